"""The TTS frame's RVQ alone on the GPU: a frame's five unmasking runs (the mask schedule's counts
over 31 codebooks of 1024 x 512 bf16) through the chain of a launch per codebook (method "fused")
and through one launch of thread-block clusters a run (method "cluster"), as FRAMES frames in a row,
each run's residual feeding the next (so the runs queue in order, as in the frame). Prints, a method,
the ms a frame: waited (each frame evaluated) and pipelined (one eval at the end), min over rounds,
and checks that the two methods give the same codes. Needs a CUDA GPU and voicechat's own launch.

    PYTHONPATH=... python3 tools/gpu/rvq_timing.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from voicechat.config import TTSConfig
from voicechat.kernels.rvq import codebook_norms, rvq_search

FRAMES = 40
ROUNDS = 7


def frame(residual, books, norms, schedule, method):
    """One frame's runs: codes [1, Q] and the last residual."""
    codes = mx.full((1, books.shape[0]), books.shape[1], mx.int32)  # all masked
    start = 0
    for count in schedule:
        codes, residual = rvq_search(residual, books, start, count, norms, into=codes, method=method)
        start += count
    return codes, residual


def timed(books, norms, schedule, method, waited):
    best = float("inf")
    for _ in range(ROUNDS):
        residual = mx.random.normal((1, books.shape[2]), key=mx.random.key(0))
        mx.eval(residual)
        start = time.perf_counter()
        outs = []
        for _ in range(FRAMES):
            codes, residual = frame(residual * 0.5 + 1.0, books, norms, schedule, method)
            outs.append(codes)
            if waited:
                mx.eval(codes, residual)
        mx.eval(outs, residual)
        best = min(best, (time.perf_counter() - start) / FRAMES)
    return 1e3 * best, np.array(mx.concatenate(outs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    cfg = TTSConfig()
    schedule = [c for c in cfg.mask_schedule if c > 0]
    books = (mx.random.normal((cfg.num_quantizers, cfg.codebook_size, cfg.latent_size), key=mx.random.key(1)) * 0.3)
    books = books.astype(mx.bfloat16)
    norms = codebook_norms(books)
    mx.eval(books, norms)
    result = {"schedule": schedule}
    codes = {}
    for method in ("fused", "cluster"):
        for waited in (True, False):
            ms, codes[method] = timed(books, norms, schedule, method, waited)
            result[f"{method}_{'waited' if waited else 'pipelined'}_ms"] = ms
            print(f"{method:8s} {'waited' if waited else 'pipelined':10s} {ms:.3f} ms a frame", flush=True)
    result["same_codes"] = bool(np.array_equal(codes["fused"], codes["cluster"]))
    print("same codes:", result["same_codes"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
