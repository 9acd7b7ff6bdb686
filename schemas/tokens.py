"""POST /tokenize and /detokenize, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from marshmallow import ValidationError, fields, validate, validates_schema

from schemas.chat import MessageSchema, ToolSchema, check_continuation
from schemas.fields import StrictBoolean, TokenIds
from schemas.requests import MAX_CONTENT_CHARS, StrictSchema, model_name


class TokenizeSchema(StrictSchema):
    model = model_name(load_default=None, allow_none=True)
    prompt = fields.String(validate=validate.Length(min=1, max=MAX_CONTENT_CHARS))
    add_special_tokens = StrictBoolean(allow_none=True)
    messages = fields.List(fields.Nested(MessageSchema), validate=validate.Length(min=1))
    chat_template_kwargs = fields.Dict(keys=fields.String(), allow_none=True)
    # The chat request's tools, rendered by the template as a chat request renders them (vLLM's).
    tools = fields.List(fields.Nested(ToolSchema), allow_none=True, validate=validate.Length(max=128))
    # vLLM's: whether the messages end with the assistant turn's opening (default true, as a chat
    # request renders them).
    add_generation_prompt = StrictBoolean(allow_none=True)
    continue_final_message = StrictBoolean(allow_none=True)

    @validates_schema
    def _one_of(self, data: dict[str, Any], **kwargs: Any) -> None:
        if ("prompt" in data) == ("messages" in data):
            raise ValidationError("Give either prompt or messages.", "prompt")
        if "messages" in data and data.get("add_special_tokens") is not None:
            raise ValidationError("Only allowed with prompt.", "add_special_tokens")
        for name in ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"):
            if "prompt" in data and data.get(name) is not None:
                raise ValidationError("Only allowed with messages.", name)
        check_continuation(data)
        names = [tool.name for tool in data.get("tools") or ()]
        if len(set(names)) < len(names):
            raise ValidationError("Function names must be unique.", "tools")


class DetokenizeSchema(StrictSchema):
    model = model_name(load_default=None, allow_none=True)
    tokens = TokenIds(required=True)
