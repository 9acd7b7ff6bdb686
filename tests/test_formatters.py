"""Formatters fed by scripted events (a pure seam): exact OpenAI and /generate shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from app.completions_format import CompletionLogprobs
from app.generate_format import generate_response, generate_stream
from app.generation import OutputOptions
from app.openai_format import chat_completion, chat_stream
from schemas.errors import ClientGone
from schemas.job import Event
from schemas.vocabulary import Vocabulary
from tests.chat_runs import FakeGeneration, message, parse_sse, scripted, streamed


def test_chat_completion_shape() -> None:
    body = chat_completion(FakeGeneration(), scripted("Hel", "lo"))
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "demo",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_chat_stream_role_deltas_finish_done() -> None:
    chunks = parse_sse(list(chat_stream(FakeGeneration(), scripted("a", "b", finish="stop"), False)))
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "a"},
        {"content": "b"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "stop"]
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[-1] == "[DONE]"


def test_chat_stream_usage_chunk_when_asked() -> None:
    chunks = parse_sse(list(chat_stream(FakeGeneration(), scripted("a"), True)))
    assert chunks[-2] == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "demo",
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert all(c["usage"] is None for c in chunks[:-2])


def test_error_mid_stream_is_an_error_event_then_done() -> None:
    error = {"message": "boom", "type": "server_error", "param": None, "code": "generation_failed"}
    chunks = parse_sse(list(chat_stream(FakeGeneration(), scripted("a", error=error), False)))
    assert chunks[-2] == {"error": error}
    assert chunks[-1] == "[DONE]"


def test_broken_event_source_still_ends_the_stream_cleanly() -> None:
    def broken():  # type: ignore[no-untyped-def]
        yield Event("chatcmpl-1", 0, "token", text="a")
        raise RuntimeError("relay bug")

    chunks = parse_sse(list(chat_stream(FakeGeneration(), broken(), False)))
    assert chunks[-2]["error"]["type"] == "server_error"
    assert chunks[-1] == "[DONE]"


def test_a_stream_whose_client_left_ends_without_writing_more() -> None:
    def leaving():  # type: ignore[no-untyped-def]
        yield Event("chatcmpl-1", 0, "token", text="a")
        raise ClientGone("The client closed the connection.")

    chunks = parse_sse(list(chat_stream(FakeGeneration(), leaving(), False)))
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "a"}]
    assert b"".join(generate_stream(FakeGeneration(), leaving(), "mindie")) == b'{"text":"a"}\0'


def test_generate_mindie_style() -> None:
    assert generate_response(FakeGeneration(), scripted("a", "b"), "mindie") == {"text": "ab"}
    frames = b"".join(generate_stream(FakeGeneration(), scripted("a", "b"), "mindie"))
    assert frames == b'{"text":"a"}\0{"text":"b"}\0'


def test_generate_vllm_style_is_cumulative_with_prompt() -> None:
    assert generate_response(FakeGeneration(), scripted("a", "b"), "vllm") == {"text": ["Hiab"]}
    frames = b"".join(generate_stream(FakeGeneration(), scripted("a", "b"), "vllm"))
    assert frames == b'{"text":["Hia"]}\0{"text":["Hiab"]}\0'


def test_generate_stream_error_frame() -> None:
    error = {"message": "boom", "type": "server_error", "param": None, "code": None}
    frames = b"".join(generate_stream(FakeGeneration(), scripted("a", error=error), "mindie"))
    assert frames.split(b"\0")[:-1] == [b'{"text":"a"}', json.dumps({"error": error}, separators=(",", ":")).encode()]


WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("tools", "pieces"),
    [
        ("hermes", ["I will check. <tool", "_call>\n", WEATHER_CALL[:20], WEATHER_CALL[20:], "\n</tool_call>"]),
        ("llama3_json", [" ", '{"name": "get_weather", ', '"parameters": {"city": "Paris"}}']),
        ("llama3_json", ["<|python_tag|>", '{"name": "get_weather", "parameters": {"city": "Paris"}}']),
        ("mistral", ["[TOOL_CALLS]", "[" + WEATHER_CALL, "]"]),
        ("mistral", ["[TOOL_CALLS]get_weather[ARGS]", '{"city": "Paris"}']),
    ],
)
def test_auto_tool_calls_are_parsed_from_each_models_format(tools: str, pieces: list[str]) -> None:
    generation = FakeGeneration(output=OutputOptions(tools=tools))
    body = chat_completion(generation, scripted(*pieces, finish="stop"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert choice["message"]["content"] == ("I will check. " if tools == "hermes" else None)

    joined = streamed(generation.output, pieces)
    assert joined["content"] == ("I will check. " if tools == "hermes" else None)
    assert [c["function"] for c in joined["tool_calls"]] == [call["function"]]
    assert joined["finish_reason"] == "tool_calls"


def test_text_that_only_looks_like_a_tool_call_stays_content() -> None:
    generation = FakeGeneration(output=OutputOptions(tools="hermes"))
    body = chat_completion(generation, scripted("a <tool", "_call>not json</tool_call>", finish="stop"))
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "a <tool_call>not json</tool_call>",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("thinking", "pieces"),
    [(False, ["<th", "ink>Let me see", ". 2+2.</thi", "nk>\n\n4"]), (True, ["Let me see. 2+2.", "</think>\n\n4"])],
)
def test_reasoning_goes_to_reasoning_content_and_the_answer_to_content(thinking: bool, pieces: list[str]) -> None:
    generation = FakeGeneration(output=OutputOptions(reasoning=True, thinking=thinking))
    message = chat_completion(generation, scripted(*pieces, finish="stop"))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "4", "refusal": None, "reasoning_content": "Let me see. 2+2."}
    chunks = parse_sse(list(chat_stream(generation, scripted(*pieces, finish="stop"), False)))
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1] if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see. 2+2."
    assert "".join(d.get("content", "") for d in deltas) == "4"


def test_a_model_that_does_not_think_answers_in_content() -> None:
    generation = FakeGeneration(output=OutputOptions(reasoning=True))
    message = chat_completion(generation, scripted("Just ", "4", finish="stop"))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Just 4", "refusal": None, "reasoning_content": None}


CALL_PIECES = ['<tool_call>\n{"name": "get_weather", "arguments": ', '{"city": ', '"Paris"}', "}\n</tool_call>"]


def test_a_tool_calls_arguments_stream_as_they_are_written() -> None:
    deltas = streamed(OutputOptions(tools="hermes"), CALL_PIECES)["deltas"]
    call_id = deltas[0]["id"]
    assert deltas == [
        {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 0, "function": {"arguments": '"Paris"}'}},
    ]


@pytest.mark.parametrize(
    ("output", "pieces", "arguments", "finish"),
    [
        (  # the name is known before the output starts: the first piece of arguments comes with it
            OutputOptions(tools="named", tool_name="get_weather"),
            ['{"ci', 'ty": "Pa', 'ris"}'],
            ['{"ci', 'ty": "Pa', 'ris"}'],
            "stop",  # the client named the call: OpenAI and vLLM end it with `stop`
        ),
        (
            OutputOptions(tools="required"),
            ['[{"name": "get_weather", ', '"parameters": {"ci', 'ty": "Pa', 'ris"}}]'],
            ["", '{"ci', 'ty": "Pa', 'ris"}'],
            "tool_calls",
        ),
    ],
)
def test_forced_calls_stream_their_arguments_too(
    output: OutputOptions, pieces: list[str], arguments: list, finish: str
) -> None:
    joined = streamed(output, pieces)
    assert [d["function"]["arguments"] for d in joined["deltas"]] == arguments
    assert joined["deltas"][0]["function"]["name"] == "get_weather"
    whole = message(output, pieces)
    assert [c["function"] for c in joined["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]
    assert whole["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert whole["finish_reason"] == joined["finish_reason"] == finish


@pytest.mark.parametrize(
    ("output", "pieces"),
    [
        (OutputOptions(tools="named", tool_name="get_weather"), ['{"city": "Pa']),
        (OutputOptions(tools="required"), ['[{"name": "get_weather", "parameters": {"city": "Pa']),
        (OutputOptions(tools="hermes"), ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa']),
    ],
)
def test_a_call_cut_by_max_tokens_keeps_its_arguments_so_far_and_finishes_with_length(
    output: OutputOptions, pieces: list[str]
) -> None:
    expected = {"name": "get_weather", "arguments": '{"city": "Pa'}
    whole = message(output, pieces, finish="length")
    assert (whole["content"], [c["function"] for c in whole["tool_calls"]]) == (None, [expected])
    assert whole["finish_reason"] == "length"
    joined = streamed(output, pieces, finish="length")
    assert (joined["content"], [c["function"] for c in joined["tool_calls"]]) == (None, [expected])
    assert joined["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("output", "pieces"),
    [
        (
            OutputOptions(reasoning=True, tools="required"),
            [
                "<think>",
                "Weather, so",
                " a call.</think>\n\n",
                '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
            ],
        ),
        (
            OutputOptions(reasoning=True, thinking=True, tools="named", tool_name="get_weather"),
            ["Weather, so", " a call.</think>", '{"city": "Paris"}'],
        ),
    ],
)
def test_a_forced_call_of_a_model_that_reasons_follows_its_reasoning(output: OutputOptions, pieces: list[str]) -> None:
    """The worker's grammar for a forced call starts after the reasoning: the reasoning is reasoning."""
    for reply in (message(output, pieces), streamed(output, pieces)):
        assert reply["reasoning_content"] == "Weather, so a call." and reply["content"] is None
        assert [c["function"] for c in reply["tool_calls"]] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        ]


