"""OpenAI chat.completion and chat.completion.chunk (SSE) from token events."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from app.service import Generation
from schemas.errors import ClientGone, GenerationFailed, TokenlineError
from schemas.job import Event

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"


def raise_for_event(event: Event) -> None:
    """An error or cancellation ends a generation; surface it as the error the client will see."""
    if event.kind == "error":
        raise TokenlineError.from_envelope(event.error or {})
    if event.kind == "cancelled":
        raise GenerationFailed("The request was cancelled.", code="cancelled")


def chat_completion(generation: Generation, events: Iterable[Event | None]) -> dict[str, Any]:
    texts: list[list[str]] = [[] for _ in range(generation.n)]
    finish: list[str | None] = [None] * generation.n
    completion_tokens = 0
    for event in events:
        if event is None:
            continue
        raise_for_event(event)
        if event.kind == "token":
            texts[event.index].append(event.text)
        elif event.kind == "done":
            finish[event.index] = event.finish_reason
            completion_tokens += event.usage.completion_tokens if event.usage else 0
    return {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": generation.created,
        "model": generation.model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": None,
                "finish_reason": finish[i],
            }
            for i in range(generation.n)
        ],
        "usage": _usage(generation.prompt_tokens, completion_tokens),
    }


def chat_stream(generation: Generation, events: Iterable[Event | None], include_usage: bool) -> Iterator[str]:
    """SSE: a role chunk per choice, content deltas, a finish chunk per choice, usage, [DONE].

    A None from `events` (a quiet interval) becomes an SSE comment: it keeps proxies from timing out
    and lets the server learn that a waiting client has gone.
    """

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": generation.request_id,
            "object": "chat.completion.chunk",
            "created": generation.created,
            "model": generation.model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    def choice(index: int, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    # Content chunks are most of a stream: build them from a fixed head and tail, not a dict per token.
    head = chunk([])[: -len("]}\n\n") - (len(',"usage":null') if include_usage else 0)]
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def content_chunk(index: int, text: str) -> str:
        delta = json.dumps(text, ensure_ascii=False)
        return f'{head}{{"index":{index},"delta":{{"content":{delta}}},"logprobs":null,"finish_reason":null}}]{tail}'

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
                yield content_chunk(event.index, event.text)
            elif event.kind == "done":
                completion_tokens += event.usage.completion_tokens if event.usage else 0
                yield chunk([choice(event.index, {}, event.finish_reason)])
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


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
