"""API keys, what is never logged, and the dependency floors that close known CVEs."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from scripts import localstack

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("tl-key-one-0123456789", "tl-key-two-9876543210")
FILE_KEY = "tl-key-from-file-abcdef"
SECRET_PROMPT = "the launch code is ZEBRA-4471-QUARTZ"


@dataclass
class Keyed:
    url: str
    log: Path


@pytest.fixture(scope="module")
def keyed(stack, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:  # type: ignore[no-untyped-def]
    """A second API (same Redis, same worker) that requires API keys from the environment and a file."""
    logs = tmp_path_factory.mktemp("keyed")
    keys_file = logs / "keys.txt"
    keys_file.write_text(f"# rotated monthly\n{FILE_KEY}\n\n")
    env = {**stack_env, "TOKENLINE_API_KEYS": ",".join(KEYS), "TOKENLINE_API_KEYS_FILE": str(keys_file)}
    port = localstack.free_port()
    api = localstack.start_api(env, port, log=logs / "api.log")
    try:
        localstack.wait_for_api(port, api)
        yield Keyed(f"http://127.0.0.1:{port}", logs / "api.log")
    finally:
        localstack.stop(api)


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/demo", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/generate", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("POST", "/v1/responses", {"model": "demo", "input": "hi", "max_output_tokens": 2, "store": False}),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_of_the_api_needs_a_key(keyed: Keyed, method: str, path: str, body: dict | None) -> None:
    missing = requests.request(method, keyed.url + path, json=body, headers={"X-Request-Id": "trace-401"}, timeout=30)
    assert missing.status_code == 401 and missing.headers["X-Request-Id"] == "trace-401"
    assert missing.json()["error"] == {
        "message": "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        "type": "authentication_error",
        "param": None,
        "code": "missing_api_key",
    }
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="tokenline"'
    wrong = requests.request(method, keyed.url + path, json=body, headers=bearer("tl-key-one-01234567890"), timeout=30)
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    basic = requests.request(method, keyed.url + path, json=body, headers={"Authorization": f"Basic {KEYS[0]}"})
    assert basic.status_code == 401
    for key in (*KEYS, FILE_KEY):
        assert requests.request(method, keyed.url + path, json=body, headers=bearer(key), timeout=30).status_code == 200


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["/health", "/health/live", "/health/ready", "/metrics", "/openapi.json", "/docs"])
def test_health_metrics_and_the_api_description_are_open(keyed: Keyed, path: str) -> None:
    assert requests.get(f"{keyed.url}{path}", timeout=10).status_code == 200


def test_an_api_whose_model_cannot_be_served_stops_with_one_line_naming_it(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    """As a worker's start does: not a traceback from each gunicorn worker that fails to boot."""
    env = {**stack_env, "MODEL_PATH": str(tmp_path / "nowhere"), "MODEL_NAME": "lost"}
    refused = localstack.start_api(env, localstack.free_port(), log=tmp_path / "api.log")
    assert refused.wait(30) != 0
    log = (tmp_path / "api.log").read_text()
    assert f"tokenline API: model lost: {tmp_path / 'nowhere' / 'config.json'} is missing" in log
    assert "Traceback" not in log


def test_an_api_whose_models_quantization_cannot_be_served_stops_with_one_line_naming_it(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    """A config.json that names MindIE's `quantize` without msModelSlim's description beside it is
    refused by the worker; the API says so too, once, rather than listing the model as float."""
    model = tmp_path / "model"
    shutil.copytree(stack_env["MODEL_PATH"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantize": "w8a8"}))
    env = {**stack_env, "MODEL_PATH": str(model)}
    refused = localstack.start_api(env, localstack.free_port(), log=tmp_path / "api.log")
    assert refused.wait(30) != 0
    log = (tmp_path / "api.log").read_text()
    assert "tokenline API: model demo: config.json names quantize='w8a8' but " in log
    assert "Traceback" not in log


def test_a_published_api_refuses_to_start_without_keys_unless_in_development_mode(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**stack_env, "TOKENLINE_PUBLIC": "1"}
    env.pop("TOKENLINE_API_KEYS", None)
    env.pop("TOKENLINE_API_KEYS_FILE", None)
    port = localstack.free_port()
    refused = localstack.start_api(env, port, log=tmp_path / "refused.log")
    assert refused.wait(30) != 0
    assert "published without API keys; set TOKENLINE_API_KEYS" in (tmp_path / "refused.log").read_text()
    dev = localstack.start_api({**env, "TOKENLINE_DEV_MODE": "1"}, port, log=tmp_path / "dev.log")
    try:
        localstack.wait_for_api(port, dev)
    finally:
        localstack.stop(dev)


@pytest.mark.e2e
def test_openai_sdk_with_a_key(keyed: Keyed) -> None:
    from openai import AuthenticationError, OpenAI

    # Clients closed as they finish: an idle connection holds the API's stop for gunicorn's keep-alive.
    with OpenAI(base_url=f"{keyed.url}/v1", api_key=KEYS[1], max_retries=0) as client:
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    with (
        OpenAI(base_url=f"{keyed.url}/v1", api_key="nope", max_retries=0) as refused,
        pytest.raises(AuthenticationError),
    ):
        refused.models.list()


@pytest.mark.e2e
def test_prompts_and_keys_are_not_logged_at_the_default_level(stack, keyed: Keyed) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "demo", "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 4}
    assert requests.post(f"{keyed.url}/v1/chat/completions", json=body, headers=bearer(KEYS[0])).status_code == 200
    gen = {"prompt": SECRET_PROMPT, "max_tokens": 4, "stream": True}
    assert requests.post(f"{keyed.url}/generate", json=gen, headers=bearer(FILE_KEY)).status_code == 200
    assert requests.post(f"{keyed.url}/generate", json=gen, headers=bearer("a-wrong-key-0000")).status_code == 401
    # The request reached the worker and was logged there by id; the prompt and the keys appear nowhere.
    localstack.wait_for(lambda: "end request_id=cmpl-" in (stack.logs / "worker.log").read_text(), 10, "worker log")
    # What it says instead: how it ended, its token counts and its time on the worker.
    ended = r"end request_id=cmpl-\w+ (length|stop) prompt_tokens=\d+ completion_tokens=[1-4] seconds=\d+\.\d{3}\n"
    assert re.search(ended, (stack.logs / "worker.log").read_text())
    for log in (keyed.log, stack.logs / "worker.log", stack.logs / "api.log"):
        text = log.read_text()
        assert "ZEBRA-4471" not in text, log
        for key in (*KEYS, FILE_KEY, "a-wrong-key-0000"):
            assert key not in text, log


@pytest.mark.e2e
def test_anthropic_sdk_with_its_x_api_key_and_errors_in_its_envelope(keyed: Keyed) -> None:
    from anthropic import Anthropic, AuthenticationError

    with Anthropic(base_url=keyed.url, api_key=KEYS[0], max_retries=0) as client:
        message = client.messages.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens == 2
    with (
        Anthropic(base_url=keyed.url, api_key="nope-nope-nope", max_retries=0) as refused,
        pytest.raises(AuthenticationError),
    ):
        refused.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "hi"}])
    missing = requests.post(f"{keyed.url}/v1/messages", json={}, timeout=10)
    assert missing.status_code == 401 and missing.json()["type"] == "error"
    assert missing.json()["error"]["type"] == "authentication_error"


@pytest.mark.e2e
def test_a_stored_response_belongs_to_the_key_that_made_it(keyed: Keyed) -> None:
    from openai import NotFoundError, OpenAI

    with (
        OpenAI(base_url=f"{keyed.url}/v1", api_key=KEYS[0], max_retries=0) as mine,
        OpenAI(base_url=f"{keyed.url}/v1", api_key=KEYS[1], max_retries=0) as theirs,
    ):
        response = mine.responses.create(model="demo", input="hi", max_output_tokens=2)
        assert mine.responses.retrieve(response.id).id == response.id
        with pytest.raises(NotFoundError):
            theirs.responses.retrieve(response.id)
        with pytest.raises(NotFoundError):
            theirs.responses.input_items.list(response.id)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# Dependencies: pinned exactly, and at or above the releases that fixed known CVEs.

FLOORS = {"gunicorn": (23, 0, 0), "marshmallow": (4, 1, 2), "werkzeug": (3, 0, 6), "jinja2": (3, 1, 6)}


def pins() -> dict[str, str]:
    found = {}
    for name in ("requirements-api.txt", "requirements.txt", "requirements-dev.txt", "requirements-bench.txt"):
        for line in (ROOT / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-r"):
                continue
            match = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==([0-9][0-9A-Za-z.]*)", line)
            assert match, f"{name}: not pinned exactly: {line!r}"
            found[match.group(1).lower()] = match.group(2)
    return found


def test_dependencies_are_pinned_at_or_above_the_cve_floors() -> None:
    found = pins()
    for package, floor in FLOORS.items():
        version = tuple(int(part) for part in found[package].split(".")[:3])
        assert version >= floor, f"{package} {found[package]} is below {'.'.join(map(str, floor))}"
