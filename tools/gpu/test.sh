#!/usr/bin/env bash
# On the lent H200 (see ../../docs/developing.md): build voicechat against mlx-cuda and run the test
# suite and the GEMV bandwidth table there. Expects the wheels installed in /tmp/site
# (../shared/tools/gpu-wheels.sh) and pre-made WAVs in .gpuwav/ (no espeak-ng / sox there).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site2 . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/site2:/tmp/site VOICECHAT_TEST_WAVS=$PWD/.gpuwav
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
python3 -c "import voicechat.kernels as k; print(k.build_info())"
# sox is not on the GPU machine: its two tests are left out there.
# pytest-timeout is on the GPU image: one hung test (a GPU kernel that never returns) costs 60 s,
# not the whole run.
timeout -s INT -k 20 "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -rfE --timeout=${PER_TEST_TIMEOUT:-60} ${TESTS:-tests} \
  -k "not other_formats_and_stereo and not stereo_other_rate" --durations=15 2>&1 | tee "$OUT/tests.log" | tail -60
timeout "${GEMV_TIMEOUT:-150}" python3 benchmarks/bench_gemv.py --size full --json "$OUT/gemv.json" ${GEMV_ARGS:-} 2>&1 \
  | tee "$OUT/gemv.log" | tail -45
