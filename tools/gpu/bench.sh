#!/usr/bin/env bash
# On the lent H200, after test.sh on the same (warm) machine: full-size benchmarks, one
# pytest-benchmark JSON each under $OUT. Random weights at the published shapes, no files.
#   bash tools/gpu/bench.sh bench_e2e:260 bench_llm:70 ...     (name:timeout-seconds)
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site2:/tmp/site PYTHONUNBUFFERED=1 VOICECHAT_BENCH_SIZE=full
[ $# -gt 0 ] || set -- bench_e2e:260 bench_llm:70 bench_reference_mlx_lm:70 bench_tts:70 bench_codec:60 bench_stt:90
for item in "$@"; do
  name=${item%%:*} limit=${item##*:}
  echo "== $name"
  # a fresh kernel cache for the end-to-end run, so its first generate() pays the JIT as a user would
  env MLX_PTX_CACHE_DIR=/tmp/ptx-$name-$$ timeout -s INT -k 15 "$limit" python3 -m pytest -q -p no:cacheprovider \
    "benchmarks/$name.py" --benchmark-enable --benchmark-min-rounds=5 --benchmark-max-time=0.5 \
    --benchmark-json="$OUT/$name.json" --benchmark-columns=min,median,rounds 2>&1 \
    | grep -vE "^(Legend|  Outliers|  OPS|Wrote)" | tail -20
done
