#!/usr/bin/env bash
# One install path for the README, CI and the container image: torch is pinned in the same
# pip command as everything else, so nothing resolves a CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test]"
