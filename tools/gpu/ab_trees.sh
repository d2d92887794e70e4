#!/usr/bin/env bash
# On the lent H200 (after the `.gw1` call, carrying `.gw2 .whl .abold`): install the wheels, then
# build the working tree into /tmp/site2 and the old tree in `.abold/` into /tmp/siteA side by side,
# for an A/B of two versions on one machine. Make the old tree here first:
#   rm -rf .abold && mkdir .abold && git archive REV | tar -x -C .abold   (.abold is excluded from git)
# Then run a tool under each: PYTHONPATH=/tmp/site2:/tmp/site (new), /tmp/siteA:/tmp/site (old);
# kernels are named after a hash of their text, so one PTX cache serves both.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash .gw2/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
(python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site2 . >"$OUT/build.log" 2>&1
 echo "new tree: build rc $?") &
(cd .abold && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/siteA . >"$OUT/build_old.log" 2>&1
 echo "old tree: build rc $?") &
wait
