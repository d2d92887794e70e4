#!/usr/bin/env bash
# On the lent H200, after a build (tools/gpu/session.sh with PARTS=none): tools/gpu/qmv_timeline.py's
# warp-by-warp timelines of the streamed 4-bit kernels, the whole log in $OUT/timeline.log and a short
# form (the rounds past the first and the last left out) on stdout.
#   export OUT; QMV_TIMELINE="down_proj:tma:8:512:2:XS=0,down_proj:tma:8:512:2" bash tools/gpu/timeline.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab}
timeout -s INT "${TL_LIMIT:-200}" python3 tools/gpu/qmv_timeline.py > "$OUT/timeline.log" 2>&1
echo "qmv_timeline rc $?"
grep -iE "differ|refused|error|Traceback" "$OUT/timeline.log" | head -5
echo "bit-equal to the extension: $(grep -c "bit-equal" "$OUT/timeline.log")"
python3 - "$OUT/timeline.log" <<'PY'
import sys

lines = [l.rstrip() for l in open(sys.argv[1]) if not l.endswith("the extension's\n")]
for i, line in enumerate(lines):
    nxt = lines[i + 1] if i + 1 < len(lines) else ""
    # a variant's header, its start line, its first round and its last round
    if not line.startswith("  round") or line.startswith("  round 0") or not nxt.startswith("  round"):
        print(line[:220])
PY
