#!/usr/bin/env bash
# Developer loop: build in build/dev and install into python/ as a wheel would (voicechat/_ext,
# libvoicechat_kernels, include/, share/cmake/), so that `PYTHONPATH=python pytest` runs the source
# tree without reinstalling.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
cmake -S "$root" -B "$root/build/dev" -G Ninja -DPython_EXECUTABLE="$(command -v "$py")" >/dev/null
cmake --build "$root/build/dev" -j "${JOBS:-2}"
cmake --install "$root/build/dev" --prefix "$root/python" >/dev/null
