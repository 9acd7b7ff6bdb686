"""From a validated request to a running generation: tokenize, check limits, enqueue, relay.

Everything that can be refused is refused here, before anything is queued.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

from app.admission import Admission
from app.dispatch import Dispatcher
from app.generation import Generation, OutputOptions
from app.parsers import THINK_CLOSE, THINK_OPEN
from app.registry import ModelEntry, ModelRegistry
from app.relay import Relay
from app.tools import call_tag
from schemas import guided
from schemas.chat import ChatCompletionSchema, ChatRequest
from schemas.clock import clock
from schemas.completions import COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionRequest, CompletionSchema
from schemas.config import Settings
from schemas.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    TokenlineError,
)
from schemas.job import JobPayload
from schemas.requests import GENERATE_DEFAULT_MAX_TOKENS, GenerateRequest, GenerateSchema, RequestLimits
from schemas.sampling import MAX_SEED, SamplingParams
from schemas.tokens import DetokenizeSchema, TokenizeSchema

logger = logging.getLogger(__name__)


def new_request_id(prefix: str) -> str:
    """A request id: `prefix` (its separator included, as each API writes its ids: `chatcmpl-`, `cmpl-`,
    `resp_`, `msg_`) and 32 hex digits."""
    return f"{prefix}{uuid.uuid4().hex}"


def echoed(request: ChatRequest) -> str:
    """vLLM's chat echo: the final message's text where it is the assistant's (the answer's role), which
    the answer then begins with; else nothing."""
    last = request.messages[-1]
    return (last.content or "") if request.echo and last.role == "assistant" else ""


def bad_word_ids(model: ModelEntry, words: list[str]) -> list[tuple[int, ...]]:
    """vLLM's bad_words as token sequences: each word as it reads at the start of a text, and, where a
    leading space makes other tokens of the same number, as it reads after a space (in the middle of
    a text)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = word.lstrip()
        first = tuple(model.prompts.encode(bare, add_special_tokens=False))
        if not first:
            raise InvalidRequest(f"bad_words: {word[:32]!r} has no tokens of its own.", param="bad_words")
        sequences.append(first)
        spaced = tuple(model.prompts.encode(" " + bare, add_special_tokens=False))
        if spaced and spaced[0] != first[0] and len(spaced) == len(first):
            sequences.append(spaced)
    return sequences


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
        prefix: str = "chatcmpl-",
        stream: bool | None = None,
        prompt_param: str = "messages",
        rename: Callable[[str], str] = str,
    ) -> Generation:
        """`prefix` begins the request id (`resp_`, `msg_` for the APIs that translate to chat), `stream`
        says whether their answer is streamed (else the chat request's `stream` does), `prompt_param`
        names the field their conversation came from, and `rename` gives a chat field's name in their API."""
        model = self.registry.get(request.model)
        ids, prompt = self._chat_prompt(model, request)
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
        grammar, grammar_param = request.grammar, request.grammar_param
        calls = auto_calls(model, request) if request.tool_choice == "auto" and request.tools else None
        if calls is not None:
            grammar, grammar_param = calls, grammar_param or "tools"
        # Usage in every chunk counts the tokens by their logprob entries (the worker sends one per token).
        logprobs = request.top_logprobs if request.logprobs else (0 if request.continuous_usage else None)
        thinking = self._thinking(model, request.thinking_budget, prompt, constrained=grammar is not None)
        sampling = self.sampling(
            model,
            values,
            len(ids),
            None,
            request.max_tokens_param,
            logprobs=logprobs,
            grammar=grammar,
            **thinking,
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
            vocabulary=model.prompts.vocabulary if request.logprobs or sampling.prompt_logprobs is not None else None,
            prompt_ids=tuple(ids) if sampling.return_token_ids else (),
            token_ids=sampling.return_token_ids,
            prompt_logprobs=sampling.prompt_logprobs is not None,
            tokens_as_ids=request.tokens_as_ids,
            echo=echoed(request),
        )
        streamed = request.stream if stream is None else stream
        generation = self._submit(
            prefix, model, prompt, ids, sampling, request.n, request.timeout, request.cache_salt, output,
            buffer=self._buffer(streamed), prompt_param=prompt_param,
            grammar_param=rename(grammar_param) if grammar_param else None,
        )  # fmt: skip
        log_caller(generation.request_id, request.user, request.safety_identifier)
        return generation

    def fits(self, request: ChatRequest) -> bool:
        """Whether a chat request's prompt, and the max_tokens it asks for, fit the model's context:
        `chat`'s first checks, without queueing anything."""
        model = self.registry.get(request.model)
        ids, _ = self._chat_prompt(model, request)
        wanted = request.sampling.get("max_tokens") or 0
        return len(ids) <= model.max_prompt_tokens and len(ids) + wanted <= model.max_model_len

    def _chat_prompt(self, model: ModelEntry, request: ChatRequest) -> tuple[list[int], str]:
        """The token ids a chat request's model reads, and their text: the rendered conversation,
        tokenized, cut to its last truncate_prompt_tokens."""
        prompt = model.prompts.request_prompt(request)
        ids = model.prompts.encode(prompt, add_special_tokens=request.add_special_tokens)
        return self._truncate(model, ids, prompt, request.truncate_prompt_tokens)

    def generate(self, request: GenerateRequest) -> Generation:
        model = self.registry.get(request.model)
        ids = model.prompts.encode(request.prompt, add_special_tokens=True)
        ids, prompt = self._truncate(model, ids, request.prompt, request.truncate_prompt_tokens)
        self._check_prompt(model, ids, "prompt")
        sampling = self.sampling(model, request.sampling, len(ids), GENERATE_DEFAULT_MAX_TOKENS)
        generation = self._submit(
            "cmpl-", model, prompt, ids, sampling, 1, request.timeout, request.cache_salt,
            buffer=self._buffer(request.stream), prompt_param="prompt",
        )  # fmt: skip
        log_caller(generation.request_id, request.user)
        return generation

    def completions(self, request: CompletionRequest) -> list[Generation]:
        """One generation per prompt, all queued before any is read (they run side by side)."""
        model = self.registry.get(request.model)
        prepared = []
        for i, prompt in enumerate(request.prompts):
            param = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = model.prompts.encode(prompt, add_special_tokens=request.add_special_tokens)
            else:
                ids = list(prompt)
                if model.vocab_size and max(ids) >= model.vocab_size:
                    raise InvalidRequest(
                        f"{param}: token ids must be below {model.vocab_size} (vocabSize).", param=param
                    )
                prompt = model.prompts.tokenizer.decode(ids, skip_special_tokens=False)
            ids, prompt = self._truncate(model, ids, prompt, request.truncate_prompt_tokens)
            self._check_prompt(model, ids, param)
            sampling = self.sampling(
                model,
                request.sampling,
                len(ids),
                COMPLETIONS_DEFAULT_MAX_TOKENS,
                logprobs=request.logprobs
                if request.logprobs is not None
                else (0 if request.continuous_usage else None),
                prompt_logprobs=request.logprobs
                if request.echo and request.logprobs is not None
                else request.sampling.get("prompt_logprobs"),
                grammar=request.grammar,
            )
            prepared.append((prompt, ids, sampling, param))
        output = OutputOptions(
            logprobs=request.logprobs is not None,
            continuous_usage=request.continuous_usage,
            tokenizer=model.prompts.tokenizer,
            vocabulary=model.prompts.vocabulary
            if request.logprobs is not None or request.sampling.get("prompt_logprobs") is not None
            else None,
            token_ids=bool(request.sampling.get("return_token_ids")),
            prompt_logprobs=request.sampling.get("prompt_logprobs") is not None,
            tokens_as_ids=request.tokens_as_ids,
        )
        # Prompts are answered one after another while all of them run: a later prompt's events wait
        # in an unbounded inbox (they are bounded by its max_tokens), not in one that would overflow.
        buffer = self._buffer(request.stream and len(prepared) == 1)
        request_ids = [new_request_id("cmpl-") for _ in prepared]
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
                        "cmpl-",
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
                        grammar_param=request.grammar_param,
                    )
                )
        except Exception:
            for generation in generations:
                self.finish(generation)
            if together:
                self.admission.release(model.name, *request_ids[len(generations) :])
            raise
        for generation in generations:
            log_caller(generation.request_id, request.user)
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
                counts=(prompt_tokens, max_tokens, model.max_model_len),
            )
        if values.get("ignore_eos") and extra.get("grammar") is not None:
            raise InvalidRequest(
                "ignore_eos: the output's grammar (a response format, structured outputs, a forced tool call or "
                "a strict tool's calls) ends it at its end of sequence; it cannot go on to max_tokens.",
                param="ignore_eos",
            )
        if values.get("min_tokens", 0) > max_tokens:  # as vLLM refuses it
            raise InvalidRequest(f"min_tokens: Must be at most {max_tokens_param} ({max_tokens}).", param="min_tokens")
        if values.get("bad_words"):
            values = {**values, "bad_words": bad_word_ids(model, values["bad_words"])}
        vocab = model.vocab_size
        if vocab:
            if values.get("top_k", -1) >= vocab:
                raise InvalidRequest(f"top_k: Must be -1 or in (0, {vocab}) (vocabSize).", param="top_k")
            for name, ids in (
                ("logit_bias", [t for t, _ in values.get("logit_bias", ())]),
                ("stop_token_ids", values.get("stop_token_ids", ())),
                ("allowed_token_ids", values.get("allowed_token_ids", ())),
            ):
                if any(t >= vocab for t in ids):
                    raise InvalidRequest(f"{name}: token ids must be below {vocab} (vocabSize).", param=name)
        return SamplingParams(**{**model.generation_defaults, **values, "max_tokens": max_tokens, **extra})

    @staticmethod
    def _thinking(model: ModelEntry, budget: int | None, prompt: str, constrained: bool) -> dict[str, Any]:
        """The reasoning as the worker reads it, for vLLM's thinking_token_budget and for a grammar
        (`constrained`), which constrains only the answer after a reasoning (vLLM's structured outputs
        with a reasoning parser): the tokens that open and close a reasoning (none open it where the
        prompt ends inside one), and the budget. Nothing for a grammar where the model does not reason,
        or where the prompt closed the reasoning already (a template with thinking off)."""
        reasons = model.reasoning_parser == "think"
        check_thinking_budget(model, budget)
        prompt = prompt.rstrip()
        if budget is None and not (constrained and reasons and not prompt.endswith(THINK_CLOSE)):
            return {}
        inside = prompt.endswith(THINK_OPEN)
        return {
            **({"thinking_budget": budget} if budget is not None else {}),
            "thinking_start": () if inside else tuple(model.prompts.encode(THINK_OPEN, add_special_tokens=False)),
            "thinking_end": tuple(model.prompts.encode(THINK_CLOSE, add_special_tokens=False)),
        }

    @staticmethod
    def _truncate(model: ModelEntry, ids: list[int], prompt: str, keep: int | None) -> tuple[list[int], str]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as a prompt may
        hold), and the text they decode to, which an echo repeats; a prompt no longer than that is kept
        as it is."""
        if keep is None:
            return ids, prompt
        if keep > model.max_model_len:
            raise InvalidRequest(
                f"truncate_prompt_tokens: Must be at most {model.max_model_len} (the model's context).",
                param="truncate_prompt_tokens",
            )
        keep = model.max_prompt_tokens if keep == -1 else keep
        if len(ids) <= keep:
            return ids, prompt
        ids = ids[len(ids) - keep :]
        return ids, model.prompts.tokenizer.decode(ids, skip_special_tokens=False)

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
                counts=(len(ids), None, model.max_prompt_tokens),
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


def log_caller(request_id: str, user: str | None, safety_identifier: str | None = None) -> None:
    """A request's end-user ids (OpenAI's `user`, `safety_identifier`), logged with its id: what they
    are for, tracing abuse to a caller's user."""
    if user or safety_identifier:
        logger.info("request_id=%s user=%s safety_identifier=%s", request_id, user, safety_identifier)


