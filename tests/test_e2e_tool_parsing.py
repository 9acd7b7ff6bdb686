"""Tool calls and reasoning parsed from what a model writes, through gunicorn and the official SDK.

The worker here is scripted at the job contract (schemas/job.py, a pure seam): the test takes the
request's RQ job from the real queue and answers on its reply channel with the text a model writes —
a Qwen-style `<think>` block and `<tool_call>`, or Mistral's `[TOOL_CALLS]` under Mistral-Nemo's real
chat template. Everything from the SDK to Redis is real; the API detects the formats from the
model's chat template.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from openai import BadRequestError, OpenAI
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.serializers import JSONSerializer
from tokenizers import Tokenizer

from schemas.job import Event, JobPayload, Usage, encode_events
from schemas.keys import live_workers_key, queue_name
from scripts import localstack, real_models
from workers.engine.grammar import GrammarCompiler

MODEL, MISTRAL = "scripted", "mistral"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call a tool inside "
    "<tool_call></tool_call>; think inside <think></think>.{% endif %}<|im_start|>assistant\n"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def api_serving(
    name: str, template: str, stack_env: dict[str, str], demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """An API serving the demo model as `name`, with `template` as its chat template."""
    directory = tmp_path_factory.mktemp(name)
    model = directory / name
    shutil.copytree(demo_model, model)
    (model / "chat_template.jinja").write_text(template)
    env = {**stack_env, "MODEL_PATH": str(model), "MODEL_NAME": name}
    with localstack.running_api(env, directory / "api.log") as url:
        yield url
        gc.collect()  # the SDK clients the tests dropped close their idle connections, which hold the API's stop


@pytest.fixture(scope="module")
def scripted_api(
    stack_env: dict[str, str], demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from api_serving(MODEL, TEMPLATE, stack_env, demo_model, tmp_path_factory)


@pytest.fixture(scope="module")
def mistral_api(stack_env: dict[str, str], demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = (real_models.chat_templates() / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    yield from api_serving(MISTRAL, template, stack_env, demo_model, tmp_path_factory)


class ScriptedWorker:
    """Answers the next job of the model's queue with `pieces` of text, one token event each. Until
    then it keeps a live worker's heartbeat, as a worker process does (the API refuses a request for a
    model whose workers' heartbeats are older than WORKER_HEARTBEAT_TTL)."""

    def __init__(self, redis_url: str, pieces: list[str], finish: str = "stop", model: str = MODEL) -> None:
        self.connection = redis.Redis.from_url(redis_url)
        self.pieces, self.finish, self.model = pieces, finish, model
        self._beat()
        self.payloads: list[JobPayload] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        seconds, micros = self.connection.time()
        self.connection.zadd(live_workers_key(self.model), {"scripted.1": seconds * 1000 + micros // 1000})

    def _serve(self) -> None:
        queue = Queue(queue_name(self.model), connection=self.connection, serializer=JSONSerializer)
        deadline = time.monotonic() + 30
        while True:
            self._beat()  # each second: well within the heartbeat's TTL
            try:
                job, _ = Queue.dequeue_any([queue], timeout=1, connection=self.connection, serializer=JSONSerializer)
                break
            except DequeueTimeout:
                assert time.monotonic() < deadline, "no job came within 30 s"
        payload = JobPayload.from_dict(job.args[0])
        self.payloads.append(payload)
        rid = payload.request_id
        events = [Event(rid, i, "token", text=piece) for i, piece in enumerate(self.pieces)]
        usage = Usage(len(payload.prompt_token_ids), len(self.pieces))
        events.append(Event(rid, len(events), "done", finish_reason=self.finish, usage=usage))
        for event in events:  # one message per step, as a worker publishes
            self.connection.publish(payload.reply_channel, encode_events([event]))

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.connection.close()


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_auto_tool_call_with_reasoning_is_parsed(scripted_api: str, redis_url: str, demo_model: Path) -> None:
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", CALL[:30], CALL[30:]])
    completion = client(scripted_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER]
    )
    worker.join()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "The user wants weather."  # type: ignore[attr-defined]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    prompt = Tokenizer.from_file(str(demo_model / "tokenizer.json")).decode(list(worker.payloads[0].prompt_token_ids))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in prompt  # the tools reached the template


def test_a_streamed_auto_tool_call_arrives_as_its_name_then_its_arguments_as_written(
    scripted_api: str, redis_url: str
) -> None:
    worker = ScriptedWorker(redis_url, ["Let me check. ", CALL[:12], CALL[12:40], CALL[40:62], CALL[62:]])
    stream = client(scripted_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True
    )
    content, deltas, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    worker.join()
    assert content == "Let me check. " and finish == "tool_calls"
    first, *rest = deltas
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert re.fullmatch(r"call_[0-9a-f]{24}", first.id)
    assert [(d.index, d.id, d.function.name) for d in rest] == [(0, None, None)] * len(rest)
    pieces = [d.function.arguments for d in deltas]
    assert len([p for p in pieces if p]) == 2 and "".join(pieces) == '{"city": "Paris"}'


def test_tool_choice_none_leaves_the_text_alone(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, [CALL])
    completion = client(scripted_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none"
    )
    worker.join()
    assert completion.choices[0].message.content == CALL and completion.choices[0].finish_reason == "stop"
    assert not completion.choices[0].message.tool_calls


MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def test_a_mistral_agents_second_turn_renders_with_the_ids_it_was_given(
    mistral_api: str, redis_url: str, demo_model: Path
) -> None:
    sdk = client(mistral_api)
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    worker = ScriptedWorker(redis_url, [MISTRAL_CALL], model=MISTRAL)
    first = sdk.chat.completions.create(model=MISTRAL, messages=messages, tools=[WEATHER])
    worker.join()
    (call,) = first.choices[0].message.tool_calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    worker = ScriptedWorker(redis_url, ["It is 18 C."], model=MISTRAL)
    second = sdk.chat.completions.create(model=MISTRAL, messages=messages, tools=[WEATHER])
    worker.join()
    assert second.choices[0].message.content == "It is 18 C."
    prompt = Tokenizer.from_file(str(demo_model / "tokenizer.json")).decode(list(worker.payloads[0].prompt_token_ids))
    assert f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{call.id}"}}]' in prompt
    assert f'[TOOL_RESULTS]{{"content": 18 C, "call_id": "{call.id}"}}[/TOOL_RESULTS]' in prompt


def test_a_grammar_of_a_model_that_reasons_starts_after_its_reasoning(
    scripted_api: str, redis_url: str, demo_model: Path
) -> None:
    """response_format and a forced call on a `<think>` model: the job names the reasoning's tokens,
    so that the worker's grammar starts after it (vLLM's structured outputs with a reasoning parser),
    and the answer parses after the reasoning."""
    sdk, tokenizer = client(scripted_api), Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    worker = ScriptedWorker(redis_url, ["<think>", "Answer in", " JSON.</think>\n\n", '{"a": 1}'])
    completion = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a."}],
        response_format=json_format,  # type: ignore[arg-type]
    )
    worker.join()
    sampling = worker.payloads[0].sampling
    assert sampling.grammar is not None and sampling.thinking_budget is None
    assert tokenizer.decode(list(sampling.thinking_start)) == "<think>"
    assert tokenizer.decode(list(sampling.thinking_end)) == "</think>"
    message = completion.choices[0].message
    assert (message.reasoning_content, message.content) == ("Answer in JSON.", '{"a": 1}')  # type: ignore[attr-defined]
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", '{"city": "Paris"}'])
    forced = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    worker.join()
    assert worker.payloads[0].sampling.thinking_end == sampling.thinking_end
    message = forced.choices[0].message
    assert message.reasoning_content == "The user wants weather." and message.content is None  # type: ignore[attr-defined]
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [  # type: ignore[union-attr]
        ("get_weather", '{"city": "Paris"}')
    ]


