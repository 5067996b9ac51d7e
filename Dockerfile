# twinkled in a container (docs/operator.md, "Install: the container image").
#
#   docker build -t twinkled .
#   docker run -d --gpus all -p 8000:8000 -v /models:/models:ro \
#       -v twinkle-data:/var/lib/twinkle -v /etc/twinkle:/etc/twinkle:ro twinkled
#
# The torch wheel pip installs on Linux x86_64 carries its own CUDA libraries, so this slim
# base runs on GPUs under the NVIDIA Container Toolkit (`--gpus all`). To build on an
# NVIDIA CUDA base instead, pass any image with python3 >= 3.11 (Ubuntu 24.04 based ones
# have 3.12; python3 and venv are installed below when missing):
#   docker build --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t twinkled .
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
COPY . .
# The same install script as the README and CI, without test extras and not editable.
RUN INSTALL_EXTRAS= INSTALL_EDITABLE=0 bash scripts/install.sh

RUN useradd --system --user-group --home-dir /var/lib/twinkle --shell /usr/sbin/nologin twinkle \
    && mkdir -p /etc/twinkle /var/lib/twinkle \
    && cp ops/twinkled.toml /etc/twinkle/twinkled.toml \
    && chown twinkle:twinkle /var/lib/twinkle

USER twinkle
WORKDIR /var/lib/twinkle
VOLUME /var/lib/twinkle
EXPOSE 8000

# Healthy once the model is loaded ("ok"); "loading" during the start period is expected.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import json, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/api/v1/healthz', timeout=5); sys.exit(json.load(r).get('status') != 'ok')"]

# docker stop sends SIGTERM: the daemon drains and persists live adapters; give it time
# with `docker stop -t 180` (or stop_grace_period: 180s in compose).
STOPSIGNAL SIGTERM
ENTRYPOINT ["twinkled", "serve"]
CMD ["--config", "/etc/twinkle/twinkled.toml"]
