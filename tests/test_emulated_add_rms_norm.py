"""The sandwich-norm seam (vc_add_rms_norm) and the MoG head's guided seam over the CFG pair
(vc_add_rms_norm_guided), run under the CPU emulation (tests/cuda_emulation.py), equal their references."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture, float_bits
from voicechat.kernels.add_rms_norm import add_rms_norm_guided_reference, add_rms_norm_reference


def add_norm_case(rows, c, y_dtype=mx.float32):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(rows + c), 4)
    h = mx.random.normal((rows, c), key=k1)
    y = (3.0 * mx.random.normal((rows, c), key=k2)).astype(y_dtype)
    post = 1.0 + 0.1 * mx.random.normal((c,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((c,), key=k4)
    args = dict(C=c, THREADS=256, EPS_BITS=float_bits(1e-6), TH=mx.float32, TY=y_dtype, TW=mx.float32, TO=mx.float32)
    case = Case("vc_add_rms_norm", args, [h, y, post, pre], [("float", (rows, c)), ("float", (rows, c))], rows, 256)
    with mx.stream(mx.cpu):
        ref = add_rms_norm_reference(h, y.astype(mx.float32), post, pre, 1e-6)
    return case, ref


def add_norm_guided_case(c, guidance, sessions=1, session=None):
    """`sessions` CFG pairs in one launch (a block a pair); `session` i: that pair launched alone."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(c + 1), 4)
    h = mx.random.normal((2 * sessions, 1, c), key=k1)
    y = 3.0 * mx.random.normal((2 * sessions, 1, c), key=k2)
    if session is not None:
        h, y, sessions = h[2 * session : 2 * session + 2], y[2 * session : 2 * session + 2], 1
    post = 1.0 + 0.1 * mx.random.normal((c,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((c,), key=k4)
    args = dict(C=c, THREADS=256, EPS_BITS=float_bits(1e-6), G_BITS=float_bits(guidance), TH=mx.float32,
                TY=mx.float32, TW=mx.float32, TO=mx.float32)
    case = Case("vc_add_rms_norm_guided", args, [h, y, post, pre], [("float", (sessions, 1, c))], sessions, 256)
    with mx.stream(mx.cpu):
        ref = add_rms_norm_guided_reference(h, y, post, pre, 1e-6, guidance)
    return case, ref


# the TTS width (CFG batch), a bfloat16 branch, a width below a block
SEAM_CASES = {"add_norm_tts": lambda: add_norm_case(2, 1152), "add_norm_bf16_y": lambda: add_norm_case(3, 1152, mx.bfloat16),
              "add_norm_small": lambda: add_norm_case(1, 100)}
# the MoG head's last seam, guided: the published width, an odd one
GUIDED_CASES = {"add_norm_guided_tts": lambda: add_norm_guided_case(1152, 0.2),
                "add_norm_guided_odd": lambda: add_norm_guided_case(300, 1.5),
                "add_norm_guided_sessions": lambda: add_norm_guided_case(300, 1.5, sessions=3)}
ALONE_CASES = {f"add_norm_guided_alone{i}": (lambda i=i: add_norm_guided_case(300, 1.5, sessions=3, session=i))
               for i in range(3)}


emulated = emulation_fixture("add_rms_norm", {**SEAM_CASES, **GUIDED_CASES, **ALONE_CASES})


@pytest.mark.parametrize("name", list(SEAM_CASES))
def test_add_rms_norm_kernel_emulated(emulated, name):
    h, z = emulated.run(name)
    h_ref, z_ref = emulated.refs[name]
    for got, want in ((h, np.array(h_ref)), (z, np.array(z_ref))):  # sums that cancel: atol by scale
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", list(GUIDED_CASES))
def test_add_rms_norm_guided_kernel_emulated(emulated, name):
    (got,) = emulated.run(name)
    want = np.array(emulated.refs[name])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_each_sessions_pair_of_a_guided_launch_has_the_bits_of_its_launch_alone(emulated):
    (together,) = emulated.run("add_norm_guided_sessions")
    for i in range(3):
        (alone,) = emulated.run(f"add_norm_guided_alone{i}")
        np.testing.assert_array_equal(together[i : i + 1].view(np.uint32), alone.view(np.uint32))