def test_a_required_call_cut_before_its_name_is_neither_a_call_nor_content() -> None:
    whole = message(OutputOptions(tools="required"), ['[{"name": "get_wea'], finish="length")
    assert whole == {"role": "assistant", "content": None, "finish_reason": "length"}
    joined = streamed(OutputOptions(tools="required"), ['[{"name": "get_wea'], finish="length")
    assert (joined["content"], joined["tool_calls"], joined["finish_reason"]) == (None, [], "length")


@pytest.mark.parametrize(
    ("output", "pieces"),
    [
        (OutputOptions(reasoning=True), ["<think>Just thinking.", "</think>", "\n\n"]),
        (OutputOptions(tools="hermes"), ["\n\n", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "\n"]),
    ],
)
def test_a_reply_of_only_reasoning_or_only_calls_has_null_content(output: OutputOptions, pieces: list[str]) -> None:
    assert message(output, pieces)["content"] is None
    assert streamed(output, pieces)["content"] is None


def test_a_reply_of_only_whitespace_is_that_whitespace() -> None:
    assert message(OutputOptions(tools="hermes"), ["\n", "\n"])["content"] == "\n\n"
    assert streamed(OutputOptions(tools="hermes"), ["\n", "\n"])["content"] == "\n\n"


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk() -> None:
    generation = FakeGeneration(output=OutputOptions(continuous_usage=True))
    chunks = parse_sse(list(chat_stream(generation, scripted("a", "b", tokens=2), True)))
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [0, 2, 4, 4, 4]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks[:-1])
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["total_tokens"] == 7


