#!/usr/bin/env bash
# On the lent H200, after session.sh / ab_trees.sh built the working tree into /tmp/site2: the GPU
# test files in GROUPS parallel pytest processes (a fresh machine's tests are bound by NVRTC's cold
# compiles, one CPU core a process, not by the GPU), each cut at LIMIT seconds; a log per group in
# $OUT/tests_<i>.log and its summary line printed.
#   export OUT; LIMIT=250 bash tools/gpu/tests_parallel.sh "tests/test_gemv.py -k 'not full_size'" "tests/test_tts.py"
# Each argument is one group: test paths and pytest options, as one shell word.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${PYTHONPATH:-/tmp/site2:/tmp/site} MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab} \
  VOICECHAT_TEST_WAVS=${VOICECHAT_TEST_WAVS:-$PWD/.gpuwav} PYTHONUNBUFFERED=1
i=0
for group in "$@"; do
  i=$((i + 1))
  eval "set -- $group"  # the group's own words (a -k expression keeps its quotes)
  timeout -s INT -k 15 "${LIMIT:-250}" python3 -m pytest -q -p no:cacheprovider -rfE "$@" \
    >"$OUT/tests_$i.log" 2>&1 &
done
wait
for j in $(seq 1 "$i"); do
  echo "group $j: $(grep -E '(passed|failed|error)' "$OUT/tests_$j.log" | tail -1 || echo 'no summary (killed?)')" \
    "$(grep -E '^(FAILED|ERROR)' "$OUT/tests_$j.log" | head -5 | tr '\n' ' ')"
done
