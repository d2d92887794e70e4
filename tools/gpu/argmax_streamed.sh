#!/usr/bin/env bash
# On the lent H200, after a build (tools/gpu/session.sh with PARTS=none): the two-head argmax in the
# block layout against both heads on the streamed integer-MMA walk (two_head_argmax's streamed; the
# default since the forty-third session, VOICECHAT_ARGMAX_STREAMED=0 the block layout). Their kernels under Nsight
# Compute (argmax_streamed.py: f32 and bf16 x, one row, the published heads' shape; ids compared), then
# bench_gemv's argmax rows against MLX's two quantized_matmul + argmax, then test_gemv's two-head
# cases (both layouts). BENCH_ONLY (default argmax) widens bench_gemv's groups: q4,argmax is issue 7's report.
#   export OUT; bash tools/gpu/argmax_streamed.sh
set -uo pipefail
# Nsight Compute tells kernels apart by name: through MLX's launch (ours names every one vc_kernel)
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1 VOICECHAT_TEST_WAVS=$PWD/.gpuwav
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout -s INT "${NCU_LIMIT:-150}" "$NCU" --clock-control none --cache-control all -k regex:argmax \
  --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,dram__bytes_read.sum \
  --csv --page raw --print-units base python3 tools/gpu/argmax_streamed.py \
  > "$OUT/argmax_ncu.csv" 2> "$OUT/argmax_ncu.err"
grep -v '^"' "$OUT/argmax_ncu.csv" | grep -E "ids" | head -4
python3 - "$OUT/argmax_ncu.csv" <<'PY'
import csv
import sys

HEADS_BYTES = 2 * 131072 * 4480 * 0.5625  # both heads' weights, bf16 scales and biases
rows = [r for r in csv.DictReader(line for line in open(sys.argv[1]) if line.startswith('"'))]
for r in rows:
    try:
        us = float(r["gpu__time_duration.sum"].replace(",", "")) / 1e3
    except ValueError:
        continue  # the units row
    name = r["Kernel Name"].split("(")[0].replace("custom_kernel_", "")[:40]
    rate = f"{HEADS_BYTES / us / 1e6:5.2f} TB/s" if "finish" not in name else ""
    regs, grid = r["launch__registers_per_thread"], r["launch__grid_size"]
    print(f"{us:8.2f} us {rate:>10} regs {regs:>3} grid {grid:>6} {name}")
PY
echo "== bench_gemv ${BENCH_ONLY:=argmax}"
timeout "${BENCH_LIMIT:-150}" python3 benchmarks/bench_gemv.py --size full --only "$BENCH_ONLY" \
  --json "$OUT/argmax_bench.json" > "$OUT/argmax_bench.txt" 2>&1
tail -"${BENCH_TAIL:-7}" "$OUT/argmax_bench.txt"
echo "== test_gemv two-head cases"
timeout -s INT "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gemv.py -k two_head 2>&1 |
  tee "$OUT/argmax_tests.log" | tail -4
