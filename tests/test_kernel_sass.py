"""tools/kernel_sass.py (SASS opcode counts of a registered kernel instance, nvcc + cuobjdump, no GPU):
its instance pick and override, and what it reads in a real listing."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import kernel_sass  # noqa: E402

STREAM_EMIT = next(s for s in kernel_sass.SOURCES if s["name"] == "vc_qmv_stream_emit")


def test_instance_pick_sets_the_given_args_and_keeps_the_rest():
    inst = kernel_sass.pick_instance(STREAM_EMIT, {"K": "15680", "N": "4480", "LEVELS": "3"})
    args = dict(inst["template_args"])
    assert (args["K"], args["N"], args["LEVELS"], args["STAGES"]) == ("int:15680", "int:4480", "int:3", "int:2")
    with pytest.raises(SystemExit, match="no template arg BOGUS"):
        kernel_sass.pick_instance(STREAM_EMIT, {"K": "15680", "N": "4480", "BOGUS": "1"})
    with pytest.raises(SystemExit, match="no registered instance"):
        kernel_sass.pick_instance(STREAM_EMIT, {"K": "7", "N": "4480"})


def test_opcode_drops_predicates_and_modifiers():
    assert kernel_sass.opcode("@!P0 IDP.4A.U8.S8 R1, R2, R3, R4") == "IDP"
    assert kernel_sass.opcode("FFMA R1, R2, R3, R4") == "FFMA"


@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cuobjdump")), reason="needs nvcc and cuobjdump")
def test_dp4a_levels_scale_the_integer_dot_products():
    """The mamba out_proj's streamed kernel: each level of x's terms is its own dp4a (IDP) for every
    weight word's two nibble planes, so 3 levels compile to a quarter fewer than 4 (384 against 512)."""
    counts = {}
    for levels in (3, 4):
        lines, _ = kernel_sass.sass_lines(STREAM_EMIT, kernel_sass.pick_instance(
            STREAM_EMIT, {"K": "10240", "N": "4480", "LEVELS": str(levels)}))
        counts[levels] = sum(kernel_sass.opcode(line) == "IDP" for line in lines)
    assert counts[4] - counts[3] == counts[4] // 4 > 0, counts
