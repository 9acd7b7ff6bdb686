"""The API's completion service (app/service.py) on a real Redis: what a request's end tells the worker.

The model here has a unique name and a fresh heartbeat but no worker process, so its jobs stay queued
and every write the service makes can be read back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from flask import Flask
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from werkzeug.test import EnvironBuilder, TestResponse

from app import create_app
from app.admission import Admission
from app.conversations import key_scope
from app.dispatch import Dispatcher
from app.generation import HEARTBEAT_SECONDS, IN_TRANSIT_SECONDS, Generation
from app.registry import ModelRegistry
from app.relay import Relay
from app.service import CompletionService
from schemas.config import Settings
from schemas.errors import ClientGone, ConstraintFailed, GenerationFailed, SlowClient, TokenlineError, WorkerLost
from schemas.job import Event, Usage, encode_events
from schemas.keys import admitted_key, cancel_key, live_workers_key, queue_name
from scripts import localstack


@pytest.fixture()
def service(redis_url: str, settings: Settings) -> Iterator[CompletionService]:
    name = f"svc-{uuid.uuid4().hex[:8]}"
    own = dataclasses.replace(settings, models=(dataclasses.replace(settings.models[0], name=name),))
    connection = redis.Redis.from_url(redis_url)
    seconds, micros = connection.time()
    connection.zadd(live_workers_key(name), {"host.1": seconds * 1000 + micros // 1000})
    admission = Admission(connection, own)
    dispatcher = Dispatcher(connection, own, admission)
    relay = Relay(connection, cancel=dispatcher.cancel)
    yield CompletionService(own, ModelRegistry(own), dispatcher, relay, admission)
    relay.stop()
    connection.close()


def chat(service: CompletionService) -> Generation:
    model = service.settings.models[0].name
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return service.chat(service.chat_schema.load(body))


def test_a_client_that_leaves_is_cancelled_before_its_stream_unwinds(
    service: CompletionService, redis_conn: redis.Redis
) -> None:
    generation = chat(service)
    model = generation.model
    assert redis_conn.zscore(admitted_key(model), generation.request_id) is not None
    generation.client_left()  # what the API's client watch calls
    assert redis_conn.get(cancel_key(generation.request_id)) == b"1"  # the worker can drop it now
    assert redis_conn.ttl(cancel_key(generation.request_id)) > 0
    events = generation.events()
    with pytest.raises(ClientGone):
        next(events)
    assert redis_conn.zscore(admitted_key(model), generation.request_id) is None  # its place is given back
    assert generation.ended
    job = Job.fetch(generation.request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == "canceled"  # taken off its queue: no worker will run it


def test_a_job_taken_off_its_queue_by_a_worker_that_never_starts_it_fails_as_worker_lost(
    service: CompletionService, redis_conn: redis.Redis
) -> None:
    """A worker killed outright keeps its Redis connection for a moment after its death, in which its
    dequeue (a BLPOP over its two queues, which keeps no list of what it took) can still be handed a
    job: the job is off every queue and still `queued`, and nothing but queueTimeout (600 s) ended it."""
    generation = chat(service)
    model, request_id = generation.model, generation.request_id
    seconds, _ = redis_conn.time()
    redis_conn.zadd(live_workers_key(model), {"host.1": (seconds + 120) * 1000})  # live throughout
    events = generation.events()
    waited = time.monotonic()
    while time.monotonic() - waited < IN_TRANSIT_SECONDS + 1.5:  # on its queue, it waits on
        assert next(events) is None
    shared = Queue(queue_name(model), connection=redis_conn, serializer=JSONSerializer)
    taken = Queue.dequeue_any([shared], None, connection=redis_conn, serializer=JSONSerializer)
    assert taken is not None and taken[0].id == request_id  # what the dead worker's dequeue did
    deadline = time.monotonic() + IN_TRANSIT_SECONDS + 10  # within seconds, not queueTimeout
    with pytest.raises(WorkerLost):
        while time.monotonic() < deadline:
            assert next(events) is None
    job = Job.fetch(request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == "failed"
    assert redis_conn.get(cancel_key(request_id)) == b"1"  # a worker that did take it drops it
    assert redis_conn.zscore(admitted_key(model), request_id) is None  # its place is given back


def test_a_job_found_failed_ends_its_request_with_the_error_event_on_its_way(
    service: CompletionService, redis_conn: redis.Redis
) -> None:
    """The worker publishes its error event, then records the failure in RQ: a request that checks its
    job between the two (a quiet interval) waits for the event, which says what kind of error it was
    (a 400 of the request's here); it was answered as the worker's 500 with the event's words."""
    generation = chat(service)
    request_id = generation.request_id
    service.dispatcher.fail_abandoned(request_id, "The output constraint could not be followed.", JobStatus.QUEUED)
    events = generation.events()
    assert next(events) is None  # a quiet interval: the job is failed, the event not yet come
    error = {"message": "The output constraint could not be followed.", "type": "invalid_request_error"}
    event = Event(request_id, 0, "error", error={**error, "code": ConstraintFailed.code})
    redis_conn.publish(service.relay.channel, encode_events([event]))
    with pytest.raises(ConstraintFailed):
        while True:
            assert next(events) is None
    # With no event at all (it was lost), the job's failure ends the request at the next interval.
    lost = chat(service)
    service.dispatcher.fail_abandoned(lost.request_id, "the device failed", JobStatus.QUEUED)
    waiting = lost.events()
    began = time.monotonic()
    with pytest.raises(GenerationFailed, match="the device failed"):
        while True:
            assert next(waiting) is None
    assert time.monotonic() - began < 3 * HEARTBEAT_SECONDS


def test_events_that_came_while_the_worker_was_checked_end_the_request_before_its_absence(
    service: CompletionService, redis_conn: redis.Redis
) -> None:
    """A worker whose group broke publishes its error, then leaves the live set: a request checking its
    worker between the two found it gone and answered 502 worker_lost over the error on its way."""
    generation = chat(service)
    job = Job.fetch(generation.request_id, connection=redis_conn, serializer=JSONSerializer)
    job.worker_name = "gone-host.1"  # no heartbeat: it has left
    job.set_status(JobStatus.STARTED)
    job.save()
    message = "A device of the worker's group failed; the worker restarts."
    event = Event(generation.request_id, 0, "error", error={"message": message, "type": "server_error"})
    redis_conn.publish(service.relay.channel, encode_events([event]))
    localstack.wait_for(lambda: not generation.subscription.inbox.empty(), 5, "the event to arrive")
    generation._check_worker()  # what a quiet interval ending as the event came does: no WorkerLost
    with pytest.raises(TokenlineError, match="A device of the worker's group failed") as caught:
        next(generation.events())
    assert caught.value.status == 500 and not isinstance(caught.value, WorkerLost)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_the_worker_reports_is_counted_once_streamed_or_not(
    service: CompletionService, redis_conn: redis.Redis, stream: bool
) -> None:
    """A stream answers 200 before its worker fails it: the failure is counted by the error event."""
    app = create_app(service.settings)
    model = service.settings.models[0].name
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    status: list[str] = []

    def fail() -> None:  # what the worker does, once the request is queued
        localstack.wait_for(lambda: redis_conn.zcard(admitted_key(model)) == 1, 10, "the request to be admitted")
        (request_id,) = [m.decode() for m in redis_conn.zrange(admitted_key(model), 0, -1)]
        token = Event(request_id, 0, "token", text="x")
        failed = Event(request_id, 1, "error", error={"message": "the device failed", "type": "server_error"})
        redis_conn.publish(app.extensions["tokenline"].relay.channel, encode_events([token, failed]))

    worker = threading.Thread(target=fail)
    worker.start()
    try:
        environ = EnvironBuilder(path="/v1/chat/completions", method="POST", json=body).get_environ()
        text = b"".join(app(environ, lambda code, headers, exc_info=None: status.append(code))).decode()
    finally:
        worker.join()
        app.extensions["tokenline"].relay.stop()
    assert status == (["200 OK"] if stream else ["500 INTERNAL SERVER ERROR"])
    assert "the device failed" in text
    metrics = app.extensions["tokenline.metrics"].local
    assert metrics.get_sample_value("tokenline:request_failed_total", {"reason": "500"}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_only_a_stream_is_bounded_by_stream_buffer(
    service: CompletionService, redis_conn: redis.Redis, stream: bool
) -> None:
    """streamBuffer bounds how far a client may fall behind its stream; an answer the API reads itself
    (not streamed) is bounded by its max_tokens, and a busy API process never fails it as a slow client."""
    service.settings = dataclasses.replace(service.settings, stream_buffer=2)
    model = service.settings.models[0].name
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream}
    generation = service.chat(service.chat_schema.load(body))
    rid = generation.request_id
    events = [Event(rid, i, "token", text="x") for i in range(6)]
    events.append(Event(rid, 6, "done", finish_reason="length", usage=Usage(1, 6)))
    for event in events:  # one message per step, as a worker publishes, before anyone reads
        redis_conn.publish(service.relay.channel, encode_events([event]))
    subscription = service.relay.subscriptions[rid]
    if stream:
        localstack.wait_for(lambda: subscription.overflowed, 10, "the inbox to overflow")
        with pytest.raises(SlowClient):
            list(generation.events())
    else:
        localstack.wait_for(lambda: subscription.inbox.qsize() == len(events), 10, "every event in the inbox")
        assert [e.kind for e in generation.events() if e is not None] == ["token"] * 6 + ["done"]


def test_events_closed_unread_end_the_request(service: CompletionService, redis_conn: redis.Redis) -> None:
    """A stream whose client reset the connection before its first chunk was written is closed before
    it reads an event: its place under maxLinkNum is given back and its job cancelled all the same."""
    generation = chat(service)
    model, request_id = generation.model, generation.request_id
    assert redis_conn.zscore(admitted_key(model), request_id) is not None
    generation.events().close()
    assert redis_conn.zscore(admitted_key(model), request_id) is None
    assert generation.ended and request_id not in service.relay.subscriptions
    job = Job.fetch(request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == "canceled"


STREAMS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/generate": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
}
# The routes whose streams write a first chunk before they read an event (a role chunk, a start event).
STARTS_FIRST = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


@pytest.mark.parametrize(("path", "chunks"), [*((path, 0) for path in STREAMS), *((path, 1) for path in STARTS_FIRST)])
def test_a_stream_closed_by_its_server_early_gives_its_place_back(
    service: CompletionService, redis_conn: redis.Redis, path: str, chunks: int
) -> None:
    """What gunicorn does when it cannot write to a client that reset the connection: it closes the
    response, before or after taking its first chunk. Either way the request's place is given back at
    once (it was held for queueTimeout + e2eTimeout) and its job cancelled."""
    app = create_app(service.settings)
    model = service.settings.models[0].name
    environ = EnvironBuilder(path=path, method="POST", json={**STREAMS[path], "model": model, "stream": True})
    status: list[str] = []
    try:
        body = app(environ.get_environ(), lambda code, headers, exc_info=None: status.append(code))
        assert status == ["200 OK"]
        (request_id,) = [m.decode() for m in redis_conn.zrange(admitted_key(model), 0, -1)]
        taken = iter(body)
        for _ in range(chunks):
            assert next(taken)
        body.close()  # type: ignore[attr-defined]
        assert redis_conn.zcard(admitted_key(model)) == 0
        job = Job.fetch(request_id, connection=redis_conn, serializer=JSONSerializer)
        assert job.get_status() == "canceled"
        # Withdrawn before any worker took it: the API's metrics count it, as no worker will.
        metrics = app.extensions["tokenline.metrics"].local
        assert metrics.get_sample_value("tokenline:request_withdrawn_total", {"model": model}) == 1
    finally:
        app.extensions["tokenline"].relay.stop()


def test_a_streamed_response_is_stored_before_its_last_event_goes_out(
    service: CompletionService, redis_conn: redis.Redis
) -> None:
    """An agent loop continues from a streamed turn (previous_response_id) as soon as it reads
    `response.incomplete` or `completed`: when the stream yields that event, the response is stored
    (it was stored after the event was written, and a quarter of such follow-ups got 404)."""
    app = create_app(service.settings)
    model = service.settings.models[0].name
    body = {"model": model, "input": "hi", "max_output_tokens": 1, "stream": True}
    status: list[str] = []
    try:
        chunks = iter(
            app(
                EnvironBuilder(path="/v1/responses", method="POST", json=body).get_environ(),
                lambda code, headers, exc_info=None: status.append(code),
            )
        )
        created = json.loads(next(chunks).decode().split("data: ", 1)[1])
        response_id = created["response"]["id"]
        (request_id,) = [m.decode() for m in redis_conn.zrange(admitted_key(model), 0, -1)]
        token = Event(request_id, 0, "token", text="x")
        done = Event(request_id, 1, "done", finish_reason="length", usage=Usage(1, 1))
        redis_conn.publish(app.extensions["tokenline"].relay.channel, encode_events([token, done]))
        store = app.extensions["tokenline.responses"].store
        for chunk in chunks:
            if b"event: response.incomplete" in chunk:
                assert store.load(key_scope(""), response_id).response["status"] == "incomplete"
                break
        else:
            raise AssertionError("the stream ended without response.incomplete")
    finally:
        app.extensions["tokenline"].relay.stop()
    assert status == ["200 OK"]


@contextlib.contextmanager
def app_with_template(service: CompletionService, tmp_path: Path, template: str) -> Iterator[tuple[Flask, str]]:
    """The API, no gunicorn, on the service's model with its chat template replaced: the app and the
    model's name."""
    model = tmp_path / "model"
    shutil.copytree(service.settings.models[0].path, model)
    (model / "chat_template.jinja").write_text(template)
    entry = dataclasses.replace(service.settings.models[0], path=model)
    app = create_app(dataclasses.replace(service.settings, models=(entry,)))
    try:
        yield app, entry.name
    finally:
        app.extensions["tokenline"].relay.stop()


TOOLS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% for t in tools or [] %}<tool>{{ t.function | tojson }}{% endfor %}<assistant>"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tokenize_counts_the_tools_as_the_chat_request_renders_them(service: CompletionService, tmp_path: Path) -> None:
    """A client sizing a tool-calling prompt gets the count its chat request has (vLLM's /tokenize)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with app_with_template(service, tmp_path, TOOLS_TEMPLATE) as (app, model):
        client = app.test_client()

        def tokenize(**body: object) -> TestResponse:
            return client.post("/tokenize", json={"model": model, **body})

        counted, plain = tokenize(messages=messages, tools=[WEATHER]), tokenize(messages=messages)
        chat = {"model": model, "messages": messages, "tools": [WEATHER], "max_tokens": 1}
        generation = app.extensions["tokenline"].chat(service.chat_schema.load(chat))
        generation.events().close()
        with_prompt, twice = tokenize(prompt="hi", tools=[WEATHER]), tokenize(messages=messages, tools=[WEATHER] * 2)
    assert counted.get_json()["count"] == generation.prompt_tokens > plain.get_json()["count"]
    for refused in (with_prompt, twice):
        assert refused.status_code == 400 and refused.get_json()["error"]["param"] == "tools"


# Gemma's and Mistral's older templates: no system role.
SYSTEM_AND_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
NO_SYSTEM_ROLE = (
    "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if m.content == 'unanswerable' %}{{ raise_exception('Not this one') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)
SYSTEM_FIELDS = {
    "Responses instructions": ("/v1/responses", {"instructions": "Be brief.", "input": "hi"}, "instructions"),
    "Responses input": ("/v1/responses", {"input": SYSTEM_AND_USER}, "input"),
    "Responses instructions and input": (
        "/v1/responses",
        {"instructions": "Be brief.", "input": SYSTEM_AND_USER},
        "input",
    ),
    "Messages system": (
        "/v1/messages",
        {"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "system",
    ),
    "Messages system, counted": (
        "/v1/messages/count_tokens",
        {"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]},
        "system",
    ),
    "Messages system and a refused message": (
        "/v1/messages",
        {"system": "Be brief.", "messages": [{"role": "user", "content": "unanswerable"}], "max_tokens": 4},
        "messages",
    ),
}


@pytest.mark.parametrize("case", list(SYSTEM_FIELDS))
def test_a_template_without_a_system_role_names_the_field_the_system_text_came_from(
    service: CompletionService, tmp_path: Path, case: str
) -> None:
    """Responses' `instructions` and Messages' `system` become the chat's system message; a model whose
    template takes none refuses them by their own name, not as the input or the messages."""
    path, body, field = SYSTEM_FIELDS[case]
    with app_with_template(service, tmp_path, NO_SYSTEM_ROLE) as (app, model):
        response = app.test_client().post(path, json={"model": model, **body})
    assert response.status_code == 400
    error = response.get_json()["error"]
    if path.startswith("/v1/responses"):
        assert (error["param"], error["message"]) == (field, "System role not supported")
    else:
        assert error["message"] == f"{field}: System role not supported"