def test_a_strict_tool_under_auto_holds_the_calls_to_the_tools_and_leaves_the_text_free(
    scripted_api: str, redis_url: str, demo_model: Path
) -> None:
    """`strict: true` with tool_choice auto (openai-agents sends it by default): the job carries a grammar
    in the model's format (hermes here) that takes any text and holds each call the model begins to one
    of the tools and its schema, after the reasoning; the calls parse as they do unconstrained. Without
    a strict tool there is no grammar, as in vLLM."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    sdk = client(scripted_api)
    worker = ScriptedWorker(redis_url, ["<think>", "Weather.</think>\n\n", "Let me check. ", CALL])
    completion = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[strict]
    )
    worker.join()
    (call,) = completion.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    sampling = worker.payloads[0].sampling
    assert sampling.grammar is not None and sampling.thinking_end  # the grammar starts after the reasoning
    follows = job_follows(sampling.grammar, demo_model)
    assert follows("Let me check. " + CALL) and follows("It is sunny.")
    assert not follows(CALL.replace('"Paris"', "5"))  # an argument against its schema
    assert not follows(CALL.replace("get_weather", "get_time"))  # no such tool
    worker = ScriptedWorker(redis_url, [CALL])
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    worker.join()
    assert worker.payloads[0].sampling.grammar is None


def job_follows(grammar: str, demo_model: Path) -> Callable[[str], bool]:
    """Whether the worker's matcher of a job's `grammar` takes a text (its tokens), then the end."""
    config = json.loads((demo_model / "config.json").read_text())
    compiler = GrammarCompiler(demo_model / "tokenizer.json", config["vocab_size"], [config["eos_token_id"]])
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))

    def follows(text: str) -> bool:
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return all(matcher.consume_token(token) for token in ids) and matcher.consume_token(config["eos_token_id"])

    return follows


def test_a_mistral_models_strict_calls_are_held_in_the_list_its_template_writes(
    mistral_api: str, redis_url: str, demo_model: Path
) -> None:
    """Mistral Nemo's template teaches `[TOOL_CALLS]` and a list of calls: a strict tool's job grammar
    holds them so (the template's form, picked from it), and the text stays free."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    worker = ScriptedWorker(redis_url, [MISTRAL_CALL[:20], MISTRAL_CALL[20:]], model=MISTRAL)
    completion = client(mistral_api).chat.completions.create(
        model=MISTRAL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[strict]
    )
    worker.join()
    (call,) = completion.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    follows = job_follows(worker.payloads[0].sampling.grammar or "", demo_model)
    two = MISTRAL_CALL[:-1] + ', {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert follows(MISTRAL_CALL) and follows(two) and follows("It is sunny.")
    assert not follows(MISTRAL_CALL.replace('"Paris"', "5"))
    assert not follows('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')  # the newer form: not this model's


def test_a_grammar_of_a_model_that_does_not_reason_starts_at_once(mistral_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, ['{"a": 1}'], model=MISTRAL)
    completion = client(mistral_api).chat.completions.create(
        model=MISTRAL, messages=[{"role": "user", "content": "Give a."}], response_format={"type": "json_object"}
    )
    worker.join()
    sampling = worker.payloads[0].sampling
    assert sampling.grammar is not None and (sampling.thinking_start, sampling.thinking_end) == ((), ())
    assert completion.choices[0].message.content == '{"a": 1}'


def test_the_responses_api_streams_reasoning_then_the_parsed_call(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", CALL[:30], CALL[30:]])
    tool = {"type": "function", **WEATHER["function"]}
    events = list(client(scripted_api).responses.create(model=MODEL, input="Weather?", tools=[tool], stream=True))
    worker.join()
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.done")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == ["reasoning", "function_call"]
    reasoning, call = final.output
    assert thought == reasoning.content[0].text == "The user wants weather."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_a_reasoning_summary_asked_for_streams_the_reasoning_as_the_summary(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", "Sunny."])
    sdk = client(scripted_api)
    with sdk.responses.stream(model=MODEL, input="Weather?", reasoning={"summary": "auto"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    worker.join()
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == "The user wants weather."
    assert not [e for e in events if e.type.startswith("response.reasoning_text")]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    reasoning = final.output[0]
    assert reasoning.summary[0].text == summary and not reasoning.content  # type: ignore[union-attr]
    assert final.output_text == "Sunny." and final.reasoning.summary == "auto"  # type: ignore[union-attr]
    with pytest.raises(BadRequestError) as refused:
        sdk.responses.create(model=MODEL, input="Weather?", reasoning={"summary": "concise"})
    assert refused.value.body["param"] == "reasoning.summary"  # type: ignore[index]
    assert "concise" in refused.value.body["message"]  # type: ignore[index]


def test_encrypted_reasoning_goes_back_with_a_tool_loop_that_stores_nothing(scripted_api: str, redis_url: str) -> None:
    """A store: false agent loop (Codex's): include reasoning.encrypted_content, then the output items as
    the SDK gives them, with the call's output, sent back; the reasoning is taken from its sealed text."""
    sdk, tool = client(scripted_api), {"type": "function", **WEATHER["function"]}
    asked = [{"role": "user", "content": "Weather?"}]
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", CALL])
    first = sdk.responses.create(
        model=MODEL, input=asked, tools=[tool], store=False, include=["reasoning.encrypted_content"]
    )
    worker.join()
    reasoning, call = first.output
    assert reasoning.encrypted_content and "weather" not in reasoning.encrypted_content  # type: ignore[union-attr]
    answered = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}  # type: ignore[union-attr]
    worker = ScriptedWorker(redis_url, ["It is 18 C."])
    second = sdk.responses.create(model=MODEL, input=[*asked, *first.output, answered], tools=[tool], store=False)
    worker.join()
    assert second.output_text == "It is 18 C."
    with pytest.raises(BadRequestError) as refused:  # another server's encrypted reasoning
        foreign = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABn-OpenAI"}
        sdk.responses.create(model=MODEL, input=[*asked, foreign, answered], tools=[tool], store=False)
    assert refused.value.body["param"] == "input[1].encrypted_content"  # type: ignore[index]


def codex_turn(scripted_api: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One turn as Codex (codex-rs, wire_api "responses") sends it: every field its ResponsesApiRequest
    serializes, streamed; the events as JSON."""
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }
    body = {
        "model": MODEL,
        "instructions": "You are a coding agent running in a terminal.",
        "input": items,
        "tools": [shell],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-session",
    }
    answer = requests.post(f"{scripted_api}/v1/responses", json=body, stream=True, timeout=30)
    assert answer.status_code == 200, answer.text
    return [json.loads(line[6:]) for line in answer.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def test_a_codex_loop_runs_as_codex_sends_it(scripted_api: str, redis_url: str, demo_model: Path) -> None:
    """Codex's two requests of a tool call: the first as it sends a turn; the second with the output
    items as codex-rs serializes them back (no ids; the reasoning's summary, content and sealed text;
    the call's output a string)."""
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}
    call = '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>'
    worker = ScriptedWorker(redis_url, ["<think>", "Run ls.</think>\n\n", call])
    events = codex_turn(scripted_api, [user])
    worker.join()
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["reasoning", "function_call"]
    reasoning, function_call = done
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Run ls."}] and reasoning["encrypted_content"]
    assert json.loads(function_call["arguments"]) == {"command": ["ls"]}
    kept = {  # what codex-rs serializes of the items it received
        "type": "reasoning",
        "summary": reasoning["summary"],
        "encrypted_content": reasoning["encrypted_content"],
    }
    called = {key: function_call[key] for key in ("type", "name", "arguments", "call_id")}
    output = {"type": "function_call_output", "call_id": function_call["call_id"], "output": "a.py\nb.py"}
    worker = ScriptedWorker(redis_url, ["Two files: a.py and b.py."])
    events = codex_turn(scripted_api, [user, kept, called, output])
    worker.join()
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == "Two files: a.py and b.py."
    prompt = Tokenizer.from_file(str(demo_model / "tokenizer.json")).decode(list(worker.payloads[0].prompt_token_ids))
    assert "\ntool\na.py\nb.py\n" in prompt  # the call's output, a tool message (special tokens decoded away)


def claude_stream(scripted_api: str, content: str, **changes: Any) -> tuple[list[Any], Any]:
    """A Messages request for the weather tool, streamed with the anthropic SDK: its events and message."""
    from anthropic import Anthropic

    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    claude = Anthropic(base_url=scripted_api, api_key="unused", max_retries=0, timeout=30)
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": content}], "tools": [tool]}
    with claude.messages.stream(**body | changes) as stream:
        return list(stream), stream.get_final_message()


def test_the_messages_api_streams_a_thinking_block_then_the_parsed_tool_use(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", CALL[:30], CALL[30:]])
    _, message = claude_stream(scripted_api, "Weather?")
    worker.join()
    thinking, use = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "The user wants weather.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use"


def test_thinking_display_omitted_sends_the_thinking_block_without_its_text(scripted_api: str, redis_url: str) -> None:
    """Anthropic's thinking.display "omitted": the thinking block opens and closes empty, no
    thinking_delta goes out, and the answer is as before."""
    worker = ScriptedWorker(redis_url, ["<think>", "The user wants", " weather.</think>\n\n", CALL[:30], CALL[30:]])
    events, message = claude_stream(scripted_api, "Weather?", thinking={"type": "adaptive", "display": "omitted"})
    worker.join()
    thinking, use = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "")
    assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})


SECOND_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Vienna"}}\n</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_answers_only_the_first_call(
    scripted_api: str, redis_url: str, parallel: bool
) -> None:
    worker = ScriptedWorker(redis_url, [CALL, "\n", SECOND_CALL])
    completion = client(scripted_api).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Paris and Vienna?"}],
        tools=[WEATHER],
        parallel_tool_calls=parallel,
    )
    worker.join()
    choice = completion.choices[0]
    cities = [json.loads(call.function.arguments)["city"] for call in choice.message.tool_calls]
    assert cities == (["Paris", "Vienna"] if parallel else ["Paris"])
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_disable_parallel_tool_use_streams_one_tool_use_block(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, [CALL[:30], CALL[30:], "\n", SECOND_CALL[:20], SECOND_CALL[20:]])
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    events, message = claude_stream(scripted_api, "Paris and Vienna?", tool_choice=choice)
    worker.join()
    (use,) = message.content
    assert (use.type, use.input, message.stop_reason) == ("tool_use", {"city": "Paris"}, "tool_use")
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["tool_use"]


CUT_CALL = ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Pa']  # a stop sequence ended it


def test_a_call_the_output_ends_inside_is_not_answered_as_a_finished_call(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, CUT_CALL)
    completion = client(scripted_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER]
    )
    worker.join()
    choice = completion.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.arguments == '{"city": "Pa' and choice.finish_reason == "stop"

    worker = ScriptedWorker(redis_url, CUT_CALL)
    tool = {"type": "function", **WEATHER["function"]}
    response = client(scripted_api).responses.create(model=MODEL, input="Weather?", tools=[tool])
    worker.join()
    (item,) = response.output
    assert (item.type, item.status, item.arguments) == ("function_call", "incomplete", '{"city": "Pa')


def test_a_follow_up_of_a_background_response_still_queued_is_a_400(scripted_api: str, redis_url: str) -> None:
    connection = redis.Redis.from_url(redis_url)
    seconds, _ = connection.time()  # a worker live for the next hour that takes nothing: the response stays queued
    connection.zadd(live_workers_key(MODEL), {"scripted.idle": (seconds + 3600) * 1000})
    try:
        with client(scripted_api) as sdk:  # closed here: its idle connection would hold the API's stop
            queued = sdk.responses.create(model=MODEL, input="Weather?", background=True)
            assert queued.status == "queued"
            with pytest.raises(BadRequestError) as caught:
                sdk.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=queued.id)
            error = caught.value.body
            assert error["param"] == "previous_response_id" and "still queued" in error["message"]
            assert sdk.responses.cancel(queued.id).status == "cancelled"
    finally:
        connection.zrem(live_workers_key(MODEL), "scripted.idle")
        connection.close()
