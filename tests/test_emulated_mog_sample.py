"""The MoG draw (vc_mog_sample), run under the CPU emulation (tests/cuda_emulation.py), picks its
reference's component and gives its latent."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture, float_bits
from voicechat.kernels.mog_sample import mog_sample_reference


def mog_case(n, r, latent, hidden, w_dtype, seed, sharp=3.0, ties=False):
    k = mx.random.split(mx.random.key(seed), 6)
    y = mx.random.normal((n + 1 + latent,), key=k[0]) * mx.concatenate(
        [mx.full((n,), sharp), mx.ones((1 + latent,))])  # sharp: top-p keeps a few components
    if ties:  # logits on a coarse grid: many equal probabilities, the top-p edge among equals
        y = mx.concatenate([mx.round(y[:n]), y[n:]])
    h = mx.random.normal((hidden,), key=k[1])
    u = mx.random.uniform(shape=(n,), key=k[2])
    noise = mx.random.normal((latent,), key=k[3])
    mus = (mx.random.normal((n * r, hidden), key=k[4]) * hidden**-0.5).astype(w_dtype)
    low_mat = (mx.random.normal((n, latent, r), key=k[5]) * r**-0.5).astype(w_dtype)
    args = dict(N=n, R=r, L=latent, H=hidden, THREADS=512, TW=w_dtype, TOP_P_BITS=float_bits(0.95),
                MIN_LOG_STD_BITS=float_bits(4.0), MIN_LOG_STD_NEG=True, NOISE_BITS=float_bits(0.001))
    case = Case("vc_mog_sample", args, [y, h, u, noise, mus, low_mat], [("float", (latent,)), ("int32_t", (1,))], 1, 512)
    with mx.stream(mx.cpu):
        ref = mog_sample_reference(y, h, u, noise, mus, low_mat, 0.95, -4.0, 0.001)
    return case, ref


# more components than threads, bfloat16 weights; a flat mixture (top-p keeps many); ties at the edge
CASES = {"mog_bf16": lambda: mog_case(1500, 8, 40, 96, mx.bfloat16, seed=1),
         "mog_flat_f32": lambda: mog_case(300, 4, 24, 64, mx.float32, seed=2, sharp=0.3),
         "mog_ties": lambda: mog_case(200, 8, 16, 64, mx.bfloat16, seed=3, sharp=1.5, ties=True),
         "mog_ties_flat": lambda: mog_case(700, 4, 24, 48, mx.float32, seed=4, sharp=0.6, ties=True)}


emulated = emulation_fixture("mog_sample", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_mog_sample_kernel_emulated(emulated, name):
    z, component = emulated.run(name)
    z_ref, c_ref = emulated.refs[name]
    assert component.tolist() == np.array(c_ref).tolist()
    np.testing.assert_allclose(z, np.array(z_ref), rtol=2e-5, atol=2e-5)
