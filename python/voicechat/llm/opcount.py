"""Count the primitives a lazy MLX graph would run (per-step op budgets for benchmarks and tests).

Every primitive costs a launch on the GPU (~14 us on CUDA), so the number of primitives per
decode step is a budget we track. `count_ops(*outputs)` walks the unevaluated graph below the
outputs (evaluated arrays, such as loaded weights and cache contents, are leaves) through
`mx.export_to_dot`. A `Compiled` (mx.compile) node counts once however many ops it fuses.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

# Primitives that only re-describe memory (no kernel launch when the input's layout allows it).
VIEWS = frozenset({"Reshape", "Slice", "Transpose", "Squeeze", "ExpandDims", "Broadcast", "AsStrided",
                   "Split", "StopGradient", "Depends"})

# Our CUDA kernels' primitive: MLX's custom kernel, or our own launch's (csrc/cuda/own_launch.h, the
# default on a CUDA build; VOICECHAT_OWN_LAUNCH=0 for MLX's).
OUR_KERNELS = ("CustomKernel", "VoicechatKernel")

_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def _arrays(outputs: tuple[Any, ...]) -> list[mx.array]:
    return [a for _, a in tree_flatten(list(outputs)) if isinstance(a, mx.array)]


def count_ops(*outputs: Any) -> Counter:
    """Primitive name -> count over the unevaluated graph of `outputs` (arrays or trees of them)."""
    return by_kind(op_labels(*outputs))


def by_kind(labels: Counter) -> Counter:
    """`op_labels`' counts with every compiled graph as one kind, "Compiled" (`count_ops`' view)."""
    out = Counter()
    for name, n in labels.items():
        out["Compiled" if name.startswith("Compiled") else name] += n
    return out


def op_labels(*outputs: Any) -> Counter:
    """Like `count_ops`, with each compiled graph under its own label (the fused ops' names)."""
    arrays = _arrays(outputs)
    if not arrays:
        return Counter()
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            text = f.read()
    finally:
        os.unlink(path)
    return Counter(_NODE.findall(text))


def kernel_count(counts: Counter) -> int:
    """Primitives that launch work: all but the view-like ones."""
    return sum(n for name, n in counts.items() if name not in VIEWS)


def custom_kernels(counts: Counter) -> int:
    """Launches of our own CUDA kernels, whichever launch path made them."""
    return sum(counts.get(name, 0) for name in OUR_KERNELS)
