"""Tool calls and reasoning parsed from what a model writes, through gunicorn and the official SDK.

The worker here is scripted at the job contract (schemas/job.py, a pure seam): the test takes the
request's RQ job from the real queue and answers on its reply channel with the text a Qwen-style
model writes — a `<think>` block and a `<tool_call>`. Everything from the SDK to Redis is real; the
API detects both formats from the model's chat template.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from openai import OpenAI
from rq import Queue
from rq.serializers import JSONSerializer
from tokenizers import Tokenizer

from schemas.job import Event, JobPayload, Usage, encode_events
from schemas.keys import live_workers_key, queue_name
from scripts import localstack

MODEL = "scripted"
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


@pytest.fixture(scope="module")
def scripted_api(
    stack_env: dict[str, str], demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("scripted")
    model = directory / MODEL
    shutil.copytree(demo_model, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    env = {**stack_env, "MODEL_PATH": str(model), "MODEL_NAME": MODEL}
    with localstack.running_api(env, directory / "api.log") as url:
        yield url


class ScriptedWorker:
    """Answers the next job of the model's queue with `pieces` of text, one token event each."""

    def __init__(self, redis_url: str, pieces: list[str], finish: str = "stop") -> None:
        self.connection = redis.Redis.from_url(redis_url)
        self.pieces, self.finish = pieces, finish
        seconds, micros = self.connection.time()
        self.connection.zadd(live_workers_key(MODEL), {"scripted.1": seconds * 1000 + micros // 1000})
        self.payloads: list[JobPayload] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        queue = Queue(queue_name(MODEL), connection=self.connection, serializer=JSONSerializer)
        job, _ = Queue.dequeue_any([queue], timeout=30, connection=self.connection, serializer=JSONSerializer)
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


def test_streamed_auto_tool_call_arrives_as_one_tool_calls_delta(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, ["Let me check. ", CALL[:12], CALL[12:40], CALL[40:]])
    stream = client(scripted_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    worker.join()
    assert content == "Let me check. " and finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_choice_none_leaves_the_text_alone(scripted_api: str, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, [CALL])
    completion = client(scripted_api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none"
    )
    worker.join()
    assert completion.choices[0].message.content == CALL and completion.choices[0].finish_reason == "stop"
    assert not completion.choices[0].message.tool_calls
