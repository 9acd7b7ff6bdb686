"""The KV host tier end to end (cpuMemSize; workers/engine/kv_cache.py): a worker whose pool holds about
three of six concurrent requests preempts some of them; their blocks go to host memory and come back,
so every request gets the text it gets alone and no token is computed twice (the worker's metrics)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from scripts import localstack

TOKEN_BYTES = 4 * 2 * 64 * 2 * 4  # the demo model: 4 layers × 2 KV heads × 64 × K and V × float32
POOL_TOKENS = 640
REQUESTS = 6


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}_total{{[^}}]*}} (\S+)$", metrics, re.M))


def test_preempted_requests_resume_from_the_host_tier_with_the_text_they_get_alone(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    env = {
        **stack_env,
        "TOKENLINE_NPU_MEM_SIZE": f"{POOL_TOKENS * TOKEN_BYTES / 2**30:.9f}",
        "TOKENLINE_CPU_MEM_SIZE": "0.05",
        "TOKENLINE_MAX_BATCH_SIZE": str(REQUESTS),
    }
    with localstack.running_model(env, "swapping", tmp_path) as url:

        def chat(i: int) -> str:
            body = {
                "model": "swapping",
                "messages": [{"role": "user", "content": f"request {i}: " + "tell me more " * 40}],
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(REQUESTS) as pool:
            together = list(pool.map(chat, range(REQUESTS)))
        seen: dict[str, float] = {}

        def swapped() -> bool:  # the worker's counters reach the API with its next heartbeat
            metrics = requests.get(f"{url}/metrics", timeout=10).text
            for name in ("num_preemptions", "kv_swapped_out_blocks", "kv_swapped_in_blocks", "recomputed_tokens"):
                seen[name] = counter(metrics, f"tokenline:{name}")
            return seen["kv_swapped_in_blocks"] > 0

        localstack.wait_for(swapped, 10, "the swaps in the metrics")
        alone = [chat(i) for i in range(REQUESTS)]
        # A prompt the model's context takes and the pool cannot: the worker refuses it, as the client's.
        long = {"model": "swapping", "prompt": "tell me more " * 300, "max_tokens": 4}
        refused = requests.post(f"{url}/v1/completions", json=long, timeout=60)
        as_input = {"model": "swapping", "input": "tell me more " * 300, "max_output_tokens": 4}
        refused_input = requests.post(f"{url}/v1/responses", json=as_input, timeout=60)
    assert together == alone
    assert seen["num_preemptions"] > 0 and seen["kv_swapped_out_blocks"] >= seen["kv_swapped_in_blocks"] > 0
    assert seen["recomputed_tokens"] == 0
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "tokens, which leaves no room to generate within the model's" in error["message"]
    assert error["param"] == "prompt"  # the worker knows no field names; the API names the request's
    assert refused_input.status_code == 400, refused_input.text
    assert refused_input.json()["error"]["param"] == "input"
