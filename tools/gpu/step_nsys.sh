#!/usr/bin/env bash
# On the lent H200, after a build: where a waited LLM decode step's time goes, from an Nsight Systems
# trace (CUDA API and every kernel of the step's graphs). Six compiled steps at full size, each from
# an idle device (synchronize, 5 ms of sleep, then build + eval), as profile_llm_step's sync_step.
# Per step: host time from the first graph launch to the end of the wait, the device's span (first
# kernel start to last kernel end), its busy time (sum of kernel durations), when the first kernel
# started after the first graph launch, the API calls that cost the host most, and the longest idle
# gaps inside the span with the kernels around them.
#   export OUT; bash tools/gpu/step_nsys.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
[ -n "$NSYS" ] || { echo "step_nsys: no nsys on this machine"; exit 0; }
cat > /tmp/llm_nsys_probe.py <<'PY'
import ctypes
import sys
import time

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_llm import CONTEXT, _audio, _primed
from profile_llm_step import _lm

lm = _lm("full")
driver = ctypes.CDLL("libcuda.so.1")
cache, text, function, _ = _primed(lm)
frames = _audio(lm, CONTEXT + 10)[:, CONTEXT:]
for i in range(10):  # compiled and warm after 4; the last 6 are traced
    mx.synchronize()
    time.sleep(0.005)
    if i == 4:
        driver.cuProfilerStart()
    t0 = time.perf_counter()
    text, function = lm.decode(text, frames[:, i : i + 1], function, cache)
    text, function = text[:, None], function[:, None]
    mx.eval(text, function, cache.state)
    if i >= 4:
        print(f"step {i}: {1e3 * (time.perf_counter() - t0):.2f} ms waited", flush=True)
driver.cuProfilerStop()
PY
timeout -s INT "${NSYS_LIMIT:-150}" "$NSYS" profile --capture-range=cudaProfilerApi --trace=cuda,osrt \
  --cuda-graph-trace=node -f true -o "$OUT/llm_nsys" python3 /tmp/llm_nsys_probe.py > "$OUT/llm_nsys.log" 2>&1
grep "^step" "$OUT/llm_nsys.log"
for report in cuda_gpu_trace cuda_api_trace; do
  "$NSYS" stats --report $report --format csv --force-export true -o "$OUT/llm_$report" "$OUT/llm_nsys.nsys-rep" \
    > /dev/null 2>&1
done
python3 - "$OUT/llm_cuda_gpu_trace_cuda_gpu_trace.csv" "$OUT/llm_cuda_api_trace_cuda_api_trace.csv" <<'PY'
import collections, csv, sys

def rows(path):
    try:
        return list(csv.DictReader(open(path)))
    except OSError as e:
        sys.exit(f"step_nsys: {e}")

gpu = sorted((int(r["Start (ns)"]), int(r["Duration (ns)"]), r["Name"]) for r in rows(sys.argv[1]))
api = sorted((int(r["Start (ns)"]), int(r["Duration (ns)"]), r["Name"]) for r in rows(sys.argv[2]))
steps, cur = [], [gpu[0]]
for g in gpu[1:]:
    if g[0] - (cur[-1][0] + cur[-1][1]) > 2_000_000:
        steps.append(cur)
        cur = []
    cur.append(g)
steps.append(cur)
for i, st in enumerate(steps):
    start, end = st[0][0], max(s + d for s, d, _ in st)
    busy = sum(d for _, d, _ in st)
    window = [a for a in api if start - 4_000_000 <= a[0] <= end + 200_000]
    launches = [a for a in window if "GraphLaunch" in a[2]]
    host0 = launches[0][0] if launches else start
    syncs = [a for a in window if "Synchronize" in a[2]]
    host_end = max((a[0] + a[1] for a in syncs), default=end)
    print(f"step {i}: {len(st)} kernels, host {1e-6 * (host_end - host0):.2f} ms from the first graph launch; "
          f"device span {1e-6 * (end - start):.2f} ms, busy {1e-6 * busy:.2f} ms; first kernel "
          f"{1e-3 * (start - host0):.0f} us after the first launch, last launch {1e-3 * (launches[-1][0] - start):.0f} us "
          f"into the span, {len(launches)} graph launches" if launches else "")
    cost = collections.Counter()
    for a in window:
        cost[a[2]] += a[1]
    print("   host API: " + ", ".join(f"{n} {1e-3 * d:.0f} us" for n, d in cost.most_common(6)))
    gaps = sorted(((st[j + 1][0] - (st[j][0] + st[j][1]), j) for j in range(len(st) - 1)), reverse=True)[:5]
    print("   gaps: " + "; ".join(f"{g / 1e3:.0f} us after {st[j][2][:28]} (#{j})" for g, j in gaps))
PY
