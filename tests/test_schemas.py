"""The request schemas, one test per rule of the seed tables (plus the client-compatibility extras)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from schemas import guided
from schemas.chat import ChatCompletionSchema, check_tool_replies
from schemas.completions import CompletionSchema
from schemas.errors import InvalidRequest
from schemas.job import JobPayload
from schemas.requests import MAX_CONTENT_CHARS, GenerateSchema, RequestLimits, load_request
from schemas.sampling import MAX_SEED, SamplingParams
from schemas.tokens import TokenizeSchema
from workers.engine.grammar import GrammarCompiler

LIMITS = RequestLimits(max_iter_times=512, max_n=4)
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


def with_params(request):  # type: ignore[no-untyped-def]
    """The request with its sampling values over SamplingParams' defaults (the service adds the
    model's), so that a test reads the value a field took."""
    return dataclasses.replace(request, sampling=SamplingParams(**{"max_tokens": 512, **request.sampling}))


def chat(**changes):  # type: ignore[no-untyped-def]
    return with_params(load_request(ChatCompletionSchema(LIMITS), {**CHAT, **changes}))


def generate(**changes):  # type: ignore[no-untyped-def]
    return with_params(load_request(GenerateSchema(LIMITS), {"prompt": "hi", **changes}))


def rejects(loader, param: str, **changes) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest) as caught:
        loader(**changes)
    assert caught.value.param == param
    assert caught.value.status == 400


@pytest.mark.parametrize("name", ["gpt-3.5-turbo", "a", "Qwen2.5_7B", "x" * 256])
def test_model_name_accepts_letters_digits_dot_dash_underscore(name: str) -> None:
    assert chat(model=name).model == name


@pytest.mark.parametrize("name", [".a", "a.", "-a", "a-", "_a", "a_", "a b", "模型", "", "x" * 257])
def test_model_name_rejects_bad_edges_characters_and_length(name: str) -> None:
    rejects(chat, "model", model=name)


def test_model_is_required() -> None:
    with pytest.raises(InvalidRequest) as caught:
        load_request(ChatCompletionSchema(LIMITS), {"messages": CHAT["messages"]})
    assert caught.value.param == "model"


def test_messages_must_be_a_non_empty_list() -> None:
    rejects(chat, "messages", messages=[])
    rejects(chat, "messages", messages="hi")


def test_roles_are_system_developer_user_assistant_and_tool() -> None:
    roles = ("system", "developer", "user", "assistant")
    messages = [{"role": r, "content": "x"} for r in roles]
    assert [m.role for m in chat(messages=messages).messages] == list(roles)
    rejects(chat, "messages[1].role", messages=[{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}])
    rejects(
        chat, "messages[1].tool_call_id", messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}]
    )


def test_content_must_be_non_empty() -> None:
    rejects(chat, "messages[0].content", messages=[{"role": "user", "content": ""}])
    rejects(chat, "messages[0].content", messages=[{"role": "user", "content": None}])
    rejects(chat, "messages[0].content", messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}])
    rejects(
        chat, "messages[1].content", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]
    )


def test_a_tools_output_and_the_text_beside_calls_may_be_empty() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": ""},
    ]
    assert [m.content for m in chat(messages=messages).messages] == ["x", "", ""]


def test_allowed_tools_keep_the_tools_they_name_and_their_mode() -> None:
    tools = [{"type": "function", "function": {"name": name}} for name in ("a", "b", "c")]

    def choice(mode: str, *names: str) -> dict:
        named = [{"type": "function", "function": {"name": name}} for name in names]
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": named}}

    request = chat(tools=tools, tool_choice=choice("required", "c", "a"))
    assert [tool.name for tool in request.tools] == ["a", "c"] and request.tool_choice == "required"
    assert chat(tools=tools, tool_choice=choice("auto", "b")).tool_choice == "auto"
    for bad, param in (
        (choice("auto", "d"), "tool_choice.allowed_tools.tools[0]"),
        (choice("none", "a"), "tool_choice.allowed_tools.mode"),
        (choice("auto"), "tool_choice.allowed_tools.tools"),
        ({"type": "allowed_tools", "mode": "auto", "tools": tools}, "tool_choice.allowed_tools"),
    ):
        with pytest.raises(InvalidRequest) as caught:
            chat(tools=tools, tool_choice=bad)
        assert caught.value.param == param, caught.value.message


