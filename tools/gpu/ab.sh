#!/usr/bin/env bash
# On the lent H200, after test.sh's build: the end-to-end frame (and the LLM step) under MLX-CUDA's
# graph settings, one process per arm, one warm kernel cache for all (the first arm pays the JIT).
#   bash tools/gpu/ab.sh default MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=400 VOICECHAT_BENCH_TTS_THREAD=0
# An arm is `default` or VAR=VALUE[,VAR=VALUE]. AB_LLM=1 / AB_TTS=1 also run profile_llm_step /
# profile_tts_step (without the backbone's parts) per arm: their host share against the wait.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${AB_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1 VOICECHAT_BENCH_SIZE=${VOICECHAT_BENCH_SIZE:-full}
export VOICECHAT_BENCH_SECONDS=${VOICECHAT_BENCH_SECONDS:-5}
export MLX_PTX_CACHE_DIR=/tmp/ptx-ab
for arm in "$@"; do
  settings=()
  [ "$arm" = default ] || IFS=, read -ra settings <<<"$arm"
  tag=${arm//[^A-Za-z0-9]/_}
  echo "== $arm"
  env "${settings[@]}" timeout -s INT -k 15 "${AB_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider \
    benchmarks/bench_e2e.py --benchmark-enable --benchmark-json="$OUT/e2e_$tag.json" \
    --benchmark-columns=min,median,rounds 2>&1 | grep -E "test_generate|passed|failed|Error" | tail -5
  if [ -s "$OUT/e2e_$tag.json" ]; then  # empty where the run was cut by AB_LIMIT
    python3 -c "import json,sys; b=json.load(open(sys.argv[1]))['benchmarks'][0]['extra_info']; \
print({k: round(b[k], 2) for k in ('ms_per_frame', 'timeline_ms_per_frame', 'rtf')})" "$OUT/e2e_$tag.json"
  else
    echo "$arm: no result (cut at AB_LIMIT=${AB_LIMIT:-240} s?)"
  fi
  if [ "${AB_LLM:-0}" = 1 ]; then
    (cd benchmarks && env "${settings[@]}" timeout 150 python3 profile_llm_step.py --size "$VOICECHAT_BENCH_SIZE" --compiled-only \
      --json "$OUT/llm_$tag.json" 2>&1 | tail -7)
  fi
  if [ "${AB_TTS:-0}" = 1 ]; then
    (cd benchmarks && env "${settings[@]}" timeout 150 python3 profile_tts_step.py --size "$VOICECHAT_BENCH_SIZE" \
      --no-parts --json "$OUT/tts_$tag.json" 2>&1 | tail -7)
  fi
done
