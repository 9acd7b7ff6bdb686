"""The output processor: a sampled token becomes text, a stop decision and the request's events."""

from __future__ import annotations

from collections.abc import Collection

from schemas.job import Event, Usage
from workers.engine.request import Sequence


class OutputProcessor:
    """Turns each sequence's new token into its events. Stops: an EOS id (unless `ignore_eos`), a stop
    string (never emitted), or the sequence's budget (`max_tokens`, or the end of the model's context)."""

    def __init__(self, eos_ids: Collection[int]) -> None:
        self.eos_ids = frozenset(eos_ids)

    def process(self, sequence: Sequence, token: int) -> list[Event]:
        output = sequence.output_ids
        output.append(token)
        if len(output) < sequence.budget and not sequence.stop.stops and token not in self.eos_ids:
            # The common case, once per sequence and step: a token's text, no end.
            text = sequence.detokenizer.push(token)
            return [sequence.request.event("token", sequence.index, text)] if text else []
        return self._ending(sequence, token)

    def _ending(self, sequence: Sequence, token: int) -> list[Event]:
        """A token that may end the sequence: EOS, a stop string, or its budget."""
        params = sequence.params
        finish = None
        if token in self.eos_ids and not params.ignore_eos:
            finish = "stop"
            delta = sequence.detokenizer.flush()
        else:
            delta = sequence.detokenizer.push(token)
        text, hit_stop = sequence.stop.push(delta)
        if hit_stop:
            finish = "stop"
        elif finish is None and self.at_length(sequence):
            finish = "length"
            more, hit_stop = sequence.stop.push(sequence.detokenizer.flush())
            text += more
            finish = "stop" if hit_stop else finish
        if finish and not hit_stop:
            text += sequence.stop.flush()
        request = sequence.request
        events = [request.event("token", sequence.index, text)] if text else []
        if finish:
            sequence.finish_reason = finish
            usage = Usage(len(sequence.prompt_ids), len(sequence.output_ids))
            events.append(request.event("done", sequence.index, finish_reason=finish, usage=usage))
        return events

    @staticmethod
    def at_length(sequence: Sequence) -> bool:
        return len(sequence.output_ids) >= sequence.budget
