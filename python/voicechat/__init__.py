"""voicechat: NemotronLabs VoiceChat on MLX, with a C++ core.

    import voicechat
    chat = voicechat.load("mlx-community/NemotronLabs-VoiceChat-11B-4bit")
    result = chat.generate("question.wav")
"""

import os

# Greedy ids must equal a float32 computation: keep MLX's CUDA backend from running float32
# matmuls through TF32 tensor cores (its default). Read once, at the first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def cache_root() -> str:
    """The user's cache folder: $XDG_CACHE_HOME, else ~/.cache (voicechat's caches live in its
    `voicechat/` folder)."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def _persistent_kernel_cache() -> None:
    """Keep MLX-CUDA's compiled kernels across reboots (its default is the temp dir): a full-size
    first run compiles minutes of kernels. Per MLX version, as MLX keys its own kernels by name
    only (ours carry a hash of their source in the name). An explicit MLX_PTX_CACHE_DIR wins.

    MLX-CUDA 0.32.4 keeps none of our kernels there (it asks for no disk cache for custom kernels):
    beside it, the folder our kernels' texts are #included from (VOICECHAT_KERNEL_TEXT_DIR; set it
    empty to hand MLX the texts themselves, which costs host time at every launch), and the cubins
    of our own launch (VOICECHAT_CUBIN_DIR; csrc/cuda/own_launch.h)."""
    root = cache_root()
    os.environ.setdefault("VOICECHAT_KERNEL_TEXT_DIR", os.path.join(root, "voicechat", "kernel-text"))
    # our own launch's cubins (on a CUDA build unless VOICECHAT_OWN_LAUNCH=0), each file beside its text
    os.environ.setdefault("VOICECHAT_CUBIN_DIR", os.path.join(root, "voicechat", "cubin"))
    if "MLX_PTX_CACHE_DIR" in os.environ:
        return
    mlx_version = _mlx_version()
    if mlx_version is None:
        return
    os.environ["MLX_PTX_CACHE_DIR"] = os.path.join(root, "voicechat", f"mlx-{mlx_version}", "ptx")


def _mlx_version() -> str | None:
    """The installed mlx's version, without importing it: from the name of its one dist-info folder
    beside the package (`mlx-<version>.dist-info`, names normalized), else from importlib.metadata,
    whose import is most of `import voicechat`'s time."""
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    if spec is None:
        return None
    for location in spec.submodule_search_locations or []:
        parent = os.path.dirname(location)
        try:
            found = [e[len("mlx-"):-len(".dist-info")] for e in os.listdir(parent)
                     if e.startswith("mlx-") and e.endswith(".dist-info")]
        except OSError:
            continue
        if len(found) == 1 and "-" not in found[0]:
            return found[0]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx")
    except PackageNotFoundError:
        return None


_persistent_kernel_cache()

__version__ = "0.1.0"


def __getattr__(name: str):
    # The API lives in voicechat.session, voicechat.live and voicechat.engine; imported on first use so
    # `import voicechat` stays light.
    if name in ("load", "VoiceChat", "Result", "InputError", "ModelBusy"):
        from . import session

        return getattr(session, name)
    if name in ("LiveSession", "Frame", "ContextFull"):
        from . import live

        return getattr(live, name)
    if name == "precompile":
        from .precompile import precompile

        return precompile
    if name in ("Engine", "EngineFull"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'voicechat' has no attribute {name!r}")
