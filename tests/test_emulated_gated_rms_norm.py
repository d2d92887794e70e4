"""The gated group RMSNorm (vc_gated_rms_norm), run under the CPU emulation (tests/cuda_emulation.py),
equals its reference computed in float32 from the same inputs and rounded once."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cuda_emulation import CUDA_TYPE, EPS_BITS, Case, assert_rounded_once, emulation_fixture
from voicechat.kernels.gated_rms_norm import gated_rms_norm_reference


def gated_norm_case(rows, c, groups, width, offset, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(rows + c), 3)
    y = mx.random.normal((rows, c), key=k1).astype(dtype)
    gate_src = (2.0 * mx.random.normal((rows, width), key=k2)).astype(dtype)
    weight = (1.0 + 0.1 * mx.random.normal((c,), key=k3)).astype(dtype)
    args = dict(C=c, G=groups, W=width, GATE_OFFSET=offset, THREADS=256, EPS_BITS=EPS_BITS, TY=dtype, TG=dtype,
                TW=dtype, TO=dtype)
    case = Case("vc_gated_rms_norm", args, [y, gate_src, weight], [(CUDA_TYPE[dtype], (rows, c))],
                rows * groups, 256)
    with mx.stream(mx.cpu):  # float32 math from the same inputs, rounded once, as the kernel does
        f32 = [a.astype(mx.float32) for a in (y, gate_src, weight)]
        ref = gated_rms_norm_reference(f32[0], f32[1], offset, f32[2], groups, 1e-5).astype(dtype)
    return case, ref


# the published mixer's width, groups narrower than a block, bfloat16
CASES = {"gated_norm_mixer": lambda: gated_norm_case(2, 10240, 8, 22656, 0),
         "gated_norm_small": lambda: gated_norm_case(3, 96, 2, 300, 4),
         "gated_norm_bf16": lambda: gated_norm_case(2, 10240, 8, 22656, 0, mx.bfloat16)}


emulated = emulation_fixture("gated_rms_norm", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_gated_rms_norm_kernel_emulated(emulated, name):
    assert_rounded_once(emulated, name)
