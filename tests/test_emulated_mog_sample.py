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


def mog_sessions_case(n, r, latent, hidden, w_dtype, seeds, session=None):
    """One draw a session (block b: session b) from one head's weights; `session` i: that session's
    draw launched alone."""
    draws = [mog_case(n, r, latent, hidden, w_dtype, seed=sd, sharp=1.0) for sd in seeds]
    first = draws[0][0]
    mus, low_mat = first.inputs[4], first.inputs[5]
    chosen = range(len(seeds)) if session is None else [session]
    rows = [mx.concatenate([draws[i][0].inputs[j] for i in chosen]) for j in range(4)]
    s = len(chosen)
    case = Case("vc_mog_sample", dict(first.template_args), rows + [mus, low_mat],
                [("float", (s * latent,)), ("int32_t", (s,))], s, 512)
    return case, None


# more components than threads, bfloat16 weights; a flat mixture (top-p keeps many); ties at the edge
CASES = {"mog_bf16": lambda: mog_case(1500, 8, 40, 96, mx.bfloat16, seed=1),
         "mog_flat_f32": lambda: mog_case(300, 4, 24, 64, mx.float32, seed=2, sharp=0.3),
         "mog_ties": lambda: mog_case(200, 8, 16, 64, mx.bfloat16, seed=3, sharp=1.5, ties=True),
         "mog_ties_flat": lambda: mog_case(700, 4, 24, 48, mx.float32, seed=4, sharp=0.6, ties=True)}


SESSION_SEEDS = (11, 12, 13)
CASES["mog_sessions"] = lambda: mog_sessions_case(300, 8, 24, 64, mx.bfloat16, SESSION_SEEDS)
for _i in range(len(SESSION_SEEDS)):
    CASES[f"mog_sessions_alone{_i}"] = lambda i=_i: mog_sessions_case(300, 8, 24, 64, mx.bfloat16, SESSION_SEEDS, i)

emulated = emulation_fixture("mog_sample", CASES)


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("mog_sessions")])
def test_mog_sample_kernel_emulated(emulated, name):
    z, component = emulated.run(name)
    z_ref, c_ref = emulated.refs[name]
    assert component.tolist() == np.array(c_ref).tolist()
    np.testing.assert_allclose(z, np.array(z_ref), rtol=2e-5, atol=2e-5)


def test_each_session_of_a_launch_draws_what_it_draws_alone(emulated):
    """Sessions' draws in one launch (a block a session, one head's weights): each session's latent and
    component are, bit for bit, its draw launched alone."""
    z, component = emulated.run("mog_sessions")
    latent = z.size // len(SESSION_SEEDS)
    assert len(set(component.tolist())) > 1  # (the sessions draw apart: a mix-up of rows would show)
    for i in range(len(SESSION_SEEDS)):
        z_i, c_i = emulated.run(f"mog_sessions_alone{i}")
        np.testing.assert_array_equal(z[i * latent : (i + 1) * latent].view(np.uint32), z_i.view(np.uint32))
        assert component[i] == c_i[0]
