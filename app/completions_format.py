"""OpenAI text_completion (and its SSE chunks) from the token events of one generation per prompt.

Choice `i * n + j` is prompt i's choice j. With echo the prompt's text comes first, and with logprobs
its tokens' log probabilities too (the first token has none), as evaluation harnesses read them.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

from app.generation import Generation, OutputOptions
from app.openai_format import (
    DONE,
    KEEP_ALIVE,
    _usage,
    chunker,
    logprob_value,
    prompt_logprobs,
    raise_for_event,
    sse,
    token_label,
    token_text,
)
from schemas.errors import ClientGone, GenerationFailed, TokenlineError


class CompletionLogprobs:
    """OpenAI's legacy logprobs shape, built token by token: tokens, token_logprobs, top_logprobs
    ({token: logprob}) and text_offset (each token's place in the choice's text: the characters its
    predecessors' bytes complete, so a token that is a piece of a character, named U+FFFD, moves it
    only once the character is whole)."""

    def __init__(self, options: OutputOptions | None, offset: int = 0) -> None:
        self.options = options
        self.offset = offset
        self.characters = codecs.getincrementaldecoder("utf-8")("replace")
        self.body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, entries: list[Any], first_token: int | None = None) -> dict[str, list[Any]]:
        """Append entries; a None entry is the prompt's first token (`first_token`), which has no logprob.
        A token's top_logprobs hold the alternatives asked for and the token itself (OpenAI: "up to
        logprobs+1 elements"; vLLM alike)."""
        added: dict[str, list[Any]] = {key: [] for key in self.body}
        for entry in entries:
            if entry is None:
                token, logprob, top = first_token, None, None
            else:
                token, logprob, alternatives = entry[:3]  # a prompt token's rank follows: vLLM's shape
                logprob = logprob_value(logprob)
                top = {token_label(self.options, t): logprob_value(v) for t, v in alternatives}
            text = token_text(self.options, token, first=entry is None) if token is not None else ""
            label = token_label(self.options, token, first=entry is None) if token is not None else ""
            if top is not None:
                top.setdefault(label, logprob)
            for key, value in zip(added, (label, logprob, top, self.offset), strict=True):
                added[key].append(value)
            self.offset += self._advance(token, text, first=entry is None)
        for key, values in added.items():
            self.body[key] += values
        return added

    def _advance(self, token: int | None, text: str, first: bool) -> int:
        """The characters of the text that the token completes (the text's first token: its own text, as
        the text starts with it; a decoder may strip its space)."""
        vocabulary = self.options.vocabulary if self.options is not None else None
        if token is None or vocabulary is None:
            return len(text)
        completed = self.characters.decode(vocabulary.bytes_of(token, skip_special_tokens=False))
        return len(text) if first and completed else len(completed)


def _prompt_entries(generation: Generation, entries: list[Any]) -> list[Any]:
    return entries or ([None] if generation.output.prompt_ids else [])


def completion(generations: list[Generation], echo: bool) -> dict[str, Any]:
    try:
        return _completion(generations, echo)
    finally:
        release(generations)


def _completion(generations: list[Generation], echo: bool) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = 0
    for g, generation in enumerate(generations):
        options = generation.output
        texts = [[generation.prompt] if echo else [] for _ in range(generation.n)]
        logprobs = [CompletionLogprobs(options) for _ in range(generation.n)]
        prompt_entries: list[Any] = []
        finish: list[str | None] = [None] * generation.n
        stop_reasons: list[str | int | None] = [None] * generation.n
        token_ids: list[list[int]] = [[] for _ in range(generation.n)]
        with closing(generation.events()) as events:
            for event in events:
                if event is None:
                    continue
                raise_for_event(event)
                if event.kind == "prompt":
                    prompt_entries += event.logprobs or []
                elif event.kind == "token":
                    texts[event.index].append(event.text)
                    token_ids[event.index] += event.token_ids or []
                    if event.logprobs:
                        if echo and not logprobs[event.index].body["tokens"]:
                            _echo(logprobs[event.index], generation, prompt_entries)
                        logprobs[event.index].add(event.logprobs)
                elif event.kind == "done":
                    finish[event.index], stop_reasons[event.index] = event.finish_reason, event.stop_reason
                    completion_tokens += event.usage.completion_tokens if event.usage else 0
        prompt_tokens += generation.prompt_tokens
        for j in range(generation.n):
            if options.logprobs and echo and not logprobs[j].body["tokens"]:
                _echo(logprobs[j], generation, prompt_entries)
            choice = {
                "index": g * generation.n + j,
                "text": "".join(texts[j]),
                "logprobs": logprobs[j].body if options.logprobs else None,
                "finish_reason": finish[j],
                "stop_reason": stop_reasons[j],
            }
            if options.prompt_logprobs:  # vLLM's
                choice["prompt_logprobs"] = prompt_logprobs(options, prompt_entries)
            if options.token_ids:  # vLLM's return_token_ids
                choice |= {"token_ids": token_ids[j], "prompt_token_ids": list(options.prompt_ids)}
            choices.append(choice)
    first = generations[0]
    return {
        "id": first.request_id,
        "object": "text_completion",
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens, sum(g.cached_tokens for g in generations)),
    }


