"""POST /v1/chat/completions: messages (with tool calls and tool results), tools, response_format,
logprobs, chat_template_kwargs, on top of the shared sampling fields (schemas/requests.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from marshmallow import ValidationError, fields, post_load, validate, validates_schema

from schemas.errors import InvalidRequest
from schemas.fields import (
    BoundedList,
    MessageContent,
    Metadata,
    Refused,
    StrictBoolean,
    StrictFloat,
    StrictInteger,
    content_chars,
)
from schemas.json_schemas import object_schema
from schemas.requests import (
    MAX_CONTENT_CHARS,
    SamplingSchema,
    StreamOptionsSchema,
    StrictSchema,
    asks_for_a_stream,
    model_name,
    value_range,
)
from schemas.response_format import ResponseFormatSchema, answer_format, request_grammar
from schemas.sampling import MAX_LOGPROBS
from schemas.structured_outputs import StructuredOutputsSchema, structured_grammar

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
SERVICE_TIERS = ("auto", "default")  # what every request gets; "flex", "scale", "priority" are refused
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}\Z"
# A function's name, as OpenAI takes it (a response format's schema's: schemas/response_format.py).
# marshmallow formats a validator's error message with str.format: braces in it would be fields.
VALID_FUNCTION_NAME = validate.Regexp(
    FUNCTION_NAME, error="Must be 1 to 64 characters, each a letter, a digit, '_', '.', ':' or '-'."
)
TOOL_CHOICES = ("none", "auto", "required")
MAX_MESSAGES = 2048  # OpenAI's bound, and the Messages and Responses APIs'; checked before they are read


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class TemplateArguments(dict[str, Any]):
    """A tool call's arguments as chat templates read them: an object under `tojson`, `items` and
    key access (Qwen's and Llama's templates apply `tojson`, which would encode a string twice), and
    the client's own string under `+`, `~` and printing (functionary's and DeepSeek's templates
    concatenate it, as transformers lets them)."""

    def __init__(self, text: str) -> None:
        super().__init__(json.loads(text))
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self.text + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self.text
        return NotImplemented


@dataclass(frozen=True)
class Message:
    role: str
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it, as transformers passes it, except where vLLM's choice
        renders on more templates: `developer` is a system message, tool-call arguments are
        `TemplateArguments`, and a null or absent content is empty text (transformers drops the key,
        and templates such as Qwen3's then fail). Reasoning is also passed as `thinking`, which
        gpt-oss's template reads (transformers does the same)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": TemplateArguments(call.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message = {"thinking": self.reasoning_content, **message, "reasoning_content": self.reasoning_content}
        return message


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `spec` is the client's tool object as sent (key order and keys
    such as `strict` kept), which is what transformers hands the chat template."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    spec: dict[str, Any] = field(default_factory=dict, compare=False)

    def for_template(self) -> dict[str, Any]:
        return self.spec

    @property
    def strict(self) -> bool:
        """The client asked for arguments that follow the schema (OpenAI's `strict`)."""
        return bool((self.spec.get("function") or {}).get("strict"))


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
    grammar_param: str | None = None  # the field whose schema the grammar follows
    # A JSON response_format's schema and strictness: with tools under `auto`, the answer is that JSON
    # or the model's calls (app/service.py's auto_calls).
    answer_format: tuple[dict[str, Any], bool] | None = None
    max_tokens_param: str = "max_tokens"  # the field that set sampling["max_tokens"]
    logprobs: bool = False
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    continuous_usage: bool = False
    # vLLM's: the conversation rendered without the assistant turn's opening; or cut after the final
    # message's text, which the model continues (an assistant prefill).
    generation_prompt: bool = True
    continue_final: bool = False
    add_special_tokens: bool = False
    truncate_prompt_tokens: int | None = None  # vLLM's: the rendered prompt's last N tokens
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids
    thinking_budget: int | None = None  # vLLM's thinking_token_budget
    echo: bool = False  # vLLM's: the answer begins with a final assistant message's text


def json_object_text(text: str) -> None:
    """A call's arguments sent back: a JSON object, as a string (chat's and Responses' calls)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested deeper than the parser recurses
        raise ValidationError("Must be a JSON object, as a string.") from None
    if not isinstance(value, dict):
        raise ValidationError("Must be a JSON object, as a string.")


class FunctionCallSchema(StrictSchema):
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    arguments = fields.String(required=True, validate=json_object_text)


class ToolCallSchema(StrictSchema):
    id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    type = fields.String(required=True, validate=validate.Equal("function"))
    function = fields.Nested(FunctionCallSchema, required=True)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ToolCall:
        return ToolCall(data["id"], data["function"]["name"], data["function"]["arguments"])


def check_tool_replies(messages: Sequence[Message]) -> None:
    """As OpenAI's chat API: an assistant message's tool calls are each answered by a tool message
    right after it (before a message of another role), and a tool message answers a call of the
    assistant message before it; InvalidRequest naming the message otherwise (vLLM renders such a
    conversation as it is, as no model was trained on it). The Responses and Messages APIs, whose
    conversations become chat's, keep their own rules."""
    unanswered: dict[str, int] = {}  # the calls of the last assistant message: id → its index
    for i, message in enumerate(messages):
        if message.role == "tool":
            if unanswered.pop(message.tool_call_id or "", None) is None:
                param = f"messages[{i}].tool_call_id"
                raise InvalidRequest(f"{param}: Answers no tool call of the assistant message before it.", param=param)
            continue
        if unanswered:
            _not_answered(unanswered)
        if message.role == "assistant":
            unanswered = {call.id: i for call in message.tool_calls}
    if unanswered:
        _not_answered(unanswered)


def _not_answered(unanswered: dict[str, int]) -> None:
    param = f"messages[{next(iter(unanswered.values()))}].tool_calls"
    ids = ", ".join(unanswered)
    raise InvalidRequest(
        f"{param}: Each call must be answered by a tool message after it; not answered: {ids}.", param=param
    )


def _refused(message: str) -> Any:
    """A validator for a field taken only as null (marshmallow does not validate a null)."""

    def refuse(_value: Any) -> None:
        raise ValidationError(message)

    return refuse


class MessageSchema(StrictSchema):
    role = fields.String(required=True, validate=validate.OneOf(ROLES))
    content = MessageContent(allow_none=True)
    name = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    tool_calls = fields.List(fields.Nested(ToolCallSchema), allow_none=True)
    tool_call_id = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    reasoning_content = fields.String(allow_none=True)
    # The rest of OpenAI's response message, as the openai SDK sends it back (`message.model_dump()`,
    # every field, null where unset): a refusal is the assistant's text; audio, a legacy function call
    # and citations (annotations) are taken only empty.
    refusal = fields.String(allow_none=True)
    audio = fields.Raw(allow_none=True, validate=_refused("Only null: tokenline does not produce audio."))
    function_call = fields.Raw(allow_none=True, validate=_refused("Only null: send tool_calls."))
    annotations = fields.List(
        fields.Raw(), allow_none=True, validate=validate.Length(max=0, error="Only null or an empty list.")
    )
    # The provider form's message metadata (seeds/unified_chat_interface_notes.txt): its API version
    # and the message's time, which change nothing in a generation, and its fallback switch `default`
    # (0: no fallback, what happens; 1, the provider's fallback answer, tokenline has none to give).
    version = fields.String(allow_none=True, validate=validate.Length(max=64))
    created = StrictInteger(allow_none=True, validate=validate.Range(min=0))
    default = Refused("a fallback answer (default 1); 0, no fallback, is what happens", allowed=(0,))

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        role = data.get("role")
        # An assistant's calls or reasoning may stand without text: OpenAI's schema makes content
        # optional beside tool calls (litellm leaves it out there), and a reply cut by max_tokens while
        # it reasoned has reasoning and no content (vLLM's null), which clients send back as it came.
        beside = role == "assistant" and bool(data.get("tool_calls") or data.get("reasoning_content"))
        if data.get("tool_calls") and role != "assistant":
            raise ValidationError("Only assistant messages carry tool_calls.", "tool_calls")
        if data.get("refusal") is not None:
            if role != "assistant":
                raise ValidationError("Only assistant messages carry a refusal.", "refusal")
            if data.get("content") is not None:
                raise ValidationError("An assistant message carries content or a refusal, not both.", "refusal")
        elif data.get("content") is None and not beside:
            missing = "content" not in data
            raise ValidationError(
                "Missing data for required field." if missing else "Field may not be null.", "content"
            )
        if data.get("content") == "" and not (role == "tool" or beside):
            # The seeds' rule: content is not empty. A tool's output may be (a tool run for its effect
            # returns nothing), and so may the text beside an assistant's calls or reasoning.
            raise ValidationError("Must not be empty.", "content")
        if role == "tool" and not data.get("tool_call_id"):
            raise ValidationError("A tool message must name the call it answers.", "tool_call_id")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> Message:
        return Message(
            role=data["role"],
            content=data["refusal"] if data.get("refusal") is not None else data.get("content"),
            name=data.get("name"),
            tool_calls=tuple(data.get("tool_calls") or ()),
            tool_call_id=data.get("tool_call_id"),
            reasoning_content=data.get("reasoning_content"),
        )


class FunctionSchema(StrictSchema):
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    description = fields.String(allow_none=True)
    parameters = fields.Dict(allow_none=True, validate=object_schema)
    strict = StrictBoolean(allow_none=True)


class ToolSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function"))
    function = fields.Nested(FunctionSchema, required=True)

    @post_load(pass_original=True)
    def _make(self, data: dict[str, Any], original: dict[str, Any], **kwargs: Any) -> Tool:
        function = data["function"]
        parameters = function.get("parameters") or {"type": "object"}
        return Tool(function["name"], function.get("description"), parameters, original)


class NamedFunctionSchema(StrictSchema):
    name = fields.String(required=True)


class NamedToolChoiceSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function"))
    function = fields.Nested(NamedFunctionSchema, required=True)


class AllowedToolsSchema(StrictSchema):
    mode = fields.String(required=True, validate=validate.OneOf(("auto", "required")))
    tools = fields.List(fields.Nested(NamedToolChoiceSchema), required=True, validate=validate.Length(min=1))


class AllowedToolChoiceSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("allowed_tools"))
    allowed_tools = fields.Nested(AllowedToolsSchema, required=True)


