"""The FastConformer of the speech encoder (Network 1) against a float64 NumPy reference written
from the spec (voicechat-port-spec.md, "Network 1", and the README's clarifications): the causal
x8 subsampling, one conformer block (both feed-forward half steps, rel-pos MHSA with the [70, 0]
chunked-limited mask, the convolution module, `norm_out`) and the whole encoder with the
projection, on random weights (`numpy_reference.randomize`). The attention runs on the C++ kernel
and on the composed MLX reference (VOICECHAT_REFERENCE=1)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from numpy_reference import assert_close, dense, f64, layer_norm, randomize, sigmoid, silu, softmax
from voicechat.config import AudioConfig
from voicechat.stt.conformer import Perception

EPS = 1e-5  # the conformer's LayerNorms (README)
LEFT = 70  # att_context_size [70, 0]: frame i sees i - 70 ..= i
# Small widths, all different; the real left context, and enough frames (80) to reach past it.
AUDIO = {
    "preprocessor": {"features": 16},
    "encoder": {"feat_in": 16, "n_layers": 2, "d_model": 24, "n_heads": 3, "subsampling_conv_channels": 6,
                "att_context_size": [LEFT, 0]},
    "decoder": {"pred_hidden": 8, "vocab_size": 5},
    "joint": {"joint_hidden": 8, "encoder_hidden": 24, "pred_hidden": 8, "num_classes": 5},
    "output_dim": 28,
}
MEL_FRAMES = 632  # -> 317 -> 159 -> 80 encoder frames


@pytest.fixture(scope="module", params=["separate", "prepared"])
def perception(request) -> Perception:
    """The encoder as built (q, k and v three layers, every weight sliced or transposed where it is
    used), or prepared as loaded (q, k and v stacked into one; the transposed weights and depthwise
    taps held)."""
    model = Perception(AudioConfig.from_dict(AUDIO))
    randomize(model, seed=3)
    if request.param == "prepared":
        model.encoder.prepare()
    mx.eval(model.parameters())
    return model


@pytest.fixture(params=["kernel", "reference"])
def attention_path(request, monkeypatch):
    """The rel-pos attention as the C++ kernel, or as the composed MLX ops."""
    if request.param == "reference":
        monkeypatch.setenv("VOICECHAT_REFERENCE", "1")
    else:
        monkeypatch.delenv("VOICECHAT_REFERENCE", raising=False)
    return request.param


def random_input(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


# --------------------------------------------------------------------------- the reference

def stage_length(n: int) -> int:
    """A (2, 1)-padded, kernel-3, stride-2 stage: floor((n + 3 - 3) / 2) + 1."""
    return (n + 3 - 3) // 2 + 1


def conv3x3_stride2(x, conv, depthwise: bool):
    """Pad (left 2, right 1) on time and frequency, then a 3x3 stride-2 Conv2d with bias;
    x [B, T, F, C] channels-last, weight [out, 3, 3, in] (MLX layout)."""
    x = np.pad(x, [(0, 0), (2, 1), (2, 1), (0, 0)])
    w = f64(conv.weight)
    t_out, f_out = stage_length(x.shape[1] - 3), stage_length(x.shape[2] - 3)
    out = np.zeros((x.shape[0], t_out, f_out, w.shape[0]))
    for dt in range(3):
        for df in range(3):
            tap = x[:, dt : dt + 2 * t_out : 2, df : df + 2 * f_out : 2, :]
            out += tap * w[:, dt, df, 0] if depthwise else tap @ w[:, dt, df, :].T
    return out + f64(conv.bias)


def pointwise2d(x, conv):
    return dense(x, conv.weight[:, 0, 0, :], conv.bias)


def subsampling_reference(pre_encode, mel):
    """`pre_encode`: [B, T, feat] -> [B, T', d_model]."""
    conv = pre_encode.conv
    relu = lambda a: np.maximum(a, 0.0)  # noqa: E731
    x = relu(conv3x3_stride2(mel[..., None], conv[0], depthwise=False))
    x = relu(pointwise2d(conv3x3_stride2(x, conv[2], depthwise=True), conv[3]))
    x = relu(pointwise2d(conv3x3_stride2(x, conv[5], depthwise=True), conv[6]))
    b, t, f, c = x.shape
    flat = x.transpose(0, 1, 3, 2).reshape(b, t, c * f)  # channel-major: channel c's F bins together
    return dense(flat, pre_encode.out.weight, pre_encode.out.bias)


def relative_position_table(length: int, d_model: int):
    """`[2L - 1, d_model]` for positions L-1 .. -(L-1): sin on even dims, cos on odd,
    `div_i = exp(-2i ln(1e4) / d_model)`."""
    positions = np.arange(length - 1, -length, -1, dtype=np.float64)
    div = np.exp(np.arange(d_model // 2) * (-2.0 * np.log(1e4) / d_model))
    angle = np.outer(positions, div)
    table = np.empty((2 * length - 1, d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    return table


def rel_shift(bd):
    """Left-pad the last axis by one, view as [B, H, P + 1, L], drop the first row, view back."""
    b, h, length, p = bd.shape
    padded = np.concatenate([np.zeros((b, h, length, 1)), bd], axis=-1)
    return padded.reshape(b, h, p + 1, length)[:, :, 1:, :].reshape(b, h, length, p)


def rel_pos_mhsa(x, attn, n_heads: int, table):
    b, length, d = x.shape
    dk = d // n_heads

    def heads(a):
        return a.reshape(a.shape[0], -1, n_heads, dk).transpose(0, 2, 1, 3)

    q, k, v = (heads(dense(x, lin.weight)) for lin in (attn.linear_q, attn.linear_k, attn.linear_v))
    p = heads(dense(table[None], attn.linear_pos.weight))[0]  # [H, 2L - 1, dk]
    q_u = q + f64(attn.pos_bias_u)[:, None, :]
    q_v = q + f64(attn.pos_bias_v)[:, None, :]
    scale = dk**-0.5
    ac = q_u @ k.transpose(0, 1, 3, 2)
    bd = rel_shift(q_v @ p.transpose(0, 2, 1))[..., :length]
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (j <= i) & (j >= i - LEFT)
    scores = np.where(visible, ac * scale + bd * scale, -1e30)
    out = softmax(scores, axis=-1) @ v
    return dense(out.transpose(0, 2, 1, 3).reshape(b, length, d), attn.linear_out.weight)


def conv_module(x, conv):
    """pointwise_conv1 -> GLU (channels) -> left pad k - 1 -> depthwise -> LayerNorm -> SiLU ->
    pointwise_conv2; Conv1d weights [out, k, in] (MLX layout), no biases."""
    d = x.shape[-1]
    y = dense(x, conv.pointwise_conv1.weight[:, 0, :])
    y = y[..., :d] * sigmoid(y[..., d:])
    taps = f64(conv.depthwise_conv.weight)[:, :, 0]  # [d, k]
    kernel, length = taps.shape[1], x.shape[1]
    y = np.pad(y, [(0, 0), (kernel - 1, 0), (0, 0)])
    y = sum(y[:, i : i + length, :] * taps[:, i] for i in range(kernel))
    y = silu(layer_norm(y, conv.batch_norm, EPS))
    return dense(y, conv.pointwise_conv2.weight[:, 0, :])


def feed_forward(x, ff):
    return dense(silu(dense(x, ff.linear1.weight)), ff.linear2.weight)


def block_reference(x, block, n_heads: int, table):
    x = x + 0.5 * feed_forward(layer_norm(x, block.norm_feed_forward1, EPS), block.feed_forward1)
    x = x + rel_pos_mhsa(layer_norm(x, block.norm_self_att, EPS), block.self_attn, n_heads, table)
    x = x + conv_module(layer_norm(x, block.norm_conv, EPS), block.conv)
    x = x + 0.5 * feed_forward(layer_norm(x, block.norm_feed_forward2, EPS), block.feed_forward2)
    return layer_norm(x, block.norm_out, EPS)


# --------------------------------------------------------------------------- tests

def test_subsampling_matches_the_spec(perception):
    """Batch 2, an odd frame count; the output length is n -> n // 2 + 1 three times."""
    mel = random_input((2, 37, 16), seed=1)
    got = perception.encoder.pre_encode(mx.array(mel, mx.float32))
    want = subsampling_reference(perception.encoder.pre_encode, mel)
    assert want.shape == (2, stage_length(stage_length(stage_length(37))), 24) == (2, 6, 24)
    assert_close(got, want)


def test_block_matches_the_spec(perception, attention_path):
    """One block over 80 frames (past the 70-frame context), fed the spec's full position table."""
    block = perception.encoder.layers[0]
    x = random_input((2, 80, 24), seed=2)
    table = relative_position_table(80, 24)
    got = block(mx.array(x, mx.float32), mx.array(table, mx.float32), 0)
    assert_close(got, block_reference(x, block, 3, table))


def test_encoder_and_projection_match_the_spec(perception, attention_path):
    """Mel -> subsampling -> two blocks (the encoder's own windowed position table) -> proj."""
    mel = random_input((1, MEL_FRAMES, 16), seed=4)
    projected, lengths, encoded = perception(mx.array(mel, mx.float32))
    x = subsampling_reference(perception.encoder.pre_encode, mel)
    assert x.shape[1] == 80 and lengths.tolist() == [80]
    table = relative_position_table(80, 24)
    for block in perception.encoder.layers:
        x = block_reference(x, block, 3, table)
    assert_close(encoded, x)
    assert_close(projected, dense(x, perception.proj.weight, perception.proj.bias))


def test_the_reference_reaches_past_the_context():
    """The references' mask leaves frame 79 blind to frames 0..8 and shows it 9..79: moving a key
    older than the context changes nothing, a key at its edge changes the output."""
    model = Perception(AudioConfig.from_dict(AUDIO))
    randomize(model, seed=5)
    attn = model.encoder.layers[0].self_attn
    table = relative_position_table(80, 24)
    x = random_input((1, 80, 24), seed=6)
    base = rel_pos_mhsa(x, attn, 3, table)[0, 79]
    for frame, changes in ((8, False), (9, True)):
        moved = x.copy()
        moved[0, frame] += 1.0
        assert (not np.allclose(rel_pos_mhsa(moved, attn, 3, table)[0, 79], base)) == changes
