#!/usr/bin/env bash
# On the lent H200, one call (after the `.gw1` wheel copy; carry .gw2 and .gpuwav): the streamed 4-bit
# matvec with each tile's rows in groups, a bulk copy and an mbarrier each, the product waiting for
# each group as it gets to its rows (the define VC_ROW_GROUPS, csrc/gemv_cuda.h), against a whole-tile
# wait. Builds the working tree into /tmp/site2 and, for each value v of RG_VALUES (default "1 -1 2"),
# a copy of it whose VC_ROW_GROUPS default is v into /tmp/site_rg$v, all at once; then Nsight Compute
# of the step's out_proj (QMV_SHAPES) under each copy in ROUNDS alternating rounds, and with TIMELINE=1
# the timelines of each value by define, and test_gemv's streamed cases under each copy but the first.
#   export OUT; bash tools/gpu/row_groups.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
AUX=/tmp/aux
mkdir -p "$OUT" "$AUX"
RG_VALUES=${RG_VALUES:-1 -1 2}
date +%T
bash .gw2/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
for v in $RG_VALUES; do
  rm -rf "/tmp/tree_rg$v" && mkdir -p "/tmp/tree_rg$v" && git ls-files -z | xargs -0 -I{} cp --parents {} "/tmp/tree_rg$v/"
  cp csrc/gemv_cuda.h "/tmp/tree_rg$v/csrc/"  # with the working tree's changes
  sed -i "s|^#define VC_ROW_GROUPS .*\$|#define VC_ROW_GROUPS $v|" "/tmp/tree_rg$v/csrc/gemv_cuda.h"
  (cd "/tmp/tree_rg$v" && python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/site_rg$v" . \
    >"$AUX/build_rg$v.log" 2>&1; echo "VC_ROW_GROUPS $v: build rc $?") &
done
wait
date +%T
export VOICECHAT_TEST_WAVS=$PWD/.gpuwav MLX_PTX_CACHE_DIR=/tmp/ptx-ab PYTHONUNBUFFERED=1
first=${RG_VALUES%% *}
if [ "${TIMELINE:-0}" = 1 ]; then
  O=out_proj:tma:8:320:2
  variants=$(for v in $RG_VALUES; do printf "%s," "$O:VC_ROW_GROUPS=$v"; done)
  GEMV_PYTHONPATH=/tmp/site_rg$first:/tmp/site OUT=$AUX TL_LIMIT=${TL_LIMIT:-150} QMV_TIMELINE="${variants%,}" \
    bash tools/gpu/timeline.sh 2>&1 | cut -c1-220 | tee "$OUT/timeline.txt"
  cp "$AUX/timeline.log" "$OUT/timeline.log"
fi
echo "== ncu, alternating trees"
for round in $(seq "${ROUNDS:-3}"); do
  for v in $RG_VALUES; do
    GEMV_PYTHONPATH=/tmp/site_rg$v:/tmp/site OUT=$AUX QMV_SHAPES=${QMV_SHAPES:-out_proj} NCU_KERNELS="regex:qmv_stream_emit" \
      NCU_LIMIT=${NCU_LIMIT:-90} bash tools/gpu/qmv_variants.sh 2>&1 | grep " us \|rror\|refused" | grep "264x320\|rror\|refused" \
      | head -1 | sed "s/^/rg $v round $round: /" | cut -c1-150 | tee -a "$OUT/ncu.txt"
  done
done
date +%T
for v in ${RG_VALUES#* }; do
  echo "== tests, VC_ROW_GROUPS $v"
  PYTHONPATH=/tmp/site_rg$v:/tmp/site timeout -s INT -k 10 "${TEST_LIMIT:-100}" python3 -m pytest -q -p no:cacheprovider -rfE \
    --timeout=90 tests/test_gemv.py -k "${TESTS_K:-default_layout or emitted_norm or group_prenormed}" 2>&1 | tail -3 \
    | tee -a "$OUT/tests.log"
done
date +%T
