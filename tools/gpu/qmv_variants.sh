#!/usr/bin/env bash
# On the lent H200, after a build: tools/gpu/qmv_variants.py under Nsight Compute at the GPU's own
# clocks (caches flushed between kernels, as the step's weights come from DRAM): per variant its
# kernel time, registers, grid, achieved occupancy and DRAM throughput. Prints one line a kernel and
# grid. NCU_CACHE=none with QMV_INPUTS_IN_L2=1: the caches as the decode step leaves them (weights
# from DRAM, x and the norm's partials from the L2; see qmv_variants.py).
# NCU_KERNELS: the kernels profiled (ncu -k; default regex:vc_probe|qmv, e.g. regex:qmv_stream).
#   export OUT; bash tools/gpu/qmv_variants.sh
set -uo pipefail
# Nsight Compute tells kernels apart by name: through MLX's launch (ours names every one vc_kernel)
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
metrics=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second
timeout -s INT "${NCU_LIMIT:-200}" "$NCU" --clock-control none --cache-control "${NCU_CACHE:-all}" -k "${NCU_KERNELS:-regex:vc_probe|qmv}" --metrics "$metrics" \
  --csv --page raw --print-units base python3 tools/gpu/qmv_variants.py > "$OUT/qmv_variants.csv" 2> "$OUT/qmv_variants.err"
python3 - "$OUT/qmv_variants.csv" <<'PY'
import csv
import sys


def num(v):
    return float(v.replace(",", ""))


rows = [r for r in csv.DictReader(line for line in open(sys.argv[1]) if line.startswith('"'))]
best = {}
for r in rows:
    try:
        us = num(r["gpu__time_duration.sum"]) / 1e3
    except ValueError:
        continue  # the units row
    name = r["Kernel Name"].split("(")[0].replace("custom_kernel_", "")
    key = (name, r["launch__grid_size"])  # the variants a blocks-an-SM field tells apart
    if key not in best or us < best[key][0]:
        best[key] = (us, r)
for (name, _), (us, r) in best.items():
    print(f"{us:7.2f} us {num(r['dram__bytes_read.sum']) / us / 1e3:6.0f} GB/s "
          f"dram {num(r['dram__throughput.avg.pct_of_peak_sustained_elapsed']):5.1f}% "
          f"occ {num(r['sm__warps_active.avg.pct_of_peak_sustained_active']):5.1f}% "
          f"regs {r['launch__registers_per_thread']:>3} grid {r['launch__grid_size']:>6}x{r['launch__block_size']:<4} "
          f"{num(r['sm__cycles_elapsed.avg.per_second']) / 1e9:4.2f} GHz {name[:100]}")
PY
