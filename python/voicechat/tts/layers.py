"""Gemma-style building blocks shared by the TTS backbone, the char encoder and the MoG head."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


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

    def __call__(self, x: mx.array) -> mx.array:
        scale = self._scale if self._scale is not None else 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps)


class GatedMLP(nn.Module):
    """`down(gelu_tanh(gate(x)) * up(x))`, no biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


def prepare_norms(module: nn.Module) -> None:
    """Cache `1 + weight` in every offset norm below `module` (call after loading weights)."""
    for _, m in module.named_modules():
        if isinstance(m, OffsetRMSNorm):
            m.prepare()


def unprepare_norms(module: nn.Module) -> None:
    for _, m in module.named_modules():
        if isinstance(m, OffsetRMSNorm):
            m.unprepare()
