#!/usr/bin/env bash
# On the lent H200, after a build (tools/gpu/session.sh with PARTS=none): out_proj's time by rounds of
# its launch. Nsight Compute of the step's out_proj instance and of its walk's loads alone (tmaprobe)
# at K = 10240 and N = 2112 r (r = 1-4 whole rounds of the launch's 264 blocks of 8-row tiles) and at
# out_proj's own 4480 rows (2.12 rounds), one run a shape (qmv_variants.sh; its ROUND_SHAPES); then
# out_proj_rounds.py's line through the whole rounds (a round's cost, the launch's beyond them) and
# what the 4480 rows' late third round costs against it; last, the timelines of 4224 and 4480 rows.
#   export OUT; bash tools/gpu/out_proj_rounds.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
AUX=/tmp/aux/rounds
mkdir -p "$OUT"
for n in 2112 4224 4480 6336 8448; do
  shape=out_proj_n$n
  mkdir -p "$AUX/$shape"
  echo "== $shape"
  OUT=$AUX/$shape QMV_SHAPES=$shape QMV_VARIANTS=$shape:tmaprobe:8:320:2 NCU_KERNELS="regex:vc_probe_tma|qmv_stream" \
    NCU_LIMIT=${NCU_LIMIT:-90} bash tools/gpu/qmv_variants.sh 2>&1 | cut -c1-160
  cp "$AUX/$shape/qmv_variants.csv" "$OUT/rounds_$shape.csv" 2>/dev/null
done
python3 tools/gpu/out_proj_rounds.py "$AUX" | tee "$OUT/rounds.txt"
QMV_TIMELINE=out_proj_n4224:tma:8:320:2,out_proj_n4480:tma:8:320:2 bash tools/gpu/timeline.sh 2>&1 |
  tee "$OUT/rounds_timeline.txt"
