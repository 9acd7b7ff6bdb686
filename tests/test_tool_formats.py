"""Each model family's tool-call format: detected from its real chat template (llama.cpp's copies),
and a realistic output parsed into OpenAI's tool calls, whole and streamed in small pieces."""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from app.generation import OutputOptions
from app.parsers import detect_tool_parser
from app.prompt import PromptBuilder
from app.registry import ModelEntry
from app.service import auto_calls
from app.tools import STRICT_CALLS, call_tag
from app.tools.formats import CallTag
from schemas import guided
from schemas.chat import ChatCompletionSchema
from schemas.model_files import ModelFiles
from schemas.requests import RequestLimits, load_request
from scripts import real_models
from tests.chat_runs import message, pieces, streamed
from tests.test_templates import ARGUMENTS, conversation, ours
from workers.engine.grammar import GrammarCompiler

# Phi-4-mini-instruct's template (its tokenizer_config.json); llama.cpp keeps no copy of it.
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] "
    "is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + "
    "'<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
WEATHER = ("get_weather", '{"city": "Paris"}')
TIME = ("get_time", '{"zone": "CET"}')
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"

# (template, format, what the model writes, content, calls)
CASES = [
    (
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "hermes",
        'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "I will check both.\n",
        [WEATHER, TIME],
    ),
    (
        "Qwen3-Coder.jinja",
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [WEATHER],
    ),
    (
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
        None,
        [WEATHER, TIME],
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        None,
        [WEATHER, TIME],
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        None,
        [WEATHER, TIME],
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "deepseek_v3",
        "<｜tool▁calls▁begin｜>"
        + DS_CALL.format("get_weather", '{"city": "Paris"}')
        + "\n"
        + DS_CALL.format("get_time", '{"zone": "CET"}')
        + "<｜tool▁calls▁end｜>",
        None,
        [WEATHER, TIME],
    ),
    (
        "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek_v31",
        "Checking.<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking.",
        [WEATHER, TIME],
    ),
    (
        "moonshotai-Kimi-K2.jinja",
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
        '{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>',
        None,
        [WEATHER, TIME],
    ),
    (
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        "granite",
        '<|tool_call|>[{"arguments": {"city": "Paris"}, "name": "get_weather"}]',
        None,
        [WEATHER],
    ),
    (
        PHI4_MINI,
        "phi4_mini",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>',
        None,
        [WEATHER],
    ),
    (
        "NVIDIA-Nemotron-Nano-v2.jinja",
        "nemotron",
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]</TOOLCALL>',
        None,
        [WEATHER, TIME],
    ),
    (
        "meetkai-functionary-medium-v3.1.jinja",
        "functionary_v31",
        '<function=get_weather>{"city": "Paris"}</function><function=get_time>{"zone": "CET"}</function>',
        None,
        [WEATHER, TIME],
    ),
    (
        "meetkai-functionary-medium-v3.2.jinja",
        "functionary_v32",
        'all\nLet me look.>>>get_weather\n{"city": "Paris"}>>>get_time\n{"zone": "CET"}',
        "Let me look.",
        [WEATHER, TIME],
    ),
    (
        "google-gemma-4-31B-it.jinja",
        "gemma4",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time{zone:<|"|>CET<|"|>}'
        "<tool_call|>",
        None,
        [WEATHER, TIME],
    ),
]
IDS = [case[1] if case[0] == PHI4_MINI else case[0].removesuffix(".jinja") for case in CASES]
PARAMETERS = {"get_weather": {"type": "object", "properties": {"days": {"type": "integer"}}}}

# The rest of the families' templates, and the format each teaches.
DETECTED = {
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen-QwQ-32B.jinja": "hermes",
    "Qwen3.5-4B.jinja": "qwen3_coder",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "ibm-granite-granite-4.0.jinja": "hermes",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3_json",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek_v3",
    "Kimi-K2-Instruct.jinja": "kimi_k2",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "qwen3_coder",
    "google-gemma-4-31B-it-interleaved.jinja": "gemma4",
    "google-gemma-2-2b-it.jinja": "none",
    "microsoft-Phi-3.5-mini-instruct.jinja": "none",
}


@pytest.fixture(scope="session")
def templates() -> Path:
    """llama.cpp's copies of real chat templates (fetched once per machine)."""
    return real_models.chat_templates()