def test_total_content_is_at_most_512_kib_characters() -> None:
    half = "字" * (MAX_CONTENT_CHARS // 2)
    ok = chat(messages=[{"role": "system", "content": half}, {"role": "user", "content": half}])
    assert sum(len(m.content) for m in ok.messages) == MAX_CONTENT_CHARS
    rejects(chat, "messages", messages=[{"role": "user", "content": half}, {"role": "user", "content": half + "x"}])


def test_content_parts_text_and_body_forms_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "body": "b"}]
    assert chat(messages=[{"role": "user", "content": parts}]).messages[0].content == "a\nb"
    rejects(chat, "messages[0].content[0].type", messages=[{"role": "user", "content": [{"type": "image_url"}]}])


def test_the_provider_forms_message_is_taken_whole() -> None:
    """seeds/unified_chat_interface_notes.txt: the provider's messages carry `version`, `created` and the
    fallback switch `default` (its document says required; its example leaves it out) beside `{type,
    body}` parts. No fallback (0) is what happens; its fallback answer (1) tokenline does not give."""
    message = {"version": "api-v2", "created": 1683944235, "role": "user", "content": [{"type": "text", "body": "hi"}]}
    assert chat(messages=[message]).messages[0].content == "hi"
    assert chat(messages=[{**message, "default": 0}]).messages[0].content == "hi"
    rejects(chat, "messages[0].created", messages=[{**message, "created": "yesterday"}])
    rejects(chat, "messages[0].default", messages=[{**message, "default": 1}])  # the provider's fallback switch


def test_content_parts_are_strict_and_parts_all_empty_are_empty_content() -> None:
    """Parts that were all empty joined into newlines, which passed the non-empty rule; a part's
    unknown key, or both text and body (text won), were taken silently."""
    empty = [{"type": "text", "body": ""}, {"type": "text", "text": ""}]
    rejects(chat, "messages[0].content", messages=[{"role": "user", "content": empty}])
    tool_turn = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": empty},  # a tool's output may be empty
    ]
    assert chat(messages=tool_turn).messages[2].content == ""
    both = [{"type": "text", "text": "a", "body": "b"}]
    rejects(chat, "messages[0].content[0].body", messages=[{"role": "user", "content": both}])
    unknown = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]
    rejects(chat, "messages[0].content[0].cache_control", messages=[{"role": "user", "content": unknown}])


def test_at_most_2048_messages_are_read_and_a_longer_list_is_refused_before_its_items() -> None:
    """100,000 messages under the body limit kept an API process busy for seconds (its other requests
    waited, and its relay took Redis for lost); the length is checked before the items are read."""
    assert len(chat(messages=[{"role": "user", "content": "a"}] * 2048).messages) == 2048
    with pytest.raises(InvalidRequest) as caught:
        chat(messages=[{"role": "bogus"}] * 2049)  # items that would each be an error
    assert caught.value.param == "messages" and caught.value.message == "messages: Length must be between 1 and 2048."


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_too_deeply_is_a_400_naming_it_not_a_500() -> None:
    """The metaschema check hit Python's recursion limit at 93 levels of properties, the grammar at 200:
    a RecursionError, a 500."""
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(93)}}
    rejects(chat, "tools[0].function.parameters", tools=[tool])
    deep_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(200)}}
    rejects(chat, "response_format.json_schema.schema", response_format=deep_format)
    shallow = {"type": "function", "function": {"name": "f", "parameters": nested_schema(40)}}
    assert chat(tools=[shallow]).tools[0].name == "f"


def test_an_integer_bounded_beyond_64_bits_is_a_400_naming_the_schema() -> None:
    """llguidance clamps integer bounds into int64: `minimum: 1e30, maximum: 2e30` became a grammar for
    9223372036854775807 alone, an answer the schema excludes, given with a 200."""
    beyond = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1e30, "maximum": 2e30}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": beyond}}
    rejects(chat, "response_format.json_schema.schema", response_format=response_format)
    with pytest.raises(InvalidRequest) as caught:
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": beyond}}])
    assert caught.value.param == "tools[0].function.parameters"
    assert "minimum 1e+30 of an integer is beyond 64 bits" in caught.value.message
    typed = {"type": "object", "properties": {"n": {"type": ["integer", "null"], "exclusiveMaximum": -(2**64)}}}
    rejects(
        chat,
        "tools[0].function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": typed}}],
    )
    # Bounds within 64 bits are taken, and so are the same keys in a JSON value (a `const`).
    within = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -(2**62), "maximum": 2**62},
            "c": {"const": {"type": "integer", "minimum": 1e30}},
        },
    }
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": within}}).grammar


