#!/usr/bin/env bash
# One install path for the README, CI and the container image. torch is pinned in the same
# pip command as everything else, so nothing else picks a different torch.
#
# Which torch build that is depends on the index pip uses, not on the machine: on Linux
# x86_64, PyPI's torch 2.13.0 is the CUDA 13 build, which pulls about 17 nvidia-* wheels
# (several GB) even on a machine with no GPU, and whose CUDA runtime needs an NVIDIA driver
# of the 580 series or newer. For the CPU build (about 750 MB), point pip at PyTorch's CPU
# wheel index with pip's own variable, e.g.
#   PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index URL> make demo
# (pip then prefers torch 2.13.0+cpu; everything else still comes from the default index).
# An environment that already holds torch 2.13.0 keeps it.
#
# With no environment set (README, `make`, CI) it installs this checkout editable with the
# test extras into whatever `python3` is. For a service or an image:
#   PYTHON=/opt/twinkle/venv/bin/python  the interpreter (a venv's) to install into
#   INSTALL_EXTRAS=                      extras to add: "test,cookbook" by default, empty
#                                        for none ("cookbook" also installs tinker-cookbook)
#   INSTALL_EDITABLE=0                   a plain (non-editable) install
#   INSTALL_ONLY_DEPS=1                  torch and the dependencies pyproject.toml lists
#                                        (with the extras'), not the project: an image's
#                                        layer that a source change does not rebuild
#   INSTALL_FORCE=1                      run pip even where all is already installed
#   INSTALL_CHROMIUM=0                   skip Debian's Chromium (below)
# pip prints its progress (a first install downloads for minutes); PIP_QUIET=1 hushes it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
INSTALL_EXTRAS="${INSTALL_EXTRAS-test,cookbook}"
spec="."
if [ -n "$INSTALL_EXTRAS" ]; then spec=".[$INSTALL_EXTRAS]"; fi
editable=(-e)
if [ "${INSTALL_EDITABLE:-1}" = 0 ]; then editable=(); fi
say() { echo "install.sh: $*"; }

if [ -n "${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}" ]; then
    say "pip uses the index(es) set in PIP_INDEX_URL / PIP_EXTRA_INDEX_URL"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
    say "no NVIDIA GPU seen (no nvidia-smi). Unless torch 2.13.0 is already installed, the" \
        "default index may give its CUDA build (several GB); for the CPU build set" \
        "PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index (see this script's header)"
fi
if [ "${INSTALL_ONLY_DEPS:-0}" = 1 ]; then
    # The requirement strings (markers kept) of [project] and of the chosen extras.
    mapfile -t deps < <(INSTALL_EXTRAS="$INSTALL_EXTRAS" "$PYTHON" -c '
import os, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e for e in os.environ["INSTALL_EXTRAS"].split(",") if e]
deps = list(project["dependencies"])
for extra in extras:
    deps += project["optional-dependencies"][extra]
print("\n".join(d for d in deps if d.split(">")[0].split("=")[0].strip() != "torch"))')
    say "torch==2.13.0 and the dependencies of twinkle${INSTALL_EXTRAS:+ [$INSTALL_EXTRAS]}" \
        "into $PYTHON (not twinkle itself)"
    "$PYTHON" -m pip install --disable-pip-version-check "torch==2.13.0" "${deps[@]}"
    exit 0
fi
# The web console's browser test (tests/test_console.py) drives Debian's Chromium through
# playwright (the `test` extra): no wheel on the package index carries a browser it can drive,
# so with the test extra, as root, where apt-get exists and /usr/bin/chromium does not, it
# comes from the distribution's packages (about 110 MB; seconds). Elsewhere, or if apt fails,
# the script says so and goes on: that test then skips and names the package.
chromium() {
    if [[ ",$INSTALL_EXTRAS," != *",test,"* ]] || [ "${INSTALL_CHROMIUM:-1}" = 0 ] \
            || [ -x /usr/bin/chromium ]; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "no /usr/bin/chromium, and not root with apt-get: the console's browser test" \
            "will skip (as root: apt-get install chromium)"
        return 0
    fi
    say "Debian's chromium for the console's browser test (apt-get; INSTALL_CHROMIUM=0 skips)"
    if ! { DEBIAN_FRONTEND=noninteractive timeout 180 apt-get install -y -q \
                --no-install-recommends chromium >/dev/null \
            || { timeout 60 apt-get update -q >/dev/null \
                 && DEBIAN_FRONTEND=noninteractive timeout 180 apt-get install -y -q \
                    --no-install-recommends chromium >/dev/null; }; }; then
        say "apt-get could not install chromium: the console's browser test will skip"
    fi
}
chromium

# Already all there (this checkout editable, every requirement met: scripts/satisfied.py)?
# Then pip is not run: its resolve and editable build cost seconds in every `make` target.
if [ "${INSTALL_EDITABLE:-1}" = 1 ] && [ -z "${INSTALL_FORCE:-}" ] \
        && INSTALL_EXTRAS="$INSTALL_EXTRAS" "$PYTHON" scripts/satisfied.py; then
    say "torch 2.13.0, twinkle $spec (editable, this checkout) and its requirements are" \
        "already installed in $PYTHON; nothing to do (INSTALL_FORCE=1 runs pip anyway)"
    exit 0
fi
say "[1/2] torch==2.13.0 and twinkle $spec into $PYTHON"
"$PYTHON" -m pip install --disable-pip-version-check "torch==2.13.0" \
    "${editable[@]}" "$spec"
# tinker-cookbook without its dependencies (the `cookbook` extra has the ones its RL loop
# imports; its pins would replace the torch above).
if [[ ",$INSTALL_EXTRAS," == *",cookbook,"* ]]; then
    say "[2/2] tinker-cookbook 0.6.1 (without its dependencies)"
    "$PYTHON" -m pip install --disable-pip-version-check --no-deps \
        "tinker-cookbook==0.6.1"
fi
say "done"
