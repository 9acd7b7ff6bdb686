"""The scheduler's plan as the model runner's plain arrays (models/step.py), and what comes back: the
logits to sample from, by sequence, and those of scored prompt positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.request import Sequence
from workers.engine.scheduler import SchedulerOutput
from workers.models.step import StepBatch


@dataclass
class Scored:
    """Prompt positions [first, first + count) of a sequence whose logits score the next prompt token."""

    sequence: Sequence
    first: int
    count: int


@dataclass
class Pass:
    """A pass's output: logits to sample from [rows], their sequences, and the scored prompt
    positions' logits [sum of counts], in the order of `scores`."""

    logits: torch.Tensor
    rows: list[Sequence]
    score_logits: torch.Tensor
    scores: list[Scored]

    @staticmethod
    def join(passes: list[Pass]) -> Pass:
        return Pass(
            torch.cat([p.logits for p in passes]),
            [s for p in passes for s in p.rows],
            torch.cat([p.score_logits for p in passes]),
            [s for p in passes for s in p.scores],
        )


def step_batch(plan: SchedulerOutput, last_rows: dict[int, int]) -> tuple[StepBatch, list[Sequence], list[Scored]]:
    """The step's arrays; the sequences that draw a token (their logits come first) and the scored
    prompt positions (after them). `last_rows`: id(sequence) → its row in the last step's draws, for
    a sequence whose last token is still on the device."""
    batch = StepBatch()
    rows: list[Sequence] = []
    scores: list[Scored] = []
    score_keep: list[int] = []
    for item in plan.scheduled:
        sequence, start, end = item.sequence, item.start, item.start + item.count
        known = sequence.tokens(start, end)
        pending = len(known) < item.count
        if pending:  # its last draw is still on the device
            known.append(0)
        ring = sequence.table.ring
        place = batch.add(
            known, start, len(sequence.prompt_ids), sequence.table.blocks, -1 if ring is None else ring, item.sample
        )
        if pending:
            batch.pending.append((place + item.count - 1, last_rows[id(sequence)]))
        if item.sample:
            batch.keep.append(place + item.count - 1)
            rows.append(sequence)
        if sequence.params.prompt_logprobs is not None:
            first = max(start, sequence.scored - 1)
            last = min(end, len(sequence.prompt_ids) - 1)  # position p scores prompt token p + 1
            if first < last:
                scores.append(Scored(sequence, first, last - first))
                score_keep += range(place + first - start, place + last - start)
    batch.keep += score_keep
    return batch, rows, scores


def split(logits: torch.Tensor, rows: list[Sequence], scores: list[Scored]) -> Pass:
    return Pass(logits[: len(rows)], rows, logits[len(rows) :], scores)
