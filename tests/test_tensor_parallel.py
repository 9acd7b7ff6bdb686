"""Tensor parallelism with real processes joined by torch.distributed (gloo on this CPU host): a group
of two ranks gives the same greedy float32 output as one process, token for token, alone and in a
continuous batch, with steps one at a time and overlapped; quantized weights split over the group answer
as their int8 reference computed as the group computes it; each rank's decode step compiled, with the
collectives in its graph, answers as the eager group does; a model that cannot be split is refused at
start-up; a group under `make run`'s supervisor fails its stream within 5 s when a rank dies, and
within its collective timeout when a rank hangs, restarts whole and serves again, and its other ranks
never outlive rank 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
import transformers

from schemas.keys import WORKER_HEARTBEAT_TTL
from scripts import localstack, quantize
from tests.chat_runs import first_token
from tests.engine_runs import ARCHITECTURES, CACHE, MAX_BATCH, MAX_LEN, arrivals, build, prompts, saved, serve
from tests.test_architectures import reference as architecture_reference
from tests.test_supervisor import CHAT, Supervised, alive, start
from tests.tp_rank import row_scales
from workers.engine.core import EngineCore
from workers.models.loader import load_model
from workers.models.parallel import GroupDidNotStart, GroupSpec, NoTensorParallelPlan, check_plan, rendezvous
from workers.models.quant.experts import PerExpert
from workers.models.quant.kernels import CpuInt8

# Every architecture of tests/engine_runs.py that transformers has a tensor-parallel plan for: Llama
# (GQA), Qwen2 (QKV bias, a sliding window smaller than the prompt on one layer), Qwen3 (q/k norm, tied
# embeddings), Mistral (every layer sliding), Gemma 2 (soft-capping) and 3, Mixtral and Qwen2-MoE
# (experts split across the ranks), DeepSeek-V2 (latent attention, its heads split), and Phi-3, whose
# plan gathers its fused QKV projection, and DeepSeek-V3, whose plan leaves its attention whole: every
# rank then keeps every KV head. Value: the KV heads (of the model's 2) in each rank's pool.
WHOLE_ATTENTION = ("phi3", "deepseek_v3")
SPLIT_KV_HEADS = {a: 1 for a in ARCHITECTURES if a not in ("gpt2", *WHOLE_ATTENTION)} | dict.fromkeys(
    WHOLE_ATTENTION, 2
)
REFUSED = "llama-position-bias"  # tests/tp_rank.py: its second layer passes an ALiBi bias to the attention


def run_group(paths: list[Path], world: int, out: Path) -> dict[str, dict]:
    """tests/tp_rank.py as `world` processes, serving each model in turn: for each, rank 0's outputs of
    every run of engine_runs.arrivals(), by the model directory's name (none for a model refused)."""
    models = [str(path) for path in paths]
    ranks = [
        subprocess.Popen([sys.executable, "tests/tp_rank.py", str(r), str(world), str(out), *models])
        for r in range(world)
    ]

    def ended() -> bool:  # all of them, or one that failed (the others would wait for it)
        codes = [rank.poll() for rank in ranks]
        return None not in codes or any(code not in (None, 0) for code in codes)

    try:
        localstack.wait_for(ended, 60 * len(paths), "the ranks to serve every model", interval=0.2)
        assert [rank.poll() for rank in ranks] == [0] * world
    finally:
        for rank in ranks:
            rank.kill()
    return {path.name: json.loads((out / f"{path.name}.json").read_text()) for path in paths if path.name != REFUSED}


@dataclass
class GroupRun:
    outputs: dict[str, tuple[Path, dict]]  # by architecture: its model directory and rank 0's outputs
    out: Path  # where the ranks wrote them
    compiled: tuple[Path, dict]  # COMPILED's directory and outputs


# Served by the group with its decode step compiled (tests/tp_rank.py): a plain Llama, whose
# tensor-parallel layers are transformers' DTensor ones; and Qwen3 with `quantization: int8`, whose
# layers are tokenline's (their all-reduces, the vocabulary-parallel embedding, the gathered logits).
# The Llama group's collectives time out after 5 s, and its rank 1 compiles 6 s more slowly than rank 0.
COMPILED, COMPILED_INT8 = "llama-compiled-slow", "qwen3-int8-compiled"


