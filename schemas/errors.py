"""The error tree. Every failure that reaches a client is one of these, in OpenAI's envelope.

TokenlineError                      500 server_error
├── InvalidRequest                  400 invalid_request_error (param names the field)
│   └── ContextLengthExceeded       400 code=context_length_exceeded
├── AuthenticationError             401 authentication_error
├── ModelNotFound                   404 code=model_not_found
├── PayloadTooLarge                 413 invalid_request_error
├── UnsupportedMediaType            415 invalid_request_error (the body is not application/json)
├── Overloaded                      429 rate_limit_exceeded (Retry-After)
├── ServiceUnavailable              503 service_unavailable (Retry-After)
└── GenerationFailed                500 server_error: the worker failed, or the relay broke
    └── RelayTimeout                504 timeout: no event within the relay's timeout
"""

from __future__ import annotations

from typing import Any


class TokenlineError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    retry_after: int | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.type, self.param, self.code)

    @classmethod
    def from_envelope(cls, body: dict[str, Any]) -> TokenlineError:
        """Rebuild an error sent as an event by a worker: a request the worker refused is the client's
        (400, as its class where its code says why); any other keeps its type, as a 500."""
        kind, code = str(body.get("type", cls.type)), body.get("code")
        rebuilt: type[TokenlineError] = cls
        if kind == InvalidRequest.type:
            rebuilt = {c.code: c for c in (ContextLengthExceeded, ConstraintFailed)}.get(code, InvalidRequest)
        err = rebuilt(str(body.get("message", "generation failed")), body.get("param"), code)
        err.type = kind
        return err


class InvalidRequest(TokenlineError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """A prompt (with `max_tokens`, where the request set them) longer than the model takes: the
    counts are kept, so that each API can word it as its clients read it."""

    code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        *,
        counts: tuple[int, int | None, int] | None = None,
    ) -> None:
        super().__init__(message, param, code)
        self.counts = counts  # (prompt tokens, max_tokens or None for a prompt too long alone, the limit)


class ConstraintFailed(InvalidRequest):
    """The worker could not compile or follow a request's grammar for its model's tokenizer: a limit of
    the grammar engine the schema exceeds (llguidance's lexer, found only as the output is drawn)."""

    code = "constraint_failed"


class AuthenticationError(TokenlineError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(TokenlineError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(TokenlineError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(TokenlineError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Overloaded(TokenlineError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"
    retry_after = 1


class ClientGone(TokenlineError):
    status = 499
    type = "client_closed_request"
    code = "client_closed_request"


class ServiceUnavailable(TokenlineError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"
    retry_after = 1


class GenerationFailed(TokenlineError):
    status = 500
    type = "server_error"
    code = "generation_failed"


class RelayTimeout(GenerationFailed):
    status = 504
    type = "timeout"
    code = "timeout"


def error_envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class RequestTimeout(RelayTimeout):
    """The request ran past its end-to-end limit (e2eTimeout, or the request's own `timeout`)."""


class QueueTimeout(ServiceUnavailable):
    """No worker took the request within queueTimeout; the job is withdrawn and never runs."""

    code = "queue_timeout"


class NoWorker(ServiceUnavailable):
    """No live worker serves the model: answered at once instead of queueing."""

    code = "no_worker"
    retry_after = 5


class WorkerLost(GenerationFailed):
    """The worker serving the request stopped (its heartbeat expired)."""

    status = 502
    code = "worker_lost"


class SlowClient(GenerationFailed):
    """The client read the stream more slowly than it was produced; past the buffer, it is cancelled."""

    status = 408
    code = "client_too_slow"
