"""The MLX environment settings a benchmark ran under, for its JSON: the CUDA backend's graph
capture (`MLX_USE_CUDA_GRAPHS`, ops and size per graph) changes what a step costs on the host,
and an A/B of them is only readable if each result says which arm it was."""

from __future__ import annotations

import os

KNOBS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE",
         "MLX_ENABLE_TF32")


def mlx_env() -> dict[str, str]:
    """The knobs that are set (unset ones take MLX's defaults)."""
    return {k: os.environ[k] for k in KNOBS if k in os.environ}
