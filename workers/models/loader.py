"""Loading a model once, from a local directory, onto the worker's device."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from schemas.model_files import ModelFiles

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    files: ModelFiles
    device: torch.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def load_model(path: Path, device: torch.device, dtype: str = "auto") -> LoadedModel:
    """safetensors only, no remote code, no hub: a directory that is not complete fails here."""
    from transformers import AutoModelForCausalLM

    files = ModelFiles(path)
    torch_dtype = DTYPES[dtype] if dtype != "auto" else ("auto" if device.type != "cpu" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch_dtype,
        trust_remote_code=False,
        use_safetensors=True,
        local_files_only=True,
    )
    model.to(device).eval()
    logger.info("loaded %s on %s (%s)", path, device, next(model.parameters()).dtype)
    return LoadedModel(model, Tokenizer.from_file(str(files.tokenizer_file)), files, device)
