"""Optional API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route
but the health probes, /metrics (for Prometheus; nginx does not publish it) and the API's own
description (/openapi.json, /docs).

Keys come from TOKENLINE_API_KEYS and TOKENLINE_API_KEYS_FILE (schemas/config.py). A presented key is
compared with every configured one in constant time, by their SHA-256 digests (of one length: the
comparison cannot end early on a length that differs), so neither the match, which key matched, nor a
key's length shows in the timing. Keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac

from flask import Flask, request

from schemas.errors import AuthenticationError

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics", "/openapi.json", "/docs"})


def require_api_keys(app: Flask, keys: tuple[str, ...]) -> None:
    if not keys:
        return
    accepted = [hashlib.sha256(key.encode()).digest() for key in keys]

    @app.before_request
    def _authenticate() -> None:
        if request.path in OPEN_PATHS:
            return
        presented = presented_key().encode()
        digest = hashlib.sha256(presented).digest()
        matched = False
        for key in accepted:  # every key, every time
            matched |= hmac.compare_digest(digest, key)
        if not presented:
            raise AuthenticationError(
                "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                code="missing_api_key",
            )
        if not matched:
            raise AuthenticationError("Incorrect API key provided.")


def presented_key() -> str:
    """The key the request presents: `Authorization: Bearer <key>`, else `x-api-key` (Anthropic's
    clients send that one); "" when there is neither."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip()
