#!/usr/bin/env bash
# On the lent H200, after tools/gpu/ab_trees.sh built the working tree into /tmp/site2 and the old
# one (.abold) into /tmp/siteA: the compiled LLM step (profile_llm_step, full size) in alternating
# processes, new / old / new / old ... (ROUNDS pairs, default 2; WARM=1, the default, runs both trees once
# first, untimed and at once, for their kernel compiles), every result in $OUT/llm_<arm><i>.json
# and one "arm i: waited min / median, pipelined" line each.
#   export OUT; ROUNDS=2 bash tools/gpu/ab_step.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx-ab}
# step SITE LIMIT [ARGS]: one profile_llm_step process on the tree installed in SITE
step() {
  (cd benchmarks && PYTHONPATH=$1:/tmp/site timeout "$2" python3 profile_llm_step.py --size full --compiled-only "${@:3}")
}
if [ "${WARM:-1}" = 1 ]; then  # both trees' first processes at once, untimed: their kernel compiles
  step /tmp/site2 "${WARM_LIMIT:-150}" >/dev/null 2>&1 &
  step /tmp/siteA "${WARM_LIMIT:-150}" >/dev/null 2>&1 &
  wait
fi
for i in $(seq 1 "${ROUNDS:-2}"); do
  for arm in new old; do
    site=/tmp/site2; [ "$arm" = old ] && site=/tmp/siteA
    step "$site" "${STEP_LIMIT:-70}" --json "$OUT/llm_$arm$i.json" >"$OUT/llm_$arm$i.log" 2>&1
    echo "$arm $i: $(grep -E "sync_step|pipelined" "$OUT/llm_$arm$i.log" | tr -s ' ' | paste -sd ';' -)"
  done
done