class ToolChoice(NamedTuple):
    """A request's tool choice: `choice` none, auto, required or function (named: `name`); `allowed`,
    the only tools the model is shown (OpenAI's `allowed_tools`), or None for all of them."""

    choice: str
    name: str | None = None
    allowed: tuple[str, ...] | None = None


class ToolChoiceField(fields.Field):
    """ "none" | "auto" | "required" | {"type": "function", "function": {"name": …}} |
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [named functions]}}
    → a ToolChoice."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> ToolChoice:
        if isinstance(value, str):
            if value not in TOOL_CHOICES:
                raise ValidationError(f"Must be one of {', '.join(TOOL_CHOICES)}, or a named function.")
            return ToolChoice(value)
        if not isinstance(value, dict):
            raise ValidationError("Must be a string or an object naming a function.")
        if value.get("type") == "allowed_tools":
            allowed = AllowedToolChoiceSchema().load(value)["allowed_tools"]
            names = tuple(tool["function"]["name"] for tool in allowed["tools"])
            return ToolChoice(allowed["mode"], allowed=names)
        named = NamedToolChoiceSchema().load(value)
        return ToolChoice("function", named["function"]["name"])


def tool_choice(data: dict[str, Any]) -> ToolChoice:
    """A loaded request's tool choice: auto where it has tools and says nothing, else none."""
    return data.get("tool_choice") or ToolChoice("auto" if data.get("tools") else "none")