def _echo(logprobs: CompletionLogprobs, generation: Generation, entries: list[Any]) -> None:
    prompt_ids = generation.output.prompt_ids
    logprobs.add(_prompt_entries(generation, entries), prompt_ids[0] if prompt_ids else None)


def completion_stream(generations: list[Generation], echo: bool, include_usage: bool) -> Iterator[str]:
    """SSE chunks, prompt after prompt; usage (with stream_options.include_usage), then [DONE]. With
    continuous usage every chunk carries its choice's usage so far (prompt and completion tokens)."""
    chunk = chunker("text_completion", generations[0], include_usage or generations[0].output.continuous_usage)
    prompt_tokens = completion_tokens = 0
    try:
        for g, generation in enumerate(generations):
            counts = [0] * generation.n
            yield from _generation_chunks(generation, g * generation.n, echo, chunk, counts)
            prompt_tokens += generation.prompt_tokens
            completion_tokens += sum(counts)
        if include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens, sum(g.cached_tokens for g in generations)))
    except ClientGone:
        return
    except TokenlineError as exc:
        yield sse(exc.envelope())
    except Exception:
        yield sse(GenerationFailed("Internal error during generation.").envelope())
    finally:
        release(generations)
    yield DONE


def _generation_chunks(
    generation: Generation, base: int, echo: bool, chunk: Callable[..., str], counts: list[int]
) -> Iterator[str]:
    """One prompt's chunks (its choices are `base + i`); `counts` gets each choice's completion tokens."""
    options = generation.output
    logprobs = [CompletionLogprobs(options) for _ in range(generation.n)]
    echoed = [not echo] * generation.n
    prompt_entries: list[Any] = []
    unsent = [options.token_ids] * generation.n  # vLLM's return_token_ids: the prompt's ids, in a first chunk

    def send(i: int, text: str, added: Any, finish: str | None = None, **end: Any) -> str:
        usage = _usage(generation.prompt_tokens, counts[i]) if options.continuous_usage else None
        if unsent[i]:
            unsent[i], end = False, {**end, "prompt_token_ids": list(options.prompt_ids)}
        return chunk([{"index": base + i, "text": text, "logprobs": added, "finish_reason": finish, **end}], usage)

    with closing(generation.events()) as events:
        for event in events:
            if event is None:
                yield KEEP_ALIVE
                continue
            raise_for_event(event)
            if event.kind == "prompt":
                prompt_entries += event.logprobs or []
                continue
            i = event.index
            if not echoed[i]:
                echoed[i] = True
                added = None
                if options.logprobs:
                    ids = options.prompt_ids
                    added = logprobs[i].add(_prompt_entries(generation, prompt_entries), ids[0] if ids else None)
                yield send(i, generation.prompt, added)
            if event.kind == "token":
                counts[i] += len(event.logprobs or ())  # one entry per token (asked for when counting)
                ids = {"token_ids": event.token_ids or []} if options.token_ids else {}
                yield send(i, event.text, logprobs[i].add(event.logprobs or []) if options.logprobs else None, **ids)
            elif event.kind == "done":
                counts[i] = event.usage.completion_tokens if event.usage else counts[i]
                yield send(i, "", None, event.finish_reason, stop_reason=event.stop_reason)


def release(generations: list[Generation]) -> None:
    """Generations never read (an earlier one failed, or the client left) are cancelled and released."""
    for generation in generations:
        if not generation.ended:
            generation.service.finish(generation)
