"""POST /v1/completions (OpenAI's legacy completions, as evaluation harnesses send them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from marshmallow import ValidationError, fields, post_load, validates_schema

from schemas.fields import Refused, StrictBoolean, StrictFloat, StrictInteger
from schemas.requests import (
    MAX_CONTENT_CHARS,
    SamplingSchema,
    StreamOptionsSchema,
    asks_for_a_stream,
    model_name,
    value_range,
)
from schemas.sampling import MAX_LOGPROBS
from schemas.structured_outputs import StructuredOutputsSchema, structured_grammar

MAX_PROMPTS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids
    sampling: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    timeout: float | None = None
    cache_salt: str | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt
    grammar: str | None = None  # llguidance grammar from structured_outputs (vLLM's)
    grammar_param: str | None = None  # the field that holds it
    truncate_prompt_tokens: int | None = None  # vLLM's: each prompt's last N tokens
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids


class PromptField(fields.Field):
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[str | tuple[int, ...], ...]:
        if isinstance(value, str):
            prompts: list[Any] = [value]
        elif isinstance(value, list) and value and all(type(x) is int for x in value):
            prompts = [value]
        elif isinstance(value, list) and value:
            prompts = value
        else:
            raise ValidationError("Must be a string, a list of strings, token ids, or lists of token ids.")
        if len(prompts) > MAX_PROMPTS:
            raise ValidationError(f"At most {MAX_PROMPTS} prompts are allowed.")
        out: list[str | tuple[int, ...]] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt or len(prompt) > MAX_CONTENT_CHARS:
                    raise ValidationError({i: [f"Must be 1 to {MAX_CONTENT_CHARS} characters."]})
                out.append(prompt)
            elif isinstance(prompt, list) and prompt and all(type(x) is int and x >= 0 for x in prompt):
                out.append(tuple(prompt))
            else:
                raise ValidationError({i: ["Must be a non-empty string or a non-empty list of token ids."]})
        return tuple(out)


class CompletionSchema(SamplingSchema):
    model = model_name(required=True)
    prompt = PromptField(required=True)
    temperature = StrictFloat(allow_none=True, validate=value_range(0.0, 2.0, True))
    n = StrictInteger(allow_none=True, validate=value_range(1, None, True))
    best_of = StrictInteger(allow_none=True, validate=value_range(1, None, True))
    echo = StrictBoolean(allow_none=True)
    logprobs = StrictInteger(allow_none=True, validate=value_range(0, MAX_LOGPROBS, True))
    stream_options = fields.Nested(StreamOptionsSchema, allow_none=True)
    # max_tokens 0 is allowed here, with echo: the prompt's logprobs alone.
    max_tokens = StrictInteger(allow_none=True, validate=value_range(0, None, True))
    suffix = Refused("a suffix (insertion)", allowed=("",))
    structured_outputs = fields.Nested(StructuredOutputsSchema, allow_none=True)  # vLLM's
    add_special_tokens = StrictBoolean(allow_none=True)  # vLLM's

    @validates_schema
    def _check_completion(self, data: dict[str, Any], **kwargs: Any) -> None:
        n = data.get("n") or 1
        if n > self.limits.max_n:
            raise ValidationError(f"Must be in [1, {self.limits.max_n}].", "n")
        best_of = data.get("best_of")
        if best_of is not None and best_of != n:
            raise ValidationError("tokenline does not rank candidates: best_of must equal n.", "best_of")
        if data.get("max_tokens") == 0 and not data.get("echo"):
            raise ValidationError("0 is only allowed with echo (to score the prompt).", "max_tokens")
        if asks_for_a_stream(data.get("stream_options")) and not data.get("stream"):
            raise ValidationError("Only allowed when stream is true.", "stream_options")
        if data.get("prompt_logprobs") is not None and data.get("echo") and data.get("logprobs") is not None:
            raise ValidationError(
                "Not with echo and logprobs, which score the prompt already (use one or the other).",
                "prompt_logprobs",
            )

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> CompletionRequest:
        options = data.get("stream_options") or {}
        structured = data.get("structured_outputs")
        grammar, grammar_param = structured_grammar(structured) if structured else (None, None)
        return CompletionRequest(
            model=data["model"],
            prompts=data["prompt"],
            sampling=self.sampling_values(data),
            n=data.get("n") or 1,
            stream=bool(data.get("stream")),
            include_usage=bool(options.get("include_usage")),
            continuous_usage=bool(options.get("continuous_usage_stats")),
            echo=bool(data.get("echo")),
            logprobs=data.get("logprobs"),
            timeout=data.get("timeout"),
            cache_salt=data.get("cache_salt"),
            user=data.get("user"),
            add_special_tokens=data.get("add_special_tokens") is not False,
            grammar=grammar,
            grammar_param=grammar_param,
            truncate_prompt_tokens=data.get("truncate_prompt_tokens"),
            tokens_as_ids=bool(data.get("return_tokens_as_token_ids")),
        )
