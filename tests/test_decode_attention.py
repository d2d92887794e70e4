"""One query over fixed-size K/V buffers (slots past the position unwritten): the CUDA kernels
equal MLX's attention with the mask (there, and under the CPU emulation in
test_gemv_cuda_emulated.py); the reference is what the TTS backbone and the LLM's compiled decode
ran before."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.decode_attention import decode_attention, decode_attention_qkv, decode_attention_reference
from voicechat.kernels.gemv import on_cuda_gpu
from voicechat.kernels.qkv_heads import qkv_heads_reference, rope_inv_freq

ON_CUDA = on_cuda_gpu()


def _inputs(b, h, hk, cap, d, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((b, h, 1, d), key=k1), mx.random.normal((b, hk, cap, d), key=k2),
            mx.random.normal((b, hk, cap, d), key=k3))


def test_reference_is_the_formula():
    q, k, v = _inputs(1, 4, 2, 20, 8, seed=3)
    offset = 11
    qn, kn, vn = np.array(q), np.array(k), np.array(v)
    want = np.zeros((1, 4, 8))
    for h in range(4):
        scores = kn[0, h // 2, : offset + 1] @ qn[0, h, 0] * 8**-0.5
        p = np.exp(scores - scores.max())
        want[0, h] = (p / p.sum()) @ vn[0, h // 2, : offset + 1]
    got = decode_attention(q, k, v, mx.array(offset, mx.int32), 8**-0.5)
    np.testing.assert_allclose(np.array(got).reshape(1, 4, 8), want, rtol=1e-5, atol=1e-5)


def _new_key(b, hk, d, seed):
    k1, k2 = mx.random.split(mx.random.key(seed + 100))
    return mx.random.normal((b, hk, 1, d), key=k1), mx.random.normal((b, hk, 1, d), key=k2)


@pytest.mark.parametrize("b,h,hk,cap,d,offset", [(2, 4, 4, 20, 8, 11), (1, 4, 2, 20, 8, 0), (1, 6, 2, 16, 8, 40)])
def test_a_new_key_reads_as_the_buffer_with_its_slot_written(b, h, hk, cap, d, offset):
    """`new = (k, v, slot)` equals writing them into the slot first: a growing buffer (slot =
    offset), grouped heads at position 0, and a full ring (slot = offset % cap)."""
    q, k, v = _inputs(b, h, hk, cap, d, seed=offset)
    k_new, v_new = _new_key(b, hk, d, offset)
    slot = offset % cap
    got = decode_attention(q, k, v, mx.array(offset, mx.int32), d**-0.5, new=(k_new, v_new, mx.array(slot, mx.int32)))
    written_k, written_v = np.array(k), np.array(v)
    written_k[:, :, slot], written_v[:, :, slot] = np.array(k_new)[:, :, 0], np.array(v_new)[:, :, 0]
    want = decode_attention_reference(q, mx.array(written_k), mx.array(written_v), mx.array(offset, mx.int32), d**-0.5)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
@pytest.mark.parametrize("b,h,hk,cap,d", [(2, 16, 16, 256, 72), (2, 16, 16, 7500, 72), (1, 40, 8, 512, 128),
                                         (1, 40, 8, 1500, 128)])
@pytest.mark.parametrize("offset", [0, 200, 300, 1100, 9000])
@pytest.mark.parametrize("with_new", [False, True])
def test_kernels_equal_the_reference(b, h, hk, cap, d, offset, with_new):
    q, k, v = _inputs(b, h, hk, cap, d, seed=offset)
    new = (*_new_key(b, hk, d, offset), mx.array(offset % cap, mx.int32)) if with_new else None
    got = decode_attention(q, k, v, mx.array([offset], mx.int32), d**-0.5, new=new)
    with mx.stream(mx.cpu):
        want = np.array(decode_attention_reference(q, k, v, mx.array(offset, mx.int32), d**-0.5, new=new))
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)


def test_bad_arguments_are_refused():
    q, k, v = _inputs(1, 4, 3, 20, 8)
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        ext.decode_attention(q, k, v, mx.array([0], mx.int32), 1.0)
    q, k, v = _inputs(1, 4, 2, 20, 8)
    with pytest.raises(ValueError, match=r"\[B, H, 1, D\]"):
        ext.decode_attention(mx.concatenate([q, q], axis=2), k, v, mx.array([0], mx.int32), 1.0)
    k_new, v_new = _new_key(1, 2, 8, 0)
    with pytest.raises(ValueError, match="together"):
        ext.decode_attention(q, k, v, mx.array([0], mx.int32), 1.0, k_new=k_new, v_new=v_new)
    with pytest.raises(ValueError, match=r"\[B, HK, 1, D\]"):
        ext.decode_attention(q, k, v, mx.array([0], mx.int32), 1.0, k_new=k, v_new=v, slot=mx.array([0], mx.int32))
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA stream"):
            ext.decode_attention(q, k, v, mx.array([0], mx.int32), 1.0)


def _qkv_inputs(b, h, hk, cap, d, dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 5)
    qkv = (2.0 * mx.random.normal((b, 1, (h + 2 * hk) * d), key=keys[0])).astype(dtype)
    q_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[1])
    k_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[2])
    return (qkv, q_scale, k_scale, rope_inv_freq(d, 1e4), mx.random.normal((b, hk, cap, d), key=keys[3]),
            mx.random.normal((b, hk, cap, d), key=keys[4]))


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
@pytest.mark.parametrize("b,h,hk,cap,d,dtype", [(2, 16, 16, 256, 72, mx.float32), (2, 16, 16, 7500, 72, mx.float32),
                                                (1, 4, 2, 300, 80, mx.bfloat16)])
@pytest.mark.parametrize("offset", [0, 200, 1100, 9000])
def test_attention_from_the_projection_equals_heads_then_attention(b, h, hk, cap, d, dtype, offset):
    """The TTS step's fused launch: the output, and the new key and value it hands the cache, equal
    qkv_heads then the attention with that key in the position's slot (the TTS step's shapes, a
    ring of 7500 slots, grouped bfloat16 heads)."""
    qkv, q_scale, k_scale, inv_freq, k, v = _qkv_inputs(b, h, hk, cap, d, dtype, seed=offset + d)
    slot = mx.array(offset % cap, mx.int32)
    got, k_new, v_new = decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, 1e-6, k, v,
                                             mx.array(offset, mx.int32), 256**-0.5, slot, h)
    with mx.stream(mx.cpu):
        q, want_k, want_v = qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, h, hk, 1e-6)
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), 256**-0.5, new=(want_k, want_v, slot))
    assert k_new.shape == v_new.shape == (b, hk, 1, d)
    np.testing.assert_allclose(np.array(k_new), np.array(want_k), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(v_new), np.array(want_v))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
@pytest.mark.parametrize("cap,offset", [(300, 7), (1300, 1299), (7500, 9000)])
def test_attention_from_the_projection_writes_the_cache_in_place(cap, offset):
    """write_cache: the launch stores the new key and value in the slot of the buffers it was given,
    views of a stacked buffer as the TTS cache hands them (MLX must pass the kernel their own
    memory); every other slot unchanged, the output as without the write."""
    from voicechat.tts.backbone import layer_kv

    b, h, hk, d = 2, 16, 16, 72
    qkv, q_scale, k_scale, inv_freq, _, _ = _qkv_inputs(b, h, hk, 8, d, mx.float32, seed=cap)
    stack = mx.random.normal((4, b * hk, cap, d), key=mx.random.key(cap))
    mx.eval(stack)
    before = np.array(stack)
    k, v = layer_kv(stack, 1, hk)
    slot = mx.array(offset % cap, mx.int32)
    args = (qkv, q_scale, k_scale, inv_freq, 1e-6, k, v, mx.array(offset, mx.int32), 256**-0.5, slot, h)
    plain = decode_attention_qkv(*args)
    mx.eval(plain)
    got, k_new, v_new = decode_attention_qkv(*args, write_cache=True)
    mx.eval(got, k_new, v_new)
    want = before.copy()
    want[2, :, offset % cap] = np.array(k_new).reshape(b * hk, d)
    want[3, :, offset % cap] = np.array(v_new).reshape(b * hk, d)
    np.testing.assert_array_equal(np.array(stack), want)
    np.testing.assert_array_equal(np.array(got), np.array(plain[0]))


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
@pytest.mark.parametrize("cap,offset", [(256, 64), (1300, 1100)])
def test_plain_attention_writes_the_cache_in_place(cap, offset):
    """The LLM's decode step: `decode_attention(new=..., write_cache=True)` stores the new key and
    value in their slot of the buffers (the LLM's grouped heads; one chunk and several), every other
    slot unchanged, the output as without the write."""
    b, h, hk, d = 1, 40, 8, 128
    keys = iter(mx.random.split(mx.random.key(cap + offset), 5))
    q = mx.random.normal((b, h, 1, d), key=next(keys))
    k, v = (mx.random.normal((b, hk, cap, d), key=next(keys)) for _ in range(2))
    k_new, v_new = (mx.random.normal((b, hk, 1, d), key=next(keys)) for _ in range(2))
    mx.eval(q, k, v, k_new, v_new)
    before = [np.array(k), np.array(v)]
    slot = mx.array([offset], mx.int32)
    plain = decode_attention(q, k, v, slot, d**-0.5, new=(k_new, v_new, slot))
    mx.eval(plain)
    got = decode_attention(q, k, v, slot, d**-0.5, new=(k_new, v_new, slot), write_cache=True)
    mx.eval(got)
    for buf, old, new in zip((k, v), before, (k_new, v_new)):
        want = old.copy()
        want[:, :, offset] = np.array(new)[:, :, 0]
        np.testing.assert_array_equal(np.array(buf), want)
    np.testing.assert_array_equal(np.array(got), np.array(plain))


def test_reference_takes_a_position_a_row():
    """Positions and slots a row (sessions stepped together): each row as the reference at its own
    position (the formula's check above covers one position)."""
    b, h, hk, cap, d = 3, 4, 2, 24, 8
    q, k, v = _inputs(b, h, hk, cap, d, seed=7)
    k_new, v_new = _new_key(b, hk, d, 7)
    rows = [0, 9, 23]
    positions = mx.array(rows, mx.int32)
    got = decode_attention(q, k, v, positions, d**-0.5, new=(k_new, v_new, positions))
    for i, p in enumerate(rows):
        want = decode_attention_reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], mx.array(p, mx.int32), d**-0.5,
                                          new=(k_new[i:i + 1], v_new[i:i + 1], mx.array(p, mx.int32)))
        np.testing.assert_allclose(np.array(got[i:i + 1]), np.array(want), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
def test_rows_at_their_own_positions_have_the_bits_of_each_row_alone():
    """The LLM's decode step for sessions stepped together (chunked, a position a row, writing in
    place): each row's output and written slot equal, bit for bit, that row's step alone over buffers
    of its own capacity."""
    b, h, hk, d, cap = 3, 40, 8, 128, 1536
    rows, own_caps = [3, 700, 1400], [256, 768, 1536]
    keys = iter(mx.random.split(mx.random.key(5), 5))
    q = mx.random.normal((b, h, 1, d), key=next(keys))
    k, v = (mx.random.normal((b, hk, cap, d), key=next(keys)) for _ in range(2))
    k_new, v_new = (mx.random.normal((b, hk, 1, d), key=next(keys)) for _ in range(2))
    alone_kv = [(mx.array(k[i:i + 1, :, :c]), mx.array(v[i:i + 1, :, :c])) for i, c in enumerate(own_caps)]
    mx.eval(q, k, v, k_new, v_new, alone_kv)
    positions = mx.array(rows, mx.int32)
    together = decode_attention(q, k, v, positions, d**-0.5, new=(k_new, v_new, positions), write_cache=True,
                                chunked=True)
    mx.eval(together)
    for i, (p, (ki, vi)) in enumerate(zip(rows, alone_kv)):
        at = mx.array([p], mx.int32)
        alone = decode_attention(q[i:i + 1], ki, vi, at, d**-0.5, new=(k_new[i:i + 1], v_new[i:i + 1], at),
                                 write_cache=True, chunked=True)
        mx.eval(alone)
        np.testing.assert_array_equal(np.array(together[i:i + 1]), np.array(alone), err_msg=f"row {i}")
        np.testing.assert_array_equal(np.array(k[i:i + 1, :, :own_caps[i]]), np.array(ki))
        np.testing.assert_array_equal(np.array(v[i:i + 1, :, :own_caps[i]]), np.array(vi))


def test_qkv_reference_takes_a_position_a_row():
    """The head preparation and attention at a position and slot a row: each row as its own call at
    its position (the one-position form is held to the float64 formula above)."""
    b, h, hk, cap, d = 3, 4, 2, 24, 8
    qkv, q_scale, k_scale, inv_freq, k, v = _qkv_inputs(b, h, hk, cap, d, mx.float32, seed=11)
    rows = [0, 9, 23]
    positions = mx.array(rows, mx.int32)
    with mx.stream(mx.cpu):
        got, k_new, v_new = decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, 1e-6, k, v, positions, d**-0.5,
                                                 positions, h)
        for i, p in enumerate(rows):
            at = mx.array(p, mx.int32)
            want, want_k, want_v = decode_attention_qkv(qkv[i:i + 1], q_scale, k_scale, inv_freq, 1e-6, k[i:i + 1],
                                                        v[i:i + 1], at, d**-0.5, at, h)
            np.testing.assert_allclose(np.array(got[i:i + 1]), np.array(want), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(np.array(k_new[i:i + 1]), np.array(want_k))
            np.testing.assert_array_equal(np.array(v_new[i:i + 1]), np.array(want_v))


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_qkv_rows_at_their_own_positions_have_the_bits_of_each_row_alone(dtype):
    """The TTS step's attention for sessions stepped together (chunked, a position a row, writing in
    place): each row's output, new key and value equal, bit for bit, that row's step alone over
    buffers of its own capacity."""
    b, h, hk, d, cap = 4, 16, 16, 72, 1536
    rows, own_caps = [3, 4, 700, 1400], [256, 256, 768, 1536]
    qkv, q_scale, k_scale, inv_freq, k, v = _qkv_inputs(b, h, hk, cap, d, dtype, seed=5)
    alone_kv = [(mx.array(k[i:i + 1, :, :c]), mx.array(v[i:i + 1, :, :c])) for i, c in enumerate(own_caps)]
    mx.eval(qkv, k, v, alone_kv)
    positions = mx.array(rows, mx.int32)
    together = decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, 1e-6, k, v, positions, d**-0.5, positions, h,
                                    write_cache=True, chunked=True)
    mx.eval(together)
    for i, (p, (ki, vi)) in enumerate(zip(rows, alone_kv)):
        at = mx.array([p], mx.int32)
        alone = decode_attention_qkv(qkv[i:i + 1], q_scale, k_scale, inv_freq, 1e-6, ki, vi, at, d**-0.5, at, h,
                                     write_cache=True, chunked=True)
        mx.eval(alone)
        for t, a in zip(together, alone):
            np.testing.assert_array_equal(np.array(t[i:i + 1]), np.array(a), err_msg=f"row {i}")
        np.testing.assert_array_equal(np.array(k[i:i + 1, :, :own_caps[i]]), np.array(ki))


