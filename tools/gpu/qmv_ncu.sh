#!/usr/bin/env bash
# On the lent H200, after a build: each 4-bit GEMV launch shape's kernel time under Nsight Compute
# (gpu__time_duration at ncu's locked clocks, one pass, no host in it) at the LLM's shapes, float32
# x. The back-to-back timings of qmv_grid.py include MLX's per-call host work, which at these sizes
# is near the kernel's own time; this is the kernel alone. Prints "shape rows threads warps: us".
# PROBE=step: the step's own instances instead (tools/gpu/qmv_step_probe.py: in_proj / up_proj with a
# prenormed x, out_proj / down_proj emitting the next norm, at several launch shapes each (the streamed
# layout's among them: "streamSxB" is S stages on B blocks), and MLX's
# quantized_matmul at the same shapes), with each launch's registers a thread.
#   export OUT; [GEMV_PYTHONPATH=...] [PROBE=step] bash tools/gpu/qmv_ncu.sh [tag]
set -uo pipefail
# Nsight Compute tells kernels apart by name: through MLX's launch (ours names every one vc_kernel)
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}
OUT=${OUT:-/tmp/out}
TAG=${1:-new}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
cat > /tmp/qmv_ncu_probe.py <<'PY'
import sys
import mlx.core as mx
sys.path.insert(0, "benchmarks")
from bench_gemv import random_q4
from voicechat.kernels import ext

# (rows, threads, warps): block layout 8 / 4 rows, 64 threads (several steps a thread), warp layout
LAUNCHES = ((8, 0, 0), (4, 0, 0), (8, 64, 0), (4, 0, 4), (2, 0, 8))
for n, k in ((22656, 4480), (15680, 4480), (4480, 10240), (4480, 15680)):
    w, s, b = random_q4(n, k, 0)
    x = mx.random.normal((1, k))
    for rows, threads, warps in LAUNCHES:
        for _ in range(2):
            mx.eval(ext.quantized_matvec(x, w, s, b, rows_per_block=rows, threads=threads, warps=warps))
        print(f"launched {n}x{k} {rows} {threads} {warps}", flush=True)
PY
probe=/tmp/qmv_ncu_probe.py filter="regex:vc_qmv"  # vc_qmv_stream too
[ "${PROBE:-}" = step ] && probe=tools/gpu/qmv_step_probe.py filter="regex:qmv"
# NCU_CLOCK=none: the GPU's own clocks (ncu locks them at base by default: comparable run to run, but
# the step's GEMVs read 16-23% longer there than they run: eighteenth session)
timeout -s INT "${NCU_LIMIT:-120}" "$NCU" --target-processes all -k "$filter" --clock-control "${NCU_CLOCK:-base}" \
  --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size \
  --csv --page raw python3 "$probe" > "$OUT/qmv_ncu_$TAG.csv" 2> "$OUT/qmv_ncu_$TAG.err"
python3 - "$OUT/qmv_ncu_$TAG.csv" "$TAG" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if not rows:
    sys.exit(f"qmv_ncu: no kernels profiled (see {sys.argv[1][:-4]}.err)")
head = rows[0]
col, name = head.index("gpu__time_duration.sum"), head.index("Kernel Name")
regs, grid = head.index("launch__registers_per_thread"), head.index("launch__grid_size")
best, extra = {}, {}
for r in rows[2:]:  # rows[1]: the units (ns)
    m = re.search(r"vc_qmv(_warp|_emit)?_[0-9a-f]+_4_64_(\d+)_(\d+)_1_(\d+)_(\d+)", r[name])
    st = re.search(r"vc_qmv_stream(_emit)?_[0-9a-f]+_64_(\d+)_(\d+)_1_(\d+)_(\d+)_(\d+)", r[name])
    im = re.search(r"vc_qmv_imma(_emit)?_[0-9a-f]+_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)", r[name])
    if im:  # the integer-MMA layout: "imma{warps}i{groups in flight}x{grid}", the levels as "split"
        key = (int(im.group(3)), int(im.group(2)), f"imma{im.group(5)}i{im.group(7)}x{r[grid]}", int(im.group(4)),
               int(im.group(6)))
    elif st:  # the streamed layout: its stages and grid (blocks) in the layout's name
        key = (int(st.group(3)), int(st.group(2)), f"stream{st.group(6)}x{r[grid]}", int(st.group(4)),
               int(st.group(5)))
    elif m:
        key = (int(m.group(3)), int(m.group(2)), (m.group(1) or "_block")[1:], int(m.group(4)), int(m.group(5)))
    else:  # MLX's kernel: its name and grid (the shape is the probe's order)
        key = (r[name][:60], r[grid])
    best[key] = min(best.get(key, 1e30), float(r[col].replace(",", "")) / 1e3)
    extra[key] = r[regs]
for key, us in best.items():
    if len(key) == 2:
        print(f"{sys.argv[2]} mlx {key[0]} grid {key[1]} regs {extra[key]}: {us:7.2f} us")
        continue
    n, k, layout, rows_, split = key
    nbytes = n * k // 2 + 4 * n * (k // 64)
    print(f"{sys.argv[2]} {n}x{k} {layout} rows {rows_} split {split} regs {extra[key]}: {us:7.2f} us "
          f"{nbytes / us / 1e3:6.0f} GB/s")
PY
