"""Which quantization a model directory ships, read without torch (the API and the worker both ask).

Two checkpoint formats are served, and a float checkpoint can be quantized at load:

- msModelSlim (Huawei's, what MindIE and vllm-ascend load): int8 weights beside a
  `quant_model_description*.json` that names each tensor's scheme (`W8A8`, `W8A8_DYNAMIC`, `W8A16`,
  `W8A8_MIX`, or `FLOAT` for a layer kept in float) and the model's `model_quant_type`.
- compressed-tensors (llm-compressor's, what vLLM loads): `quantization_config` in config.json with
  `quant_method: compressed-tensors`; served when every config group is int8 channel-wise symmetric
  weights with dynamic per-token symmetric int8 activations (llm-compressor's W8A8 int8 scheme).
- `quantization: int8` (the setting): per-channel int8 weights and dynamic per-token int8 activations,
  computed from a float checkpoint at load.

Anything else (GPTQ, AWQ, FP8, W4A8, ...) is refused at start-up with its name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.model_files import ModelFiles, ModelFilesError

MSMODELSLIM_SCHEMES = ("W8A8", "W8A8_DYNAMIC", "W8A16", "W8A8_MIX")
# msModelSlim's prefill-decode mix: the tensors of both W8A8 schemes. vllm-ascend quantizes such a
# layer per token (W8A8_DYNAMIC) except on a disaggregated decode node (per tensor); tokenline is no
# such node, and serves it per token.
MIX = "W8A8_MIX"
# The description's keys of msModelSlim's KV-cache quantization (C8) and attention quantization (FAQuant).
QUANTIZED_ATTENTION = ("kv_quant_type", "kv_cache_type", "fa_quant_type")
FLOAT = "FLOAT"
COMPRESSED_TENSORS = "compressed-tensors"
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "naive-quantized")
SETTINGS = ("", "int8")  # the `quantization` setting: off, or int8 computed at load


class UnsupportedQuantization(ModelFilesError):
    """The checkpoint's quantization is one tokenline does not run; the message names it."""


@dataclass(frozen=True)
class QuantSpec:
    """How a model's linear layers are quantized. `layers` maps a module name to its scheme (W8A8,
    W8A8_DYNAMIC or W8A16; absent: float) for msModelSlim; compressed-tensors and the int8 setting
    quantize every linear layer but those `ignore` names (`re:` patterns as compressed-tensors writes
    them)."""

    source: str  # msmodelslim, compressed-tensors, or load (the quantization setting)
    scheme: str  # the model's scheme: W8A8, W8A8_DYNAMIC, W8A16, or W8A8_DYNAMIC for the other two
    layers: dict[str, str] = field(default_factory=dict)
    ignore: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """What /v1/models and the metrics say: `w8a8_dynamic (msmodelslim)`."""
        return f"{self.scheme.lower()} ({self.source})"

    def scheme_of(self, module: str) -> str | None:
        """The scheme of linear module `module`, None when it stays float."""
        if self.source == "msmodelslim":
            scheme = self.layers.get(module)
            return None if scheme in (None, FLOAT) else scheme
        return None if any(_matches(pattern, module) for pattern in self.ignore) else self.scheme


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def description_file(path: Path) -> Path | None:
    """msModelSlim's description: quant_model_description.json or quant_model_description_<type>.json."""
    found = sorted(path.glob("quant_model_description*.json"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise UnsupportedQuantization(f"{path} holds several msModelSlim descriptions ({names}); keep one")
    return found[0] if found else None


def detect(files: ModelFiles, setting: str = "") -> QuantSpec | None:
    """The model's quantization: its checkpoint's, else the setting's, else None (float)."""
    return _detect(files, setting)


def _detect(files: ModelFiles, setting: str) -> QuantSpec | None:
    if files.gguf is not None:
        return _on_load(setting)
    description = description_file(files.path)
    if description is not None:
        return _msmodelslim(description)
    config = files.config.get("quantization_config")
    if isinstance(config, dict):
        return _compressed_tensors(config)
    quantize = files.config.get("quantize")  # MindIE's key in the weights' config.json
    if isinstance(quantize, str) and quantize:
        raise UnsupportedQuantization(
            f"config.json names quantize={quantize!r} but {files.path} has no quant_model_description*.json"
        )
    return _on_load(setting)


def _on_load(setting: str) -> QuantSpec | None:
    if setting not in SETTINGS:
        raise UnsupportedQuantization(f"quantization {setting!r} (supported: int8)")
    return QuantSpec("load", "W8A8_DYNAMIC") if setting == "int8" else None


def _msmodelslim(file: Path) -> QuantSpec:
    try:
        description: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedQuantization(f"{file} cannot be read: {exc}") from None
    model_type = str(description.get("model_quant_type", ""))
    for key in QUANTIZED_ATTENTION:
        value = description.get(key)
        if value not in (None, "", FLOAT):
            raise UnsupportedQuantization(
                f"msModelSlim {key} {value!r} in {file.name}: a quantized KV cache or attention, which tokenline "
                "does not run (its KV cache holds the model's float dtype)"
            )
    if model_type not in MSMODELSLIM_SCHEMES:
        raise UnsupportedQuantization(
            f"msModelSlim model_quant_type {model_type!r} in {file.name} (supported: {', '.join(MSMODELSLIM_SCHEMES)})"
        )
    layers: dict[str, str] = {}
    for key, scheme in description.items():
        if not key.endswith(".weight") or not isinstance(scheme, str):
            continue
        if scheme != FLOAT and scheme not in MSMODELSLIM_SCHEMES:
            raise UnsupportedQuantization(f"msModelSlim scheme {scheme!r} of {key} in {file.name}")
        layers[key.removesuffix(".weight")] = scheme
    return QuantSpec("msmodelslim", model_type, layers)


def _compressed_tensors(config: dict[str, Any]) -> QuantSpec:
    method = config.get("quant_method")
    if method != COMPRESSED_TENSORS:
        raise UnsupportedQuantization(f"quant_method {method!r} in config.json's quantization_config")
    fmt = config.get("format")
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} (supported: int-quantized)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantization("compressed-tensors quantization_config without config_groups")
    for name, group in groups.items():
        _int8_w8a8_group(name, group)
    if config.get("kv_cache_scheme"):
        raise UnsupportedQuantization("compressed-tensors kv_cache_scheme (a quantized KV cache)")
    return QuantSpec(COMPRESSED_TENSORS, "W8A8_DYNAMIC", ignore=tuple(config.get("ignore") or ()))


def _int8_w8a8_group(name: str, group: dict[str, Any]) -> None:
    """Refuse a group that is not int8 channel weights with dynamic per-token int8 activations."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations") or {}
    want_weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    want_inputs = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    for kind, args, want in (("weights", weights, want_weights), ("input_activations", inputs, want_inputs)):
        wrong = {key: args.get(key) for key, value in want.items() if args.get(key) != value}
        if wrong:
            described = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
            raise UnsupportedQuantization(
                f"compressed-tensors scheme of {name} ({kind}: {described}); supported: int8 W8A8 "
                "(channel-wise symmetric int8 weights, dynamic per-token symmetric int8 activations)"
            )
    if group.get("output_activations"):
        raise UnsupportedQuantization(f"compressed-tensors output_activations in {name}")
