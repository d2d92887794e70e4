#!/usr/bin/env bash
# On the lent H200, after a build into /tmp/site2 (session.sh PARTS=none, or ab_trees.sh), carrying
# `.whl` with py-spy's wheel (`pip download --no-deps -d .whl py-spy`): the host's time in the LLM
# chain (tools/gpu/host_loop.py: its steady chain only, after a warm-up in the same process) and the
# TTS step's chains (full size, compiled), sampled with native frames (libmlx's symbols), and
# tools/gpu/host_profile.py's summary of each: which of MLX's functions the ~15 us a launch goes to.
# RATE 50 by default: native unwinding pauses the process for every sample, and at 1000 Hz py-spy
# fell a minute behind (nineteenth session); --nonblocking cannot take --native.
#   export OUT; bash tools/gpu/host_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site2:/tmp/site} MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl >/dev/null 2>&1
SPY=/tmp/pyspy/bin/py-spy
# profile: NAME FILTER COMMAND... Our kernels are compiled again in every process (MLX-CUDA 0.32.4
# keeps no custom kernel in MLX_PTX_CACHE_DIR): FILTER must name a function that runs only after
# the process's own warm-up, or the compiles swamp the launches.
profile() {
  local name=$1 needle=$2; shift 2
  (cd benchmarks && timeout "${HOST_LIMIT:-150}" "$SPY" record --native ${SPY_ARGS:-} --rate "${RATE:-50}" --format raw \
     -o "$OUT/host_$name.txt" -- ${PY:-python3} "$@" >"$OUT/host_$name.log" 2>&1)
  python3 tools/gpu/host_profile.py "$OUT/host_$name.txt" "$needle" "${TOP:-40}" | tee "$OUT/host_$name.summary"
}
profile llm steady_chain ../tools/gpu/host_loop.py --size "${SIZE:-full}" --steps "${STEPS:-2000}"
# the TTS steps run compiled through profile_tts_step.py's _chain (EarTTS.step caught 2 samples);
# its first chain's compiles are in there too
profile tts "_chain (profile_tts_step" profile_tts_step.py --size "${SIZE:-full}" --no-parts