def allowed_tools(tools: tuple[Tool, ...], choice: ToolChoice) -> tuple[Tool, ...]:
    """The tools the model is shown: those `allowed_tools` names, or all."""
    return tools if choice.allowed is None else tuple(tool for tool in tools if tool.name in choice.allowed)


class ChatCompletionSchema(SamplingSchema):
    model = model_name(required=True)
    messages = BoundedList(fields.Nested(MessageSchema), required=True, max_items=MAX_MESSAGES)
    max_completion_tokens = StrictInteger(allow_none=True, validate=value_range(0, None, False))
    # The seed table says (0.0, 2.0]; 0 is accepted as greedy because OpenAI clients send it.
    temperature = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, True))
    n = StrictInteger(allow_none=True, validate=value_range(1, None, True))
    stream_options = fields.Nested(StreamOptionsSchema, allow_none=True)
    tools = fields.List(fields.Nested(ToolSchema), allow_none=True, validate=validate.Length(max=128))
    tool_choice = ToolChoiceField(allow_none=True)
    parallel_tool_calls = StrictBoolean(allow_none=True)
    response_format = fields.Nested(ResponseFormatSchema, allow_none=True)
    structured_outputs = fields.Nested(StructuredOutputsSchema, allow_none=True)  # vLLM's
    logprobs = StrictBoolean(allow_none=True)
    top_logprobs = StrictInteger(allow_none=True, validate=value_range(0, MAX_LOGPROBS, True))
    chat_template_kwargs = fields.Dict(keys=fields.String(), allow_none=True)
    add_generation_prompt = StrictBoolean(allow_none=True)
    continue_final_message = StrictBoolean(allow_none=True)
    # vLLM's: special tokens (a BOS) added on top of the template's own; its default is false.
    add_special_tokens = StrictBoolean(allow_none=True)
    echo = StrictBoolean(allow_none=True)  # vLLM's: a final assistant message's text begins the answer
    best_of = Refused("best_of above 1", allowed=(1,))
    documents = Refused("documents for the chat template")
    chat_template = Refused("a chat template in the request (the model's own renders it)")
    # vLLM passes it to the chat template, which may act on it (gpt-oss's does).
    reasoning_effort = fields.String(allow_none=True, validate=validate.OneOf(REASONING_EFFORTS))
    # vLLM's: the most tokens a reasoning model's <think> may run before its end is forced.
    thinking_token_budget = StrictInteger(allow_none=True, validate=value_range(0, None, True))
    # OpenAI's fields whose request is what happens anyway: nothing is stored, every request gets the
    # one tier, the output is text; prompt caching is automatic (the key is a hint, as OpenAI's is).
    store = StrictBoolean(
        allow_none=True,
        validate=validate.Equal(False, error="tokenline stores no completions; only false is accepted."),
    )
    service_tier = fields.String(allow_none=True, validate=validate.OneOf(SERVICE_TIERS))
    modalities = fields.List(
        fields.String(validate=validate.Equal("text", error="tokenline answers with text only.")), allow_none=True
    )
    metadata = Metadata(MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE, allow_none=True)
    prompt_cache_key = fields.String(allow_none=True, validate=validate.Length(max=1024))
    safety_identifier = fields.String(allow_none=True, validate=validate.Length(max=64))
    verbosity = Refused("verbosity", allowed=("medium",))
    prompt_cache_retention = Refused("24-hour prompt cache retention", allowed=("in_memory",))
    # OpenAI's fields that tokenline knows and does not implement: a value but null is a 400 naming it.
    audio = Refused("audio output")
    prediction = Refused("predicted outputs")
    web_search_options = Refused("web search")
    functions = Refused("the deprecated `functions` (use `tools`)")
    function_call = Refused("the deprecated `function_call` (use `tool_choice`)")
    moderation = Refused("moderation")
    prompt_cache_options = Refused("prompt cache options")

    @validates_schema
    def _check_chat(self, data: dict[str, Any], **kwargs: Any) -> None:
        total = sum(content_chars(m.content) for m in data.get("messages", ()))
        if total > MAX_CONTENT_CHARS:
            raise ValidationError(
                f"Total content is {total} characters; at most {MAX_CONTENT_CHARS} are allowed.", "messages"
            )
        self.check_max_tokens(data, "max_completion_tokens")
        n = data.get("n")
        if n is not None and n > self.limits.max_n:
            raise ValidationError(f"Must be in [1, {self.limits.max_n}].", "n")
        if asks_for_a_stream(data.get("stream_options")) and not data.get("stream"):
            raise ValidationError("Only allowed when stream is true.", "stream_options")
        if data.get("top_logprobs") is not None and not data.get("logprobs"):
            raise ValidationError("Only allowed when logprobs is true.", "top_logprobs")
        check_continuation(data)
        self._check_tools(data)

    def _check_tools(self, data: dict[str, Any]) -> None:
        tools = data.get("tools") or []
        choice, name, allowed = tool_choice(data)
        names = [t.name for t in tools]
        if len(set(names)) < len(names):
            raise ValidationError("Function names must be unique.", "tools")
        if choice in ("required", "function") and not tools:
            raise ValidationError(f"tool_choice {choice!r} needs tools.", "tool_choice")
        if choice == "function" and name not in names:
            raise ValidationError(f"No tool is named {name!r}.", "tool_choice")
        for i, allowed_name in enumerate(allowed or ()):
            if allowed_name not in names:
                raise ValidationError(
                    {"allowed_tools": {"tools": {i: [f"No tool is named {allowed_name!r}."]}}}, "tool_choice"
                )
        fmt = data.get("response_format")
        if data.get("structured_outputs"):
            if choice in ("required", "function"):
                raise ValidationError("Cannot be combined with a tool_choice that forces a call.", "structured_outputs")
            if fmt and fmt["type"] != "text":
                raise ValidationError("Cannot be combined with response_format.", "structured_outputs")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ChatRequest:
        if data.get("max_completion_tokens") is not None:
            data["max_tokens"] = data["max_completion_tokens"]
        choice, name, _ = tool_choice(data)
        tools = allowed_tools(tuple(data.get("tools") or ()), tool_choice(data))
        parallel = data.get("parallel_tool_calls") is not False
        options = data.get("stream_options") or {}
        grammar, grammar_param = (
            structured_grammar(data["structured_outputs"])
            if data.get("structured_outputs")
            else request_grammar(data.get("response_format"), tools, choice, name, parallel)
        )
        if choice in ("required", "function") and data.get("response_format"):
            # A forced call writes no text for the format to shape (OpenAI and vLLM take the pair; agents
            # send both): the call's grammar is the constraint, and the format is only checked.
            request_grammar(data["response_format"], (), "none", None, parallel)
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
            grammar=grammar,
            grammar_param=grammar_param,
            answer_format=answer_format(data.get("response_format")) if not data.get("structured_outputs") else None,
            max_tokens_param="max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens",
            logprobs=bool(data.get("logprobs")),
            top_logprobs=data.get("top_logprobs") or 0,
            template_kwargs=_template_kwargs(data),
            user=data.get("user"),
            safety_identifier=data.get("safety_identifier"),
            continuous_usage=bool(options.get("continuous_usage_stats")),
            generation_prompt=generation_prompt(data),
            continue_final=bool(data.get("continue_final_message")),
            add_special_tokens=bool(data.get("add_special_tokens")),
            truncate_prompt_tokens=data.get("truncate_prompt_tokens"),
            tokens_as_ids=bool(data.get("return_tokens_as_token_ids")),
            thinking_budget=data.get("thinking_token_budget"),
            echo=bool(data.get("echo")),
        )


def check_continuation(data: dict[str, Any]) -> None:
    """continue_final_message continues the final message's text: the conversation must end in one
    with text, and the assistant turn's opening cannot come after it."""
    if not data.get("continue_final_message"):
        return
    if data.get("add_generation_prompt"):
        raise ValidationError(
            "Cannot be true with add_generation_prompt true: the final message is continued, "
            "not followed by a new assistant turn.",
            "continue_final_message",
        )
    messages = data.get("messages") or ()
    if messages and not (messages[-1].content or "").strip():
        raise ValidationError(
            {len(messages) - 1: {"content": ["Must have text to continue (continue_final_message)."]}}, "messages"
        )


def generation_prompt(data: dict[str, Any]) -> bool:
    """Whether the rendering ends with the assistant turn's opening: as asked, by default unless the
    final message is continued."""
    asked = data.get("add_generation_prompt")
    return not data.get("continue_final_message") if asked is None else asked


def _template_kwargs(data: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs, over reasoning_effort (as vLLM passes both; the explicit kwargs win)."""
    effort = data.get("reasoning_effort")
    return ({"reasoning_effort": effort} if effort is not None else {}) | (data.get("chat_template_kwargs") or {})
