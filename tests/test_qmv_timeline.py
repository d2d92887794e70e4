"""tools/gpu/qmv_timeline.py off the GPU: its report reads stamps as the probe writes them, and its
kernel texts (the streamed kernels with the stamps defined, with each way of staging x, and with
VC_RAMP=0, which only this tool turns on) compile for sm_90 with nvcc."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))
import qmv_timeline  # noqa: E402


def _stamps(blocks: int, warps: int, rounds: list[int], ghz: float = 2.0) -> np.ndarray:
    """Warp w of block b starts at b us (global timer, ns), its prologue done 1 us later, tile r in at
    3 + 2r us and summed 1 + w / 10 us after, the last warp storing it 0.5 us after that."""
    st = np.zeros((blocks, warps, qmv_timeline.SLOTS), np.int64)
    cyc = ghz * 1e3  # cycles a us
    for b in range(blocks):
        for w in range(warps):
            g0, c0 = 1000 * b, 10_000 * (b + 1)  # each SM's counter its own
            st[b, w, :4] = [g0, c0, g0 + 20_000, c0 + int(20 * cyc)]
            at = lambda event, r, us: st[b, w].__setitem__(4 + event * qmv_timeline.ROUNDS + r, c0 + int(us * cyc))
            at(0, 0, 1.0)
            for r in range(rounds[b]):
                at(1, r, 3 + 2 * r)
                at(2, r, 4 + 2 * r + w / 10)
                if w == warps - 1:
                    at(3, r, 4.5 + 2 * r + w / 10)
    return st


def test_report_reads_the_stamps_as_times_from_the_first_start(capsys):
    qmv_timeline.report("t", _stamps(blocks=3, warps=2, rounds=[2, 2, 3]))
    out = capsys.readouterr().out.splitlines()
    assert "3 blocks x 2 warps" in out[0] and "span 22.00 us" in out[0] and "2.00 GHz" in out[0]
    assert "past" not in out[0]
    # block b's clock starts b us after block 0's: prologue done at 1, 2, 3 us
    assert "prologue done 1.00/2.00/3.00/3.00" in out[1]
    round0, round2 = out[2], out[4]
    assert round0.startswith("  round 0 (3 blocks): in 3.00/4.00/5.00/5.00")
    assert "product 1.00/1.05/1.10/1.10" in round0  # 1 us, +0.1 for warp 1
    assert "stored 5.60/6.60" in round0  # the blocks' last warp: 4.6, 5.6, 6.6 us
    assert round2.startswith("  round 2 (1 blocks): in 9.00/9.00/9.00/9.00") and len(out) == 5


def test_report_counts_warps_a_launch_held(capsys):
    st = _stamps(blocks=2, warps=2, rounds=[1, 1])
    st[1, 0, 2] += 300_000  # one warp ends 300 us late (global timer and cycles alike)
    st[1, 0, 3] += 600_000
    qmv_timeline.report("t", st)
    assert "1 warps past 100 us" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("variant", ["out_proj:tma:8:320:2", "down_proj:tma:8:512:2:XS=2+VC_RAMP=0",
                                     "down_proj:tma:8:512:2:XS=0", "out_proj:immatma:0:256:2:VC_RAMP=0",
                                     "down_proj:immatma:8:256:2", "out_proj:tma:8:320:2:VC_TILE_FIRST=1",
                                     "out_proj:probe:8:320:2", "out_proj:tma:8:640:4:VC_START_ITEMS=1",
                                     "out_proj_n4224:tma:8:320:2"])
def test_the_timeline_kernels_compile_for_sm90(variant, monkeypatch, capsys):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    monkeypatch.setenv("QMV_TIMELINE", variant)
    qmv_timeline.nvcc()
    out = capsys.readouterr().out
    assert out.strip().endswith("compiled"), out
