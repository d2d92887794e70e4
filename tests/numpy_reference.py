"""Float64 NumPy pieces for the spec references of test_conformer_reference.py and
test_ear_tts_reference.py.

Written from the model specification (voicechat-port-spec.md and its README), never from our
modules: nothing here imports voicechat. Weights are read out of a module's parameters (MLX
layout) and widened to float64; every formula is computed again here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


def f64(a) -> np.ndarray:
    """A float64 NumPy copy of an MLX array of any floating dtype (or of anything array-like)."""
    if isinstance(a, mx.array):
        a = a.astype(mx.float32)
    return np.array(a, dtype=np.float64)


def randomize(module, seed: int) -> None:
    """Give every floating parameter of `module` random normal values: a matrix (any tensor of two
    or more axes) `N(0, 1 / its last axis)`, a vector or scalar `N(0, 0.25)` (norm weights, biases,
    gates, embeddings of one row). Integer buffers are left alone."""
    rng = np.random.default_rng(seed)
    fresh = []
    for name, value in tree_flatten(module.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        std = value.shape[-1] ** -0.5 if value.ndim >= 2 else 0.5
        fresh.append((name, mx.array((rng.standard_normal(value.shape) * std).astype(np.float32))))
    module.update(tree_unflatten(fresh))


def assert_close(got, want, rtol: float = 1e-4) -> None:
    """float32 `got` equals float64 `want` to `rtol`, relative to each entry and to the largest one
    (an entry near zero is held to `rtol` times the array's scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


# --------------------------------------------------------------------------- elementwise

def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def gelu_tanh(x):
    """GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`)."""
    inner = np.sqrt(2.0 / np.pi) * (x + 0.044715 * np.power(x, 3))
    return 0.5 * x * (1.0 + np.tanh(inner))


def softmax(x, axis=-1):
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


# --------------------------------------------------------------------------- layers

def dense(x, weight, bias=None):
    """`nn.Linear` with an MLX-layout weight `[out, in]`."""
    y = np.einsum("...i,oi->...o", x, f64(weight))
    return y if bias is None else y + f64(bias)


def layer_norm(x, norm, eps: float):
    """LayerNorm over the last axis with the module's weight and bias."""
    centred = x - x.mean(axis=-1, keepdims=True)
    var = (centred**2).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * f64(norm.weight) + f64(norm.bias)


def gemma_norm(x, norm, eps: float):
    """Gemma's RMSNorm: the stored weight is an offset, the scale is `1 + weight`."""
    inv_rms = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    return x * inv_rms * (1.0 + f64(norm.weight))


def gated_gelu_mlp(x, mlp):
    """`down(gelu_tanh(gate(x)) * up(x))`, no biases."""
    return dense(gelu_tanh(dense(x, mlp.gate_proj.weight)) * dense(x, mlp.up_proj.weight), mlp.down_proj.weight)