def test_write_cache_is_refused_off_the_kernel_path():
    qkv, q_scale, k_scale, inv_freq, k, v = _qkv_inputs(1, 4, 2, 20, 8, mx.float32, seed=3)
    with mx.stream(mx.cpu), pytest.raises(ValueError, match="write_cache"):
        decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, 1e-6, k, v, mx.array(3, mx.int32), 0.5,
                             mx.array(3, mx.int32), 4, write_cache=True)
    q = mx.zeros((1, 4, 1, 8))
    with mx.stream(mx.cpu), pytest.raises(ValueError, match="write_cache"):
        decode_attention(q, k, v, mx.array(3, mx.int32), 0.5, new=(k[:, :, :1], v[:, :, :1], mx.array(3, mx.int32)),
                         write_cache=True)


def test_attention_from_the_projection_refuses_bad_arguments():
    qkv, q_scale, k_scale, inv_freq, k, v = _qkv_inputs(1, 4, 2, 20, 8, mx.float32, seed=1)
    zero = mx.array([0], mx.int32)
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        ext.decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, 1e-6, k, v, zero, 1.0, zero, 3)
    with pytest.raises(ValueError, match="B x \\(heads"):
        ext.decode_attention_qkv(qkv[..., :-8], q_scale, k_scale, inv_freq, 1e-6, k, v, zero, 1.0, zero, 4)
    with pytest.raises(ValueError, match="inv_freq"):
        ext.decode_attention_qkv(qkv, q_scale, k_scale, inv_freq[:2], 1e-6, k, v, zero, 1.0, zero, 4)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA stream"):
            ext.decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, 1e-6, k, v, zero, 1.0, zero, 4)
