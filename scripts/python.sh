#!/usr/bin/env bash
# Prints the Python interpreter that `make` installs into and runs with:
#   - $PYTHON when set (a service's or an image's venv);
#   - python3 when it already runs inside a virtual environment;
#   - otherwise the project's .venv, made on first use. A stock Debian/Ubuntu Python refuses
#     system-wide pip installs (PEP 668), so nothing is installed into it. The venv sees the
#     interpreter's own packages (--system-site-packages): a machine where torch and the
#     rest are already installed does not download them again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
    exit 0
fi
if python3 -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
    command -v python3
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    if ! python3 -m venv --system-site-packages .venv >&2; then
        echo "could not create .venv with 'python3 -m venv'; on Debian/Ubuntu install it" \
             "with: apt install python3-venv" >&2
        exit 1
    fi
fi
echo "$PWD/.venv/bin/python"
