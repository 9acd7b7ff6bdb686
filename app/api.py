"""The HTTP routes: parse → validate → service → formatter. Each route stays a few lines."""

from __future__ import annotations

import datetime
import logging
import re
import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, suppress
from typing import Any

import redis
from flask import Blueprint, Response, current_app, g, jsonify, request

from app.completions_format import completion, completion_stream, release
from app.errors import json_body
from app.generate_format import generate_response, generate_stream
from app.generation import Events, Generation
from app.openai_format import chat_completion, chat_stream
from app.service import CompletionService
from schemas.chat import check_tool_replies, generation_prompt
from schemas.errors import InvalidRequest, ModelNotFound, ServiceUnavailable
from schemas.requests import load_request

bp = Blueprint("api", __name__)

CLIENT_WATCH_SECONDS = 1.0  # how long a watch outlives its request, at most
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STREAM_SEND_BUFFER_BYTES = 64 * 1024
# A caller's (or nginx's) X-Request-Id is kept if it looks like an id; it is logged and sent back.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

logger = logging.getLogger(__name__)


def _client_request_id() -> str | None:
    header = request.headers.get("X-Request-Id", "")
    return header if _REQUEST_ID.fullmatch(header) else None


@bp.after_app_request  # every route's answer (Messages and Responses too), refusals by the auth hook too
def _request_id_header(response: Response) -> Response:
    request_id = _client_request_id() or g.get("request_id")
    if request_id:
        response.headers["X-Request-Id"] = request_id
    return response


def trace(request_id: str) -> None:
    """Tie our id (the RQ job id) to the caller's, in the log and in the response header."""
    g.request_id = request_id
    client_id = _client_request_id()
    if client_id:
        logger.info("request_id=%s x_request_id=%s", request_id, client_id)


def _service() -> CompletionService:
    return current_app.extensions["tokenline"]


def _watch_client(generation: Generation) -> None:
    """Notice at once a client that hangs up while its request runs, where gunicorn gives the socket.

    A thread (a greenlet under gevent) waits for the socket to turn readable: EOF means the client
    left, and the request ends and is cancelled within a decode step, whether or not anything is
    being written to it (a queued stream, a JSON answer). It stops when the request ends.
    """
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        threading.Thread(target=_watch, args=(sock, generation), name="client-watch", daemon=True).start()


def _watch(sock: socket.socket, generation: Generation) -> None:
    while not generation.ended:
        try:
            readable, _, _ = select.select([sock], [], [], CLIENT_WATCH_SECONDS)
            if not readable or generation.ended:
                continue
            if sock.recv(1, socket.MSG_PEEK) != b"":
                return  # the client sent more (a pipelined request): that is not a hang-up
        except (OSError, ValueError):  # reset, or closed under us
            pass
        if not generation.ended:
            generation.client_left()
        return


def _bound_send_buffer() -> None:
    """A stream's kernel send buffer stays small (no autotuning to megabytes), so a client that stops
    reading soon blocks its writer; its events then back up in the bounded inbox and it is cancelled."""
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER_BYTES)


class Streamed:
    """A streamed body that ends its requests when the response is closed (werkzeug closes it when the
    response ends, also when the client has gone), whether or not a chunk was ever taken: `end` closes
    their events, or releases them."""

    def __init__(self, chunks: Iterator[Any], end: Callable[[], None]) -> None:
        self.chunks = chunks
        self.end = end

    def __iter__(self) -> Iterator[Any]:
        return self.chunks

    def close(self) -> None:
        try:
            close = getattr(self.chunks, "close", None)  # the formats' chunks are generators
            if close is not None:
                close()
        finally:
            self.end()


def begin(generation: Generation) -> None:
    """What a route does with the generation it queued: trace its id, watch its client (the routes of
    the other APIs on the chat path call it too)."""
    trace(generation.request_id)
    _watch_client(generation)


def event_stream(chunks: Iterator[str], events: Events) -> Response:
    """A server-sent-events response of `chunks` that closes `events` when it ends."""
    _bound_send_buffer()
    return Response(Streamed(chunks, events.close), mimetype="text/event-stream", headers=SSE_HEADERS)


@bp.post("/v1/chat/completions")
def chat_completions() -> Response:
    service = _service()
    body = load_request(service.chat_schema, json_body())
    check_tool_replies(body.messages)
    generation = service.chat(body)
    trace(generation.request_id)
    _watch_client(generation)
    events = generation.events()  # a stream writes keep-alives while waiting
    if body.stream:
        _bound_send_buffer()
        chunks = Streamed(chat_stream(generation, events, body.include_usage), events.close)
        return Response(chunks, mimetype="text/event-stream", headers=SSE_HEADERS)
    with closing(events):
        return jsonify(chat_completion(generation, events))


@bp.post("/v1/completions")
def completions() -> Response:
    service = _service()
    body = load_request(service.completion_schema, json_body())
    generations = service.completions(body)
    trace(generations[0].request_id)
    for generation in generations:
        _watch_client(generation)
    if body.stream:
        _bound_send_buffer()
        chunks = Streamed(completion_stream(generations, body.echo, body.include_usage), lambda: release(generations))
        return Response(chunks, mimetype="text/event-stream", headers=SSE_HEADERS)
    return jsonify(completion(generations, body.echo))


@bp.post("/generate")
def generate() -> Response:
    service = _service()
    body = load_request(service.generate_schema, json_body())
    generation = service.generate(body)
    trace(generation.request_id)
    _watch_client(generation)
    events = generation.events()  # '\0'-framed JSON has no room for keep-alives
    style = service.settings.generate_style
    if body.stream:
        _bound_send_buffer()
        chunks = Streamed(generate_stream(generation, events, style), events.close)
        return Response(chunks, mimetype="application/json", headers=SSE_HEADERS)
    with closing(events):
        return jsonify(generate_response(generation, events, style))