def test_a_schema_whose_references_only_lead_back_to_themselves_is_a_400() -> None:
    """`{"$ref": "#"}` describes nothing: its grammar wrote an empty answer, a 200 that is not JSON."""
    loops = [{"$ref": "#"}, {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}]
    for schema in loops:
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        rejects(chat, "response_format.json_schema.schema", response_format=response_format)
    parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}}
    rejects(
        chat,
        "tools[0].function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    )
    linked = {"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"}
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": linked}}).grammar


def test_call_arguments_nested_deeper_than_the_parser_goes_are_a_400() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 1500 + "]" * 1500}}
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    rejects(chat, "messages[1].tool_calls[0].function.arguments", messages=turn)


def test_the_content_bound_counts_the_parts_not_the_newlines_that_join_them() -> None:
    half = "a" * (MAX_CONTENT_CHARS // 2)
    parts = [{"type": "text", "text": half}, {"type": "text", "text": half}]
    content = chat(messages=[{"role": "user", "content": parts}]).messages[0].content
    assert len(content) == MAX_CONTENT_CHARS + 1 and copy.deepcopy(content) == content  # a copy is the same text
    parts[1]["text"] += "x"
    rejects(chat, "messages", messages=[{"role": "user", "content": parts}])


def test_max_tokens_is_in_0_exclusive_to_max_iter_times() -> None:
    assert chat(max_tokens=512).sampling.max_tokens == 512
    assert chat(max_tokens=1).sampling.max_tokens == 1
    rejects(chat, "max_tokens", max_tokens=0)
    rejects(chat, "max_tokens", max_tokens=513)


def test_max_tokens_is_left_to_the_service_when_omitted() -> None:
    assert "max_tokens" not in load_request(ChatCompletionSchema(LIMITS), CHAT).sampling
    assert "max_tokens" not in load_request(GenerateSchema(LIMITS), {"prompt": "hi"}).sampling


def test_max_completion_tokens_is_an_alias_of_max_tokens() -> None:
    assert chat(max_completion_tokens=7).sampling.max_tokens == 7
    rejects(chat, "max_completion_tokens", max_completion_tokens=513)


@pytest.mark.parametrize("value", ["5", 5.5, True, None])
def test_integers_are_strict(value: object) -> None:
    if value is None:
        assert chat(max_tokens=None).sampling.max_tokens == 512
    else:
        rejects(chat, "max_tokens", max_tokens=value)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_are_in_minus_2_to_2(field: str) -> None:
    assert getattr(chat(**{field: -2.0}).sampling, field) == -2.0
    assert getattr(chat(**{field: 2}).sampling, field) == 2.0
    assert getattr(chat().sampling, field) == 0.0
    rejects(chat, field, **{field: 2.0001})
    rejects(chat, field, **{field: "1.0"})


def test_repetition_penalty_is_in_0_exclusive_to_2() -> None:
    assert generate(repetition_penalty=2.0).sampling.repetition_penalty == 2.0
    assert generate().sampling.repetition_penalty == 1.0
    rejects(generate, "repetition_penalty", repetition_penalty=0.0)
    rejects(generate, "repetition_penalty", repetition_penalty=2.1)


def test_seed_is_in_1_to_2_pow_64_minus_1_or_null() -> None:
    assert chat(seed=MAX_SEED).sampling.seed == MAX_SEED
    assert chat(seed=None).sampling.seed is None
    rejects(chat, "seed", seed=0)
    rejects(chat, "seed", seed=MAX_SEED + 1)


def test_chat_temperature_is_0_to_2_with_0_greedy() -> None:
    assert chat(temperature=0).sampling.greedy
    assert chat(temperature=2.0).sampling.temperature == 2.0
    assert chat().sampling.temperature == 1.0
    rejects(chat, "temperature", temperature=2.01)
    rejects(chat, "temperature", temperature=-0.01)


def test_generate_temperature_is_at_least_0() -> None:
    assert generate(temperature=0.0).sampling.greedy
    assert generate(temperature=5.0).sampling.temperature == 5.0
    rejects(generate, "temperature", temperature=-0.5)


def test_top_p_is_in_0_exclusive_to_1() -> None:
    assert chat(top_p=1.0).sampling.top_p == 1.0
    rejects(chat, "top_p", top_p=0.0)
    rejects(chat, "top_p", top_p=1.5)


def test_top_k_is_minus_1_or_positive_and_explicit_0_is_rejected() -> None:
    assert generate().sampling.top_k == -1
    assert generate(top_k=-1).sampling.top_k == -1
    assert generate(top_k=10).sampling.top_k == 10
    rejects(generate, "top_k", top_k=0)
    rejects(generate, "top_k", top_k=-5)


def test_stream_is_a_boolean_default_false() -> None:
    assert chat().stream is False
    assert chat(stream=True).stream is True
    rejects(chat, "stream", stream="true")
    rejects(chat, "stream", stream=1)


def test_stop_is_a_string_or_up_to_four_strings() -> None:
    assert chat(stop="x").sampling.stop == ("x",)
    assert chat(stop=["a", "b", "c", "d"]).sampling.stop == ("a", "b", "c", "d")
    rejects(chat, "stop", stop=["a", "b", "c", "d", "e"])
    rejects(chat, "stop", stop=[1])
    rejects(chat, "stop", stop=[""])


def test_stream_options_include_usage_needs_stream() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    rejects(chat, "stream_options", stream_options={"include_usage": True})
    # Options that ask for nothing are what an answer that is not streamed does: taken, as they mean.
    for options in ({}, {"include_usage": False}, {"include_usage": False, "continuous_usage_stats": False}):
        assert chat(stream_options=options).include_usage is False


def test_ignore_eos_is_a_boolean() -> None:
    assert generate(ignore_eos=True).sampling.ignore_eos is True
    rejects(generate, "ignore_eos", ignore_eos="yes")


def test_n_is_bounded_by_the_configured_maximum() -> None:
    assert chat(n=4).n == 4
    rejects(chat, "n", n=5)
    rejects(chat, "n", n=0)


def test_unknown_fields_are_refused_by_name() -> None:
    with pytest.raises(InvalidRequest, match="Unrecognized request argument supplied: frobnicate") as caught:
        chat(frobnicate=1)
    assert caught.value.param == "frobnicate"
    rejects(chat, "messages[0].frob", messages=[{"role": "user", "content": "hi", "frob": 1}])
    rejects(generate, "best_of", best_of=2)


REFUSED_CHAT_FIELDS = [
    "audio",
    "web_search_options",
    "functions",
    "function_call",
    "prediction",
    "verbosity",
    "moderation",
    "prompt_cache_retention",
    "prompt_cache_options",
]


@pytest.mark.parametrize("field", REFUSED_CHAT_FIELDS)
def test_known_openai_fields_that_tokenline_lacks_are_refused_as_unsupported_but_for_null(field: str) -> None:
    """null is "not set", as the SDKs send an optional field (OpenAI takes it); a value is refused."""
    with pytest.raises(InvalidRequest, match="does not support") as caught:
        chat(**{field: {}})
    assert caught.value.param == field
    assert chat(**{field: None}).messages


def test_values_that_ask_for_what_happens_anyway_are_taken() -> None:
    """OpenAI's default verbosity and in-memory prompt cache, a stream without obfuscation, an empty
    suffix: the values the Responses API already took. Anything else is refused, by name."""
    assert chat(verbosity="medium", prompt_cache_retention="in_memory").messages
    rejects(chat, "verbosity", verbosity="low")
    rejects(chat, "prompt_cache_retention", prompt_cache_retention="24h")
    for schema, body in (
        (ChatCompletionSchema(LIMITS), CHAT),
        (CompletionSchema(LIMITS), {"model": "demo", "prompt": "hi"}),
    ):
        assert load_request(schema, {**body, "stream": True, "stream_options": {"include_obfuscation": False}})
        with pytest.raises(InvalidRequest) as caught:
            load_request(schema, {**body, "stream": True, "stream_options": {"include_obfuscation": True}})
        assert caught.value.param == "stream_options.include_obfuscation"
    completion = {"model": "demo", "prompt": "hi"}
    for suffix in (None, ""):
        assert load_request(CompletionSchema(LIMITS), {**completion, "suffix": suffix})
    with pytest.raises(InvalidRequest, match="does not support a suffix") as caught:
        load_request(CompletionSchema(LIMITS), {**completion, "suffix": "x"})
    assert caught.value.param == "suffix"


def test_prompt_is_required_non_empty_and_at_most_512_kib() -> None:
    rejects(generate, "prompt", prompt="")
    rejects(generate, "prompt", prompt="x" * (MAX_CONTENT_CHARS + 1))
    with pytest.raises(InvalidRequest) as caught:
        load_request(GenerateSchema(LIMITS), {})
    assert caught.value.param == "prompt"


def test_a_body_that_is_not_an_object_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        load_request(GenerateSchema(LIMITS), ["prompt"])
    assert caught.value.param is None


def job_payload(**changes: object) -> dict[str, object]:
    return {**JobPayload("r1", "demo", (5, 6, 7), SamplingParams(max_tokens=4), "reply:x").to_dict(), **changes}


def test_a_job_payload_round_trips_with_its_token_ids_as_a_tuple() -> None:
    payload = JobPayload.from_dict(job_payload(prompt_token_ids=list(range(2000))))
    assert payload.prompt_token_ids == tuple(range(2000))
    assert JobPayload.from_dict(payload.to_dict()) == payload


@pytest.mark.parametrize("ids", [[], [1, -2], [1, 2.0], [1, True], [1, "2"], [1, None], "123", 7, {"0": 1}, [[1]]])
def test_a_job_payloads_token_ids_are_a_non_empty_list_of_non_negative_integers(ids: object) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        JobPayload.from_dict(job_payload(prompt_token_ids=ids))


def test_cache_salt_is_carried_to_the_job_and_must_be_a_non_empty_string() -> None:
    assert chat(cache_salt="tenant-a").cache_salt == "tenant-a"
    assert generate(cache_salt="tenant-a").cache_salt == "tenant-a"
    assert chat().cache_salt is None and chat(cache_salt=None).cache_salt is None
    for bad in ("", 5, "x" * 257):
        rejects(chat, "cache_salt", cache_salt=bad)
        rejects(generate, "cache_salt", cache_salt=bad)
    payload = JobPayload("r", "m", (1, 2), SamplingParams(max_tokens=4), "ch", cache_salt="tenant-a")
    assert JobPayload.from_dict(payload.to_dict()) == payload
    assert "cache_salt" not in JobPayload("r", "m", (1, 2), SamplingParams(max_tokens=4), "ch").to_dict()


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL_REPLY = {"role": "tool", "tool_call_id": "c1", "content": "done"}
USER = {"role": "user", "content": "y"}


def test_an_assistant_message_with_tool_calls_may_leave_content_out() -> None:
    answered = {"role": "tool", "tool_call_id": "c1", "content": "done"}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}, answered]
    (_, assistant, _) = chat(messages=messages).messages
    assert (assistant.content, [c.name for c in assistant.tool_calls]) == (None, ["f"])


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        (
            [{"role": "assistant", "tool_calls": [CALL]}],
            "messages[1].tool_calls",
            "Each call must be answered by a tool message after it; not answered: c1.",
        ),
        (
            [{"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "c2"}]}, TOOL_REPLY, USER],
            "messages[1].tool_calls",
            "Each call must be answered by a tool message after it; not answered: c2.",
        ),
        (
            [{"role": "assistant", "tool_calls": [CALL]}, USER, TOOL_REPLY],
            "messages[1].tool_calls",
            "Each call must be answered by a tool message after it; not answered: c1.",
        ),
        ([TOOL_REPLY], "messages[1].tool_call_id", "Answers no tool call of the assistant message before it."),
        (
            [{"role": "assistant", "tool_calls": [CALL]}, TOOL_REPLY, TOOL_REPLY],
            "messages[3].tool_call_id",
            "Answers no tool call of the assistant message before it.",
        ),
    ],
)
def test_each_tool_call_is_answered_by_a_tool_message_right_after_it_as_openai_asks(
    messages: list[dict], param: str, message: str
) -> None:
    """OpenAI's rule, which it refuses with a 400: a call without its tool message, or a tool message
    that answers no call of the assistant message before it (vLLM renders either as it is)."""
    with pytest.raises(InvalidRequest) as caught:
        check_tool_replies(chat(messages=[{"role": "user", "content": "x"}, *messages]).messages)
    assert (caught.value.param, caught.value.message) == (param, f"{param}: {message}")