def test_continuous_usage_without_include_usage_has_no_closing_usage_chunk() -> None:
    generation = FakeGeneration(output=OutputOptions(continuous_usage=True))
    chunks = parse_sse(list(chat_stream(generation, scripted("a"), False)))
    assert [(c["usage"]["completion_tokens"], len(c["choices"])) for c in chunks[:-1]] == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize(("tools", "opening"), [("required", None), ("named", None), ("hermes", ""), ("none", "")])
def test_a_forced_calls_stream_opens_with_null_content(tools: str, opening: str | None) -> None:
    """A forced call writes no text: its stream's first delta has content null, as its whole message
    does (a client joining the deltas would otherwise end with content ""); a reply that may be text
    opens with ""."""
    output = OutputOptions(tools=tools, tool_name="f" if tools == "named" else None)
    pieces = {"required": ['[{"name": "f", "parameters": {}}]'], "named": ["{}"]}.get(tools, ["hi"])
    chunks = parse_sse(list(chat_stream(FakeGeneration(output=output), scripted(*pieces), False)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": opening}


def test_text_offsets_count_the_characters_a_tokens_predecessors_complete(demo_model: Path) -> None:
    """A token that is a piece of a character (named U+FFFD) moves the offset only once the character is
    whole: the tokens after an emoji split over several byte tokens point at their own text."""
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    prompt = "a 🎉 b é c"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    vocabulary = Vocabulary.of(tokenizer)
    assert any("\ufffd" in vocabulary.text_of(t) for t in ids)  # the emoji is split
    options = OutputOptions(logprobs=True, tokenizer=tokenizer, vocabulary=vocabulary)
    logprobs = CompletionLogprobs(options)
    logprobs.add([None, *([t, -1.0, []] for t in ids[1:])], first_token=ids[0])
    offsets = logprobs.body["text_offset"]
    pieces = [vocabulary.bytes_of(t) for t in ids]
    expected = [len(b"".join(pieces[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert offsets == expected
    after = next(i for i, t in enumerate(ids) if vocabulary.text_of(t).startswith(" b"))
    assert offsets[after] == prompt.index(" b")
