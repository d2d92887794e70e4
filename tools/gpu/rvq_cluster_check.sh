#!/usr/bin/env bash
# On a lent H100 / H200, one call (after the `.gw1` wheel copy; carry .gw2 and .gpuwav): the GPU test
# suite with the cluster RVQ as "auto"'s default (a kernel of clusters a child graph in MLX's graph
# since c0a7112), in eight parallel groups (tests_parallel.sh): the kernels and our launch, the CUDA
# sources, the TTS, the session (three), the CLI, the rest (the CPU emulation left out). Logs in
# $OUT/tests_<i>.log. BUILT=1 reuses the last call's build; CHECK_TESTS=0 skips the suite. With
# OLD_LAUNCH=<a copy of csrc/own_launch.cpp from before c0a7112> (carried), it then builds that launch
# into /tmp/site_old and runs test_rvq_kernel with it: it failed 16 cases there (VOICECHAT_RVQ_CLUSTER=1, H100).
#   export OUT; [BUILT=1 CHECK_TESTS=0] [OLD_LAUNCH=.dbg/own_launch_old.cpp] bash tools/gpu/rvq_cluster_check.sh
. tools/gpu/built_tree.sh
if [ "${CHECK_TESTS:-1}" = 1 ]; then
  echo "== GPU tests, the cluster RVQ by default"
  own="tests/test_rvq_kernel.py tests/test_own_launch.py"
  sources="tests/test_cuda_sources.py tests/test_kernel_sass.py"
  tts="tests/test_tts.py tests/test_tts_backbone.py tests/test_mog_sample.py tests/test_code_embedding.py"
  session=tests/test_session.py cli=tests/test_cli.py
  rest="tests"
  for f in $own $sources $tts $session $cli tests/test_gemv_cuda_emulated.py; do rest="$rest --ignore=$f"; done
  # test_session in three processes: one ran 10 of its 21 tests in 190 s on a fresh H100 (cold NVRTC
  # compiles). The rest takes longest: 270 s stopped it in test_gemv (307 passed). The lent machine
  # has no sox: its two stereo / other-rate cases are left out.
  worker_half="tts_worker or evaluated or failing"  # the TTS worker's tests in two halves
  LIMIT=${TEST_LIMIT:-420} bash tools/gpu/tests_parallel.sh "$own --timeout=150" "$sources --timeout=150" \
    "$tts --timeout=150" "$session --timeout=250 -k 'not (tts or thread or evaluated)'" \
    "$session --timeout=250 -k '$worker_half'" "$session --timeout=250 -k '(tts or thread) and not ($worker_half)'" \
    "$cli --timeout=250 -k 'not stereo_other_rate'" "$rest --timeout=150 -k 'not other_formats_and_stereo'"
  date +%T
fi
if [ -n "${OLD_LAUNCH:-}" ]; then
  cp csrc/own_launch.cpp /tmp/own_launch_new.cpp && cp "$OLD_LAUNCH" csrc/own_launch.cpp
  rm -rf /tmp/site_old
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site_old . \
    >/tmp/aux/build_old.log 2>&1 || tail -20 /tmp/aux/build_old.log
  cp /tmp/own_launch_new.cpp csrc/own_launch.cpp
  echo "== test_rvq_kernel with the launch from before c0a7112 (failed 16 cases on the H100)"
  PYTHONPATH=/tmp/site_old:/tmp/site timeout -s INT -k 10 "${OLD_LIMIT:-120}" python3 -m pytest -q \
    -p no:cacheprovider --timeout=60 tests/test_rvq_kernel.py 2>&1 | tee "$OUT/old_launch.log" \
    | grep -E "^FAILED|passed|failed" | tail -8
  date +%T
fi
