#!/usr/bin/env bash
# On the lent H200, after a build into /tmp/site2 (session.sh PARTS=none, or ab_trees.sh), carrying
# `.whl` with py-spy's wheel (`pip download --no-deps -d .whl py-spy`): the host's time in the LLM
# step and the TTS step (full size, compiled), sampled with native frames (libmlx's symbols), and
# tools/gpu/host_profile.py's summary of each: which of MLX's functions the ~15 us a launch goes to.
#   export OUT; bash tools/gpu/host_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site2:/tmp/site} MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl >/dev/null 2>&1
SPY=/tmp/pyspy/bin/py-spy
# profile: NAME FILTER COMMAND... Kernels compiled at a step's first call land inside FILTER's frames
# too: run this after something that filled MLX_PTX_CACHE_DIR with the full-size kernels (ab_step.sh,
# bench_e2e), or the cold compiles swamp the launches.
profile() {
  local name=$1 needle=$2; shift 2
  (cd benchmarks && timeout "${HOST_LIMIT:-150}" "$SPY" record --native ${SPY_ARGS:-} --rate "${RATE:-1000}" --format raw \
     -o "$OUT/host_$name.txt" -- ${PY:-python3} "$@" >"$OUT/host_$name.log" 2>&1)
  python3 tools/gpu/host_profile.py "$OUT/host_$name.txt" "$needle" "${TOP:-40}" | tee "$OUT/host_$name.summary"
}
profile llm DuplexLM.decode profile_llm_step.py --size "${SIZE:-full}" --compiled-only
profile tts EarTTS.step profile_tts_step.py --size "${SIZE:-full}" --no-parts
