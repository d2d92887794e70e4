# Sourced by a one-call device script (warp_groups.sh, rvq_cluster.sh) after the `.gw1` wheel copy:
# builds the working tree (session.sh, PARTS=none; its logs in $AUX), then sets what the tests and
# tools need (the built tree on PYTHONPATH, the carried WAVs, one kernel cache). OUT defaults to /tmp/out.
# BUILT=1 skips the build: a later call on the same warm machine reuses the last one's /tmp/site2.
set -uo pipefail
OUT=${OUT:-/tmp/out}
AUX=/tmp/aux
mkdir -p "$OUT" "$AUX"
date +%T
if [ "${BUILT:-0}" != 1 ]; then
  OUT=$AUX PARTS=none bash tools/gpu/session.sh 2>&1 | tail -2
  date +%T
fi
export PYTHONPATH=/tmp/site2:/tmp/site VOICECHAT_TEST_WAVS=$PWD/.gpuwav MLX_PTX_CACHE_DIR=/tmp/ptx-ab PYTHONUNBUFFERED=1
