"""Import `voicechat._ext`, refusing clearly when it was built against another mlx."""

from __future__ import annotations

import os

import mlx.core as mx  # the extension links the libmlx that mlx.core has loaded


def _load():
    try:
        from .. import _build_config
    except ImportError:
        raise ImportError(
            "voicechat._ext is not built; install the package with `pip install .` (or run "
            "tools/dev-build.sh in a source checkout)") from None
    if _build_config.MLX_VERSION != mx.__version__:
        raise ImportError(
            f"voicechat._ext was built against mlx {_build_config.MLX_VERSION} but mlx "
            f"{mx.__version__} is installed; reinstall voicechat (`pip install --force-reinstall "
            f"--no-build-isolation voicechat`) or install mlx=={_build_config.MLX_VERSION}.")
    from .. import _ext

    cuda = getattr(mx, "cuda", None)
    if _build_config.BACKEND == "cpu" and cuda is not None and cuda.is_available():
        import warnings

        warnings.warn(
            "voicechat._ext was built against mlx-cpu but mlx-cuda is running: the CUDA kernels are "
            "off (composed MLX ops run instead); reinstall with `pip install --no-build-isolation .` "
            "after `pip install 'mlx[cuda13]==0.32.4'`.", RuntimeWarning, stacklevel=2)
    return _ext


ext = _load()


def build_info() -> dict:
    """Which mlx version and backend the extension was built with."""
    return dict(ext.build_info())


def kernel_launch() -> dict:
    """How this process launches our CUDA kernels: `launch` "own" (compiled by us, the cubins kept on
    disk; csrc/cuda/own_launch.h), "mlx" (MLX's custom kernels: VOICECHAT_OWN_LAUNCH=0, a build without
    ours, or ours failed: `own_launch_fallback` says why), or None (no CUDA kernels here)."""
    backend = build_info()["backend"]
    fallback = ext.own_launch_fallback()
    built, wanted = ext.own_launch()
    cuda = getattr(mx, "cuda", None)
    if backend != "cuda" or cuda is None or not cuda.is_available():
        launch = None
    else:
        launch = "own" if built and wanted and fallback is None else "mlx"
    return {"backend": backend, "launch": launch, "own_launch_fallback": fallback}


def use_reference() -> bool:
    """True when VOICECHAT_REFERENCE asks for the pure-MLX reference paths everywhere."""
    return os.environ.get("VOICECHAT_REFERENCE", "") not in ("", "0", "false", "no")
