"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the request as
Anthropic defines it, validated into a `MessagesRequest` with content blocks in their canonical shape.
app/anthropic_format.py turns it into the chat request that the service runs.

The fields of Anthropic's Messages API as of its 2025 version are known here: honoured, or refused
with a 400 that names it; a field added since is refused as unknown, by name. Server tools (web
search, code execution, bash, text editor, computer use, …) are refused by their type.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from marshmallow import ValidationError, fields, post_load, validate, validates_schema

from schemas.chat import VALID_FUNCTION_NAME
from schemas.fields import BoundedList, Refused, StrictBoolean, StrictFloat, StrictInteger
from schemas.json_schemas import instance_problem, object_schema
from schemas.requests import MAX_CONTENT_CHARS, StrictSchema, model_name, value_range
from schemas.response_items import direct_caller, load_variant
from schemas.sampling import MAX_SEED, MAX_STOP_SEQUENCES

MAX_MESSAGES = 2048
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
# Block types that need what a text model or tokenline lacks: refused by type.
UNSUPPORTED_BLOCKS = {
    "image": "images (this is a text model)",
    "document": "documents (this is a text model)",
    "search_result": "search result blocks",
    "redacted_thinking": "redacted thinking (it is encrypted by Anthropic)",
    "server_tool_use": "server tools",
    "web_search_tool_result": "server tools",
    "web_fetch_tool_result": "server tools",
    "code_execution_tool_result": "server tools",
    "container_upload": "containers",
    "mcp_tool_use": "MCP servers",
    "mcp_tool_result": "MCP servers",
}
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking"), "system": ("text",)}


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    messages: tuple[dict[str, Any], ...]  # {"role", "content": [blocks]}
    max_tokens: int | None = None  # None only for count_tokens
    system: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: dict[str, Any] = field(default_factory=lambda: {"type": "auto"})
    stop_sequences: tuple[str, ...] = ()
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    user: str | None = None
    thinking: bool | None = None  # enable_thinking for the chat template; None: the template's default
    output_schema: dict[str, Any] | None = None  # output_config.format's JSON schema
    effort: str | None = None  # output_config.effort
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks come without their text
    extra: dict[str, Any] = field(default_factory=dict)


def _text_blocks(value: Any) -> str:
    """A string, or a list of text blocks (each loaded as a message's text block is), as one text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValidationError("Must be a string or a list of text blocks.")
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict):
            raise ValidationError({i: ["Must be a text block."]})
        loaded = load_variant(i, block, block.get("type"), TEXT_BLOCK, UNSUPPORTED_BLOCKS, "Must be a text block, not")
        texts.append(loaded["text"])
    return "\n".join(texts)


class TextField(fields.Field):
    """`system`, or a tool result's `content`: a string or a list of text blocks, as one text."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> str:
        return _text_blocks(value)


class CacheControlSchema(StrictSchema):
    """Anthropic's breakpoint marker, taken as it is (prefix caching is automatic): an ephemeral entry,
    kept 5 minutes or an hour."""

    type = fields.String(required=True, validate=validate.Equal("ephemeral"))
    ttl = fields.String(allow_none=True, validate=validate.OneOf(("5m", "1h")))


class TextBlockSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("text"))
    # Anthropic refuses empty text blocks (and a message's empty string, one such block).
    text = fields.String(required=True, validate=validate.Length(min=1, error="Must not be empty."))
    cache_control = fields.Nested(CacheControlSchema, allow_none=True)  # prompt caching is automatic
    citations = Refused("citations", allowed=([],))


TEXT_BLOCK = {"text": TextBlockSchema()}


class ToolUseBlockSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("tool_use"))
    id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    input = fields.Dict(required=True)
    cache_control = fields.Nested(CacheControlSchema, allow_none=True)
    # What the anthropic SDK (2.14) may send back with a block it received (a model_dump() keeps them as
    # null): honoured where they say what tokenline's calls are (made by the model directly, in no toolset).
    caller = fields.Raw(allow_none=True, validate=lambda value: direct_caller(value))
    toolset_name = fields.Raw(
        allow_none=True, validate=validate.Equal(None, error="tokenline's tools belong to no toolset.")
    )

    @post_load
    def _honoured(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        for honoured in ("caller", "toolset_name"):
            data.pop(honoured, None)
        return data


class ToolResultBlockSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("tool_result"))
    tool_use_id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    content = TextField(load_default="")
    is_error = StrictBoolean(allow_none=True)
    cache_control = fields.Nested(CacheControlSchema, allow_none=True)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {**data, "is_error": bool(data.get("is_error"))}


class ThinkingBlockSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("thinking"))
    thinking = fields.String(required=True)
    signature = fields.String(allow_none=True)


BLOCK_SCHEMAS = {
    "text": TextBlockSchema(),
    "tool_use": ToolUseBlockSchema(),
    "tool_result": ToolResultBlockSchema(),
    "thinking": ThinkingBlockSchema(),
}


class ContentField(fields.Field):
    """A message's content: a string (one text block) or a list of blocks, each loaded by its type."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[dict[str, Any], ...]:
        if isinstance(value, str):
            if not value:
                raise ValidationError("Must not be empty.")
            return ({"type": "text", "text": value},)
        if not isinstance(value, list) or not value:
            raise ValidationError("Must be a string or a non-empty list of content blocks.")
        return tuple(self._block(i, block) for i, block in enumerate(value))

    @staticmethod
    def _block(index: int, block: Any) -> dict[str, Any]:
        if not isinstance(block, dict):
            raise ValidationError({index: ["Must be an object."]})
        return load_variant(
            index, block, block.get("type"), BLOCK_SCHEMAS, UNSUPPORTED_BLOCKS, "Unknown content block type"
        )


class AnthropicMessageSchema(StrictSchema):
    """A turn of the conversation: user, assistant, or a system message among them (what Claude Code
    sends; its text is a system message there, for the templates that take one mid-conversation)."""

    role = fields.String(required=True, validate=validate.OneOf(("user", "assistant", "system")))
    content = ContentField(required=True)
    # A system message's: "never" (shown on every request: the default) or "next_user_message" (shown
    # only until a user message follows it).
    clear_at = fields.String(allow_none=True, validate=validate.OneOf(("next_user_message", "never")))

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        allowed = BLOCKS.get(data.get("role", ""), ())
        for i, block in enumerate(data.get("content", ())):
            if block["type"] not in allowed:
                raise ValidationError(
                    {i: {"type": [f"A {data['role']} message holds no {block['type']} blocks."]}}, "content"
                )
        if data.get("clear_at") is not None and data.get("role") != "system":
            raise ValidationError("Only on a system message.", "clear_at")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        message = {"role": data["role"], "content": list(data["content"])}
        if data.get("clear_at") == "next_user_message":
            message["clear_at"] = "next_user_message"
        return message


class ContextEditSchema(StrictSchema):
    """What Claude Code sends with thinking on: clear no thinking (`keep: "all"`), which is what happens
    (every thinking block goes to the template, which renders what its model was trained on). An
    edit that clears anything is refused: tokenline does not cut the conversation it is sent."""

    type = fields.String(
        required=True,
        validate=validate.Equal(
            "clear_thinking_20251015", error="tokenline does not clear the conversation: only clear_thinking_20251015."
        ),
    )
    keep = fields.Raw(
        required=True,
        validate=validate.Equal("all", error="tokenline clears no thinking: only 'all' (what happens)."),
    )


class ContextManagementSchema(StrictSchema):
    edits = fields.List(fields.Nested(ContextEditSchema), allow_none=True)


class ToolSchema(StrictSchema):
    type = fields.String(allow_none=True, validate=validate.Equal("custom"))
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    description = fields.String(allow_none=True)
    input_schema = fields.Dict(required=True, validate=object_schema)
    cache_control = fields.Nested(CacheControlSchema, allow_none=True)
    strict = StrictBoolean(allow_none=True)
    # true or null: the input streams as the model writes it (what happens); false: in one delta at its end.
    eager_input_streaming = StrictBoolean(allow_none=True)
    # Inputs the tool takes, each valid by its input_schema (else a 400, as Anthropic answers): the
    # model reads them after the tool's description.
    input_examples = fields.List(fields.Dict(), allow_none=True)
    defer_loading = Refused("deferred tool loading", allowed=(False,))
    allowed_callers = Refused("programmatic tool calls", allowed=(["direct"],))  # direct: what happens

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        for i, example in enumerate(data.get("input_examples") or ()):
            problem = instance_problem(data.get("input_schema") or {}, example)
            if problem is not None:
                raise ValidationError({i: [f"Not valid by the tool's input_schema: {problem}."]}, "input_examples")


class ToolsField(fields.Field):
    """Custom (client) tools; a server tool (`web_search_20250305`, `bash_20250124`, …) is refused by type."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[dict[str, Any], ...]:
        if not isinstance(value, list):
            raise ValidationError("Must be a list of tools.")
        if len(value) > 128:
            raise ValidationError("At most 128 tools are allowed.")
        tools = []
        for i, tool in enumerate(value):
            type_ = tool.get("type") if isinstance(tool, dict) else None
            if type_ not in ("custom", None):
                raise ValidationError({i: {"type": [f"tokenline does not support server tools ({type_})."]}})
            try:
                tools.append(ToolSchema().load(tool if isinstance(tool, dict) else {}))
            except ValidationError as exc:
                raise ValidationError({i: exc.messages}) from None
        return tuple(tools)


class AnthropicToolChoiceSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.OneOf(("auto", "any", "tool", "none")))
    name = fields.String()
    disable_parallel_tool_use = StrictBoolean(allow_none=True)

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        if (data["type"] == "tool") != ("name" in data):
            raise ValidationError("Required when type is tool, and only then.", "name")


class AnthropicThinkingSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.OneOf(("enabled", "disabled", "adaptive")))
    # The most tokens the model's <think> may run (vLLM's thinking_token_budget); Anthropic's bounds.
    budget_tokens = StrictInteger(allow_none=True, validate=value_range(MIN_THINKING_BUDGET, None, True))
    # summarized: the thinking as it is written (what happens); omitted: its blocks come empty.
    display = fields.String(allow_none=True, validate=validate.OneOf(("summarized", "omitted")))

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        if data.get("budget_tokens") is not None and data["type"] != "enabled":
            raise ValidationError("Only with type 'enabled'.", "budget_tokens")
        if data.get("display") is not None and data["type"] == "disabled":
            raise ValidationError("Only with type 'enabled' or 'adaptive'.", "display")


class AnthropicOutputFormatSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("json_schema"))
    json_schema = fields.Dict(required=True, data_key="schema")


class AnthropicOutputConfigSchema(StrictSchema):
    """Structured outputs (`format`: the reply's text is JSON of the schema, as a chat request's
    response_format json_schema) and `effort`, passed to the chat template as reasoning_effort (the
    levels chat templates know; Anthropic's `xhigh` and `max` are refused)."""

    effort = fields.String(allow_none=True, validate=validate.OneOf(("low", "medium", "high")))
    format = fields.Nested(AnthropicOutputFormatSchema, allow_none=True)


class AnthropicMetadataSchema(StrictSchema):
    user_id = fields.String(allow_none=True, validate=validate.Length(max=256))


