"""The RNNT transcript branch: prediction network, joint network, greedy decoding.

Attribute names mirror the checkpoint:
  stt_model.rnnt_decoder.prediction.embed             Embedding(vocab + 1, pred_hidden); row `blank` unused
  stt_model.rnnt_decoder.prediction.dec_rnn.lstm.N    LSTM layers (torch weight_ih_l{n} ... renamed at load)
  stt_model.rnnt_joint.{enc, pred, joint_net.2}       Linear layers; joint_net.0 is the ReLU

Greedy decoding (spec README): per frame, up to `max_symbols` emissions; the count resets when the
frame advances and, at the limit, the frame advances without another query; the blank id
(= vocab size) is never embedded, its prediction input is zeros. The transcript text is
`voicechat.tokenizer.decode_pieces(ids, pieces)`. `TranscriptStream` decodes a stream of frames a
few at a time, carrying the LSTM state and last token between calls: the same tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import DecoderConfig, JointConfig
from ..kernels.rnnt_greedy import GreedyState, emitted_tokens, initial_state, rnnt_greedy, rnnt_greedy_streams


class PredictionRNN(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h = cfg.pred_hidden
        self.lstm = [nn.LSTM(h, h) for _ in range(cfg.pred_rnn_layers)]


class PredictionNetwork(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size + 1, cfg.pred_hidden)
        self.dec_rnn = PredictionRNN(cfg)


class RNNTDecoder(nn.Module):
    """The prediction network: token -> embedding -> stacked LSTM."""

    def __init__(self, decoder_cfg: DecoderConfig):
        super().__init__()
        self.blank_id = decoder_cfg.vocab_size
        self.hidden = decoder_cfg.pred_hidden
        self.prediction = PredictionNetwork(decoder_cfg)

    def initial_state(self) -> list[tuple[mx.array, mx.array]]:
        return [(mx.zeros((1, self.hidden)), mx.zeros((1, self.hidden))) for _ in self.prediction.dec_rnn.lstm]

    def lstm_weights(self) -> list[tuple[mx.array, mx.array, mx.array]]:
        return [(l.Wx, l.Wh, l.bias) for l in self.prediction.dec_rnn.lstm]

    def step(self, token: int, state: list[tuple[mx.array, mx.array]]):
        """One prediction step from the last emitted token: `(out [1, H] float32, new state)`."""
        if token == self.blank_id:
            x = mx.zeros((1, self.hidden))
        else:
            x = self.prediction.embed(mx.array([token])).astype(mx.float32)
        new_state = []
        for lstm, (h, c) in zip(self.prediction.dec_rnn.lstm, state):
            hs, cs = lstm(x[:, None, :], hidden=h, cell=c)
            h, c = hs[:, -1].astype(mx.float32), cs[:, -1].astype(mx.float32)
            new_state.append((h, c))
            x = h
        return x, new_state


class RNNTJoint(nn.Module):
    """`joint_net(relu(enc(e) + pred(g)))`, logits over vocab + blank."""

    def __init__(self, joint_cfg: JointConfig):
        super().__init__()
        self.enc = nn.Linear(joint_cfg.encoder_hidden, joint_cfg.joint_hidden)
        self.pred = nn.Linear(joint_cfg.pred_hidden, joint_cfg.joint_hidden)
        self.joint_net = [nn.ReLU(), nn.Identity(), nn.Linear(joint_cfg.joint_hidden, joint_cfg.num_classes + 1)]

    def __call__(self, enc_proj: mx.array, pred_out: mx.array) -> mx.array:
        """Logits from an already projected encoder frame and a prediction-network output."""
        x = enc_proj + self.pred(pred_out)
        for layer in self.joint_net:
            x = layer(x)
        return x


class LoopWeights(NamedTuple):
    """What the greedy loop reads besides the frames, in `rnnt_greedy`'s argument order."""

    embed: mx.array
    lstm: list[tuple[mx.array, mx.array, mx.array]]
    pred_w: mx.array
    pred_b: mx.array
    out_w: mx.array
    out_b: mx.array


def loop_weights(decoder: RNNTDecoder, joint: RNNTJoint, host_copies: bool = False) -> LoopWeights:
    """The loop's weights. `host_copies`: float32 copies written from the host, made once. With a
    GPU the arrays live in CUDA managed memory, and the weights the GPU wrote stay in its memory,
    where the CPU loop reads them across the bus; copies the host wrote live in host memory. Same
    values (bfloat16 and float16 widen exactly), so the same tokens."""
    out = joint.joint_net[2]
    weights = LoopWeights(decoder.prediction.embed.weight, decoder.lstm_weights(), joint.pred.weight,
                          joint.pred.bias, out.weight, out.bias)
    if not host_copies:
        return weights

    def host(a: mx.array) -> mx.array:
        return mx.array(np.array(a.astype(mx.float32)))

    return LoopWeights(host(weights.embed), [tuple(host(w) for w in layer) for layer in weights.lstm],
                       *(host(w) for w in weights[2:]))


