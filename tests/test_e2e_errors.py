"""Bad input through the real stack: 4xx with OpenAI's envelope naming the field; nothing queued."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import openai
import pytest
import requests

from tests import raw_http

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_OK = {"model": "demo", "messages": MESSAGES, "max_tokens": 2}
GENERATE_OK = {"prompt": "hi", "max_tokens": 2}


def post(stack, path: str, body=None, data=None):  # type: ignore[no-untyped-def]
    headers = {"Content-Type": "application/json"} if data is not None else None
    return requests.post(f"{stack.base_url}{path}", json=body, data=data, headers=headers, timeout=30)


def assert_error(response: requests.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    return error


UNANSWERED = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": "_demo"}, "model"),
        ({"model": "demo-"}, "model"),
        ({"model": "a" * 257}, "model"),
        ({"model": "demo\n"}, "model"),  # `$` matches before a final newline; the patterns end with \Z
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x" * (512 * 1024 + 1)}]}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 257}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"seed": 0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"n": 5}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        # The grammar ends the output where it is complete: it cannot go on to max_tokens.
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
        # Token ids are ASCII digits: "²" and "１" pass str.isdigit() (the first was a 500, the second token 1).
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"１": 5}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"logit_bias": {"12": 100, "012": 100}}, "logit_bias"),  # one token: two biases would add up past 100
        # Tool names as OpenAI takes them: no spaces, at most 64 characters (an MCP tool's long name).
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "mcp__files__" + "x" * 60}}]}, "tools[0].function.name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a.b"}}},
            "response_format.json_schema.name",
        ),
        # OpenAI's: each call answered by a tool message right after it, each tool message by a call.
        (
            {"messages": [{"role": "user", "content": "hi"}, UNANSWERED, {"role": "user", "content": "?"}]},
            "messages[1].tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
            "messages[1].tool_call_id",
        ),
    ],
)
def test_chat_rule_violation_is_400_naming_the_field(stack, change: dict, param: str) -> None:
    error = assert_error(post(stack, "/v1/chat/completions", {**CHAT_OK, **change}), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.01}, "repetition_penalty"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 4096}, "top_k"),
        ({"min_tokens": 3}, "min_tokens"),  # above GENERATE_OK's max_tokens
        ({"top_p": 0.0}, "top_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_generate_rule_violation_is_400_naming_the_field(stack, change: dict, param: str) -> None:
    assert_error(post(stack, "/generate", {**GENERATE_OK, **change}), 400, param)


def test_an_unknown_field_is_a_400_naming_it_and_known_extras_are_accepted(stack) -> None:
    assert post(stack, "/v1/chat/completions", {**CHAT_OK, "user": "u1", "logit_bias": {}}).status_code == 200
    body = assert_error(post(stack, "/v1/chat/completions", {**CHAT_OK, "foo": 1}), 400, "foo")
    assert body["message"] == "Unrecognized request argument supplied: foo"
    assert_error(post(stack, "/v1/chat/completions", {**CHAT_OK, "web_search_options": {}}), 400, "web_search_options")
    assert_error(post(stack, "/generate", {**GENERATE_OK, "foo": 1}), 400, "foo")


def test_sdk_raises_bad_request_with_param(openai_client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="demo", messages=MESSAGES, temperature=3)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "temperature"


def test_sdk_raises_not_found_for_unknown_model(openai_client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["param"] == "model"
    assert caught.value.body["code"] == "model_not_found"


def test_prompt_over_the_context_limit_is_context_length_exceeded(stack) -> None:
    long_prompt = " ".join(["token"] * 2100)  # the limit: min(maxSeqLen - maxIterTimes, 2048 positions)
    error = assert_error(post(stack, "/generate", {"prompt": long_prompt}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    body = {**CHAT_OK, "messages": [{"role": "user", "content": long_prompt}]}
    error = assert_error(post(stack, "/v1/chat/completions", body), 400, "messages")
    assert error["code"] == "context_length_exceeded"


def test_a_max_completion_tokens_past_the_context_is_named_as_sent(stack) -> None:
    """The check ran on the max_tokens it was copied into, and named a field the client never sent."""
    context = requests.get(f"{stack.base_url}/v1/models/demo", timeout=10).json()["max_model_len"]
    messages = [{"role": "user", "content": " ".join(["token"] * (context - 200))}]
    fits = post(stack, "/v1/chat/completions", {**CHAT_OK, "messages": messages, "max_completion_tokens": 1})
    assert fits.status_code == 200, fits.text
    over = context - fits.json()["usage"]["prompt_tokens"] + 1
    body = {"model": "demo", "messages": messages, "max_completion_tokens": over, "min_tokens": over + 1}
    error = assert_error(post(stack, "/v1/chat/completions", body), 400, "max_completion_tokens")
    assert error["code"] == "context_length_exceeded"
    assert error["message"].endswith("Please reduce the length of the prompt or max_completion_tokens.")
    body = {**body, "max_completion_tokens": over - 1}
    error = assert_error(post(stack, "/v1/chat/completions", body), 400, "min_tokens")
    assert error["message"] == f"min_tokens: Must be at most max_completion_tokens ({over - 1})."


HUGE_REPEAT = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["a"]}


def test_a_schema_the_grammar_engine_fails_on_mid_output_is_a_400_naming_it_in_each_api(stack) -> None:
    """The schema compiles and its grammar fails at the first token drawn (llguidance builds a
    pattern's lexer lazily): the worker's error names no field, the API names the one that held it."""
    response_format = {"type": "json_schema", "json_schema": {"name": "huge", "schema": HUGE_REPEAT}}
    error = assert_error(
        post(stack, "/v1/chat/completions", {**CHAT_OK, "response_format": response_format}),
        400,
        "response_format.json_schema.schema",
    )
    assert (error["type"], error["code"]) == ("invalid_request_error", "constraint_failed")
    assert error["message"].startswith("The output constraint could not be followed: lexer error: too many expressions")
    streamed = post(stack, "/v1/chat/completions", {**CHAT_OK, "response_format": response_format, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert streamed.status_code == 200 and events[-1]["error"] == error

    tool = {"name": "fill", "input_schema": HUGE_REPEAT}
    body = {**CHAT_OK, "tools": [tool], "tool_choice": {"type": "tool", "name": "fill"}}
    refused = post(stack, "/v1/messages", body)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    assert refused.json()["error"]["message"].startswith("tools[0].input_schema: The output constraint could not")

    text = {"format": {"type": "json_schema", "name": "huge", "schema": HUGE_REPEAT}}
    failed = post(stack, "/v1/responses", {"model": "demo", "input": "hi", "text": text, "store": False})
    assert failed.status_code == 400, failed.text
    assert failed.json()["error"]["param"] == "text.format.schema"


@pytest.mark.parametrize("data", [b"{", b"[1, 2]", b'{"prompt": NaN}', b'{"prompt": "x", "top_p": Infinity}', b"\xff"])
def test_malformed_json_is_400(stack, data: bytes) -> None:
    assert_error(post(stack, "/generate", data=data), 400, None)


def test_oversized_body_is_413_json(stack) -> None:
    response = post(stack, "/generate", data=b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    assert_error(response, 413, None)


def chunked(body: bytes) -> Iterator[bytes]:
    """The body in pieces: sent with Transfer-Encoding: chunked, no Content-Length."""
    for start in range(0, len(body), 64 * 1024):
        yield body[start : start + 64 * 1024]


def test_a_chunked_body_over_the_limit_is_413_not_cut_short(stack) -> None:  # type: ignore[no-untyped-def]
    body = b'{"prompt": "hi", "max_tokens": 1}'
    over = body + b" " * (6 * 1024 * 1024)  # valid JSON in its first 4 MiB: cut there, it was answered 200
    assert_error(post(stack, "/generate", data=chunked(over)), 413, None)
    assert post(stack, "/generate", data=chunked(body + b" " * 1024)).status_code == 200


@pytest.mark.parametrize("framing", [b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n"])
def test_a_body_whose_chunks_are_malformed_is_400(stack, framing: bytes) -> None:  # type: ignore[no-untyped-def]
    """A chunk size that is not hexadecimal, a chunk without its CRLF: the body cannot be read (a 500)."""
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    status, _, rest = raw_http.exchange(int(stack.base_url.rsplit(":", 1)[1]), head + framing)
    assert status == 400, rest
    assert b'"type":"invalid_request_error"' in rest.replace(b" ", b"") and b"could not be read" in rest


@pytest.mark.parametrize(
    ("request_head", "status", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400, "bad_request"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "bad_request"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-\x01: 1\r\n\r\n", 400, "bad_request"),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431, None),
        (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "bad_request"),
    ],
)
def test_what_gunicorn_cannot_parse_is_answered_in_the_envelope(  # type: ignore[no-untyped-def]
    stack, request_head: bytes, status: int, code: str | None
) -> None:
    """Requests that never reach the app (no nginx in front, as under `make run`): gunicorn's own
    refusals, in OpenAI's error envelope rather than its HTML page (deploy/gunicorn.conf.py)."""
    answered, headers, body = raw_http.exchange(int(stack.base_url.rsplit(":", 1)[1]), request_head)
    assert answered == status, body
    assert headers["Content-Type"] == "application/json" and int(headers["Content-Length"]) == len(body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == (code or "request_header_fields_too_large")


@pytest.mark.parametrize("coding", ["gzip", "br"])
def test_a_compressed_body_is_415_naming_its_coding(stack, coding: str) -> None:  # type: ignore[no-untyped-def]
    body = gzip.compress(json.dumps(GENERATE_OK).encode()) if coding == "gzip" else json.dumps(GENERATE_OK)
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    response = requests.post(f"{stack.base_url}/generate", data=body, headers=headers, timeout=30)
    error = assert_error(response, 415, None)
    assert error["code"] == "unsupported_media_type" and f"Content-Encoding {coding}" in error["message"]


def test_unknown_route_and_wrong_method_use_the_envelope(stack) -> None:
    assert_error(requests.get(f"{stack.base_url}/v1/nothing", timeout=10), 404, None)
    wrong_method = requests.get(f"{stack.base_url}/generate", timeout=10)
    assert_error(wrong_method, 405, None)
    assert set(wrong_method.headers["Allow"].split(", ")) == {"POST", "OPTIONS"}


def test_health_reports_redis_and_workers(stack) -> None:
    body = requests.get(f"{stack.base_url}/health", timeout=10).json()
    assert body == {"status": "ok", "redis": "ok", "workers": {"demo": 1}}


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_a_body_not_sent_as_json_is_415(stack, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps(CHAT_OK).encode()
    response = requests.post(f"{stack.base_url}/v1/chat/completions", data=body, headers=headers, timeout=30)
    assert assert_error(response, 415, None)["code"] == "unsupported_media_type"


def test_json_with_a_charset_parameter_is_accepted(stack) -> None:
    headers = {"Content-Type": "application/json; charset=utf-8"}
    response = requests.post(f"{stack.base_url}/generate", data=json.dumps(GENERATE_OK), headers=headers, timeout=30)
    assert response.status_code == 200


def test_a_lone_surrogate_is_a_400_naming_the_field(stack) -> None:
    raw = '{"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    error = assert_error(post(stack, "/v1/chat/completions", data=raw.encode()), 400, "messages[0].content")
    assert "surrogate" in error["message"]
    paired = '{"prompt": "\\ud83d\\ude00", "max_tokens": 2}'  # a proper pair is a character
    assert post(stack, "/generate", data=paired.encode()).status_code == 200


def test_json_nested_1000_deep_is_a_400(stack) -> None:
    raw = '{"prompt": "hi", "x": ' + "[" * 1000 + "]" * 1000 + "}"
    assert "nested too deeply" in assert_error(post(stack, "/generate", data=raw.encode()), 400, None)["message"]
