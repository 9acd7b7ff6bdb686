"""POST /v1/chat/completions: messages (with tool calls and tool results), tools, response_format,
logprobs, chat_template_kwargs, on top of the shared sampling fields (schemas/requests.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from marshmallow import ValidationError, fields, post_load, validate, validates_schema

from schemas import guided
from schemas.fields import MessageContent, StrictBoolean, StrictFloat, StrictInteger
from schemas.requests import (
    MAX_CONTENT_CHARS,
    SamplingSchema,
    StreamOptionsSchema,
    StrictSchema,
    model_name,
    value_range,
)
from schemas.sampling import MAX_LOGPROBS

ROLES = ("system", "developer", "user", "assistant", "tool")
FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class Message:
    role: str
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: `developer` is a system message (as vLLM maps it),
        tool-call arguments are objects (Qwen's and Llama's templates apply `tojson` to them), and a
        null content (beside tool calls) is empty text, which every template can concatenate or trim."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def for_template(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    sampling: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None
    cache_salt: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"  # none, auto, required, or "function" (named: `tool_name`)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    grammar: str | None = None  # llguidance grammar from response_format or a forced tool choice
    logprobs: bool = False
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    user: str | None = None


class FunctionCallSchema(StrictSchema):
    name = fields.String(required=True, validate=validate.Regexp(FUNCTION_NAME))
    arguments = fields.String(required=True)

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        try:
            value = json.loads(data["arguments"])
        except ValueError:
            raise ValidationError("Must be a JSON object, as a string.", "arguments") from None
        if not isinstance(value, dict):
            raise ValidationError("Must be a JSON object, as a string.", "arguments")


class ToolCallSchema(StrictSchema):
    id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    type = fields.String(required=True, validate=validate.Equal("function"))
    function = fields.Nested(FunctionCallSchema, required=True)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ToolCall:
        return ToolCall(data["id"], data["function"]["name"], data["function"]["arguments"])


class MessageSchema(StrictSchema):
    role = fields.String(required=True, validate=validate.OneOf(ROLES))
    content = MessageContent(required=True, allow_none=True)
    name = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    tool_calls = fields.List(fields.Nested(ToolCallSchema), allow_none=True)
    tool_call_id = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    reasoning_content = fields.String(allow_none=True)

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        role = data.get("role")
        if data.get("tool_calls") and role != "assistant":
            raise ValidationError("Only assistant messages carry tool_calls.", "tool_calls")
        if data.get("content") is None and not (role == "assistant" and data.get("tool_calls")):
            raise ValidationError("Field may not be null.", "content")
        if role == "tool" and not data.get("tool_call_id"):
            raise ValidationError("A tool message must name the call it answers.", "tool_call_id")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> Message:
        return Message(
            role=data["role"],
            content=data.get("content"),
            name=data.get("name"),
            tool_calls=tuple(data.get("tool_calls") or ()),
            tool_call_id=data.get("tool_call_id"),
            reasoning_content=data.get("reasoning_content"),
        )


class FunctionSchema(StrictSchema):
    name = fields.String(
        required=True, validate=validate.Regexp(FUNCTION_NAME, error="Must match [A-Za-z0-9_.:-]{1,64}.")
    )
    description = fields.String(allow_none=True)
    parameters = fields.Dict(allow_none=True)
    strict = StrictBoolean(allow_none=True)


class ToolSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function"))
    function = fields.Nested(FunctionSchema, required=True)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> Tool:
        function = data["function"]
        return Tool(function["name"], function.get("description"), function.get("parameters") or {"type": "object"})


class NamedFunctionSchema(StrictSchema):
    name = fields.String(required=True)


class NamedToolChoiceSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function"))
    function = fields.Nested(NamedFunctionSchema, required=True)


class ToolChoiceField(fields.Field):
    """ "none" | "auto" | "required" | {"type": "function", "function": {"name": …}} → (choice, name)."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[str, str | None]:
        if isinstance(value, str):
            if value not in TOOL_CHOICES:
                raise ValidationError(f"Must be one of {', '.join(TOOL_CHOICES)}, or a named function.")
            return value, None
        if not isinstance(value, dict):
            raise ValidationError("Must be a string or an object naming a function.")
        named = NamedToolChoiceSchema().load(value)
        return "function", named["function"]["name"]


class JsonSchemaFormatSchema(StrictSchema):
    name = fields.String(required=True, validate=validate.Regexp(r"^[A-Za-z0-9_-]{1,64}$"))
    description = fields.String(allow_none=True)
    schema = fields.Dict(allow_none=True)
    strict = StrictBoolean(allow_none=True)


class ResponseFormatSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.OneOf(("text", "json_object", "json_schema")))
    json_schema = fields.Nested(JsonSchemaFormatSchema, allow_none=True)

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        if data["type"] == "json_schema" and not data.get("json_schema"):
            raise ValidationError("Required when type is json_schema.", "json_schema")
        if data["type"] != "json_schema" and data.get("json_schema"):
            raise ValidationError("Only allowed when type is json_schema.", "json_schema")


