"""The MoG draw of one TTS frame (top-p, Gumbel-max component, low-rank mean, noise): the CUDA
kernel equals the pure-MLX reference (there, and under the CPU emulation in
test_gemv_cuda_emulated.py); the reference is what the head's own step computes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.gemv import on_cuda_gpu
from voicechat.kernels.mog_sample import mog_sample, mog_sample_reference

ON_CUDA = on_cuda_gpu()


def _inputs(n, r, latent, hidden, w_dtype=mx.bfloat16, seed=0, sharp=3.0):
    k = mx.random.split(mx.random.key(seed), 6)
    y = mx.random.normal((1, 1, n + 1 + latent), key=k[0])
    y = mx.concatenate([y[..., :n] * sharp, y[..., n:]], axis=-1)
    h = mx.random.normal((1, 1, hidden), key=k[1])
    u = mx.random.uniform(shape=(1, 1, n), key=k[2])
    noise = mx.random.normal((1, 1, latent), key=k[3])
    mus = (mx.random.normal((n * r, hidden), key=k[4]) * hidden**-0.5).astype(w_dtype)
    low_mat = (mx.random.normal((n, latent, r), key=k[5]) * r**-0.5).astype(w_dtype)
    return y, h, u, noise, mus, low_mat


def test_the_heads_step_draws_what_the_reference_draws(tiny_checkpoint):
    """MoGHead.sample (stacked projections) equals infer() followed by the step's noise formula."""
    from voicechat.checkpoint import open_checkpoint
    from voicechat.tts.ear_tts import EarTTS

    ckpt = open_checkpoint(tiny_checkpoint)
    cfg = ckpt.config.tts_config
    tts = EarTTS(cfg, ckpt.config.text_config.vocab_size, compile=False)
    ckpt.load_into(tts, "tts_model.tts_model.")
    mog = tts.mog_head
    mog.stack()
    x = mx.random.normal((2, 1, cfg.hidden_size), key=mx.random.key(4))
    u = mx.random.uniform(shape=(1, 1, mog.num_predictions), key=mx.random.key(5))
    noise = mx.random.normal((1, 1, cfg.latent_size), key=mx.random.key(6))
    mu, logs = mog.infer(x, cfg.guidance_scale, cfg.top_p, u)
    want = mu + mx.exp(logs) * noise * cfg.noise_scale
    got = mog.sample(x, cfg.guidance_scale, cfg.top_p, u, noise, cfg.noise_scale)
    tol = 2e-5 if ON_CUDA else 0.0  # the same ops off CUDA
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
@pytest.mark.parametrize("n,r,latent,hidden,sharp", [(1024, 64, 512, 1152, 3.0), (1024, 64, 512, 1152, 0.3),
                                                     (1500, 8, 40, 96, 3.0), (7, 2, 5, 33, 1.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_equals_reference(n, r, latent, hidden, sharp, seed):
    args = _inputs(n, r, latent, hidden, seed=seed, sharp=sharp)
    z, c = mog_sample(*args, 0.95, -4.0, 0.001)
    with mx.stream(mx.cpu):
        z_ref, c_ref = mog_sample_reference(*args, 0.95, -4.0, 0.001)
        z_ref, c_ref = np.array(z_ref), np.array(c_ref)
    assert np.array(c).tolist() == c_ref.tolist()
    np.testing.assert_allclose(np.array(z), z_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
def test_the_kernel_is_one_launch():
    from voicechat.llm.opcount import count_ops, custom_kernels

    args = _inputs(1024, 64, 512, 1152)
    mx.eval(args)
    counts = count_ops(*mog_sample(*args, 0.95, -4.0, 0.001))
    assert custom_kernels(counts) == 1 and "Sort" not in counts


@pytest.mark.parametrize("n,r,latent,hidden", [(1024, 64, 512, 1152), (7, 2, 5, 33)])
def test_sessions_in_one_call_draw_what_each_draws_alone(n, r, latent, hidden):
    """Three sessions' draws from one head (`sessions=3`: the kernel's blocks a session on a GPU, the
    reference row by row elsewhere): each session's latent and component bit for bit its own call's."""
    draws = [_inputs(n, r, latent, hidden, seed=s, sharp=1.0) for s in (4, 5, 6)]
    mus, low_mat = draws[0][4], draws[0][5]
    rows = [mx.concatenate([d[j] for d in draws], axis=0) for j in range(4)]
    z, c = mog_sample(*rows, mus, low_mat, 0.95, -4.0, 0.001, sessions=3)
    assert z.shape == (3, latent) and c.shape == (3,)
    for i, d in enumerate(draws):
        z_i, c_i = mog_sample(*d[:4], mus, low_mat, 0.95, -4.0, 0.001)
        np.testing.assert_array_equal(np.array(z[i]), np.array(z_i))
        assert int(c[i]) == int(c_i[0])


def test_bad_arguments_are_refused():
    y, h, u, noise, mus, low_mat = _inputs(16, 2, 8, 12)
    with pytest.raises(ValueError, match="N \\+ 1 \\+ L"):
        ext.mog_sample(y[..., :-1], h, u, noise, mus, low_mat, 0.95, -4.0, 0.001)
    with pytest.raises(ValueError, match="mus"):
        ext.mog_sample(y, h, u, noise, mus[:-1], low_mat, 0.95, -4.0, 0.001)
    with pytest.raises(ValueError, match="a session"):
        ext.mog_sample(y, h, u, noise, mus, low_mat, 0.95, -4.0, 0.001, sessions=2)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA stream"):
            ext.mog_sample(y, h, u, noise, mus, low_mat, 0.95, -4.0, 0.001)
