# rq-dashboard for the tokenline queues (JSON serializer, job arguments hidden), behind basic auth.
# It refuses to start without RQ_DASHBOARD_PASSWORD.
FROM python:3.11.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin tokenline
COPY deploy/requirements-dashboard.txt /tmp/requirements-dashboard.txt
RUN pip install -r /tmp/requirements-dashboard.txt
USER tokenline
EXPOSE 9181
CMD ["sh", "-c", "test -n \"$RQ_DASHBOARD_PASSWORD\" || { echo 'rq-dashboard: set RQ_DASHBOARD_PASSWORD' >&2; exit 2; }; exec rq-dashboard --json --bind 0.0.0.0 --port 9181"]
