"""out_proj's time by rounds of its launch, from tools/gpu/out_proj_rounds.sh's Nsight Compute runs (one
folder a shape, each with qmv_variants.sh's qmv_variants.csv): the step's out_proj instance and its
walk's loads alone (tmaprobe) at K = 10240 and N = 2112 r, r = 1-4 whole rounds of the launch's 264
blocks of 8-row tiles, and at out_proj's own 4480 rows (2.12 rounds: 32 tiles in a third round).

A line t = a + b r through the whole rounds says what a round costs (b) and what the launch costs
beyond its rounds (a); 4480 rows against the line at 2.12 rounds is what the late third round costs
beyond an even share of its bytes, the most that handing out the same rows without one could win.

    python3 tools/gpu/out_proj_rounds.py FOLDER     # FOLDER/out_proj_n<N>/qmv_variants.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

K = 10240
ROUND_ROWS = 264 * 8  # a round: every block of the launch one 8-row tile
ROUND_NS = (2112, 4224, 6336, 8448)
OUT_PROJ_N = 4480
BYTES_PER_ROW = K // 2 + 2 * 2 * (K // 64)  # the 4-bit row, its bf16 scales and biases


def kernel_times(csv_path: Path) -> dict[str, float]:
    """{"probe": us, "kernel": us}: the fastest launch of each in one qmv_variants.sh CSV (its raw
    page: one row a profiled launch, a units row after the header)."""
    best: dict[str, float] = {}
    with open(csv_path) as f:
        for row in csv.DictReader(line for line in f if line.startswith('"')):
            try:
                us = float(row["gpu__time_duration.sum"].replace(",", "")) / 1e3
            except ValueError:
                continue  # the units row
            name = row["Kernel Name"]
            kind = "probe" if "vc_probe_tma" in name else "kernel" if "qmv_stream" in name else None
            if kind is not None and us < best.get(kind, float("inf")):
                best[kind] = us
    return best


def fit_line(points: dict[float, float]) -> tuple[float, float]:
    """(a, b) of the least-squares line t = a + b r through {r: t} (two points at least)."""
    if len(points) < 2:
        raise ValueError("a line needs two rounds at least")
    b, a = np.polyfit(list(points), list(points.values()), 1)
    return float(a), float(b)


def report(times: dict[int, dict[str, float]]) -> list[str]:
    """The lines of the report from {N: {"probe": us, "kernel": us}} (a shape or a kind missing: said)."""
    lines = []
    for n in sorted(times):
        cells = "  ".join(f"{kind} {us:6.2f} us {n * BYTES_PER_ROW / us / 1e6:4.2f} TB/s"
                          for kind, us in sorted(times[n].items()))
        lines.append(f"N {n:5d} ({n / ROUND_ROWS:4.2f} rounds): {cells}")
    for kind in ("kernel", "probe"):
        points = {n / ROUND_ROWS: times[n][kind] for n in ROUND_NS if kind in times.get(n, {})}
        if len(points) < 2:
            lines.append(f"{kind}: fewer than two whole-round shapes measured, no line")
            continue
        a, b = fit_line(points)
        worst = max(abs(t - (a + b * r)) for r, t in points.items())
        line = f"{kind}: {b:.2f} us a round + {a:.2f} us (the line misses a whole round by {worst:.2f} us at most)"
        if kind in times.get(OUT_PROJ_N, {}):
            r = OUT_PROJ_N / ROUND_ROWS
            at, on_line = times[OUT_PROJ_N][kind], a + b * r
            goal = OUT_PROJ_N * BYTES_PER_ROW / 2.5e6  # us at 2.5 TB/s
            line += (f"; 4480 rows {at:.2f} us against the line's {on_line:.2f} at {r:.2f} rounds "
                     f"({at - on_line:+.2f} us for the third round's 32 tiles; 2.5 TB/s is {goal:.2f} us)")
        lines.append(line)
    return lines


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    folder = Path(sys.argv[1])
    times = {}
    for n in (*ROUND_NS, OUT_PROJ_N):
        path = folder / f"out_proj_n{n}" / "qmv_variants.csv"
        if path.exists():
            times[n] = kernel_times(path)
        else:
            print(f"N {n}: no {path}")
    print("\n".join(report(times)))


if __name__ == "__main__":
    main()
