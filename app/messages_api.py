"""The routes of Anthropic's Messages API: POST /v1/messages (plain or streamed) and
/v1/messages/count_tokens. A request is validated (schemas/messages.py), translated to chat
(app/anthropic_format.py) and run by the service like any chat request. Every error on these routes
reaches the client in Anthropic's envelope."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from contextlib import closing
from itertools import chain
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request

from app.anthropic_format import (
    PING,
    MessageEvents,
    anthropic_envelope,
    chat_body,
    context_error,
    messages_error,
    messages_param,
    sse_event,
)
from app.api import begin, event_stream
from app.chat_deltas import translated
from app.errors import json_body
from app.generation import Generation
from app.service import CompletionService, check_thinking_budget
from schemas.chat import ChatRequest
from schemas.errors import ClientGone, ContextLengthExceeded, GenerationFailed, InvalidRequest, TokenlineError
from schemas.messages import CountTokensSchema, MessagesRequest, MessagesSchema
from schemas.requests import load_request

bp = Blueprint("messages", __name__)
logger = logging.getLogger(__name__)


class MessagesApi:
    def __init__(self, service: CompletionService) -> None:
        self.service = service
        self.schema = MessagesSchema()
        self.count_schema = CountTokensSchema()

    def chat_request(self, request_: MessagesRequest) -> ChatRequest:
        body = chat_body(request_)
        if "thinking_token_budget" in body and self.service.registry.get(request_.model).reasoning_parser != "think":
            # A ceiling on reasoning the model does not do is met: Anthropic's `enabled` needs a budget
            # (Claude Code sends one by default), where chat's own thinking_token_budget is refused.
            del body["thinking_token_budget"]
        try:
            return load_request(self.service.chat_schema, body)
        except InvalidRequest as exc:
            raise messages_error(exc) from None

    def create(self, request_: MessagesRequest) -> Generation:
        chat = self.chat_request(request_)
        try:
            return self.service.chat(chat, prefix="msg_", stream=request_.stream, rename=messages_param)
        except InvalidRequest as exc:
            raise self._error(request_, chat, exc) from None

    def count_tokens(self, request_: MessagesRequest) -> int:
        chat = self.chat_request(request_)
        model = self.service.registry.get(chat.model)
        try:
            check_thinking_budget(model, chat.thinking_budget)  # as the request itself would be refused
            prompt = model.prompts.request_prompt(chat)
        except InvalidRequest as exc:
            raise self._error(request_, chat, exc) from None
        return len(model.prompts.encode(prompt, add_special_tokens=False))

    def _error(self, request_: MessagesRequest, chat: ChatRequest, exc: InvalidRequest) -> InvalidRequest:
        if isinstance(exc, ContextLengthExceeded) and exc.counts is not None:
            exc = context_error(exc, exc.counts)
        if request_.system:
            exc = self.service.registry.get(chat.model).prompts.system_refused(chat, exc, "system")
        return messages_error(exc)


def init_app(app: Flask, service: CompletionService) -> None:
    app.extensions["tokenline.messages"] = MessagesApi(service)
    app.register_blueprint(bp)
    # On the app, not the blueprint: a path under /v1/messages that no route takes (a 404, a 405)
    # never reaches the blueprint's hooks.
    app.after_request(_anthropic_envelopes)


def _api() -> MessagesApi:
    return current_app.extensions["tokenline.messages"]


def _anthropic_envelopes(response: Response) -> Response:
    """Every answer under /v1/messages carries a `request-id` header, as Anthropic's do (the
    generation's id where there is one, else one made for it). Any error there (validation, auth, the
    worker's, a path or method no route takes) is in Anthropic's envelope, which carries the same id."""
    if request.path != "/v1/messages" and not request.path.startswith("/v1/messages/"):
        return response
    request_id = g.get("request_id") or f"req_{uuid.uuid4().hex}"
    response.headers.setdefault("request-id", request_id)
    if response.status_code < 400 or not response.is_json:
        return response
    body = response.get_json(silent=True)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and body.get("type") != "error":
        envelope = anthropic_envelope(response.status_code, error.get("message", ""), request_id, error.get("param"))
        response.set_data(json.dumps(envelope))
    return response


@bp.post("/v1/messages")
def create() -> Response:
    api = _api()
    request_ = load_request(api.schema, json_body())
    generation = api.create(request_)
    begin(generation)
    builder = MessageEvents(
        generation.request_id,
        generation.model,
        generation.prompt_tokens,
        request_.stop_sequences,
        omit_thinking=request_.omit_thinking,
        buffered=frozenset(tool["name"] for tool in request_.tools if tool.get("eager_input_streaming") is False),
    )
    events = generation.events()
    if request_.stream:
        return event_stream(_stream(generation, builder, events), events)
    with closing(events):
        for _ in translated(generation, events, builder):
            pass
    return jsonify(builder.message)


def _stream(generation: Generation, builder: MessageEvents, events: Iterator[Any]) -> Iterator[str]:
    """Anthropic's events; a failure after message_start is an `error` event, as Anthropic sends one."""
    try:
        for event in chain(builder.start(), translated(generation, events, builder)):
            yield PING if event is None else sse_event(event)
    except ClientGone:
        logger.info("client left request_id=%s", generation.request_id)
    except TokenlineError as exc:
        logger.warning("stream ended with an error request_id=%s: %s", generation.request_id, exc.message)
        yield from map(sse_event, builder.fail(exc))
    except Exception:
        logger.exception("stream failed request_id=%s", generation.request_id)
        yield from map(sse_event, builder.fail(GenerationFailed("Internal error during generation.")))


@bp.post("/v1/messages/count_tokens")
def count_tokens() -> Response:
    api = _api()
    request_ = load_request(api.count_schema, json_body())
    return jsonify({"input_tokens": api.count_tokens(request_)})
