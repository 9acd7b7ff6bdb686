"""The forward pass the engine runs: a prefill of new, left-padded prompts and a decode step of the batch.

Two implementations, one contract (`Forward`):
- `TransformersForward` calls the model's own transformers forward, with the batch's cache as its
  `past_key_values`; it runs every causal LM that transformers runs.
- `LlamaForward` (workers/models/llama.py) is the same computation for Llama-shaped models written as a short
  run of torch operations over fused weights and the batch's KV buffers, without transformers' per-call
  machinery (mask building, rotary module, output classes). On the 2-core CPU, one thread, an engine
  decode step of the demo model took 2.4-3.0 ms instead of 3.7-4.3 at batch 1, and 6.2-7.2 ms
  instead of 7.6-9.3 at batch 16 (README "Benchmark").

`make_forward(model, "auto")` picks `LlamaForward` when the model is one it computes exactly (its
`unsupported` says why not otherwise), else `TransformersForward`; "transformers" forces the latter.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from transformers import DynamicCache

from schemas.config import FORWARDS
from workers.engine.kv_cache import KVBatch, cache_layers
from workers.models.llama import LlamaForward

logger = logging.getLogger(__name__)



def left_padded(
    prompts: list[list[int]] | list[tuple[int, ...]], pad_id: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill's inputs: the prompts left-padded to the longest, their position ids and mask (1 real, 0 padding)."""
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), length), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, length - len(prompt) :] = torch.tensor(prompt, device=device)
        mask[row, length - len(prompt) :] = 1
    return input_ids, (mask.cumsum(dim=1) - 1).clamp(min=0), mask


class Forward(Protocol):
    """A model's forward pass as the engine calls it. A forward may also offer `mixed`, a prefill and a
    decode step in one pass (workers/models/llama.py); the engine uses it where it exists."""

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Float logits of each row's last position, and each layer's (keys, values) [rows, heads, length, dim]."""
        ...

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """Float logits [rows, vocab] for one new token per row; its keys and values go into `kv`
        (whose mask already holds the new column)."""
        ...


class TransformersForward:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,  # only the last position is sampled: skip the LM head for the rest of the prompt
        )
        return out.logits[:, -1].float(), cache_layers(out.past_key_values)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=kv.mask,
            position_ids=positions,
            past_key_values=kv.cache,
            use_cache=True,
        )
        return out.logits[:, -1].float()


def make_forward(model: torch.nn.Module, kind: str = "auto") -> Forward:
    if kind not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, not {kind!r}")
    if kind == "auto":
        reason = LlamaForward.unsupported(model)
        if reason is None:
            logger.info("forward pass: tokenline's Llama forward")
            return LlamaForward(model)
        logger.info("forward pass: transformers' (%s)", reason)
    return TransformersForward(model)
