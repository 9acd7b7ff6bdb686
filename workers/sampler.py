"""Vectorised token selection for a batch of rows, each with its own parameters and generator.

Order, as in vLLM and transformers: repetition penalty (transformers semantics, over prompt and
output), presence/frequency penalties (OpenAI semantics, over output counts), temperature (0 = greedy),
top-k, top-p, then one draw per row from that row's own torch.Generator, so a seeded request picks
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.sampling import SamplingParams


@dataclass
class SamplingState:
    """Per-sequence sampling state kept across steps.

    Only a sequence that a penalty reads keeps a history: building one is a few tensor operations,
    which cost a fraction of a millisecond in a lone request's path to its first token.
    """

    params: SamplingParams
    generator: torch.Generator | None
    seen: torch.Tensor | None = None  # bool [vocab]: tokens in the prompt or the output so far
    counts: torch.Tensor | None = None  # int [vocab]: occurrences in the output so far

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_ids: list[int] | tuple[int, ...], vocab_size: int, device: torch.device
    ) -> SamplingState:
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        state = cls(params, generator)
        if state.penalised:
            state.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.seen[torch.tensor(list(prompt_ids), device=device).clamp(max=vocab_size - 1)] = True
            state.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        return state

    @property
    def penalised(self) -> bool:
        """Whether any penalty reads this sequence's history (a neutral one leaves its row unchanged)."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def record(self, token_id: int) -> None:
        if self.seen is not None and self.counts is not None:  # two tensor writes per token
            self.seen[token_id] = True
            self.counts[token_id] += 1


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _history(rows: list[torch.Tensor | None], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, vocab]: each row's history; zeros for a sequence without one (its penalty is neutral)."""
    none = torch.zeros(like.shape[-1], dtype=dtype, device=like.device)
    return torch.stack([none if row is None else row for row in rows])


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    params = [s.params for s in states]
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = _column([p.repetition_penalty for p in params], logits)
        seen = _history([s.seen for s in states], logits, torch.bool)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = _history([s.counts for s in states], logits, torch.int32).to(logits.dtype)
        logits = logits - _column([p.frequency_penalty for p in params], logits) * counts
        logits = logits - _column([p.presence_penalty for p in params], logits) * (counts > 0).to(logits.dtype)
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; each row keeps at least its best token."""
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= _column(top_p, probs)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


GREEDY_BELOW = 1e-5


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """+inf (overflow) becomes the largest float, NaN becomes -inf; -inf (masked) stays."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """Pick one token per row of `logits` [batch, vocab] (float32).

    Extreme but valid parameters (a temperature of 1e-300, a repetition penalty of 1e-300) must not
    turn a row into inf − inf = NaN, which would fail the whole batch's step: temperatures below
    GREEDY_BELOW pick greedily (as vLLM does), and overflowing logits are clamped to the largest float.
    """
    logits = _finite(apply_penalties(logits.float(), states))
    params = [s.params for s in states]
    greedy = [p.greedy or p.temperature < GREEDY_BELOW for p in params]
    chosen = logits.argmax(dim=-1)
    if all(greedy):
        return chosen.tolist()
    temperature = _column([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], logits)
    scaled = _finite(logits / temperature)
    filtered = filter_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
    probs = filtered.softmax(dim=-1)
    out = chosen.tolist()
    for row, state in enumerate(states):
        if not greedy[row]:
            out[row] = int(torch.multinomial(probs[row], 1, generator=state.generator).item())
    return out
