#!/usr/bin/env bash
# On a lent H100 / H200, one call (after the `.gw1` wheel copy; carry .gw2 and .gpuwav): whether the
# cluster RVQ and the kernels around it stay right now that a kernel of clusters is a child graph in
# MLX's graph (c0a7112). Builds the working tree, runs the cluster-opted-in GPU tests and the RVQ
# timing; with OLD_LAUNCH=<a copy of csrc/own_launch.cpp from before c0a7112> (carried), rebuilds with
# it and runs test_rvq_kernel there (its "cluster" cases among the others), where it failed 16 cases. Logs in $OUT.
#   export OUT; [OLD_LAUNCH=.dbg/own_launch_old.cpp] bash tools/gpu/rvq_cluster_check.sh
. tools/gpu/built_tree.sh
echo "== tests, VOICECHAT_RVQ_CLUSTER=1"
VOICECHAT_RVQ_CLUSTER=1 timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_rvq_kernel.py \
  tests/test_own_launch.py tests/test_tts.py -k "cluster or code_generation or rvq or same_seed or launch" 2>&1 \
  | tee "$OUT/tests.log" | grep -E "^FAILED|passed|failed" | tail -14
date +%T
echo "== the RVQ alone"
timeout -s INT 60 python3 tools/gpu/rvq_timing.py --json "$OUT/rvq_timing.json" 2>&1 | tail -6
if [ -n "${OLD_LAUNCH:-}" ]; then
  cp csrc/own_launch.cpp /tmp/own_launch_new.cpp && cp "$OLD_LAUNCH" csrc/own_launch.cpp
  rm -rf /tmp/site2
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site2 . \
    >/tmp/aux/build_old.log 2>&1 || tail -20 /tmp/aux/build_old.log
  echo "== test_rvq_kernel with the old launch (failed 16 cases on the H100)"
  timeout -s INT 120 python3 -m pytest -q -p no:cacheprovider tests/test_rvq_kernel.py 2>&1 \
    | grep -E "^FAILED|passed|failed" | tail -6
  cp /tmp/own_launch_new.cpp csrc/own_launch.cpp
fi
date +%T
