#!/usr/bin/env bash
# On the lent H200, after a build: which instructions of the 4-bit GEMV's kernels the warps stall
# on. tools/gpu/qmv_variants.py's launches (QMV_SHAPES / QMV_VARIANTS pick them) under Nsight
# Compute's warp-state sampling (SourceCounters), at the GPU's own clocks; the per-SASS-instruction
# page of each kernel lands in $OUT/qmv_source.csv (the report itself in $OUT/qmv_source.ncu-rep).
#   export OUT; QMV_SHAPES=in_proj QMV_VARIANTS=in_proj:tma:8:160:3 bash tools/gpu/qmv_source.sh
set -uo pipefail
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}  # ncu tells kernels apart by name (ours: vc_kernel)
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout -s INT "${NCU_LIMIT:-200}" "$NCU" --clock-control none -k "regex:qmv" --import-source no \
  --section SourceCounters --section WarpStateStats -f -o "$OUT/qmv_source" python3 tools/gpu/qmv_variants.py \
  > "$OUT/qmv_source.log" 2>&1
"$NCU" -i "$OUT/qmv_source.ncu-rep" --page source --print-source sass --csv > "$OUT/qmv_source.csv" 2>> "$OUT/qmv_source.log"
echo "qmv_source: $(wc -l < "$OUT/qmv_source.csv") lines in $OUT/qmv_source.csv"
[ -s "$OUT/qmv_source.csv" ] || "$NCU" --help | grep -i -A4 "page\|print-source" | head -40
head -c 3000 "$OUT/qmv_source.csv"
