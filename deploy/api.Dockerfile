# The API image: Flask + gunicorn, no torch.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOST=0.0.0.0 PORT=8000
WORKDIR /srv/tokenline
COPY requirements-api.txt .
RUN pip install -r requirements-api.txt
COPY schemas schemas
COPY app app
COPY deploy/gunicorn.conf.py deploy/gunicorn.conf.py
USER nobody
EXPOSE 8000
CMD ["gunicorn", "-c", "deploy/gunicorn.conf.py", "app:create_app()"]
