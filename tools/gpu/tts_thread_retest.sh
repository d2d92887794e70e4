#!/usr/bin/env bash
# On the lent H200, after a build into /tmp/site2: the TTS worker thread's tests (test_session.py's
# threaded ones) ROUNDS times, each round a
# fresh process, through MLX's launch (OWN_ARMS "0") and, with "0 1", our own too: does the
# segfault of 2026-12-01 (rc 139, both threads inside mx.async_eval) come back? A line a round;
# the logs in $OUT. The native frames of a crash (VOICECHAT_NATIVE_TRACE=1) go to fd 2 itself, which
# pytest captures and loses at an abort unless run with -s (twentieth session: none came back). A fresh machine's first round compiles the tiny checkpoint's kernels (~150 s).
#   export OUT; ROUNDS=3 OWN_ARMS="0 1" bash tools/gpu/tts_thread_retest.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site2:/tmp/site} VOICECHAT_TEST_WAVS=${VOICECHAT_TEST_WAVS:-$PWD/.gpuwav} \
  MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab} PYTHONUNBUFFERED=1 \
  VOICECHAT_NATIVE_TRACE=1
for i in $(seq 1 "${ROUNDS:-3}"); do
  for own in ${OWN_ARMS:-0}; do
    log="$OUT/tts_thread_own${own}_$i.log"
    VOICECHAT_OWN_LAUNCH=$own timeout -s INT "${LIMIT:-300}" python3 -m pytest -q -s -p no:cacheprovider -rfE \
      tests/test_session.py -k "tts_thread or own_thread" >"$log" 2>&1
    echo "round $i, own launch $own: rc $? $(tail -n 1 "$log")"
    # test_cli's same-seed WAVs with the worker on (twenty-first session: they differed once)
    VOICECHAT_TTS_THREAD=1 VOICECHAT_OWN_LAUNCH=$own timeout -s INT "${LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider \
      -rfE tests/test_cli.py -k "byte_identical" >>"$log" 2>&1
    echo "round $i, own launch $own, same-seed WAVs threaded: rc $? $(tail -n 1 "$log")"
  done
done
