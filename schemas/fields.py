"""Strict JSON fields: "5", 5.5 and true are not integers; "1.0" is not a number; 1 is not a boolean.

They subclass marshmallow's Integer, Float and Boolean (so that the OpenAPI document types them) and
replace their lenient loading."""

from __future__ import annotations

import math
import re
from typing import Any

from marshmallow import ValidationError, fields, validate

from schemas.sampling import MAX_LOGIT_BIAS


class StrictInteger(fields.Integer):
    default_error_messages = {"invalid": "Not a valid integer."}

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.make_error("invalid")
        return value


class StrictFloat(fields.Float):
    default_error_messages = {"invalid": "Not a valid number."}

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.make_error("invalid")
        if not math.isfinite(value):
            raise self.make_error("invalid")
        return float(value)


class StrictBoolean(fields.Boolean):
    default_error_messages = {"invalid": "Not a valid boolean."}

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> bool:
        if not isinstance(value, bool):
            raise self.make_error("invalid")
        return value


class Refused(fields.Field):
    """A field tokenline knows and does not implement: any value but null (or `allowed`) is a 400 that
    says what it would have asked for."""

    def __init__(self, what: str, allowed: tuple[Any, ...] = (), **kwargs: Any) -> None:
        super().__init__(allow_none=True, **kwargs)
        self.what, self.allowed = what, allowed

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if any(value == a and type(value) is type(a) for a in self.allowed):
            return value
        raise ValidationError(f"tokenline does not support {self.what}.")


class TokenIds(fields.Field):
    """A non-empty list of non-negative integer token ids, checked in one pass (marshmallow's
    List(Integer) checks element by element, which a worker would pay on each request's way to its
    first token)."""

    default_error_messages = {
        "invalid": "Not a list of token ids (non-negative integers).",
        "empty": "Must hold at least one token id.",
    }

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[int, ...]:
        if not isinstance(value, (list, tuple)):
            raise self.make_error("invalid")
        if not value:
            raise self.make_error("empty")
        # type(x) is int: bool, float and str are not token ids
        if not all(type(x) is int for x in value) or min(value) < 0:
            raise self.make_error("invalid")
        return tuple(value)


class TokenIdList(fields.Field):
    """A list of at most `max_items` non-negative integer token ids (may be empty)."""

    def __init__(self, max_items: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_items = max_items

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(type(x) is int and x >= 0 for x in value):
            raise ValidationError("Must be a list of token ids (non-negative integers).")
        if len(value) > self.max_items:
            raise ValidationError(f"At most {self.max_items} token ids are allowed.")
        return tuple(value)


_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # the ids of any vocabulary; a longer key is no token's


class LogitBias(fields.Field):
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}, at most 300 entries."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[tuple[int, float], ...]:
        if not isinstance(value, dict):
            raise ValidationError("Must be an object mapping token ids to biases.")
        if len(value) > MAX_LOGIT_BIAS:
            raise ValidationError(f"At most {MAX_LOGIT_BIAS} entries are allowed.")
        pairs = []
        named: dict[int, str] = {}
        for key, bias in value.items():
            if not _TOKEN_ID.fullmatch(key):  # ASCII digits only: str.isdigit() takes "²" and "１"
                raise ValidationError(f"{key[:32]!r} is not a token id.")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValidationError(f"The bias of token {key} must be a number in [-100, 100].")
            token = int(key)
            if token in named:  # "12" and "012": one token, two biases
                raise ValidationError(f"Tokens {named[token]} and {key[:32]} are the same token; give it one bias.")
            named[token] = key
            pairs.append((token, float(bias)))
        return tuple(pairs)


