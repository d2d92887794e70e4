#!/usr/bin/env bash
# Developer loop: build voicechat._ext in build/dev and drop it into python/voicechat/, so that
# `PYTHONPATH=python pytest` runs the source tree without reinstalling.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
cmake -S "$root" -B "$root/build/dev" -G Ninja -DPython_EXECUTABLE="$(command -v "$py")" >/dev/null
cmake --build "$root/build/dev" -j "${JOBS:-2}"
cp "$root"/build/dev/_ext*.so "$root/build/dev/_build_config.py" "$root/python/voicechat/"
