"""The models this API serves, each with its tokenizer, template and limits, loaded at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.parsers import detect_reasoning_parser, detect_tool_parser
from app.prompt import PromptBuilder
from schemas.config import ModelConfig, Settings
from schemas.errors import ModelNotFound
from schemas.keys import queue_name
from schemas.model_files import ModelFiles
from schemas.quantization import detect as detect_quantization


@dataclass(frozen=True)
class ModelEntry:
    name: str
    prompts: PromptBuilder
    vocab_size: int
    max_prompt_tokens: int
    max_model_len: int
    created: int
    generation_defaults: dict[str, Any]  # generation_config.json's sampling defaults
    tool_parser: str  # hermes, mistral, llama3_json or none
    reasoning_parser: str  # think or none
    max_iter_times: int | None = None
    quantization: str = ""  # the scheme the weights run with (schemas/quantization.py), "" for float

    @property
    def queue(self) -> str:
        return queue_name(self.name)


def _entry(model: ModelConfig, settings: Settings) -> ModelEntry:
    files = ModelFiles.of(model.path, model.chat_template)
    positions = files.context_length or settings.max_seq_len
    prompts = PromptBuilder(files)
    tool_parser = model.tool_parser
    if tool_parser == "auto":
        tool_parser = detect_tool_parser(prompts.template_text)
    reasoning_parser = model.reasoning_parser
    if reasoning_parser == "auto":
        reasoning_parser = detect_reasoning_parser(prompts.template_text)
    return ModelEntry(
        name=model.name,
        prompts=prompts,
        vocab_size=files.vocab_size,
        max_prompt_tokens=min(settings.max_prompt_tokens, positions - 1),  # one token left to generate
        max_model_len=min(settings.max_seq_len, positions),
        # When its files were last written: the same from every API process and restart (OpenAI's
        # `created` is the model's).
        created=int(model.path.stat().st_mtime),
        generation_defaults=files.generation_defaults,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        max_iter_times=settings.max_iter_times,
        quantization=_quantization(files, settings, model),
    )


def _quantization(files: ModelFiles, settings: Settings, model: ModelConfig) -> str:
    spec = detect_quantization(files, settings.quantization)
    return spec.label if spec is not None else ""


class ModelRegistry:
    def __init__(self, settings: Settings) -> None:
        self.entries = {m.name: _entry(m, settings) for m in settings.models}
        self.default = settings.models[0].name

    def get(self, name: str | None) -> ModelEntry:
        entry = self.entries.get(name or self.default)
        if entry is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return entry
