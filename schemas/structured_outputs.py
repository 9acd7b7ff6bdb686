"""vLLM's `structured_outputs` (chat and completions, an `extra_body` field of the openai SDK): the
output follows a JSON schema, a regular expression, one of a list of strings, or a context-free
grammar, built with llguidance as response_format's constraints are (schemas/guided.py).

Exactly one constraint: `json` (a schema, or its JSON text), `regex` (Rust's regex syntax, which
llguidance reads), `choice` (strings), `grammar` (Lark, or llama.cpp's GBNF, which vLLM's xgrammar
backend reads and llguidance converts) or `json_object: true`. Of the options, those whose meaning is
already what happens are taken (`disable_any_whitespace`: the JSON is compact either way,
`disable_fallback`: there is no other backend); the others are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from marshmallow import ValidationError, fields, validate, validates_schema

from schemas import guided
from schemas.fields import Refused, StrictBoolean
from schemas.json_schemas import schema_grammar
from schemas.requests import MAX_CONTENT_CHARS, StrictSchema

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1024


class JsonField(fields.Field):
    """A JSON schema, as an object or as its JSON text (vLLM takes both)."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> dict[str, Any]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise ValidationError("Must be a JSON schema: an object, or its JSON text.") from None
        if not isinstance(value, dict):
            raise ValidationError("Must be a JSON schema: an object, or its JSON text.")
        return value


class StructuredOutputsSchema(StrictSchema):
    json = JsonField(allow_none=True)
    regex = fields.String(allow_none=True, validate=validate.Length(min=1, max=MAX_CONTENT_CHARS))
    choice = fields.List(
        fields.String(validate=validate.Length(min=1)),
        allow_none=True,
        validate=validate.Length(min=1, max=MAX_CHOICES),
    )
    grammar = fields.String(allow_none=True, validate=validate.Length(min=1, max=MAX_CONTENT_CHARS))
    json_object = StrictBoolean(allow_none=True)
    disable_any_whitespace = StrictBoolean(allow_none=True)
    disable_fallback = StrictBoolean(allow_none=True)
    disable_additional_properties = Refused("disable_additional_properties (give additionalProperties)", (False,))
    whitespace_pattern = Refused("whitespace patterns (the JSON is compact)")
    structural_tag = Refused("structural tags")

    @validates_schema
    def _one(self, data: dict[str, Any], **kwargs: Any) -> None:
        given = [name for name in CONSTRAINTS if data.get(name) not in (None, False)]
        if len(given) != 1:
            raise ValidationError(f"Give exactly one of {', '.join(CONSTRAINTS[:-1])} or json_object: true.")


def structured_grammar(spec: dict[str, Any]) -> tuple[str, str]:
    """The grammar `spec` (a loaded StructuredOutputsSchema) asks for, and the field that holds it;
    ValidationError naming that field where it does not compile."""
    kind = next(name for name in CONSTRAINTS if spec.get(name) not in (None, False))
    try:
        if kind == "json":
            grammar = schema_grammar(spec["json"], strict=True)
        elif kind == "json_object":
            grammar = guided.json_object()
        elif kind == "choice":
            grammar = guided.from_text("choice", json.dumps(spec["choice"]))
        else:
            grammar = guided.from_text(kind, spec[kind])
    except guided.GrammarError as exc:
        raise ValidationError({"structured_outputs": {kind: [str(exc)]}}) from None
    return grammar, f"structured_outputs.{kind}"
