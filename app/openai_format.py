"""OpenAI chat.completion and chat.completion.chunk (SSE) from token events."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from app.parsers import ChoiceParser
from app.service import Generation, OutputOptions
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
        reasoning=options.reasoning, thinking=options.thinking, tools=options.tools, tool_name=options.tool_name
    )


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)


def logprob_value(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def chat_logprobs(options: OutputOptions, entries: list[Any]) -> list[dict[str, Any]]:
    """Worker entries [id, logprob, [[id, logprob], …]] in OpenAI's chat shape."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(options.tokenizer, token)
        return {"token": text, "logprob": logprob_value(logprob), "bytes": list(text.encode("utf-8"))}

    return [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]} for token, lp, top in entries]


def finish_reason(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def chat_completion(generation: Generation, events: Iterable[Event | None]) -> dict[str, Any]:
    options = generation.output
    parsers = [parser_for(options) for _ in range(generation.n)]
    parts: list[dict[str, list[str]]] = [{"content": [], "reasoning_content": []} for _ in range(generation.n)]
    logprobs: list[list[Any]] = [[] for _ in range(generation.n)]
    finish: list[str | None] = [None] * generation.n
    completion_tokens = 0
    for event in events:
        if event is None:
            continue
        raise_for_event(event)
        if event.kind == "token":
            for delta in parsers[event.index].feed(event.text):
                for key, text in delta.items():
                    parts[event.index][key].append(text)
            logprobs[event.index] += event.logprobs or []
        elif event.kind == "done":
            finish[event.index] = event.finish_reason
            completion_tokens += event.usage.completion_tokens if event.usage else 0
    choices = []
    for i in range(generation.n):
        rest, calls = parsers[i].close()
        for delta in rest:
            for key, text in delta.items():
                parts[i][key].append(text)
        content = "".join(parts[i]["content"])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if options.reasoning:
            message["reasoning_content"] = "".join(parts[i]["reasoning_content"]) or None
        if calls:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": {"content": chat_logprobs(options, logprobs[i])} if options.logprobs else None,
                "finish_reason": finish_reason(finish[i], calls),
            }
        )
    return {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": generation.created,
        "model": generation.model,
        "choices": choices,
        "usage": _usage(generation.prompt_tokens, completion_tokens),
    }


def chat_stream(generation: Generation, events: Iterable[Event | None], include_usage: bool) -> Iterator[str]:
    """SSE: a role chunk per choice, content deltas, a finish chunk per choice, usage, [DONE].

    A None from `events` (a quiet interval) becomes an SSE comment: it keeps proxies from timing out
    and lets the server learn that a waiting client has gone. Reasoning goes out as
    `reasoning_content` deltas; tool calls, once complete, as one `tool_calls` delta per choice.
    """
    options = generation.output
    parsers = [parser_for(options) for _ in range(generation.n)]
    plain = options.tools == "none" and not options.reasoning and not options.logprobs

    chunk = chunker("chat.completion.chunk", generation, include_usage)

    def choice(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    # Content chunks are most of a stream: build them from a fixed head and tail, not a dict per token.
    head = chunk([])[: -len("]}\n\n") - (len(',"usage":null') if include_usage else 0)]
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def content_chunk(index: int, text: str) -> str:
        delta = json.dumps(text, ensure_ascii=False)
        return f'{head}{{"index":{index},"delta":{{"content":{delta}}},"logprobs":null,"finish_reason":null}}]{tail}'

    def parsed_chunks(event: Event) -> Iterator[str]:
        deltas = parsers[event.index].feed(event.text)
        logprobs = {"content": chat_logprobs(options, event.logprobs or [])} if options.logprobs else None
        if not deltas and logprobs and logprobs["content"]:
            deltas = [{"content": ""}]  # the tokens' text is held back; their logprobs are not
        for n, delta in enumerate(deltas):
            yield chunk([choice(event.index, delta, logprobs=logprobs if n == 0 else None)])

    def closing_chunks(event: Event) -> Iterator[str]:
        rest, calls = parsers[event.index].close()
        for delta in rest:
            yield chunk([choice(event.index, delta)])
        if calls:
            indexed = [{"index": i, **call} for i, call in enumerate(calls)]
            yield chunk([choice(event.index, {"tool_calls": indexed})])
        yield chunk([choice(event.index, {}, finish_reason(event.finish_reason, calls))])

    completion_tokens = 0
    try:
        for i in range(generation.n):
            yield chunk([choice(i, {"role": "assistant", "content": ""})])
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
                completion_tokens += event.usage.completion_tokens if event.usage else 0
                yield from closing_chunks(event)
        if include_usage:
            yield chunk([], _usage(generation.prompt_tokens, completion_tokens))
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

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": generation.request_id,
            "object": kind,
            "created": generation.created,
            "model": generation.model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    return chunk


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
