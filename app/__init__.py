"""The tokenline API (gateway): `gunicorn 'app:create_app()'`. No torch is imported here."""

from __future__ import annotations

import logging
import sys

import redis
from flask import Flask
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from schemas.config import Settings, load_settings, log_config_notes

# Bodies above this are refused with 413 before they are read: 512 KiB of content, JSON-escaped.
MAX_BODY_BYTES = 4 * 1024 * 1024
REDIS_CONNECT_TIMEOUT = 2.0  # seconds: a Redis across a network may be slow to accept, not absent
# Seconds a command waits for its reply: the API's commands take microseconds, so a Redis silent this
# long hangs (stopped, or cut off by the network), and the request gets its 503 now rather than after
# redis-py's default of 5 s per try.
REDIS_COMMAND_TIMEOUT = 2.0


def create_app(settings: Settings | None = None) -> Flask:
    """Build the app from explicit settings (tests) or from the environment (gunicorn)."""
    from app.admission import Admission
    from app.api import bp
    from app.auth import require_api_keys
    from app.dispatch import Dispatcher
    from app.errors import register_error_handlers
    from app.messages_api import init_app as init_messages
    from app.metrics import ApiMetrics
    from app.metrics import bp as metrics_bp
    from app.openapi import bp as openapi_bp
    from app.registry import ModelRegistry
    from app.relay import Relay
    from app.responses_api import init_app as init_responses
    from app.service import CompletionService

    settings = settings or load_settings()
    logging.basicConfig(
        level=settings.log_level, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log_config_notes(settings)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.json.ensure_ascii = False  # type: ignore[attr-defined]
    # A request waits for Redis only briefly: two quick retries of a refused or reset connection, then
    # 503 (redis-py's default of ten retries with backoff would hold every request for seconds while
    # Redis is away); a command left unanswered is not tried again (each try would wait as long).
    connection = redis.Redis.from_url(
        settings.redis_url,
        health_check_interval=30,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT,
        socket_timeout=REDIS_COMMAND_TIMEOUT,
        retry=Retry(ExponentialBackoff(cap=0.02, base=0.005), 2, supported_errors=(redis.ConnectionError,)),
    )
    admission = Admission(connection, settings)
    dispatcher = Dispatcher(connection, settings, admission)
    relay = Relay(connection, cancel=dispatcher.cancel)
    relay.on_reply = admission.release_deferred
    service = CompletionService(settings, ModelRegistry(settings), dispatcher, relay, admission)
    service.metrics = app.extensions["tokenline.metrics"] = ApiMetrics(connection, [m.name for m in settings.models])
    dispatcher.on_route = service.metrics.count_route
    dispatcher.on_withdrawn = service.metrics.count_withdrawn
    app.extensions["tokenline"] = service
    register_error_handlers(app)
    require_api_keys(app, settings.api_keys)
    app.register_blueprint(bp)
    init_responses(app, service, connection)
    init_messages(app, service)
    app.register_blueprint(openapi_bp)
    app.register_blueprint(metrics_bp)
    return app
