# The API image: Flask + gunicorn (gevent), no torch. Also carries deploy/tls/make-cert.sh, which the
# compose `certs` step runs (python:*-slim ships the openssl command).
FROM python:3.11.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOST=0.0.0.0 PORT=8000
RUN useradd --system --uid 10001 --user-group --home-dir /srv/tokenline --shell /usr/sbin/nologin tokenline
WORKDIR /srv/tokenline
# What the API derives from a model it cannot read as it is (a tekken.json's tokenizer.json, schemas/derived.py)
# goes under the user's ~/.cache where /models is mounted read-only: that directory is the user's.
RUN mkdir -p /srv/tokenline/.cache/tokenline && chown -R tokenline:tokenline /srv/tokenline/.cache

COPY requirements-api.txt .
RUN pip install -r requirements-api.txt
COPY schemas schemas
COPY app app
COPY deploy/gunicorn.conf.py deploy/gunicorn.conf.py
COPY deploy/tls deploy/tls

USER tokenline
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['PORT']}/health/live\", timeout=2)"]
CMD ["gunicorn", "-c", "deploy/gunicorn.conf.py", "app:create_app()"]
