"""Runs of OpenAI's Responses API (app/responses_api.py has its routes): a create queued as a chat
request, after the conversation it continues, and its response stored as it ends.

A background response is stored as queued and answered at once; a thread of the API process that
queued it reads its events and stores it as it ends. A cancel, from any API process, drops its job
(off its queue, or by the worker at its next step) and sets its cancel flag, which that thread
checks every quiet second: it then stores the response as cancelled, with its output so far. Once a
cancel has answered `cancelled`, the response stays cancelled; deleting a running one cancels it, and
it is not stored again (each write reads the record in the same Redis transaction).

The record names the reply channel of the process running it (`owner`). A process that dies (a
SIGKILL, the OOM killer) leaves its background responses stored as running, their generations
dropped by the worker (a PUBLISH that reaches no one); whoever reads such a record next (a retrieve, a
follow-up, a cancel) finds no subscriber on that channel and stores it as failed, with its output so
far, closed. A live process always listens on its channel: its relay subscribes before it queues
anything, and where the relay loses Redis its runs fail anyway. A run whose end cannot be stored
(Redis away) tries again every second until it is, or until its process stops."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import redis
from marshmallow import ValidationError

from app.chat_deltas import translated
from app.conversations import ResponseNotFound, ResponseStore, StoredResponse
from app.generation import Generation
from app.responses_format import (
    ResponseEvents,
    chat_body,
    response_object,
    responses_error,
    responses_param,
)
from app.service import CompletionService
from schemas.errors import ClientGone, ContextLengthExceeded, GenerationFailed, InvalidRequest, TokenlineError
from schemas.keys import cancel_key
from schemas.requests import first_error, load_request
from schemas.response_items import input_item
from schemas.responses import ResponsesRequest, ResponsesSchema

logger = logging.getLogger(__name__)

STOP_SECONDS = 5.0  # how long a stopping API process waits for its background responses to be stored
# How long a cancel waits for the cancelled run to store its output so far (its worker drops it at its
# next step; the run's API process, this one or another, then stores it).
CANCEL_WAIT_SECONDS = 5.0
STORE_RETRY_SECONDS = 1.0  # how often a run whose end could not be stored (Redis away) tries again


@dataclass
class ResponseRun:
    """One create: its request, the generation answering it, the events that build its response, and
    the record stored when it ends."""

    request: ResponsesRequest
    scope: str
    generation: Generation
    builder: ResponseEvents
    record: StoredResponse


class ResponsesApi:
    """What the routes share: the service that runs chat, the schema, the store."""

    def __init__(self, service: CompletionService, store: ResponseStore) -> None:
        self.service = service
        self.store = store
        self.schema = ResponsesSchema()
        self.running: dict[str, ResponseRun] = {}  # this process's background responses, by request id
        self.stopping = threading.Event()

    def create(self, request_: ResponsesRequest, scope: str) -> ResponseRun:
        """Queue the chat request of a Responses request, after the conversation it continues."""
        if any(item["type"] == "item_reference" for item in request_.items):
            request_ = dataclasses.replace(request_, items=self._referenced(scope, request_.items))
        context: list[dict[str, Any]] = []
        if request_.previous_response_id:
            previous = self.load(scope, request_.previous_response_id, "previous_response_id")
            status = previous.response.get("status")
            if status in ("queued", "in_progress") or _ending(previous.response):  # its output is not there yet
                status = "ending" if status == "cancelled" else status
                raise InvalidRequest(
                    f"Previous response with id '{request_.previous_response_id}' is still {status}: continue "
                    "from it once it has ended.",
                    param="previous_response_id",
                )
            context = previous.conversation()
        _check_outputs(context, request_.items)
        record = StoredResponse({}, list(request_.items), context)
        if request_.store:
            self.store.check_size(record.conversation(), "previous_response_id" if context else "input")
        chat = None

        def queued(items: tuple[dict[str, Any], ...], before: list[dict[str, Any]]) -> Generation:
            nonlocal chat
            chat = load_request(self.service.chat_schema, chat_body(dataclasses.replace(request_, items=items), before))
            return self.service.chat(
                chat, prefix="resp_", stream=request_.stream, prompt_param="input", rename=responses_param
            )

        try:
            try:
                generation = queued(request_.items, context)
            except ContextLengthExceeded:
                kept = self._truncated(request_, [*context, *request_.items]) if request_.truncation == "auto" else None
                if kept is None:
                    raise
                generation = queued(kept, [])
        except InvalidRequest as exc:
            if chat is not None and request_.instructions:
                exc = self.service.registry.get(chat.model).prompts.system_refused(chat, exc, "instructions")
            raise responses_error(exc) from None
        defaults = self.service.registry.get(generation.model).generation_defaults
        record.response = response_object(request_, generation.request_id, generation.created, defaults)
        events = ResponseEvents(record.response, request_.encrypted_reasoning)
        return ResponseRun(request_, scope, generation, events, record)

    def _referenced(self, scope: str, items: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        """The input with each `item_reference` replaced by the item it names, from the stored response
        (of this API key) that holds it, loaded as the client's own item would be: 404 naming
        `input[i].id` where no stored response holds it (never stored, expired, deleted, another key's:
        OpenAI's answer), 400 where the item cannot be sent back (a call its response ended inside)."""
        records: dict[str, StoredResponse | None] = {}
        resolved = []
        for i, item in enumerate(items):
            if item["type"] != "item_reference":
                resolved.append(item)
                continue
            param = f"input[{i}].id"
            stored = self._stored_item(scope, item["id"], records)
            if stored is None:
                raise ResponseNotFound(f"Item with id '{item['id']}' not found.", param=param)
            try:
                resolved.append(input_item(i, stored))
            except ValidationError as exc:
                _, problem = first_error(exc.messages)
                raise InvalidRequest(
                    f"{param}: the item with id '{item['id']}' cannot be sent back: {problem}", param=param
                ) from None
        return tuple(resolved)

    def _stored_item(
        self, scope: str, item_id: str, records: dict[str, StoredResponse | None]
    ) -> dict[str, Any] | None:
        """The stored item `item_id` of this API key, as it was stored; `records` keeps the responses
        read for this request."""
        response_id = self.store.item_response(scope, item_id)
        if response_id is None:
            return None
        if response_id not in records:
            try:
                records[response_id] = self.load(scope, response_id)
            except ResponseNotFound:  # deleted; its items' index expires with it
                records[response_id] = None
        record = records[response_id]
        held = (*record.input_items, *record.response.get("output", ())) if record else ()
        return next((held_item for held_item in held if held_item.get("id") == item_id), None)

    def _truncated(self, request_: ResponsesRequest, conversation: list[dict[str, Any]]) -> tuple[Any, ...] | None:
        """truncation "auto", for a conversation too long for the context (with max_output_tokens): its
        oldest turns left out, as few as make it fit (`turns`: what may go); None where it does not fit
        with all of them gone. Found by bisection, each try a render and a count, nothing queued."""
        head, cuts = turns(conversation)

        def kept(cut: int) -> tuple[dict[str, Any], ...]:
            return (*conversation[:head], *conversation[cut:])

        def fits(cut: int) -> bool:
            body = chat_body(dataclasses.replace(request_, items=kept(cut)), [])
            try:
                return self.service.fits(load_request(self.service.chat_schema, body))
            except InvalidRequest:  # a conversation its template does not render from there
                return False

        if not cuts or not fits(cuts[-1]):
            return None
        low, high = 0, len(cuts) - 1  # cuts[high] fits; find the first that does
        while low < high:
            middle = (low + high) // 2
            if fits(cuts[middle]):
                high = middle
            else:
                low = middle + 1
        return kept(cuts[low])

    def save(self, run: ResponseRun) -> None:
        if run.request.store:
            self.store.save(run.scope, run.record)

    def load(self, scope: str, response_id: str, param: str | None = None) -> StoredResponse:
        """A stored response; a background one whose API process died is stored as failed first. While
        this process knows Redis is away, a 503 at once (not after a command's timeout)."""
        self.service.relay.ensure_started()
        record = self.store.load(scope, response_id, param)
        if record.owner is not None and _running(record.response) and self._owner_gone(record):
            record = self._settle(scope, response_id, record.owner) or self.store.load(scope, response_id, param)
        return record

    def _owner_gone(self, record: StoredResponse) -> bool:
        """Whether the process that runs this background response can no longer store its end: this
        one, if the run is not among its own; another, if nothing listens on its reply channel."""
        if record.owner == self.service.relay.channel:
            return record.response["id"] not in self.running
        [(_, listeners)] = self.store.connection.pubsub_numsub(record.owner)
        return listeners == 0

    def _settle(self, scope: str, response_id: str, owner: str) -> StoredResponse | None:
        """Store a background response whose process is gone as it ends now: failed, or, if a cancel
        came first, cancelled; its open item closed with what it holds."""

        def settled(stored: StoredResponse | None) -> StoredResponse | None:
            if stored is None or stored.owner != owner or not _running(stored.response):
                return None  # stored meanwhile (its end, a cancel's, a delete)
            builder = ResponseEvents.resumed(stored.response)
            if stored.response["status"] == "cancelled":
                builder.cancel()
            else:
                builder.fail(
                    GenerationFailed(
                        "The API process running this background response died before it ended; create it again."
                    )
                )
            return stored

        record = self.store.update(scope, response_id, settled)
        if record is not None:
            logger.warning(
                "background response %s: the API process that ran it (%s) is gone; stored as %s",
                response_id,
                owner,
                record.response["status"],
            )
        return record

    def in_background(self, run: ResponseRun) -> dict[str, Any]:
        """Store the response as queued and answer it; a thread sees it to its end."""
        run.record.response["status"] = "queued"
        run.record.queue = run.generation.queue
        run.record.owner = self.service.relay.channel
        self.running[run.generation.request_id] = run  # before it is stored: a reader here finds it running
        try:
            self.save(run)
        except BaseException:  # no record to store its end in: the request ends here
            del self.running[run.generation.request_id]
            run.generation.events().close()
            raise
        answer = copy.deepcopy(run.record.response)
        threading.Thread(target=self._run, args=(run,), name="background-response", daemon=True).start()
        return answer

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """This API process is stopping (a reload or a restart: gunicorn's `worker_exit`, which waits
        only for open HTTP requests). Its background responses' events come to it alone, so none could
        end: each still running ends now as failed, stored so and cancelled on its worker, its place
        under maxLinkNum given back (they stayed `in_progress` for responsesTtl, their places held)."""
        self.stopping.set()
        runs = list(self.running.values())
        if not runs:
            return
        logger.warning("stopping: %d background responses end as failed", len(runs))
        for run in runs:
            run.generation.subscription.interrupt(
                GenerationFailed(
                    "The API process running this background response stopped (a restart or a reload) "
                    "before it ended; create it again."
                )
            )
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)

    def _run(self, run: ResponseRun) -> None:
        try:
            self._see_to_end(run)
        finally:
            self.running.pop(run.generation.request_id, None)

    def _see_to_end(self, run: ResponseRun) -> None:
        generation, response = run.generation, run.record.response
        events = generation.events()
        try:
            with closing(events):
                for event in translated(generation, events, run.builder):
                    if event is None and self._cancel_asked(generation.request_id):
                        generation.client_left()  # the events end with ClientGone
                    elif event is not None and response["status"] == "queued":
                        response["status"] = "in_progress"
                        self._store_started(run)
        except ClientGone:
            run.builder.cancel()
        except TokenlineError as exc:
            if exc.code == "cancelled":
                run.builder.cancel()
            else:
                run.builder.fail(exc)
        except Exception:
            logger.exception("background response failed request_id=%s", generation.request_id)
            run.builder.fail(GenerationFailed("Internal error during generation."))
        self._store_end(run)

    def _store_end(self, run: ResponseRun) -> None:
        """Store the run's end, trying again while Redis is away, until this process stops (then the
        record names a process that is gone, and its next reader stores it as failed)."""
        warned = False
        while True:
            try:
                self._store_ended(run)
                return
            except redis.RedisError as exc:
                if not warned:
                    logger.warning(
                        "background response not stored request_id=%s: %s; trying again every %.0f s",
                        run.generation.request_id,
                        exc,
                        STORE_RETRY_SECONDS,
                    )
                    warned = True
            if self.stopping.wait(STORE_RETRY_SECONDS):
                return

    # The stored record of a background response is written by the thread that runs it and by a cancel
    # or a delete from any API process. Each write reads what is stored in the same transaction: a
    # deleted response is never stored again, and once a cancel has answered `cancelled`, it stays so.

    def _store_started(self, run: ResponseRun) -> None:
        """Stored as in progress, if it is still stored as queued (not cancelled, not deleted); with
        Redis away, not (its end is stored once Redis is back)."""

        def started(stored: StoredResponse | None) -> StoredResponse | None:
            return run.record if stored is not None and stored.response["status"] == "queued" else None

        try:
            self.store.update(run.scope, run.record.response["id"], started)
        except redis.RedisError as exc:
            logger.info("background response not stored as started request_id=%s: %s", run.generation.request_id, exc)

    def _store_ended(self, run: ResponseRun) -> None:
        """Stored as it ended, cancelled (with its output so far) if a cancel came first, unless deleted."""

        def ended(stored: StoredResponse | None) -> StoredResponse | None:
            if stored is None:
                logger.info("background response deleted before its end request_id=%s", run.record.response["id"])
                return None
            if stored.response["status"] == "cancelled":
                run.builder.cancel()
            return run.record

        if self.store.update(run.scope, run.record.response["id"], ended) is not None:
            response = run.record.response
            logger.info("background response stored request_id=%s status=%s", response["id"], response["status"])

    def _cancel_asked(self, request_id: str) -> bool:
        """Whether a cancel flagged the run; with Redis away, not yet (the relay ends the run if the
        outage lasts)."""
        try:
            return bool(self.service.dispatcher.connection.exists(cancel_key(request_id)))
        except redis.RedisError:
            return False

    def cancel(self, scope: str, response_id: str) -> dict[str, Any]:
        """Cancel a background response that is queued or in progress (a cancelled one is answered as it
        is; any other is a 400)."""
        self.load(scope, response_id)  # a run whose process died is stored as failed: a 400 below
        found: list[StoredResponse] = []

        def cancelling(stored: StoredResponse | None) -> StoredResponse | None:
            if stored is None:
                raise ResponseNotFound(f"Response with id '{response_id}' not found.")
            found[:] = [stored]
            response = stored.response
            if not response.get("background"):
                raise InvalidRequest(
                    "Only responses created with background=true can be cancelled.", param="response_id"
                )
            if response["status"] == "cancelled":
                return None
            if response["status"] not in ("queued", "in_progress"):
                raise InvalidRequest(
                    f"Response with id '{response_id}' is {response['status']}: only a queued or in-progress "
                    "response can be cancelled.",
                    param="response_id",
                )
            response["status"] = "cancelled"
            return stored

        if self.store.update(scope, response_id, cancelling) is not None:
            record = found[0]
            self.service.dispatcher.cancel(response_id, record.response["model"], record.queue)
        return self._cancelled(scope, response_id, found[0].response)

    def _cancelled(self, scope: str, response_id: str, response: dict[str, Any]) -> dict[str, Any]:
        """The cancelled response with its output so far, once its run has stored it (the record a cancel
        writes holds the output as it was when the run started: an empty message, in progress); as it
        is stored after CANCEL_WAIT_SECONDS."""
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        while _ending(response) and time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                response = self.load(scope, response_id).response
            except ResponseNotFound:  # deleted meanwhile
                break
        return response

    def delete(self, scope: str, response_id: str) -> None:
        """Delete a stored response; a background one still running is cancelled (nothing would keep its end)."""
        self.service.relay.ensure_started()
        record = self.store.delete(scope, response_id)
        response = record.response
        if response.get("background") and response["status"] in ("queued", "in_progress"):
            self.service.dispatcher.cancel(response_id, response["model"], record.queue)


