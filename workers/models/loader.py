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


def load_model(path: Path, device: torch.device, dtype: str = "auto", world: int = 1) -> LoadedModel:
    """safetensors only, no remote code, no hub: a directory that is not complete fails here. With
    `world` > 1 this process is one rank of a tensor-parallel group (torch.distributed is initialised,
    models/parallel.py) and loads only its shards, by the model's tensor-parallel plan."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    files = ModelFiles(path)
    torch_dtype = DTYPES[dtype] if dtype != "auto" else ("auto" if device.type != "cpu" else torch.float32)
    sharding = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world)} if world > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch_dtype,
        trust_remote_code=False,
        use_safetensors=True,
        local_files_only=True,
        **sharding,
    )
    if world == 1:
        model.to(device)
    model.eval()
    shards = f", 1/{world} of it" if world > 1 else ""
    logger.info("loaded %s on %s (%s%s)", path, device, next(model.parameters()).dtype, shards)
    return LoadedModel(model, Tokenizer.from_file(str(files.tokenizer_file)), files, device)