@pytest.mark.parametrize("content", [None, ""])
def test_an_assistant_message_of_reasoning_alone_may_have_no_content(content: str | None) -> None:
    """A reply cut by max_tokens while it reasoned (reasoning_content, content null), sent back as it
    came; without reasoning such a message is still refused."""
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": content, "reasoning_content": "Let me"},
        {"role": "user", "content": "y"},
    ]
    assistant = chat(messages=messages).messages[1]
    assert (assistant.content, assistant.reasoning_content) == (content, "Let me")
    messages[1] = {"role": "assistant", "content": content}
    rejects(chat, "messages[1].content", messages=messages)


def test_content_is_required_on_any_other_message() -> None:
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.content: Missing data for required field\.") as caught:
        chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant"}])
    assert caught.value.param == "messages[1].content"
    rejects(chat, "messages[0].content", messages=[{"role": "user"}])


def test_store_false_is_honoured_and_store_true_refused() -> None:
    assert chat(store=False).model == "demo"
    with pytest.raises(InvalidRequest, match="store: tokenline stores no completions") as caught:
        chat(store=True)
    assert caught.value.param == "store"


@pytest.mark.parametrize("tier", ["auto", "default", None])
def test_service_tier_auto_and_default_are_what_every_request_gets(tier: str | None) -> None:
    assert chat(service_tier=tier).model == "demo"


