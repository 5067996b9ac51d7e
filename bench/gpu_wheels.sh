#!/usr/bin/env bash
# The wheels the GPU machines lack (they have torch, triton, transformers, peft, numpy), for
# the device tool's `carry`: run here once, into .whl/ (ignored), then on the GPU machine
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
# Versions are the ones this checkout's venv has, so both machines run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py=${PYTHON:-.venv/bin/python}
names="msgspec sqlite-utils sqlite-fts4 click-default-group tabulate pluggy python-dateutil
pyzmq uvloop aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl
prometheus-client zstandard protobuf tinker anyio distro httpx httpcore h11 orjson pydantic
pydantic-core typing-inspection annotated-types pyqwest rich markdown-it-py mdurl pygments
sniffio certifi idna click openai httpx2 httpcore2 truststore jiter tqdm h2 hpack hyperframe liger-kernel megatron-core"
pins=()
for n in $names; do
    v=$("$py" -m pip show "$n" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$v" ] && pins+=("$n==$v") || echo "gpu_wheels: $n is not installed here, skipped"
done
# GPU only, so not in this venv: fla-core (Qwen3.5's delta-rule kernels, the `gpu` extra's pin)
pins+=("fla-core==0.6.0" "einops==0.8.2")
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "${pins[@]}"
du -sh .whl
