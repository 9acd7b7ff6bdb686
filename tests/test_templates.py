"""Real chat templates get what transformers gives them: a tool round trip (the client's tools as
sent, an assistant call whose message has no `content` key, as litellm sends it, the tool's result)
rendered by tokenline is byte-identical to transformers' `apply_chat_template(messages, tools=tools,
add_generation_prompt=True, tokenize=False)`, on every template of llama.cpp's set that knows tools.

Two choices differ from transformers, as vLLM's do, and the tests say where:
- a call's `arguments` reach the template as an object under `tojson`, `items` and key access, and
  as the client's own string under `+` and `~`. transformers passes the string, which templates that
  apply `tojson` encode twice, templates that iterate it or demand a mapping refuse, and Kimi-K3's
  and Gemma 4's print in another form than an object's. There tokenline renders what transformers
  renders when given the object.
- a null or absent `content` is empty text: transformers drops the key, and Qwen3's template (among
  others) then fails. The transformers side of the comparison is given `""`.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from app.anthropic_format import chat_body as messages_chat_body
from app.anthropic_format import tool_use_id
from app.parsers import new_call_id
from app.prompt import PromptBuilder
from schemas.chat import ChatCompletionSchema
from schemas.errors import InvalidRequest
from schemas.messages import MessagesSchema
from schemas.model_files import ModelFiles
from schemas.requests import RequestLimits, load_request
from scripts import real_models

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "strict": True,
        },
    }
]
ARGUMENTS = '{"city": "Paris"}'  # as tokenline (json.dumps) returns arguments


@pytest.fixture(scope="session")
def templates() -> Path:
    """llama.cpp's copies of real chat templates (fetched once per machine)."""
    return real_models.chat_templates()


def conversation(arguments: str = ARGUMENTS) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "The user wants the weather.",
            "tool_calls": [
                {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "18 C, sunny"},
    ]


# `tojson` of the string: transformers encodes the arguments twice.
TWICE = {
    "Apertus-8B-Instruct.jinja",
    "Apriel-1.6-15b-Thinker-fixed.jinja",
    "Cohere2MoE.jinja",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
    "MiMo-VL.jinja",
    "MiniMax-M1.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "Qwen-QwQ-32B.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "deepseek-ai-DeepSeek-V3.1.jinja",  # llama.cpp's copy adds `| tojson`
    "meetkai-functionary-medium-v3.1.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "moonshotai-Kimi-K2.jinja",
    "openai-gpt-oss-120b.jinja",
    "unsloth-Apriel-1.5.jinja",
}
# The template iterates the arguments (`items`) or demands a mapping: transformers fails on the string.
NO_STRING = {
    "ByteDance-Seed-OSS.jinja",
    "GLM-4.6.jinja",
    "GLM-4.7-Flash.jinja",
    "LFM2.5-8B-A1B.jinja",
    "MiniMax-M2.jinja",
    "MiniMax-M3.jinja",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "Qwen3-Coder.jinja",
    "Qwen3.5-4B.jinja",
    "Spark2.5.jinja",
    "StepFun3.5-Flash.jinja",
    "deepseek-ai-DeepSeek-V3.2.jinja",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
    "deepseek-ai-DeepSeek-V4.jinja",
    "inclusionai-ling-3.0-flash.jinja",
    "muse-glimmer.jinja",
    "openbmb-MiniCPM5-1B.jinja",
    "poolside-Laguna-S-2.1.jinja",
    "poolside-Laguna-XS-2.1.jinja",
    "poolside-Laguna-XS.2.jinja",
    "tencent-Hy3.jinja",
}
# A string is printed as it is, an object in the template's own form (what the model was trained on).
OWN_FORM = {"Kimi-K3.jinja", "google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"}
# transformers fails on these messages whatever the arguments: so does tokenline, with a 400.
BROKEN = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "tools flat, not OpenAI's",
    "Kimi-K2-Instruct.jinja": "list.append in an immutable sandbox",
    "Kimi-K2-Thinking.jinja": "list.append in an immutable sandbox",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "tools under another name",
    "llama-cpp-deepseek-r1.jinja": "tojson of a generator",
}
# Rendered exactly as transformers renders the client's messages.
AS_SENT = {
    "Bielik-11B-v3.0-Instruct.jinja",
    "GigaChat3-10B-A1.8B.jinja",
    "GigaChat3.1-10B-A1.8B.jinja",
    "HuggingFaceTB-SmolLM3-3B.jinja",
    "LFM2-8B-A1B.jinja",
    "LFM2.5-Instruct.jinja",
    "NVIDIA-Nemotron-Nano-v2.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "Reka-Edge.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
    "ibm-granite-granite-3.3-2B-Instruct.jinja",
    "ibm-granite-granite-4.0.jinja",
    "ibm-granite-granite-4.1.jinja",
    "meetkai-functionary-medium-v3.2.jinja",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
    "upstage-Solar-Open-100B.jinja",
}
AS_OBJECT = TWICE | NO_STRING | OWN_FORM
ALL = sorted(AS_SENT | AS_OBJECT | set(BROKEN))


