"""What the API and the workers both read from a model directory, without torch or transformers.

A model directory is a Hugging Face layout: config.json, generation_config.json (optional),
tokenizer.json, tokenizer_config.json, and the chat template inline or in chat_template.jinja. A GGUF
file (or a directory holding one) is read through the directory of those files derived from its
metadata (schemas/gguf.py); a directory whose tokenizer is Mistral's tekken.json alone, through the
tokenizer.json derived from it (schemas/tekken.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from schemas import tekken
from schemas.gguf import SUFFIX, GGUFError, companion, gguf_file

# Architectures whose attention adds a learned "sink" logit per head to the softmax (transformers passes
# it to the attention function as `s_aux`): none of tokenline's attention backends computes it.
ATTENTION_SINKS = frozenset({"gpt_oss"})
# The kinds of a config's `layer_types` the KV pool serves: attention over every position, or a window;
# and chunked attention (Llama 4), which is attention over every position within its first chunk, where
# `context_length` keeps the model.
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


class ModelFilesError(ValueError):
    """The directory is not a usable model directory; the message names the file."""


def default_model_name(path: Path) -> str:
    """The name a model is served under when none is given: its directory's, or its GGUF file's
    without the suffix."""
    resolved = path.resolve()
    return resolved.stem if resolved.suffix == SUFFIX else resolved.name


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    gguf: Path | None = None  # the GGUF file whose metadata `path` was derived from
    template: Path | None = None  # a chat template file the settings name (chatTemplate), which wins

    @classmethod
    def of(cls, path: Path, template: Path | None = None) -> ModelFiles:
        """The files of the model at `path`: a Hugging Face directory, or a GGUF file's derived ones;
        with `template`, its chat template is that file's."""
        try:
            file = gguf_file(path)
            return cls(path, template=template) if file is None else cls(companion(file), file, template)
        except GGUFError as exc:
            raise ModelFilesError(str(exc)) from None

    def check(self) -> None:
        """ModelFilesError unless config.json and tokenizer.json are there and readable, a Hugging Face
        directory holds safetensors weights (pickled ones are never loaded), and the architecture's
        attention is one tokenline computes, and a chat template file the settings name is readable."""
        _ = self.config, self.tokenizer_file, self.chat_template  # each raises when its file is missing or unreadable
        self.check_attention()
        if self.gguf is None and not any(self.path.glob("*.safetensors")):
            pickled = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            found = f" ({', '.join(pickled[:3])} are pickled weights, which are never loaded)" if pickled else ""
            raise ModelFilesError(f"{self.path} holds no *.safetensors weights{found}")

    def check_attention(self, derived: Iterable[str] = ()) -> None:
        """ModelFilesError where the architecture's layers are not all attention that tokenline computes:
        sinks, or layers that carry a recurrent state (linear attention, Mamba, convolutions) instead of
        keys and values, which the KV pool does not hold. `derived`: the layer types transformers
        derives where config.json does not list them (RecurrentGemma's from its `block_types`); the
        worker passes them, the API (without transformers) reads the file alone."""
        model_type = self.config.get("model_type")
        if model_type in ATTENTION_SINKS:
            raise ModelFilesError(
                f"{self.path / 'config.json'}: model_type {model_type!r} adds learned attention sinks to each "
                "head's softmax, which tokenline's attention backends do not compute: it would answer wrongly, "
                "so it is not served"
            )
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else {}
        kinds = {str(kind) for config in (self.config, text) for kind in config.get("layer_types") or ()}
        kinds |= {str(kind) for kind in derived}
        stateful = sorted(kinds - ATTENTION_LAYERS)
        if stateful:
            raise ModelFilesError(
                f"{self.path / 'config.json'}: model_type {model_type!r} has {', '.join(stateful)} layers, whose "
                "state tokenline's KV cache does not hold (it holds attention layers' keys and values): it would "
                "answer wrongly, so it is not served"
            )

    def _json(self, name: str, required: bool = True) -> dict[str, Any]:
        file = self.path / name
        if not file.is_file():
            if required:
                raise ModelFilesError(f"{file} is missing")
            return {}
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFilesError(f"{file} cannot be read: {exc}") from None
        return data if isinstance(data, dict) else {}

    @cached_property
    def config(self) -> dict[str, Any]:
        return self._json("config.json")

    @cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        own = self._json("tokenizer_config.json", required=False)
        if own or self.tokenizer_directory == self.path:
            return own
        return json.loads((self.tokenizer_directory / "tokenizer_config.json").read_text(encoding="utf-8"))

    @cached_property
    def tokenizer_directory(self) -> Path:
        """Where tokenizer.json is: the model's directory, or for one whose tokenizer is Mistral's
        tekken.json alone, the directory derived from that file (schemas/tekken.py)."""
        file = self.path / tekken.FILE
        if (self.path / "tokenizer.json").is_file() or not file.is_file():
            return self.path
        try:
            return tekken.tokenizer_directory(file)
        except (tekken.TekkenError, OSError) as exc:
            raise ModelFilesError(str(exc)) from None

    @property
    def tokenizer_file(self) -> Path:
        file = self.tokenizer_directory / "tokenizer.json"
        if not file.is_file():
            raise ModelFilesError(
                f"{file} is missing (a fast tokenizer is required: tokenizer.json, or Mistral's {tekken.FILE})"
            )
        return file

    @property
    def vocab_size(self) -> int:
        """The seed's vocabSize: vocab_size or padded_vocab_size from config.json, else 0."""
        config = self.config.get("text_config", self.config)
        return int(config.get("vocab_size") or config.get("padded_vocab_size") or 0)

    @property
    def max_position_embeddings(self) -> int | None:
        """The model's context: max_position_embeddings, or the older names for it (GPT-2's n_positions
        and n_ctx, seq_length, max_sequence_length), as vLLM reads them."""
        config = self.config.get("text_config", self.config)
        for key in (
            "max_position_embeddings",
            "n_positions",
            "max_seq_len",
            "seq_length",
            "max_sequence_length",
            "n_ctx",
        ):
            value = config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model serves, as vLLM derives it from config.json: its
        max_position_embeddings, extended by a rope scaling whose rotary does not depend on the
        sequence's length: YaRN to original_max_position_embeddings × factor (Qwen's model cards have
        users add it so), linear to max_position_embeddings × factor (but Gemma 3's, whose
        max_position_embeddings counts it already). LongRoPE's and Llama 3's scaling are counted in
        max_position_embeddings; dynamic NTK stays within it (transformers' dynamic rotary scales a
        whole call by its longest sequence, which a batch of sequences does not share). A model with
        chunked attention layers (Llama 4) serves its first chunk (`attention_chunk_size`): past it
        those layers would attend within later chunks only, which the KV pool's attention does not."""
        length = self._positional_length()
        config = self.config.get("text_config", self.config)
        chunk = config.get("attention_chunk_size")
        if "chunked_attention" in (config.get("layer_types") or ()) and isinstance(chunk, int) and chunk > 0:
            return min(length, chunk) if length is not None else chunk
        return length

    def _positional_length(self) -> int | None:
        positions = self.max_position_embeddings
        config = self.config.get("text_config", self.config)
        rope = config.get("rope_scaling") or config.get("rope_parameters")
        if positions is None or not isinstance(rope, dict):
            return positions
        if "full_attention" in rope and isinstance(rope["full_attention"], dict):  # per layer type (transformers 5)
            rope = rope["full_attention"]
        kind, factor = rope.get("rope_type") or rope.get("type"), rope.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
            return positions
        if kind == "yarn":
            original = rope.get("original_max_position_embeddings")
            return int((original if isinstance(original, int) and original > 0 else positions) * factor)
        if kind == "linear" and "gemma3" not in str(config.get("model_type", "")):
            return int(positions * factor)
        return positions

    @cached_property
    def generation_defaults(self) -> dict[str, float | int]:
        """The sampling defaults the checkpoint ships in generation_config.json (used where a request
        gives none), as vLLM applies them: temperature, top_p, top_k, min_p, repetition_penalty."""
        config = self._json("generation_config.json", required=False)
        defaults: dict[str, float | int] = {}
        for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = config.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                defaults[key] = float(value)
        top_k = config.get("top_k")
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0:
            defaults["top_k"] = top_k
        return defaults

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's eos_token_id (int or list), else config.json's."""
        value = self._json("generation_config.json", required=False).get("eos_token_id")
        if value is None:
            value = self.config.get("eos_token_id")
        if value is None:
            return ()
        return tuple(value) if isinstance(value, list) else (int(value),)

    def special_token(self, name: str) -> str | None:
        """bos_token / eos_token from tokenizer_config.json (a string or an AddedToken dict)."""
        value = self.tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    @property
    def chat_template_file(self) -> Path:
        """Where the chat template comes from: the settings' file, else chat_template.jinja, else
        tokenizer_config.json."""
        if self.template is not None:
            return self.template
        file = self.path / "chat_template.jinja"
        return file if file.is_file() else self.path / "tokenizer_config.json"

    @cached_property
    def chat_template(self) -> str | None:
        if self.template is not None:
            try:
                text = self.template.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ModelFilesError(
                    f"the chat template {self.template} (chatTemplate) cannot be read: {exc}"
                ) from None
            if not text.strip():
                raise ModelFilesError(f"the chat template {self.template} (chatTemplate) is empty")
            return text
        file = self.path / "chat_template.jinja"
        if file.is_file():
            return file.read_text(encoding="utf-8")
        template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None
