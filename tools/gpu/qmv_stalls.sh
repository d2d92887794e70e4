#!/usr/bin/env bash
# On the lent H200, after a build: where the 4-bit GEMV's warps wait. tools/gpu/qmv_variants.py's
# launches (QMV_SHAPES / QMV_VARIANTS pick them) under Nsight Compute with the warp-state, scheduler,
# memory-table and instruction sections, at the GPU's own clocks; per kernel its time, issue activity, the six
# largest stall reasons (cycles a warp spends stalled per issued instruction) and the L1's request,
# sector and shared-memory wavefront counts.
#   export OUT; QMV_SHAPES=in_proj QMV_VARIANTS=in_proj:imma:0:0:1 bash tools/gpu/qmv_stalls.sh
set -uo pipefail
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}  # ncu tells kernels apart by name (ours: vc_kernel)
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout -s INT "${NCU_LIMIT:-200}" "$NCU" --clock-control none -k "regex:vc_probe|qmv" \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section InstructionStats \
  --csv --page raw --print-units base python3 tools/gpu/qmv_variants.py > "$OUT/qmv_stalls.csv" 2> "$OUT/qmv_stalls.err"
python3 - "$OUT/qmv_stalls.csv" <<'PY'
import csv
import re
import sys


def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


rows = list(csv.DictReader(line for line in open(sys.argv[1]) if line.startswith('"')))
if not rows:
    sys.exit(f"qmv_stalls: no kernels profiled (see {sys.argv[1][:-4]}.err)")
seen = set()
for r in rows:
    us = num(r.get("gpu__time_duration.sum", ""))
    if us is None:
        continue  # the units row
    name = r["Kernel Name"].split("(")[0].replace("custom_kernel_", "")[:90]
    if name in seen:
        continue  # each launch shape once (the probe launches each twice)
    seen.add(name)
    stalls = {}
    for col, v in r.items():
        m = re.match(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active", col or "")
        if m and num(v) is not None:
            stalls[m.group(1)] = num(v)
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
    issue = next((num(v) for c, v in r.items() if c == "smsp__issue_active.avg.pct_of_peak_sustained_active"), None)
    mem = {c.split("__", 1)[1][:60]: num(v) for c, v in r.items()
           if c and c.startswith("l1tex__") and ("wavefronts" in c or "requests" in c or "sectors_pipe_lsu" in c
                                                 or "bank_conflicts" in c) and c.endswith(".sum") and num(v)}
    inst = next((num(v) for c, v in r.items() if c in ("smsp__inst_executed.sum", "sm__inst_executed.sum")), None)
    warps = num(r.get("smsp__warps_active.avg.per_cycle_active", "") or "")
    print(f"{us / 1e3:7.2f} us issue {issue if issue is not None else '?'}% warp instructions "
          f"{inst / 1e6 if inst else 0:.2f} M, warps a scheduler {warps} {name}")
    print("   stalls: " + (", ".join(f"{k} {v:.2f}" for k, v in top) or
                           "none matched; columns: " + ", ".join(c for c in r if c and "stalled" in c)[:600]))
    print("   l1: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(mem.items())[:12]))
PY
