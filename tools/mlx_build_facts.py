"""Print `<mlx version>;<backend>` for CMake: the mlx this build links and its backend."""
import importlib.metadata as md
import sys

import mlx.core as mx


def backend() -> str:
    if sys.platform == "darwin":
        return "metal"
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("mlx-cuda") or name.startswith("mlx_cuda"):
            return "cuda"
    return "cpu"


print(f"{mx.__version__};{backend()}", end="")
