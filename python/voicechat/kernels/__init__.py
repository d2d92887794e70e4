"""The Python face of `voicechat._ext`: each C++ kernel beside its pure-MLX reference.

Each kernel module exposes `name(...)` (the fast path: the C++ kernel, or the reference where a
backend has no path of its own) and `name_reference(...)` (composed MLX ops, obviously right).
Set VOICECHAT_REFERENCE=1 to route every call to the references, for comparisons.
"""

from ._native import build_info, ext, kernel_launch, use_reference

__all__ = ["build_info", "ext", "kernel_launch", "use_reference"]