def _model_card(model: Any) -> dict[str, Any]:
    """OpenAI's model object, with Anthropic's fields beside (`type`, `display_name`, `created_at`):
    both SDKs list the models of one route, and each reads its own fields."""
    created_at = datetime.datetime.fromtimestamp(model.created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "tokenline",
        "max_model_len": model.max_model_len,
        "quantization": model.quantization or None,
        "type": "model",
        "display_name": model.name,
        "created_at": created_at,
    }


def _refuse_query(*accepted: str) -> None:
    """400 naming the first query parameter the route does not take."""
    for name in request.args:
        if name not in accepted:
            raise InvalidRequest(f"{name}: Unknown query parameter.", param=name)


MAX_MODELS_PAGE = 1000  # Anthropic's `limit` range: 1 to 1,000


@bp.get("/v1/models")
def models() -> Response:
    """OpenAI's list (every model) and Anthropic's page of it: `limit` (1–1,000), `after_id`, `before_id`,
    with `has_more`, `first_id` and `last_id`. Any other query parameter is a 400 naming it."""
    data = [_model_card(m) for m in _service().registry.entries.values()]
    _refuse_query("limit", "after_id", "before_id")
    ids = [card["id"] for card in data]
    for name in ("after_id", "before_id"):
        if name in request.args and request.args[name] not in ids:
            raise ModelNotFound(f"{name}: The model `{request.args[name]}` does not exist.", param=name)
    limit = request.args.get("limit", str(MAX_MODELS_PAGE))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_MODELS_PAGE:
        raise InvalidRequest(f"limit: Must be an integer from 1 to {MAX_MODELS_PAGE}.", param="limit")
    start = ids.index(request.args["after_id"]) + 1 if "after_id" in request.args else 0
    end = ids.index(request.args["before_id"]) if "before_id" in request.args else len(ids)
    window = data[start:end]
    backwards = "before_id" in request.args and "after_id" not in request.args  # the page just before it
    page = window[-int(limit) :] if backwards else window[: int(limit)]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    more = len(page) < len(window)
    return jsonify({"object": "list", "data": page, "has_more": more, "first_id": first, "last_id": last})


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str) -> Response:
    _refuse_query()
    entry = _service().registry.entries.get(model_id)
    if entry is None:
        raise ModelNotFound(f"The model `{model_id}` does not exist.", param="model")
    return jsonify(_model_card(entry))


@bp.post("/tokenize")
def tokenize() -> Response:
    """vLLM's: {"model"?, "prompt"} or {"model"?, "messages", "tools"?, "add_generation_prompt"?,
    "continue_final_message"?} → token ids."""
    service = _service()
    request_ = load_request(service.tokenize_schema, json_body())
    model = service.registry.get(request_["model"])
    if "messages" in request_:
        text = model.prompts.chat_prompt(
            tuple(request_["messages"]),
            tuple(request_.get("tools") or ()),
            request_.get("chat_template_kwargs"),
            generation_prompt=generation_prompt(request_),
            continue_final=bool(request_.get("continue_final_message")),
        )
        special = False
    else:
        text, special = request_["prompt"], request_.get("add_special_tokens", True)
    ids = model.prompts.encode(text, add_special_tokens=special)
    return jsonify({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids})


@bp.post("/detokenize")
def detokenize() -> Response:
    """vLLM's: {"model"?, "tokens": [ids]} → {"prompt": text}."""
    service = _service()
    request_ = load_request(service.detokenize_schema, json_body())
    model = service.registry.get(request_["model"])
    if model.vocab_size and any(t >= model.vocab_size for t in request_["tokens"]):
        raise InvalidRequest(f"tokens: token ids must be below {model.vocab_size} (vocabSize).", param="tokens")
    return jsonify({"prompt": model.prompts.tokenizer.decode(list(request_["tokens"]), skip_special_tokens=False)})


@bp.get("/health")
def health() -> Response:
    """The service's state: 200 when Redis answers, with the live worker processes of each model."""
    workers = _live_workers()
    if isinstance(workers, Response):
        return workers
    return jsonify({"status": "ok", "redis": "ok", "workers": workers})


@bp.get("/health/live")
def live() -> Response:
    """Liveness: the API process serves HTTP (restart it when this fails)."""
    return jsonify({"status": "ok"})


@bp.get("/health/ready")
def ready() -> Response:
    """Readiness: Redis answers and some model has a live worker, so a request can be served (send
    traffic when this answers 200); else 503 with the reason."""
    workers = _live_workers()
    if isinstance(workers, Response):
        return workers
    if not any(workers.values()):
        return _unavailable({"redis": "ok", "workers": workers, "reason": "no live worker serves any model"})
    return jsonify({"status": "ok", "redis": "ok", "workers": workers})


def _live_workers() -> dict[str, int] | Response:
    """Each model's live worker processes (fresh heartbeats), or the 503 that says Redis is away: at
    once while the relay knows it is (its listener, started here if no request has, finds it back)."""
    service = _service()
    try:
        service.relay.ensure_started()
        return service.admission.live_workers(list(service.registry.entries))
    except ServiceUnavailable:
        return _unavailable({"redis": "unavailable"})
    except redis.RedisError as exc:
        service.relay.redis.lost(exc)
        return _unavailable({"redis": "unavailable"})  # no internal address


def _unavailable(body: dict[str, object]) -> Response:
    response = jsonify({"status": "unavailable", **body})
    response.status_code = 503
    response.headers["Retry-After"] = "1"
    return response