@pytest.fixture(scope="module")
def group_run(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    """Every architecture served by one group of two rank processes, one model after another, then a
    model that every rank must refuse at its probe forward."""
    models = tmp_path_factory.mktemp("tp-models")
    paths = [build(architecture, models / architecture, demo_model) for architecture in sorted(SPLIT_KV_HEADS)]
    compiled = build("llama", models / COMPILED, demo_model)
    out = tmp_path_factory.mktemp("tp-out")
    outputs = run_group([*paths, compiled, build("llama", models / REFUSED, demo_model)], 2, out)
    return GroupRun({path.name: (path, outputs[path.name]) for path in paths}, out, (compiled, outputs[COMPILED]))


@pytest.fixture(scope="module")
def group_outputs(group_run: GroupRun) -> dict[str, tuple[Path, dict]]:
    return group_run.outputs


@pytest.mark.parametrize("architecture", sorted(SPLIT_KV_HEADS))
def test_two_ranks_give_one_process_greedy_output_token_for_token(
    architecture: str, group_outputs: dict[str, tuple[Path, dict]]
) -> None:
    path, outputs = group_outputs[architecture]
    loaded = load_model(path, torch.device("cpu"))
    runs = arrivals().items()
    expected = {name: serve(EngineCore.build(loaded, MAX_LEN, MAX_BATCH, cache=CACHE), plan) for name, plan in runs}
    got = dict(outputs)
    assert got.pop("kv_heads") == SPLIT_KV_HEADS[architecture]  # of the model's 2, in rank 0's pool
    # Rank 0's own shards (the norms whole on every rank), not the whole model's weights.
    assert loaded.weight_bytes / 2 <= got.pop("weight_bytes") < loaded.weight_bytes
    assert got.pop("quantization") == ""
    (decodes, compiled), follower = got.pop("compiled_steps")  # rank 0's, and rank 1's
    assert decodes > 0 and compiled == 0 and follower == [decodes, 0]  # `compile: off`
    assert set(got.pop("row_scales").values()) == {None}  # float layers
    # Overlapped steps (as on an accelerator): each decode's input goes from rank 0's device to the others.
    assert {k.removeprefix("o-"): v for k, v in got.pop("overlapped").items()} == expected["batch"]
    assert got == expected
    assert set(got) == {"alone-p0", "alone-p1", "alone-p2", "batch"} and all(
        len(ids) == 10 for run in got.values() for ids in run.values()
    )


# Quantized weights split over the group (workers/models/quant/sharded.py):
# - `quantization: int8` on Qwen3: its int8 embedding split by vocabulary and tied to the LM head, whose
#   logits are gathered; the q/k norms whole on each rank; and on Gemma 3 (its scaled embedding in int8);
# - msModelSlim's W8A8_DYNAMIC on Qwen2 (q, k and v split with their biases), on Gemma 2 (its float
#   embedding, scaled, split by vocabulary and tied to the float LM head) and on Phi-3 (its fused QKV
#   and gate-up outputs gathered, o and down taking their part of the whole input);
# - its static W8A8 on Llama (quant_bias on rank 0 alone; down_proj float, split by rows) and W8A16 on
#   Mistral (dequantized on a CPU, split alike);
# - the experts one by one, each rank its part of every expert: `quantization: int8` on Qwen2-MoE
#   (transformers' split fused experts, split again one by one; the shared expert whole on each rank)
#   and W8A8_DYNAMIC on DeepSeek-V3 (its attention whole on each rank); `quantization: int8` on
#   DeepSeek-V2 (its latent attention's heads split, its compressing projection whole on each rank).
# Qwen3's and Qwen2's vocabularies are of 4,097 tokens (2,049 on rank 0, 2,048 on rank 1: the demo
# tokenizer's 4,096 and a padding row), which the embedding and the gathered logits split unevenly.
UNEVEN_VOCABULARY = {"qwen3": 4097, "qwen2": 4097}
QUANTIZED = {
    "qwen3": "int8",
    "qwen2": "w8a8_dynamic",
    "gemma2": "w8a8_dynamic",
    "gemma3": "int8",
    "llama": "w8a8",
    "mistral": "w8a16",
    "phi3": "w8a8_dynamic",
    "qwen2_moe": "int8",
    "deepseek_v3": "w8a8_dynamic",
    "deepseek_v2": "int8",
}
LABELS = {
    "int8": "w8a8_dynamic (load)",
    "w8a8_dynamic": "w8a8_dynamic (msmodelslim)",
    "w8a8": "w8a8 (msmodelslim)",
    "w8a16": "w8a16 (msmodelslim)",
}


@pytest.fixture(scope="module")
def quantized_outputs(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict]]:
    """Each quantized model served by one group of two ranks: its float model's directory, its own, and
    rank 0's outputs."""
    models = tmp_path_factory.mktemp("tp-quantized")
    floats, paths = {}, []
    for architecture, layout in QUANTIZED.items():
        vocabulary = {"vocab_size": UNEVEN_VOCABULARY[architecture]} if architecture in UNEVEN_VOCABULARY else {}
        floats[architecture] = build(architecture, models / architecture, demo_model, **vocabulary)
        if layout == "int8":  # tests/tp_rank.py serves it with `quantization: int8`
            paths.append(build(architecture, models / f"{architecture}-int8", demo_model, **vocabulary))
        else:
            paths.append(quantize.write(floats[architecture], layout, models / f"{architecture}-{layout}"))
    compiled = build("qwen3", models / COMPILED_INT8, demo_model, vocab_size=UNEVEN_VOCABULARY["qwen3"])
    outputs = run_group([*paths, compiled], 2, tmp_path_factory.mktemp("tp-quantized-out"))
    served = {a: (floats[a], path, outputs[path.name]) for a, path in zip(QUANTIZED, paths, strict=True)}
    return served | {COMPILED_INT8: (floats["qwen3"], compiled, outputs[COMPILED_INT8])}


