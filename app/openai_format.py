"""OpenAI chat.completion and chat.completion.chunk (SSE) from token events."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from app.generation import Generation, OutputOptions
from app.parsers import ChoiceParser
from schemas.errors import ClientGone, GenerationFailed, TokenlineError
from schemas.job import Event

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"
LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM writes this for a token the model rules out


def raise_for_event(event: Event) -> None:
    """An error or cancellation ends a generation; surface it as the error the client will see."""
    if event.kind == "error":
        raise TokenlineError.from_envelope(event.error or {})
    if event.kind == "cancelled":
        raise GenerationFailed("The request was cancelled.", code="cancelled")


def parser_for(options: OutputOptions) -> ChoiceParser:
    return ChoiceParser(
        reasoning=options.reasoning,
        thinking=options.thinking,
        tools=options.tools,
        tool_name=options.tool_name,
        parallel=options.parallel,
        call_ids=options.call_ids,
        parameters=dict(options.parameters),
    )


def token_text(options: OutputOptions | None, token: int, first: bool = False) -> str:
    """A token's own text, as its logprob entries name it: the text of the bytes it stands for (a
    SentencePiece "▁" is the space it writes, as in the content; a piece of a character is U+FFFD).
    Not `decode([token])`, but for the text's `first` token: a decoder that strips the text's first
    space (Llama 2, Mistral) strips it from every token decoded alone."""
    if options is None or options.tokenizer is None:
        return str(token)
    if options.vocabulary is not None and not first:
        return options.vocabulary.text_of(token)
    return options.tokenizer.decode([token], skip_special_tokens=False)


def token_label(options: OutputOptions | None, token: int, first: bool = False) -> str:
    """How a logprob entry names a token: its text, or `token_id:<id>` with vLLM's
    return_tokens_as_token_ids (for tokens whose text is not theirs alone: a piece of a character)."""
    if options is not None and options.tokens_as_ids:
        return f"token_id:{token}"
    return token_text(options, token, first)


def logprob_value(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def chat_logprobs(options: OutputOptions, entries: list[Any]) -> list[dict[str, Any]]:
    """Worker entries [id, logprob, [[id, logprob], …]] in OpenAI's chat shape."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_label(options, token)
        # A token that is a piece of a character: its own bytes, which join with its neighbours' into
        # the character (its text is U+FFFD); named by its id, the name's bytes, as vLLM gives them.
        named = options.vocabulary is None or options.tokens_as_ids
        raw = text.encode("utf-8") if named else options.vocabulary.bytes_of(token, False)
        return {"token": text, "logprob": logprob_value(logprob), "bytes": list(raw)}

    return [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]} for token, lp, top in entries]


