"""From a validated request to a running generation: tokenize, check limits, enqueue, relay.

Everything that can be refused is refused here, before anything is queued.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from rq.job import JobStatus

from app.admission import Admission
from app.dispatch import Dispatcher
from app.registry import ModelEntry, ModelRegistry
from app.relay import FirstEventTimeout, Relay, Subscription
from schemas.chat import ChatCompletionSchema, ChatRequest
from schemas.clock import clock
from schemas.completions import COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionRequest, CompletionSchema
from schemas.config import Settings
from schemas.errors import (
    ClientGone,
    ConstraintFailed,
    ContextLengthExceeded,
    GenerationFailed,
    InvalidRequest,
    NoWorker,
    QueueTimeout,
    RelayTimeout,
    TokenlineError,
    WorkerLost,
)
from schemas.job import Event, JobPayload
from schemas.keys import queue_name
from schemas.requests import GENERATE_DEFAULT_MAX_TOKENS, GenerateRequest, GenerateSchema, RequestLimits
from schemas.sampling import MAX_SEED, SamplingParams
from schemas.tokens import DetokenizeSchema, TokenizeSchema

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0  # how often a waiting request writes a keep-alive and checks its worker
# A queued job off every queue this long was taken by a worker that died before starting it (a live
# worker records a job's start within milliseconds of its dequeue).
IN_TRANSIT_SECONDS = 2.0


@dataclass(frozen=True)
class OutputOptions:
    """How the formatters read a generation's text: the tool-call format ("none", a model format,
    "named" or "required"), the shape of call ids ("mistral" or "openai"), the functions'
    parameters (to type formats that write arguments as text), whether the model reasons in <think>
    (and starts inside it), logprobs, usage in every chunk, and the tokenizer that names token ids.
    Without parallel calls only the first call the model writes is answered (as vLLM answers)."""

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


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionService:
    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        dispatcher: Dispatcher,
        relay: Relay,
        admission: Admission,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.dispatcher = dispatcher
        self.relay = relay
        self.admission = admission
        self.metrics: Any = None  # app/metrics.py's ApiMetrics, when the app has one
        self.limits = RequestLimits(max_iter_times=settings.max_iter_times, max_n=settings.max_n)
        # Built once: a marshmallow schema keeps no state between loads, and building one costs more.
        self.chat_schema = ChatCompletionSchema(self.limits)
        self.generate_schema = GenerateSchema(self.limits)
        self.completion_schema = CompletionSchema(self.limits)
        self.tokenize_schema = TokenizeSchema()
        self.detokenize_schema = DetokenizeSchema()

    def chat(
        self,
        request: ChatRequest,
        prefix: str = "chatcmpl",
        stream: bool | None = None,
        prompt_param: str = "messages",
        rename: Callable[[str], str] = str,
    ) -> Generation:
        """`prefix` begins the request id (`resp`, `msg` for the APIs that translate to chat), `stream`
        says whether their answer is streamed (else the chat request's `stream` does), `prompt_param`
        names the field their conversation came from, and `rename` gives a chat field's name in their API."""
        model = self.registry.get(request.model)
        prompt = model.prompts.chat_prompt(request.messages, request.tools, request.template_kwargs)
        ids = model.prompts.encode(prompt, add_special_tokens=False)
        self._check_prompt(model, ids, prompt_param)
        tools = {"none": "none", "auto": model.tool_parser, "required": "required", "function": "named"}
        mode = tools[request.tool_choice]
        values = dict(request.sampling)
        if request.tool_choice == "auto" and mode != "none":  # markers may be special tokens (as vLLM does)
            values.setdefault("skip_special_tokens", False)
        if mode in ("named", "required"):
            # A forced call is not text: its grammar ends it, and a stop sequence or token would cut
            # its arguments short of their schema.
            for key in ("stop", "stop_token_ids", "include_stop_str_in_output"):
                values.pop(key, None)
        # Usage in every chunk counts the tokens by their logprob entries (the worker sends one per token).
        logprobs = request.top_logprobs if request.logprobs else (0 if request.continuous_usage else None)
        sampling = self.sampling(
            model, values, len(ids), None, request.max_tokens_param, logprobs=logprobs, grammar=request.grammar
        )
        output = OutputOptions(
            tools=mode,
            tool_name=request.tool_name,
            parallel=request.parallel_tool_calls,
            call_ids="mistral" if model.tool_parser == "mistral" else "openai",
            parameters={tool.name: tool.parameters for tool in request.tools},
            reasoning=model.reasoning_parser == "think",
            thinking=prompt.rstrip().endswith("<think>"),
            logprobs=request.logprobs,
            continuous_usage=request.continuous_usage,
            tokenizer=model.prompts.tokenizer,
            vocabulary=model.prompts.vocabulary if request.logprobs else None,
        )
        streamed = request.stream if stream is None else stream
        generation = self._submit(
            prefix, model, prompt, ids, sampling, request.n, request.timeout, request.cache_salt, output,
            buffer=self._buffer(streamed), prompt_param=prompt_param,
            grammar_param=rename(request.grammar_param) if request.grammar_param else None,
        )  # fmt: skip
        if request.user or request.safety_identifier:  # what they are for: tracing abuse to a caller's user
            logger.info(
                "request_id=%s user=%s safety_identifier=%s",
                generation.request_id,
                request.user,
                request.safety_identifier,
            )
        return generation

    def generate(self, request: GenerateRequest) -> Generation:
        model = self.registry.get(request.model)
        ids = model.prompts.encode(request.prompt, add_special_tokens=True)
        self._check_prompt(model, ids, "prompt")
        sampling = self.sampling(model, request.sampling, len(ids), GENERATE_DEFAULT_MAX_TOKENS)
        return self._submit(
            "cmpl", model, request.prompt, ids, sampling, 1, request.timeout, request.cache_salt,
            buffer=self._buffer(request.stream), prompt_param="prompt",
        )  # fmt: skip

    def completions(self, request: CompletionRequest) -> list[Generation]:
        """One generation per prompt, all queued before any is read (they run side by side)."""
        model = self.registry.get(request.model)
        prepared = []
        for i, prompt in enumerate(request.prompts):
            param = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = model.prompts.encode(prompt, add_special_tokens=True)
            else:
                ids = list(prompt)
                if model.vocab_size and max(ids) >= model.vocab_size:
                    raise InvalidRequest(
                        f"{param}: token ids must be below {model.vocab_size} (vocabSize).", param=param
                    )
                prompt = model.prompts.tokenizer.decode(ids, skip_special_tokens=False)
            self._check_prompt(model, ids, param)
            sampling = self.sampling(
                model,
                request.sampling,
                len(ids),
                COMPLETIONS_DEFAULT_MAX_TOKENS,
                logprobs=request.logprobs
                if request.logprobs is not None
                else (0 if request.continuous_usage else None),
                prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None else None,
            )
            prepared.append((prompt, ids, sampling, param))
        output = OutputOptions(
            logprobs=request.logprobs is not None,
            continuous_usage=request.continuous_usage,
            tokenizer=model.prompts.tokenizer,
            vocabulary=model.prompts.vocabulary if request.logprobs is not None else None,
        )
        # Prompts are answered one after another while all of them run: a later prompt's events wait
        # in an unbounded inbox (they are bounded by its max_tokens), not in one that would overflow.
        buffer = self._buffer(request.stream and len(prepared) == 1)
        request_ids = [new_request_id("cmpl") for _ in prepared]
        together = len(prepared) > 1
        if together:  # the prompts' places all at once, or none (a 429 then leaves nothing queued)
            if len(prepared) > self.settings.max_link_num:
                raise InvalidRequest(
                    f"prompt: {len(prepared)} prompts; at most {self.settings.max_link_num} requests of a model "
                    "are queued or running at once (maxLinkNum).",
                    param="prompt",
                )
            self.admission.admit(model.name, *request_ids)
        generations: list[Generation] = []
        try:
            for request_id, (prompt, ids, sampling, param) in zip(request_ids, prepared, strict=True):
                options = dataclasses.replace(output, prompt_ids=tuple(ids))
                generations.append(
                    self._submit(
                        "cmpl",
                        model,
                        prompt,
                        ids,
                        sampling,
                        request.n,
                        request.timeout,
                        request.cache_salt,
                        options,
                        buffer=buffer,
                        request_id=request_id,
                        admitted=together,
                        prompt_param=param,
                    )
                )
        except Exception:
            for generation in generations:
                self.finish(generation)
            if together:
                self.admission.release(model.name, *request_ids[len(generations) :])
            raise
        return generations

    def sampling(
        self,
        model: ModelEntry,
        values: dict[str, Any],
        prompt_tokens: int,
        default_max_tokens: int | None,
        max_tokens_param: str = "max_tokens",
        **extra: Any,
    ) -> SamplingParams:
        """A request's sampling values over the model's generation_config.json defaults. Without
        max_tokens it may generate to the end of the context (capped by maxIterTimes when set, or by
        the endpoint's own default); a max_tokens that does not fit the context is a 400, as in vLLM,
        naming `max_tokens_param` (the field the request set it with)."""
        left = model.max_model_len - prompt_tokens
        left_default = left if model.max_iter_times is None else min(left, model.max_iter_times)
        max_tokens = values.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(left_default, default_max_tokens) if default_max_tokens else left_default
        elif max_tokens > left:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the length of the prompt or {max_tokens_param}.",
                param=max_tokens_param,
            )
        if values.get("min_tokens", 0) > max_tokens:  # as vLLM refuses it
            raise InvalidRequest(f"min_tokens: Must be at most {max_tokens_param} ({max_tokens}).", param="min_tokens")
        vocab = model.vocab_size
        if vocab:
            if values.get("top_k", -1) >= vocab:
                raise InvalidRequest(f"top_k: Must be -1 or in (0, {vocab}) (vocabSize).", param="top_k")
            for name, ids in (
                ("logit_bias", [t for t, _ in values.get("logit_bias", ())]),
                ("stop_token_ids", values.get("stop_token_ids", ())),
            ):
                if any(t >= vocab for t in ids):
                    raise InvalidRequest(f"{name}: token ids must be below {vocab} (vocabSize).", param=name)
        return SamplingParams(**{**model.generation_defaults, **values, "max_tokens": max_tokens, **extra})

    def _buffer(self, streamed: bool) -> int:
        """The events a request's inbox holds: `streamBuffer` for a stream, which a slow client can let
        fill; unbounded for an answer the API itself reads (it is bounded by max_tokens)."""
        return self.settings.stream_buffer if streamed else 0

    def _check_prompt(self, model: ModelEntry, ids: list[int], param: str) -> None:
        if len(ids) > model.max_prompt_tokens:
            raise ContextLengthExceeded(
                f"This model's maximum input length is {model.max_prompt_tokens} tokens. However, your "
                f"{param} resulted in {len(ids)} tokens. Please reduce the length of the {param}.",
                param=param,
            )

    def _submit(
        self,
        prefix: str,
        model: ModelEntry,
        prompt: str,
        ids: list[int],
        sampling: SamplingParams,
        n: int,
        timeout: float | None,
        cache_salt: str | None = None,
        output: OutputOptions | None = None,
        *,
        buffer: int,
        request_id: str | None = None,
        admitted: bool = False,
        prompt_param: str,
        grammar_param: str | None = None,
    ) -> Generation:
        """Queue one request; its events arrive in an inbox of `buffer` events (0: unbounded).
        `admitted`: its place was taken with others' (`request_id` then names it)."""
        request_id = request_id or new_request_id(prefix)
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbelow(MAX_SEED) + 1)
        payload = JobPayload(
            request_id,
            model.name,
            tuple(ids),
            sampling,
            self.relay.channel,
            n,
            cache_salt=cache_salt,
            queued_at=clock.now(),  # Redis' clock, as the worker's times are (the relay keeps it measured)
        )
        subscription = self.relay.open(request_id, n, buffer)  # before enqueueing
        try:
            queue = self.dispatcher.submit(payload, admitted)  # 429 over maxLinkNum, 503 with no live worker
        except Exception:
            self.relay.close(request_id)
            raise
        logger.info(
            "queued request_id=%s model=%s prompt_tokens=%d max_tokens=%d",
            request_id,
            model.name,
            len(ids),
            sampling.max_tokens,
        )
        limit = min(timeout or self.settings.e2e_timeout, self.settings.e2e_timeout)
        return Generation(
            request_id,
            model.name,
            int(time.time()),
            prompt,
            len(ids),
            n,
            subscription,
            self,
            timeout=limit,
            output=output or OutputOptions(),
            queue=queue,
            prompt_param=prompt_param,
            grammar_param=grammar_param,
        )

    def count_error(self, error: TokenlineError) -> None:
        if self.metrics is None:
            return
        if error.code == "lost_events":
            self.metrics.relay_gaps.inc()
        self.metrics.count_error(error)

    def finish(self, generation: Generation) -> None:
        self.relay.close(generation.request_id)
        if self.relay.redis.down:
            # No round trip to a Redis known to be away before the client hears of it: the place is
            # given back when Redis answers again, and the worker drops what no one listens to.
            self.admission.release(generation.model, generation.request_id, defer=True)
            return
        if not generation.subscription.finished and not generation.cancelled:
            logger.info("request_id=%s ended early; cancelling", generation.request_id)
            generation.cancelled = True
            self.dispatcher.cancel(generation.request_id, generation.model, generation.queue)
        self.admission.release(generation.model, generation.request_id)
