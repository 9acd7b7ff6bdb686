"""The job payload (API → worker) and the token events (worker → API): a versioned contract.

A job is enqueued with RQ's JSON serializer as `workers.serving.jobs.generate(payload)`; its RQ job id is the
request id. The worker answers on `payload.reply_channel` with Redis pub/sub messages, each a JSON
list of events (one message per decode step per channel, whatever the number of requests in it).
Every event of a request carries `seq`, counting from 0 without gaps; the last event of a request is
always `done` or `error`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from marshmallow import EXCLUDE, Schema, ValidationError, fields, post_load, validate

from schemas.fields import TokenIdList, TokenIds
from schemas.sampling import MAX_ALLOWED_TOKEN_IDS, MAX_STOP_TOKEN_IDS, SamplingParams

PAYLOAD_VERSION = 1
JOB_FUNCTION = "workers.serving.jobs.generate"


@dataclass(frozen=True)
class JobPayload:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    reply_channel: str
    n: int = 1
    v: int = PAYLOAD_VERSION
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    queued_at: float | None = None  # when the API queued it (time.time()), for queue time and TTFT

    def to_dict(self) -> dict[str, Any]:
        data = {
            "v": self.v,
            "request_id": self.request_id,
            "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "reply_channel": self.reply_channel,
            "n": self.n,
        }
        if self.cache_salt is not None:
            data["cache_salt"] = self.cache_salt
        if self.queued_at is not None:
            data["queued_at"] = self.queued_at
        return data

    @classmethod
    def from_dict(cls, data: Any) -> JobPayload:
        """Validate a payload read from Redis; a malformed one raises ValueError naming the field."""
        try:
            return _PAYLOAD_SCHEMA.load(data)
        except ValidationError as exc:
            raise ValueError(f"invalid job payload: {exc.messages}") from None


class _SamplingSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    max_tokens = fields.Integer(strict=True, required=True, validate=validate.Range(min=0))
    temperature = fields.Float(required=True, validate=validate.Range(min=0.0))
    top_k = fields.Integer(strict=True, required=True)
    top_p = fields.Float(required=True, validate=validate.Range(min=0.0, max=1.0, min_inclusive=False))
    min_p = fields.Float(load_default=0.0, validate=validate.Range(min=0.0, max=1.0))
    presence_penalty = fields.Float(required=True)
    frequency_penalty = fields.Float(required=True)
    repetition_penalty = fields.Float(required=True, validate=validate.Range(min=0.0, min_inclusive=False))
    seed = fields.Integer(strict=True, allow_none=True, load_default=None)
    stop = fields.List(fields.String(), load_default=list)
    stop_token_ids = fields.List(fields.Integer(strict=True, validate=validate.Range(min=0)), load_default=list)
    include_stop_str_in_output = fields.Boolean(load_default=False)
    ignore_eos = fields.Boolean(load_default=False)
    min_tokens = fields.Integer(strict=True, load_default=0, validate=validate.Range(min=0))
    logit_bias = fields.List(fields.Tuple((fields.Integer(strict=True), fields.Float())), load_default=list)
    skip_special_tokens = fields.Boolean(load_default=True)
    logprobs = fields.Integer(strict=True, allow_none=True, load_default=None, validate=validate.Range(min=0))
    prompt_logprobs = fields.Integer(strict=True, allow_none=True, load_default=None, validate=validate.Range(min=0))
    grammar = fields.String(allow_none=True, load_default=None)
    allowed_token_ids = TokenIdList(MAX_ALLOWED_TOKEN_IDS, load_default=tuple)
    bad_words = fields.List(TokenIds(), load_default=list)
    return_token_ids = fields.Boolean(load_default=False)
    thinking_budget = fields.Integer(strict=True, allow_none=True, load_default=None, validate=validate.Range(min=0))
    thinking_start = TokenIdList(MAX_STOP_TOKEN_IDS, load_default=tuple)
    thinking_end = TokenIdList(MAX_STOP_TOKEN_IDS, load_default=tuple)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> SamplingParams:
        return SamplingParams.from_dict(data)


class _JobPayloadSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    v = fields.Integer(strict=True, required=True, validate=validate.Equal(PAYLOAD_VERSION))
    request_id = fields.String(required=True, validate=validate.Length(min=1, max=128))
    model = fields.String(required=True)
    prompt_token_ids = TokenIds(required=True)
    sampling = fields.Nested(_SamplingSchema, required=True)
    reply_channel = fields.String(required=True, validate=validate.Length(min=1))
    n = fields.Integer(strict=True, load_default=1, validate=validate.Range(min=1))
    cache_salt = fields.String(load_default=None, validate=validate.Length(min=1, max=256))
    queued_at = fields.Float(load_default=None, allow_none=True)

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> JobPayload:
        return JobPayload(**data)


# Built once: a schema keeps no state between loads, and building one costs more than a load.
_PAYLOAD_SCHEMA = _JobPayloadSchema()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the worker's prefix cache (or host tier) held

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


@dataclass(slots=True)
class Event:
    """One step of one request. kind: "token" (text delta), "prompt" (the prompt's logprobs), "done"
    (finish_reason, usage, and vLLM's stop_reason: the stop string or token id that ended it), "error",
    "cancelled", "waiting" (sequence `index` was preempted, its KV pool full: no token comes until it
    runs again; the relay reads it, the formats never see it)."""

    request_id: str
    seq: int
    kind: str
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: dict[str, Any] | None = field(default=None)
    # Per token covered by this event: [token id, logprob, [[id, logprob], …] (the top alternatives)];
    # for a "prompt" event, one per prompt token, the first None (nothing comes before it), and each
    # with the token's rank among the vocabulary after its alternatives.
    logprobs: list[Any] | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # the ids of the tokens this event covers, where asked for

    @property
    def final(self) -> bool:
        return self.kind in ("done", "error", "cancelled")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.request_id, "seq": self.seq, "kind": self.kind, "index": self.index}
        if self.text:
            data["text"] = self.text
        if self.finish_reason is not None:
            data["finish_reason"] = self.finish_reason
        if self.usage is not None:
            data["usage"] = {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
            }
            if self.usage.cached_tokens:
                data["usage"]["cached_tokens"] = self.usage.cached_tokens
        if self.error is not None:
            data["error"] = self.error
        if self.logprobs is not None:
            data["logprobs"] = self.logprobs
        if self.stop_reason is not None:
            data["stop_reason"] = self.stop_reason
        if self.token_ids is not None:
            data["token_ids"] = self.token_ids
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        usage = data.get("usage")
        return cls(
            request_id=data["id"],
            seq=data["seq"],
            kind=data["kind"],
            index=data.get("index", 0),
            text=data.get("text", ""),
            finish_reason=data.get("finish_reason"),
            usage=Usage(**usage) if usage else None,
            error=data.get("error"),
            logprobs=data.get("logprobs"),
            stop_reason=data.get("stop_reason"),
            token_ids=data.get("token_ids"),
        )


def encode_events(events: list[Event]) -> str:
    return json.dumps([e.to_dict() for e in events], separators=(",", ":"), ensure_ascii=False)


def decode_events(message: bytes | str) -> list[Event]:
    return [Event.from_dict(item) for item in json.loads(message)]
