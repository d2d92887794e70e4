"""Gemma-style building blocks shared by the TTS backbone, the char encoder and the MoG head."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels.add_rms_norm import add_rms_norm, add_rms_norm_guided, add_rms_norm_linear
from ..kernels.gemv import linear, stack_linears


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: `x / rms(x) * (1 + weight)`, computed in float32.

    The stored weight sits around 0; `prepare()` caches `1 + weight` in float32 once the weights
    are loaded so a step does not recompute it (without it the sum is formed on every call).
    """

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps
        self._scale = None

    def prepare(self) -> None:
        self._scale = 1.0 + self.weight.astype(mx.float32)

    def unprepare(self) -> None:
        self._scale = None

    @property
    def scale(self) -> mx.array:
        """`1 + weight` in float32 (cached by `prepare()`)."""
        return self._scale if self._scale is not None else 1.0 + self.weight.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), self.scale, self.eps)


def add_and_norm_linear(h: mx.array, y: mx.array, post: OffsetRMSNorm, pre: OffsetRMSNorm,
                        layer, sessions: int = 1) -> tuple[mx.array, mx.array]:
    """`(h', layer(pre(h')))` with `h' = h + post(y)`: the seam and the next projection, one launch
    on a CUDA GPU for our dense GEMV layers (`kernels.add_rms_norm.add_rms_norm_linear`; `sessions`:
    the rows are that many equal groups, each group's bits those it has alone)."""
    if post.eps != pre.eps:
        h, z = add_and_norm(h, y, post, pre)
        return h, linear(layer, z, sessions=sessions)
    return add_rms_norm_linear(h.astype(mx.float32), y.astype(mx.float32), post.scale, pre.scale, post.eps, layer,
                               sessions=sessions)


def norm_linear(h: mx.array, pre: OffsetRMSNorm, layer, add: mx.array | None = None,
                sessions: int = 1) -> tuple[mx.array, mx.array]:
    """`(h', layer(pre(h')))` with `h' = h + add` (or `h`): an input norm and the projection after it,
    one launch on a CUDA GPU for our dense GEMV layers (`kernels.add_rms_norm.add_rms_norm_linear`
    without post; `sessions` as `add_and_norm_linear`'s)."""
    return add_rms_norm_linear(h.astype(mx.float32), None if add is None else add.astype(mx.float32), None,
                               pre.scale, pre.eps, layer, sessions=sessions)


def add_and_norm_guided(h: mx.array, y: mx.array, post: OffsetRMSNorm, pre: OffsetRMSNorm,
                        guidance: float) -> mx.array:
    """`add_and_norm`'s normed output `z` over a CFG pair `[2, 1, C]`, guided: `z[:1] + guidance *
    (z[:1] - z[1:])`. One launch on a CUDA GPU (`kernels.add_rms_norm.add_rms_norm_guided`)."""
    if post.eps != pre.eps:
        _, z = add_and_norm(h, y, post, pre)
        return z[:1] + guidance * (z[:1] - z[1:])
    return add_rms_norm_guided(h.astype(mx.float32), y.astype(mx.float32), post.scale, pre.scale, post.eps, guidance)


def add_and_norm(h: mx.array, y: mx.array, post: OffsetRMSNorm, pre: OffsetRMSNorm) -> tuple[mx.array, mx.array]:
    """`h' = h + post(y)` and `pre(h')`, the seam between two sandwich-normed sublayers: one
    launch on a CUDA GPU (`kernels.add_rms_norm`), the same ops as the two norms and the add elsewhere."""
    if post.eps != pre.eps:
        h = h + post(y)
        return h, pre(h)
    return add_rms_norm(h.astype(mx.float32), y.astype(mx.float32), post.scale, pre.scale, post.eps)


class GatedMLP(nn.Module):
    """`down(gelu_tanh(gate(x)) * up(x))`, no biases.

    `stack()` (at load time) runs gate and up as one layer of both (one launch, not two)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up = None  # underscore: not a parameter, not in the checkpoint's key tree

    def stack(self) -> None:
        self._gate_up = stack_linears([self.gate_proj, self.up_proj])

    def unstack(self) -> None:
        self._gate_up = None

    def __call__(self, x: mx.array) -> mx.array:
        if self._gate_up is None:
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))
        return self.down_from(self._gate_up(x))

    def down_from(self, gate_up: mx.array, sessions: int = 1) -> mx.array:
        """down_proj(gelu(gate) * up) from the stacked gate/up output (`sessions`: as `linear`'s)."""
        return linear(self.down_proj, gate_up, gated_input=True, sessions=sessions)


def stack_projections(module: nn.Module) -> None:
    """Stack the projections that share an input (`stack()`) in every module below `module` that
    has them (call after loading weights, and after `use_gemv`)."""
    for _, m in module.named_modules():
        if hasattr(m, "stack"):
            m.stack()


def unstack_projections(module: nn.Module) -> None:
    for _, m in module.named_modules():
        if hasattr(m, "unstack"):
            m.unstack()


def prepare_norms(module: nn.Module) -> None:
    """Cache `1 + weight` in every offset norm below `module` (call after loading weights)."""
    for _, m in module.named_modules():
        if isinstance(m, OffsetRMSNorm):
            m.prepare()


def unprepare_norms(module: nn.Module) -> None:
    for _, m in module.named_modules():
        if isinstance(m, OffsetRMSNorm):
            m.unprepare()
