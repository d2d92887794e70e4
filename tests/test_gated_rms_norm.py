"""The Mamba-2 gated group RMSNorm: the extension (CUDA kernel, or MLX ops elsewhere) equals the
pure-MLX reference; the kernel's own text is also run under the CPU emulation
(test_gemv_cuda_emulated.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from voicechat.kernels.gemv import on_cuda_gpu

ON_CUDA = on_cuda_gpu()
# (leading shape, C, groups, gate_src width, gate offset): the published mixer (a step and a
# prefix), one group, an offset gate, odd sizes.
CASES = [((1, 1), 10240, 8, 22656, 0), ((1, 64), 10240, 8, 22656, 0), ((2, 3), 96, 1, 96, 0),
         ((1, 5), 96, 2, 300, 4), ((7,), 40, 4, 41, 1)]


def _inputs(lead, c, width, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    y = mx.random.normal((*lead, c), key=k1)
    gate_src = 2.0 * mx.random.normal((*lead, width), key=k2)
    weight = 1.0 + 0.1 * mx.random.normal((c,), key=k3)
    return y, gate_src, weight


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("lead,c,groups,width,offset", CASES)
def test_extension_equals_reference(lead, c, groups, width, offset, dtype):
    y, gate_src, weight = (a.astype(dtype) for a in _inputs(lead, c, width))
    got = ext.gated_rms_norm(y, gate_src, offset, weight, groups, 1e-5)
    with mx.stream(mx.cpu):  # from float32 inputs: the kernel's math is float32 whatever they are
        want = gated_rms_norm_reference(*(a.astype(mx.float32) for a in (y, gate_src)), offset,
                                        weight.astype(mx.float32), groups, 1e-5)
        want = np.array(want)
    assert got.shape == y.shape and got.dtype == dtype
    tol = 2e-5 if dtype == mx.float32 else 3e-2  # bfloat16: the composed path rounds h and the norm
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol)


def test_reference_is_the_formula():
    """Independent numpy: per group, h / sqrt(mean(h^2) + eps) * w with h = y * g * sigmoid(g)."""
    y, gate_src, weight = _inputs((3,), 12, 20, seed=4)
    yn, gn, wn = (np.array(a, np.float64) for a in (y, gate_src[..., 5:17], weight))
    h = yn * gn / (1 + np.exp(-gn))
    hg = h.reshape(3, 3, 4)
    want = (hg / np.sqrt((hg**2).mean(-1, keepdims=True) + 1e-6)).reshape(3, 12) * wn
    got = gated_rms_norm(y, gate_src, 5, weight, 3, 1e-6)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    y, gate_src, weight = _inputs((2,), 12, 20)
    with pytest.raises(ValueError, match="groups do not divide"):
        ext.gated_rms_norm(y, gate_src, 0, weight, 5, 1e-5)
    with pytest.raises(ValueError, match="outside gate_src"):
        ext.gated_rms_norm(y, gate_src, 9, weight, 3, 1e-5)
    with pytest.raises(ValueError, match="disagree"):
        ext.gated_rms_norm(y, gate_src, 0, weight[:5], 3, 1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
def test_the_kernel_runs_on_cuda_as_one_launch():
    from voicechat.llm.opcount import count_ops, custom_kernels

    y, gate_src, weight = _inputs((1, 1), 10240, 22656)
    mx.eval(y, gate_src, weight)
    counts = count_ops(gated_rms_norm(y, gate_src, 0, weight, 8, 1e-5))
    assert custom_kernels(counts) == 1 and "RMSNorm" not in counts
