"""Evaluating every array a module holds, the derived private ones too."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def evaluate_held(*modules: nn.Module) -> None:
    """Evaluate every array the modules hold, the derived private ones too (norm scales, RoPE
    frequencies, stacked projections, codebook views): a compiled step that closes over a lazy
    array computes it again at every call, one made on this thread's default stream cannot be
    evaluated from another thread, and one left lazy is built by the first step that reads it, on
    whatever thread runs that step."""
    mx.eval([a for m in modules for _, a in tree_flatten(m) if isinstance(a, mx.array)])
