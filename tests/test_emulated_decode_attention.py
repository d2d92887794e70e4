"""The decode steps' attention (vc_decode_attn_part and its merge vc_decode_attn_combine; the TTS
step's vc_decode_attn_qkv_part with the head norms + RoPE inside), run under the CPU emulation
(tests/cuda_emulation.py), equals its reference at every slot range and writes the new key in place."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulate, float_bits
from voicechat.kernels.decode_attention import decode_attention_reference
from voicechat.kernels.qkv_heads import qkv_heads_reference, rope_inv_freq

# Slots per block of the attention's first launch (csrc/ops/decode_attention.cpp): all of them up to
# ATTN_CHUNK (one launch), else ATTN_SPLIT_CHUNK a block and a merge launch.
ATTN_CHUNK, ATTN_SPLIT_CHUNK = 1024, 256


def attn_chunking(cap, chunked=False):
    """(slots per chunk, chunks) of the first launch over `cap` slots (`chunked`: split at any cap)."""
    ch = ATTN_CHUNK if cap <= ATTN_CHUNK and not chunked else ATTN_SPLIT_CHUNK
    return ch, -(-cap // ch)


# (B, H, HK, CAP, D): the TTS's heads over two chunks of slots, grouped heads, one chunk, a head dim
# that is no multiple of 4 (the scalar key loads)
ATTN_CONFIGS = {"attn_tts": (2, 4, 4, 1300, 72), "attn_gqa": (1, 4, 2, 1500, 40), "attn_single": (2, 4, 4, 300, 72),
                "attn_odd_dim": (1, 2, 1, 1100, 42)}
# the plain kernel writing the new key and value in place: the LLM's grouped heads in one chunk, and
# over several chunks
ATTN_WRITE_CONFIGS = {"attn_write_llm": (1, 8, 2, 300, 64), "attn_write_chunks": (2, 4, 2, 1300, 40)}
# sessions stepped together (the LLM's decode step at a position a row, chunked, writing in place):
# three rows at their own positions in buffers of the longest one's capacity, and each row alone in
# buffers of its own (smaller) capacity
ATTN_ROWS_CONFIGS = {"attn_rows": (3, 8, 2, 1300, 64)}
ROWS_OWN_CAPS = {"attn_rows": (256, 800, 1300), "attn_qkv_rows": (256, 800, 1300)}
ROWS_POSITIONS = {"attn_rows": (5, 700, 1299), "attn_qkv_rows": (5, 700, 1299)}
# the TTS step's form for sessions stepped together (the head norms and RoPE at a position a row)
ATTN_QKV_ROWS_CONFIGS = {"attn_qkv_rows": (3, 4, 2, 1300, 72, mx.bfloat16)}
# (B, H, HK, CAP, D, qkv's dtype, WRITE) of the attention from the stacked projection: the TTS step
# over several chunks and over one, writing the cache in place over one and several chunks, grouped
# heads with a bfloat16 projection
ATTN_QKV_CONFIGS = {"attn_qkv_tts": (2, 4, 4, 1300, 72, mx.float32, False),
                    "attn_qkv_single": (2, 4, 4, 300, 72, mx.float32, False),
                    "attn_qkv_write": (2, 4, 4, 300, 72, mx.float32, True),
                    "attn_qkv_write_chunks": (2, 4, 2, 1300, 72, mx.float32, True),
                    "attn_qkv_gqa_bf16": (1, 4, 2, 1500, 40, mx.bfloat16, False),
                    "attn_qkv_tiny": (2, 4, 4, 32, 24, mx.float32, True)}


def combine_case(b, h, cap, d):
    return Case("vc_decode_attn_combine", dict(D=d, CH=ATTN_SPLIT_CHUNK, THREADS=128),
                [mx.zeros((b * h * attn_chunking(cap)[1], d + 2)), mx.array([cap], mx.int32)],
                [("float", (b * h, d))], b * h, 128)


def attention_cases(tag, b, h, hk, cap, d, write=False, chunked=False, row_pos=False):
    """The plain kernel's launch and its merge (inputs set per test); `row_pos`: a position and slot a
    batch row."""
    ch, nc = attn_chunking(cap, chunked)
    q, kv = mx.zeros((b, h, 1, d)), mx.zeros((b, hk, cap, d))
    single = nc == 1 and not chunked  # one chunk: the part kernel writes the result
    new = mx.zeros((b, hk, 1, d))
    positions = mx.zeros((b if row_pos else 1,), mx.int32)
    part = Case("vc_decode_attn_part", dict(D=d, H=h, HK=hk, CH=ch, THREADS=256, SINGLE=single, WRITE=write,
                                            ROW_POS=row_pos, SCALE_BITS=float_bits(d**-0.5)),
                [q, kv, kv, positions, mx.array([cap], mx.int32), new, new, positions],
                [("float", (b * h * nc, d if single else d + 2))], b * h * nc, 256, written=(1, 2) if write else ())
    return {f"{tag}_part": (part, None), f"{tag}_combine": (combine_case(b, h, cap, d), None)}


def attention_qkv_cases(tag, b, h, hk, cap, d, dtype, write, chunked=False, row_pos=False):
    ch, nc = attn_chunking(cap, chunked)
    single = nc == 1 and not chunked
    kv = mx.zeros((b, hk, cap, d))
    positions = mx.zeros((b if row_pos else 1,), mx.int32)
    inputs = [mx.zeros((b, 1, (h + 2 * hk) * d), dtype), mx.zeros((d,)), mx.zeros((d,)), mx.zeros((d // 2,)),
              kv, kv, positions, mx.array([cap], mx.int32), positions]
    part = Case("vc_decode_attn_qkv_part",
                dict(D=d, H=h, HK=hk, CH=ch, THREADS=256, SINGLE=single, TX=dtype, WRITE=write, ROW_POS=row_pos,
                     SCALE_BITS=float_bits(256**-0.5), EPS_BITS=float_bits(1e-6)),
                inputs, [("float", (b * h * nc, d if single else d + 2)), ("float", (b, hk, 1, d)),
                         ("float", (b, hk, 1, d))], b * h * nc, 256, written=(4, 5) if write else ())
    return {tag: (part, None), f"{tag}_combine": (combine_case(b, h, cap, d), None)}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    cases = {}
    for tag, config in ATTN_CONFIGS.items():
        cases.update(attention_cases(tag, *config))
    for tag, config in ATTN_WRITE_CONFIGS.items():
        cases.update(attention_cases(tag, *config, write=True))
    for tag, config in ATTN_QKV_CONFIGS.items():
        cases.update(attention_qkv_cases(tag, *config))
    for tag, (b, h, hk, cap, d) in ATTN_ROWS_CONFIGS.items():
        cases.update(attention_cases(tag, b, h, hk, cap, d, write=True, chunked=True, row_pos=True))
        for i, own_cap in enumerate(ROWS_OWN_CAPS[tag]):
            cases.update(attention_cases(f"{tag}_alone{i}", 1, h, hk, own_cap, d, write=True, chunked=True))
    for tag, (b, h, hk, cap, d, dtype) in ATTN_QKV_ROWS_CONFIGS.items():
        cases.update(attention_qkv_cases(tag, b, h, hk, cap, d, dtype, True, chunked=True, row_pos=True))
        for i, own_cap in enumerate(ROWS_OWN_CAPS[tag]):
            cases.update(attention_qkv_cases(f"{tag}_alone{i}", 1, h, hk, own_cap, d, dtype, True, chunked=True))
    return emulate(tmp_path_factory, "decode_attention", cases)


def _attention_inputs(b, h, hk, cap, d, seed):
    """Random q [B, H, 1, D], buffers k, v [B, HK, CAP, D] and a new key and value [B, HK, 1, D]."""
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(seed), 5)
    return (mx.random.normal((b, h, 1, d), key=k1), mx.random.normal((b, hk, cap, d), key=k2),
            mx.random.normal((b, hk, cap, d), key=k3), mx.random.normal((b, hk, 1, d), key=k4),
            mx.random.normal((b, hk, 1, d), key=k5))


def _with_inputs(case: Case, inputs) -> Case:
    launch = copy.copy(case)
    launch.inputs = inputs
    return launch


def _merged(emulated, tag, out, cap, folder, chunked=False):
    """The attention's second launch (beyond ATTN_CHUNK slots, or `chunked`): the chunks' partial
    softmaxes merged."""
    if cap <= ATTN_CHUNK and not chunked:
        return out
    combine = _with_inputs(emulated.cases[f"{tag}_combine"], [mx.array(out), mx.array([cap], mx.int32)])
    (merged,) = emulated.run(f"{tag}_combine", combine, folder)
    return merged


def _run_plain_part(emulated, tag, q, k, v, offset, cap, k_new, v_new, slot, folder):
    """The plain attention's launch(es) on these inputs: its outputs, the first merged (`_merged`)."""
    part = _with_inputs(emulated.cases[f"{tag}_part"], [q, k, v, mx.array([offset], mx.int32),
                                                        mx.array([cap], mx.int32), k_new, v_new,
                                                        mx.array([slot], mx.int32)])
    out, *rest = emulated.run(f"{tag}_part", part, folder)
    return [_merged(emulated, tag, out, cap, folder + "_c"), *rest]