@pytest.mark.parametrize("architecture", QUANTIZED)
def test_two_ranks_serve_quantized_weights_split_by_the_plan_as_its_int8_reference_answers(
    architecture: str, quantized_outputs: dict[str, tuple[Path, Path, dict]]
) -> None:
    """MindIE's W8A8 checkpoints of 70B models are served across several NPUs; quantized weights with a
    worldSize above 1 were refused. Split over two ranks, a quantized model answers as its plain-torch
    reference computed as the group computes it (each row-wise layer's activations quantized per rank,
    the parts summed), token for token, alone, batched and with overlapped steps; each rank holds its
    part of the int8 weights."""
    layout = QUANTIZED[architecture]
    float_model, path, outputs = quantized_outputs[architecture]
    reference = quantize.reference(float_model, layout, world=2)
    expected = {f"p{i}": architecture_reference(reference, prompt) for i, prompt in enumerate(prompts())}
    got = dict(outputs)
    assert got.pop("quantization") == LABELS[layout]
    (decodes, compiled), follower = got.pop("compiled_steps")
    assert decodes > 0 and compiled == 0 and follower == [decodes, 0]
    assert got.pop("kv_heads") == SPLIT_KV_HEADS[architecture]
    whole = load_model(path, torch.device("cpu"), quantization="int8" if layout == "int8" else "")
    assert whole.weight_bytes / 2 <= got.pop("weight_bytes") < whole.weight_bytes
    # A row-wise layer's weight scales (an expert's down projection's too) are its whole rows' (those one
    # process computes), not its part's.
    scales = row_scales(whole.model)
    moe = any(isinstance(module, PerExpert) for module in whole.model.modules())
    assert got.pop("row_scales") == scales and len(scales) == 1 + moe
    overlapped = {k.removeprefix("o-"): v for k, v in got.pop("overlapped").items()}
    assert overlapped == expected
    assert got.pop("batch") == expected
    assert got == {f"alone-p{i}": {f"p{i}": expected[f"p{i}"]} for i in range(len(expected))}


