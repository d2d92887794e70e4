#!/usr/bin/env bash
# The benchmarks on a CUDA machine: voicechat installed with mlx-cuda (its extension built against
# it), then each benchmarks/bench_*.py at full size under pytest-benchmark, one JSON a file in $OUT.
#
#   benchmarks/run_gpu.sh                      # every bench_*.py
#   benchmarks/run_gpu.sh bench_gemv.py ...    # those
#
# PYTHON: the interpreter to install into (default python3); OUT: the results folder (default
# bench-out); VOICECHAT_BENCH_SIZE: tiny or full (default full); SKIP_INSTALL=1: use what is installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
out=${OUT:-$root/bench-out}
export VOICECHAT_BENCH_SIZE=${VOICECHAT_BENCH_SIZE:-full}
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  "$py" -m pip install "mlx[cuda13]==0.32.4" scikit-build-core pybind11==3.1.0 nanobind==3.1.0 cmake ninja
  "$py" -m pip install --no-build-isolation "$root[cuda13,test]"
fi
mkdir -p "$out"
cd "$root"
benches=("$@")
if [[ ${#benches[@]} -eq 0 ]]; then
  benches=(benchmarks/bench_*.py)
fi
status=0
for bench in "${benches[@]}"; do
  bench=benchmarks/$(basename "$bench")
  name=$(basename "$bench" .py)
  echo "== $name" >&2
  "$py" -m pytest "$bench" -q -p no:cacheprovider --benchmark-enable --benchmark-json "$out/$name.json" || status=1
done
exit "$status"