@pytest.mark.parametrize("tag", list(ATTN_CONFIGS))
@pytest.mark.parametrize("offset", [0, 10, 270, 1100, 5000])
@pytest.mark.parametrize("with_new", [False, True])
def test_decode_attention_kernels_emulated(emulated, tag, offset, with_new):
    """Slot 0 only, one pass of a warp only partly, passes of several warps (the second chunk
    empty), into the second chunk, all (a full ring); `attn_single`: one chunk, no merge launch.
    `with_new`: the new key and value read in the position's slot (as the TTS backbone's step does)
    instead of the buffers'."""
    b, h, hk, cap, d = ATTN_CONFIGS[tag]
    q, k, v, k_new, v_new = _attention_inputs(b, h, hk, cap, d, seed=offset + d)
    slot = offset % cap if with_new else -1
    (out,) = _run_plain_part(emulated, tag, q, k, v, offset, cap, k_new, v_new, slot, f"{tag}_{offset}_{int(with_new)}")
    with mx.stream(mx.cpu):
        new = (k_new, v_new, mx.array(slot, mx.int32)) if with_new else None
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), d**-0.5, new=new)
    np.testing.assert_allclose(out.reshape(b, 1, h * d), np.array(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tag", list(ATTN_WRITE_CONFIGS))
@pytest.mark.parametrize("offset", [0, 37, 299])
def test_decode_attention_writes_the_new_key_in_place_emulated(emulated, tag, offset):
    """WRITE: the same attention as reading the new key and value in their slot, and the buffers
    hold them there afterwards, every other slot untouched."""
    b, h, hk, cap, d = ATTN_WRITE_CONFIGS[tag]
    q, k, v, k_new, v_new = _attention_inputs(b, h, hk, cap, d, seed=offset + d + 1)
    out, k_after, v_after = _run_plain_part(emulated, tag, q, k, v, offset, cap, k_new, v_new, offset,
                                            f"{tag}_{offset}_write")
    with mx.stream(mx.cpu):
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), d**-0.5,
                                          new=(k_new, v_new, mx.array(offset, mx.int32)))
    np.testing.assert_allclose(out.reshape(b, 1, h * d), np.array(want), rtol=2e-5, atol=2e-5)
    for after, before, new in ((k_after, k, k_new), (v_after, v, v_new)):
        want_buf = np.array(before).copy()
        want_buf[:, :, offset] = np.array(new)[:, :, 0]
        np.testing.assert_array_equal(after, want_buf)


