# The CPU worker image: torch (CPU build), transformers, the engine.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1
WORKDIR /srv/tokenline
COPY requirements.txt requirements-api.txt ./
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install -r requirements.txt
COPY schemas schemas
COPY workers workers
COPY scripts scripts
USER nobody
CMD ["python", "-m", "workers"]
