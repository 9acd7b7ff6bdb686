"""The output processor: a sampled token becomes text, a stop decision and the request's events; a
scored prompt chunk becomes its "prompt" event."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from schemas.job import Event, Usage
from workers.engine.batch import Scored
from workers.engine.grammar import follow
from workers.engine.request import Sequence


class OutputProcessor:
    """Turns each sequence's new token into its events. Stops: an EOS id (unless `ignore_eos`), a stop
    token id, a stop string (emitted only with include_stop_str_in_output), a grammar that is complete,
    or the sequence's budget (`max_tokens`, or the end of the model's context). A token's logprobs
    entry (and its id, with return_token_ids) travels with the event that carries its text (a token
    that completes no character yet waits for the next one)."""

    def __init__(self, eos_ids: Collection[int]) -> None:
        self.eos_ids = frozenset(eos_ids)

    def process(self, sequence: Sequence, token: int, logprobs: list[Any] | None = None) -> list[Event]:
        if sequence.budget == 0:  # max_tokens 0 (with echo): the prompt alone was wanted
            return self._finish(sequence, "length", [])
        output = sequence.output_ids
        output.append(token)
        if logprobs is not None:
            sequence.logprobs.append(logprobs)
        if sequence.params.return_token_ids:
            sequence.token_ids.append(token)
        matcher = sequence.matcher
        if matcher is not None:
            reasoning = sequence.reasoning
            if reasoning is not None:
                reasoning.update(output)
            if reasoning is None or reasoning.answering(output):  # a reasoning is not the grammar's
                follow(matcher, token)
        # A complete grammar ends the output even before min_tokens: nothing it allows could follow.
        if len(output) < sequence.budget and (matcher is None or not matcher.is_stopped()):
            if len(output) < sequence.params.min_tokens:
                # Nothing but the budget ends it before min_tokens (vLLM); a stop string may begin here
                # and end after it, so the text that could begin one waits, unmatched.
                text = sequence.stop.hold(sequence.detokenizer.push(token))
                return [self._token(sequence, text)] if text else []
            if not sequence.stop.stops and token not in self.eos_ids and token not in sequence.params.stop_token_ids:
                # The common case, once per sequence and step: a token's text, no end.
                text = sequence.detokenizer.push(token)
                return [self._token(sequence, text)] if text else []
        return self._ending(sequence, token)

    def _ending(self, sequence: Sequence, token: int) -> list[Event]:
        """A token that may end the sequence: EOS, a stop token id or string, a grammar's end, or its budget."""
        params = sequence.params
        finish = None
        stop_reason: str | int | None = None  # vLLM's: the stop token id or string that ended it
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            finish = "stop"
            if token in params.stop_token_ids:
                stop_reason = token
            # With include_stop_str_in_output the stopping token (EOS too) is text like any other,
            # special tokens skipped unless skip_special_tokens is false (vLLM's detokenizer).
            delta = sequence.detokenizer.push(token) if params.include_stop_str_in_output else ""
            delta += sequence.detokenizer.flush()
        else:
            delta = sequence.detokenizer.push(token)
        text, hit_stop = sequence.stop.push(delta)
        if hit_stop:
            finish, stop_reason = "stop", sequence.stop.matched
        elif finish is None and (self.at_length(sequence) or (sequence.matcher and sequence.matcher.is_stopped())):
            finish = "stop" if sequence.matcher and sequence.matcher.is_stopped() else "length"
            more, hit_stop = sequence.stop.push(sequence.detokenizer.flush())
            text += more
            if hit_stop:
                finish, stop_reason = "stop", sequence.stop.matched
        if finish and not hit_stop:
            text += sequence.stop.flush()
        events = [self._token(sequence, text)] if text else []
        if finish:
            return self._finish(sequence, finish, events, stop_reason)
        return events

    def _finish(
        self, sequence: Sequence, finish: str, events: list[Event], stop_reason: str | int | None = None
    ) -> list[Event]:
        if sequence.logprobs or sequence.token_ids:  # tokens whose text never came (held bytes, a stop string)
            events.append(self._token(sequence, ""))
        sequence.finish_reason = finish
        usage = Usage(len(sequence.prompt_ids), len(sequence.output_ids), sequence.cached_tokens)
        events.append(
            sequence.request.event("done", sequence.index, finish_reason=finish, usage=usage, stop_reason=stop_reason)
        )
        return events

    @staticmethod
    def _token(sequence: Sequence, text: str) -> Event:
        logprobs = token_ids = None
        if sequence.logprobs:
            logprobs, sequence.logprobs = sequence.logprobs, []
        if sequence.token_ids:
            token_ids, sequence.token_ids = sequence.token_ids, []
        return sequence.request.event("token", sequence.index, text, logprobs=logprobs, token_ids=token_ids)

    @staticmethod
    def at_length(sequence: Sequence) -> bool:
        return len(sequence.output_ids) >= sequence.budget


def prompt_events(logits: torch.Tensor, scores: list[Scored]) -> list[Event]:
    """A "prompt" event per scored chunk: each prompt token's logprob under the model, with the
    alternatives the request asked for and its rank among every token (1: the likeliest; the first
    prompt token has none: nothing predicts it)."""
    logprobs = logits.log_softmax(dim=-1)
    events = []
    offset = 0
    for item in scores:
        sequence = item.sequence
        rows = logprobs[offset : offset + item.count]
        offset += item.count
        prompt = sequence.prompt_ids
        targets = torch.tensor(prompt[item.first + 1 : item.first + 1 + item.count], device=rows.device)
        picked = rows.gather(1, targets.unsqueeze(1))
        ranks = ((rows > picked).sum(dim=1) + 1).tolist()
        picked = picked.squeeze(1).tolist()
        k = sequence.params.prompt_logprobs or 0
        values, ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
        values, ids = values.tolist(), ids.tolist()
        entries: list[object] = [None] if item.first == 0 else []
        entries += [
            [prompt[item.first + 1 + i], picked[i], [[ids[i][j], values[i][j]] for j in range(k)], ranks[i]]
            for i in range(item.count)
        ]
        sequence.scored = item.first + 1 + item.count
        if sequence.index == 0:  # the prompt is the request's, not each choice's
            events.append(sequence.request.event("prompt", 0, logprobs=entries))
    return events