class ChatCompletionSchema(SamplingSchema):
    model = model_name(required=True)
    messages = fields.List(fields.Nested(MessageSchema), required=True, validate=validate.Length(min=1))
    max_completion_tokens = StrictInteger(allow_none=True, validate=value_range(0, None, False))
    # The seed table says (0.0, 2.0]; 0 is accepted as greedy because OpenAI clients send it.
    temperature = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, True))
    n = StrictInteger(allow_none=True, validate=value_range(1, None, True))
    stream_options = fields.Nested(StreamOptionsSchema, allow_none=True)
    tools = fields.List(fields.Nested(ToolSchema), allow_none=True, validate=validate.Length(max=128))
    tool_choice = ToolChoiceField(allow_none=True)
    parallel_tool_calls = StrictBoolean(allow_none=True)
    response_format = fields.Nested(ResponseFormatSchema, allow_none=True)
    logprobs = StrictBoolean(allow_none=True)
    top_logprobs = StrictInteger(allow_none=True, validate=value_range(0, MAX_LOGPROBS, True))
    chat_template_kwargs = fields.Dict(keys=fields.String(), allow_none=True)

    @validates_schema
    def _check_chat(self, data: dict[str, Any], **kwargs: Any) -> None:
        total = sum(len(m.content or "") for m in data.get("messages", ()))
        if total > MAX_CONTENT_CHARS:
            raise ValidationError(
                f"Total content is {total} characters; at most {MAX_CONTENT_CHARS} are allowed.", "messages"
            )
        self.check_max_tokens(data, "max_completion_tokens")
        n = data.get("n")
        if n is not None and n > self.limits.max_n:
            raise ValidationError(f"Must be in [1, {self.limits.max_n}].", "n")
        if data.get("stream_options") and not data.get("stream"):
            raise ValidationError("Only allowed when stream is true.", "stream_options")
        if data.get("top_logprobs") is not None and not data.get("logprobs"):
            raise ValidationError("Only allowed when logprobs is true.", "top_logprobs")
        self._check_tools(data)

    def _check_tools(self, data: dict[str, Any]) -> None:
        tools = data.get("tools") or []
        choice, name = data.get("tool_choice") or ("auto" if tools else "none", None)
        names = [t.name for t in tools]
        if len(set(names)) < len(names):
            raise ValidationError("Function names must be unique.", "tools")
        if choice in ("required", "function") and not tools:
            raise ValidationError(f"tool_choice {choice!r} needs tools.", "tool_choice")
        if choice == "function" and name not in names:
            raise ValidationError(f"No tool is named {name!r}.", "tool_choice")
        fmt = data.get("response_format")
        if choice in ("required", "function") and fmt and fmt["type"] != "text":
            raise ValidationError("Cannot be combined with a tool_choice that forces a call.", "response_format")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ChatRequest:
        if data.get("max_completion_tokens") is not None:
            data["max_tokens"] = data["max_completion_tokens"]
        tools = tuple(data.get("tools") or ())
        choice, name = data.get("tool_choice") or ("auto" if tools else "none", None)
        parallel = data.get("parallel_tool_calls") is not False
        options = data.get("stream_options") or {}
        return ChatRequest(
            model=data["model"],
            messages=tuple(data["messages"]),
            sampling=self.sampling_values(data),
            n=data.get("n") or 1,
            stream=bool(data.get("stream")),
            include_usage=bool(options.get("include_usage")),
            timeout=data.get("timeout"),
            cache_salt=data.get("cache_salt"),
            tools=tools,
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=parallel,
            grammar=_grammar(data.get("response_format"), tools, choice, name, parallel),
            logprobs=bool(data.get("logprobs")),
            top_logprobs=data.get("top_logprobs") or 0,
            template_kwargs=data.get("chat_template_kwargs") or {},
            user=data.get("user"),
        )


def _grammar(
    response_format: dict[str, Any] | None, tools: tuple[Tool, ...], choice: str, name: str | None, parallel: bool
) -> str | None:
    """The constraint a request asks for; ValidationError naming the field if it does not compile."""
    try:
        if choice == "function":
            return guided.named_tool(next(t.parameters for t in tools if t.name == name))
        if choice == "required":
            return guided.required_tools([(t.name, t.parameters) for t in tools], parallel)
    except guided.GrammarError as exc:
        raise ValidationError({"tools": [f"A function's parameters are not a usable JSON schema: {exc}"]}) from None
    if not response_format or response_format["type"] == "text":
        return None
    if response_format["type"] == "json_object":
        return guided.json_object()
    spec = response_format["json_schema"]
    try:
        return guided.json_schema(spec.get("schema") or {"type": "object"}, strict=spec.get("strict") is not False)
    except guided.GrammarError as exc:
        raise ValidationError({"response_format": {"json_schema": {"schema": [str(exc)]}}}) from None
