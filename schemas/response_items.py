"""The Responses API's input items (OpenAI's shapes): messages, function calls and their outputs,
reasoning (its text, a summary, or the `encrypted_content` tokenline sealed it in), and references to
items of stored responses (resolved by app/response_runs.py), each validated into its canonical shape
(the shape items are stored and listed in); hosted tools' items and non-text parts are refused by
their type. `load_variant` also loads the Messages API's content blocks.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from marshmallow import ValidationError, fields, post_load, validate

from schemas.chat import VALID_FUNCTION_NAME, json_object_text
from schemas.fields import StrictBoolean
from schemas.requests import StrictSchema

MAX_ITEMS = 2048
SEALED = "tokenline-reasoning-v1:"
# Output items of hosted tools, and item kinds that need OpenAI's servers: refused in `input` by type.
UNSUPPORTED_ITEMS = {
    "input_image": "images (this is a text model)",
    "input_file": "files (this is a text model)",
    "input_audio": "audio (this is a text model)",
}


# The keys of each content part; an output_text's annotations and logprobs are what the server wrote.
PART_KEYS = {
    "input_text": {"type", "text"},
    "text": {"type", "text"},
    "output_text": {"type", "text", "annotations", "logprobs"},
    "refusal": {"type", "refusal"},
}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def seal_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content`: its text, carried (not hidden: tokenline returns the
    reasoning in clear anyway) so that a client that stores nothing (`store: false`) can give the
    reasoning back in its next request, as OpenAI's encrypted reasoning lets it."""
    return SEALED + base64.urlsafe_b64encode(text.encode()).decode()


