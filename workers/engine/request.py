"""A request's state inside the engine: its sequences (one per choice), their tokens and their end."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from schemas.job import Event, JobPayload
from schemas.sampling import MAX_SEED, SamplingParams
from schemas.vocabulary import Vocabulary
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.kv_cache import BlockTable
from workers.engine.reasoning import Reasoning
from workers.engine.stats import now
from workers.engine.stopping import StopStrings


@dataclass(eq=False)
class Sequence:
    """One choice of one request: what the scheduler places, the runner feeds and the sampler draws for."""

    request: Request
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop: StopStrings
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sampled: int = 0  # tokens drawn, ahead of output_ids while a step is in flight
    budget: int = 0  # the most tokens it may generate: max_tokens, or less where the context ends first
    table: BlockTable = field(default_factory=lambda: BlockTable(None))
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (or host tier)
    matcher: Any = None  # the grammar's matcher (workers/engine/grammar.py) for a constrained sequence
    # Where its reasoning is, for a grammar that follows the reasoning (workers/engine/reasoning.py).
    reasoning: Reasoning | None = None
    last_token_at: float | None = None  # wall-clock time of its last token (for inter-token latency)
    scored: int = 1  # prompt tokens whose logprobs went out (the first has none), for prompt_logprobs
    logprobs: list[Any] = field(default_factory=list)  # entries of tokens whose text is not out yet
    token_ids: list[int] = field(default_factory=list)  # ids of those tokens, with return_token_ids

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.payload.prompt_token_ids

    @property
    def length(self) -> int:
        """Tokens in its context so far: the prompt and what it generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def context(self) -> int:
        """Tokens in its context including a drawn token not yet processed: what the next step extends."""
        return len(self.prompt_ids) + self.sampled

    @property
    def settled(self) -> bool:
        """Every token it drew is processed (none is in flight)."""
        return self.sampled == len(self.output_ids)

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Its known tokens [start, end): the prompt, then the output."""
        prompt = self.prompt_ids
        end = self.length if end is None else end
        if end <= len(prompt):
            return list(prompt[start:end])
        head = list(prompt[start:]) if start < len(prompt) else []
        return head + self.output_ids[max(0, start - len(prompt)) : end - len(prompt)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """One job: its payload, its sequences and the numbering of its events."""

    payload: JobPayload
    sequences: list[Sequence] = field(default_factory=list)
    next_seq: int = 0
    arrived: float = 0.0  # wall-clock: when the API queued it, else when the engine got it
    scheduled: bool = False  # it has run in a step
    prompt_counted: bool = False  # its prompt tokens are in the engine's stats (once its prefill is done)

    @classmethod
    def create(cls, payload: JobPayload, vocabulary: Vocabulary, max_model_len: int, grammars: Any = None) -> Request:
        """The request and its `n` sequences; choice i > 0 of a seeded request draws with seed + i.
        A constrained request gets a matcher per sequence from `grammars` (ConstraintFailed if it
        does not compile)."""
        request = cls(payload, arrived=payload.queued_at or now())
        for index in range(payload.n):
            params = payload.sampling
            if params.seed is not None and index:
                params = dataclasses.replace(params, seed=(params.seed + index) % MAX_SEED)
            request.sequences.append(
                Sequence(
                    request=request,
                    index=index,
                    params=params,
                    detokenizer=IncrementalDetokenizer(vocabulary, params.skip_special_tokens),
                    stop=StopStrings(params.stop, params.include_stop_str_in_output),
                    budget=min(params.max_tokens, max_model_len - len(payload.prompt_token_ids)),
                    table=BlockTable(payload.cache_salt),
                    matcher=grammars.matcher(params.grammar) if params.grammar else None,
                    reasoning=Reasoning(params, at_start=True) if params.grammar and params.thinking_end else None,
                )
            )
        return request

    @property
    def request_id(self) -> str:
        return self.payload.request_id

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def event(self, kind: str, index: int = 0, text: str = "", **fields: Any) -> Event:
        seq = self.next_seq
        self.next_seq = seq + 1
        return Event(self.payload.request_id, seq, kind, index, text, **fields)  # type: ignore[arg-type]
