"""RNNT greedy decoding of a whole utterance in one call.

    state = zeros; last = blank
    for each frame t:
        repeat up to max_symbols times:
            x = embed[last] (zeros when last is blank); (out, state') = LSTM stack(x, state)
            tok = argmax(out_w @ relu(enc_proj[t] + pred_w @ out + pred_b) + out_b)
            if tok == blank: next frame
            emit tok; last = tok; state = state'

`enc_proj` is the joint's encoder projection of every frame (`joint.enc(encoded)`, `[F, J]`),
computed beforehand in one matmul. `lstm` holds `(Wx, Wh, bias)` per layer (gates i, f, g, o).
Returns `[F, max_symbols]` int32: the tokens emitted at each frame, then -1. Given a `start`, it
starts from that `GreedyState` (the LSTM state and the last emitted token) and also returns the
one it ends with: a stream decoded a few frames at a time gives the tokens of one call. The prediction
network only changes when a token is emitted, so it is evaluated once per emission (and once at
the start), not once per query: same values, fewer LSTM steps. Everything is float32 inside.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from ._native import ext, use_reference

LstmWeights = Sequence[tuple[mx.array, mx.array, mx.array]]


class GreedyState(NamedTuple):
    """Where a greedy decode stands between frames: the LSTM state `[2, layers, hidden]` float32
    (h of every layer, then c) and the last emitted token `[1]` int32 (blank: none yet)."""

    lstm: mx.array
    last: mx.array


def initial_state(layers: int, hidden: int, blank_id: int) -> GreedyState:
    """The state an utterance starts from: zeros, nothing emitted."""
    return GreedyState(mx.zeros((2, layers, hidden), mx.float32), mx.array([blank_id], mx.int32))


def _f32(a: mx.array) -> mx.array:
    return a.astype(mx.float32)


def _prediction(x: mx.array, lstm: LstmWeights, state: list[tuple[mx.array, mx.array]]):
    """One step of the LSTM stack: top-layer output and the new (h, c) per layer."""
    new_state = []
    for (wx, wh, bias), (h, c) in zip(lstm, state):
        gates = x @ _f32(wx).T + h @ _f32(wh).T + _f32(bias)
        i, f, g, o = mx.split(gates, 4, axis=-1)
        c = mx.sigmoid(f) * c + mx.sigmoid(i) * mx.tanh(g)
        h = mx.sigmoid(o) * mx.tanh(c)
        new_state.append((h, c))
        x = h
    return x, new_state


def rnnt_greedy_reference(
    enc_proj: mx.array,
    embed: mx.array,
    lstm: LstmWeights,
    pred_w: mx.array,
    pred_b: mx.array,
    out_w: mx.array,
    out_b: mx.array,
    blank_id: int,
    max_symbols: int,
    start: GreedyState | None = None,
) -> mx.array | tuple[mx.array, GreedyState]:
    """The loop above in composed MLX ops, one host sync per query. With `start`, returns the
    table and the state it ends with (as `rnnt_greedy_from`)."""
    frames, hidden = enc_proj.shape[0], embed.shape[1]
    out = np.full((frames, max_symbols), -1, dtype=np.int32)
    if start is None:
        state = [(mx.zeros((hidden,)), mx.zeros((hidden,))) for _ in lstm]
        last = blank_id
    else:
        state = [(_f32(start.lstm[0, i]), _f32(start.lstm[1, i])) for i in range(len(lstm))]
        last = int(start.last.reshape(-1)[0].item())
    enc = _f32(enc_proj)
    pred = None
    for t in range(frames):
        emitted = 0
        while emitted < max_symbols:
            if pred is None:
                x = mx.zeros((hidden,)) if last == blank_id else _f32(embed[last])
                top, candidate = _prediction(x, lstm, state)
                pred = top @ _f32(pred_w).T + _f32(pred_b)
            logits = mx.maximum(enc[t] + pred, 0.0) @ _f32(out_w).T + _f32(out_b)
            tok = int(mx.argmax(logits).item())
            if tok == blank_id:
                break
            out[t, emitted] = tok
            emitted += 1
            last, state, pred = tok, candidate, None
    if start is None:
        return mx.array(out)
    lstm_state = mx.stack([mx.stack([h for h, _ in state]), mx.stack([c for _, c in state])])
    return mx.array(out), GreedyState(lstm_state, mx.array([last], mx.int32))


def rnnt_greedy(
    enc_proj: mx.array,
    embed: mx.array,
    lstm: LstmWeights,
    pred_w: mx.array,
    pred_b: mx.array,
    out_w: mx.array,
    out_b: mx.array,
    blank_id: int,
    max_symbols: int,
    stream: mx.Stream | None = None,
    threads: int = 0,
    start: GreedyState | None = None,
) -> mx.array | tuple[mx.array, GreedyState]:
    """The C++ loop, on a CPU stream (the loop is data-dependent and sequential): `stream`, or
    the default CPU stream. Lazy like any op: `mx.async_eval` of the result on a stream of its
    own (`mx.new_stream(mx.cpu)`) runs the loop beside the GPU's work. `threads`: the loop's worker
    threads (0: by the model's size, up to half the cores); every count gives the same tokens.

    `start` (see `initial_state`): decode from that state and return `(table, the state after the
    last frame)`, both lazy. Decoding frames in pieces, each from the state the one before ended
    with, gives the table of one call over every frame."""
    if use_reference():
        return rnnt_greedy_reference(enc_proj, embed, lstm, pred_w, pred_b, out_w, out_b, blank_id, max_symbols,
                                     start)
    flat = [w for layer in lstm for w in layer]
    if start is None:
        return ext.rnnt_greedy(enc_proj, embed, flat, pred_w, pred_b, out_w, out_b, int(blank_id), int(max_symbols),
                               threads=int(threads), stream=stream)
    table, state, last = ext.rnnt_greedy_from(enc_proj, embed, flat, pred_w, pred_b, out_w, out_b, int(blank_id),
                                              int(max_symbols), threads=int(threads), stream=stream,
                                              state=start.lstm, last=start.last)
    return table, GreedyState(state, last)


def rnnt_greedy_streams(
    enc_projs: Sequence[mx.array],
    embed: mx.array,
    lstm: LstmWeights,
    pred_w: mx.array,
    pred_b: mx.array,
    out_w: mx.array,
    out_b: mx.array,
    blank_id: int,
    max_symbols: int,
    starts: Sequence[GreedyState],
    stream: mx.Stream | None = None,
    threads: int = 0,
) -> list[tuple[mx.array, GreedyState]]:
    """`rnnt_greedy(..., start=starts[i])` of every stream's frames `enc_projs[i]` `[F_i, J]`, as
    one C++ call: each pass of the loop runs the prediction network for every stream that emitted
    and a joint query for every stream still decoding, reading each weight row once for all of
    them. Each stream gets the table and state it gets alone (the same dot products; tested)."""
    if len(enc_projs) != len(starts):
        raise ValueError(f"rnnt_greedy_streams: {len(enc_projs)} streams' frames but {len(starts)} starts")
    if use_reference():
        return [rnnt_greedy_reference(e, embed, lstm, pred_w, pred_b, out_w, out_b, blank_id, max_symbols, start)
                for e, start in zip(enc_projs, starts)]
    flat = [w for layer in lstm for w in layer]
    out = ext.rnnt_greedy_streams(list(enc_projs), embed, flat, pred_w, pred_b, out_w, out_b, int(blank_id),
                                  int(max_symbols), threads=int(threads), stream=stream,
                                  states=[s.lstm for s in starts], lasts=[s.last for s in starts])
    return [(out[i], GreedyState(out[i + 1], out[i + 2])) for i in range(0, len(out), 3)]


def emitted_tokens(table: mx.array) -> list[int]:
    """The `[F, max_symbols]` table as one id list in emission order."""
    ids = np.array(table).reshape(-1)
    return [int(i) for i in ids[ids >= 0]]