def template_text(templates: Path, template: str) -> str:
    return template if template == PHI4_MINI else (templates / template).read_text()


def output(format: str) -> OutputOptions:
    return OutputOptions(tools=format, parameters=PARAMETERS)


def without_ids(calls: list[dict]) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


@pytest.mark.parametrize(("template", "format", "text", "content", "calls"), CASES, ids=IDS)
def test_the_format_is_detected_from_the_real_template(
    templates: Path, template: str, format: str, text: str, content: str | None, calls: list
) -> None:
    assert detect_tool_parser(template_text(templates, template)) == format


@pytest.mark.parametrize(("template", "format"), DETECTED.items())
def test_each_familys_template_is_detected_as_its_format(templates: Path, template: str, format: str) -> None:
    assert detect_tool_parser((templates / template).read_text()) == format


@pytest.mark.parametrize(("template", "format", "text", "content", "calls"), CASES, ids=IDS)
def test_a_realistic_output_becomes_its_tool_calls(
    template: str, format: str, text: str, content: str | None, calls: list
) -> None:
    parsed = message(output(format), [text])
    assert parsed["content"] == content
    assert without_ids(parsed["tool_calls"]) == calls
    assert parsed["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize(("template", "format", "text", "content", "calls"), CASES, ids=IDS)
def test_streamed_in_small_pieces_the_same_calls_arrive(
    template: str, format: str, text: str, content: str | None, calls: list, size: int
) -> None:
    joined = streamed(output(format), pieces(text, size))
    assert joined["content"] == content
    assert without_ids(joined["tool_calls"]) == calls
    assert joined["finish_reason"] == "tool_calls"


def test_kimi_k2_calls_keep_the_models_own_ids() -> None:
    text = CASES[IDS.index("moonshotai-Kimi-K2")][2]
    ids = [call["id"] for call in message(output("kimi_k2"), [text])["tool_calls"]]
    assert ids == ["functions.get_weather:0", "functions.get_time:1"]


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    text = CASES[IDS.index("mistralai-Mistral-Nemo-Instruct-2407")][2]
    calls = message(OutputOptions(tools="mistral", call_ids="mistral"), [text])["tool_calls"]
    assert [bool(re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])) for call in calls] == [True, True]
    assert calls[0]["id"] != calls[1]["id"]


def test_other_formats_call_ids_are_openais_shape() -> None:
    (call,) = message(output("hermes"), [CASES[0][2]])["tool_calls"][:1]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])


def test_deepseek_r1_reasons_then_calls_with_no_content() -> None:
    text = "The user wants Paris.\n</think>\n\n" + CASES[IDS.index("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")][2]
    options = OutputOptions(tools="deepseek_v3", reasoning=True, thinking=True)
    parsed = message(options, [text])
    assert (parsed["reasoning_content"], parsed["content"]) == ("The user wants Paris.\n", None)
    assert without_ids(parsed["tool_calls"]) == [WEATHER, TIME]


def test_qwen3_coder_values_are_typed_by_the_functions_schema() -> None:
    text = (
        "<tool_call>\n<function=plan>\n<parameter=days>\n3\n</parameter>\n<parameter=code>\n007\n</parameter>\n"
        '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    schema = {
        "type": "object",
        "properties": {"days": {"type": "integer"}, "code": {"type": "string"}, "tags": {"type": "array"}},
    }
    options = OutputOptions(tools="qwen3_coder", parameters={"plan": schema})
    (call,) = message(options, [text])["tool_calls"]
    assert (
        call["function"]["arguments"] == '{"days": 3, "code": "007", "tags": ["a", "b"], "note": "line one\\nline two"}'
    )


@pytest.mark.parametrize(
    ("format", "text"),
    [
        ("hermes", "a <tool_call>not json</tool_call>"),
        ("deepseek_v31", "x<｜tool▁calls▁begin｜>no call here"),
        ("functionary_v31", "use <function=f> wisely"),
        ("llama3_json", 'Answer: {"name": "x"}'),
        ("mistral", "[TOOL_CALLS] is how I call"),
        ("gemma4", "say <|tool_call> aloud"),
    ],
)
def test_text_that_only_looks_like_a_call_stays_content(format: str, text: str) -> None:
    for texts in ([text], pieces(text, 1)):
        assert message(output(format), texts) == {"role": "assistant", "content": text, "finish_reason": "stop"}