def test_each_rank_compiles_its_decode_step_with_the_groups_collectives_in_it_and_answers_as_one_eager_process(
    group_run: GroupRun,
) -> None:
    """A model split over several devices (a 70B one over eight NPUs) decoded eagerly: ~2,000 kernel
    launches a step on each rank, its collectives between them. With `compile: on` each rank compiles
    its decode step, the all-reduces and gathers of transformers' DTensor layers inside the graph, and
    the group answers as one eager process, token for token; every decode step ran compiled on both
    ranks, the same steps on each (each padded to a bucket of 2 or 4). One rank compiled more slowly
    than the group's collective timeout: the ranks meet once each has compiled, before the graph's
    first collective."""
    path, outputs = group_run.compiled
    got = dict(outputs)
    steps = got.pop("compiled_steps")
    expected = {
        name: serve(EngineCore.build(load_model(path, torch.device("cpu")), MAX_LEN, MAX_BATCH, cache=CACHE), plan)
        for name, plan in arrivals().items()
    }
    assert {k.removeprefix("o-"): v for k, v in got.pop("overlapped").items()} == expected["batch"]
    assert {name: got[name] for name in expected} == expected
    # Each prompt alone decodes 9 steps (its first token comes from its prefill), the batches more.
    (decodes, compiled), follower = steps
    assert decodes == compiled > 9 * 3 and follower == [decodes, compiled]


def test_each_rank_compiles_its_decode_step_over_int8_weights_split_by_the_plan(
    quantized_outputs: dict[str, tuple[Path, Path, dict]],
) -> None:
    """`quantization: int8` over the group, compiled: tokenline's own tensor-parallel layers (the
    all-reduce after each row-wise product, the vocabulary-parallel int8 embedding, the LM head's
    gathered logits) inside each rank's graph, fbgemm's products between its kernels. It answers as the
    same group eager, token for token, every decode step compiled on both ranks."""
    got = dict(quantized_outputs[COMPILED_INT8][2])
    eager = dict(quantized_outputs["qwen3"][2])
    (decodes, compiled), follower = got.pop("compiled_steps")
    assert eager.pop("compiled_steps") == [[decodes, 0]] * 2
    assert got == eager
    assert decodes == compiled > 9 * 3 and follower == [decodes, compiled]


LLAMA4 = {  # a tiny Llama 4 text model: 4 experts, one chosen per token, and a shared expert
    "vocab_size": 4096,
    "hidden_size": 32,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_local_experts": 4,
}


