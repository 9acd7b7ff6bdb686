"""The in-process ceiling: plain `model.generate()` (static batch, greedy) on the same model."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from schemas.model_files import ModelFiles


def load(model_dir: Path) -> tuple[torch.nn.Module, Tokenizer]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    return model, Tokenizer.from_file(str(ModelFiles(model_dir).tokenizer_file))


@torch.inference_mode()
def tokens_per_second(
    model: torch.nn.Module, prompt_ids: list[int], batch: int, new_tokens: int, repeats: int = 3
) -> float:
    """Median over `repeats` of batch × new_tokens / seconds, EOS ignored."""
    input_ids = torch.tensor([prompt_ids] * batch)
    rates = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )
        rates.append(batch * new_tokens / (time.perf_counter() - started))
    return statistics.median(rates[1:])  # the first run warms up


@torch.inference_mode()
def first_token_ms(model: torch.nn.Module, prompt_ids: list[int], repeats: int = 21) -> float:
    """Median time to the first generated token at batch 1 (prefill + one sampling step)."""
    input_ids = torch.tensor([prompt_ids])
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[1:])
