"""A queued request's generation: the events that answer it, read from its subscription, and the
checks of its worker and job made in each quiet interval while it waits (app/service.py queues it)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from rq.job import JobStatus

from app.relay import FirstEventTimeout, Subscription
from schemas.errors import (
    ClientGone,
    ConstraintFailed,
    ContextLengthExceeded,
    GenerationFailed,
    NoWorker,
    QueueTimeout,
    RelayTimeout,
    TokenlineError,
    WorkerLost,
)
from schemas.job import Event
from schemas.keys import queue_name

if TYPE_CHECKING:
    from app.service import CompletionService

HEARTBEAT_SECONDS = 1.0  # how often a waiting request writes a keep-alive and checks its worker
# A queued job off every queue this long was taken by a worker that died before starting it (a live
# worker records a job's start within milliseconds of its dequeue).
IN_TRANSIT_SECONDS = 2.0


@dataclass(frozen=True)
class OutputOptions:
    """How the formatters read a generation's text: the tool-call format ("none", a model format,
    "named" or "required"), the shape of call ids ("mistral" or "openai"), the functions'
    parameters (to type formats that write arguments as text), whether the model reasons in <think>
    (and starts inside it), logprobs, usage in every chunk, the tokenizer that names token ids, and
    whether the answer carries its token ids and the prompt's (vLLM's return_token_ids). Without
    parallel calls only the first call the model writes is answered (as vLLM answers)."""

    tools: str = "none"
    tool_name: str | None = None
    parallel: bool = True
    call_ids: str = "openai"
    parameters: Mapping[str, Any] = field(default_factory=dict)
    reasoning: bool = False
    thinking: bool = False
    logprobs: bool = False
    continuous_usage: bool = False
    tokenizer: Any = None
    vocabulary: Any = None  # each token's bytes (schemas/vocabulary.py), where logprobs are asked for
    prompt_ids: tuple[int, ...] = ()
    token_ids: bool = False
    prompt_logprobs: bool = False  # vLLM's: the prompt's logprobs in its shape, beside the answer
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob entries name `token_id:<id>`
    echo: str = ""  # vLLM's chat echo: the text each choice's content begins with


@dataclass
class Generation:
    """A queued request and the events that answer it. Closing it early cancels the job."""

    request_id: str
    model: str
    created: int
    prompt: str
    prompt_tokens: int
    n: int
    subscription: Subscription
    service: CompletionService = field(repr=False)
    timeout: float = float("inf")  # seconds, end to end
    started: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # the worker has been told to drop the request
    queue: str | None = None  # the RQ queue its job was put on (app/routing.py)
    cached_tokens: int = 0  # prompt tokens the worker found cached (its first choice's done event says)
    output: OutputOptions = field(default_factory=lambda: OutputOptions())
    prompt_param: str = "prompt"  # the request's field that holds the prompt, as its API names it
    grammar_param: str | None = None  # the field whose schema its output follows, as its API names it
    off_queue_since: float | None = None  # time.monotonic() its queued job was first found off the queues
    failed_seen: bool = False  # its job was found failed in RQ, its error event not yet come

    @property
    def ended(self) -> bool:
        return self.subscription.closed

    def client_left(self) -> None:
        """From any thread (the API's client watch): the client hung up. The worker is told at once,
        and the request ends, even while nothing is being written to the client.

        The cancel flag goes out before the request's stream unwinds, which can take several decode
        steps when many clients hang up together; the worker would decode for them meanwhile."""
        if not self.subscription.finished and not self.cancelled:
            self.cancelled = True
            self.service.dispatcher.cancel(self.request_id, self.model, self.queue)
        self.subscription.interrupt(ClientGone("The client closed the connection."))

    def events(self) -> Events:
        """The request's events; None marks a quiet heartbeat interval (a keep-alive is due).

        In each quiet interval the job's worker is checked: if it died, the request fails at once.
        The error that ends a request is counted in the API's metrics. Closing them ends the request
        (Events.close), read or not.
        """
        return Events(self)

    def _counted_events(self) -> Iterator[Event | None]:
        try:
            yield from self._events()
        except TokenlineError as exc:
            self.service.count_error(exc)
            raise

    def _events(self) -> Iterator[Event | None]:
        settings = self.service.settings
        try:
            for event in self.subscription.events(
                settings.queue_timeout, settings.token_timeout, HEARTBEAT_SECONDS, deadline=self.started + self.timeout
            ):
                if event is None:
                    self._check_worker()
                elif event.kind == "done" and event.index == 0 and event.usage is not None:
                    self.cached_tokens = event.usage.cached_tokens
                elif event.kind == "error":
                    # Raised here, not by each formatter, so that _counted_events counts it, streamed or not.
                    error = dict(event.error or {})
                    # The worker knows no field names: the prompt's fills its KV pool (which may hold less
                    # than the model's context), or the schema's grammar failed there.
                    if error.get("code") == ContextLengthExceeded.code:
                        error["param"] = error.get("param") or self.prompt_param
                    elif error.get("code") == ConstraintFailed.code:
                        error["param"] = error.get("param") or self.grammar_param
                    raise TokenlineError.from_envelope(error)
                yield event
        except FirstEventTimeout:
            try:
                status, _ = self.service.admission.job_state(self.request_id)
            except redis.RedisError:
                status = "unknown"
            if status in (None, "queued", "deferred", "scheduled"):
                raise QueueTimeout(
                    f"No worker took the request within {settings.queue_timeout:g} seconds (queueTimeout); "
                    "it was withdrawn. Try again shortly."
                ) from None
            raise RelayTimeout(
                f"No response from the model worker within {settings.queue_timeout:g} seconds."
            ) from None
        except RelayTimeout:
            reason = self.service.dispatcher.failure(self.request_id)
            if reason:  # the worker's own words, as its error event carries them
                raise GenerationFailed(reason) from None
            raise
        finally:
            self.service.finish(self)

    def _check_worker(self) -> None:
        """A started job whose worker died fails the request (502); a queued one for a model that no
        live worker serves is withdrawn (503): nobody would take it; a job that failed in RQ ends it."""
        service = self.service
        try:
            status, alive = service.admission.job_state(self.request_id)
            orphaned = status == "queued" and service.admission.live_workers([self.model])[self.model] == 0
            lost = status == "queued" and not orphaned and self._lost_in_transit()
        except redis.RedisError:
            return  # the relay reports a Redis outage itself
        if not self.subscription.inbox.empty():
            # Events came while Redis was asked: they come first. A worker that ends a request (its
            # group broke, it stops) publishes the error before it leaves the live set, and the two
            # can meet here; the next quiet interval checks again.
            return
        if not alive:
            reason = "the worker serving this request stopped (no heartbeat)"
            service.dispatcher.fail_abandoned(self.request_id, reason)
            raise WorkerLost(f"Generation failed: {reason}. The request was not retried.")
        if lost:
            reason = "the worker that took this request off its queue stopped before starting it"
            self.cancelled = True  # a worker that did take it, only slowly, drops it
            service.dispatcher.cancel(self.request_id)
            service.dispatcher.fail_abandoned(self.request_id, reason, JobStatus.QUEUED)
            raise WorkerLost(f"Generation failed: {reason}. The request was not retried.")
        # Queued for a worker that died or drains: the shared queue serves it instead.
        on_worker_queue = status == "queued" and not orphaned and self.queue != queue_name(self.model)
        if on_worker_queue and service.dispatcher.rescue(self.request_id, self.model):
            self.queue = queue_name(self.model)
        if orphaned:
            self.cancelled = True
            service.dispatcher.cancel(self.request_id, self.model, self.queue)
            raise NoWorker(f"No worker is serving model '{self.model}' right now; try again shortly.")
        if status == "failed":
            # The worker published its error event before it recorded the failure: the event, which says
            # what kind of error it is (a 400 of the request's, or the worker's 500), is on its way and
            # ends the request. Only if a quiet interval more brings nothing was it lost.
            if not self.failed_seen:
                self.failed_seen = True
                return
            raise GenerationFailed(service.dispatcher.failure(self.request_id) or "Generation failed: the job failed.")

    def _lost_in_transit(self) -> bool:
        """Whether the queued job has been off every queue for IN_TRANSIT_SECONDS."""
        if not self.service.dispatcher.off_the_queues(self.request_id, self.model, self.queue):
            self.off_queue_since = None
            return False
        now = time.monotonic()
        if self.off_queue_since is None:
            self.off_queue_since = now
        return now - self.off_queue_since >= IN_TRANSIT_SECONDS


class Events:
    """A generation's events, as an iterator that ends the request when it is closed, also when it was
    never read: a generator's `finally` runs only once it has started, and a stream whose client reset
    the connection before its first chunk was written is closed before it reads its first event (its
    place under maxLinkNum then stayed taken until the hold expired)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._events = generation._counted_events()

    def __iter__(self) -> Events:
        return self

    def __next__(self) -> Event | None:
        return next(self._events)

    def close(self) -> None:
        try:
            self._events.close()
        finally:
            if not self.generation.ended:
                self.generation.service.finish(self.generation)
