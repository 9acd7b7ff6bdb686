"""GGUF checkpoints (llama.cpp's and Ollama's format) served as they are.

A GGUF file carries the weights (often quantized), the model's configuration, its tokenizer and its
chat template as metadata. transformers reads all of them (with the `gguf` package): the worker loads
the weights from the file, dequantized to its serving dtype (workers/models/loader.py); the Hugging
Face files that the API and the worker read beside the weights (config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json) are derived from the metadata once
into a companion directory, which both then read like any model directory.

The companion directory is made once, beside the file or under `~/.cache/tokenline/gguf/`
(schemas/derived.py). Deriving it needs transformers (without torch): an API image without
it (docker compose's) must be given the directory made beside the file by `python -m schemas.gguf FILE`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from schemas.derived import derived_once

SUFFIX = ".gguf"


class GGUFError(ValueError):
    """The GGUF file cannot be served: an architecture or tokenizer transformers cannot read."""


def gguf_file(path: Path) -> Path | None:
    """The GGUF checkpoint `path` names: the file itself, or the one .gguf file of a directory that
    has no config.json; None for a Hugging Face directory."""
    if path.suffix == SUFFIX and path.is_file():
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob(f"*{SUFFIX}"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise GGUFError(f"{path} holds several GGUF files ({names}): name one in the model's path")
    return None


def companion(file: Path) -> Path:
    """The Hugging Face files derived from `file`'s metadata, made if missing (GGUFError if
    transformers cannot read the file's architecture or tokenizer)."""
    return derived_once(file, "gguf", lambda where: _derive(file, where))


@contextmanager
def tensor_names_built_once() -> Iterator[None]:
    """While the block runs, gguf's map of an architecture's tensor names is built once per
    architecture and depth, and shared.

    transformers 5.23 maps a file's tensor names to the model's by walking the model's modules
    (`modeling_gguf_pytorch_utils.get_gguf_hf_weights_map`), and at every module it builds the whole
    architecture's map again with `gguf.get_tensor_name_map`, which it imports at each call: about
    400 builds for a 30-layer model, 10 of the 28 s a load of SmolLM2 took on a CPU, and more the
    deeper the model. The maps are only read (`TensorNameMap.get_name`). tests/test_gguf.py fails
    where transformers stops calling it so (the block then changes nothing)."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _derive(file: Path, where: Path) -> None:
    try:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    except ImportError:
        raise GGUFError(
            f"{file} is a GGUF file: deriving its tokenizer and configuration needs transformers; "
            f"run `python -m schemas.gguf {file}` where it is installed"
        ) from None
    try:
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise GGUFError(f"{file} cannot be served: {exc}") from None
    # The weights are dequantized at load: what this directory describes is a plain checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(where)
    tokenizer.save_pretrained(where)
    GenerationConfig.from_model_config(config).save_pretrained(where)


if __name__ == "__main__":
    print(companion(Path(sys.argv[1]).resolve()))