class CountTokensSchema(StrictSchema):
    """What /v1/messages/count_tokens reads; /v1/messages adds generation's fields (MessagesSchema)."""

    model = model_name(required=True)
    messages = BoundedList(fields.Nested(AnthropicMessageSchema), required=True, max_items=MAX_MESSAGES)
    system = TextField(allow_none=True)
    tools = ToolsField(allow_none=True)
    tool_choice = fields.Nested(AnthropicToolChoiceSchema, allow_none=True)
    thinking = fields.Nested(AnthropicThinkingSchema, allow_none=True)
    output_config = fields.Nested(AnthropicOutputConfigSchema, allow_none=True)
    # Automatic caching's marker, as the blocks' own: prefix caching is automatic.
    cache_control = fields.Nested(CacheControlSchema, allow_none=True)
    mcp_servers = Refused("MCP servers", allowed=([],))
    context_management = fields.Nested(ContextManagementSchema, allow_none=True)
    container = Refused("containers")

    @validates_schema
    def _check_content(self, data: dict[str, Any], **kwargs: Any) -> None:
        total = len(data.get("system") or "") + sum(_chars(m) for m in data.get("messages", ()))
        if total > MAX_CONTENT_CHARS:
            raise ValidationError(
                f"Total content is {total} characters; at most {MAX_CONTENT_CHARS} are allowed.", "messages"
            )
        messages = data.get("messages") or []
        _check_prefill(messages)
        _check_results(messages)
        _check_answered(messages)
        choice = data.get("tool_choice") or {}
        names = [tool["name"] for tool in data.get("tools") or ()]
        if choice.get("type") in ("any", "tool") and not names:
            raise ValidationError(f"tool_choice {choice['type']!r} needs tools.", "tool_choice")
        if choice.get("type") == "tool" and choice["name"] not in names:
            raise ValidationError(f"No tool is named {choice['name']!r}.", "tool_choice")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> MessagesRequest:
        thinking = (data.get("thinking") or {}).get("type")
        output = data.get("output_config") or {}
        extra = {
            k: data[k]
            for k in ("seed", "min_p", "repetition_penalty", "cache_salt", "timeout")
            if data.get(k) is not None
        }
        budget = (data.get("thinking") or {}).get("budget_tokens")
        if budget is not None:
            extra["thinking_token_budget"] = budget
        return MessagesRequest(
            model=data["model"],
            messages=tuple(data["messages"]),
            max_tokens=data.get("max_tokens"),
            system=data.get("system"),
            tools=tuple(data.get("tools") or ()),
            tool_choice=data.get("tool_choice") or {"type": "auto"},
            stop_sequences=tuple(data.get("stop_sequences") or ()),
            stream=bool(data.get("stream")),
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
            top_k=data.get("top_k"),
            user=(data.get("metadata") or {}).get("user_id"),
            thinking=None if thinking is None or thinking == "adaptive" else thinking == "enabled",
            output_schema=(output.get("format") or {}).get("json_schema"),
            effort=output.get("effort"),
            extra=extra,
            omit_thinking=(data.get("thinking") or {}).get("display") == "omitted",
        )


class MessagesSchema(CountTokensSchema):
    max_tokens = StrictInteger(required=True, validate=value_range(0, None, False))
    stop_sequences = fields.List(
        fields.String(validate=validate.Length(min=1)),
        allow_none=True,
        validate=validate.Length(max=MAX_STOP_SEQUENCES),
    )
    stream = StrictBoolean(allow_none=True)
    temperature = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, True))
    top_p = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, False))
    top_k = StrictInteger(allow_none=True, validate=value_range(0, None, False))
    metadata = fields.Nested(AnthropicMetadataSchema, allow_none=True)
    # Every request gets the one tier.
    service_tier = fields.String(allow_none=True, validate=validate.OneOf(("auto", "standard_only")))
    inference_geo = Refused("inference geography")
    diagnostics = Refused("request diagnostics")
    # Anthropic's message threads (the server keeps the conversation): the refusal carries the details
    # that make the SDKs' tool runners send the conversation whole instead (app/anthropic_format.py).
    thread = Refused("message threads (send the whole conversation)")
    user_profile_id = Refused("user profiles")
    workspace_id = Refused("workspaces")
    # Every request runs at the one speed.
    speed = fields.String(
        allow_none=True,
        validate=validate.OneOf(("standard",), error="Must be 'standard': tokenline has no fast mode."),
    )
    # tokenline's and vLLM's sampling fields, beside Anthropic's.
    seed = StrictInteger(allow_none=True, validate=value_range(0, MAX_SEED, False))
    min_p = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, True))
    repetition_penalty = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, False))
    cache_salt = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    timeout = StrictFloat(allow_none=True, validate=value_range(0.0, None, False))

    @validates_schema
    def _check_budget(self, data: dict[str, Any], **kwargs: Any) -> None:
        budget = (data.get("thinking") or {}).get("budget_tokens")
        if budget is not None and budget >= data.get("max_tokens", 0):
            raise ValidationError("Must be less than max_tokens (as Anthropic requires).", "thinking.budget_tokens")