def test_gemma_4_arguments_in_the_templates_notation_become_json() -> None:
    text = (
        '<|tool_call>call:plan{when:<|"|>today, 9:00 {sharp}<|"|>,days:3,ok:true,ratio:0.5,none:None,'
        'tags:[<|"|>a<|"|>,<|"|>b<|"|>],where:{city:<|"|>Paris<|"|>,zip:75001}}<tool_call|>'
    )
    expected = (
        '{"when": "today, 9:00 {sharp}", "days": 3, "ok": true, "ratio": 0.5, "none": null, '
        '"tags": ["a", "b"], "where": {"city": "Paris", "zip": 75001}}'
    )
    for texts in ([text], pieces(text, 1), pieces(text, 4)):
        (call,) = message(output("gemma4"), texts)["tool_calls"]
        assert (call["function"]["name"], call["function"]["arguments"]) == ("plan", expected)


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@functools.cache
def compiler(tokenizer_file: Path, eos: str) -> tuple[Tokenizer, GrammarCompiler, int]:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos_id = tokenizer.token_to_id(eos)
    return tokenizer, GrammarCompiler(tokenizer_file, tokenizer.get_vocab_size(), [eos_id]), eos_id


def follows(grammar: str, tokenizer_file: Path, *texts: str, eos: str = "<|im_end|>") -> bool:
    """Whether the worker's matcher of `grammar` takes `texts` (the tokens of each as the tokenizer
    splits it, special tokens included: a marker split across two texts is spelt by other tokens)
    and then the end of sequence."""
    tokenizer, grammars, eos_id = compiler(tokenizer_file, eos)
    matcher = grammars.matcher(grammar)
    ids = [token for text in texts for token in tokenizer.encode(text, add_special_tokens=False).ids]
    return all(matcher.consume_token(token) for token in ids) and matcher.consume_token(eos_id)


def block(format: str, tokens: Mapping[str, int]) -> guided.CallBlock:
    """The calls of get_weather and get_time (both strict) as `format` writes them."""
    return STRICT_CALLS[format].block(((name, WEATHER_SCHEMA, True) for name in ("get_weather", "get_time")), tokens)


def written(tag: CallTag, calls: list[tuple[str, str]], space: str = "") -> str:
    """One block of `calls` (name, arguments) as the format writes it (Llama 3's JSON calls without
    the trigger, as its template writes them)."""
    numbered = [f"{i}{tag.numbered}" if tag.numbered is not None else "" for i in range(len(calls))]
    items = [
        tag.opening(name) + n + arguments + tag.close for (name, arguments), n in zip(calls, numbered, strict=True)
    ]
    opened = ("" if tag.whole else tag.trigger) + space + tag.begin
    return opened + ((tag.separator or "") + space).join(items) + space + tag.end


def with_markers(demo_model: Path, tmp_path: Path, format: str, markers: str) -> tuple[Path, dict[str, int]]:
    """The demo tokenizer, and its added tokens as the API reads them (text → id): as it is (`text`:
    the format's markers are pieces of text), or with its markers (every `<…>` and `[…]` it writes)
    added as tokens, flagged not special as Qwen's `<tool_call>` is (`added`) or special (`special`);
    llguidance reads either as special tokens."""
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    if markers != "text":
        tag = STRICT_CALLS[format]
        texts = (tag.trigger, tag.begin, tag.opening("f"), tag.close, tag.end, tag.separator or "", tag.numbered or "")
        names = dict.fromkeys(m.group() for text in texts for m in guided.MARKER.finditer(text))
        tokenizer.add_tokens([AddedToken(name, special=markers == "special") for name in names])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    added = tokenizer.get_added_tokens_decoder()
    return tmp_path / "tokenizer.json", {token.content: id for id, token in added.items()}


# The formats whose calls begin where the model writes their trigger (not Llama 3's, the whole answer),
# and those whose trigger may be a token of its own (not functionary's `<function=`, always text).
TRIGGERED = [f for f in sorted(STRICT_CALLS) if STRICT_CALLS[f].whole is None]
NAMEABLE = [f for f in TRIGGERED if guided.MARKER.fullmatch(STRICT_CALLS[f].trigger)]