def check_thinking_budget(model: ModelEntry, budget: int | None) -> None:
    """A thinking budget is for a model that reasons in <think>…</think>; another refuses it by name."""
    if budget is not None and model.reasoning_parser != "think":
        raise InvalidRequest(
            f"thinking_token_budget: the model does not reason in {THINK_OPEN}…{THINK_CLOSE} "
            "(its reasoningParser is none).",
            param="thinking_token_budget",
        )


def auto_calls(model: ModelEntry, request: ChatRequest) -> str | None:
    """tool_choice "auto": where the model's format has a grammar for its calls (app/tools/formats.py's
    call_tag), the grammar that holds the calls it writes to the tools' names and schemas (each
    tool as strict as it asks) when a tool is strict, its text left free; and with a JSON response
    format, the grammar of that answer or calls, so that the format leaves the model its tools. None
    otherwise: the request's own grammar, if any, serves (a format's then holds the whole output, and
    a format without such a grammar cannot write calls). A 400 naming `tools` where a schema does not
    compile."""
    tag = call_tag(model.tool_parser, model.prompts.template_text)
    answer = request.answer_format
    if tag is None:
        return None
    if answer is None and (request.grammar is not None or not any(tool.strict for tool in request.tools)):
        return None  # structured outputs hold the whole output; without a strict tool, nothing is held
    tokens = model.prompts.added_tokens
    if tag.trigger in tokens and not guided.MARKER.fullmatch(tag.trigger):
        return None  # a token the grammar cannot name: spelt as text, the model could never call
    block = tag.block(((tool.name, tool.parameters, tool.strict) for tool in request.tools), tokens)
    try:
        return guided.tool_calls_in_text(block) if answer is None else guided.answer_or_calls(answer, block)
    except guided.GrammarError as exc:
        raise InvalidRequest(
            f"tools: A function's parameters are not a usable JSON schema: {exc}", param="tools"
        ) from None
