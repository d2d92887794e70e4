"""The compiled LLM step in a long pipelined chain, for a host profile of the steady state: one
process builds the full-size LM, runs the chain once untimed (every kernel compiled, or read from
the PTX cache, before it counts), then `steady_chain` for STEPS steps. Under py-spy, pass
`steady_chain` as tools/gpu/host_profile.py's filter: only the steady state's samples count.

    cd benchmarks && PYTHONPATH=... python3 ../tools/gpu/host_loop.py [--size full] [--steps 3000]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

sys.path.insert(0, ".")
from profile_llm_step import CONTEXT, _lm, prime  # noqa: E402


def _chain(lm, primed, audio, text, function, steps: int) -> float:
    """Seconds a step: each fed the previous step's ids, queued with `mx.async_eval`."""
    cache = primed.copy()
    mx.eval(cache.state)
    t, f = text, function
    t0 = time.perf_counter()
    for i in range(steps):
        t, f = lm.decode(t, audio[:, CONTEXT + i % 64 : CONTEXT + i % 64 + 1], f, cache)
        t, f = t[:, None], f[:, None]
        mx.async_eval(t, f, *cache.state)
    mx.eval(t, f)
    return (time.perf_counter() - t0) / steps


def warm_up(*args) -> float:
    return _chain(*args)


def steady_chain(*args) -> float:
    # its own name, apart from the warm-up's: the profile's filter keeps only this one's samples
    return _chain(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    lm = _lm(args.size)
    audio, primed, text, function = prime(lm, CONTEXT, 65)
    warm = warm_up(lm, primed, audio, text, function, 40)
    print(f"warm-up chain: {1e3 * warm:.2f} ms a step", flush=True)
    print(f"steady chain: {1e3 * steady_chain(lm, primed, audio, text, function, args.steps):.3f} ms a step",
          flush=True)


if __name__ == "__main__":
    main()
