"""LongRoPE applied per sequence of a packed step (Phi-3.5, Phi-4-mini)."""

from __future__ import annotations

import torch


class PerSequenceRotary(torch.nn.Module):
    """A model's LongRoPE rotary embedding (Phi-3.5, Phi-4-mini) applied per sequence, as transformers'
    `generate()` applies it to that sequence alone. transformers picks the short or the long factors
    for a whole call from its largest position (long past `original_max_position_embeddings`): a
    prompt's keys get the factors its whole prefill would get, and each generated token those of its
    own position. Given a packed step, one long sequence would switch every other one; given one chunk
    of a long prompt, the early chunks would take the short factors. So each sequence is rotated on its
    own, its tokens split where the choice changes: a token at position p of a sequence whose prompt has
    P tokens takes the long factors when max(P, p + 1) passes the original context (a prompt recomputed
    after preemption gets the factors it had). `segments` ([start, end) in the step, first position,
    prompt length of each sequence) is set by the model runner."""

    def __init__(self, rotary: torch.nn.Module, original_context: int) -> None:
        super().__init__()
        self.rotary = rotary
        self.original_context = original_context
        self.segments: list[tuple[int, int, int, int]] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for start, end, first, prompt in self.segments:
            short = 0 if prompt > self.original_context else max(0, min(end - start, self.original_context - first))
            if short:
                parts.append(self.rotary(x, position_ids[:, start : start + short]))
            if start + short < end:  # one position past the original context makes the call take the long factors
                positions = position_ids[:, start + short : end]
                beyond = positions.new_full((positions.shape[0], 1), self.original_context)
                cos, sin = self.rotary(x, torch.cat([positions, beyond], dim=1))
                parts.append((cos[:, :-1], sin[:, :-1]))
        return torch.cat([c for c, _ in parts], dim=1), torch.cat([s for _, s in parts], dim=1)


def per_sequence_rotary(model: torch.nn.Module) -> PerSequenceRotary | None:
    """Wrap the model's rotary embedding when it depends on the largest position (LongRoPE)."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if isinstance(rotary, PerSequenceRotary):  # another runner on the same model wrapped it
        return rotary
    if rotary is None or "longrope" not in str(getattr(rotary, "rope_type", "")):
        return None
    rope = model.config.get_text_config().rope_parameters
    wrapped = PerSequenceRotary(rotary, int(rope["original_max_position_embeddings"]))
    inner.rotary_emb = wrapped  # type: ignore[union-attr]
    return wrapped
