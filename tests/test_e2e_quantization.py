"""`quantization: int8` through the stack: a worker quantizing the demo model at load and the API in
front of it, under gunicorn. /v1/models and the worker's metrics say how the model runs, and it
serves (streamed and not, the same greedy text). tests/test_quantization.py holds the int8 math;
tests/test_metrics.py the float model's labels."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from scripts import localstack
from tests.test_metrics import scrape, value
from workers.models.quant.kernels import CpuInt8

pytestmark = pytest.mark.e2e

MODEL = "demo-int8"


@pytest.fixture(scope="module")
def api(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {**stack_env, "TOKENLINE_QUANTIZATION": "int8"}
    with localstack.running_model(env, MODEL, tmp_path_factory.mktemp("int8")) as url:
        yield url


def test_the_model_card_names_the_scheme(api: str) -> None:
    card = requests.get(f"{api}/v1/models/{MODEL}", timeout=30).json()
    assert card["id"] == MODEL and card["quantization"] == "w8a8_dynamic (load)"


def test_the_worker_metrics_say_how_the_model_runs(api: str, demo_model: Path) -> None:
    stack_of_model = SimpleNamespace(base_url=api)
    localstack.wait_for(
        lambda: value(scrape(stack_of_model), "tokenline:model_info", model=MODEL) == 1, 10, "the worker's snapshot"
    )
    samples = scrape(stack_of_model)
    (labels,) = [dict(ls) for n, ls in samples if n == "tokenline:model_info" and ("model", MODEL) in ls]
    # The kernel as the worker names it on this CPU: fbgemm, on 7-bit halves where the CPU has no VNNI.
    kernel = CpuInt8().name
    assert kernel in ("fbgemm", "fbgemm (7-bit halves: this CPU has no VNNI)")
    assert (labels["quantization"], labels["kernel"], labels["dtype"]) == ("w8a8_dynamic (load)", kernel, "float32")
    # int8 weights: a quarter of the float32 checkpoint's linear layers, and the float norms.
    weights = value(samples, "tokenline:model_weight_bytes", model=MODEL)
    checkpoint = sum(f.stat().st_size for f in demo_model.glob("*.safetensors"))
    assert 0.2 * checkpoint < weights < 0.4 * checkpoint


def test_it_serves_the_same_greedy_text_streamed_and_not(api: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0}
    plain = requests.post(f"{api}/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 12
    text = ""
    with requests.post(  # closed at its end: an open connection holds the API's stop
        f"{api}/v1/chat/completions", json={**body, "ignore_eos": True, "stream": True}, stream=True, timeout=60
    ) as streamed:
        for line in streamed.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[len("data: ") :])["choices"]
                text += choices[0]["delta"].get("content") or "" if choices else ""
    assert text == plain.json()["choices"][0]["message"]["content"]
