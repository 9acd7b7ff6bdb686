# The worker image, one per accelerator (build argument ACCELERATOR):
#   cpu  (default)  python:3.11-slim + the CPU build of torch; runs on any laptop
#   cuda            python:3.11-slim + torch from PyPI (CUDA 12 wheels); run with the NVIDIA runtime
#   npu             a CANN base image (BASE_IMAGE: CANN 9.1+, Python 3.11) + the CPU build of torch + torch-npu
#                   of the same version (deploy/requirements-npu.txt); see docker-compose.npu.yml
# TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps `import torch` working when CANN is absent; the worker loads
# torch_npu itself and, with TOKENLINE_ACCELERATOR=npu, stops with a message naming what is missing.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG ACCELERATOR=cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 TOKENLINE_ACCELERATOR=${ACCELERATOR}

RUN useradd --system --uid 10001 --user-group --home-dir /srv/tokenline --shell /usr/sbin/nologin tokenline
WORKDIR /srv/tokenline
# The user's home is its own: CANN writes its logs under $HOME/ascend/log unless told elsewhere.
# The compile cache's directory, the user's: a named volume mounted on it starts with its owner.
RUN mkdir -p /srv/tokenline/.cache/tokenline && chown -R tokenline:tokenline /srv/tokenline
ENV ASCEND_PROCESS_LOG_PATH=/srv/tokenline/ascend/log

# torch first and alone, from the index that matches the accelerator; requirements.txt pins the same version.
# On CUDA also the C compiler: Triton (flex attention, the compiled decode step) builds its launcher with it.
COPY deploy/requirements-npu.txt /tmp/requirements-npu.txt
RUN set -eu; \
    case "$ACCELERATOR" in \
        cpu|npu) python3 -m pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu ;; \
        cuda) python3 -m pip install "torch==${TORCH_VERSION}"; \
              apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* ;; \
        *) echo "ACCELERATOR must be cpu, cuda or npu, not '$ACCELERATOR'" >&2; exit 1 ;; \
    esac; \
    if [ "$ACCELERATOR" = npu ]; then python3 -m pip install -r /tmp/requirements-npu.txt; fi
COPY requirements.txt requirements-api.txt ./
RUN python3 -m pip install -r requirements.txt

COPY schemas schemas
COPY workers workers
COPY scripts/build_demo_model.py scripts/__init__.py scripts/
COPY deploy/worker-entrypoint.sh /usr/local/bin/tokenline-worker

USER tokenline
# Healthy while a worker of this container has refreshed its heartbeat in Redis (workers/ops/health.py).
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 CMD ["python3", "-m", "workers.ops.health"]
ENTRYPOINT ["tokenline-worker"]
CMD ["python3", "-m", "workers"]