@pytest.mark.parametrize("tier", ["flex", "priority", "scale", 1])
def test_other_service_tiers_are_refused(tier: object) -> None:
    rejects(chat, "service_tier", service_tier=tier)


def test_text_modalities_are_honoured_and_audio_refused() -> None:
    assert chat(modalities=["text"]).model == "demo"
    with pytest.raises(InvalidRequest, match="tokenline answers with text only") as caught:
        chat(modalities=["text", "audio"])
    assert caught.value.param == "modalities[1]"
    rejects(chat, "modalities", modalities="text")


def test_metadata_is_accepted_within_openais_limits() -> None:
    assert chat(metadata={f"k{i}": "v" * 512 for i in range(16)}).model == "demo"
    rejects(chat, "metadata", metadata={f"k{i}": "v" for i in range(17)})
    rejects(chat, "metadata", metadata={"k" * 65: "v"})
    rejects(chat, "metadata", metadata={"k": "v" * 513})
    rejects(chat, "metadata", metadata={"k": 1})


def test_safety_identifier_and_prompt_cache_key_are_accepted_strings() -> None:
    assert chat(safety_identifier="user-42", prompt_cache_key="tenant-a:chat").model == "demo"
    rejects(chat, "safety_identifier", safety_identifier="x" * 65)
    rejects(chat, "prompt_cache_key", prompt_cache_key=5)


