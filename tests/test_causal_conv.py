"""The Mamba-2 causal depthwise conv + SiLU from a conv state: the extension (CUDA kernel, or MLX
ops elsewhere) equals the pure-MLX reference and an independent numpy formula; the kernel's own
text also runs under the CPU emulation (test_gemv_cuda_emulated.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.causal_conv import causal_conv_silu, causal_conv_silu_reference
from voicechat.kernels.gemv import on_cuda_gpu

ON_CUDA = on_cuda_gpu()
# (batch, L, C, K, src width, offset): the published mixer (a step and a prefix), small odd ones.
CASES = [(1, 1, 12288, 4, 22656, 10240), (1, 64, 12288, 4, 22656, 10240), (2, 5, 40, 3, 50, 7), (1, 2, 8, 4, 8, 0)]


def _inputs(b, length, c, k, width, seed=0):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    state = mx.random.normal((b, k - 1, c), key=k1)
    src = mx.random.normal((b, length, width), key=k2)
    weight = 0.5 * mx.random.normal((c, k, 1), key=k3)
    bias = 0.1 * mx.random.normal((c,), key=k4)
    return state, src, weight, bias


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("src_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("b,length,c,k,width,offset", CASES)
def test_extension_equals_reference(b, length, c, k, width, offset, src_dtype, with_bias):
    state, src, weight, bias = _inputs(b, length, c, k, width)
    src = src.astype(src_dtype)
    bias = bias if with_bias else None
    y, nxt = ext.causal_conv_silu(state, src, offset, weight, bias)
    with mx.stream(mx.cpu):
        y_ref, nxt_ref = causal_conv_silu_reference(state, src, offset, weight, bias)
        y_ref, nxt_ref = np.array(y_ref), np.array(nxt_ref)
    assert y.shape == (b, length, c) and y.dtype == mx.float32 and nxt.shape == (b, k - 1, c)
    np.testing.assert_allclose(np.array(y), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(nxt), nxt_ref)  # a copy of inputs: exact


def test_reference_is_the_formula():
    state, src, weight, bias = _inputs(2, 3, 6, 4, 9, seed=3)
    s, x = np.array(state, np.float64), np.array(src, np.float64)[..., 2:8]
    w, bb = np.array(weight, np.float64)[..., 0], np.array(bias, np.float64)
    window = np.concatenate([s, x], axis=1)  # [b, K-1+L, C]
    out = bb + sum(window[:, j : j + 3] * w[:, j] for j in range(4))
    y, nxt = causal_conv_silu(state, src, 2, weight, bias)
    np.testing.assert_allclose(np.array(y), out / (1 + np.exp(-out)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(nxt), window[:, 3:], rtol=0, atol=0)


def test_bad_arguments_are_refused():
    state, src, weight, bias = _inputs(1, 2, 8, 4, 10)
    with pytest.raises(ValueError, match="outside src"):
        ext.causal_conv_silu(state, src, 3, weight, bias)
    with pytest.raises(ValueError, match="weight must be"):
        ext.causal_conv_silu(state, src, 0, weight[:, :3], bias)
    with pytest.raises(ValueError, match="bias must be"):
        ext.causal_conv_silu(state, src, 0, weight, bias[:4])


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
def test_the_kernel_runs_on_cuda_as_one_launch():
    from voicechat.llm.opcount import count_ops, custom_kernels

    state, src, weight, bias = _inputs(1, 1, 12288, 4, 22656)
    mx.eval(state, src, weight, bias)
    counts = count_ops(*causal_conv_silu(state, src, 10240, weight, bias))
    assert custom_kernels(counts) == 1 and "Concatenate" not in counts
