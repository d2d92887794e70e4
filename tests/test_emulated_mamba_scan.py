"""The Mamba-2 scan CUDA kernel (mamba_scan: a warp a (batch, head, channel) row, any number of
positions from a state), run under the CPU emulation (tests/cuda_emulation.py), equals its reference."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from cuda_emulation import Case, assert_close_to, emulation_fixture, float_bits
from voicechat.kernels.mamba_scan import mamba_scan_packed_reference


def scan_case(b, length, h, p, g, n, extra=0, dtype=mx.float32, with_state=True, limit=(0.0, math.inf)):
    """xbc [b, L, H*P + 2*G*N] (x | B | C) and dt [b, L, extra + H] (the step inputs at column
    `extra`), bf16 D / dt_bias as the published model's."""
    keys = mx.random.split(mx.random.key(length + h + n), 7)
    xbc = mx.random.normal((b, length, h * p + 2 * g * n), key=keys[0]).astype(dtype)
    dt = mx.random.normal((b, length, extra + h), key=keys[1]).astype(dtype)
    A_log = 0.5 * mx.random.normal((h,), key=keys[2])
    D = mx.random.normal((h,), key=keys[3]).astype(mx.bfloat16)
    dt_bias = (mx.random.normal((h,), key=keys[4]) - 1.0).astype(mx.bfloat16)
    state = mx.random.normal((b, h, p, n), key=keys[5])
    rows = b * h * p
    args = dict(T=dtype, H=h, P=p, G=g, N=n, DT_W=extra + h, DT_OFF=extra, HAS_STATE=with_state,
                LO_BITS=float_bits(limit[0]), HI_BITS=float_bits(limit[1]))
    case = Case("mamba_scan", args,
                [xbc, dt, A_log, D, dt_bias, state if with_state else dt_bias, mx.array([length, b], mx.int32)],
                [("float" if dtype == mx.float32 else "__nv_bfloat16", (b, length, h, p)), ("float", (b, h, p, n))],
                -(-rows * 32 // 128), 128)
    with mx.stream(mx.cpu):
        ref = mamba_scan_packed_reference(xbc, dt, extra, A_log, D, dt_bias, state if with_state else None, h, p, g,
                                          n, limit)
    return case, ref


# a prefix of 5 positions from a state, two batch rows, N = 40 (a lane's second entry partly); no
# state and a step limit; 6 rows: the second block's last two warps past them (they leave at once)
CASES = {"scan_prefix_b2": lambda: scan_case(2, 5, 4, 8, 2, 40, extra=3),
         "scan_no_state_limited": lambda: scan_case(1, 3, 4, 6, 1, 24, with_state=False, limit=(0.001, 0.1)),
         "scan_rows_past_the_grid": lambda: scan_case(1, 2, 2, 3, 1, 32, extra=1)}

emulated = emulation_fixture("mamba_scan", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_mamba_scan_kernel_emulated(emulated, name):
    assert_close_to(emulated.run(name), emulated.refs[name], rtol=2e-5)