def open_reasoning(sealed: str) -> str:
    """The text `seal_reasoning` carried; a ValidationError for anything else (another server's)."""
    try:
        if sealed.startswith(SEALED):
            return base64.b64decode(sealed[len(SEALED) :], altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise ValidationError("Not reasoning this server encrypted (tokenline reads back only its own).")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string.")
    return value


def _parts(content: Any, role: str) -> list[dict[str, Any]]:
    """A message's content as typed parts: input_text (or output_text for the assistant)."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts: list[Any] = [{"type": kind, "text": content}]
    elif isinstance(content, list) and content:
        parts = content
    else:
        raise ValidationError({"content": ["Must be a string or a non-empty list of content parts."]})
    out = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ValidationError({"content": {i: ["Must be an object."]}})
        type_ = part.get("type")
        if isinstance(type_, str) and type_ in UNSUPPORTED_ITEMS:  # a list or an object is no type
            raise ValidationError(
                {"content": {i: {"type": [f"tokenline does not support {UNSUPPORTED_ITEMS[type_]}."]}}}
            )
        if type_ not in ("input_text", "output_text", "refusal", "text"):
            raise ValidationError({"content": {i: {"type": [f"Unknown content part type {type_!r}."]}}})
        key = "refusal" if type_ == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise ValidationError({"content": {i: {key: ["Must be a string."]}}})
        unknown = set(part) - PART_KEYS[type_]
        if unknown:
            raise ValidationError({"content": {i: {sorted(unknown)[0]: ["Unknown field."]}}})
        if type_ == "output_text" or (type_ == "text" and role == "assistant"):
            out.append({"type": "output_text", "text": part["text"], "annotations": []})
        elif type_ == "refusal":
            out.append({"type": "refusal", "refusal": part["refusal"]})
        else:
            out.append({"type": "input_text", "text": part["text"]})
    return out


class MessageItemSchema(StrictSchema):
    type = fields.String(validate=validate.Equal("message"))
    id = fields.String(validate=validate.Length(min=1, max=256))
    role = fields.String(required=True, validate=validate.OneOf(("user", "assistant", "system", "developer")))
    content = fields.Raw(required=True)
    status = fields.String(validate=validate.OneOf(("in_progress", "completed", "incomplete")))
    phase = fields.String(allow_none=True, validate=validate.OneOf(("commentary", "final_answer")))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {
            "type": "message",
            "id": data.get("id") or new_item_id("msg"),
            "role": data["role"],
            "content": _parts(data["content"], data["role"]),
            **({"status": data.get("status", "completed")} if data["role"] == "assistant" else {}),
            # An assistant message's phase (`commentary`, `final_answer`), as the client sent it back:
            # kept with the item (input_items lists it), not read by the template.
            **({"phase": data["phase"]} if data.get("phase") else {}),
        }


class FunctionCallItemSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function_call"))
    id = fields.String(validate=validate.Length(min=1, max=256))
    call_id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    name = fields.String(required=True, validate=VALID_FUNCTION_NAME)
    arguments = fields.String(required=True, validate=json_object_text)
    status = fields.String(validate=validate.OneOf(("in_progress", "completed", "incomplete")))
    # What the openai SDK (3.52) may send back with an item it received: honoured where they say what
    # tokenline's calls are (made by the model directly, not asynchronous); a namespace tool's calls
    # name it, and keep it.
    caller = fields.Raw(allow_none=True, validate=lambda value: direct_caller(value))
    namespace = fields.String(allow_none=True, validate=VALID_FUNCTION_NAME)
    is_async = StrictBoolean(
        data_key="async",
        allow_none=True,
        validate=validate.OneOf((False, None), error="tokenline does not run asynchronous function calls."),
    )

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        for honoured in ("caller", "is_async"):
            data.pop(honoured, None)
        if data.get("namespace") is None:
            data.pop("namespace", None)
        return {"id": new_item_id("fc"), "status": "completed", **data}


def direct_caller(value: Any) -> bool:
    if value is None or value == {"type": "direct"}:
        return True
    raise ValidationError("tokenline's function calls are made by the model directly: only {'type': 'direct'}.")


class FunctionCallOutputItemSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("function_call_output"))
    id = fields.String(validate=validate.Length(min=1, max=256))
    call_id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    output = fields.Raw(required=True)
    status = fields.String(validate=validate.OneOf(("in_progress", "completed", "incomplete")))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        output = data["output"]
        if not isinstance(output, str):  # a list of parts: text parts only
            output = "\n".join(p["text"] for p in _parts(output, "user"))
        return {"id": new_item_id("fco"), "status": "completed", **data, "output": output}


class ReasoningTextSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.OneOf(("reasoning_text", "summary_text")))
    text = fields.String(required=True)


class ReasoningItemSchema(StrictSchema):
    type = fields.String(required=True, validate=validate.Equal("reasoning"))
    id = fields.String(validate=validate.Length(min=1, max=256))
    summary = fields.List(fields.Nested(ReasoningTextSchema), load_default=list)
    content = fields.List(fields.Nested(ReasoningTextSchema), allow_none=True)
    encrypted_content = fields.String(allow_none=True)  # what include's reasoning.encrypted_content gave
    status = fields.String(validate=validate.OneOf(("in_progress", "completed", "incomplete")))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        sealed = data.pop("encrypted_content", None)
        content = data.get("content") or []
        if sealed is not None:
            try:
                text = open_reasoning(sealed)
            except ValidationError as exc:
                raise ValidationError(exc.messages, "encrypted_content") from None
            if not content and not data["summary"]:  # what the client kept of the item: the sealed text
                content = [{"type": "reasoning_text", "text": text}]
        return {"id": new_item_id("rs"), **data, "content": content}


class ItemReferenceSchema(StrictSchema):
    """An item of a stored response (its input or output) named by its id, as the AI SDK sends an
    earlier turn's items under `store: true`: replaced by the item before anything reads the input."""

    type = fields.String(allow_none=True, validate=validate.Equal("item_reference"))
    id = fields.String(required=True, validate=validate.Length(min=1, max=256))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {"type": "item_reference", "id": data["id"]}


ITEM_SCHEMAS = {
    "message": MessageItemSchema(),
    "function_call": FunctionCallItemSchema(),
    "function_call_output": FunctionCallOutputItemSchema(),
    "reasoning": ReasoningItemSchema(),
    "item_reference": ItemReferenceSchema(),
}


class InputField(fields.Field):
    """`input`: a string (one user message) or a list of items, each loaded by its type's schema."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[dict[str, Any], ...]:
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValidationError("Must be a string or a list of input items.")
        if len(value) > MAX_ITEMS:
            raise ValidationError(f"At most {MAX_ITEMS} items are allowed.")
        return tuple(input_item(i, item) for i, item in enumerate(value))


def input_item(index: int, item: Any) -> dict[str, Any]:
    """Item `index` of an input, in its canonical shape (an item without a type is a message where it
    has a role, else a reference where it has an id, as OpenAI's types read it)."""
    if not isinstance(item, dict):
        raise ValidationError({index: ["Must be an object."]})
    implied = "message" if "role" in item else ("item_reference" if "id" in item else None)
    type_ = item.get("type", implied)
    return load_variant(index, item, type_, ITEM_SCHEMAS, UNSUPPORTED_ITEMS, "Unknown or unsupported item type")


def load_variant(
    index: int,
    value: dict[str, Any],
    type_: Any,
    schemas: dict[str, Any],
    unsupported: dict[str, str],
    unknown: str,
) -> dict[str, Any]:
    """Element `index` of a list whose `type` picks its schema (Responses' items, Messages' content
    blocks): loaded by it, or refused naming what tokenline does not support or the unknown type; the
    errors are keyed by the element's index."""
    schema = schemas.get(type_) if isinstance(type_, str) else None
    if schema is None:
        what = unsupported.get(type_) if isinstance(type_, str) else None
        message = f"tokenline does not support {what}." if what else f"{unknown} {type_!r}."
        raise ValidationError({index: {"type": [message]}})
    try:
        return schema.load(value)
    except ValidationError as exc:
        raise ValidationError({index: exc.messages}) from None