def greedy_table(
    encoded: mx.array, decoder: RNNTDecoder, joint: RNNTJoint, blank_id: int, max_symbols: int,
    stream: mx.Stream | None = None, weights: LoopWeights | None = None,
) -> mx.array:
    """The greedy decode as a lazy `[F, max_symbols]` int32 table (tokens per frame, -1 padded;
    `emitted_tokens` reads it). The loop runs on the CPU stream `stream` (default: the default one).

    `encoded` `[1, F, d_model]`. The joint's encoder projection of all frames is one matmul; the
    loop itself is one C++ call (VOICECHAT_REFERENCE=1 runs its pure-MLX reference instead).
    `weights`: `loop_weights(decoder, joint, ...)` made beforehand (default: the layers' own).
    """
    w = weights if weights is not None else loop_weights(decoder, joint)
    return rnnt_greedy(_encoder_projection(encoded, joint), w.embed, w.lstm, w.pred_w, w.pred_b, w.out_w, w.out_b,
                       blank_id, max_symbols, stream=stream)


def _encoder_projection(encoded: mx.array, joint: RNNTJoint) -> mx.array:
    """`joint.enc` of every frame of `encoded [1, F, d_model]`: `[F, joint_hidden]` float32."""
    if encoded.ndim != 3 or encoded.shape[0] != 1:
        raise ValueError(f"encoded must be [1, F, d_model], got {tuple(encoded.shape)}")
    return joint.enc(encoded[0].astype(mx.float32)).astype(mx.float32)


class TranscriptStream:
    """`greedy_table` over a stream of encoder frames given a few at a time: each `push` decodes
    its frames from the state the previous one ended with (the LSTM state and the last token, a
    few KB), so the tables of every push, stacked, are the table of one call over every frame."""

    def __init__(self, decoder: RNNTDecoder, joint: RNNTJoint, blank_id: int, max_symbols: int,
                 stream: mx.Stream | None = None, weights: LoopWeights | None = None):
        self.joint, self.blank_id, self.max_symbols, self.stream = joint, blank_id, max_symbols, stream
        self.weights = weights if weights is not None else loop_weights(decoder, joint)
        self.state: GreedyState = initial_state(len(self.weights.lstm), decoder.hidden, blank_id)

    def push(self, encoded: mx.array) -> mx.array:
        """The lazy `[F, max_symbols]` table of these frames (`encoded [1, F, d_model]`)."""
        return push_streams([self], [encoded])[0]


def push_streams(streams: list[TranscriptStream], encoded: list[mx.array]) -> list[mx.array]:
    """`streams[i].push(encoded[i])` for every stream, as one loop over all of them
    (`rnnt_greedy_streams`: the weights read once a step for every stream): the same tables and
    states as each push alone. The streams share one model's weights, blank, `max_symbols` and
    CPU stream."""
    if not streams:
        return []
    first = streams[0]
    if any(s.weights is not first.weights or s.stream is not first.stream for s in streams):
        raise ValueError("push_streams: the transcript streams must share their weights and CPU stream")
    w = first.weights
    projected = [_encoder_projection(e, s.joint) for s, e in zip(streams, encoded)]
    out = rnnt_greedy_streams(projected, w.embed, w.lstm, w.pred_w, w.pred_b, w.out_w, w.out_b, first.blank_id,
                              first.max_symbols, [s.state for s in streams], stream=first.stream)
    tables = []
    for s, (table, state) in zip(streams, out):
        s.state = state
        tables.append(table)
    return tables


def greedy_decode(
    encoded: mx.array, decoder: RNNTDecoder, joint: RNNTJoint, blank_id: int, max_symbols: int
) -> list[int]:
    """Every non-blank id of the utterance (specials included), in emission order."""
    return emitted_tokens(greedy_table(encoded, decoder, joint, blank_id, max_symbols))


def greedy_decode_reference(
    encoded: mx.array, decoder: RNNTDecoder, joint: RNNTJoint, blank_id: int, max_symbols: int
) -> list[int]:
    """The spec's loop word for word, through the modules: every query runs the prediction net."""
    tokens: list[int] = []
    state = decoder.initial_state()
    last = blank_id
    for t in range(encoded.shape[1]):
        e = joint.enc(encoded[:, t].astype(mx.float32))
        for _ in range(max_symbols):
            out, new_state = decoder.step(last, state)
            tok = int(mx.argmax(joint(e, out), axis=-1).item())
            if tok == blank_id:
                break
            tokens.append(tok)
            last, state = tok, new_state
    return tokens
