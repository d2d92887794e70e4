#!/usr/bin/env bash
# On the lent H200, one call (after the `.gw1` wheel copy; carry .gw2 and .gpuwav): the streamed
# out_proj with warp groups (640 threads, one block an SM, each group of 10 warps on half of every
# tile's rows: 8:640:3 and 8:640:4) against the default 8:320:2. Builds the working tree
# (session.sh, PARTS=none), then timelines (each variant's bits checked against the extension's) and
# Nsight Compute with the last round whole (VOICECHAT_QMV_SPLIT=1), the same with the last round cut
# into parts (auto: one block an SM), and test_gemv's warp-group cases. Each part's output in $OUT.
# 8:640:4 with parts needs 119 registers under nvcc, more than 640 threads allow: our launch refuses
# it with the numbers (docs/developing.md, the thirty-fifth session), and MLX's launch (the ncu and
# timeline tools') would leave its output unwritten. Asking for one item at the start (the probe
# define VC_START_ITEMS=1, 96 registers) fits it: the timeline with parts runs that instead, and ncu
# with parts runs 8:640:3 alone (qmv_variants.sh cannot pass defines).
#   export OUT; bash tools/gpu/warp_groups.sh
. tools/gpu/built_tree.sh
O=out_proj:tma
W="$O:8:640:3,$O:8:640:4"
echo "== timeline, last round whole"
VOICECHAT_QMV_SPLIT=1 OUT=$AUX TL_LIMIT=120 QMV_TIMELINE="$O:8:320:2,$W,$O:8:320:2,$W" bash tools/gpu/timeline.sh 2>&1 \
  | cut -c1-220 | tee "$OUT/timeline_whole.txt"
cp "$AUX/timeline.log" "$OUT/timeline_whole.log"
date +%T
echo "== ncu, last round whole"
VOICECHAT_QMV_SPLIT=1 GEMV_PYTHONPATH=$PYTHONPATH OUT=$AUX QMV_SHAPES=out_proj QMV_VARIANTS="$W" \
  NCU_KERNELS="regex:qmv_stream_emit" NCU_LIMIT=120 bash tools/gpu/qmv_variants.sh 2>&1 \
  | grep " us \|rror\|refused" | cut -c1-200 | tee "$OUT/ncu_whole.txt"
tail -3 "$AUX/qmv_variants.err"
date +%T
echo "== timeline, last round in parts"
OUT=$AUX TL_LIMIT=100 QMV_TIMELINE="$O:8:640:3,$O:8:640:4:VC_START_ITEMS=1" bash tools/gpu/timeline.sh 2>&1 | cut -c1-220 | tee "$OUT/timeline_split.txt"
cp "$AUX/timeline.log" "$OUT/timeline_split.log"
date +%T
echo "== ncu, last round in parts"
GEMV_PYTHONPATH=$PYTHONPATH OUT=$AUX QMV_SHAPES=out_proj QMV_VARIANTS="$O:8:640:3" NCU_KERNELS="regex:qmv_stream_emit" \
  NCU_LIMIT=100 bash tools/gpu/qmv_variants.sh 2>&1 | grep " us \|rror\|refused" | cut -c1-200 | tee "$OUT/ncu_split.txt"
tail -3 "$AUX/qmv_variants.err"
date +%T
echo "== tests"
timeout -s INT -k 10 150 python3 -m pytest -q -p no:cacheprovider -rfE --timeout=120 tests/test_gemv.py -k "warp_groups" \
  2>&1 | tail -4 | tee "$OUT/tests.log"
date +%T
