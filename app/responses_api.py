"""The routes of OpenAI's Responses API: create (plain, streamed or in the background), retrieve, list
input items, delete, cancel. A create is validated (schemas/responses.py), translated to chat
(app/responses_format.py), run by the service like any chat request, and stored in Redis
(app/conversations.py) unless `store` is false.

The runs themselves, in the background included, are app/response_runs.py's."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import closing
from itertools import chain
from typing import Any

import redis
from flask import Blueprint, Flask, Response, current_app, jsonify, request

from app.api import begin, event_stream, trace
from app.auth import presented_key
from app.chat_deltas import translated
from app.conversations import ResponseNotFound, ResponseStore, StoredResponse, key_scope
from app.errors import json_body
from app.openai_format import KEEP_ALIVE
from app.response_runs import ResponseRun, ResponsesApi
from app.responses_format import sse_event
from app.service import CompletionService
from schemas.errors import ClientGone, GenerationFailed, InvalidRequest, TokenlineError
from schemas.requests import load_request
from schemas.responses import RESPONSE_ID

bp = Blueprint("responses", __name__)
logger = logging.getLogger(__name__)


def init_app(app: Flask, service: CompletionService, connection: Any) -> None:
    settings = service.settings
    store = ResponseStore(connection, settings.responses_ttl, settings.responses_max_bytes)
    app.extensions["tokenline.responses"] = ResponsesApi(service, store)
    app.register_blueprint(bp)


def _api() -> ResponsesApi:
    return current_app.extensions["tokenline.responses"]


def _scope() -> str:
    return key_scope(presented_key())


@bp.post("/v1/responses")
def create() -> Response:
    api = _api()
    run = api.create(load_request(api.schema, json_body()), _scope())
    if run.request.background:
        trace(run.generation.request_id)  # no client to watch
        return jsonify(api.in_background(run))
    begin(run.generation)
    events = run.generation.events()
    if run.request.stream:
        return event_stream(_stream(api, run, events), events)
    with closing(events):
        for _ in translated(run.generation, events, run.builder):
            pass
    api.save(run)
    return jsonify(run.record.response)


def _stream(api: ResponsesApi, run: ResponseRun, events: Iterator[Any]) -> Iterator[str]:
    """The semantic events; a failure after the start is `response.failed`, and the response is
    stored as it ended (completed, incomplete or failed) before the event that says so goes out: a
    client may continue from it (previous_response_id) as soon as it reads that event. A client that
    leaves before the end (its generation is cancelled) finds it stored as cancelled, with its output
    so far: the first event gave it the id."""
    request_id = run.generation.request_id
    ended = False
    try:
        for event in chain(run.builder.start(), translated(run.generation, events, run.builder)):
            if event is None:
                yield KEEP_ALIVE
                continue
            if event["type"] in ENDING_EVENTS:
                api.save(run)
                ended = True
            yield sse_event(event)
    except ClientGone:
        logger.info("client left request_id=%s", request_id)
    except TokenlineError as exc:
        logger.warning("stream ended with an error request_id=%s: %s", request_id, exc.message)
        ended = True
        yield from _failed(api, run, exc)
    except Exception:
        logger.exception("stream failed request_id=%s", request_id)
        ended = True
        yield from _failed(api, run, GenerationFailed("Internal error during generation."))
    finally:
        if not ended and run.request.store:  # the client left (also where the server found it out writing)
            run.builder.cancel()
            _save_while_up(api, run)


# The events that end a response's stream; the builder has set the response's final state before them.
ENDING_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def _failed(api: ResponsesApi, run: ResponseRun, error: TokenlineError) -> Iterator[str]:
    """The events of a response that failed, stored so first where Redis can store it."""
    ending = run.builder.fail(error)
    _save_while_up(api, run)
    yield from map(sse_event, ending)


def _save_while_up(api: ResponsesApi, run: ResponseRun) -> None:
    """Store the run as it ended, unless Redis is away (often the failure itself): the record is then
    left unstored, and the client still hears how the stream ended where it is there to hear it."""
    if not api.service.relay.redis.down:
        try:
            api.save(run)
        except redis.RedisError as exc:
            api.service.relay.redis.lost(exc)


def _stored(response_id: str) -> StoredResponse:
    _known_id(response_id)
    return _api().load(_scope(), response_id)


def _known_id(response_id: str) -> None:
    """404 for what cannot be a response's id (it never reaches a Redis key)."""
    if re.fullmatch(RESPONSE_ID, response_id) is None:
        raise ResponseNotFound(f"Response with id '{response_id[:64]}' not found.")


def _check_query(accepted: tuple[str, ...]) -> None:
    """400 naming a query parameter the route does not honour (`include[]` is the SDK's `include`)."""
    for raw in request.args:
        name = raw.removesuffix("[]")
        values = [value for value in request.args.getlist(raw) if value]
        if name == "stream" and all(value in ("false", "0") for value in values):
            continue
        if name == "include" and not values:  # no extra data asked for: what happens
            continue
        if name in accepted:
            continue
        if name in ("stream", "starting_after"):
            message = "tokenline does not replay stored responses as a stream."
        elif name == "include":
            message = "tokenline does not support `include`."
        else:
            message = "Unknown query parameter."
        raise InvalidRequest(f"{name}: {message}", param=name)


@bp.get("/v1/responses/<response_id>")
def retrieve(response_id: str) -> Response:
    # include_obfuscation shapes stream events only: without a stream it is what happens either way.
    _check_query(("include_obfuscation",))
    return jsonify(_stored(response_id).response)


@bp.get("/v1/responses/<response_id>/input_items")
def input_items(response_id: str) -> Response:
    """The response's input items, newest first by default (OpenAI's `order`), paged by `after` and `limit`."""
    _check_query(("order", "limit", "after"))
    items = list(_stored(response_id).input_items)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order: Must be asc or desc.", param="order")
    if order == "desc":
        items.reverse()
    limit_text = request.args.get("limit", "20")
    if re.fullmatch(r"[0-9]{1,3}", limit_text) is None or not 1 <= int(limit_text) <= 100:  # ASCII digits only
        raise InvalidRequest("limit: Must be an integer in [1, 100].", param="limit")
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"after: No input item has the id {after[:64]!r}.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return jsonify(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


@bp.delete("/v1/responses/<response_id>")
def delete(response_id: str) -> Response:
    _known_id(response_id)
    _check_query(())
    _api().delete(_scope(), response_id)
    return jsonify({"id": response_id, "object": "response.deleted", "deleted": True})


@bp.post("/v1/responses/<response_id>/cancel")
def cancel(response_id: str) -> Response:
    """Cancel a background response, from any API process; any other response is a 400. The route
    takes no parameters: a body (the SDK sends none) may only be an empty object."""
    _known_id(response_id)
    _check_query(())
    if request.get_data(cache=True):
        body = json_body()
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        for name in body:
            raise InvalidRequest(f"{name}: Unknown parameter.", param=name)
    return jsonify(_api().cancel(_scope(), response_id))
