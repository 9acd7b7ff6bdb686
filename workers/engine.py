"""The generation engine: requests are added, then advanced one decode step at a time.

`add_request` prefills nothing by itself; each `step` runs one forward pass for every live sequence,
samples one token per sequence, and returns the events of that step (text deltas, finishes). The RQ
glue (workers/runtime.py) publishes them. Each sequence keeps its own KV cache here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from schemas.job import Event, JobPayload, Usage
from schemas.sampling import MAX_SEED
from workers.detokenizer import IncrementalDetokenizer
from workers.model import LoadedModel
from workers.sampler import SamplingState, sample
from workers.stopping import StopStrings

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One choice of one request."""

    request: Request
    index: int
    state: SamplingState
    detokenizer: IncrementalDetokenizer
    stop: StopStrings
    next_input: list[int]
    cache: DynamicCache = field(default_factory=DynamicCache)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Request:
    payload: JobPayload
    sequences: list[Sequence] = field(default_factory=list)
    next_seq: int = 0

    @property
    def request_id(self) -> str:
        return self.payload.request_id

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def event(self, kind: str, **fields: object) -> Event:
        event = Event(self.request_id, self.next_seq, kind, **fields)  # type: ignore[arg-type]
        self.next_seq += 1
        return event


class Engine:
    def __init__(self, loaded: LoadedModel, max_seq_len: int) -> None:
        self.loaded = loaded
        self.eos_ids = frozenset(loaded.files.eos_token_ids)
        positions = loaded.files.max_position_embeddings or max_seq_len
        self.max_model_len = min(max_seq_len, positions)
        self.requests: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def add_request(self, payload: JobPayload) -> None:
        if len(payload.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(payload.prompt_token_ids)} tokens leaves no room to generate")
        request = Request(payload)
        for index in range(payload.n):
            params = payload.sampling
            if params.seed is not None and index:
                params = type(params).from_dict({**params.to_dict(), "seed": (params.seed + index) % MAX_SEED})
            request.sequences.append(
                Sequence(
                    request=request,
                    index=index,
                    state=SamplingState.create(
                        params, payload.prompt_token_ids, self.loaded.vocab_size, self.loaded.device
                    ),
                    detokenizer=IncrementalDetokenizer(self.loaded.tokenizer, payload.prompt_token_ids),
                    stop=StopStrings(params.stop),
                    next_input=list(payload.prompt_token_ids),
                )
            )
        self.requests[payload.request_id] = request

    def cancel(self, request_id: str) -> list[Event]:
        request = self.requests.pop(request_id, None)
        return [request.event("cancelled")] if request else []

    def fail_all(self, message: str) -> list[Event]:
        """End every request with an error event (the engine cannot go on with them)."""
        error = {"message": message, "type": "server_error", "param": None, "code": "generation_failed"}
        events = [r.event("error", error=error) for r in self.requests.values()]
        self.requests.clear()
        return events

    def step(self) -> list[Event]:
        live = [s for r in self.requests.values() for s in r.sequences if s.finish_reason is None]
        if not live:
            return []
        logits = self._forward(live)
        tokens = sample(logits, [s.state for s in live])
        events: list[Event] = []
        for sequence, token in zip(live, tokens, strict=True):
            events.extend(self._advance(sequence, token))
        for request_id in [rid for rid, r in self.requests.items() if r.finished]:
            del self.requests[request_id]
        return events

    @torch.inference_mode()
    def _forward(self, live: list[Sequence]) -> torch.Tensor:
        rows = []
        for sequence in live:
            input_ids = torch.tensor([sequence.next_input], device=self.loaded.device)
            out = self.loaded.model(input_ids=input_ids, past_key_values=sequence.cache, use_cache=True)
            sequence.cache = out.past_key_values
            rows.append(out.logits[0, -1])
        return torch.stack(rows).float()

    def _advance(self, sequence: Sequence, token: int) -> list[Event]:
        sequence.output_ids.append(token)
        sequence.state.record(token)
        sequence.next_input = [token]
        params = sequence.state.params
        finish = None
        if token in self.eos_ids and not params.ignore_eos:
            finish = "stop"
            delta = sequence.detokenizer.flush()
        else:
            delta = sequence.detokenizer.push(token)
        text, hit_stop = sequence.stop.push(delta)
        if hit_stop:
            finish = "stop"
        elif finish is None and self._at_length(sequence):
            finish = "length"
            more, hit_stop = sequence.stop.push(sequence.detokenizer.flush())
            text += more
            finish = "stop" if hit_stop else finish
        if finish and not hit_stop:
            text += sequence.stop.flush()
        request = sequence.request
        events = [request.event("token", index=sequence.index, text=text)] if text else []
        if finish:
            sequence.finish_reason = finish
            usage = Usage(len(request.payload.prompt_token_ids), len(sequence.output_ids))
            events.append(request.event("done", index=sequence.index, finish_reason=finish, usage=usage))
        return events

    def _at_length(self, sequence: Sequence) -> bool:
        generated = len(sequence.output_ids)
        total = len(sequence.request.payload.prompt_token_ids) + generated
        return generated >= sequence.state.params.max_tokens or total >= self.max_model_len