class StopField(fields.Field):
    """OpenAI's `stop`: one string or a list of at most four non-empty strings."""

    def __init__(self, max_items: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_items = max_items

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValidationError("Must be a string or a list of strings.")
        if len(items) > self.max_items:
            raise ValidationError(f"At most {self.max_items} stop sequences are allowed.")
        if any(s == "" for s in items):
            raise ValidationError("Stop sequences must not be empty.")
        return tuple(dict.fromkeys(items))


class Metadata(fields.Field):
    """OpenAI's `metadata`: at most `pairs` string pairs, keys up to `key_length` characters and
    values up to `value_length`."""

    def __init__(self, pairs: int, key_length: int, value_length: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pairs, self.key_length, self.value_length = pairs, key_length, value_length

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValidationError("Must be an object of string values.")
        if len(value) > self.pairs:
            raise ValidationError(f"At most {self.pairs} pairs are allowed.")
        if any(len(k) > self.key_length for k in value):
            raise ValidationError(f"Keys are at most {self.key_length} characters.")
        if any(len(v) > self.value_length for v in value.values()):
            raise ValidationError(f"Values are at most {self.value_length} characters.")
        return dict(value)


class BoundedList(fields.List):
    """A list of `min_items` (1 unless told) to `max_items`, its length checked before its items are
    read: a chat of 100,000 messages cost an API process seconds of its loop before the length check,
    which runs after the items, refused it."""

    def __init__(self, cls_or_instance: Any, *, max_items: int, min_items: int = 1, **kwargs: Any) -> None:
        super().__init__(cls_or_instance, validate=validate.Length(min=min_items, max=max_items), **kwargs)
        self.min_items, self.max_items = min_items, max_items

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> list[Any]:
        if isinstance(value, list) and len(value) > self.max_items:
            raise ValidationError(f"Length must be between {self.min_items} and {self.max_items}.")
        return super()._deserialize(value, attr, data, **kwargs)


class JoinedParts(str):
    """A content's text parts joined with newlines; `sent`: the characters of the parts themselves,
    which the content bound counts (the joins are the server's, not the client's)."""

    sent: int

    def __new__(cls, text: str, sent: int) -> JoinedParts:
        joined = super().__new__(cls, text)
        joined.sent = sent
        return joined

    def __getnewargs__(self) -> tuple[str, int]:  # type: ignore[override]  # copies keep the count
        return str(self), self.sent

    @classmethod
    def of(cls, parts: list[str]) -> JoinedParts:
        return cls("\n".join(parts), sum(map(len, parts)))


def content_chars(content: str | None) -> int:
    """The characters a client sent as a message's content."""
    return content.sent if isinstance(content, JoinedParts) else len(content or "")


class MessageContent(fields.Field):
    """A message's content: a string, or a list of text parts.

    Parts are `{"type": "text", "text": ...}` (OpenAI) or `{"type": "text", "body": ...}` (the provider
    form in seeds/unified_chat_interface_notes.txt); they are joined with newlines, as vLLM does, and
    parts that are all empty are an empty content. Whether it may be empty depends on the message's
    role (chat.MessageSchema).
    """

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> str:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValidationError("Must be a string or a list of content parts.")
        parts = [_part_text(i, part) for i, part in enumerate(value)]
        return JoinedParts.of(parts) if any(parts) else ""


PART_KEYS = ("type", "text", "body")


def _part_text(index: int, part: Any) -> str:
    if not isinstance(part, dict):
        raise ValidationError({index: ["Must be an object."]})
    kind = part.get("type")
    if kind != "text":
        what = f"{kind} parts" if isinstance(kind, str) else "parts without a type"
        raise ValidationError(
            {index: {"type": [f"Only text content parts are supported (this is a text model), not {what}."]}}
        )
    for key in part:
        if key not in PART_KEYS:
            raise ValidationError({index: {key: ["Unknown field."]}})
    if "text" in part and "body" in part:
        raise ValidationError({index: {"body": ["A text part carries text (OpenAI) or body, not both."]}})
    key = "text" if "text" in part else "body"
    text = part.get(key)
    if not isinstance(text, str):
        raise ValidationError({index: {key: ["Must be a string."]}})
    return text
