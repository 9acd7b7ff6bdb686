"""One error envelope for everything the API answers with, and strict JSON parsing of bodies."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import redis
from flask import Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from schemas.errors import InvalidRequest, ServiceUnavailable, TokenlineError, UnsupportedMediaType, error_envelope

logger = logging.getLogger(__name__)

HTTP_ERROR_TYPES = {413: ("invalid_request_error", "payload_too_large"), 429: ("rate_limit_exceeded", None)}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# A \uD800-\uDFFF escape: JSON lets it through, but alone it is not a character (no tokenizer takes it).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_body() -> Any:
    """The request body as JSON: sent as application/json (else 415), UTF-8 without lone surrogates,
    no NaN or Infinity (they are not JSON), and nested less deeply than Python's recursion limit."""
    if request.mimetype != "application/json":
        raise UnsupportedMediaType(
            f"The request body must be sent as application/json, not {request.mimetype or 'without a Content-Type'}."
        )
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity"):  # RFC 9110: a coding the server does not decode is a 415
        raise UnsupportedMediaType(f"Content-Encoding {coding} is not supported; send the body uncompressed.")
    try:
        data = request.get_data(cache=False)
        limit = request.max_content_length
        if request.content_length is None and limit is not None and len(data) >= limit and _body_goes_on():
            raise RequestEntityTooLarge()  # a chunked body: werkzeug reads up to the limit and stops there
    except HTTPException:
        raise
    except Exception as exc:  # gunicorn's ParseException: a chunk size not in hex, a chunk without its end
        raise InvalidRequest(f"The request body could not be read: {exc}") from None
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.") from None
    if _SURROGATE_ESCAPE.search(data):
        param = _lone_surrogate(body, "")
        if param is not None:
            raise InvalidRequest(
                f"{param or 'body'}: holds a lone UTF-16 surrogate (\\uD800-\\uDFFF), which is not a character.",
                param=param or None,
            )
    return body


def _body_goes_on() -> bool:
    """Whether a body sent without a Content-Length goes on past what was read of it (the server
    ends the chunked stream it hands over: reading on is safe)."""
    return bool(request.environ["wsgi.input"].read(1))


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
        found = _lone_surrogate(key, sub) if isinstance(key, str) else None
        found = found if found is not None else _lone_surrogate(item, sub)
        if found is not None:
            return found
    return None


def error_response(error: TokenlineError) -> Response:
    metrics = current_app.extensions.get("tokenline.metrics")
    if metrics is not None:
        metrics.count_error(error)
    request_id = g.get("request_id")
    if request_id:  # it was queued: its end is logged with its id, as a stream's is
        level = logging.WARNING if error.status >= 500 else logging.INFO
        logger.log(level, "request ended with an error request_id=%s: %d %s", request_id, error.status, error.message)
    response = jsonify(error.envelope())
    response.status_code = error.status
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if error.status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="tokenline"'
    return response


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(TokenlineError, error_response)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        status = exc.code or 500
        type_, code = HTTP_ERROR_TYPES.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
        response = jsonify(error_envelope(exc.description or exc.name, type_, None, code))
        response.status_code = status
        for name, value in exc.get_headers():  # a 405's Allow (RFC 9110 requires it), a 429's Retry-After
            if name.lower() != "content-type":
                response.headers[name] = value
        return response

    @app.errorhandler(redis.RedisError)
    def _redis(exc: redis.RedisError) -> Response:
        relay = app.extensions["tokenline"].relay
        relay.redis.lost(exc)  # logged once per outage; the relay notices when Redis is back
        return error_response(ServiceUnavailable("The queue (Redis) is unavailable; try again shortly."))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        response = jsonify(error_envelope("Internal server error.", "server_error", None, None))
        response.status_code = 500
        return response
