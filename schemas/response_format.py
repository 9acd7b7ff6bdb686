"""What a chat request's output must follow: response_format (text, a JSON object, or a JSON schema's
JSON) or a forced tool call's arguments, as an llguidance grammar (schemas/guided.py), and the field
that holds its schema. vLLM's structured_outputs are schemas/structured_outputs.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from marshmallow import ValidationError, fields, validate, validates_schema

from schemas import guided
from schemas.fields import StrictBoolean
from schemas.json_schemas import schema_grammar
from schemas.requests import StrictSchema

if TYPE_CHECKING:
    from schemas.chat import Tool

# A response format's schema's name, as OpenAI takes it (a function's without "." and ":").
VALID_SCHEMA_NAME = validate.Regexp(
    r"^[A-Za-z0-9_-]{1,64}\Z", error="Must be 1 to 64 characters, each a letter, a digit, '_' or '-'."
)


class JsonSchemaFormatSchema(StrictSchema):
    name = fields.String(required=True, validate=VALID_SCHEMA_NAME)
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


def request_grammar(
    response_format: dict[str, Any] | None, tools: tuple[Tool, ...], choice: str, name: str | None, parallel: bool
) -> tuple[str | None, str | None]:
    """The constraint a request asks for, and the field that holds its schema (an error the worker
    meets while following it names that field); ValidationError naming the field if it does not compile."""
    try:
        if choice == "function":
            index = next(i for i, tool in enumerate(tools) if tool.name == name)
            return guided.named_tool(tools[index].parameters), f"tools[{index}].function.parameters"
        if choice == "required":
            return guided.required_tools([(t.name, t.parameters) for t in tools], parallel), "tools"
    except guided.GrammarError as exc:
        raise ValidationError({"tools": [f"A function's parameters are not a usable JSON schema: {exc}"]}) from None
    answer = answer_format(response_format)
    if answer is None:
        return None, None
    if response_format["type"] == "json_object":
        return guided.json_object(), "response_format"
    try:
        grammar = schema_grammar(*answer)
    except guided.GrammarError as exc:
        raise ValidationError({"response_format": {"json_schema": {"schema": [str(exc)]}}}) from None
    return grammar, "response_format.json_schema.schema"


def answer_format(response_format: dict[str, Any] | None) -> tuple[dict[str, Any], bool] | None:
    """A JSON response_format's schema (any object for json_object, or a json_schema without one) and
    whether it is strict; None for text."""
    if not response_format or response_format["type"] == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}, True
    spec = response_format["json_schema"]
    return spec.get("schema") or {"type": "object"}, spec.get("strict") is not False
