"""The C++ rel-pos attention kernel equals its pure-MLX reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels.rel_pos_attention import (
    chunked_limited_mask,
    position_window,
    rel_pos_attention,
    rel_pos_attention_reference,
)

TOL = {mx.float32: 2e-5, mx.bfloat16: 1e-2}


def _case(batch, heads, length, dim, dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 6)
    q, k, v = (mx.random.normal((batch, heads, length, dim), key=keys[i]).astype(dtype) for i in range(3))
    p = mx.random.normal((heads, 2 * length - 1, dim), key=keys[3]).astype(dtype)
    u = (0.3 * mx.random.normal((heads, dim), key=keys[4])).astype(dtype)
    b = (0.3 * mx.random.normal((heads, dim), key=keys[5])).astype(dtype)
    return q, k, v, p, u, b


def _close(a, b, dtype):
    assert a.shape == b.shape and a.dtype == b.dtype == dtype
    np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)),
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("length", [1, 2, 17, 71, 130])
@pytest.mark.parametrize("context", [(70, 0), (-1, 0), (4, 1), (2, 3)])
@pytest.mark.parametrize("method", ["fused", "composed"])
def test_kernel_equals_reference(dtype, length, context, method):
    args = _case(2, 3, length, 20, dtype, seed=length + context[0])
    scale = 20**-0.5
    out = rel_pos_attention(*args, scale, *context, method=method)
    ref = rel_pos_attention_reference(*args, scale, *context)
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("method", ["fused", "composed"])
@pytest.mark.parametrize("queries", [1, 3])
def test_the_last_frames_queries_give_those_rows_of_all(dtype, method, queries):
    """q of only the last n frames (a stream's new frames after its cached ones) gives the last n
    rows of the output for all L frames' queries, bit for bit."""
    length, context = 75, (70, 0)
    q, k, v, p, u, b = _case(2, 3, length, 20, dtype, seed=queries)
    first, count = position_window(length, *context)
    p = p[:, first : first + count]
    every = rel_pos_attention(q, k, v, p, u, b, 0.3, *context, first, method=method)
    last = rel_pos_attention(q[:, :, -queries:], k, v, p, u, b, 0.3, *context, first, method=method)
    assert last.shape == (2, 3, queries, 20)
    np.testing.assert_array_equal(np.array(last.astype(mx.float32)), np.array(every[:, :, -queries:].astype(mx.float32)))
    ref = rel_pos_attention_reference(q[:, :, -queries:], k, v, p, u, b, 0.3, *context, first)
    _close(last, ref, dtype)


def test_full_head_width_and_strided_inputs():
    """Perception hands in transposed views of [B, L, H, D] and [2L-1, H, D]: no copy needed, same result."""
    length, heads, dim = 90, 8, 128
    keys = mx.random.split(mx.random.key(7), 4)
    qkv = [mx.random.normal((1, length, heads, dim), key=keys[i]) for i in range(3)]
    p = mx.random.normal((2 * length - 1, heads, dim), key=keys[3]).transpose(1, 0, 2)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in qkv)
    u, b = mx.ones((heads, dim)) * 0.1, mx.ones((heads, dim)) * -0.2
    out = rel_pos_attention(q, k, v, p, u, b, dim**-0.5, 70, 0, method="fused")
    ref = rel_pos_attention_reference(q, k, v, p, u, b, dim**-0.5, 70, 0)
    _close(out, ref, mx.float32)


def test_zero_positions_and_biases_is_masked_softmax_attention():
    """With p = u = v_bias = 0 the op is plain attention under the chunked-limited mask."""
    q, k, v, _, _, _ = _case(1, 2, 80, 16, mx.float32, seed=3)
    zeros_p, zeros_b = mx.zeros((2, 159, 16)), mx.zeros((2, 16))
    mask = chunked_limited_mask(80, 70, 0)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    for method in ("fused", "composed"):
        out = rel_pos_attention(q, k, v, zeros_p, zeros_b, zeros_b, 0.25, 70, 0, method=method)
        _close(out, expected, mx.float32)


@pytest.mark.parametrize("method", ["fused", "composed"])
def test_frame_never_sees_the_future_or_beyond_left_context(method):
    q, k, v, p, u, b = _case(1, 2, 100, 16, mx.float32, seed=4)
    base = rel_pos_attention(q, k, v, p, u, b, 0.25, 70, 0, method=method)
    # Change keys and values of frames 50..: frames 0..49 keep their outputs exactly.
    noise = mx.random.normal(k.shape, key=mx.random.key(9))
    sel = mx.array((np.arange(100) >= 50)[None, None, :, None])
    out = rel_pos_attention(q, mx.where(sel, k + noise, k), mx.where(sel, v + noise, v), p, u, b, 0.25, 70, 0,
                            method=method)
    diff = np.abs(np.array(out) - np.array(base)).max(axis=(0, 1, 3))
    assert (diff[:50] == 0).all() and (diff[50:] > 0).all()
    # Frame 85 sees 15..85 only: changing frames 0..14 leaves it (and 80..84) unchanged.
    sel = mx.array((np.arange(100) < 15)[None, None, :, None])
    out = rel_pos_attention(q, mx.where(sel, k + noise, k), mx.where(sel, v + noise, v), p, u, b, 0.25, 70, 0,
                            method=method)
    diff = np.abs(np.array(out) - np.array(base)).max(axis=(0, 1, 3))
    assert (diff[85:] == 0).all() and diff[84] > 0