@pytest.mark.parametrize(
    ("format", "markers"),
    [(f, "text") for f in sorted(TRIGGERED)] + [(f, m) for f in NAMEABLE for m in ("added", "special")],
)
def test_a_strict_tools_grammar_takes_text_and_the_calls_its_format_writes_and_its_parser_reads(
    format: str, markers: str, demo_model: Path, tmp_path: Path
) -> None:
    """tool_choice auto with a strict tool (app/service.py's auto_calls): free text, and calls in the
    model's format held to the tools' names and schemas, which the format's parser reads back. The
    markers are text in one tokenizer and tokens of their own in others, named as tokens (a grammar
    that spelt Qwen's `<tool_call>` token as text refused it: no call could be written)."""
    tokenizer_file, tokens = with_markers(demo_model, tmp_path, format, markers)
    tag = STRICT_CALLS[format]
    grammar = guided.tool_calls_in_text(block(format, tokens))
    call = written(tag, [("get_weather", '{"city": "Paris"}')])
    assert follows(grammar, tokenizer_file, "It is sunny.") and follows(grammar, tokenizer_file, "Checking. " + call)
    pair = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Rome"}')]
    # Two calls: a list of them where the format writes lists, else one block after another.
    both = written(tag, pair) if tag.separator is not None else written(tag, pair[:1]) + "\n" + written(tag, pair[1:])
    assert follows(grammar, tokenizer_file, both) and follows(grammar, tokenizer_file, call + "\n" + call)
    assert not follows(grammar, tokenizer_file, written(tag, [("get_weather", '{"city": 5}')]))
    assert not follows(grammar, tokenizer_file, written(tag, [("get_rain", '{"city": "Paris"}')]))
    parsed = message(output(format.removesuffix("_named")), ["Checking. " + both])
    assert without_ids(parsed["tool_calls"]) == pair
    if markers != "text":  # the trigger spelt by other tokens: the parser would read an unchecked call
        spelt = written(tag, [("get_rain", '{"city": 5}')])
        assert message(output(format.removesuffix("_named")), [spelt])["tool_calls"]
        assert not follows(grammar, tokenizer_file, "Checking. ", *spelt)  # a character a text: no token
    if tag.spaced:  # whitespace after the trigger, between the calls and before the end, as parsers take
        spaced = written(tag, pair, space="\n")
        assert follows(grammar, tokenizer_file, spaced)
        assert without_ids(message(output(format), [spaced])["tool_calls"]) == pair
        if tag.separator and tag.separator.strip():  # a separator's own space, any whitespace
            tight = written(tag._replace(separator=tag.separator.strip() + "\n"), pair)
            assert follows(grammar, tokenizer_file, tight)
            assert without_ids(message(output(format), [tight])["tool_calls"]) == pair
    else:
        assert not follows(grammar, tokenizer_file, written(tag, pair[:1], space="\n\n"))


