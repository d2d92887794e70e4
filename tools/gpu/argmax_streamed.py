"""The two-head argmax at the published heads' shape (2 x 131072 x 4480, 4-bit, random weights), one
row of float32 and of bfloat16 x, in the block layout (streamed=0) and on the streamed integer-MMA walk
(streamed=1), each launched twice: the program tools/gpu/argmax_streamed.sh runs under Nsight Compute.
Prints whether the two layouts gave the same ids (a near-tie rounded apart can differ; the tests hold
each to MLX's own argmax).

    PYTHONPATH=python python tools/gpu/argmax_streamed.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_gemv import random_head  # noqa: E402

from voicechat.kernels.gemv import two_head_argmax  # noqa: E402
from voicechat.testing import full_config  # noqa: E402


def main() -> None:
    cfg = full_config().text_config
    head_a, head_b = random_head(cfg.vocab_size, cfg.hidden_size, 1), random_head(cfg.vocab_size, cfg.hidden_size, 2)
    for dtype in (mx.float32, mx.bfloat16):
        h = mx.random.normal((1, cfg.hidden_size), key=mx.random.key(3)).astype(dtype)
        ids = {}
        for streamed in (0, 1):
            for _ in range(2):
                ids[streamed] = two_head_argmax(h, head_a, head_b, streamed=streamed)
                mx.eval(ids[streamed])
        same = ids[0].tolist() == ids[1].tolist()
        print(f"{dtype}: block layout ids {ids[0].tolist()}, streamed {ids[1].tolist()}"
              f"{'' if same else ' (differ)'}", flush=True)


if __name__ == "__main__":
    main()
