#!/usr/bin/env bash
# On the lent H200, after test.sh's build: Nsight Compute's view of the 4-bit GEMV (ours and MLX's)
# at the LLM's biggest shapes: DRAM throughput, issue activity, occupancy and warp stall reasons,
# the facts a kernel rewrite needs (bench_gemv only gives the time). Writes $OUT/gemv.ncu-rep, the
# details page and the raw metrics (CSV), and prints the main lines.
#   export OUT; bash tools/gpu/gemv_ncu.sh
set -uo pipefail
# Nsight Compute tells kernels apart by name: through MLX's launch (ours names every one vc_kernel)
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
cat > /tmp/gemv_probe.py <<'PY'
import sys
import mlx.core as mx
sys.path.insert(0, "benchmarks")
from bench_gemv import random_q4
from voicechat.kernels.gemv import quantized_matvec

for n, k in ((22656, 4480), (4480, 10240), (4480, 15680)):
    w, s, b = random_q4(n, k, 0)
    for dtype in (mx.bfloat16, mx.float32):
        x = mx.random.normal((1, k)).astype(dtype)
        for _ in range(2):
            mx.eval(quantized_matvec(x, w, s, b))
            mx.eval(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))
PY
timeout -s INT "${NCU_LIMIT:-240}" "$NCU" --target-processes all -k "regex:qmv|affine_qmv|gemv" --launch-skip 0 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis -f -o "$OUT/gemv" python3 /tmp/gemv_probe.py \
  > "$OUT/ncu.log" 2>&1
tail -5 "$OUT/ncu.log"
"$NCU" --import "$OUT/gemv.ncu-rep" --page details > "$OUT/gemv_details.txt" 2>&1
"$NCU" --import "$OUT/gemv.ncu-rep" --page raw --csv > "$OUT/gemv_raw.csv" 2>&1
grep -E "^  [a-z_]*qmv|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per" "$OUT/gemv_details.txt" | head -120
