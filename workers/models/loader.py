"""Loading a model once, from a local directory, onto the worker's device."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from schemas.gguf import tensor_names_built_once
from schemas.model_files import ModelFiles, ModelFilesError
from schemas.quantization import detect as detect_quantization
from workers.models import quant
from workers.models.device import release_device_memory
from workers.models.quant.sharded import Shard

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    files: ModelFiles
    device: torch.device
    quantization: str = ""  # the scheme the weights run with (schemas/quantization.py), "" for float
    weight_bytes: int = 0  # the weights' bytes on the device
    kernel: str = ""  # what runs the int8 products (models/quant/kernels.py), "" for float

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's float parameters (norms, and every layer of a float model)."""
        return quant.float_dtype(self.model)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def context(self, max_model_len: int) -> int:
        """The longest sequence served: `max_model_len` (maxSeqLen), or the model's context where it is
        shorter (ModelFiles.context_length)."""
        return min(max_model_len, self.files.context_length or max_model_len)


def load_model(
    path: Path, device: torch.device, dtype: str = "auto", world: int = 1, quantization: str = ""
) -> LoadedModel:
    """safetensors only, no remote code, no hub: a directory that is not complete fails here. A GGUF
    file is read by transformers and dequantized to `dtype`. With `world` > 1 this process is one rank
    of a tensor-parallel group (torch.distributed is initialised, models/parallel.py) and loads only
    its shards, by the model's tensor-parallel plan. A quantized checkpoint, or a float one with
    `quantization` int8, keeps its linear layers in int8 (models/quant/), split alike across a group
    (quant/sharded.py); an unsupported scheme, or a plan that splits a layer otherwise, raises
    UnsupportedQuantization, naming it."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    files = ModelFiles.of(path)
    model_type = files.config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:  # the architectures this transformers knows
        raise ModelFilesError(
            f"{files.path / 'config.json'}: model_type {model_type!r} is not one that transformers "
            f"{transformers.__version__} knows (no remote code is run)"
        )
    config = AutoConfig.from_pretrained(files.path, local_files_only=True, trust_remote_code=False)
    # What tokenline does not serve, whatever transformers knows, by the layer types transformers derives too.
    files.check_attention(getattr(config.get_text_config(), "layer_types", None) or ())
    spec = detect_quantization(files, quantization)
    shard = Shard.of_group() if world > 1 else None
    if quantization and spec is not None and spec.source != "load":
        logger.info(
            "quantization %s: the checkpoint is quantized already (%s), and served so", quantization, spec.label
        )
    torch_dtype = DTYPES[dtype] if dtype != "auto" else ("auto" if device.type != "cpu" else torch.float32)
    sharding = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world)} if world > 1 else {}
    if files.gguf is not None:
        # The configuration derived from the file's metadata once (schemas/gguf.py): given, transformers
        # reads only the tensors from the file, where it would parse the metadata again for the config.
        source: dict[str, object] = {
            "pretrained_model_name_or_path": files.gguf.parent,
            "gguf_file": files.gguf.name,
            "config": config,
        }
        if torch_dtype == "auto":  # a GGUF file's tensors are mostly quantized: dequantize to bfloat16
            torch_dtype = torch.bfloat16
    else:
        source = {"pretrained_model_name_or_path": path, "use_safetensors": True}
    if spec is not None and spec.source != "load":
        saved = DTYPES.get(str(files.config.get("torch_dtype") or files.config.get("dtype")), torch.float32)
        model = quant.load_quantized(path, spec, saved if torch_dtype == "auto" else torch_dtype, config, shard)
    else:
        with tensor_names_built_once() if files.gguf is not None else nullcontext():
            model = AutoModelForCausalLM.from_pretrained(
                **source, dtype=torch_dtype, trust_remote_code=False, local_files_only=True, **sharding
            )
    if spec is not None and spec.source == "load":
        quant.quantize_float(model, spec, shard)
    if not model.is_backend_compatible():
        # Its modeling code computes attention itself: the paged KV pool would never see it, and each
        # step would attend only to its own new tokens.
        raise ModelFilesError(
            f"{path}: {type(model).__name__} (model_type {model_type!r}) does not run its attention through "
            f"transformers' attention interface in transformers {transformers.__version__}, which tokenline's "
            "paged KV cache is plugged into: it would answer wrongly, so it is not served"
        )
    sinks = next((m for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)), None)
    if sinks is not None:  # gpt-oss's is refused by its files already; other architectures have them too
        raise ModelFilesError(
            f"{path}: the model's attention ({type(sinks).__name__}) adds learned attention sinks to each head's "
            "softmax, which tokenline's attention backends do not compute: it would answer wrongly, so it is "
            "not served"
        )
    if world == 1 or (spec is not None and spec.source != "load"):  # not placed by transformers' sharding
        model.to(device)
    float_dtype = quant.float_dtype(model)
    kernel = quant.bind(model, device, float_dtype) if spec is not None else ""
    if kernel:
        logger.info("%s runs with %s int8 products", spec.label, kernel)
        release_device_memory(device)  # the int8 copies that packing replaced, before the KV pool is sized
    model.eval()
    shards = f", 1/{world} of it" if world > 1 else ""
    where = f"{files.gguf} (GGUF, dequantized)" if files.gguf is not None else path
    logger.info("loaded %s on %s (%s%s)", where, device, float_dtype, shards)
    label = spec.label if spec is not None else ""
    tokenizer = Tokenizer.from_file(str(files.tokenizer_file))
    return LoadedModel(model, tokenizer, files, device, label, quant.weight_bytes(model), kernel)
