#!/usr/bin/env bash
# On the lent H200, after test.sh on the same (warm) machine: the full-size benchmarks, one
# pytest-benchmark JSON each under $OUT. Random weights at the published shapes, no files.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site2:/tmp/site PYTHONUNBUFFERED=1 VOICECHAT_BENCH_SIZE=full
run() {  # name, timeout, extra env
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  env "$@" timeout "$limit" python3 -m pytest -q -p no:cacheprovider "benchmarks/$name.py" --benchmark-enable \
    --benchmark-min-rounds=5 --benchmark-max-time=0.5 --benchmark-json="$OUT/$name.json" \
    --benchmark-columns=min,median,mean,rounds 2>&1 | grep -vE "^(Legend|  Outliers|  OPS)" | tail -25
}
run bench_e2e "${E2E_TIMEOUT:-260}" MLX_PTX_CACHE_DIR=/tmp/ptx-cold-$$
run bench_llm 70
run bench_reference_mlx_lm 70
run bench_tts 70
run bench_codec 60
run bench_stt 90
