"""What reaches the chat template and the sampler from a model directory: tools, template kwargs,
generation tags, template errors, generation_config.json defaults and the context's length."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.prompt import PromptBuilder, compiled_template
from app.registry import ModelRegistry
from app.service import CompletionService
from schemas.chat import ChatCompletionSchema
from schemas.config import ModelConfig, Settings
from schemas.errors import ContextLengthExceeded, InvalidRequest
from schemas.model_files import ModelFiles, ModelFilesError
from schemas.requests import RequestLimits, load_request

TOOLS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% endfor %}{% if tools %}TOOLS:{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% generation %}<assistant>{% endgeneration %}"
)


def model_dir(tmp_path: Path, demo_model: Path, template: str | None = None, **config: object) -> Path:
    path = tmp_path / "model"
    shutil.copytree(demo_model, path)
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    if config:
        data = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**data, **config}))
    return path


def chat(body: dict) -> object:
    base = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    return load_request(ChatCompletionSchema(RequestLimits(max_n=4)), {**base, **body})


def test_tools_tool_calls_developer_and_template_kwargs_reach_the_template(tmp_path: Path, demo_model: Path) -> None:
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, TOOLS_TEMPLATE)))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    request = chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "tools": [tool],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    text = builder.chat_prompt(request.messages, request.tools, request.template_kwargs)  # type: ignore[attr-defined]
    assert text == '<system>be brief<assistant>[call f {"a": 1}]<tool>okTOOLS:f<think></think><assistant>'


def test_template_kwargs_cannot_replace_what_the_server_sets(tmp_path: Path, demo_model: Path) -> None:
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, TOOLS_TEMPLATE)))
    request = chat({"chat_template_kwargs": {"messages": []}})
    with pytest.raises(InvalidRequest) as caught:
        builder.chat_prompt(request.messages, (), request.template_kwargs)  # type: ignore[attr-defined]
    assert caught.value.param == "chat_template_kwargs"


def test_a_template_that_raises_a_type_error_is_a_400(tmp_path: Path, demo_model: Path) -> None:
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, "{{ messages[0].content + 1 }}")))
    with pytest.raises(InvalidRequest, match="TypeError") as caught:
        builder.chat_prompt(chat({}).messages)  # type: ignore[attr-defined]
    assert caught.value.param == "messages"


def test_a_model_without_a_chat_template_refuses_chat_and_says_where_a_prompt_goes(
    tmp_path: Path, demo_model: Path
) -> None:
    path = model_dir(tmp_path, demo_model)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(InvalidRequest) as caught:
        PromptBuilder(ModelFiles(path)).chat_prompt(chat({}).messages)  # type: ignore[attr-defined]
    assert caught.value.param == "messages"
    assert (
        caught.value.message == "This model has no chat template; send a plain prompt to /v1/completions or /generate."
    )


def test_a_template_that_does_not_compile_names_its_file(tmp_path: Path, demo_model: Path) -> None:
    path = model_dir(tmp_path, demo_model, "{% for m in messages %}")
    with pytest.raises(ModelFilesError, match=f"{path / 'chat_template.jinja'} does not compile"):
        PromptBuilder(ModelFiles(path))


def test_generation_config_defaults_apply_where_a_request_gives_none(tmp_path: Path, demo_model: Path) -> None:
    path = model_dir(tmp_path, demo_model)
    generation = json.loads((path / "generation_config.json").read_text())
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (path / "generation_config.json").write_text(json.dumps({**generation, **defaults}))
    service = CompletionService.__new__(CompletionService)
    entry = ModelRegistry(Settings(models=(ModelConfig("demo", path),))).get("demo")
    params = service.sampling(entry, {"temperature": 0.2}, 10, None)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.2, 0.8, 20, 1.05)


def test_max_tokens_defaults_to_the_rest_of_the_context_and_must_fit_it(tmp_path: Path, demo_model: Path) -> None:
    path = model_dir(tmp_path, demo_model)
    service = CompletionService.__new__(CompletionService)
    entry = ModelRegistry(Settings(models=(ModelConfig("demo", path),), max_seq_len=2048)).get("demo")
    assert service.sampling(entry, {}, 48, None).max_tokens == 2000
    assert service.sampling(entry, {}, 48, 16).max_tokens == 16
    assert service.sampling(entry, {"max_tokens": 2000}, 48, None).max_tokens == 2000
    with pytest.raises(ContextLengthExceeded) as caught:
        service.sampling(entry, {"max_tokens": 2001}, 48, None)
    assert caught.value.param == "max_tokens"
    capped = ModelRegistry(Settings(models=(ModelConfig("demo", path),), max_seq_len=2048, max_iter_times=512))
    assert service.sampling(capped.get("demo"), {}, 48, None).max_tokens == 512


@pytest.mark.parametrize("key", ["n_positions", "n_ctx", "seq_length", "max_sequence_length"])
def test_older_names_for_the_context_length_are_read(tmp_path: Path, demo_model: Path, key: str) -> None:
    path = model_dir(tmp_path, demo_model)
    data = json.loads((path / "config.json").read_text())
    del data["max_position_embeddings"]
    (path / "config.json").write_text(json.dumps({**data, key: 64}))
    entry = ModelRegistry(Settings(models=(ModelConfig("demo", path),))).get("demo")
    assert ModelFiles(path).max_position_embeddings == 64
    assert entry.max_model_len == 64 and entry.max_prompt_tokens == 63


@pytest.mark.parametrize(
    ("config", "context"),
    [
        # Qwen's model cards: add YaRN to config.json, its max_position_embeddings left at the original
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}, 256),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 256),  # the original: max_position_embeddings
        # DeepSeek-V3's: max_position_embeddings already the original times the factor
        ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16}}, 64),
        # transformers 5 writes rope_parameters, per layer type for some models
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}, 128),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0},
                    "sliding_attention": {"rope_type": "default"},
                }
            },
            128,
        ),
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, 256),
        # Gemma 3's max_position_embeddings counts its linear factor already (as vLLM reads it)
        ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, 64),
        # dynamic NTK, LongRoPE and Llama 3's scaling: max_position_embeddings as it is
        ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, 64),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8}}, 64),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, 64),
        ({"rope_scaling": {"type": "yarn", "factor": None}}, 64),
        ({"rope_scaling": None}, 64),
    ],
)
def test_the_context_counts_a_rope_scaling_as_vllm_does(
    tmp_path: Path, demo_model: Path, config: dict, context: int
) -> None:
    path = model_dir(tmp_path, demo_model)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "max_position_embeddings": 64, **config}))
    assert ModelFiles(path).context_length == context
    entry = ModelRegistry(Settings(models=(ModelConfig("demo", path),))).get("demo")
    assert entry.max_model_len == context and entry.max_prompt_tokens == context - 1


def test_tools_reach_the_template_as_the_client_sent_them(tmp_path: Path, demo_model: Path) -> None:
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, "{{ tools | tojson }}")))
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}, "strict": True}}
    request = chat({"tools": [tool]})
    text = builder.chat_prompt(request.messages, request.tools)  # type: ignore[attr-defined]
    assert (
        text
        == '[{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}, "strict": true}}]'
    )


ARGUMENT_OPERATIONS = (
    "{% set a = messages[1].tool_calls[0].function.arguments %}"
    "{{ '+' + a }} {{ a + '+' }} {{ a ~ '~' }} {{ a | string }} {{ a }} {{ a | tojson }} {{ a.city }} {{ a['city'] }} "
    "{% for k, v in a | items %}{{ k }}={{ v }}{% endfor %} {% for k, v in a.items() %}{{ k }}={{ v }}{% endfor %} "
    "{{ a is mapping }} {{ a is string }} {{ a | length }}"
)


def test_call_arguments_are_an_object_to_json_and_the_clients_string_to_concatenation(
    tmp_path: Path, demo_model: Path
) -> None:
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, ARGUMENT_OPERATIONS)))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city":"Paris"}'}}
    answered = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    request = chat(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}, answered]}
    )
    text = builder.chat_prompt(request.messages)  # type: ignore[attr-defined]
    assert text == (
        '+{"city":"Paris"} {"city":"Paris"}+ {"city":"Paris"}~ {"city":"Paris"} {"city":"Paris"} {"city": "Paris"} '
        "Paris Paris city=Paris city=Paris True False 1"
    )


def test_reasoning_effort_reaches_the_template_and_chat_template_kwargs_win(tmp_path: Path, demo_model: Path) -> None:
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, "effort={{ reasoning_effort }}")))
    low = chat({"reasoning_effort": "low"})
    assert builder.chat_prompt(low.messages, (), low.template_kwargs) == "effort=low"  # type: ignore[attr-defined]
    both = chat({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert builder.chat_prompt(both.messages, (), both.template_kwargs) == "effort=high"  # type: ignore[attr-defined]


def test_reasoning_reaches_the_template_also_as_thinking(tmp_path: Path, demo_model: Path) -> None:
    template = "{% for m in messages %}{{ m.thinking }}/{{ m.reasoning_content }}{% endfor %}"
    builder = PromptBuilder(ModelFiles(model_dir(tmp_path, demo_model, template)))
    request = chat(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x", "reasoning_content": "r"},
            ]
        }
    )
    assert builder.chat_prompt(request.messages) == "/r/r"  # type: ignore[attr-defined]


def test_a_chat_template_the_settings_name_replaces_the_models_own(tmp_path: Path, demo_model: Path) -> None:
    """chatTemplate (TOKENLINE_CHAT_TEMPLATE), as vLLM's --chat-template: a model whose template has no
    tools (DeepSeek-R1's distills) or a read-only model directory gets another one, which renders the
    prompts and teaches the tool-call format that is read; a file that cannot be read is named."""
    path = model_dir(tmp_path, demo_model, "{{ messages[0]['content'] }}")
    file = tmp_path / "tools.jinja"
    file.write_text("<tool_call>{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    settings = Settings(models=(ModelConfig("demo", path, chat_template=file),))
    entry = ModelRegistry(settings).get("demo")
    assert entry.prompts.chat_prompt(chat({}).messages) == "<tool_call>[user] hi"  # type: ignore[attr-defined]
    assert entry.tool_parser == "hermes"  # detected from the settings' template
    assert ModelRegistry(Settings(models=(ModelConfig("demo", path),))).get("demo").tool_parser == "none"
    missing = ModelFiles.of(path, tmp_path / "missing.jinja")
    with pytest.raises(ModelFilesError, match=r"the chat template .*missing\.jinja \(chatTemplate\) cannot be read"):
        missing.check()
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ModelFilesError, match=r"the chat template .*empty\.jinja \(chatTemplate\) is empty"):
        ModelFiles.of(path, tmp_path / "empty.jinja").check()
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ModelFilesError, match=r"the chat template in .*broken\.jinja does not compile"):
        compiled_template(ModelFiles.of(path, tmp_path / "broken.jinja"))