def prompt_logprobs(options: OutputOptions, entries: list[Any]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs from a "prompt" event's entries: per prompt token (the first null) its
    id's {logprob, rank, decoded_token}, then its alternatives' (ranks 1 to k). A prompt of one token
    has no event (nothing to score): its one entry is null."""

    def one(token: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob_value(logprob), "rank": rank, "decoded_token": token_label(options, token)}

    scored: list[dict[str, Any] | None] = []
    for entry in entries or [None]:
        if entry is None:
            scored.append(None)
            continue
        token, logprob, top, rank = entry
        alternatives = {str(t): one(t, v, r) for r, (t, v) in enumerate(top, 1)}
        scored.append({str(token): one(token, logprob, rank), **alternatives})
    return scored


def finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    """`tool_calls` when the model ended on its own after calling; a call cut by max_tokens keeps
    `length` and one cut by a stop sequence `stop` (its arguments are as far as they were written)."""
    return "tool_calls" if parser.calls and reason == "stop" and parser.calls_complete() else reason


def chat_finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    """A chat choice's finish_reason: as `finish_reason`, except that the call of a named tool_choice
    ends with `stop`, as OpenAI and vLLM end it (the client named the call; `tool_calls` says the model
    chose to call)."""
    return reason if parser.tools == "named" else finish_reason(reason, parser)


class MessageBuilder:
    """One choice's message from its parser's deltas: the same deltas a stream sends, joined."""

    def __init__(self, options: OutputOptions) -> None:
        self.options = options
        self.parser = parser_for(options)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[Any] = []
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self.stop_reason: str | int | None = None

    def feed(self, text: str) -> None:
        for delta in self.parser.feed(text):
            self._add(delta)

    def _add(self, delta: dict[str, Any]) -> None:
        if "content" in delta:
            self.content.append(delta["content"])
        elif "reasoning_content" in delta:
            self.reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                self.calls.append({key: call[key] for key in ("id", "type")} | {"function": dict(call["function"])})
            else:
                self.calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]

    def choice(self, index: int) -> dict[str, Any]:
        for delta in self.parser.close():
            self._add(delta)
        content = self.options.echo + "".join(self.content)
        reasoning = "".join(self.reasoning) or None
        # No words at all is "" for a plain reply, and null beside reasoning or calls or for a forced call.
        wordless = self.calls or reasoning or self.options.tools in ("named", "required")
        # `refusal` is always null (the model's refusals are its words), as OpenAI and vLLM send it.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or (None if wordless else ""),
            "refusal": None,
        }
        if self.options.reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        choice = {
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(self.options, self.logprobs)} if self.options.logprobs else None,
            "finish_reason": chat_finish_reason(self.finish, self.parser),
            "stop_reason": self.stop_reason,
        }
        if self.options.token_ids:
            choice["token_ids"] = self.token_ids
        return choice


def chat_completion(generation: Generation, events: Iterable[Event | None]) -> dict[str, Any]:
    options = generation.output
    builders = [MessageBuilder(options) for _ in range(generation.n)]
    completion_tokens = 0
    scored: list[Any] = []  # the prompt's logprob entries (vLLM's prompt_logprobs)
    for event in events:
        if event is None:
            continue
        raise_for_event(event)
        builder = builders[event.index]
        if event.kind == "prompt":
            scored += event.logprobs or []
        elif event.kind == "token":
            builder.feed(event.text)
            builder.logprobs += event.logprobs or []
            builder.token_ids += event.token_ids or []
        elif event.kind == "done":
            builder.finish, builder.stop_reason = event.finish_reason, event.stop_reason
            completion_tokens += event.usage.completion_tokens if event.usage else 0
    body = {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": generation.created,
        "model": generation.model,
        "choices": [builder.choice(i) for i, builder in enumerate(builders)],
        "usage": _usage(generation.prompt_tokens, completion_tokens, generation.cached_tokens),
    }
    if options.prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs(options, scored)
    if options.token_ids:  # vLLM's return_token_ids
        body["prompt_token_ids"] = list(options.prompt_ids)
    return body


def chat_stream(generation: Generation, events: Iterable[Event | None], include_usage: bool) -> Iterator[str]:
    """SSE: a role chunk per choice, content deltas, a finish chunk per choice, usage, [DONE].

    A None from `events` (a quiet interval) becomes an SSE comment: it keeps proxies from timing out
    and lets the server learn that a waiting client has gone. Reasoning goes out as
    `reasoning_content` deltas; a tool call as a first delta with its id and name, then its
    arguments as the model writes them. With `continuous_usage` every chunk carries the usage of
    its choice so far (vLLM's stream_options.continuous_usage_stats). With vLLM's return_token_ids
    the first chunk carries `prompt_token_ids`, and a choice's chunk the ids of the tokens whose text
    it carries (`token_ids`).
    """
    options = generation.output
    continuous = options.continuous_usage
    parsers = [parser_for(options) for _ in range(generation.n)]
    counts = [0] * generation.n  # completion tokens of each choice so far
    plain = options.tools == "none" and not (options.reasoning or options.logprobs or continuous or options.token_ids)

    with_usage = include_usage or continuous
    chunk = chunker("chat.completion.chunk", generation, with_usage)

    def send(
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: Any = None,
        top: dict[str, Any] | None = None,
        **end: Any,
    ) -> str:
        usage = _usage(generation.prompt_tokens, counts[index]) if continuous else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **end}
        return chunk([choice], usage, **(top or {}))

    # Content chunks are most of a stream: build them from a fixed head and tail, not a dict per token.
    head = chunk([])[: -len("]}\n\n") - (len(',"usage":null') if with_usage else 0)]
    tail = ',"usage":null}\n\n' if with_usage else "}\n\n"

    def content_chunk(index: int, text: str) -> str:
        delta = json.dumps(text, ensure_ascii=False)
        return f'{head}{{"index":{index},"delta":{{"content":{delta}}},"logprobs":null,"finish_reason":null}}]{tail}'

    def parsed_chunks(event: Event) -> Iterator[str]:
        counts[event.index] += len(event.logprobs or ())
        deltas = parsers[event.index].feed(event.text)
        logprobs = {"content": chat_logprobs(options, event.logprobs or [])} if options.logprobs else None
        ids = {"token_ids": event.token_ids or []} if options.token_ids else {}
        if not deltas and ((logprobs and logprobs["content"]) or event.token_ids):
            deltas = [{"content": ""}]  # the tokens' text is held back; their logprobs and ids are not
        for n, delta in enumerate(deltas):  # the event's logprobs and ids go with its first delta
            yield send(event.index, delta, **({"logprobs": logprobs, **ids} if n == 0 else {}))

    def closing_chunks(event: Event) -> Iterator[str]:
        if event.usage:
            counts[event.index] = event.usage.completion_tokens
        parser = parsers[event.index]
        for delta in parser.close():
            yield send(event.index, delta)
        yield send(event.index, {}, chat_finish_reason(event.finish_reason, parser), stop_reason=event.stop_reason)

    try:
        # A forced call writes no text: its content is null from the first chunk, as the whole
        # message's is (OpenAI's streams of tool calls open so).
        opening = None if options.tools in ("named", "required") else ""
        prompt_ids = {"prompt_token_ids": list(options.prompt_ids)} if options.token_ids else None
        for i in range(generation.n):  # vLLM's return_token_ids: the prompt's ids in the first chunk
            yield send(i, {"role": "assistant", "content": opening}, top=prompt_ids if i == 0 else None)
        for i in range(generation.n if options.echo else 0):  # vLLM's echo: the final message's text first
            yield send(i, {"content": options.echo})
        for event in events:
            if event is None:
                yield KEEP_ALIVE
                continue
            raise_for_event(event)
            if event.kind == "token":
                if plain:
                    yield content_chunk(event.index, event.text)
                else:
                    yield from parsed_chunks(event)
            elif event.kind == "done":
                yield from closing_chunks(event)
        if include_usage:
            yield chunk([], _usage(generation.prompt_tokens, sum(counts), generation.cached_tokens))
    except ClientGone:
        logger.info("client left request_id=%s", generation.request_id)
        return  # no one to write to: an error event and [DONE] would only fail on the closed socket
    except TokenlineError as exc:
        logger.warning("stream ended with an error request_id=%s: %s", generation.request_id, exc.message)
        yield sse(exc.envelope())
    except Exception:
        logger.exception("stream failed request_id=%s", generation.request_id)
        yield sse(GenerationFailed("Internal error during generation.").envelope())
    yield DONE


def chunker(kind: str, generation: Generation, include_usage: bool) -> Callable[..., str]:
    """`chunk(choices, usage=None)`: one SSE chunk of a stream of `kind` (chat.completion.chunk or
    text_completion); with stream_options.include_usage every chunk carries `usage` (null but the last)."""

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None, **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": generation.request_id,
            "object": kind,
            "created": generation.created,
            "model": generation.model,
            "choices": choices,
            **extra,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    return chunk


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; a request's final usage (with `cached_tokens`) also says how many prompt tokens
    the worker's prefix cache held (prompt_tokens_details.cached_tokens)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage
