"""Real parts: a redis-server on a free port, the demo model built offline, worker processes, gunicorn."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests

from schemas.config import Settings, load_settings
from scripts import localstack, real_models
from scripts.build_demo_model import SENTENCEPIECE_LAYOUTS
from scripts.build_demo_model import main as build_demo_model
from workers.serving.main import GOMP_SPIN_COUNT

# Before torch loads here: libgomp's threads sleep soon after a parallel region, as in a worker. With its
# default spin, the two test processes of `make test` (on two cores) took half as long again over the
# modules that run transformers in the test process, each one's idle threads holding a core.
os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)

MODEL_NAME = "demo"


def pytest_configure(config: pytest.Config) -> None:
    """With a test process per core (`make test`: two on two cores), each computes on one torch thread,
    as a worker's decode does: at torch's default (every core) the two processes' threads took turns
    on the cores, and the modules that run models in the test process took ~10% longer. An engine
    still sets its own counts for its passes (workers/models/runner.py)."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
        import torch

        torch.set_num_threads(1)


def _fetches(item: pytest.Item) -> bool:
    """Whether the test needs files that scripts/real_models.py fetches from PyPI."""
    return (
        item.get_closest_marker("fetched") is not None
        or "smollm2" in item.fixturenames
        or getattr(item.module, "real_models", None) is not None
    )


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules by their number of tests, most first (what pytest-xdist's loadfile does by default; the
    Makefile turns its own reordering off), those that need fetched files after the others, while one
    test process fetches them in the background (below)."""
    module = {item: item.nodeid.split("::")[0] for item in items}
    counts = Counter(module.values())
    fetching = {module[item] for item in items if _fetches(item)}
    items.sort(key=lambda item: (module[item] in fetching, -counts[module[item]]))
    worker = getattr(config, "workerinput", {}).get("workerid")
    if fetching and worker in (None, "gw0"):
        _fetch_in_background(config)


FETCH = pytest.StashKey[subprocess.Popen[bytes]]()


def _fetch_in_background(config: pytest.Config) -> None:
    """SmolLM2, the chat templates, the device libraries' interfaces, Mistral's tekken.json and the
    real tokenizers, fetched (over the network: a minute on a fresh machine) and built (the tokenizers
    ~20 s) while the tests that do not need them run. The fixtures that need them wait on the same
    file locks, and build them themselves (with their errors) if this fetch failed."""
    config.stash[FETCH] = subprocess.Popen(
        [
            sys.executable,
            str(localstack.ROOT / "scripts" / "real_models.py"),
            "smollm2-gguf",
            "templates",
            "smollm2",
            "interfaces",
            "tekken",
            "tokenizers",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The fetch is waited for (the other test process may be waiting on its lock), or stopped if the
    run was interrupted."""
    fetch = session.config.stash.get(FETCH, None)
    if fetch is not None:
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            fetch.terminate()
        fetch.wait()


@pytest.fixture(scope="session", autouse=True)
def connections_closed_after_each_request() -> Iterator[None]:
    """The tests' requests ask the API to close the connection after its answer. requests keeps a
    connection open while its response object lives, which in a test is until the test ends; a
    stopping gunicorn waits for such idle connections up to its keep-alive (5 s), so each API a test
    stopped took 6 s instead of 1."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(requests.sessions, "default_headers", _closing_headers)
        yield


def _closing_headers() -> requests.structures.CaseInsensitiveDict[str]:
    headers = requests.utils.default_headers()
    headers["Connection"] = "close"
    return headers


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / MODEL_NAME
    build_demo_model([str(path)])
    return path


@pytest.fixture(scope="session")
def sentencepiece_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model with SentencePiece byte-fallback tokenizers: the "llama2" layout (Llama 2,
    Mistral, Phi-3) and the "gemma" one."""
    root = tmp_path_factory.mktemp("sentencepiece")
    for layout in SENTENCEPIECE_LAYOUTS:
        build_demo_model([str(root / layout), "--tokenizer", layout])
    return {layout: root / layout for layout in SENTENCEPIECE_LAYOUTS}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, real weights (scripts/real_models.py: built once per machine, in models/)."""
    return real_models.smollm2()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = localstack.free_port()
    proc = localstack.start_redis(port, log=tmp_path_factory.mktemp("logs") / "redis.log")
    yield f"redis://127.0.0.1:{port}/0"
    localstack.stop(proc)


@pytest.fixture()
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(scope="session")
def stack_env(demo_model: Path, redis_url: str) -> dict[str, str]:
    return localstack.environment(
        MODEL_PATH=str(demo_model),
        MODEL_NAME=MODEL_NAME,
        REDIS_URL=redis_url,
        TOKENLINE_MAX_ITER_TIMES="256",
        TOKENLINE_LOG_LEVEL="INFO",
        # Test stacks share one host and one Redis: no device leases (tests/test_device_lease.py has those).
        TOKENLINE_DEVICE="cpu",
    )


@pytest.fixture(scope="session")
def settings(stack_env: dict[str, str]) -> Settings:
    return load_settings(stack_env)


@dataclass
class Stack:
    base_url: str
    redis_url: str
    logs: Path
    worker: subprocess.Popen[bytes]
    api: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def stack(stack_env: dict[str, str], redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One worker and the API under gunicorn, shared by the end-to-end tests."""
    logs = tmp_path_factory.mktemp("stack")
    port = localstack.free_port()
    worker = localstack.start_worker(stack_env, MODEL_NAME, log=logs / "worker.log")
    api = localstack.start_api(stack_env, port, log=logs / "api.log")
    try:
        localstack.wait_for_api(port, api)
        localstack.wait_for(lambda: localstack.worker_count(redis_url, MODEL_NAME) > 0, 60, "the worker")
        yield Stack(f"http://127.0.0.1:{port}", redis_url, logs, worker, api)
    finally:
        localstack.stop(api, worker)


@pytest.fixture(scope="session")
def openai_client(stack: Stack):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
