"""JSON Schemas that clients send (tool parameters, response formats), checked as OpenAI checks them
before any grammar is built: nesting depth, the dialect's metaschema, and `$ref`s that resolve
within the schema to something."""

from __future__ import annotations

import functools
import json
from typing import Any

from jsonschema import SchemaError
from jsonschema.exceptions import best_match
from jsonschema.validators import Draft202012Validator, validator_for
from marshmallow import ValidationError
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from schemas import guided


def object_schema(schema: dict[str, Any] | None) -> None:
    """A function's parameters (a tool's input_schema) describe the object its arguments are: a
    schema whose `type` says otherwise is refused (OpenAI and Anthropic refuse it; a forced call's
    grammar would write no arguments object). A schema without `type` is taken as an object's."""
    try:
        guided.check_schema(schema)
    except guided.GrammarError as exc:
        raise ValidationError(f"Not a valid JSON schema: {exc}.") from None
    kind = (schema or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValidationError(f"Must be a JSON schema of type 'object', not of type {json.dumps(kind)}.")
    problem = _schema_problem(json.dumps(schema or {}, sort_keys=True))
    if problem is not None:
        raise ValidationError(f"Not a valid JSON schema: {problem}.")


def instance_problem(schema: dict[str, Any], instance: Any) -> str | None:
    """Why `instance` is not valid by `schema` (a schema `object_schema` took), or None where it is."""
    validator = validator_for(schema, default=Draft202012Validator)(schema)
    error = best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = ".".join(map(str, error.path))
    return f"{error.message} (at {where})" if where else error.message


def schema_grammar(schema: dict[str, Any] | None, strict: bool = True) -> str:
    """The grammar of JSON that `schema` (None: any object) validates (a response format's, vLLM's
    structured_outputs.json); GrammarError if it nests too deep, bounds an integer past 64 bits, has a
    `$ref` that leads nowhere, or does not compile."""
    guided.check_schema(schema)
    problem = ref_problem(json.dumps(schema or {}, sort_keys=True))
    if problem is not None:
        raise guided.GrammarError(problem)
    return guided.json_schema(schema or {"type": "object"}, strict=strict)


@functools.lru_cache(maxsize=1024)
def _schema_problem(text: str) -> str | None:
    """What makes a schema invalid against its dialect's metaschema (2020-12 unless its `$schema` names
    another), or a `$ref` of it that points nowhere in it, as OpenAI refuses them; an agent sends the
    same tools every turn, so each is checked once."""
    schema = json.loads(text)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = ".".join(map(str, exc.path))
        return f"{exc.message} (at {where})" if where else exc.message
    return ref_problem(text)


@functools.lru_cache(maxsize=1024)
def ref_problem(text: str) -> str | None:
    """A `$ref` of the schema that points nowhere in it, or that leads through references alone back
    to itself (`{"$ref": "#"}`: no instance is described, and the grammar wrote an empty answer)."""
    schema = json.loads(text)
    resource = Resource.from_contents(schema, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:tokenline:tool", resource).crawl()
    return _unresolved(schema, registry.resolver(base_uri="urn:tokenline:tool"), root=True)


# The keywords of a schema that constrain nothing: one made of them and a `$ref` is only that reference.
ANNOTATIONS = frozenset(
    {"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title", "description", "examples"}
    | {"default", "deprecated", "readOnly", "writeOnly"}
)


def _ref_loop(schema: dict[str, Any], resolved: Any) -> bool:
    """Whether `schema`, only a `$ref` (resolved as `resolved`), comes back to a schema of its chain
    through references alone."""
    chain = [schema]
    target, resolver = resolved.contents, resolved.resolver
    while isinstance(target, dict) and isinstance(target.get("$ref"), str) and set(target) <= ANNOTATIONS:
        if any(target is seen for seen in chain):
            return True
        chain.append(target)
        try:
            resolved = resolver.lookup(target["$ref"])
        except Unresolvable:
            return False  # said of that reference itself
        target, resolver = resolved.contents, resolved.resolver
    return False


def _unresolved(schema: Any, resolver: Any, root: bool = False) -> str | None:
    """The first `$ref` of the schema that points nowhere in it (tokenline fetches no other schema),
    each resolved against its base: the schema's, or a nested `$id`'s."""
    if isinstance(schema, list):
        return next((p for p in (_unresolved(item, resolver) for item in schema) if p), None)
    if not isinstance(schema, dict):
        return None
    if "$id" in schema and not root:
        resolver = resolver.in_subresource(Resource.from_contents(schema, default_specification=DRAFT202012))
    ref = schema.get("$ref")
    if isinstance(ref, str):
        try:
            resolved = resolver.lookup(ref)
        except Unresolvable:
            return f"$ref {json.dumps(ref)} points nowhere in the schema (tokenline fetches no other schema)"
        if set(schema) <= ANNOTATIONS and _ref_loop(schema, resolved):
            return f"$ref {json.dumps(ref)} refers back to itself through references alone: it describes nothing"
    for key, value in schema.items():
        if key not in guided.VALUE_KEYWORDS:
            problem = _unresolved(value, resolver)
            if problem:
                return problem
    return None
