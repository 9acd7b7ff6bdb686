"""HTTP request schemas shared by every endpoint: the sampling fields, the limits, the error mapping.

Each schema is built with the server's `RequestLimits` and loads a JSON object into a typed request.
A field no schema knows is refused with a 400 that names it (clients must not believe a parameter
took effect when it did not). The sampling values a request gives are carried as they are; the
service fills in the rest from the model (generation_config.json defaults, the context left for
max_tokens), see app/service.py. The endpoints' own schemas are in schemas/chat.py and
schemas/completions.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from marshmallow import RAISE, Schema, ValidationError, fields, post_load, validate, validates_schema

from schemas.errors import InvalidRequest
from schemas.fields import (
    BoundedList,
    LogitBias,
    Refused,
    StopField,
    StrictBoolean,
    StrictFloat,
    StrictInteger,
    TokenIdList,
)
from schemas.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
)

MODEL_NAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\Z"
MAX_MODEL_NAME_LENGTH = 256
MAX_CONTENT_CHARS = 512 * 1024
GENERATE_DEFAULT_MAX_TOKENS = 16

# Request fields that map one to one onto SamplingParams.
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "return_token_ids",
    "prompt_logprobs",
)


@dataclass(frozen=True)
class RequestLimits:
    """The configured bounds a request is validated against (None: no bound but the context)."""

    max_iter_times: int | None = None
    max_n: int = 1


@dataclass(frozen=True)
class GenerateRequest:
    model: str | None
    prompt: str
    sampling: dict[str, Any] = field(default_factory=dict)  # the sampling values the request gave
    stream: bool = False
    timeout: float | None = None
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last N tokens (-1: all a prompt may hold)
    user: str | None = None


def model_name(**kwargs: Any) -> fields.String:
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


def value_range(lo: float | None, hi: float | None, lo_inclusive: bool, hi_inclusive: bool = True) -> validate.Range:
    return validate.Range(min=lo, max=hi, min_inclusive=lo_inclusive, max_inclusive=hi_inclusive)


class StrictSchema(Schema):
    """Unknown fields are refused (RAISE); the error names the field."""

    class Meta:
        unknown = RAISE


class SamplingSchema(StrictSchema):
    """Fields shared by every endpoint. None means "use the default", as clients send nulls."""

    max_tokens = StrictInteger(allow_none=True, validate=value_range(0, None, False))
    presence_penalty = StrictFloat(allow_none=True, validate=value_range(-2.0, 2.0, True))
    frequency_penalty = StrictFloat(allow_none=True, validate=value_range(-2.0, 2.0, True))
    repetition_penalty = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, False))
    top_k = StrictInteger(allow_none=True)
    top_p = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, False))
    min_p = StrictFloat(allow_none=True, validate=value_range(0.0, 1.0, True))
    seed = StrictInteger(allow_none=True, validate=value_range(0, MAX_SEED, False))
    stop = StopField(MAX_STOP_SEQUENCES, allow_none=True)
    stop_token_ids = TokenIdList(MAX_STOP_TOKEN_IDS, allow_none=True)
    include_stop_str_in_output = StrictBoolean(allow_none=True)
    ignore_eos = StrictBoolean(allow_none=True)
    min_tokens = StrictInteger(allow_none=True, validate=value_range(0, None, True))
    logit_bias = LogitBias(allow_none=True)
    skip_special_tokens = StrictBoolean(allow_none=True)
    stream = StrictBoolean(allow_none=True)
    # OpenAI's end-user id: accepted and logged.
    user = fields.String(allow_none=True, validate=validate.Length(max=256))
    # tokenline's own: seconds this request may take end to end (capped by e2eTimeout).
    timeout = StrictFloat(allow_none=True, validate=value_range(0.0, None, False))
    # vLLM's: only requests with the same salt share cached prompt blocks (tenants that must not share).
    cache_salt = fields.String(allow_none=True, validate=validate.Length(min=1, max=256))
    # vLLM's fields whose default (or null) is what happens here, as its clients send them in extra_body;
    # another value is a 400 naming the field.
    use_beam_search = Refused("beam search", allowed=(False,))
    length_penalty = Refused("a length penalty (beam search)", allowed=(1.0, 1))
    spaces_between_special_tokens = Refused("spaces_between_special_tokens false", allowed=(True,))
    priority = Refused("request priorities", allowed=(0,))
    # vLLM's: the only tokens it may draw; words its output never contains (tokenized by the service);
    # the prompt cut to its last N tokens (-1: as many as a prompt may hold).
    allowed_token_ids = TokenIdList(
        MAX_ALLOWED_TOKEN_IDS,
        allow_none=True,
        validate=validate.Length(min=1, error="Must hold at least one token id."),
    )
    bad_words = BoundedList(
        fields.String(validate=validate.Length(min=1, max=MAX_BAD_WORD_CHARS)),
        max_items=MAX_BAD_WORDS,
        min_items=0,
        allow_none=True,
    )
    truncate_prompt_tokens = StrictInteger(allow_none=True)
    # vLLM's: every prompt token's logprob (and rank) with this many alternatives, beside the answer.
    prompt_logprobs = StrictInteger(allow_none=True, validate=value_range(0, MAX_LOGPROBS, True))
    # vLLM's: the answer's token ids beside its text, and the prompt's.
    return_token_ids = StrictBoolean(allow_none=True)
    # vLLM's: logprob entries name their tokens `token_id:<id>`.
    return_tokens_as_token_ids = StrictBoolean(allow_none=True)
    logits_processors = Refused("logits processors")
    mm_processor_kwargs = Refused("multimodal inputs")
    kv_transfer_params = Refused("KV transfer (disaggregated prefill)")
    vllm_xargs = Refused("vllm_xargs")
    request_id = Refused("a request id in the body (send it as the X-Request-Id header)")

    def __init__(self, limits: RequestLimits, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limits = limits

    @validates_schema
    def _check_bounds(self, data: dict[str, Any], **kwargs: Any) -> None:
        self.check_max_tokens(data, "max_tokens")
        top_k = data.get("top_k")
        if top_k is not None and top_k != -1 and top_k <= 0:
            raise ValidationError("Must be -1 (disabled) or a positive integer; 0 is not allowed.", "top_k")
        if data.get("prompt_logprobs") is not None and data.get("stream"):
            raise ValidationError("Not available with stream (as in vLLM).", "prompt_logprobs")
        keep = data.get("truncate_prompt_tokens")
        if keep is not None and keep != -1 and keep <= 0:
            raise ValidationError(
                "Must be -1 (as many tokens as a prompt may hold) or a positive integer.", "truncate_prompt_tokens"
            )

    def check_max_tokens(self, data: dict[str, Any], name: str) -> None:
        value = data.get(name)
        bound = self.limits.max_iter_times
        if value is not None and bound is not None and value > bound:
            raise ValidationError(f"Must be at most {bound} (maxIterTimes).", name)

    @staticmethod
    def sampling_values(data: dict[str, Any]) -> dict[str, Any]:
        return {name: data[name] for name in SAMPLING_FIELDS if data.get(name) is not None}


def asks_for_a_stream(options: dict[str, Any] | None) -> bool:
    """Whether stream_options ask for anything only a stream gives: `{}` or every option false is what
    a response that is not streamed does anyway, and is taken without `stream`."""
    return any(value for value in (options or {}).values())


class StreamOptionsSchema(StrictSchema):
    include_usage = StrictBoolean(allow_none=True)
    # vLLM's: every chunk carries the usage of its choice so far.
    continuous_usage_stats = StrictBoolean(allow_none=True)
    include_obfuscation = Refused("stream obfuscation", allowed=(False,))


class GenerateSchema(SamplingSchema):
    prompt = fields.String(required=True, validate=validate.Length(min=1, max=MAX_CONTENT_CHARS))
    model = model_name(allow_none=True)
    temperature = StrictFloat(allow_none=True, validate=value_range(0.0, None, True))
    # vLLM's SamplingParams defaults: one answer, no logprobs, no constraint (/v1/completions has them).
    n = Refused("n above 1 on /generate (use /v1/completions)", allowed=(1,))
    best_of = Refused("best_of above 1", allowed=(1,))
    logprobs = Refused("logprobs on /generate (use /v1/completions)")
    structured_outputs = Refused("structured_outputs on /generate (use /v1/completions)")
    return_token_ids = Refused("token ids on /generate (use /v1/completions)", allowed=(False,))
    prompt_logprobs = Refused("prompt_logprobs on /generate (use /v1/completions)")
    return_tokens_as_token_ids = Refused("logprobs on /generate (use /v1/completions)", allowed=(False,))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> GenerateRequest:
        return GenerateRequest(
            model=data.get("model"),
            prompt=data["prompt"],
            sampling=self.sampling_values(data),
            stream=bool(data.get("stream")),
            timeout=data.get("timeout"),
            cache_salt=data.get("cache_salt"),
            truncate_prompt_tokens=data.get("truncate_prompt_tokens"),
            user=data.get("user"),
        )


def load_request(schema: Schema, body: Any) -> Any:
    """Load a parsed JSON body, turning the first validation error into an InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return schema.load(body)
    except ValidationError as exc:
        param, message = first_error(exc.messages)
        if message == "Unknown field.":
            raise InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param) from None
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
