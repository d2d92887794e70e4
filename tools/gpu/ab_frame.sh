#!/usr/bin/env bash
# On the lent H200, after tools/gpu/ab_trees.sh built the working tree into /tmp/site2 and the old
# one (.abold) into /tmp/siteA: the end-to-end frame (bench_e2e, full size, one input length) in
# alternating processes, new / old / new / old ... (ROUNDS pairs, default 1). WARM=1 (the default)
# first runs both trees once at once, untimed, so that each tree's kernels are compiled (our cubin
# folder keeps them) before the timed processes. Every result in $OUT/frame_<arm><i>.json and one
# "arm i: ms a frame, timeline ms a frame" line each.
#   export OUT; ROUNDS=1 VOICECHAT_BENCH_SECONDS=5 bash tools/gpu/ab_frame.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 VOICECHAT_BENCH_SIZE=full VOICECHAT_BENCH_SECONDS=${VOICECHAT_BENCH_SECONDS:-5}
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab}
# frame SITE LIMIT JSON: one bench_e2e process on the tree installed in SITE
frame() {
  PYTHONPATH=$1:/tmp/site timeout -s INT -k 15 "$2" python3 -m pytest -q -p no:cacheprovider benchmarks/bench_e2e.py \
    --benchmark-enable --benchmark-json="$3" --benchmark-columns=min,median,rounds
}
if [ "${WARM:-1}" = 1 ]; then
  frame /tmp/site2 "${WARM_LIMIT:-200}" "$OUT/frame_warm_new.json" >/dev/null 2>&1 &
  frame /tmp/siteA "${WARM_LIMIT:-200}" "$OUT/frame_warm_old.json" >/dev/null 2>&1 &
  wait
fi
for i in $(seq 1 "${ROUNDS:-1}"); do
  for arm in new old; do
    site=/tmp/site2; [ "$arm" = old ] && site=/tmp/siteA
    frame "$site" "${FRAME_LIMIT:-150}" "$OUT/frame_$arm$i.json" >"$OUT/frame_$arm$i.log" 2>&1
    echo "$arm $i: $(python3 -c "import json,sys; b=json.load(open(sys.argv[1]))['benchmarks'][0]['extra_info']; \
print(round(b['ms_per_frame'], 2), 'ms a frame, timeline', round(b['timeline_ms_per_frame'], 2))" \
      "$OUT/frame_$arm$i.json" 2>/dev/null || echo "no result (see $OUT/frame_$arm$i.log)")"
  done
done
