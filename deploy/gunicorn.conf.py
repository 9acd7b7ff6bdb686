"""gunicorn settings for the tokenline API, from tokenline's one settings object (schemas/config.py:
HOST, PORT, WEB_CONCURRENCY, GUNICORN_* or their keys in $TOKENLINE_CONFIG). gevent workers hold many
open streams each."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gunicorn import util as gunicorn_util

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root: `gunicorn` may run from elsewhere

from schemas.config import ConfigError, load_settings

try:
    _settings = load_settings(require_model=False)
except ConfigError as exc:
    raise SystemExit(f"tokenline API: {exc}") from None

# Each model's files read once here, in the master: a model that cannot be served stops the server with
# one line naming it (as a worker's start does), not a traceback from every worker that fails to boot.
from app.prompt import compiled_template
from schemas.model_files import ModelFiles
from schemas.quantization import detect as detect_quantization

for _model in _settings.models:
    try:
        _files = ModelFiles.of(_model.path, _model.chat_template)
        _files.check()
        compiled_template(_files)
        detect_quantization(_files, _settings.quantization)
    except ValueError as exc:  # ModelFilesError, GGUFError, UnsupportedQuantization
        raise SystemExit(f"tokenline API: model {_model.name}: {exc}") from None

if _settings.public and not _settings.api_keys and not _settings.dev_mode:
    raise SystemExit(
        "tokenline API: published without API keys; set TOKENLINE_API_KEYS (or TOKENLINE_API_KEYS_FILE), "
        "or TOKENLINE_DEV_MODE=1 for a development stack"
    )

# Requests gunicorn cannot parse (a malformed request line, method or header; a line or headers past
# the limits below; an unsupported transfer coding) are answered in the API's error envelope, as nginx
# answers them, not with gunicorn's HTML page: a client without nginx in front (`make run`) reads the
# same error shape as for any other bad request. gunicorn has no setting for these pages; its workers
# write them with `gunicorn.util.write_error(sock, status_int, reason, mesg)` (`Worker.handle_error`,
# gunicorn/workers/base.py), replaced here in the master, before it forks them: a private detail of
# gunicorn 27.0.1, which requirements-api.txt pins; tests/test_e2e_errors.py fails if a release stops
# calling it.
_ERROR_CODES = {  # nginx's codes for the same errors (deploy/nginx/default.conf.template)
    400: "bad_request",
    403: "forbidden",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    501: "not_implemented",
}


def _write_json_error(sock, status_int, reason, mesg):
    error = {
        "message": mesg or reason,
        "type": "invalid_request_error" if status_int < 500 else "server_error",
        "param": None,
        "code": _ERROR_CODES.get(status_int, "server_error" if status_int >= 500 else "bad_request"),
    }
    body = (json.dumps({"error": error}) + "\n").encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    gunicorn_util.write_nonblock(sock, head.encode("latin-1") + body)


gunicorn_util.write_error = _write_json_error

bind = f"{_settings.host}:{_settings.port}"
workers = _settings.web_concurrency
worker_class = _settings.gunicorn_worker_class
worker_connections = _settings.gunicorn_worker_connections
timeout = 60  # for gevent workers this is a heartbeat, not a request limit: streams may run longer
graceful_timeout = _settings.gunicorn_graceful_timeout
# gunicorn 25+ opens a control socket at a fixed path; several servers on one host would share it.
control_socket_disable = True
keepalive = _settings.gunicorn_keepalive
# A request line as long as nginx takes (its 8 KiB header buffers), so that nginx, which answers in
# the API's error envelope, is the one to refuse a longer one (gunicorn's default, 4,094, answered
# the lines between them with its own HTML page).
limit_request_line = 8190
# Headers as nginx takes them (a line up to 8 KiB, 32 KiB in all, to which it adds three), for the
# same reason: gunicorn's defaults (100 fields, 8,190 bytes a field) answered a request nginx passed
# with gunicorn's HTML 431. nginx's 32 KiB bounds what reaches the API; the development stack (`make
# run`, no nginx) listens on 127.0.0.1.
limit_request_fields = 8200
limit_request_field_size = 16384
accesslog = _settings.gunicorn_access_log
# gunicorn's default line, and the request's id (the X-Request-Id the API answers with): a status in
# the access log leads to the request's lines in the API's and the worker's logs.
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" request_id=%({x-request-id}o)s'
errorlog = "-"

# prometheus-client's multiprocess mode: every worker writes its metrics to files in one directory,
# which /metrics sums. Set before the workers import prometheus_client; emptied when the server starts
# (a fresh temporary directory unless PROMETHEUS_MULTIPROC_DIR names one).
_own_metrics_dir = not os.environ.get("PROMETHEUS_MULTIPROC_DIR")
if _own_metrics_dir:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="tokenline-metrics-")


def on_starting(server):
    directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()


def child_exit(server, worker):
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def post_fork(server, worker):
    """A new worker process, before it loads the app: a SIGTERM reaching it while it boots (gunicorn
    starting, a worker replaced after a crash, a reload) met the master's signal handler, inherited
    with the fork, which only queues the signal for a master loop the child never runs. The worker
    booted and served on, and the master waited its whole graceful timeout before killing it. Until
    the worker installs its own handlers (it serves nothing yet), SIGTERM ends it at once."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# An API process that stops ends its open requests this long before gunicorn's graceful timeout
# kills it (at most half of it): each gets an error (a stream its error event and [DONE]) and
# gives its place back, where the kill cut streams off mid-chunk and left their places taken.
STOP_MARGIN_SECONDS = 2.0


def post_worker_init(worker):
    """A watcher for this process's stop: STOP_MARGIN_SECONDS before the graceful timeout, it ends the
    requests still open (app/relay.py `Relay.interrupt_all`)."""
    import threading
    import time

    service = getattr(worker.wsgi, "extensions", {}).get("tokenline")
    if service is None:
        return

    def end_open_requests_in_time():
        while worker.alive:  # False once SIGTERM (a stop, or a reload's old process) has come
            time.sleep(0.5)
        grace = worker.cfg.graceful_timeout
        time.sleep(max(grace / 2, grace - STOP_MARGIN_SECONDS))
        from app.relay import ApiStopping

        service.relay.interrupt_all(
            ApiStopping("This API process is restarting and could not finish the request in time; retry it.")
        )

    threading.Thread(target=end_open_requests_in_time, name="stop-in-time", daemon=True).start()


def worker_exit(server, worker):
    """A stopping API process ends the background responses it runs, as failed (app/responses_api.py
    `ResponsesApi.stop`): their events come to it alone."""
    extensions = getattr(getattr(worker, "wsgi", None), "extensions", {})
    responses = extensions.get("tokenline.responses")
    if responses is not None:
        responses.stop()


def on_exit(server):
    if _own_metrics_dir:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
