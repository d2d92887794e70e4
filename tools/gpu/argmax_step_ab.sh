#!/usr/bin/env bash
# On the lent H200, after a build (tools/gpu/session.sh with PARTS=none): the compiled LLM step
# (profile_llm_step, full size) with the two-head argmax in the block layout (VOICECHAT_ARGMAX_STREAMED=0)
# and on the streamed walk (=1), one tree, alternating processes (ROUNDS pairs, default 2) after (WARM=1, the default) one
# untimed process of each for the kernel compiles; every result in $OUT/argmax_step_<arm><i>.json.
#   export OUT; bash tools/gpu/argmax_step_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=${GEMV_PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1
step() {  # step STREAMED LIMIT [ARGS]
  (cd benchmarks && VOICECHAT_ARGMAX_STREAMED=$1 timeout "$2" python3 profile_llm_step.py --size full --compiled-only "${@:3}")
}
[ "${WARM:-1}" = 1 ] && for s in 0 1; do step $s "${WARM_LIMIT:-120}" >/dev/null 2>&1; done
for i in $(seq 1 "${ROUNDS:-2}"); do
  for s in 1 0; do
    step $s "${STEP_LIMIT:-70}" --json "$OUT/argmax_step_$s$i.json" >"$OUT/argmax_step_$s$i.log" 2>&1
    echo "streamed=$s $i: $(grep -E "sync_step|pipelined" "$OUT/argmax_step_$s$i.log" | tr -s ' ' | paste -sd ';' -)"
  done
done