def turns(conversation: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """What truncation may leave out of a conversation: its head (the items up to its first user
    message: the system's and the task an agent works on) stays; after it, whole turns go, oldest first,
    so the rest starts where a turn does (a user message, or the assistant's reasoning, message or call
    after a user message or a call's output) and every call keeps its output. Returns the head's length
    and the places the rest may start, in order (the last keeps the least)."""
    users = [i for i, item in enumerate(conversation) if _is(item, "message", "user")]
    head = users[0] + 1 if users else 0

    def starts_turn(i: int) -> bool:
        item, before = conversation[i], conversation[i - 1]
        if _is(item, "message", "user"):
            return True
        answer = item["type"] in ("reasoning", "function_call") or _is(item, "message", "assistant")
        return answer and (_is(before, "message", "user") or before["type"] == "function_call_output")

    return head, [i for i in range(head + 1, len(conversation)) if starts_turn(i)]


def _is(item: dict[str, Any], kind: str, role: str) -> bool:
    return item["type"] == kind and item.get("role") == role


def _check_outputs(context: list[dict[str, Any]], items: tuple[dict[str, Any], ...]) -> None:
    """Each function_call_output answers a function call before it in the conversation, and each
    function call has its output, as OpenAI requires: an agent that sent the wrong id would get an
    answer that ignores its tool's result, and one that sent no result an answer to a call that
    seemed to return nothing."""
    calls = {item["call_id"]: None for item in context if item["type"] == "function_call"}
    answered = {item["call_id"] for item in context if item["type"] == "function_call_output"}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            calls[item["call_id"]] = None
        elif item["type"] == "function_call_output":
            if item["call_id"] not in calls:
                raise InvalidRequest(
                    f"input[{i}].call_id: No tool call found for function call output with call_id {item['call_id']}.",
                    param=f"input[{i}].call_id",
                )
            answered.add(item["call_id"])
    unanswered = [call for call in calls if call not in answered]
    if unanswered:
        raise InvalidRequest(f"input: No tool output found for function call {unanswered[0]}.", param="input")


def _running(response: dict[str, Any]) -> bool:
    """A background response whose run has not stored its end (queued, in progress, or cancelled with
    its output not yet stored)."""
    return response.get("status") in ("queued", "in_progress") or _ending(response)


def _ending(response: dict[str, Any]) -> bool:
    """A response whose output items are still open: its run has not stored its end."""
    return any(item.get("status") == "in_progress" for item in response.get("output") or ())