def _check_prefill(messages: list[dict[str, Any]]) -> None:
    """A final assistant turn is a prefill: the answer continues its text. Its last block is that text,
    without trailing whitespace (as Anthropic requires: a tokenizer would end it with a token the model
    rarely follows), and it calls no tool (nothing would answer the call)."""
    last = len(messages) - 1
    if last < 0 or messages[last]["role"] != "assistant":
        return
    i = last
    while i >= 0 and messages[i]["role"] == "assistant":  # consecutive turns of one role are one turn
        for j, block in enumerate(messages[i]["content"]):
            if block["type"] == "tool_use":
                error = "A final assistant turn (a prefill) is continued as text: its tool_use has no tool_result."
                raise ValidationError({i: {"content": {j: {"type": [error]}}}}, "messages")
        i -= 1
    blocks = messages[last]["content"]
    if not blocks or blocks[-1]["type"] != "text":
        error = "A final assistant turn (a prefill) must end with text."
        raise ValidationError({last: {"content": [error]}}, "messages")
    if blocks[-1]["text"] != blocks[-1]["text"].rstrip():
        error = "final assistant content cannot end with trailing whitespace"
        raise ValidationError({last: {"content": {len(blocks) - 1: {"text": [error]}}}}, "messages")


def _check_results(messages: list[dict[str, Any]]) -> None:
    """Each tool_result answers a tool_use of the assistant turn just before it (consecutive messages of
    one role are one turn), once, as Anthropic requires: a result answering nothing was taken, and the
    answer ignored it. tool_use ids are unique in the conversation: the chat template pairs a call
    and its result by id."""
    offered: set[str] = set()
    used: set[str] = set()
    answered: set[str] = set()
    previous = None
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            offered = offered if previous == "assistant" else set()
            for j, block in enumerate(message["content"]):
                if block["type"] == "tool_use":
                    if block["id"] in used:
                        error = f"tool_use ids must be unique: {block['id']!r} is used before."
                        raise ValidationError({i: {"content": {j: {"id": [error]}}}}, "messages")
                    used.add(block["id"])
                    offered.add(block["id"])
        else:
            answered = answered if previous == message["role"] else set()
            for j, block in enumerate(message["content"]):
                if block["type"] != "tool_result":
                    continue
                if block["tool_use_id"] not in offered:
                    error = f"No tool_use block with id {block['tool_use_id']!r} in the assistant turn before it."
                elif block["tool_use_id"] in answered:
                    error = f"The tool_use block with id {block['tool_use_id']!r} has a tool_result already."
                else:
                    answered.add(block["tool_use_id"])
                    continue
                raise ValidationError({i: {"content": {j: {"tool_use_id": [error]}}}}, "messages")
        previous = message["role"]


def _check_answered(messages: list[dict[str, Any]]) -> None:
    """Each tool_use has its tool_result in the user turn after it, as Anthropic requires: a call sent
    back without its result would be answered as though its tool had returned nothing. (A final
    assistant turn's call is refused as a prefill's.)"""
    turns: list[list[int]] = []  # the messages of each turn (consecutive messages of one role)
    for i, message in enumerate(messages):
        if turns and messages[turns[-1][0]]["role"] == message["role"]:
            turns[-1].append(i)
        else:
            turns.append([i])
    for turn, after in itertools.pairwise(turns):
        if messages[turn[0]]["role"] != "assistant":
            continue
        results = {b["tool_use_id"] for i in after for b in messages[i]["content"] if b["type"] == "tool_result"}
        for i in turn:
            missing = [b["id"] for b in messages[i]["content"] if b["type"] == "tool_use" and b["id"] not in results]
            if missing:
                error = (
                    f"tool_use ids were found without tool_result blocks immediately after: {', '.join(missing)}. "
                    "Each tool_use block must have a corresponding tool_result block in the next message."
                )
                raise ValidationError({i: {"content": [error]}}, "messages")


def _chars(message: dict[str, Any]) -> int:
    total = 0
    for block in message["content"]:
        total += len(block.get("text") or block.get("thinking") or "")
        if block["type"] == "tool_result":
            total += len(block["content"])
    return total
