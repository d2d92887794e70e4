#!/usr/bin/env bash
# On the lent H200, after a build into /tmp/site2 (session.sh PARTS=none, or ab_trees.sh): our own
# kernel launch (VOICECHAT_OWN_LAUNCH=1, csrc/own_launch.h) against MLX's custom kernels.
#   1. tests/test_own_launch.py (the GEMV layouts through both paths, the cubin cache read back);
#   2. the compiled LLM chain (tools/gpu/host_loop.py, 900 steps: short of the 1024 slots whose split
#      attention would compile mid-chain) in fresh processes: MLX's path, ours with
#      an empty cubin folder, ours again from the folder: each one's warm-up (its compiles) and its
#      steady chain (ms a step: the host time a launch);
#   3. TESTS (default tests/test_session.py) with the own launch on (SESSION_LIMIT=0 skips it).
# Every log in $OUT.
#   export OUT; bash tools/gpu/own_launch_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site2:/tmp/site} VOICECHAT_TEST_WAVS=${VOICECHAT_TEST_WAVS:-$PWD/.gpuwav} \
  PYTHONUNBUFFERED=1 VOICECHAT_CUBIN_DIR=/tmp/own-cubin
rm -rf /tmp/own-cubin
python3 -c "import voicechat.kernels as k; print(k.build_info())" | tee "$OUT/own_build_info.txt"
timeout -s INT "${TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_own_launch.py \
  >"$OUT/own_tests.log" 2>&1
echo "test_own_launch: $(tail -n 1 "$OUT/own_tests.log")"
rm -rf /tmp/own-cubin
for arm in mlx own own_cached; do
  own=1; [ "$arm" = mlx ] && own=0
  (cd benchmarks && VOICECHAT_OWN_LAUNCH=$own timeout "${LOOP_LIMIT:-200}" python3 ../tools/gpu/host_loop.py \
     --steps "${STEPS:-900}") >"$OUT/own_loop_$arm.log" 2>&1
  echo "$arm: $(tr '\n' ';' <"$OUT/own_loop_$arm.log" | tail -c 300)"
done
echo "cubins: $(ls /tmp/own-cubin 2>/dev/null | wc -l)"
[ "${SESSION_LIMIT:-300}" = 0 ] && exit 0  # 0: the session tests left for another call
VOICECHAT_OWN_LAUNCH=1 timeout -s INT "${SESSION_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE \
  ${TESTS:-tests/test_session.py} -k "not other_formats_and_stereo and not stereo_other_rate" \
  >"$OUT/own_session.log" 2>&1
echo "with the own launch, ${TESTS:-tests/test_session.py}: $(tail -n 1 "$OUT/own_session.log")"
