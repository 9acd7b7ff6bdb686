"""POST /v1/responses (OpenAI's Responses API): the request as OpenAI defines it, validated into a
`ResponsesRequest` whose input items are in their canonical shape (the shape they are stored and listed
in: schemas/response_items.py). app/responses_format.py turns it into the chat request that the service
runs.

Every field OpenAI defines is known here: honoured, or refused with a 400 that names it. Hosted tools
(web search, file search, code interpreter, MCP, computer use, …) are refused by their type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from marshmallow import ValidationError, fields, post_load, validate, validates_schema

from schemas.chat import (
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    SERVICE_TIERS,
    VALID_FUNCTION_NAME,
)
from schemas.fields import Metadata, Refused, StopField, StrictBoolean, StrictFloat, StrictInteger
from schemas.json_schemas import object_schema
from schemas.requests import MAX_CONTENT_CHARS, StrictSchema, asks_for_a_stream, model_name, value_range
from schemas.response_format import VALID_SCHEMA_NAME
from schemas.response_items import InputField
from schemas.sampling import MAX_LOGPROBS, MAX_SEED, MAX_STOP_SEQUENCES

RESPONSE_ID = r"^resp_[0-9a-f]{32}\Z"
LOGPROBS = "message.output_text.logprobs"  # what `include` may ask for
ENCRYPTED_REASONING = "reasoning.encrypted_content"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# Tools OpenAI runs on its side: tokenline has none of them.
HOSTED_TOOLS = {
    "web_search": "web search",
    "web_search_preview": "web search",
    "web_search_2025_08_26": "web search",
    "web_search_preview_2025_03_11": "web search",
    "file_search": "file search",
    "code_interpreter": "the code interpreter",
    "mcp": "remote MCP servers",
    "computer": "computer use",
    "computer_use_preview": "computer use",
    "image_generation": "image generation",
    "local_shell": "the local shell tool",
    "shell": "the shell tool",
    "apply_patch": "the apply_patch tool",
    "custom": "custom (free-form grammar) tools",
    "tool_search": "tool search",
}


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    items: tuple[dict[str, Any], ...]  # this request's input items, canonical (ids, typed parts)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # answered at once (queued); the response is stored as it ends
    tools: tuple[dict[str, Any], ...] = ()  # function tools in the Responses shape
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    reasoning_effort: str | None = None
    # "auto" or "detailed": the reasoning comes back as the reasoning item's summary (its text verbatim:
    # the most detailed summary there is), not as reasoning_text content.
    reasoning_summary: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)  # tokenline's and vLLM's sampling fields, as given
    truncation: str = "disabled"  # "auto": the conversation's oldest turns are left out where it is too long
    max_tool_calls: int | None = None  # echoed: it bounds built-in tools' calls, and there are none
    logprobs: bool = False  # include asks for message.output_text.logprobs
    encrypted_reasoning: bool = False  # include asks for reasoning.encrypted_content
    top_logprobs: int = 0


class FunctionToolSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function"))
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    description = fields.String(allow_none=True)
    parameters = fields.Dict(allow_none=True, validate=object_schema)
    strict = StrictBoolean(allow_none=True)
    defer_loading = Refused("deferred tool loading", allowed=(False,))
    # What happens anyway: the model calls the function directly, and waits for its output.
    allowed_callers = Refused("programmatic tool calls", allowed=(["direct"],))
    is_async = Refused("asynchronous function calls", allowed=(False,), data_key="async", attribute="async")
    output_schema = Refused("output schemas of functions")


class NamespaceToolSchema(StrictSchema):
    """A group of function tools under a name (Codex's `multi_agent_v1`): the model is shown its
    functions, and a call of one names the namespace (`function_tools`, `namespaces`)."""

    type = fields.String(required=True, validate=validate.Equal("namespace"))
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    description = fields.String(allow_none=True)
    tools = fields.List(fields.Nested(FunctionToolSchema), required=True, validate=validate.Length(min=1))


def function_tools(tools: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The functions the model is shown: each function tool, and each function of a namespace."""
    return [inner for tool in tools for inner in (tool["tools"] if tool["type"] == "namespace" else (tool,))]


def namespaces(tools: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The namespace of each function that is in one, by the function's name."""
    return {inner["name"]: tool["name"] for tool in tools if tool["type"] == "namespace" for inner in tool["tools"]}


class ToolsField(fields.Field):
    """Function tools and namespaces of them; a hosted tool is refused by its type."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[dict[str, Any], ...]:
        if not isinstance(value, list):
            raise ValidationError("Must be a list of tools.")
        if len(value) > 128:
            raise ValidationError("At most 128 tools are allowed.")
        tools = []
        for i, tool in enumerate(value):
            type_ = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(type_, str) and type_ in HOSTED_TOOLS:  # a list or an object is no type
                raise ValidationError({i: {"type": [f"tokenline does not support {HOSTED_TOOLS[type_]} ({type_})."]}})
            schema = NamespaceToolSchema() if type_ == "namespace" else FunctionToolSchema()
            try:
                tools.append(schema.load(tool if isinstance(tool, dict) else {}))
            except ValidationError as exc:
                raise ValidationError({i: exc.messages}) from None
        return tuple(tools)


class ResponsesAllowedToolSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function"))
    name = fields.String(required=True)


class ResponsesAllowedToolsSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("allowed_tools"))
    mode = fields.String(required=True, validate=validate.OneOf(("auto", "required")))
    tools = fields.List(fields.Nested(ResponsesAllowedToolSchema), required=True, validate=validate.Length(min=1))


class ResponsesToolChoice(fields.Field):
    """ "none" | "auto" | "required" | {"type": "function", "name"} | {"type": "allowed_tools", "mode",
    "tools": [{"type": "function", "name"}]}; hosted tools' choices refused."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, str):
            if value not in ("none", "auto", "required"):
                raise ValidationError("Must be none, auto, required, or a named function.")
            return value
        if not isinstance(value, dict):
            raise ValidationError("Must be a string or an object naming a function.")
        type_ = value.get("type")
        if type_ == "allowed_tools":
            return ResponsesAllowedToolsSchema().load(value)
        if type_ != "function":
            raise ValidationError({"type": [f"tokenline supports function tool choices only, not {type_!r}."]})
        if set(value) != {"type", "name"} or not isinstance(value["name"], str):
            raise ValidationError("A function choice is {'type': 'function', 'name': <name>}.")
        return {"type": "function", "name": value["name"]}


class ResponsesTextFormatSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.OneOf(("text", "json_object", "json_schema")))
    name = fields.String(validate=VALID_SCHEMA_NAME)
    schema = fields.Dict()
    description = fields.String(allow_none=True)
    strict = StrictBoolean(allow_none=True)

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        if data["type"] == "json_schema":
            for key in ("name", "schema"):
                if key not in data:
                    raise ValidationError("Required when type is json_schema.", key)
        elif set(data) - {"type"}:
            raise ValidationError("Only allowed when type is json_schema.", sorted(set(data) - {"type"})[0])


class ResponsesTextSchema(StrictSchema):
    format = fields.Nested(ResponsesTextFormatSchema, allow_none=True)
    verbosity = Refused("verbosity", allowed=("medium",))


SUMMARIES = ("auto", "detailed")


def _summary(value: str) -> None:
    if value == "concise":
        raise ValidationError(
            "tokenline summarizes reasoning only as the reasoning itself: 'auto' or 'detailed' give its text "
            "as the summary; it writes no concise one."
        )
    if value not in (*SUMMARIES, "none"):
        raise ValidationError("Must be one of: auto, detailed, none.")


class ResponsesReasoningSchema(StrictSchema):
    effort = fields.String(allow_none=True, validate=validate.OneOf(REASONING_EFFORTS))
    summary = fields.String(allow_none=True, validate=_summary)
    generate_summary = fields.String(allow_none=True, validate=_summary)  # summary's deprecated name

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        summary, deprecated = data.get("summary"), data.get("generate_summary")
        if summary is not None and deprecated is not None and summary != deprecated:
            raise ValidationError(f"Contradicts summary {summary!r}, its newer name; give one.", "generate_summary")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        summary, deprecated = data.pop("summary", None), data.pop("generate_summary", None)
        return {**data, "summary": next((s for s in (summary, deprecated) if s in SUMMARIES), None)}


class ResponsesStreamOptionsSchema(StrictSchema):
    include_obfuscation = Refused("stream obfuscation", allowed=(False,))


class ResponsesSchema(StrictSchema):
    model = model_name(required=True)
    input = InputField(required=True)
    instructions = fields.String(allow_none=True, validate=validate.Length(max=MAX_CONTENT_CHARS))
    previous_response_id = fields.String(
        allow_none=True, validate=validate.Regexp(RESPONSE_ID, error="Not a response id of this server.")
    )
    store = StrictBoolean(allow_none=True)
    stream = StrictBoolean(allow_none=True)
    background = StrictBoolean(allow_none=True)
    stream_options = fields.Nested(ResponsesStreamOptionsSchema, allow_none=True)
    tools = ToolsField(allow_none=True)
    tool_choice = ResponsesToolChoice(allow_none=True)
    parallel_tool_calls = StrictBoolean(allow_none=True)
    text = fields.Nested(ResponsesTextSchema, allow_none=True)
    reasoning = fields.Nested(ResponsesReasoningSchema, allow_none=True)
    max_output_tokens = StrictInteger(allow_none=True, validate=value_range(0, None, False))
    temperature = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, True))
    top_p = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, False))
    metadata = Metadata(MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE, allow_none=True)
    user = fields.String(allow_none=True, validate=validate.Length(max=256))
    safety_identifier = fields.String(allow_none=True, validate=validate.Length(max=64))
    prompt_cache_key = fields.String(allow_none=True, validate=validate.Length(max=1024))
    # Codex's: its session, thread and turn ids, which say nothing about the answer; taken, not stored.
    client_metadata = fields.Dict(keys=fields.String(), values=fields.String(), allow_none=True)
    # What happens anyway: one tier, an in-memory prefix cache.
    service_tier = fields.String(allow_none=True, validate=validate.OneOf(SERVICE_TIERS))
    prompt_cache_retention = Refused("24-hour prompt cache retention", allowed=("in_memory",))
    truncation = fields.String(allow_none=True, validate=validate.OneOf(("auto", "disabled")))
    # A bound on built-in tools' calls, of which tokenline makes none (function calls are the client's).
    max_tool_calls = StrictInteger(allow_none=True, validate=value_range(0, None, True))
    # Known and not served.
    # Of what `include` may ask for, the message tokens' logprobs (top_logprobs alternatives each) and
    # the reasoning as encrypted_content.
    include = fields.List(
        fields.String(
            validate=validate.OneOf(
                (LOGPROBS, ENCRYPTED_REASONING),
                error="tokenline includes only message.output_text.logprobs and reasoning.encrypted_content "
                "(not hosted tools' outputs, nor input images).",
            )
        ),
        allow_none=True,
        validate=validate.Length(max=16),
    )
    top_logprobs = StrictInteger(allow_none=True, validate=value_range(0, MAX_LOGPROBS, True))
    conversation = Refused("the Conversations API (use previous_response_id)")
    prompt = Refused("prompt templates")
    context_management = Refused("context management (compaction)")
    moderation = Refused("moderation")
    prompt_cache_options = Refused("prompt cache options")
    # tokenline's and vLLM's sampling fields, beside OpenAI's.
    top_k = StrictInteger(allow_none=True)
    min_p = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, True))
    repetition_penalty = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, False))
    presence_penalty = StrictFloat(allow_none=True, validate=value_range(-2.0, 2.0, True))
    frequency_penalty = StrictFloat(allow_none=True, validate=value_range(-2.0, 2.0, True))
    seed = StrictInteger(allow_none=True, validate=value_range(0, MAX_SEED, False))
    ignore_eos = StrictBoolean(allow_none=True)
    stop = fields.Raw(allow_none=True, metadata={"description": "tokenline's: stop strings"})
    cache_salt = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    timeout = StrictFloat(allow_none=True, validate=value_range(0.0, None, False))

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        total = len(data.get("instructions") or "") + sum(_item_chars(item) for item in data.get("input", ()))
        if total > MAX_CONTENT_CHARS:
            raise ValidationError(
                f"Total content is {total} characters; at most {MAX_CONTENT_CHARS} are allowed.", "input"
            )
        if asks_for_a_stream(data.get("stream_options")) and not data.get("stream"):
            raise ValidationError("Only allowed when stream is true.", "stream_options")
        if data.get("background") and data.get("store") is False:
            raise ValidationError("A background response is stored: it needs store true.", "background")
        if data.get("background") and data.get("stream"):
            raise ValidationError("tokenline does not stream background responses; poll or leave it out.", "background")
        if data.get("stop") is not None:
            try:
                StopField(MAX_STOP_SEQUENCES).deserialize(data["stop"])
            except ValidationError as exc:
                raise ValidationError(exc.messages, "stop") from None

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ResponsesRequest:
        extra_fields = (
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "seed",
            "ignore_eos",
        )
        extra = {k: data[k] for k in (*extra_fields, "stop", "cache_salt", "timeout") if data.get(k) is not None}
        return ResponsesRequest(
            model=data["model"],
            items=data["input"],
            instructions=data.get("instructions"),
            previous_response_id=data.get("previous_response_id"),
            store=data.get("store") is not False,
            stream=bool(data.get("stream")),
            background=bool(data.get("background")),
            tools=tuple(data.get("tools") or ()),
            tool_choice=data.get("tool_choice") or "auto",
            parallel_tool_calls=data.get("parallel_tool_calls") is not False,
            text_format=(data.get("text") or {}).get("format") or {"type": "text"},
            reasoning_effort=(data.get("reasoning") or {}).get("effort"),
            reasoning_summary=(data.get("reasoning") or {}).get("summary"),
            max_output_tokens=data.get("max_output_tokens"),
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
            metadata=data.get("metadata") or {},
            user=data.get("user"),
            safety_identifier=data.get("safety_identifier"),
            prompt_cache_key=data.get("prompt_cache_key"),
            service_tier=data.get("service_tier") or "auto",
            extra=extra,
            truncation=data.get("truncation") or "disabled",
            max_tool_calls=data.get("max_tool_calls"),
            logprobs=LOGPROBS in (data.get("include") or ()),
            encrypted_reasoning=ENCRYPTED_REASONING in (data.get("include") or ()),
            top_logprobs=data.get("top_logprobs") or 0,
        )


def _item_chars(item: dict[str, Any]) -> int:
    if item["type"] == "message":
        return sum(len(p.get("text") or p.get("refusal") or "") for p in item["content"])
    if item["type"] == "function_call":
        return len(item["arguments"])
    if item["type"] == "function_call_output":
        return len(item["output"])
    return sum(len(p["text"]) for p in item.get("content") or ())
