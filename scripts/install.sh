#!/usr/bin/env bash
# One install path for the README, CI and the container image: torch is pinned in the same
# pip command as everything else, so nothing resolves a CUDA build on a CPU machine.
#
# With no environment set (README, `make`, CI) it installs this checkout editable with the
# test extras into whatever `python3` is. For a service or an image:
#   PYTHON=/opt/twinkle/venv/bin/python  the interpreter (a venv's) to install into
#   INSTALL_EXTRAS=                      extras to add: "test,cookbook" by default, empty
#                                        for none ("cookbook" also installs tinker-cookbook)
#   INSTALL_EDITABLE=0                   a plain (non-editable) install
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
INSTALL_EXTRAS="${INSTALL_EXTRAS-test,cookbook}"
spec="."
if [ -n "$INSTALL_EXTRAS" ]; then spec=".[$INSTALL_EXTRAS]"; fi
editable=(-e)
if [ "${INSTALL_EDITABLE:-1}" = 0 ]; then editable=(); fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
    "${editable[@]}" "$spec"
# tinker-cookbook without its dependencies (the `cookbook` extra has the ones its RL loop
# imports; its pins would replace the torch above).
if [[ ",$INSTALL_EXTRAS," == *",cookbook,"* ]]; then
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
        "tinker-cookbook==0.6.1"
fi
