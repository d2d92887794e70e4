"""voicechat: NemotronLabs VoiceChat on MLX, with a C++ core.

    import voicechat
    chat = voicechat.load("mlx-community/NemotronLabs-VoiceChat-11B-4bit")
    result = chat.generate("question.wav")
"""

import os

# Greedy ids must equal a float32 computation: keep MLX's CUDA backend from running float32
# matmuls through TF32 tensor cores (its default). Read once, at the first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"


def __getattr__(name: str):
    # The API lives in voicechat.session; imported on first use so `import voicechat` stays light.
    if name in ("load", "VoiceChat", "Result"):
        from . import session

        return getattr(session, name)
    raise AttributeError(f"module 'voicechat' has no attribute {name!r}")