@pytest.mark.parametrize("length", [1, 3, 71, 100])
@pytest.mark.parametrize("context", [(70, 0), (-1, 0), (4, 1), (2, 3)])
def test_the_context_window_of_the_table_is_enough(length, context):
    args = list(_case(1, 2, length, 8, mx.float32, seed=length))
    full = rel_pos_attention_reference(*args, 0.3, *context)
    first, count = position_window(length, *context)
    assert 0 <= first and first + count <= 2 * length - 1
    args[3] = args[3][:, first : first + count]
    for method in ("fused", "composed"):
        _close(rel_pos_attention(*args, 0.3, *context, first, method=method), full, mx.float32)
    _close(rel_pos_attention_reference(*args, 0.3, *context, first), full, mx.float32)
    if count > 1:  # and it is the smallest such window: the kernel refuses one row less on either side
        with pytest.raises(ValueError, match="needs rows"):
            rel_pos_attention(*args[:3], args[3][:, 1:], *args[4:], 0.3, *context, first + 1)
        with pytest.raises(ValueError, match="needs rows"):
            rel_pos_attention(*args[:3], args[3][:, :-1], *args[4:], 0.3, *context, first)


def test_position_window_for_the_published_context():
    assert position_window(750, 70, 0) == (749 - 70, 71)
    assert position_window(10, 70, 0) == (0, 10)
    assert position_window(10, -1, 0) == (0, 10)


def test_leading_batch_axis_on_p_and_reference_switch(monkeypatch):
    q, k, v, p, u, b = _case(1, 2, 5, 8, mx.float32, seed=5)
    out = rel_pos_attention(q, k, v, p[None], u, b, 0.3, 70, 0)
    _close(out, rel_pos_attention_reference(q, k, v, p, u, b, 0.3, 70, 0), mx.float32)
    monkeypatch.setenv("VOICECHAT_REFERENCE", "1")
    np.testing.assert_array_equal(np.array(rel_pos_attention(q, k, v, p, u, b, 0.3, 70, 0)),
                                  np.array(rel_pos_attention_reference(q, k, v, p, u, b, 0.3, 70, 0)))


def test_bad_arguments_are_errors():
    q, k, v, p, u, b = _case(1, 2, 5, 8, mx.float32, seed=6)
    with pytest.raises(ValueError, match=r"needs rows \[0, 5\)"):
        rel_pos_attention(q, k, v, p[:, :4], u, b, 0.3, 70, 0)
    with pytest.raises(ValueError, match=r"\[H, P, D\]"):
        rel_pos_attention(q, k, v, p[0], u, b, 0.3, 70, 0)
    with pytest.raises(ValueError, match="B, H, L, D"):
        rel_pos_attention(q, k[:, :, :4], v, p, u, b, 0.3, 70, 0)
    with pytest.raises(ValueError, match="pos_bias"):
        rel_pos_attention(q, k, v, p, u[:1], b, 0.3, 70, 0)
    with pytest.raises(ValueError, match="method"):
        rel_pos_attention(q, k, v, p, u, b, 0.3, 70, 0, method="fast")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("context", [(70, 0), (4, 1), (-1, 0)])
@pytest.mark.parametrize("method", ["fused", "composed"])
def test_rows_with_a_key_start_are_their_frames_alone(dtype, context, method):
    """A stream's cache kept at one length while it fills: batch row b's frames begin at key
    key_start[b], and the keys before hold anything. Each row's output is that of its frames
    alone (the keys from key_start[b] on, the table rows of the same relative positions): bit
    for bit on the fused path."""
    length, queries, starts = 20, 3, [0, 5, 13]
    q, k, v, p, u, b = _case(len(starts), 2, length, 20, dtype, seed=11 + context[0])
    q = q[:, :, -queries:]
    garbage = mx.arange(length)[None, None, :, None] < mx.array(starts)[:, None, None, None]
    k, v = (mx.where(garbage, (1e3 * a).astype(dtype), a) for a in (k, v))
    out = rel_pos_attention(q, k, v, p, u, b, 0.3, *context, key_start=mx.array(starts, mx.int32), method=method)
    ref = rel_pos_attention_reference(q, k, v, p, u, b, 0.3, *context, key_start=mx.array(starts, mx.int32))
    _close(out, ref, dtype)
    for row, start in enumerate(starts):
        frames = length - start  # the frames' table: rows of the same relative positions
        alone = rel_pos_attention(q[row : row + 1], k[row : row + 1, :, start:], v[row : row + 1, :, start:],
                                  p[:, start : start + 2 * frames - 1], u, b, 0.3, *context, method=method)
        if method == "fused":
            np.testing.assert_array_equal(np.array(out[row : row + 1].astype(mx.float32)),
                                          np.array(alone.astype(mx.float32)))
        else:
            _close(out[row : row + 1], alone, dtype)


@pytest.mark.parametrize("method", ["fused", "composed"])
def test_a_query_before_its_key_start_gets_zeros(method):
    q, k, v, p, u, b = _case(2, 2, 12, 8, mx.float32, seed=12)
    starts = mx.array([0, 4], mx.int32)
    out = np.array(rel_pos_attention(q, k, v, p, u, b, 0.3, 70, 0, key_start=starts, method=method))
    ref = np.array(rel_pos_attention_reference(q, k, v, p, u, b, 0.3, 70, 0, key_start=starts))
    assert (out[1, :, :4] == 0).all() and (ref[1, :, :4] == 0).all() and (np.abs(out[1, :, 4:]) > 0).any()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_a_bad_key_start_is_an_error():
    q, k, v, p, u, b = _case(2, 2, 5, 8, mx.float32, seed=13)
    for bad in (mx.array([0, 1, 2], mx.int32), mx.array([0.0, 1.0]), mx.array([[0, 1]], mx.int32)):
        with pytest.raises(ValueError, match="key_start"):
            rel_pos_attention(q, k, v, p, u, b, 0.3, 70, 0, key_start=bad)
