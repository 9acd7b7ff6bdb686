"""One error envelope for everything the API answers with, and strict JSON parsing of bodies."""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from schemas.errors import InvalidRequest, ServiceUnavailable, TokenlineError, error_envelope

logger = logging.getLogger(__name__)

HTTP_ERROR_TYPES = {413: ("invalid_request_error", "payload_too_large"), 429: ("rate_limit_exceeded", None)}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def json_body() -> Any:
    """The request body as JSON; NaN and Infinity are refused, as they are not JSON."""
    data = request.get_data(cache=False)
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None


def error_response(error: TokenlineError) -> Response:
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
        return response

    @app.errorhandler(redis.RedisError)
    def _redis(exc: redis.RedisError) -> Response:
        logger.warning("Redis unavailable on %s %s: %s", request.method, request.path, exc)
        return error_response(ServiceUnavailable("The queue (Redis) is unavailable; try again shortly."))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        response = jsonify(error_envelope("Internal server error.", "server_error", None, None))
        response.status_code = 500
        return response
