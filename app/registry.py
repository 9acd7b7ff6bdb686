"""The models this API serves, each with its tokenizer, template and limits, loaded at start-up."""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.prompt import PromptBuilder
from schemas.config import ModelConfig, Settings
from schemas.errors import ModelNotFound
from schemas.keys import queue_name
from schemas.model_files import ModelFiles


@dataclass(frozen=True)
class ModelEntry:
    name: str
    prompts: PromptBuilder
    vocab_size: int
    max_prompt_tokens: int
    max_model_len: int
    created: int

    @property
    def queue(self) -> str:
        return queue_name(self.name)


def _entry(model: ModelConfig, settings: Settings) -> ModelEntry:
    files = ModelFiles(model.path)
    positions = files.max_position_embeddings or settings.max_seq_len
    return ModelEntry(
        name=model.name,
        prompts=PromptBuilder(files),
        vocab_size=files.vocab_size,
        max_prompt_tokens=min(settings.max_prompt_tokens, positions),
        max_model_len=min(settings.max_seq_len, positions),
        created=int(time.time()),
    )


class ModelRegistry:
    def __init__(self, settings: Settings) -> None:
        self.entries = {m.name: _entry(m, settings) for m in settings.models}
        self.default = settings.models[0].name

    def get(self, name: str | None) -> ModelEntry:
        entry = self.entries.get(name or self.default)
        if entry is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return entry
