# twinkled in a container (docs/operator.md, "Install: the container image"; ops/compose.yaml).
#
#   docker build -t twinkled .
#   docker run -d --gpus all -p 8000:8000 -v /models:/models:ro \
#       -v twinkle-data:/var/lib/twinkle -v /etc/twinkle/twinkled.toml:/etc/twinkle/twinkled.toml:ro \
#       twinkled
#
# The configuration is yours, mounted at /etc/twinkle/twinkled.toml (start from
# ops/twinkled.toml, with host = "0.0.0.0"), or no file at all: flags after the image name
# replace the default command (`twinkled serve --model /models/X --host 0.0.0.0 ...`).
#
# The torch wheel pip installs on Linux x86_64 carries its own CUDA 13 libraries (an NVIDIA
# driver of the 580 series or newer on the host), so this slim base runs on GPUs under the
# NVIDIA Container Toolkit (`--gpus all`). To build on an NVIDIA CUDA base instead, pass any
# image with python3 >= 3.11 (Ubuntu 24.04 based ones have 3.12; python3 and venv are
# installed below when missing):
#   docker build --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t twinkled .
# megatron-core is installed (the `megatron` extra): `--tp` > 1 works.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    VIRTUAL_ENV=/opt/twinkle/venv \
    PATH=/opt/twinkle/venv/bin:$PATH

# A venv at the same place as on a host install (/opt/twinkle/venv); python3 first if the
# base image has none (CUDA bases).
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-pip ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/twinkle/venv

WORKDIR /opt/twinkle/src
# torch and every dependency first, in a layer of their own: it is rebuilt only when
# pyproject.toml or the install script changes, never for a change to the source.
COPY pyproject.toml ./
COPY scripts/install.sh scripts/
RUN INSTALL_ONLY_DEPS=1 INSTALL_EXTRAS=megatron bash scripts/install.sh
# Then the source: the same install script as the README and CI, with megatron-core for
# --tp and without test extras, not editable (its dependencies are already satisfied).
COPY . .
RUN INSTALL_EXTRAS=megatron INSTALL_EDITABLE=0 bash scripts/install.sh

RUN useradd --system --user-group --home-dir /var/lib/twinkle --shell /usr/sbin/nologin twinkle \
    && mkdir -p /etc/twinkle /var/lib/twinkle \
    && chown twinkle:twinkle /var/lib/twinkle

USER twinkle
WORKDIR /var/lib/twinkle
VOLUME /var/lib/twinkle
EXPOSE 8000

# Healthy once the model is loaded ("ok"); "loading" during the start period is expected.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import json, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/api/v1/healthz', timeout=5); sys.exit(json.load(r).get('status') != 'ok')"]

# The configuration comes from a mount at /etc/twinkle/twinkled.toml (nothing is baked in).
# docker stop sends SIGTERM: the daemon drains and persists live adapters; give it time
# with `docker stop -t 180` (or stop_grace_period: 180s in compose).
STOPSIGNAL SIGTERM
ENTRYPOINT ["twinkled", "serve"]
CMD ["--config", "/etc/twinkle/twinkled.toml"]
