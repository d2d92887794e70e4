"""The Mamba-2 decode step's conv + SiLU and scan in one launch (vc_mamba_conv_scan_step), run under
the CPU emulation (tests/cuda_emulation.py), equals causal_conv_silu then the scan's references."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture
from voicechat.kernels.causal_conv import causal_conv_silu_reference
from voicechat.kernels.mamba_scan import mamba_scan_packed_reference


def conv_scan_case(b, h, p, g, n, extra, src_dtype=mx.float32, with_state=True, gated=False):
    """The decode step's conv + scan: projected = [gate (h*p) | x B C | dt (h) | `extra` columns].
    `gated`: the gated group norm's input times its weight, and the blocks' partial sums of squares."""
    keys = mx.random.split(mx.random.key(h + p + n), 9)
    conv, k = h * p + 2 * g * n, 4
    width = h * p + conv + h + extra
    projected = mx.random.normal((b, 1, width), key=keys[0]).astype(src_dtype)
    conv_state = mx.random.normal((b, k - 1, conv), key=keys[1])
    weight = 0.5 * mx.random.normal((conv, k, 1), key=keys[2])
    bias = 0.1 * mx.random.normal((conv,), key=keys[3])
    A_log = mx.random.normal((h,), key=keys[4]) * 0.5
    D = mx.random.normal((h,), key=keys[5]).astype(mx.bfloat16)
    dt_bias = (mx.random.normal((h,), key=keys[6]) - 1.0).astype(mx.bfloat16)
    state = mx.random.normal((b, h, p, n), key=keys[7])
    rb = next(r for r in (16, 8, 4, 2, 1) if p % r == 0)  # as mamba_conv_scan_step picks it
    gate_w = 1.0 + 0.2 * mx.random.normal((h * p,), key=keys[8])
    blocks = h * (p // rb)
    args = dict(H=h, P=p, G=g, N=n, K=k, W=width, X_OFF=h * p, DT_OFF=h * p + conv, RB=rb, HAS_BIAS=True,
                HAS_STATE=with_state, GATED=gated, GATE_OFF=0, TS=src_dtype, LO_BITS=0, HI_BITS=2139095040, BATCH=b)
    case = Case("vc_mamba_conv_scan_step", args,
                [projected, conv_state, weight, bias, A_log, D, dt_bias, state if with_state else dt_bias, gate_w],
                [("float", (b, 1, h * p)), ("float", (b, h, p, n)), ("float", (b, k - 1, conv)),
                 ("float", (b, 1, blocks if gated else 1))],
                b * blocks, rb * 32)
    with mx.stream(mx.cpu):
        xbc, new_conv = causal_conv_silu_reference(conv_state, projected, h * p, weight, bias)
        y, new_state = mamba_scan_packed_reference(xbc, projected, h * p + conv, A_log, D, dt_bias,
                                                   state if with_state else None, h, p, g, n)
        y = y.reshape(b, 1, h * p)
        if gated:
            hv = y * nn.silu(projected[..., : h * p].astype(mx.float32))
            return case, (hv * gate_w, new_state, new_conv, mx.square(hv).reshape(b, 1, blocks, rb).sum(-1))
    return case, (y, new_state, new_conv)


# 8-row blocks, a state size over 32 not a multiple of it, two batch rows; bfloat16 activations
# without a state and 4-row blocks; 16 rows a block; gated: the norm's input and its partial sums (two
# rows, two 16-row blocks a head; bfloat16)
CASES = {"conv_scan_b2": lambda: conv_scan_case(2, 8, 16, 2, 40, 5),
         "conv_scan_bf16_no_state": lambda: conv_scan_case(1, 4, 12, 2, 24, 0, mx.bfloat16, with_state=False),
         "conv_scan_two_blocks_a_head": lambda: conv_scan_case(1, 4, 32, 2, 40, 3),
         "conv_scan_gated_b2": lambda: conv_scan_case(2, 4, 32, 2, 40, 3, gated=True),
         "conv_scan_gated_bf16": lambda: conv_scan_case(1, 8, 16, 2, 24, 0, mx.bfloat16, gated=True)}


emulated = emulation_fixture("mamba_conv_scan_step", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_conv_scan_step_kernel_emulated(emulated, name):
    """One launch equals causal_conv_silu then the scan: y, the ssm state and the conv state; gated,
    y * silu(gate) * weight and each block's sum of (y * silu(gate))^2."""
    y, state, conv_state, partials = emulated.run(name)
    y_ref, state_ref, conv_ref, *partials_ref = emulated.refs[name]
    if partials_ref:
        np.testing.assert_allclose(partials, np.array(partials_ref[0]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(y, np.array(y_ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(state, np.array(state_ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(conv_state, np.array(conv_ref))
