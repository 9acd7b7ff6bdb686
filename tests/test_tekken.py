"""Mistral's tekken.json tokenizers (Magistral, Devstral and Mistral Small 3.x ship no tokenizer.json):
the tokenizer.json tokenline derives from one encodes as tiktoken encodes the file's ranks, which is
how mistral-common reads it, and a model directory that holds only tekken.json is served.

The file is Mistral Nemo's real one, from mistral-common's wheel (scripts/real_models.py)."""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tiktoken
import torch
import transformers

from schemas import tekken
from schemas.model_files import ModelFiles, ModelFilesError
from scripts import localstack, real_models

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\n\nand newlines\r\n",
    "日本語のテキストと中文混合，한국어도",
    "emoji 🤖👍🏽 and a family 👨‍👩‍👧",
    "def square(x):\n    return x ** 2  # 平方\n",
    "Ünïcödé façade naïve — “quotes” ‘single’",
    "1234567890 3.14159 -1e-9",
    "https://example.com/a?b=c&d=e#f",
    "a" * 300,
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Привет, как дела? Ελληνικά العربية हिन्दी",
    "   ",
    "\u00a0non-breaking\u2009thin x\u0301\u0302 combining",
]


@pytest.fixture(scope="module")
def nemo_tekken() -> Path:
    return real_models.tekken()


def reference(file: Path) -> tiktoken.Encoding:
    """The file's BPE as mistral-common builds it: tiktoken over its ranks (cut to the vocabulary size
    less the control tokens), whose ids follow the 1,000 control tokens."""
    data = json.loads(file.read_text(encoding="utf-8"))
    config = data["config"]
    kept = config["default_vocab_size"] - config["default_num_special_tokens"]
    ranks = {base64.b64decode(entry["token_bytes"]): rank for rank, entry in enumerate(data["vocab"][:kept])}
    return tiktoken.Encoding("tekken", pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={})


def model_directory(path: Path, file: Path) -> Path:
    """A directory as Mistral's later releases lay it out: config.json and tekken.json, no tokenizer.json."""
    path.mkdir()
    transformers.MistralConfig(vocab_size=131072).save_pretrained(path)
    shutil.copy(file, path / tekken.FILE)
    return path


def test_the_tokenizer_derived_from_a_tekken_file_encodes_as_tiktoken_reads_its_ranks(
    nemo_tekken: Path, tmp_path: Path
) -> None:
    files = ModelFiles.of(model_directory(tmp_path / "nemo", nemo_tekken))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(files.tokenizer_file))
    assert files.tokenizer_file.parent != files.path  # derived beside it, the model's directory untouched
    assert sorted(p.name for p in files.path.iterdir() if not p.name.startswith(".")) == ["config.json", "tekken.json"]
    encoding = reference(nemo_tekken)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == [1000 + token for token in encoding.encode(text)], text
        assert tokenizer.decode(ids) == text
    assert tokenizer.get_vocab_size() == 131072
    # The control tokens, at the ids mistral-common gives them; a prompt encoded whole starts with <s>.
    assert [tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "[INST]", "[TOOL_CALLS]", "<pad>")] == [
        0,
        1,
        2,
        3,
        9,
        11,
    ]
    assert tokenizer.id_to_token(999) == "<SPECIAL_999>"
    body = [1000 + token for token in encoding.encode("Bonjour")]
    assert tokenizer.encode("[INST]Bonjour[/INST]", add_special_tokens=True).ids == [1, 3, *body, 4]
    assert files.special_token("bos_token") == "<s>" and files.special_token("eos_token") == "</s>"
    assert ModelFiles.of(files.path).tokenizer_file == files.tokenizer_file  # made once


def test_a_tekken_file_that_lists_its_control_tokens_gives_each_its_rank(nemo_tekken: Path, tmp_path: Path) -> None:
    """Later files list their control tokens (`special_tokens`, by rank) where older ones rely on
    mistral-common's original twenty."""
    data = json.loads(nemo_tekken.read_text(encoding="utf-8"))
    listed = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[THINK]", "[/THINK]"]
    data["special_tokens"] = [
        {"rank": rank, "token_str": token, "is_control": True} for rank, token in reversed(list(enumerate(listed)))
    ]
    file = tmp_path / "later.json"
    file.write_text(json.dumps(data), encoding="utf-8")
    tokenizer = tekken.convert(file)
    assert [tokenizer.token_to_id(t) for t in listed] == list(range(7))
    assert tokenizer.token_to_id("[TOOL_CALLS]") is None and tokenizer.id_to_token(7) == "<SPECIAL_7>"
    ids = tokenizer.encode("[THINK]Hmm[/THINK]", add_special_tokens=False).ids
    assert (ids[0], ids[-1]) == (5, 6) and min(ids[1:-1]) >= 7