@pytest.mark.parametrize("tag", list(ATTN_QKV_CONFIGS))
@pytest.mark.parametrize("offset", [0, 10, 270, 1100, 5000])
def test_decode_attention_from_qkv_kernel_emulated(emulated, tag, offset):
    """The head preparation inside the attention equals qkv_heads then the attention with the new
    key in the position's slot; the key and value it writes out equal qkv_heads' k and v."""
    b, h, hk, cap, d, dtype, write = ATTN_QKV_CONFIGS[tag]
    keys = mx.random.split(mx.random.key(offset + d + 1), 5)
    qkv = (2.0 * mx.random.normal((b, 1, (h + 2 * hk) * d), key=keys[0])).astype(dtype)
    q_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[1])
    k_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[2])
    inv_freq = rope_inv_freq(d, 1e4)
    k, v = mx.random.normal((b, hk, cap, d), key=keys[3]), mx.random.normal((b, hk, cap, d), key=keys[4])
    slot, scale = offset % cap, 256**-0.5
    case = _with_inputs(emulated.cases[tag], [qkv, q_scale, k_scale, inv_freq, k, v, mx.array([offset], mx.int32),
                                              mx.array([cap], mx.int32), mx.array([slot], mx.int32)])
    folder = f"{tag}_{offset}"
    out, k_new, v_new, *written = emulated.run(tag, case, folder)
    out = _merged(emulated, tag, out, cap, folder + "_c")
    if write:  # the new key and value stored in the slot, every other slot as it was
        for after, before, new in zip(written, (k, v), (k_new, v_new)):
            want_buffer = np.array(before)
            want_buffer[:, :, slot] = new[:, :, 0]
            np.testing.assert_array_equal(after, want_buffer)
    else:
        assert not written
    with mx.stream(mx.cpu):
        q, want_k, want_v = qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, h, hk, 1e-6)
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), scale,
                                          new=(want_k, want_v, mx.array(slot, mx.int32)))
    np.testing.assert_allclose(k_new, np.array(want_k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_new, np.array(want_v), rtol=0, atol=0)
    np.testing.assert_allclose(out.reshape(b, 1, h * d), np.array(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tag", list(ATTN_ROWS_CONFIGS))
def test_rows_at_their_own_positions_have_the_bits_of_each_row_alone(emulated, tag):
    """A position and slot a batch row (ROW_POS, chunked, writing the new key in place): each row's
    output equals, bit for bit, the launch of that row alone over buffers of its own capacity (the
    chunks' sums do not depend on the capacity), and the reference; each row's new key and value land
    in its own slot."""
    b, h, hk, cap, d = ATTN_ROWS_CONFIGS[tag]
    positions = ROWS_POSITIONS[tag]
    q, k, v, k_new, v_new = _attention_inputs(b, h, hk, cap, d, seed=d)
    rows = mx.array(positions, mx.int32)
    part = _with_inputs(emulated.cases[f"{tag}_part"], [q, k, v, rows, mx.array([cap], mx.int32), k_new, v_new, rows])
    out, k_after, v_after = emulated.run(f"{tag}_part", part, f"{tag}_rows")
    together = _merged(emulated, tag, out, cap, f"{tag}_rows_c", chunked=True).reshape(b, 1, h * d)
    with mx.stream(mx.cpu):
        want = decode_attention_reference(q, k, v, rows, d**-0.5, new=(k_new, v_new, rows))
    np.testing.assert_allclose(together, np.array(want), rtol=2e-5, atol=2e-5)
    for i, (own_cap, p) in enumerate(zip(ROWS_OWN_CAPS[tag], positions)):
        name = f"{tag}_alone{i}"
        alone_in = [q[i:i + 1], k[i:i + 1, :, :own_cap], v[i:i + 1, :, :own_cap], mx.array([p], mx.int32),
                    mx.array([own_cap], mx.int32), k_new[i:i + 1], v_new[i:i + 1], mx.array([p], mx.int32)]
        out_i, *_ = emulated.run(f"{name}_part", _with_inputs(emulated.cases[f"{name}_part"], alone_in), name)
        alone = _merged(emulated, name, out_i, own_cap, name + "_c", chunked=True)
        np.testing.assert_array_equal(together[i], alone.reshape(1, h * d), err_msg=f"row {i}")
        for after, before, new in ((k_after, k, k_new), (v_after, v, v_new)):
            want_row = np.array(before[i]).copy()
            want_row[:, p] = np.array(new[i])[:, 0]
            np.testing.assert_array_equal(after[i], want_row)


@pytest.mark.parametrize("tag", list(ATTN_QKV_ROWS_CONFIGS))
def test_qkv_rows_at_their_own_positions_have_the_bits_of_each_row_alone(emulated, tag):
    """The TTS form at a position and slot a batch row (ROW_POS, chunked, writing in place): each
    row's attention, new key and new value equal, bit for bit, that row's launch alone over buffers
    of its own capacity, its q and key rotated at its own position; and the reference."""
    b, h, hk, cap, d, dtype = ATTN_QKV_ROWS_CONFIGS[tag]
    positions = ROWS_POSITIONS[tag]
    keys = mx.random.split(mx.random.key(d), 5)
    qkv = (2.0 * mx.random.normal((b, 1, (h + 2 * hk) * d), key=keys[0])).astype(dtype)
    q_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[1])
    k_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[2])
    inv_freq = rope_inv_freq(d, 1e4)
    k, v = mx.random.normal((b, hk, cap, d), key=keys[3]), mx.random.normal((b, hk, cap, d), key=keys[4])
    rows = mx.array(positions, mx.int32)
    case = _with_inputs(emulated.cases[tag], [qkv, q_scale, k_scale, inv_freq, k, v, rows, mx.array([cap], mx.int32),
                                              rows])
    out, k_new, v_new, k_after, v_after = emulated.run(tag, case, f"{tag}_rows")
    together = _merged(emulated, tag, out, cap, f"{tag}_rows_c", chunked=True).reshape(b, 1, h * d)
    with mx.stream(mx.cpu):
        q, want_k, want_v = qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, rows, h, hk, 1e-6)
        want = decode_attention_reference(q, k, v, rows, 256**-0.5, new=(want_k, want_v, rows))
    np.testing.assert_allclose(k_new, np.array(want_k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(together, np.array(want), rtol=2e-5, atol=2e-5)
    for i, (own_cap, p) in enumerate(zip(ROWS_OWN_CAPS[tag], positions)):
        name = f"{tag}_alone{i}"
        alone_in = [qkv[i:i + 1], q_scale, k_scale, inv_freq, k[i:i + 1, :, :own_cap], v[i:i + 1, :, :own_cap],
                    mx.array([p], mx.int32), mx.array([own_cap], mx.int32), mx.array([p], mx.int32)]
        out_i, k_i, v_i, *_ = emulated.run(name, _with_inputs(emulated.cases[name], alone_in), name)
        alone = _merged(emulated, name, out_i, own_cap, name + "_c", chunked=True)
        np.testing.assert_array_equal(together[i], alone.reshape(1, h * d), err_msg=f"row {i}")
        np.testing.assert_array_equal(k_new[i], k_i[0])
        np.testing.assert_array_equal(v_new[i], v_i[0])
        for after, before, new in ((k_after, k, k_new), (v_after, v, v_new)):
            want_row = np.array(before[i]).copy()
            want_row[:, p] = np.array(new[i])[:, 0]
            np.testing.assert_array_equal(after[i], want_row)