def test_reasoning_effort_is_a_template_kwarg_under_chat_template_kwargs() -> None:
    assert chat(reasoning_effort="low").template_kwargs == {"reasoning_effort": "low"}
    both = chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high", "x": 1})
    assert both.template_kwargs == {"reasoning_effort": "high", "x": 1}
    rejects(chat, "reasoning_effort", reasoning_effort="extreme")


def test_continuous_usage_stats_is_a_stream_option() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    assert chat(stream=True, stream_options=options).continuous_usage is True
    assert chat(stream=True, stream_options={"include_usage": True}).continuous_usage is False
    rejects(chat, "stream_options.continuous_usage_stats", stream=True, stream_options={"continuous_usage_stats": 1})
    completions = load_request(
        CompletionSchema(LIMITS), {"model": "demo", "prompt": "hi", "stream": True, "stream_options": options}
    )
    assert completions.continuous_usage is True


@pytest.mark.parametrize(
    "parameters", [{"type": "string"}, {"type": "array", "items": {}}, {"type": ["string", "null"]}]
)
def test_a_functions_parameters_describe_an_object(parameters: dict) -> None:
    """A forced call's grammar writes an arguments object: parameters of another type are refused
    (as OpenAI refuses them), naming the field; schemas without a type, or allowing an object, are taken."""
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(InvalidRequest) as caught:
        chat(tools=[tool])
    assert caught.value.param == "tools[0].function.parameters"
    assert "type 'object'" in caught.value.message
    for taken in ({}, {"properties": {}}, {"type": ["object", "null"]}, None):
        tool = {"type": "function", "function": {"name": "f", "parameters": taken}}
        assert chat(tools=[tool], tool_choice="required").tools[0].name == "f"


