"""A model with a SentencePiece byte-fallback tokenizer (Llama 2 / Mistral / Gemma / Phi-3's layout),
served through the API: requests whose text runs through byte tokens, valid or not, end cleanly,
streamed and not, and text that never forms characters streams as it comes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from scripts import localstack

pytestmark = pytest.mark.e2e

MODEL = "spm"
PROMPTS = [
    "你好，世界！请介绍一下昇腾。",
    "🙂🙃😀 emoji only? 🚀🔥",
    "日本語のテキスト：こんにちは",
    "한국어 문장도 있습니다",
    "naïve café — “quotes” and ‘marks’",
    "数学：∑∫√∞≈≠",
    "𝄞 musical, 𐍈 gothic, 🀄 tiles",
    "混合 mixed 文本 text 🙂 end",
    "Ελληνικά και русский текст",
    "עברית ועربي",
    "🇨🇳🇫🇷 flags and 👨‍👩‍👧 families",
    "推理服务模型请求流式文本生成",
]


@pytest.fixture(scope="module")
def api(
    sentencepiece_models: dict[str, Path], stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    env = {**stack_env, "MODEL_PATH": str(sentencepiece_models["llama2"])}
    with localstack.running_model(env, MODEL, tmp_path_factory.mktemp("spm")) as url:
        yield url


def chat(api: str, prompt: str, **fields: object) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}
    return requests.post(f"{api}/v1/chat/completions", json=body, timeout=60, stream=bool(fields.get("stream")))


def streamed(response: requests.Response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_greedy_requests_over_byte_tokens_end_cleanly_streamed_and_not(
    api: str, sentencepiece_models: dict[str, Path]
) -> None:
    """The model is pushed towards its 256 byte tokens (random weights rarely pick them): its output
    is runs of bytes, some of them characters, some never."""
    vocab = json.loads((sentencepiece_models["llama2"] / "tokenizer.json").read_text())["model"]["vocab"]
    towards_bytes = {str(vocab[f"<0x{b:02X}>"]): 3 for b in range(256)}
    for prompt in PROMPTS:
        whole = chat(api, prompt, max_tokens=48, logit_bias=towards_bytes)
        assert whole.status_code == 200, whole.text
        (choice,) = whole.json()["choices"]
        assert choice["finish_reason"] in ("stop", "length")
        with chat(api, prompt, max_tokens=48, logit_bias=towards_bytes, stream=True) as stream:
            assert stream.status_code == 200
            chunks = streamed(stream)
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == choice["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_tokens_that_never_form_a_character_stream_one_event_each(
    api: str, sentencepiece_models: dict[str, Path]
) -> None:
    """200 lone continuation bytes (<0xA9>, forced by logit_bias): 200 content events of U+FFFD, as
    they are generated, not held back to the end."""
    vocab = json.loads((sentencepiece_models["llama2"] / "tokenizer.json").read_text())["model"]["vocab"]
    bias = {str(vocab["<0xA9>"]): 100}
    with chat(api, "hi", max_tokens=200, ignore_eos=True, logit_bias=bias, stream=True) as stream:
        chunks = streamed(stream)
    contents = [
        c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert len(contents) >= 180
    assert "".join(contents) == "\ufffd" * 200


def test_logprobs_give_each_byte_tokens_own_bytes_which_join_into_the_text(
    api: str, sentencepiece_models: dict[str, Path]
) -> None:
    """A token that is a piece of a character has its own bytes in `bytes` (OpenAI's field for
    joining them), not those of the U+FFFD its text shows."""
    vocab = json.loads((sentencepiece_models["llama2"] / "tokenizer.json").read_text())["model"]["vocab"]
    lone = chat(api, "hi", max_tokens=5, ignore_eos=True, logit_bias={str(vocab["<0xA9>"]): 100}, logprobs=True)
    entries = lone.json()["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in entries] == [("\ufffd", [0xA9])] * 5
    towards_bytes = {str(vocab[f"<0x{b:02X}>"]): 3 for b in range(256)}
    formed = 0
    for prompt in PROMPTS[:4]:
        answer = chat(api, prompt, max_tokens=32, ignore_eos=True, logit_bias=towards_bytes, logprobs=True)
        (choice,) = answer.json()["choices"]
        joined = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
        # Every character of the text joined from its tokens' bytes (U+FFFD's count per invalid run is
        # the detokenizer's, not necessarily Python's decoder's).
        characters = joined.decode("utf-8", "replace").replace("\ufffd", "")
        assert characters == choice["message"]["content"].replace("\ufffd", "")
        formed += any(len(c.encode()) > 1 for c in characters)
    assert formed  # some characters were formed from byte tokens


def test_logprob_tokens_are_the_text_of_their_bytes_and_join_into_the_content(api: str) -> None:
    """A "▁wi" token's text is " wi", as the content writes it and its `bytes` say (OpenAI: `bytes`
    is the UTF-8 of `token`), not the "wi" that decoding it alone gives through this layout's decoder
    (which strips the text's first space); the alternatives alike. Echoed completions' tokens join into
    the prompt and their text_offsets point into it."""
    answer = chat(api, "Hello there, how are you?", max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    alternatives = [a for e in entries for a in e["top_logprobs"]]
    for entry in [*entries, *alternatives]:
        if "\ufffd" not in entry["token"]:
            assert list(entry["token"].encode()) == entry["bytes"], entry
    assert any(e["token"].startswith(" ") for e in [*entries, *alternatives])
    prompt = "a b c 你好"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    echoed = requests.post(f"{api}/v1/completions", json=body, timeout=60)
    assert echoed.status_code == 200, echoed.text
    (completion,) = echoed.json()["choices"]
    tokens, offsets = completion["logprobs"]["tokens"], completion["logprobs"]["text_offset"]
    assert completion["text"] == prompt and "".join(tokens) == prompt
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def bos_api(
    sentencepiece_models: dict[str, Path], stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The layout with Llama 2's own post-processor: its tokenizer.json writes `<s>` before a text."""
    path = tmp_path_factory.mktemp("bos") / MODEL
    shutil.copytree(sentencepiece_models["llama2"], path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    bos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<s>")
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with localstack.running_model({**stack_env, "MODEL_PATH": str(path)}, MODEL, path.parent) as url:
        yield url


def test_add_special_tokens_adds_the_tokenizers_bos_as_vllm_does(bos_api: str) -> None:
    """vLLM's add_special_tokens: on /v1/completions (default true) the tokenizer's BOS comes first, and
    false leaves it out; on chat (default false) the template's text is all, and true adds the BOS."""

    def prompt_tokens(path: str, body: dict) -> int:
        answer = requests.post(f"{bos_api}{path}", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens"]

    text = {"prompt": "Hello there"}
    counted = requests.post(f"{bos_api}/tokenize", json={"model": MODEL, **text}, timeout=60).json()["count"]
    plain = {**text, "add_special_tokens": False}
    without = requests.post(f"{bos_api}/tokenize", json={"model": MODEL, **plain}, timeout=60).json()["count"]
    assert without == counted - 1
    assert prompt_tokens("/v1/completions", text) == counted
    assert prompt_tokens("/v1/completions", plain) == counted - 1
    messages = {"messages": [{"role": "user", "content": "Hello there"}]}
    assert prompt_tokens("/v1/chat/completions", {**messages, "add_special_tokens": True}) == (
        prompt_tokens("/v1/chat/completions", messages) + 1
    )