def test_a_tekken_file_that_cannot_be_read_stops_the_start_naming_it(nemo_tekken: Path, tmp_path: Path) -> None:
    data = json.loads(nemo_tekken.read_text(encoding="utf-8"))
    data["special_tokens"] = [{"rank": 0, "token_str": "<unk>"}, {"rank": 2, "token_str": "</s>"}]
    directory = tmp_path / "broken"
    directory.mkdir()
    transformers.MistralConfig(vocab_size=131072).save_pretrained(directory)
    (directory / tekken.FILE).write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ModelFilesError, match=r"broken/tekken\.json cannot be read as a tekken tokenizer: .*ranks"):
        ModelFiles.of(directory).check()
    (directory / tekken.FILE).unlink()
    with pytest.raises(ModelFilesError, match=r"tokenizer\.json is missing .*tekken\.json"):
        _ = ModelFiles.of(directory).tokenizer_file


@pytest.fixture(scope="module")
def api(
    nemo_tekken: Path, stack_env: dict[str, str], templates_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """A random Mistral of Nemo's vocabulary, its directory laid out as Mistral's later releases are
    (config.json, weights, tekken.json), with Nemo's chat template."""
    path = tmp_path_factory.mktemp("tekken") / "mistral"
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=131072,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
    )
    transformers.MistralForCausalLM(config).save_pretrained(path)
    shutil.copy(nemo_tekken, path / tekken.FILE)
    shutil.copy(templates_dir / "mistralai-Mistral-Nemo-Instruct-2407.jinja", path / "chat_template.jinja")
    env = {**stack_env, "MODEL_PATH": str(path)}
    logs = tmp_path_factory.mktemp("logs")
    with localstack.running_model(env, "mistral", logs) as url:
        yield url, logs / "worker.log"


@pytest.fixture(scope="module")
def templates_dir() -> Path:
    return real_models.chat_templates()


@pytest.mark.e2e
def test_a_model_whose_tokenizer_is_tekken_json_alone_is_served(api: tuple[str, Path], nemo_tekken: Path) -> None:
    """The chat prompt is Nemo's template over the tekken tokenizer's ids (its control tokens and
    tiktoken's BPE between them); the answer's ids decode to its text, streamed and not."""
    api, _ = api
    encoding = reference(nemo_tekken)
    body = {
        "model": "mistral",
        "messages": [{"role": "user", "content": "Bonjour, ça va ?"}],
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": True,
    }
    answer = requests.post(f"{api}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    prompt = [1, 3, *(1000 + t for t in encoding.encode("Bonjour, ça va ?")), 4]
    assert answer.json()["prompt_token_ids"] == prompt
    made = [t for t in choice["token_ids"] if t >= 1000]  # the control tokens are not text
    assert choice["message"]["content"] == encoding.decode_bytes([t - 1000 for t in made]).decode(errors="replace")
    with requests.post(f"{api}/v1/chat/completions", json={**body, "stream": True}, timeout=60, stream=True) as stream:
        lines = [line[6:] for line in stream.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == (choice["message"]["content"])
    )
    tokenized = requests.post(f"{api}/tokenize", json={"model": "mistral", "prompt": "Bonjour"}, timeout=10).json()
    assert tokenized["tokens"] == [1, *(1000 + t for t in encoding.encode("Bonjour"))]


def test_a_read_only_model_directory_has_its_tokenizer_derived_under_the_homes_cache(
    nemo_tekken: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container mounts the models read-only: the tokenizer is derived under ~/.cache/tokenline/tekken."""
    directory = model_directory(tmp_path / "mounted", nemo_tekken)
    # Root writes anywhere: the read-only mount is what os.access answers for it.
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: writable(path, mode) and Path(path) != directory)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    file = ModelFiles.of(directory).tokenizer_file
    assert file.parent.parent == tmp_path / "home" / ".cache" / "tokenline" / "tekken" and file.is_file()
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "tekken.json"]


@pytest.mark.e2e
def test_the_first_constrained_request_finds_the_grammar_engine_ready(api: tuple[str, Path]) -> None:
    """The grammar engine read the 131,072-token vocabulary before the worker served. Read at the
    first constrained request instead, it held the worker's GIL for seconds, past the heartbeat's
    TTL on a slow CPU, and the API failed the request (and any other the worker held) as the
    worker's loss. A required call is held to the tool's schema and read back."""
    api, worker_log = api
    log = worker_log.read_text(encoding="utf-8")
    assert log.index("grammar engine: 131072-token vocabulary read") < log.index("serving model=mistral")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    body = {
        "model": "mistral",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 40,
        "temperature": 0,
    }
    answer = requests.post(f"{api}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert len(json.loads(call["function"]["arguments"])["city"]) <= 8
    assert worker_log.read_text(encoding="utf-8").count("grammar engine:") == 1
