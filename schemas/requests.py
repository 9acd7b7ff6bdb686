"""HTTP request schemas for /v1/chat/completions and /generate, with every rule of the seed tables.

Each schema is built with the server's `RequestLimits` (maxIterTimes and friends come from config) and
loads a JSON object into a typed request. Unknown fields are ignored, as OpenAI clients send many.
Where a rule depends on the model (top_k < vocabSize, prompt tokens), the service checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marshmallow import EXCLUDE, Schema, ValidationError, fields, post_load, validate, validates_schema

from schemas.errors import InvalidRequest
from schemas.fields import MessageContent, StopField, StrictBoolean, StrictFloat, StrictInteger
from schemas.sampling import MAX_SEED, MAX_STOP_SEQUENCES, SamplingParams

MODEL_NAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$"
MAX_MODEL_NAME_LENGTH = 256
MAX_CONTENT_CHARS = 512 * 1024
ROLES = ("system", "user", "assistant")
GENERATE_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestLimits:
    """The configured bounds a request is validated against."""

    max_iter_times: int
    max_n: int = 1


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    timeout: float | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    model: str | None
    prompt: str
    sampling: SamplingParams
    stream: bool
    timeout: float | None = None
    cache_salt: str | None = None


def _model_name(**kwargs: Any) -> fields.String:
    return fields.String(
        validate=[
            validate.Length(min=1, max=MAX_MODEL_NAME_LENGTH),
            validate.Regexp(
                MODEL_NAME_PATTERN,
                error="Must consist of letters, digits, '.', '-' and '_', "
                "and must not start or end with '.', '-' or '_'.",
            ),
        ],
        **kwargs,
    )


def _range(lo: float | None, hi: float | None, lo_inclusive: bool, hi_inclusive: bool = True):
    return validate.Range(min=lo, max=hi, min_inclusive=lo_inclusive, max_inclusive=hi_inclusive)


class _SamplingSchema(Schema):
    """Fields shared by both endpoints. None means "use the default", as clients send nulls."""

    class Meta:
        unknown = EXCLUDE

    max_tokens = StrictInteger(allow_none=True, validate=_range(0, None, False))
    presence_penalty = StrictFloat(allow_none=True, validate=_range(-2.0, 2.0, True))
    frequency_penalty = StrictFloat(allow_none=True, validate=_range(-2.0, 2.0, True))
    repetition_penalty = StrictFloat(allow_none=True, validate=_range(0.0, 2.0, False))
    top_k = StrictInteger(allow_none=True)
    top_p = StrictFloat(allow_none=True, validate=_range(0.0, 1.0, False))
    seed = StrictInteger(allow_none=True, validate=_range(0, MAX_SEED, False))
    stop = StopField(MAX_STOP_SEQUENCES, allow_none=True)
    ignore_eos = StrictBoolean(allow_none=True)
    stream = StrictBoolean(allow_none=True)
    # tokenline's own: seconds this request may take end to end (capped by e2eTimeout).
    timeout = StrictFloat(allow_none=True, validate=_range(0.0, None, False))
    # vLLM's: only requests with the same salt share cached prompt blocks (tenants that must not share).
    cache_salt = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))

    default_max_tokens: int

    def __init__(self, limits: RequestLimits, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limits = limits

    @validates_schema
    def _check_bounds(self, data: dict[str, Any], **kwargs: Any) -> None:
        max_tokens = data.get("max_tokens")
        if max_tokens is not None and max_tokens > self.limits.max_iter_times:
            raise ValidationError(f"Must be in (0, {self.limits.max_iter_times}] (maxIterTimes).", "max_tokens")
        top_k = data.get("top_k")
        if top_k is not None and top_k != -1 and top_k <= 0:
            raise ValidationError("Must be -1 (disabled) or a positive integer; 0 is not allowed.", "top_k")

    def _sampling(self, data: dict[str, Any], default_max_tokens: int) -> SamplingParams:
        def get(name: str, default: Any) -> Any:
            value = data.get(name)
            return default if value is None else value

        return SamplingParams(
            max_tokens=get("max_tokens", min(default_max_tokens, self.limits.max_iter_times)),
            temperature=get("temperature", 1.0),
            top_k=get("top_k", -1),
            top_p=get("top_p", 1.0),
            presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0),
            repetition_penalty=get("repetition_penalty", 1.0),
            seed=data.get("seed"),
            stop=get("stop", ()),
            ignore_eos=get("ignore_eos", False),
        )


class StreamOptionsSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    include_usage = StrictBoolean(allow_none=True)


class MessageSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    role = fields.String(required=True, validate=validate.OneOf(ROLES))
    content = MessageContent(required=True)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> Message:
        return Message(**data)


class ChatCompletionSchema(_SamplingSchema):
    model = _model_name(required=True)
    messages = fields.List(fields.Nested(MessageSchema), required=True, validate=validate.Length(min=1))
    max_completion_tokens = StrictInteger(allow_none=True, validate=_range(0, None, False))
    # The seed table says (0.0, 2.0]; 0 is accepted as greedy because OpenAI clients send it.
    temperature = StrictFloat(allow_none=True, validate=_range(0.0, 2.0, True))
    n = StrictInteger(allow_none=True, validate=_range(1, None, True))
    stream_options = fields.Nested(StreamOptionsSchema, allow_none=True)

    @validates_schema
    def _check_chat(self, data: dict[str, Any], **kwargs: Any) -> None:
        total = sum(len(m.content) for m in data.get("messages", ()))
        if total > MAX_CONTENT_CHARS:
            raise ValidationError(
                f"Total content is {total} characters; at most {MAX_CONTENT_CHARS} are allowed.",
                "messages",
            )
        mct = data.get("max_completion_tokens")
        if mct is not None and mct > self.limits.max_iter_times:
            raise ValidationError(
                f"Must be in (0, {self.limits.max_iter_times}] (maxIterTimes).", "max_completion_tokens"
            )
        n = data.get("n")
        if n is not None and n > self.limits.max_n:
            raise ValidationError(f"Must be in [1, {self.limits.max_n}].", "n")
        if data.get("stream_options") and not data.get("stream"):
            raise ValidationError("Only allowed when stream is true.", "stream_options")

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ChatRequest:
        if data.get("max_completion_tokens") is not None:
            data["max_tokens"] = data["max_completion_tokens"]
        options = data.get("stream_options") or {}
        return ChatRequest(
            model=data["model"],
            messages=tuple(data["messages"]),
            sampling=self._sampling(data, self.limits.max_iter_times),
            n=data.get("n") or 1,
            stream=bool(data.get("stream")),
            include_usage=bool(options.get("include_usage")),
            timeout=data.get("timeout"),
            cache_salt=data.get("cache_salt"),
        )


class GenerateSchema(_SamplingSchema):
    prompt = fields.String(required=True, validate=validate.Length(min=1, max=MAX_CONTENT_CHARS))
    model = _model_name(allow_none=True)
    temperature = StrictFloat(allow_none=True, validate=_range(0.0, None, True))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> GenerateRequest:
        return GenerateRequest(
            model=data.get("model"),
            prompt=data["prompt"],
            sampling=self._sampling(data, GENERATE_DEFAULT_MAX_TOKENS),
            stream=bool(data.get("stream")),
            timeout=data.get("timeout"),
            cache_salt=data.get("cache_salt"),
        )


def load_request(schema: Schema, body: Any) -> Any:
    """Load a parsed JSON body, turning the first validation error into an InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return schema.load(body)
    except ValidationError as exc:
        param, message = first_error(exc.messages)
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param) from None


def first_error(messages: Any, path: str = "") -> tuple[str | None, str]:
    """Flatten marshmallow's nested messages to (param, message): ("messages[0].content", "...")."""
    if isinstance(messages, list):
        if messages and isinstance(messages[0], str):
            return (path or None), messages[0]
        return first_error(messages[0], path) if messages else (path or None, "Invalid value.")
    if isinstance(messages, dict):
        key, value = next(iter(messages.items()))
        if key == "_schema":
            return first_error(value, path)
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        return first_error(value, sub)
    return (path or None), str(messages)
