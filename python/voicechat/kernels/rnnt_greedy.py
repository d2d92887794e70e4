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
Returns `[F, max_symbols]` int32: the tokens emitted at each frame, then -1. The prediction
network only changes when a token is emitted, so it is evaluated once per emission (and once at
the start), not once per query: same values, fewer LSTM steps. Everything is float32 inside.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ._native import ext, use_reference

LstmWeights = Sequence[tuple[mx.array, mx.array, mx.array]]


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
) -> mx.array:
    """The loop above in composed MLX ops, one host sync per query."""
    frames, hidden = enc_proj.shape[0], embed.shape[1]
    out = np.full((frames, max_symbols), -1, dtype=np.int32)
    state = [(mx.zeros((hidden,)), mx.zeros((hidden,))) for _ in lstm]
    enc = _f32(enc_proj)
    last, pred = blank_id, None
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
    return mx.array(out)


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
) -> mx.array:
    """The C++ loop, on a CPU stream (the loop is data-dependent and sequential): `stream`, or
    the default CPU stream. Lazy like any op: `mx.async_eval` of the result on a stream of its
    own (`mx.new_stream(mx.cpu)`) runs the loop beside the GPU's work. `threads`: the loop's worker
    threads (0: by the model's size, up to half the cores); every count gives the same tokens."""
    if use_reference():
        return rnnt_greedy_reference(enc_proj, embed, lstm, pred_w, pred_b, out_w, out_b, blank_id, max_symbols)
    flat = [w for layer in lstm for w in layer]
    return ext.rnnt_greedy(enc_proj, embed, flat, pred_w, pred_b, out_w, out_b, int(blank_id), int(max_symbols),
                           threads=int(threads), stream=stream)


def emitted_tokens(table: mx.array) -> list[int]:
    """The `[F, max_symbols]` table as one id list in emission order."""
    ids = np.array(table).reshape(-1)
    return [int(i) for i in ids[ids >= 0]]
