"""What the chat tests share: a generation fed by scripted token events (the formatters' pure seam),
the SSE reader that joins a streamed choice as a client does, and the wait for a stream's first token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from app.generation import OutputOptions
from app.openai_format import chat_completion, chat_stream
from schemas.job import Event, Usage


@dataclass
class FakeGeneration:
    request_id: str = "chatcmpl-1"
    model: str = "demo"
    created: int = 1700000000
    prompt: str = "Hi"
    prompt_tokens: int = 3
    n: int = 1
    output: OutputOptions = field(default_factory=OutputOptions)
    cached_tokens: int = 0


def scripted(*texts: str, finish: str = "length", error: dict | None = None, tokens: int = 1) -> list[Event]:
    """One token event per text (carrying `tokens` logprob entries, as the worker sends when asked),
    then the done event (or an error)."""
    entries = [[7, -0.5, []]] * tokens
    events = [Event("chatcmpl-1", i, "token", text=t, logprobs=list(entries)) for i, t in enumerate(texts)]
    if error:
        events.append(Event("chatcmpl-1", len(texts), "error", error=error))
    else:
        usage = Usage(3, len(texts) * tokens)
        events.append(Event("chatcmpl-1", len(texts), "done", finish_reason=finish, usage=usage))
    return events


def parse_sse(chunks: list[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for chunk in chunks:
        assert chunk.startswith("data: ") and chunk.endswith("\n\n")
        payload = chunk[len("data: ") : -2]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def message(output: OutputOptions, texts: list[str], finish: str = "stop") -> dict[str, Any]:
    """The non-streamed choice: its message (whose refusal is null) and finish_reason."""
    choice = chat_completion(FakeGeneration(output=output), scripted(*texts, finish=finish))["choices"][0]
    message = dict(choice["message"])
    assert message.pop("refusal") is None
    return {**message, "finish_reason": choice["finish_reason"]}


def streamed(output: OutputOptions, texts: list[str], finish: str = "stop") -> dict[str, Any]:
    """The streamed choice's deltas joined as a client joins them (ids and names from the first
    delta of each call, arguments concatenated), with every tool-call delta kept in `deltas`."""
    chunks = parse_sse(list(chat_stream(FakeGeneration(output=output), scripted(*texts, finish=finish), False)))
    joined: dict[str, Any] = {"content": None, "reasoning_content": None, "tool_calls": [], "deltas": []}
    for chunk in chunks[:-1]:
        assert isinstance(chunk, dict)
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                joined[key] = (joined[key] or "") + delta[key]
        for call in delta.get("tool_calls", ()):
            joined["deltas"].append(call)
            if "id" in call:
                joined["tool_calls"].append(
                    {"id": call["id"], "type": call["type"], "function": dict(call["function"])}
                )
            else:
                joined["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        joined["finish_reason"] = choice["finish_reason"]
    return joined


def first_token(lines: Iterator[bytes]) -> bytes:
    """The first data line of a chat stream that a token made: a worker has taken the request. The
    stream's opening chunk (the role) is the API's own, sent before any worker has taken it; a request
    still queued when its only worker stops is withdrawn (503 `no_worker`), not drained."""
    return next(line for line in lines if line.startswith(b"data: {") and b'"role"' not in line)
