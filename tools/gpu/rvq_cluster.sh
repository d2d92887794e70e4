#!/usr/bin/env bash
# On the lent H200, one call (after the `.gw1` wheel copy; carry .gw2 and .gpuwav): the one-launch
# RVQ of thread-block clusters (vc_rvq_cluster, "auto"'s default; VOICECHAT_RVQ_CLUSTER=0 keeps the
# chain) against the chain of a launch per codebook. Builds the working tree (built_tree.sh; BUILT=1
# reuses the last call's build), runs the GPU tests that hold it to the chain's bits (test_rvq_kernel,
# test_tts -k cluster; RVQ_TESTS=0 skips them), times the RVQ alone (rvq_timing.py), then the TTS
# frame (profile_tts_step, full size) and the 5 s end-to-end frame (bench_e2e) in alternating
# processes, chain / cluster, ROUNDS pairs (default 1; TTS_ROUNDS for the TTS frame's alone). Each
# part's output in $OUT.
#   export OUT; [BUILT=1 RVQ_TESTS=0] bash tools/gpu/rvq_cluster.sh
. tools/gpu/built_tree.sh
if [ "${RVQ_TESTS:-1}" = 1 ]; then
  echo "== tests"
  timeout -s INT -k 10 150 python3 -m pytest -q -p no:cacheprovider -rfE --timeout=120 tests/test_rvq_kernel.py \
    tests/test_tts.py -k "cluster or code_generation or rvq" 2>&1 | tail -6 | tee "$OUT/tests.log"
  date +%T
fi
echo "== the RVQ alone: a frame's five runs, chain / cluster"
timeout -s INT -k 10 "${RVQ_LIMIT:-90}" python3 tools/gpu/rvq_timing.py --json "$OUT/rvq_timing.json" 2>&1 \
  | tail -6 | tee "$OUT/rvq_timing.txt"
date +%T
for i in $(seq 1 "${TTS_ROUNDS:-${ROUNDS:-1}}"); do
  for arm in 0 1; do
    echo "== TTS frame, VOICECHAT_RVQ_CLUSTER=$arm, round $i"
    VOICECHAT_RVQ_CLUSTER=$arm timeout -s INT -k 10 "${TTS_LIMIT:-100}" python3 benchmarks/profile_tts_step.py \
      --size full --json "$OUT/tts_$arm$i.json" >"$OUT/tts_$arm$i.log" 2>&1
    grep -iE "step|generation|launch" "$OUT/tts_$arm$i.log" | head -8
  done
done
date +%T
for i in $(seq 1 "${ROUNDS:-1}"); do
  for arm in 0 1; do
    VOICECHAT_RVQ_CLUSTER=$arm VOICECHAT_BENCH_SIZE=full VOICECHAT_BENCH_SECONDS=5 timeout -s INT -k 15 \
      "${FRAME_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider benchmarks/bench_e2e.py --benchmark-enable \
      --benchmark-json="$OUT/frame_$arm$i.json" >"$OUT/frame_$arm$i.log" 2>&1
    echo "cluster=$arm $i: $(python3 -c "import json,sys; b=json.load(open(sys.argv[1]))['benchmarks'][0]['extra_info']; \
print(round(b['ms_per_frame'], 2), 'ms a frame, timeline', round(b['timeline_ms_per_frame'], 2))" \
      "$OUT/frame_$arm$i.json" 2>/dev/null || echo "no result (see $OUT/frame_$arm$i.log)")" | tee -a "$OUT/frames.txt"
  done
done
date +%T