@pytest.fixture(scope="module")
def transformers_tokenizer(demo_model: Path) -> PreTrainedTokenizerFast:
    files = ModelFiles(demo_model)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(files.tokenizer_file),
        bos_token=files.special_token("bos_token"),
        eos_token=files.special_token("eos_token"),
    )


def ours(directory: Path, demo_model: Path, template: str, messages: list[dict], tools: list[dict] = TOOLS) -> str:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, directory / name)
    (directory / "chat_template.jinja").write_text(template)
    request = load_request(ChatCompletionSchema(RequestLimits()), {"model": "m", "messages": messages, "tools": tools})
    return PromptBuilder(ModelFiles(directory)).chat_prompt(request.messages, request.tools)


def theirs(tokenizer: PreTrainedTokenizerFast, template: str, messages: list[dict], as_object: bool = False) -> str:
    """transformers' rendering, with the null content tokenline gives (and the arguments as objects)."""
    messages = copy.deepcopy(messages)
    for message in messages:
        if message["role"] == "assistant" and message.get("content") is None:
            message["content"] = ""
        for call in message.get("tool_calls", ()):
            if as_object:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    rendered = tokenizer.apply_chat_template(
        messages, tools=copy.deepcopy(TOOLS), add_generation_prompt=True, tokenize=False, chat_template=template
    )
    assert isinstance(rendered, str)
    return rendered


def test_every_template_that_knows_tools_is_compared(templates: Path) -> None:
    knowing = {path.name for path in templates.glob("*.jinja") if "tool" in path.read_text()}
    assert knowing == set(ALL)


@pytest.mark.parametrize("name", sorted(AS_SENT))
def test_the_prompt_is_what_transformers_renders(
    templates: Path, demo_model: Path, transformers_tokenizer: PreTrainedTokenizerFast, tmp_path: Path, name: str
) -> None:
    template = (templates / name).read_text()
    expected = theirs(transformers_tokenizer, template, conversation())
    assert ours(tmp_path, demo_model, template, conversation()) == expected


@pytest.mark.parametrize("name", sorted(AS_OBJECT))
def test_where_transformers_cannot_use_the_string_the_prompt_is_its_rendering_of_the_object(
    templates: Path, demo_model: Path, transformers_tokenizer: PreTrainedTokenizerFast, tmp_path: Path, name: str
) -> None:
    template = (templates / name).read_text()
    expected = theirs(transformers_tokenizer, template, conversation(), as_object=True)
    assert ours(tmp_path, demo_model, template, conversation()) == expected
    try:
        as_sent = theirs(transformers_tokenizer, template, conversation())
    except Exception:  # NO_STRING: transformers refuses the string
        assert name in NO_STRING
    else:
        assert as_sent != expected
        assert (json.dumps(ARGUMENTS)[1:-1] in as_sent) == (name in TWICE)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_template_transformers_cannot_render_is_a_400(
    templates: Path, demo_model: Path, transformers_tokenizer: PreTrainedTokenizerFast, tmp_path: Path, name: str
) -> None:
    template = (templates / name).read_text()
    with pytest.raises(Exception):  # noqa: B017 (whatever transformers raises)
        theirs(transformers_tokenizer, template, conversation(), as_object=True)
    with pytest.raises(InvalidRequest) as caught:
        ours(tmp_path, demo_model, template, conversation())
    assert caught.value.param == "messages"


COMPACT = '{"city":"Paris"}'  # how OpenAI writes arguments; a client sends back what it got


