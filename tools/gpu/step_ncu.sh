#!/usr/bin/env bash
# On the lent H200, after test.sh's build: every kernel of one compiled decode step under Nsight
# Compute at the GPU's own clocks, summed by kernel. STEP=llm (default): the Nemotron-H step (full
# size, 4-bit, both heads, 64 cached positions); STEP=tts: the EAR-TTS frame (backbone and the
# 8-iteration code generation, bf16 weights, just after the warmup). Against the step's device time
# (profile_llm_step / profile_tts_step) the sum says how much is kernels and how much the gaps
# between them, and which kernels own the rest. Only the step is profiled: the probe brackets it
# with cuProfilerStart / cuProfilerStop (ncu --profile-from-start off).
#   export OUT; [STEP=tts] [NCU_DETAIL=regex] bash tools/gpu/step_ncu.sh
set -uo pipefail
# Nsight Compute tells kernels apart by name: through MLX's launch (ours names every one vc_kernel)
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
STEP=${STEP:-llm}
cat > /tmp/llm_step_probe.py <<'PY'
import ctypes
import os
import sys

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_llm import CONTEXT, _audio, _primed
from profile_llm_step import _lm

# LLM_PROBE_SIZE=tiny: a check of the probe itself (on a CPU too, where nothing is profiled)
lm = _lm(os.environ.get("LLM_PROBE_SIZE", "full"))
driver = ctypes.CDLL("libcuda.so.1") if mx.default_device() == mx.gpu else None
cache, text, function, _ = _primed(lm)
frames = _audio(lm, CONTEXT + 4)[:, CONTEXT:]
for i in range(4):  # compiled and warm; the last one is profiled
    mx.synchronize()
    if i == 3 and driver:
        driver.cuProfilerStart()
    text, function = lm.decode(text, frames[:, i : i + 1], function, cache)
    text, function = text[:, None], function[:, None]
    mx.eval(text, function, cache.state)
    mx.synchronize()
if driver:
    driver.cuProfilerStop()
print("profiled one decode step:", text.item(), function.item(), flush=True)
PY
cat > /tmp/tts_step_probe.py <<'PY'
import ctypes
import os
import sys

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from profile_tts_step import _tts

tts, cache, previous = _tts(os.environ.get("TTS_PROBE_SIZE", "full"), gemv=True)
driver = ctypes.CDLL("libcuda.so.1") if mx.default_device() == mx.gpu else None
key, text = mx.random.key(0), mx.array([100], mx.int32)
silence = mx.zeros((tts.cfg.num_quantizers,), mx.int32)
for i in range(4):  # compiled and warm; the last one is profiled
    mx.synchronize()
    if i == 3 and driver:
        driver.cuProfilerStart()
    previous, key = tts.step(previous, text, cache, key, silence)
    mx.eval(previous, key, cache.buffers)
    mx.synchronize()
if driver:
    driver.cuProfilerStop()
print("profiled one TTS step:", previous.reshape(-1)[:4].tolist(), flush=True)
PY
timeout -s INT "${NCU_LIMIT:-240}" "$NCU" --profile-from-start off --clock-control none --cache-control none \
  --metrics gpu__time_duration.sum -f -o "$OUT/${STEP}_step" python3 /tmp/${STEP}_step_probe.py > "$OUT/${STEP}_step_ncu.log" 2>&1
tail -3 "$OUT/${STEP}_step_ncu.log"
"$NCU" --import "$OUT/${STEP}_step.ncu-rep" --page raw --csv --print-units base > "$OUT/${STEP}_step.csv" 2>&1
python3 - "$OUT/${STEP}_step.csv" <<'PY'
import collections
import csv
import sys

def ns(row):  # the duration in ns, None on the units row
    try:
        return float(row.get("gpu__time_duration.sum", "").replace(",", ""))
    except ValueError:
        return None


rows = [r for r in csv.DictReader(open(sys.argv[1])) if ns(r) is not None]
by_kernel = collections.defaultdict(lambda: [0, 0.0])
for r in rows:  # one line per kernel and grid: the GEMVs of different shapes apart
    name = r["Kernel Name"].split("(")[0].split("<")[0] + " grid" + r.get("Grid Size", "?")
    by_kernel[name][0] += 1
    by_kernel[name][1] += ns(r) / 1e3
total = sum(us for _, us in by_kernel.values())
print(f"{len(rows)} kernels, {total:.0f} us of kernel time in the step")
for name, (n, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1]):
    print(f"{us:8.0f} us {100 * us / total:5.1f}% {n:4d}x {us / n:6.1f} us  {name[:100]}")
PY
# NCU_DETAIL=regex: the first NCU_DETAIL_COUNT (default 6) launches of the step whose kernel names
# match it, again under Nsight Compute's full set (throughput, occupancy, warp stall reasons), as
# text in $OUT/${STEP}_detail.txt.
if [ -n "${NCU_DETAIL:-}" ]; then
  timeout -s INT "${NCU_DETAIL_LIMIT:-150}" "$NCU" --profile-from-start off --clock-control none --set full \
    -k "regex:${NCU_DETAIL}" -c "${NCU_DETAIL_COUNT:-6}" -f -o "$OUT/${STEP}_detail" python3 /tmp/${STEP}_step_probe.py \
    > "$OUT/${STEP}_detail.log" 2>&1
  "$NCU" --import "$OUT/${STEP}_detail.ncu-rep" --page details > "$OUT/${STEP}_detail.txt" 2>&1
  grep -E "^  [a-z_]|Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per" \
    "$OUT/${STEP}_detail.txt" | head -60
fi
