#!/usr/bin/env bash
# On the lent H200, one call (after the `.gw1` wheel copy; carry .gw2 and .gpuwav): an A/B of a
# kernel header define's default (DEFINE, default VC_ROW_GROUPS: vc_qmv_stream's row groups; any
# `#ifndef NAME / #define NAME v` of csrc/gemv_cuda.h, e.g. VC_RAMP, VC_TILE_FIRST, VC_START_ITEMS).
# Builds, for each value v of VALUES (default "1 -1 2"), a copy of the working tree whose default is
# v into /tmp/site_v$v, all at once; then Nsight Compute of the step's instance at QMV_SHAPES (default
# out_proj; its default launch's grid GRID, default 264x320) under each copy in ROUNDS alternating
# rounds; with TIMELINE=1 first the timelines of out_proj's default launch with each value by define
# (under the first copy); then test_gemv's cases TESTS_K under each copy but the first.
#   export OUT; DEFINE=VC_ROW_GROUPS VALUES="2 1" bash tools/gpu/define_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
AUX=/tmp/aux
mkdir -p "$OUT" "$AUX"
DEFINE=${DEFINE:-VC_ROW_GROUPS}
VALUES=${VALUES:-1 -1 2}
grep -q "^#define $DEFINE " csrc/gemv_cuda.h || { echo "csrc/gemv_cuda.h has no #define $DEFINE"; exit 1; }
date +%T
bash .gw2/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
for v in $VALUES; do
  tree=/tmp/tree_v$v
  rm -rf "$tree" && mkdir -p "$tree" && git ls-files -z | xargs -0 -I{} cp --parents {} "$tree/"
  cp csrc/gemv_cuda.h "$tree/csrc/"  # with the working tree's changes
  sed -i "s|^#define $DEFINE .*\$|#define $DEFINE $v|" "$tree/csrc/gemv_cuda.h"
  (cd "$tree" && python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/site_v$v" . \
    >"$AUX/build_v$v.log" 2>&1; echo "$DEFINE $v: build rc $?") &
done
wait
date +%T
export VOICECHAT_TEST_WAVS=$PWD/.gpuwav MLX_PTX_CACHE_DIR=/tmp/ptx-ab PYTHONUNBUFFERED=1
first=${VALUES%% *}
if [ "${TIMELINE:-0}" = 1 ]; then
  O=out_proj:tma:8:320:2
  variants=$(for v in $VALUES; do printf "%s," "$O:$DEFINE=$v"; done)
  GEMV_PYTHONPATH=/tmp/site_v$first:/tmp/site OUT=$AUX TL_LIMIT=${TL_LIMIT:-150} QMV_TIMELINE="${variants%,}" \
    bash tools/gpu/timeline.sh 2>&1 | cut -c1-220 | tee "$OUT/timeline.txt"
  cp "$AUX/timeline.log" "$OUT/timeline.log"
fi
echo "== ncu, alternating trees"
for round in $(seq "${ROUNDS:-3}"); do
  for v in $VALUES; do
    GEMV_PYTHONPATH=/tmp/site_v$v:/tmp/site OUT=$AUX QMV_SHAPES=${QMV_SHAPES:-out_proj} NCU_KERNELS="regex:qmv_stream_emit" \
      NCU_LIMIT=${NCU_LIMIT:-90} bash tools/gpu/qmv_variants.sh 2>&1 | grep " us \|rror\|refused" \
      | grep "${GRID:-264x320}\|rror\|refused" | head -1 | sed "s/^/$DEFINE $v round $round: /" | cut -c1-150 \
      | tee -a "$OUT/ncu.txt"
  done
done
date +%T
for v in ${VALUES#* }; do
  echo "== tests, $DEFINE $v"
  PYTHONPATH=/tmp/site_v$v:/tmp/site timeout -s INT -k 10 "${TEST_LIMIT:-100}" python3 -m pytest -q -p no:cacheprovider -rfE \
    --timeout=90 tests/test_gemv.py -k "${TESTS_K:-default_layout or emitted_norm or group_prenormed}" 2>&1 | tail -3 \
    | tee -a "$OUT/tests.log"
done
date +%T