def test_functionary_v3_2_concatenates_the_clients_own_string(
    templates: Path, demo_model: Path, transformers_tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    template = (templates / "meetkai-functionary-medium-v3.2.jinja").read_text()
    prompt = ours(tmp_path, demo_model, template, conversation(COMPACT))
    assert prompt == theirs(transformers_tokenizer, template, conversation(COMPACT))
    assert ">>>get_weather\n" + COMPACT in prompt


def test_the_original_deepseek_v3_1_template_concatenates_the_clients_own_string(
    templates: Path, demo_model: Path, transformers_tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    patched = (templates / "deepseek-ai-DeepSeek-V3.1.jinja").read_text()
    template = patched.replace("tool['function']['arguments'] | tojson", "tool['function']['arguments']")
    assert template != patched
    prompt = ours(tmp_path, demo_model, template, conversation(COMPACT))
    assert prompt == theirs(transformers_tokenizer, template, conversation(COMPACT))
    assert "get_weather<｜tool▁sep｜>" + COMPACT + "<｜tool▁call▁end｜>" in prompt


def test_a_template_that_prints_a_string_as_is_gets_the_object_as_json(
    templates: Path, demo_model: Path, tmp_path: Path
) -> None:
    """Qwen3's template writes a string as is and an object with `tojson`: tokenline gives the
    object (vLLM's choice), so compact arguments come out as json.dumps writes them."""
    template = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    prompt = ours(tmp_path, demo_model, template, conversation(COMPACT))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


def test_mistral_templates_take_the_nine_character_ids_tokenline_makes(
    templates: Path, demo_model: Path, tmp_path: Path
) -> None:
    call_id = new_call_id("mistral")
    messages = conversation()
    messages[2]["tool_calls"][0]["id"] = messages[3]["tool_call_id"] = call_id
    for name in ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja"):
        assert call_id in ours(tmp_path, demo_model, (templates / name).read_text(), messages)
    messages[2]["tool_calls"][0]["id"] = messages[3]["tool_call_id"] = "call_" + "0" * 24
    with pytest.raises(InvalidRequest, match="Tool call IDs should be alphanumeric strings with length 9!"):
        ours(tmp_path, demo_model, (templates / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(), messages)


def test_a_messages_tool_loop_reaches_mistrals_template_with_the_ids_the_model_wrote(
    templates: Path, demo_model: Path, tmp_path: Path
) -> None:
    """Anthropic's tool_use ids are `toolu_` and the call's id: sent back, the template gets the
    9-character id again (it refused the prefixed one: a Messages tool loop on a Mistral model was a
    400 on its second turn)."""
    call_id = new_call_id("mistral")
    issued = tool_use_id(call_id)
    request = MessagesSchema().load(
        {
            "model": "m",
            "max_tokens": 8,
            "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": issued, "name": "get_weather", "input": {"city": "Paris"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": issued, "content": "18 C"}]},
            ],
        }
    )
    body = messages_chat_body(request)
    template = (templates / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    prompt = ours(tmp_path, demo_model, template, body["messages"], body["tools"])
    assert prompt.count(call_id) == 2 and issued not in prompt


PREFILLED = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": " The weather in Paris is "},  # spaces a template may trim or keep
]


# transformers fails on PREFILLED with these (tools in another shape, no system role): tokenline's is a 400.
PREFILL_BROKEN = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "fireworks-ai-llama-3-firefunction-v2.jinja",
    "google-gemma-2-2b-it.jinja",
}


def test_a_continued_final_message_is_cut_where_transformers_cuts_it(
    templates: Path, demo_model: Path, transformers_tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """continue_final_message (vLLM's; a Messages prefill): on every template of llama.cpp's set, the
    prompt ends with the final message's text as transformers' `apply_chat_template(
    continue_final_message=True)` renders it; where transformers fails on the conversation,
    tokenline's answer is a 400 naming `messages`."""
    for filename in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / filename, tmp_path / filename)
    request = load_request(
        ChatCompletionSchema(RequestLimits()), {"model": "m", "messages": PREFILLED, "continue_final_message": True}
    )
    refused, compared = set(), 0
    for path in sorted(templates.glob("*.jinja")):
        template = path.read_text()
        (tmp_path / "chat_template.jinja").write_text(template)
        try:
            expected = transformers_tokenizer.apply_chat_template(
                copy.deepcopy(PREFILLED),
                add_generation_prompt=False,
                continue_final_message=True,
                tokenize=False,
                chat_template=template,
            )
        except Exception:
            with pytest.raises(InvalidRequest) as caught:
                PromptBuilder(ModelFiles(tmp_path)).request_prompt(request)
            assert caught.value.param == "messages", path.name
            refused.add(path.name)
            continue
        assert PromptBuilder(ModelFiles(tmp_path)).request_prompt(request) == expected, path.name
        assert expected.rstrip().endswith("The weather in Paris is"), path.name
        compared += 1
    assert refused == PREFILL_BROKEN and compared == len(list(templates.glob("*.jinja"))) - len(PREFILL_BROKEN) > 60
