"""EAR-TTS's MoG draw for one frame: the C++ / CUDA kernel and its pure-MLX reference.

From `y = [logits (N) | log_std (1) | rest (L)]` (the stacked projections of the guided hidden
state `h`), uniforms `u [N]` and normals `noise [L]`:

    keep      = top_p_keep(logits, top_p)                  (ties kept together)
    c         = argmax(log_softmax over kept logits + gumbel(u))   (first index on ties)
    mu        = low_mat[c] @ (proj_mus.weight.reshape(N, R, H)[c] @ h)
    s         = exp(max(log_std, min_log_std))
    z         = (mu * s + rest) + s * noise * noise_scale

Returns `(z [L] float32, c [1] int32)`. On a CUDA GPU one launch (`ext.mog_sample`); elsewhere the
reference. The kernel sums each component's "more likely" mass directly instead of a sorted scan,
so a component whose mass lies within float rounding of top_p may be decided differently.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import on_cuda_gpu

GUMBEL_EPS = 1e-8


def top_p_keep(logits: mx.array, top_p: float) -> mx.array:
    """Boolean mask over the last axis: keep a component while the probability mass of the
    strictly more likely components is < top_p (so the most likely one is always kept)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    ordered = -mx.sort(-probs, axis=-1)  # descending
    mass_before = mx.cumsum(ordered, axis=-1) - ordered
    # The kept set is every component at least as likely as the least likely kept one; taking
    # the threshold from the sorted order keeps ties together (a tie's first member carries the
    # exact "strictly more likely" mass).
    threshold = mx.min(mx.where(mass_before < top_p, ordered, mx.inf), axis=-1, keepdims=True)
    return probs >= threshold


def gumbel(u: mx.array) -> mx.array:
    return -mx.log(-mx.log(u + GUMBEL_EPS) + GUMBEL_EPS)


def choose_component(logits: mx.array, top_p: float, u: mx.array) -> mx.array:
    """Gumbel-max over the top-p components: int indices, the shape of logits without its last axis."""
    logits = mx.where(top_p_keep(logits, top_p), logits, -mx.inf)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(log_probs + gumbel(u), axis=-1)


def component_mean(h: mx.array, component: mx.array, mus: mx.array, low_mat: mx.array) -> mx.array:
    """`low_mat[c] @ (mus.reshape(N, R, H)[c] @ h)` for each row of `h [B, T, H]`: [B, T, L] float32."""
    b, t, hidden = h.shape
    n, latent, rank = low_mat.shape
    c = component.reshape(-1)
    w = mus.reshape(n, rank, hidden)[c]  # [bt, R, H]
    low = (w @ h.reshape(b * t, hidden, 1)).astype(mx.float32)  # [bt, R, 1]
    mu = low_mat[c] @ low  # [bt, L, 1]
    return mu.reshape(b, t, latent).astype(mx.float32)


def mog_sample_reference(y, h, u, noise, mus, low_mat, top_p: float, min_log_std: float, noise_scale: float):
    n, latent = low_mat.shape[0], low_mat.shape[1]
    y = y.reshape(1, 1, n + 1 + latent)
    logits, log_std, rest = y[..., :n], y[..., n : n + 1], y[..., n + 1 :]
    c = choose_component(logits, top_p, u.reshape(1, 1, n))
    mu = component_mean(h.reshape(1, 1, -1).astype(mx.float32), c, mus, low_mat)
    logs = mx.maximum(log_std, min_log_std)
    z = (mu * mx.exp(logs) + rest) + mx.exp(logs) * noise.reshape(1, 1, latent) * noise_scale
    return z.reshape(latent), c.reshape(1).astype(mx.int32)


def mog_sample(y, h, u, noise, mus, low_mat, top_p: float, min_log_std: float, noise_scale: float,
               sessions: int = 1):
    """`(z [L], component [1])`; see the module docstring. `sessions` S > 1: y, h, u and noise hold S
    rows, one draw each (in one launch, each as alone): `(z [S, L], component [S])`."""
    kernel_takes = (all(a.dtype == mx.float32 for a in (y, h, u, noise)) and mus.dtype == low_mat.dtype
                    and low_mat.shape[0] <= 4096)
    if use_reference() or not on_cuda_gpu() or not kernel_takes:
        if sessions == 1:
            return mog_sample_reference(y, h, u, noise, mus, low_mat, top_p, min_log_std, noise_scale)
        rows = [y.reshape(sessions, -1), h.reshape(sessions, -1), u.reshape(sessions, -1), noise.reshape(sessions, -1)]
        draws = [mog_sample_reference(*(a[i] for a in rows), mus, low_mat, top_p, min_log_std, noise_scale)
                 for i in range(sessions)]
        return mx.stack([z for z, _ in draws]), mx.concatenate([c for _, c in draws])
    return tuple(ext.mog_sample(y, h, u, noise, mus, low_mat, top_p, min_log_std, noise_scale, sessions=sessions))
