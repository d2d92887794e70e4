#!/usr/bin/env bash
# On the lent H200, after a build: which instructions of the 4-bit GEMV's kernels the warps stall
# on. tools/gpu/qmv_variants.py's launches (QMV_SHAPES / QMV_VARIANTS pick them) under Nsight
# Compute's warp-state sampling (SourceCounters), at the GPU's own clocks; the per-SASS-instruction
# page of each kernel lands in $OUT/qmv_source.csv (the report itself in $OUT/qmv_source.ncu-rep),
# summed up per kernel (stall reasons, opcodes, the stalled-on instructions, the code regions) into
# $OUT/qmv_source.txt and stdout.
#   export OUT; QMV_SHAPES=in_proj QMV_VARIANTS=in_proj:tma:8:160:3 bash tools/gpu/qmv_source.sh
set -uo pipefail
export VOICECHAT_OWN_LAUNCH=${VOICECHAT_OWN_LAUNCH:-0}  # ncu tells kernels apart by name (ours: vc_kernel)
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout -s INT "${NCU_LIMIT:-200}" "$NCU" --clock-control none -k "regex:qmv" --import-source no \
  --section SourceCounters --section WarpStateStats -f -o "$OUT/qmv_source" python3 tools/gpu/qmv_variants.py \
  > "$OUT/qmv_source.log" 2>&1
"$NCU" -i "$OUT/qmv_source.ncu-rep" --page source --print-source sass --csv > "$OUT/qmv_source.csv" 2>> "$OUT/qmv_source.log"
[ -s "$OUT/qmv_source.csv" ] || { "$NCU" --help | grep -i -A4 "page\|print-source" | head -40; exit 1; }
# Per kernel: its samples by stall reason, instructions and samples by opcode, the stalled-on
# instructions, and the code between branches and barriers (its share of instructions and samples).
python3 - "$OUT/qmv_source.csv" <<'PY' | tee "$OUT/qmv_source.txt"
import collections
import csv
import sys


def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


kernels, header = [], None
for row in csv.reader(open(sys.argv[1])):
    if not row:
        continue
    if row[0] == "Kernel Name":
        kernels.append((row[1].split("(")[0].replace("mlx::core::cu::custom_kernel_", "")[:90], []))
    elif row[0] == "Address":
        header = row
    elif kernels and header:
        kernels[-1][1].append(dict(zip(header, row)))
SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"
for name, rows in kernels:
    total = sum(num(r[SAMPLES]) for r in rows) or 1.0
    reasons = collections.Counter()
    ops, op_samples = collections.Counter(), collections.Counter()
    for r in rows:
        for c, v in r.items():
            if c.startswith("stall_") and "Not Issued" not in c:
                reasons[c[6:]] += num(v)
        words = r["Source"].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "?")
        ops[op.split(".")[0]] += num(r[EXECUTED])
        op_samples[op.split(".")[0]] += num(r[SAMPLES])
    print(f"\n{name}: {total:.0f} samples, {sum(ops.values()) / 1e6:.2f} M warp instructions")
    print("  stalls: " + ", ".join(f"{k} {v / total:.0%}" for k, v in reasons.most_common(8)))
    print("  opcodes (M, share of samples): " +
          ", ".join(f"{o} {c / 1e6:.2f}/{op_samples[o] / total:.0%}" for o, c in ops.most_common(12)))
    for r in sorted(rows, key=lambda r: -num(r[SAMPLES]))[:8]:
        top = max(((c[6:], num(v)) for c, v in r.items() if c.startswith("stall_") and "Not Issued" not in c),
                  key=lambda kv: kv[1])
        print(f"  {num(r[SAMPLES]) / total:5.1%} {r['Source'].strip()[:56]:56s} {top[0]}")
    start, inst, samples = 0, 0.0, 0.0
    for i, r in enumerate(rows):
        inst, samples = inst + num(r[EXECUTED]), samples + num(r[SAMPLES])
        src = r["Source"]
        if "BRA" in src or "EXIT" in src or "BAR" in src or i == len(rows) - 1:
            if samples / total >= 0.02:
                print(f"  [{start:4d}-{i:4d}] {inst / 1e3:9.1f} k instructions, {samples / total:5.1%} of samples,"
                      f" ends {src.strip()[:40]}")
            start, inst, samples = i + 1, 0.0, 0.0
PY