@pytest.mark.parametrize("markers", ["text", "special"])
def test_llama_3s_strict_calls_are_the_whole_answer_and_text_is_what_does_not_begin_as_one(
    markers: str, demo_model: Path, tmp_path: Path
) -> None:
    """Llama 3's JSON calls are the answer itself (`{"name": …, "parameters": …}`, `; ` between them,
    `<|python_tag|>` allowed before), which its parser reads from the answer's start, taking any `{`
    there for a call, whatever its keys and spacing: with a strict tool, an answer that begins (after
    whitespace) with `{` or the tag is held to the tools' calls, and any other text stays free and stays
    content. With a JSON format, the answer is that JSON or a call, or the tag and calls."""
    tokenizer_file, tokens = with_markers(demo_model, tmp_path, "llama3_json", markers)
    tag = STRICT_CALLS["llama3_json"]
    grammar = guided.tool_calls_in_text(block("llama3_json", tokens))
    pair = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Rome"}')]
    call, both = written(tag, pair[:1]), written(tag, pair)
    for text, calls in (
        (call, pair[:1]),
        (both, pair),
        (" \n" + call, pair[:1]),
        (tag.trigger + call, pair[:1]),
        (tag.trigger + " " + both, pair),
    ):
        assert follows(grammar, tokenizer_file, text), text
        assert without_ids(message(output("llama3_json"), [text])["tool_calls"]) == calls
    for text in ("It is sunny.", 'Here: {"name": "get_rain"}', "\xa0" + call, "", " "):
        assert follows(grammar, tokenizer_file, text), text
        assert message(output("llama3_json"), [text]).get("tool_calls") is None
    for text in (
        written(tag, [("get_weather", '{"city": 5}')]),
        written(tag, [("get_rain", '{"city": "Paris"}')]),
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{ "name": "get_rain", "parameters": {"city": 5}}',  # what the parser would read as a call
        '{"type": "function", "name": "get_rain", "parameters": {}}',
        '{"answer": "sunny"}',
        tag.trigger + "Sunny.",
        call + "\n" + call,
    ):
        assert not follows(grammar, tokenizer_file, text), text
    assert not follows(grammar, tokenizer_file, tag.trigger[:2], tag.trigger[2:] + "Sunny.")  # spelt
    answer = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    grammar = guided.answer_or_calls((answer, True), block("llama3_json", tokens))
    for text in ('{"summary": "Sunny."}', call, tag.trigger + " " + both):
        assert follows(grammar, tokenizer_file, text), text
    for text in ("Sunny.", '{"summary": 5}', written(tag, [("get_weather", '{"city": 5}')]), " " + call):
        assert not follows(grammar, tokenizer_file, text), text
    # An answer that may be any object, whatever its schema's root: a call still cannot pass as one (the
    # parser reads any leading object with a `name` as a call); an answer whose schema has a name keeps it.
    for loose in (
        {"type": "object"},
        {"type": ["object", "null"]},
        {"properties": {"summary": {"type": "string"}}},
        {"$ref": "#/$defs/Report", "$defs": {"Report": {"type": "object"}}},
        {"anyOf": [{"type": "object"}, {"type": "string"}]},
    ):
        grammar = guided.answer_or_calls((loose, False), block("llama3_json", tokens))
        assert follows(grammar, tokenizer_file, '{"summary": "Sunny."}') and follows(grammar, tokenizer_file, call)
        for passing in (written(tag, [("get_weather", '{"city": 5}')]), '{"summary": "x", "name": "get_rain"}'):
            assert not follows(grammar, tokenizer_file, passing), (loose, passing)
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert follows(
        guided.answer_or_calls((person, True), block("llama3_json", tokens)), tokenizer_file, '{"name": "Bob"}'
    )


@pytest.mark.parametrize("markers", ["text", "added"])
def test_with_a_json_format_the_answer_is_that_json_or_the_models_calls(
    markers: str, demo_model: Path, tmp_path: Path
) -> None:
    """tool_choice auto with a JSON response format (an agent with an output type and tools): the
    format's JSON, or calls in the model's format from the first token, so that the format does not
    take the model's tools away; text of neither kind is refused."""
    tokenizer_file, tokens = with_markers(demo_model, tmp_path, "hermes", markers)
    tag = STRICT_CALLS["hermes"]
    answer = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    grammar = guided.answer_or_calls((answer, True), block("hermes", tokens))
    call = written(tag, [("get_weather", '{"city": "Paris"}')])
    assert follows(grammar, tokenizer_file, '{"summary": "Sunny."}')
    assert follows(grammar, tokenizer_file, call) and follows(grammar, tokenizer_file, call + "\n" + call)
    assert not follows(grammar, tokenizer_file, '{"title": "Sunny."}')  # not the format's schema
    assert not follows(grammar, tokenizer_file, "Let me check. " + call)  # text is the format's JSON
    assert not follows(grammar, tokenizer_file, written(tag, [("get_weather", '{"city": 5}')]))


# A real template of each format a strict tool's grammar holds (granite 3.3's does not write the
# history's calls), and what of its call is not the grammar's: Mistral's older template writes the
# call's id, its newer a [CALL_ID], which the model need not write (the parser takes calls without).
WRITTEN_BY = [
    ("Qwen-Qwen3-0.6B.jinja", "hermes", ""),
    ("NVIDIA-Nemotron-Nano-v2.jinja", "nemotron", ""),
    ("meetkai-functionary-medium-v3.1.jinja", "functionary_v31", ""),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3", ""),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v31", ""),
    ("moonshotai-Kimi-K2.jinja", "kimi_k2", ""),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json", ""),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", ', "id": "abcDEF123"'),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral_named", "[CALL_ID]abcDEF123"),
    ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral_named", ""),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral_named", ""),
]