@pytest.mark.parametrize(
    ("parameters", "said"),
    [
        ({"type": "object", "properties": 5}, "5 is not of type 'object' (at properties)"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "(at properties.a.type)"),
        ({"type": "object", "required": "a"}, "'a' is not of type 'array' (at required)"),
        ({"$ref": "#/nope"}, '$ref "#/nope" points nowhere in the schema'),
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/gone"}}}, '$ref "#/$defs/gone" points nowhere'),
        ({"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}, "fetches no other schema"),
        ({"type": "object", "properties": {"x": {"$id": "urn:x", "items": {"$ref": "#/nope"}}}}, '"#/nope" points'),
    ],
)
def test_a_functions_parameters_must_be_a_valid_json_schema(parameters: dict, said: str) -> None:
    """Checked against the metaschema of its dialect, as OpenAI checks it, whatever tool_choice says: a
    schema that is not one was taken with `auto` and refused only by a forced call's grammar, as `tools`."""
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(InvalidRequest) as caught:
        chat(tools=[tool])
    assert caught.value.param == "tools[0].function.parameters"
    assert "Not a valid JSON schema: " in caught.value.message and said in caught.value.message
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"a": {"$ref": "#/definitions/a"}},
        "definitions": {"a": {"type": "string"}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": draft7}}
    assert chat(tools=[tool]).tools[0].name == "f"


def test_a_forced_call_of_any_tool_keeps_each_tools_references_within_its_own_schema(demo_model: Path) -> None:
    """tool_choice "required" puts each tool's parameters inside an array of calls: pydantic's "#/$defs/…"
    and a recursive "#" pointed at the array's schema (a 400 for every nested pydantic model, and
    arguments that were call lists), not the tool's."""
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    compiler = GrammarCompiler(demo_model / "tokenizer.json", tokenizer.get_vocab_size(), [0])
    pick = {"type": "object", "$defs": {"C": {"enum": ["red", "blue"]}}, "properties": {"c": {"$ref": "#/$defs/C"}}}
    tree = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["name", "child"],
        "additionalProperties": False,
    }
    grammar = guided.required_tools([("pick", {**pick, "required": ["c"]}), ("tree", tree)], parallel=True)

    def accepts(calls: list) -> bool:
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(json.dumps(calls), add_special_tokens=False).ids
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts([{"name": "pick", "parameters": {"c": "red"}}])
    assert not accepts([{"name": "pick", "parameters": {"c": "green"}}])
    assert accepts([{"name": "tree", "parameters": {"name": "a", "child": {"name": "b", "child": None}}}])
    assert not accepts([{"name": "tree", "parameters": {"name": "a", "child": [{"name": "tree", "parameters": {}}]}}])


def test_a_final_message_continued_needs_its_text_and_no_new_assistant_turn() -> None:
    """vLLM's continue_final_message and add_generation_prompt: both true is a 400 (vLLM's, and
    transformers refuses the pair); continuing without saying leaves the assistant turn's opening out."""
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello,"}]
    continued = chat(messages=prefill, continue_final_message=True)
    assert (continued.continue_final, continued.generation_prompt) == (True, False)
    assert (chat().continue_final, chat().generation_prompt) == (False, True)
    assert chat(add_generation_prompt=False).generation_prompt is False
    rejects(chat, "continue_final_message", messages=prefill, continue_final_message=True, add_generation_prompt=True)
    rejects(
        chat,
        "messages[1].content",
        messages=[*prefill[:1], {"role": "assistant", "content": " "}],
        continue_final_message=True,
    )
    tokenize = TokenizeSchema()
    assert load_request(tokenize, {"messages": prefill, "continue_final_message": True})["continue_final_message"]
    for body, param in (
        ({"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
        (
            {"messages": prefill, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
    ):
        with pytest.raises(InvalidRequest) as caught:
            load_request(tokenize, body)
        assert caught.value.param == param


def test_vllms_structured_outputs_take_one_constraint_and_name_what_does_not_compile() -> None:
    for spec, param in (
        ({"choice": ["yes", "no"]}, "structured_outputs.choice"),
        ({"regex": r"\d+"}, "structured_outputs.regex"),
        ({"grammar": 'root ::= "a" | "b"'}, "structured_outputs.grammar"),  # GBNF, as xgrammar reads it
        ({"grammar": 'start: "a" | "b"'}, "structured_outputs.grammar"),  # Lark, as llguidance reads it
        ({"json": {"type": "object"}, "disable_any_whitespace": True}, "structured_outputs.json"),
        ({"json": '{"type": "string"}', "disable_fallback": True}, "structured_outputs.json"),
        ({"json_object": True, "disable_additional_properties": False}, "structured_outputs.json_object"),
    ):
        request = chat(structured_outputs=spec)
        assert request.grammar and request.grammar_param == param
        body = {"model": "demo", "prompt": "hi", "structured_outputs": spec}
        completion = load_request(CompletionSchema(LIMITS), body)
        assert completion.grammar == request.grammar and completion.grammar_param == param
    for spec, param in (
        ({}, "structured_outputs"),
        ({"json_object": False}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"regex": "("}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"json": "{"}, "structured_outputs.json"),
        ({"json": {"type": "integer", "maximum": 2e30}}, "structured_outputs.json"),
        ({"choice": ["a"], "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
        ({"choice": ["a"], "structural_tag": "{}"}, "structured_outputs.structural_tag"),
        ({"choice": ["a"], "disable_additional_properties": True}, "structured_outputs.disable_additional_properties"),
        ({"choice": ["a"], "backend": "xgrammar"}, "structured_outputs.backend"),
    ):
        rejects(chat, param, structured_outputs=spec)
    rejects(chat, "structured_outputs", structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    tool = {"type": "function", "function": {"name": "f"}}
    rejects(chat, "structured_outputs", structured_outputs={"regex": "a"}, tools=[tool], tool_choice="required")


VLLM_DEFAULTS = {  # vLLM's request fields at their defaults, as its clients send them in extra_body
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "priority": 0,
    "bad_words": [],
    "return_token_ids": False,
    "return_tokens_as_token_ids": False,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "logits_processors": None,
    "mm_processor_kwargs": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "request_id": None,
}
VLLM_OTHERWISE = {"use_beam_search": True, "length_penalty": 0.5, "priority": 1}


def test_vllms_fields_at_their_defaults_are_taken_and_other_values_refused_by_name() -> None:
    chat_defaults = {**VLLM_DEFAULTS, "echo": False, "best_of": 1, "documents": None, "chat_template": None}
    generate_defaults = {**VLLM_DEFAULTS, "n": 1, "best_of": 1, "logprobs": None, "structured_outputs": None}
    assert chat(**chat_defaults).messages
    assert load_request(CompletionSchema(LIMITS), {"model": "demo", "prompt": "hi", **VLLM_DEFAULTS})
    assert generate(**generate_defaults).prompt == "hi"
    for field, value in {**VLLM_OTHERWISE, "chat_template": "{{ x }}"}.items():
        with pytest.raises(InvalidRequest, match="does not support") as caught:
            chat(**{field: value})
        assert caught.value.param == field
    for field, value in {
        **VLLM_OTHERWISE,
        "n": 2,
        "logprobs": 1,
        "return_token_ids": True,
        "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }.items():
        with pytest.raises(InvalidRequest, match="does not support") as caught:
            generate(**{field: value})
        assert caught.value.param == field
    # Honoured: add_special_tokens (chat's default false, completions' true).
    assert chat().add_special_tokens is False and chat(add_special_tokens=True).add_special_tokens is True
    completion = {"model": "demo", "prompt": "hi"}
    assert load_request(CompletionSchema(LIMITS), completion).add_special_tokens is True
    assert (
        load_request(CompletionSchema(LIMITS), {**completion, "add_special_tokens": False}).add_special_tokens is False
    )


def test_vllms_allowed_token_ids_bad_words_and_prompt_truncation_are_carried_and_checked() -> None:
    for loader in (chat, generate):
        request = loader(allowed_token_ids=[5, 7], bad_words=["foo", " bar baz"], truncate_prompt_tokens=8)
        assert request.sampling.allowed_token_ids == (5, 7)
        assert request.sampling.bad_words == ["foo", " bar baz"]  # the service tokenizes them
        assert request.truncate_prompt_tokens == 8
        assert loader(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
        for field, value in (
            ("allowed_token_ids", []),
            ("allowed_token_ids", [-1]),
            ("allowed_token_ids", [1.0]),
            ("allowed_token_ids", "5"),
            ("bad_words", "foo"),
            ("bad_words", ["w"] * 65),
            ("truncate_prompt_tokens", 0),
            ("truncate_prompt_tokens", -2),
            ("truncate_prompt_tokens", 1.5),
            ("truncate_prompt_tokens", True),
        ):
            rejects(loader, field, **{field: value})
        for words in ([""], [3], ["w" * 257]):
            rejects(loader, "bad_words[0]", bad_words=words)
    body = {"model": "demo", "prompt": "hi", "truncate_prompt_tokens": 3, "allowed_token_ids": [9]}
    completion = load_request(CompletionSchema(LIMITS), body)
    assert completion.truncate_prompt_tokens == 3 and completion.sampling["allowed_token_ids"] == (9,)
    assert chat(return_token_ids=True).sampling.return_token_ids is True
    assert chat(return_tokens_as_token_ids=True).tokens_as_ids is True
    rejects(chat, "return_token_ids", return_token_ids="yes")
    assert chat(prompt_logprobs=0).sampling.prompt_logprobs == 0
    for value in (-1, 21, 1.0):
        rejects(chat, "prompt_logprobs", prompt_logprobs=value)
    rejects(chat, "prompt_logprobs", prompt_logprobs=2, stream=True)  # as vLLM refuses it
    scored = {**body, "prompt_logprobs": 2, "echo": True}
    assert load_request(CompletionSchema(LIMITS), scored).sampling["prompt_logprobs"] == 2
    with pytest.raises(InvalidRequest) as caught:
        load_request(CompletionSchema(LIMITS), {**scored, "logprobs": 1})  # echo's logprobs score it already
    assert caught.value.param == "prompt_logprobs"
