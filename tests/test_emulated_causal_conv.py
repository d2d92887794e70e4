"""The Mamba-2 causal depthwise conv + SiLU (vc_causal_conv_silu), run under the CPU emulation
(tests/cuda_emulation.py), equals its reference: the output and the next conv state."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture
from voicechat.kernels.causal_conv import causal_conv_silu_reference


def conv_case(b, length, c, k, width, offset, src_dtype=mx.float32):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(c + length), 4)
    state = mx.random.normal((b, k - 1, c), key=k1)
    src = mx.random.normal((b, length, width), key=k2).astype(src_dtype)
    weight = 0.5 * mx.random.normal((c, k), key=k3)
    bias = 0.1 * mx.random.normal((c,), key=k4)
    args = dict(B=b, C=c, K=k, L=length, W=width, OFFSET=offset, HAS_BIAS=True, TS=src_dtype, THREADS=256)
    threads = b * (length + k - 1) * c
    case = Case("vc_causal_conv_silu", args, [state, src, weight, bias], [("float", (b, length, c)),
                ("float", (b, k - 1, c))], -(-threads // 256), 256)
    with mx.stream(mx.cpu):
        ref = causal_conv_silu_reference(state, src, offset, weight[..., None], bias)
    return case, ref


# a step, and a prefix longer than the kernel with bfloat16 input
CASES = {"conv_step": lambda: conv_case(1, 1, 300, 4, 700, 256),
         "conv_prefix_b2": lambda: conv_case(2, 6, 40, 4, 50, 7, mx.bfloat16)}


emulated = emulation_fixture("causal_conv", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_causal_conv_kernel_emulated(emulated, name):
    y, state = emulated.run(name)
    y_ref, state_ref = emulated.refs[name]
    np.testing.assert_allclose(y, np.array(y_ref), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(state, np.array(state_ref))