@pytest.mark.parametrize(("template", "strict", "extra"), WRITTEN_BY)
def test_a_strict_tools_grammar_writes_a_call_as_the_models_own_template_does(
    templates: Path, demo_model: Path, tmp_path: Path, template: str, strict: str, extra: str
) -> None:
    """The call a strict tool's grammar holds the model to is the one its chat template writes in the
    conversation's history (what the model was trained to write), for each format's real template:
    Mistral's by the template's tokenizer version, a list of calls or `name[ARGS]` per call."""
    text = (templates / template).read_text()
    assert call_tag(detect_tool_parser(text), text) == STRICT_CALLS[strict]
    rendered = ours(tmp_path, demo_model, text, conversation()).replace(extra, "")
    assert written(STRICT_CALLS[strict], [("get_weather", ARGUMENTS)]) in rendered


@pytest.mark.parametrize("token", [False, True])
def test_a_trigger_the_grammar_cannot_name_as_a_token_leaves_the_calls_as_the_model_writes_them(
    templates: Path, demo_model: Path, tmp_path: Path, token: bool
) -> None:
    """functionary v3.1's `<function=` has no name llguidance reads (not `<…>` nor `[…]`): where a
    tokenizer makes it a token, spelling it as text in the grammar would let the model never call, so a
    strict tool's calls are read as written; as text, they are held."""
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    if token:
        tokenizer.add_tokens([AddedToken("<function=", special=False)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(demo_model / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    template = (templates / "meetkai-functionary-medium-v3.1.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(template)
    prompts = PromptBuilder(ModelFiles(tmp_path))
    model = ModelEntry("m", prompts, 4096, 512, 1024, 0, {}, detect_tool_parser(template), "none")
    strict = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": [strict]}
    grammar = auto_calls(model, load_request(ChatCompletionSchema(RequestLimits()), body))
    assert (grammar is None) == token


# Real tokenizers, built from llama.cpp's vocabulary files with their releases' added tokens at their
# ids (scripts/real_models.py): the format each teaches, and its end of turn.
REAL = {"hermes": ("qwen2.5", "<|im_end|>"), "llama3_json": ("llama3.1", "<|eot_id|>")}


@pytest.mark.parametrize("format", sorted(REAL))
def test_a_strict_tools_grammar_holds_the_calls_on_the_real_tokenizer_of_its_family(format: str) -> None:
    """Qwen2.5's tokenizer (`<tool_call>` an added token not flagged special, id 151657) and Llama
    3.1's (`<|python_tag|>`, special, 128010): the grammar names the markers by their real ids, and the
    family's own byte-level BPE of the text and JSON around them (`>` and a newline are one token
    where the marker is spelt) is held as on the demo tokenizer; a marker spelt by other tokens is
    refused, and the parser reads back the calls the grammar takes."""
    release, eos = REAL[format]
    file = real_models.tokenizers() / release / "tokenizer.json"
    added = Tokenizer.from_file(str(file)).get_added_tokens_decoder()
    tokens = {token.content: id for id, token in added.items()}
    tag = STRICT_CALLS[format]
    assert tag.trigger in tokens  # the release's own token
    grammar = guided.tool_calls_in_text(block(format, tokens))
    pair = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Rome"}')]
    call = written(tag, pair[:1])
    both = written(tag, pair) if tag.whole else call + "\n" + written(tag, pair[1:])
    opened = ("" if tag.whole is None else tag.trigger) + call
    for text, calls in ((call, pair[:1]), (both, pair), (opened, pair[:1])):
        assert follows(grammar, file, text, eos=eos), text
        assert without_ids(message(output(format), [text])["tool_calls"]) == calls
    assert follows(grammar, file, "It is sunny in Paris today.", eos=eos)
    for text in (written(tag, [("get_weather", '{"city": 5}')]), written(tag, [("get_rain", '{"city": "Paris"}')])):
        assert not follows(grammar, file, text, eos=eos), text
    # A character a text: no token. Llama 3's answer is a call only from its start, as its parser reads.
    spelt = tag.trigger + call if tag.whole else "Checking. " + call
    assert not follows(grammar, file, *spelt, eos=eos)