@pytest.mark.parametrize("setting", ["int8", "checkpoint"])
def test_quantized_weights_of_a_plan_that_splits_what_int8_layers_do_not_are_refused_before_the_ranks_start(
    demo_model: Path, tmp_path: Path, setting: str
) -> None:
    """Llama 4's plan splits its experts, which it stores transposed, by `packed_rowwise`, which
    tokenline's int8 layers are not split by: the worker stops with one line, exit code 2, before any
    rank starts (and before Redis is reached)."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**LLAMA4, max_position_embeddings=512, pad_token_id=0)
    float_model = saved(transformers.Llama4ForCausalLM(config), tmp_path / "llama4", demo_model)
    model = float_model if setting == "int8" else quantize.write(float_model, "w8a8_dynamic", tmp_path / "w8a8")
    with pytest.raises(NoTensorParallelPlan, match="the model's tensor-parallel plan splits layers"):
        check_plan(model, 2, quantized=True)
    check_plan(model, 2)  # float weights: transformers splits it
    result = localstack.refused_worker(
        model, TOKENLINE_WORLD_SIZE="2", TOKENLINE_QUANTIZATION="int8" if setting == "int8" else ""
    )
    assert result.returncode == 2, result.stderr
    refused = (
        "quantized weights with worldSize 2: the model's tensor-parallel plan splits "
        "layers.*.feed_forward.experts.gate_up_proj as 'packed_rowwise'"
    )
    assert refused in result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "started ranks" not in result.stdout


def test_every_rank_of_a_group_refuses_a_model_whose_attention_no_backend_computes_at_its_probe(
    group_run: GroupRun,
) -> None:
    """The runner's probe forward runs on every rank at once (their collectives meet there), so a
    group refuses such a model at start-up as one process does, each rank with the reason, and the
    ranks leave the group whole (tp_rank's exit statuses, checked by run_group)."""
    for rank in range(2):
        reason = (group_run.out / f"{REFUSED}.rank{rank}.refused").read_text()
        assert reason == (
            "its attention adds a position bias (ALiBi) (`position_bias`), "
            "which tokenline's attention backends do not compute"
        )


def test_a_model_the_group_cannot_split_is_refused_with_the_reason(demo_model: Path, tmp_path: Path) -> None:
    gpt2 = build("gpt2", tmp_path / "gpt2", demo_model)
    with pytest.raises(NoTensorParallelPlan, match="model type 'gpt2' has no tensor-parallel plan"):
        check_plan(gpt2, 2)
    with pytest.raises(NoTensorParallelPlan, match="worldSize 4 must divide the model's 4 attention heads and 2 KV"):
        check_plan(build("llama", tmp_path / "llama", demo_model), 4)
    check_plan(tmp_path / "llama", 2)
    # The worker says so at start-up, before it loads anything or starts another rank.
    env = localstack.environment(MODEL_PATH=str(gpt2), TOKENLINE_WORLD_SIZE="2", TOKENLINE_DEVICE="cpu")
    env["REDIS_URL"] = "redis://127.0.0.1:1/0"  # not reached: the device is named, nothing is leased
    worker = subprocess.run(
        [sys.executable, "-m", "workers"], cwd=localstack.ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert worker.returncode == 2
    assert "model type 'gpt2' has no tensor-parallel plan in transformers" in worker.stdout + worker.stderr
    assert "started ranks" not in worker.stdout


def test_a_rank_that_arrives_later_than_the_group_timeout_still_joins() -> None:
    """Joining is not bounded by groupTimeout (a rank's imports take longer than a collective may):
    rank 1 arrives 2 s after rank 0, with a 0.5 s groupTimeout, and both get the store."""
    address = f"tcp://127.0.0.1:{localstack.free_port()}"
    waiting = threading.Event()

    def lost() -> None:
        waiting.set()  # rank 0 is at the rendezvous, polling

    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(rendezvous, GroupSpec(0, 2, address, timeout=0.5), lost)
        assert waiting.wait(10)
        arrived_at = time.monotonic() + 2.0
        while time.monotonic() < arrived_at:  # the late rank's imports
            assert not leader.done()
            time.sleep(0.1)
        follower = pool.submit(rendezvous, GroupSpec(1, 2, address, timeout=0.5))
        stores = [leader.result(10), follower.result(10)]
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"
    assert stores[1].timeout.total_seconds() == 0.5  # from now on, the group's own timeout


def test_rank_0_stops_waiting_at_once_when_a_rank_exits_before_the_group_forms() -> None:
    spec = GroupSpec(0, 2, f"tcp://127.0.0.1:{localstack.free_port()}", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(GroupDidNotStart, match="rank 1 exited"):
        rendezvous(spec, lambda: "rank 1 exited (status 1) before the group formed")
    assert time.monotonic() - started < 1


def followers_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a group's ranks 1..N-1 are rank 0's children)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


GROUP_TIMEOUT = WORKER_HEARTBEAT_TTL - 1


def test_a_group_under_make_run_ends_its_stream_when_a_rank_dies_and_comes_back_whole(
    demo_model: Path, tmp_path: Path
) -> None:
    # Below the heartbeat's TTL: the stopped rank's collective times out while rank 0's heartbeat is
    # still fresh, even where a busy machine delays its beats (else the API may call it dead first).
    stack = start_group(demo_model, tmp_path, TOKENLINE_GROUP_TIMEOUT=str(GROUP_TIMEOUT))
    seen: set[int] = set()
    try:
        leader = stack.pids()["worker"]
        (follower,) = followers_of(leader)
        seen |= {leader, follower}
        assert stack.served()
        body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with requests.post(f"{stack.url}/v1/chat/completions", json=body, stream=True, timeout=60) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith(b"data: "))
            first_token(lines)  # the group generates it
            killed_at = time.monotonic()
            os.kill(follower, signal.SIGKILL)
            rest = list(lines)
            ended_after = time.monotonic() - killed_at
        assert rest[-1] == b"data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["message"] == "A device of the worker's group failed; the worker restarts."
        assert ended_after < 5, ended_after
        assert not any(b'"finish_reason":"length"' in line for line in rest)  # cut, and said so

        # The supervisor restarts rank 0, which starts the group again.
        localstack.wait_for(lambda: stack.pids().get("worker", leader) != leader, 15, "a new rank 0")
        localstack.wait_for(stack.served, 60, "service after the group's restart", interval=0.5)
        leader = stack.pids()["worker"]
        (follower,) = followers_of(leader)
        seen |= {leader, follower}
        # A rank that hangs (stopped) mid-stream: rank 0's next collective times out (groupTimeout).
        with requests.post(f"{stack.url}/v1/chat/completions", json=body, stream=True, timeout=60) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith(b"data: "))
            first_token(lines)
            stopped_at = time.monotonic()
            os.kill(follower, signal.SIGSTOP)
            rest = list(lines)
            ended_after = time.monotonic() - stopped_at
        assert json.loads(rest[-2][6:])["error"]["message"] == error["message"]
        assert GROUP_TIMEOUT <= ended_after < GROUP_TIMEOUT + 2, ended_after
        localstack.wait_for(lambda: not alive(follower), 10, "the stopped rank to die with its rank 0")
        localstack.wait_for(lambda: stack.pids().get("worker", leader) != leader, 15, "a new rank 0")
        localstack.wait_for(stack.served, 60, "service after the second restart", interval=0.5)
        leader = stack.pids()["worker"]
        (follower,) = followers_of(leader)
        seen |= {leader, follower}
        # Rank 0 killed: the other ranks die with it (PR_SET_PDEATHSIG), nothing is left behind.
        os.kill(leader, signal.SIGKILL)
        localstack.wait_for(lambda: not alive(follower), 5, "rank 1 to die with rank 0")
        output = stack.output.read_text()
        assert "rank 1 of the device group" in output or "a rank of the device group failed" in output
        assert "worker exited with code 1; restarting" in output
    finally:
        stop(stack, seen)


