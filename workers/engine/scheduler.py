"""The scheduler: which sequences run in the next step, and how many of their tokens.

One kind of step (as in vLLM's v1 scheduler and Sarathi-Serve): each scheduled sequence computes its
next tokens, one for a decoding sequence, a chunk of its prompt for a prefilling one; a sequence whose
computed tokens reach its context draws its next token. A step carries every running decode and at
most `max_prefill_tokens` prompt tokens of at most `max_prefill_batch_size` newcomers; while any
sequence is decoding, at most `prefill_chunk` prompt tokens, or `chunk_per_decode` per decoding
sequence if that is more (a longer prompt is split over steps, so the decodes keep flowing while it
enters; alone, it runs in as few passes as the cap allows).

Memory decides the rest (engine/kv_cache.py): a newcomer is admitted, first come first served, when
the blocks for its first chunk fit (after its cached prefix); a running sequence that needs a block
when the pool is empty preempts the newest running sequence (at most `max_preempt` a step), whose
blocks are freed: it waits at the head of the line. With a host tier its blocks are copied there and
back when it is admitted again; without one (or when the tier is full) it is computed again (its
tokens so far are its prompt then; its client sees nothing but a pause).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request, Sequence


@dataclass
class Scheduled:
    """A sequence's share of a step: it computes `count` tokens from position `start`; `sample`: the
    last of them completes its context, and its logits draw the next token."""

    sequence: Sequence
    start: int
    count: int
    sample: bool


@dataclass
class SchedulerOutput:
    """One step's plan: the scheduled sequences in packing order (running ones first), the sequences
    that left the batch before it and those it preempted."""

    scheduled: list[Scheduled] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        """Tokens computed for prompts (prefill chunks), not decodes."""
        return sum(s.count for s in self.scheduled if s.count > 1 or not s.sample)

    @property
    def sampled(self) -> list[Sequence]:
        return [s.sequence for s in self.scheduled if s.sample]

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_batch_size: int,
        max_prefill_tokens: int = 8192,
        max_prefill_batch_size: int = 0,  # 0: max_batch_size
        max_preempt: int = 4,
        prefill_chunk: int | None = None,
        chunk_per_decode: int = 0,
    ) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_batch_size = max_prefill_batch_size or max_batch_size
        self.max_preempt = max_preempt
        self.prefill_chunk = min(prefill_chunk or max_prefill_tokens, max_prefill_tokens)
        self.chunk_per_decode = chunk_per_decode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # in all
        self.recomputed = 0  # tokens computed again after a preemption

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.extend(request.sequences)

    def remove(self, request: Request) -> None:
        """Take a request's sequences off the waiting line; its running ones leave at the next step."""
        for sequence in self.waiting:
            if sequence.request is request:
                self.kv.forget(sequence.table)
        self.waiting = deque(s for s in self.waiting if s.request is not request)

    def release_finished(self) -> list[Sequence]:
        """Take the sequences that finished out of the batch and free their blocks."""
        finished = [s for s in self.running if s.finished]
        if finished:
            self.running = [s for s in self.running if not s.finished]
            for sequence in finished:
                self.kv.release(sequence.table)
        return finished

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput(finished=self.release_finished())
        decoding = sum(1 for s in self.running if s.context - s.table.computed <= 1)
        budget = self._prefill_budget(decoding)
        for sequence in list(self.running):
            if sequence in plan.preempted:
                continue
            start = sequence.table.computed
            remaining = sequence.context - start
            count = 1 if remaining <= 1 else min(remaining, budget)
            if count <= 0:
                continue
            if not self._make_room(sequence, start + count, plan):
                continue
            plan.scheduled.append(Scheduled(sequence, start, count, start + count == sequence.context))
            if remaining > 1:
                budget -= count
        admitted = 0
        while (
            self.waiting
            and not plan.preempted  # the pool is full: the preempted ones come back first, later
            and len(self.running) < self.max_batch_size
            and budget > 0
            and admitted < self.max_prefill_batch_size
        ):
            sequence = self.waiting[0]
            if sequence.finished:  # preempted, then ended by the token it had in flight
                self.kv.forget(sequence.table)
                self.waiting.popleft()
                continue
            if not sequence.settled:  # preempted with a token in flight: back once it is processed
                break
            tokens = sequence.tokens()
            table = sequence.table
            if table.swapped is not None:  # its blocks are in the host tier
                start = table.swapped_computed
                count = min(len(tokens) - start, budget)
                if not self.kv.swap_in(table, start + count):
                    break
            else:
                start = self.kv.admit(table, tokens, reuse=sequence.params.prompt_logprobs is None)
                count = min(len(tokens) - start, budget)
                if not self.kv.allocate(table, start + count):
                    self.kv.release(table)
                    break
                self.kv.count(len(tokens), start)
                if not sequence.preemptions:
                    sequence.cached_tokens = start
                self.recomputed += max(0, table.lost - start)
                table.lost = 0
            self.waiting.popleft()
            self.running.append(sequence)
            plan.scheduled.append(Scheduled(sequence, start, count, start + count == len(tokens)))
            budget -= count
            admitted += 1
        return plan

    def _prefill_budget(self, decoding: int) -> int:
        """Prompt tokens this step may carry beside `decoding` decodes: all `max_prefill_tokens` when
        none decodes, else `prefill_chunk`, or `chunk_per_decode` per decode if that is more."""
        if not decoding:
            return self.max_prefill_tokens
        return min(max(self.prefill_chunk, self.chunk_per_decode * decoding), self.max_prefill_tokens)

    def _make_room(self, sequence: Sequence, tokens: int, plan: SchedulerOutput) -> bool:
        """Blocks for the sequence's first `tokens` tokens, preempting the newest running sequences if
        need be; False if it does not run in this step (it was preempted itself, or the step's
        preemptions are spent)."""
        while not self.kv.allocate(sequence.table, tokens):
            # maxPreemptCount 0 turns preemption off, except where nothing else could run: the pool
            # would then stay full for ever.
            limit = self.max_preempt or (0 if plan.scheduled else 1)
            if len(plan.preempted) >= limit:
                return False
            victim = next(s for s in reversed(self.running) if s not in plan.preempted)
            self._preempt(victim, plan)
            if victim is sequence:
                return False
        return True

    def _preempt(self, sequence: Sequence, plan: SchedulerOutput) -> None:
        table = sequence.table
        if not self.kv.swap_out(table):
            table.lost = max(table.lost, table.computed)
            self.kv.release(table)
        self.running.remove(sequence)
        self.waiting.appendleft(sequence)
        sequence.preemptions += 1
        self.preemptions += 1
        plan.preempted.append(sequence)
