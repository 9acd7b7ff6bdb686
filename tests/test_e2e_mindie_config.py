"""tokenline started from MindIE's own config.json, as Huawei ships it, with only the model's name
and weight path changed: the API and a worker come up from it and serve a chat request.

The sample asks for maxBatchSize 200 and a KV pool of "what the device has free"; on a CPU test host
the environment bounds the pool (TOKENLINE_NPU_MEM_SIZE, tokenline's documented override) and names
the device (TOKENLINE_DEVICE=cpu). Its worldSize 4 is served as it asks, by a tensor-parallel group of
four ranks, on a model shaped like the demo model with as many KV heads as attention heads (4), so
that four ranks can split them.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import requests
import torch
import transformers

from scripts import localstack

SAMPLE = Path(__file__).parent / "data" / "mindie_config.json"


def four_way(demo_model: Path, path: Path) -> Path:
    """The demo model's shape and tokenizer, with 4 KV heads."""
    config = transformers.AutoConfig.from_pretrained(demo_model)
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(demo_model / name, path / name)
    return path


def test_the_stack_starts_from_mindies_sample_config_and_serves(
    demo_model: Path, redis_url: str, tmp_path: Path
) -> None:
    data = json.loads(SAMPLE.read_text())
    model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert model["worldSize"] == 4 and data["BackendConfig"]["npuDeviceIds"] == [[0, 1, 2, 3]]
    model.update({"modelName": "llama_65b", "modelWeightPath": str(four_way(demo_model, tmp_path / "llama_65b"))})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    env = localstack.environment(
        TOKENLINE_CONFIG=str(config), REDIS_URL=redis_url, TOKENLINE_DEVICE="cpu", TOKENLINE_NPU_MEM_SIZE="0.25"
    )
    port = localstack.free_port()
    worker = localstack.start_worker(env, log=tmp_path / "worker.log")
    api = localstack.start_api(env, port, log=tmp_path / "api.log")
    try:
        localstack.wait_for_api(port, api)
        localstack.wait_for(lambda: localstack.worker_count(redis_url, "llama_65b") > 0, 60, "the worker")
        body = {"model": "llama_65b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        localstack.stop(api, worker)
    worker_log = (tmp_path / "worker.log").read_text()
    assert "config keys tokenline does not use: Version, LogConfig.logFileSize" in worker_log
    assert "serving model=llama_65b queue=tokenline.llama_65b device=cpu (rank 0 of 4, tensor parallel)" in worker_log
    assert worker_log.count("left the device group") == 3  # ranks 1-3 left when rank 0 stopped
    assert "of the device group exited" not in worker_log and "ERROR" not in worker_log
    assert worker_log.count("config keys tokenline does not use") == 1


def test_make_run_with_a_mindie_config_serves_its_model_as_its_tensor_parallel_group(
    demo_model: Path, tmp_path: Path
) -> None:
    """`TOKENLINE_CONFIG=config.json make run`: the model that ModelConfig names (not the demo model),
    as the group of two ranks that its worldSize 2 and npuDeviceIds [[0, 1]] ask for, on the port of its
    ServerConfig (PORT unset)."""
    from tests.test_supervisor import start
    from tests.test_tensor_parallel import followers_of

    data = json.loads(SAMPLE.read_text())
    port = data["ServerConfig"]["port"] = localstack.free_port()
    data["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model.update({"modelName": "llama_65b", "modelWeightPath": str(demo_model), "worldSize": 2})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    stack = start(
        [sys.executable, "scripts/run_local.py"],
        None,
        tmp_path,
        config_port=port,
        TOKENLINE_CONFIG=str(config),
        TOKENLINE_NPU_MEM_SIZE="0.25",
    )
    try:
        models = requests.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["llama_65b"]
        body = {"model": "llama_65b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = requests.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert len(followers_of(stack.pids()["worker"])) == 1  # rank 1, rank 0's child
    finally:
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(60) == 0
    assert "serving 'llama_65b' at" in stack.output.read_text()


def test_make_run_serves_every_model_of_the_config_on_a_host_without_an_accelerator(
    demo_model: Path, tmp_path: Path
) -> None:
    """Two models and npuDeviceIds' default of one device: on a CPU host the workers would each wait
    for a lease of device 0 (the second forever); `make run` serves both on the CPU instead."""
    from tests.test_supervisor import start

    models = [{"modelName": name, "modelWeightPath": str(demo_model)} for name in ("first", "second")]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"ModelConfig": models}))
    stack = start(
        [sys.executable, "scripts/run_local.py"], None, tmp_path, TOKENLINE_CONFIG=str(config),
        TOKENLINE_NPU_MEM_SIZE="0.25",
    )  # fmt: skip
    try:
        assert "the workers run on the CPU" in stack.output.read_text()
        for name in ("first", "second"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            response = requests.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
            assert response.status_code == 200 and response.json()["model"] == name, response.text
    finally:
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(60) == 0


def test_models_that_need_more_devices_than_npu_device_ids_name_stop_the_start_where_there_are_some() -> None:
    from schemas.config import ModelConfig, Settings
    from scripts.run_local import devices_for

    def settings(**values: object) -> Settings:
        models = tuple(ModelConfig(name, Path("/m")) for name in ("a", "b"))
        return Settings(models=models, **values)  # type: ignore[arg-type]

    assert devices_for(settings(accelerator="npu", npu_device_ids=(0, 1))) == ({}, None)
    assert devices_for(settings(accelerator="cpu")) == ({"TOKENLINE_DEVICE": "cpu"}, None)
    assert devices_for(settings(accelerator="cpu", device="cpu")) == ({}, None)
    environment, reason = devices_for(settings(accelerator="npu"))
    assert environment == {} and reason == (
        "the models need 2 devices and npuDeviceIds names 1: give each model its own (MindIE: one group per "
        "model), or set TOKENLINE_DEVICE"
    )
