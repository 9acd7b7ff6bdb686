"""A generation as the chat deltas its parser makes (app/parsers.py): the one reading of a model's output
that the Responses and Messages formatters translate into their own shapes, as chat's does."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.generation import Generation
from app.openai_format import chat_logprobs, finish_reason, parser_for, raise_for_event
from schemas.job import Event


@dataclass(frozen=True)
class Finished:
    """The end of a generation: chat's finish_reason (stop, length, tool_calls) and its token counts."""

    reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, found in the worker's prefix cache
    stop_reason: str | int | None = None  # the stop string or token id that ended it (vLLM's)


def chat_deltas(generation: Generation, events: Iterable[Event | None]) -> Iterator[dict[str, Any] | Finished | None]:
    """Chat deltas ({"content"}, {"reasoning_content"}, {"tool_calls"}) of a one-choice generation, then
    one `Finished`; None for a quiet interval (a keep-alive is due). A worker's error is raised. Where
    logprobs are asked for, a content delta carries those of the tokens whose text it begins with
    (`logprobs`, chat's shape); tokens whose text is reasoning or a call have none."""
    options = generation.output
    parser = parser_for(options)
    pending: list[Any] = []  # logprob entries of tokens whose text the parser has not given out yet
    wrote = False  # a content delta has gone out

    def scored(deltas: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        nonlocal pending, wrote
        for delta in deltas:
            if pending and "content" in delta:
                delta = {**delta, "logprobs": chat_logprobs(options, pending)}
            if "content" in delta or "reasoning_content" in delta or "tool_calls" in delta:
                pending, wrote = [], wrote or "content" in delta
            yield delta

    for event in events:
        if event is None:
            yield None
            continue
        raise_for_event(event)
        if event.kind == "token":
            if not options.logprobs:
                yield from parser.feed(event.text)
                continue
            pending += event.logprobs or []
            yield from scored(parser.feed(event.text))
        elif event.kind == "done":
            yield from scored(parser.close())
            if pending and wrote:  # the text's last tokens wrote no character (held bytes, a stop string)
                yield {"content": "", "logprobs": chat_logprobs(options, pending)}
            tokens = event.usage.completion_tokens if event.usage else 0
            cached = event.usage.cached_tokens if event.usage else 0
            reason = finish_reason(event.finish_reason, parser)
            yield Finished(reason, generation.prompt_tokens, tokens, cached, event.stop_reason)


class Translator(Protocol):
    """An API's formatter: its own events for each chat delta and for the end."""

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]: ...

    def finish(self, finished: Finished) -> list[dict[str, Any]]: ...


def translated(
    generation: Generation, events: Iterable[Event | None], translator: Translator
) -> Iterator[dict[str, Any] | None]:
    """The translator's events for a generation, in order; None for a quiet interval."""
    for delta in chat_deltas(generation, events):
        if delta is None:
            yield None
        elif isinstance(delta, Finished):
            yield from translator.finish(delta)
        else:
            yield from translator.delta(delta)
