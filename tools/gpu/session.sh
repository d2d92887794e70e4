#!/usr/bin/env bash
# The first full call of a device session on the lent H200 (after the `.gw1` call, carrying
# `.gw2 .whl .gpuwav`; see docs/developing.md): install the wheels, build, then in one call
# the LLM step's kernels under Nsight Compute, the GPU tests named in TESTS, the GEMVs back to back,
# the LLM step and mlx-lm's on the same machine, and one end-to-end length. Each part has its own
# limit so that a slow one cannot starve the rest (~9 minutes in all, inside one call's 10);
# every log lands in $OUT.
#   export OUT; TESTS="tests/test_mamba_scan.py" bash tools/gpu/session.sh
# PARTS (default "ncu tests isolation step ref e2e") picks the parts; NCU_DETAIL passes through to
# step_ncu.sh. Three more parts, not in the default: "variants" (qmv_variants.sh: the 4-bit GEMV's
# launch shapes and the loads-only probe's parts under ncu), "stalls" (qmv_stalls.sh: where those
# kernels' warps wait) and "source" (qmv_source.sh: the same by SASS instruction); QMV_SHAPES /
# QMV_VARIANTS / QMV_LAUNCHES pass through to all three. TESTS holds test paths or node ids (split
# on spaces); TESTS_K, a pytest -k expression added to the run's own.
set -uo pipefail
PARTS=" ${PARTS:-ncu tests isolation step ref e2e} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
OUT=${OUT:-/tmp/out}
bash .gw2/install.sh >/dev/null 2>&1
PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site2 . \
  >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
[ -d .whl ] && PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
export PYTHONPATH=/tmp/site2:/tmp/site VOICECHAT_TEST_WAVS=$PWD/.gpuwav MLX_PTX_CACHE_DIR=/tmp/ptx-ab \
  PYTHONUNBUFFERED=1
part stalls && echo "== 4-bit GEMV stall reasons" && NCU_LIMIT=${STALLS_LIMIT:-150} bash tools/gpu/qmv_stalls.sh 2>&1 | tail -80
part source && echo "== 4-bit GEMV stalls by instruction" && NCU_LIMIT=${SOURCE_LIMIT:-200} bash tools/gpu/qmv_source.sh 2>&1 | tail -30
part variants && echo "== 4-bit GEMV variants" && NCU_LIMIT=${VARIANTS_LIMIT:-150} bash tools/gpu/qmv_variants.sh 2>&1 | tail -30
part ncu && echo "== llm step under ncu" && NCU_LIMIT=${NCU_LIMIT:-120} bash tools/gpu/step_ncu.sh 2>&1 | tail -14
if [ -n "${TESTS:-}" ] && part tests; then
  echo "== tests: $TESTS"
  timeout -s INT -k 10 "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -rfE --timeout=140 $TESTS \
    -k "not other_formats_and_stereo and not stereo_other_rate${TESTS_K:+ and ($TESTS_K)}" 2>&1 | tee "$OUT/tests.log" | tail -8
fi
part isolation && echo "== gemv back to back" &&
  timeout 60 python3 tools/gpu/gemv_isolation.py 2>&1 | tee "$OUT/isolation.log"
part step && echo "== llm step, ours" && (cd benchmarks && timeout 60 python3 profile_llm_step.py --size full --compiled-only --json "$OUT/llm.json" 2>&1 \
  | grep -E "sync_step|pipelined")
part ref && echo "== llm step, mlx-lm's" && (cd benchmarks && VOICECHAT_BENCH_SIZE=full timeout 90 python3 -m pytest -q -p no:cacheprovider \
  bench_reference_mlx_lm.py --benchmark-enable --benchmark-json="$OUT/ref.json" --benchmark-columns=min,median 2>&1 \
  | grep -E "test_mlx|passed|failed")
part e2e && echo "== end to end, ${VOICECHAT_BENCH_SECONDS:=5} s" && AB_LIMIT=${AB_LIMIT:-170} VOICECHAT_BENCH_SECONDS=$VOICECHAT_BENCH_SECONDS bash tools/gpu/ab.sh default 2>&1 | tail -2
exit 0  # the parts not picked leave their `part` test false: not a failure
