"""Where the host's time goes in a py-spy profile (`py-spy record --native --format raw`): each
function's inclusive and self share of the samples whose stack passes through FILTER (default: the
LLM step, `DuplexLM.decode`), native frames (libmlx, our extension) and Python ones alike, line
numbers dropped. The question it answers: of the ~15 us of host time an MLX-CUDA launch costs in
the frame loop (against ~4-6 us in tools/gpu/launch_cost.py's bare chains), what is it.

    py-spy record --native --rate 1000 --format raw -o prof.txt -- python3 benchmarks/profile_llm_step.py ...
    python3 tools/gpu/host_profile.py prof.txt [FILTER] [TOP]
"""

from __future__ import annotations

import re
import sys
from collections import Counter


def frame_name(frame: str) -> str:
    """`fn (file:line)` -> `fn (file)`; bare addresses keep only their library."""
    frame = re.sub(r":\d+\)$", ")", frame.strip())
    return re.sub(r"^0x[0-9a-f]+ ", "", frame)


def summarize(lines, needle: str) -> tuple[int, Counter, Counter]:
    total, inclusive, self_ = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit() or needle not in stack:
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        for name in set(frames):
            inclusive[name] += n
        self_[frames[-1]] += n
    return total, inclusive, self_


def main() -> None:
    path = sys.argv[1]
    needle = sys.argv[2] if len(sys.argv) > 2 else "DuplexLM.decode"
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    with open(path) as f:
        total, inclusive, self_ = summarize(f, needle)
    if not total:
        sys.exit(f"host_profile: no samples pass through {needle!r} in {path}")
    print(f"{total} samples through {needle!r}")
    print("inclusive %  self %  function")
    for name, n in inclusive.most_common(top):
        print(f"{100 * n / total:10.1f} {100 * self_[name] / total:7.1f}  {name[:150]}")
    print("-- by self time")
    for name, n in self_.most_common(top // 2):
        print(f"{100 * n / total:10.1f}  {name[:150]}")


if __name__ == "__main__":
    main()
