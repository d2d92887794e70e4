"""tools/gpu/out_proj_rounds.{sh,py} off the GPU: the report reads Nsight Compute's raw CSV as
qmv_variants.sh writes it, fits its line through the whole rounds, and qmv_variants.py takes the round
shapes it names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
import out_proj_rounds  # noqa: E402

HEADER = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum"\n'
UNITS = '"","","ns","byte"\n'


def _csv(path: Path, launches: list[tuple[str, float]]) -> Path:
    """A raw-page CSV as ncu writes it: a log line, the header, the units row, a row a launch."""
    rows = "".join(f'"{i}","{name}","{ns:,.0f}","1"\n' for i, (name, ns) in enumerate(launches))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("==PROF== Connected to process\n" + HEADER + UNITS + rows)
    return path


def test_kernel_times_takes_each_kinds_fastest_launch(tmp_path):
    probe, kernel = "custom_kernel_vc_probe_tma_1a2b", "custom_kernel_vc_qmv_stream_emit_9f"
    path = _csv(tmp_path / "a.csv", [(probe, 7210.0), (probe, 7050.0), (kernel, 9880.0), (kernel, 9920.0),
                                     ("other_kernel", 10.0)])
    assert out_proj_rounds.kernel_times(path) == {"probe": 7.05, "kernel": 9.88}


def test_the_line_through_whole_rounds_and_the_third_rounds_cost(tmp_path):
    # a launch of 2 us and 3 us a round, the 4480 rows 0.9 us above the line at 2.12 rounds
    for n in (*out_proj_rounds.ROUND_NS, out_proj_rounds.OUT_PROJ_N):
        r = n / out_proj_rounds.ROUND_ROWS
        extra = 900.0 if n == out_proj_rounds.OUT_PROJ_N else 0.0
        _csv(tmp_path / f"out_proj_n{n}" / "qmv_variants.csv",
             [("custom_kernel_vc_qmv_stream_emit_9f", (2.0 + 3.0 * r) * 1e3 + extra)])
    times = {n: out_proj_rounds.kernel_times(tmp_path / f"out_proj_n{n}" / "qmv_variants.csv")
             for n in (*out_proj_rounds.ROUND_NS, out_proj_rounds.OUT_PROJ_N)}
    lines = out_proj_rounds.report(times)
    kernel = next(line for line in lines if line.startswith("kernel:"))
    assert kernel.startswith("kernel: 3.00 us a round + 2.00 us (the line misses a whole round by 0.00 us")
    assert "4480 rows 9.26 us against the line's 8.36 at 2.12 rounds (+0.90 us" in kernel
    assert "2.5 TB/s is 10.32 us" in kernel
    # the walk's loads alone were not measured: said, not fitted
    assert "probe: fewer than two whole-round shapes measured, no line" in lines
    assert lines[0].startswith("N  2112 (1.00 rounds): kernel   5.00 us")


def test_fit_line_needs_two_points():
    assert out_proj_rounds.fit_line({1.0: 5.0, 3.0: 11.0}) == pytest.approx((2.0, 3.0))
    with pytest.raises(ValueError):
        out_proj_rounds.fit_line({1.0: 5.0})


def test_qmv_variants_takes_the_round_shapes_it_is_named():
    env = {**os.environ, "QMV_SHAPES": "out_proj_n4224,out_proj_n4480",
           "QMV_VARIANTS": "out_proj_n4224:tmaprobe:8:320:2"}
    proc = subprocess.run([sys.executable, "tools/gpu/qmv_variants.py", "--list"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["out_proj_n4224 ext rows 0 threads 0 row_groups 1",
                                        "out_proj_n4224 tmaprobe rows 8 threads 320 stages 2",
                                        "out_proj_n4480 ext rows 0 threads 0 row_groups 1"]
