#!/usr/bin/env bash
# On the lent H200, after a build: Nsight Compute's detailed sections (speed of light, occupancy,
# scheduler and warp-state statistics, memory workload) for the step's 4-bit GEMV instances at the
# launches in QMV_LAUNCHES (see qmv_step_probe.py), kernels whose name matches FILTER. Writes the
# report as text to $OUT/qmv_detail_TAG.txt and prints the lines that say where the time goes.
#   export OUT; QMV_CASES=out_proj QMV_LAUNCHES="8,0,2,0" bash tools/gpu/qmv_detail.sh [tag]
set -uo pipefail
# Nsight Compute tells kernels apart by name: through MLX's launch (ours names every one vc_kernel)
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}
OUT=${OUT:-/tmp/out}
TAG=${1:-detail}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout -s INT "${NCU_LIMIT:-150}" "$NCU" --target-processes all -k "regex:${FILTER:-vc_qmv}" -c "${NCU_COUNT:-8}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  python3 tools/gpu/qmv_step_probe.py > "$OUT/qmv_detail_$TAG.txt" 2> "$OUT/qmv_detail_$TAG.err"
grep -E "vc_qmv|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Eligible Warps|No Eligible|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Waves Per SM|L1/TEX Hit|Mem Busy|Max Bandwidth" \
  "$OUT/qmv_detail_$TAG.txt" | sed -E 's/ +/ /g' | cut -c1-150
