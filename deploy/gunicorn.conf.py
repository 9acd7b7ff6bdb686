"""gunicorn settings for the tokenline API. gevent workers hold many open streams each."""

import os

bind = f"{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '8000')}"
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
worker_class = os.environ.get("GUNICORN_WORKER_CLASS", "gevent")
worker_connections = int(os.environ.get("GUNICORN_WORKER_CONNECTIONS", "1000"))
timeout = 60  # for gevent workers this is a heartbeat, not a request limit: streams may run longer
graceful_timeout = int(os.environ.get("GUNICORN_GRACEFUL_TIMEOUT", "30"))
# gunicorn 25+ opens a control socket at a fixed path; several servers on one host would share it.
control_socket_disable = True
keepalive = 5
accesslog = os.environ.get("GUNICORN_ACCESS_LOG", "-")
errorlog = "-"
