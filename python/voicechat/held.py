"""Arrays a module derives from its weights and keeps (held), and evaluating all it holds."""

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


def hold(module: nn.Module, name: str, sources: tuple[mx.array, ...], derived) -> None:
    """Keep `derived` (arrays made from `sources`) under the private key `name` of `module`: out of
    the checkpoint's key tree (`parameters()`), evaluated with the module's arrays."""
    module[name] = (tuple(sources), derived)


def held(module: nn.Module, name: str, sources: tuple[mx.array, ...]):
    """What `hold` kept under `name`, while `sources` are still the arrays it was made from; None
    once any was replaced (a dtype change, a reload), until its owner holds it again."""
    kept = module.get(name)
    if kept is None or len(kept[0]) != len(sources) or any(a is not b for a, b in zip(kept[0], sources)):
        return None
    return kept[1]