def start_group(demo_model: Path, tmp_path: Path, **env: str) -> Supervised:
    """`make run` serving the demo model as a group of two CPU ranks, with `env`."""
    return start(
        [sys.executable, "scripts/run_local.py"],
        demo_model,
        tmp_path,
        TOKENLINE_WORLD_SIZE="2",
        TOKENLINE_DEVICE="cpu",
        **env,
    )


def stop(stack: Supervised, seen: set[int]) -> None:
    """The stack stopped as `make run` stops on ^C; then any of its processes (`seen`, and the ones
    it lists now) that outlived it killed."""
    stack.proc.send_signal(signal.SIGTERM)
    try:
        stack.proc.wait(60)
    finally:
        for pid in seen | set(stack.pids().values()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_group_under_make_run_serves_int8_weights_quantized_on_every_rank(demo_model: Path, tmp_path: Path) -> None:
    """`quantization: int8` with worldSize 2 under `make run`: /v1/models names it, each rank quantizes
    its own part (a rank that loaded float shards would meet rank 0's int8 layers in the same
    collectives, and the group would answer otherwise without a word), and the group serves."""
    stack = start_group(demo_model, tmp_path, TOKENLINE_QUANTIZATION="int8")
    try:
        localstack.wait_for(stack.served, 60, "the group to serve", interval=0.5)
        (model,) = requests.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
        assert model["quantization"] == "w8a8_dynamic (load)"
        body = {**CHAT, "max_tokens": 8, "ignore_eos": True}
        response = requests.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        output = stack.output.read_text()
        # The kernel as the ranks name it on this CPU: fbgemm, on 7-bit halves where the CPU has no VNNI.
        ran = f"w8a8_dynamic (load) runs with {CpuInt8().name} int8 products"
        assert output.count(ran) == 2, output[-3000:]
        assert output.count("1/2 of it") == 2  # each rank loaded its part
    finally:
        stop(stack, set())
