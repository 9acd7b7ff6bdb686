"""/generate end to end: the vLLM-compatible endpoint, JSON and '\\0'-separated streaming."""

from __future__ import annotations

import itertools
import json

import pytest
import requests

pytestmark = pytest.mark.e2e

SEED_SAMPLE = {
    "prompt": "My name is Olivier and I",
    "max_tokens": 20,
    "repetition_penalty": 1.03,
    "presence_penalty": 1.2,
    "frequency_penalty": 1.2,
    "temperature": 0.5,
    "top_k": 10,
    "top_p": 0.95,
    "stream": False,
}
SEED_STREAM_SAMPLE = {
    "prompt": "My name is Olivier and I",
    "stream": True,
    "repetition_penalty": 1.0,
    "top_p": 1.0,
    "top_k": 10,
    "max_tokens": 16,
    "temperature": 1.0,
}


def post(stack, body: dict) -> requests.Response:  # type: ignore[no-untyped-def]
    return requests.post(f"{stack.base_url}/generate", json=body, timeout=60)


def frames(response: requests.Response) -> list[dict]:
    raw = response.content
    assert raw.endswith(b"\0")
    return [json.loads(part) for part in raw.split(b"\0")[:-1]]


def test_seed_sample_returns_text(stack) -> None:
    response = post(stack, SEED_SAMPLE)
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"text"} and isinstance(body["text"], str) and body["text"]


def test_seed_stream_sample_returns_null_separated_json_deltas(stack) -> None:
    response = post(stack, SEED_STREAM_SAMPLE)
    assert response.status_code == 200
    parts = frames(response)
    assert parts and all(set(p) == {"text"} and isinstance(p["text"], str) for p in parts)


def test_stream_deltas_join_to_the_non_stream_text(stack) -> None:
    body = {"prompt": "hello world", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    whole = post(stack, body).json()["text"]
    parts = frames(post(stack, {**body, "stream": True}))
    assert "".join(p["text"] for p in parts) == whole


def first_token_text(stack, prompt: str) -> str:  # type: ignore[no-untyped-def]
    text = post(stack, {"prompt": prompt, "max_tokens": 1, "temperature": 0}).json()["text"]
    assert text, "the greedy first token has text"
    return text


def test_a_stream_stopped_at_its_first_token_still_sends_its_one_object(stack) -> None:
    """A stop string met at the first token leaves no text to send: the stream still sends one
    object (else a client sees an empty body, as from a dropped connection)."""
    stop = first_token_text(stack, "hello world")
    body = {"prompt": "hello world", "max_tokens": 5, "temperature": 0, "stop": [stop]}
    assert post(stack, body).json() == {"text": ""}
    response = post(stack, {**body, "stream": True})
    assert response.status_code == 200 and frames(response) == [{"text": ""}]


def test_default_max_tokens_is_16(stack) -> None:
    body = {"prompt": "hello", "temperature": 0, "ignore_eos": True}
    default = post(stack, body).json()["text"]
    assert default == post(stack, {**body, "max_tokens": 16}).json()["text"]
    assert default != post(stack, {**body, "max_tokens": 48}).json()["text"]


def test_greedy_temperature_zero_is_deterministic(stack) -> None:
    body = {"prompt": "the model", "max_tokens": 12, "temperature": 0}
    assert post(stack, body).json() == post(stack, body).json()


def test_vllm_style_streams_cumulative_prompt_and_text(demo_model, redis_url, stack, tmp_path) -> None:
    """generateStyle=vllm (a second API on the same Redis and worker): vLLM's cumulative shape."""
    from scripts import localstack

    env = localstack.environment(
        MODEL_PATH=str(demo_model), MODEL_NAME="demo", REDIS_URL=redis_url, TOKENLINE_GENERATE_STYLE="vllm"
    )
    port = localstack.free_port()
    api = localstack.start_api(env, port, log=tmp_path / "api.log")
    try:
        localstack.wait_for_api(port, api)
        body = {"prompt": "hello world", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        url = f"http://127.0.0.1:{port}/generate"
        whole = requests.post(url, json=body, timeout=60).json()
        parts = frames(requests.post(url, json={**body, "stream": True}, timeout=60))
        mindie = post(stack, body).json()["text"]
        stopped = {**body, "stop": [first_token_text(stack, "hello world")], "stream": True}
        at_once = frames(requests.post(url, json=stopped, timeout=60))
    finally:
        localstack.stop(api)
    assert whole == {"text": ["hello world" + mindie]}
    texts = [p["text"][0] for p in parts]
    assert all(t.startswith("hello world") for t in texts)
    assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == whole["text"][0]
    assert at_once == [{"text": ["hello world"]}]  # stopped at its first token: vLLM's final output
