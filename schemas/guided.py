"""Grammars for constrained decoding, built and checked in the API with llguidance (no torch).

A request's constraint travels in the job as llguidance's grammar text; the worker compiles it
against the model's tokenizer (workers/engine/grammar.py). JSON is compact (", " and ": ", no other
whitespace), so a bounded schema always ends and the output parses with `json.loads`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, grammar_from

# Separators as json.dumps writes them; no free whitespace: random weights cannot wander in it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A schema's keywords whose values are JSON values, not schemas (a walk over its subschemas skips them).
VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


# How deep a schema may nest (objects and arrays): the metaschema check recurses per level and hit
# Python's recursion limit (a 500) near 190, grammar building deeper; OpenAI's strict schemas allow 10
# levels of objects, about 20 here.
MAX_SCHEMA_DEPTH = 128
# A format's marker that may be a token of its own: `<tool_call>`, `<｜tool▁sep｜>`, `[TOOL_CALLS]`.
MARKER = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")
INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class GrammarError(ValueError):
    """The schema cannot be compiled; the message says why."""


def check_schema(schema: Any) -> None:
    """GrammarError if `schema` nests objects and arrays more than MAX_SCHEMA_DEPTH deep, or bounds an
    integer beyond 64 bits: llguidance's integer ranges are int64, and it clamped such a bound into
    them (`"minimum": 1e30` became 2⁶³ - 1: the grammar wrote numbers the schema excludes)."""
    stack = [(schema, 1, True)]  # (value, depth, whether it is a schema: not a keyword's JSON value)
    while stack:
        value, depth, is_schema = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(value, dict):
            if is_schema:
                _check_integer_bounds(value)
            children = [(child, is_schema and key not in VALUE_KEYWORDS) for key, child in value.items()]
        else:
            children = [(child, is_schema) for child in value] if isinstance(value, list) else []
        stack.extend((child, depth + 1, kind) for child, kind in children if isinstance(child, (dict, list)))


def _check_integer_bounds(schema: dict[str, Any]) -> None:
    kind = schema.get("type")
    if kind != "integer" and not (isinstance(kind, list) and "integer" in kind):
        return
    for keyword in INTEGER_BOUNDS:
        bound = schema.get(keyword)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not INT64_MIN <= bound <= INT64_MAX:
            raise GrammarError(
                f"{keyword} {json.dumps(bound)} of an integer is beyond 64 bits: "
                f"bounds go from {INT64_MIN} to {INT64_MAX}"
            )


def json_schema(schema: dict[str, Any], strict: bool = True) -> str:
    """A grammar for JSON that validates against `schema`. Not strict: keywords llguidance does not
    implement are ignored instead of refused."""
    options = dict(JSON_OPTIONS, lenient=not strict)
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def from_text(kind: str, text: str) -> str:
    """A grammar for output that matches `text` as llguidance reads a `kind`: "regex" (Rust's regex
    syntax), "grammar" (Lark, or llama.cpp's GBNF, which it converts), "choice" (a JSON list of the
    strings the output may be)."""
    try:
        grammar = grammar_from(kind, text)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def json_object() -> str:
    """Any JSON object (response_format json_object)."""
    return json_schema({"type": "object"})


def named_tool(parameters: dict[str, Any]) -> str:
    """tool_choice naming a function: the output is that function's arguments."""
    return json_schema(parameters)


def required_tools(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """tool_choice "required": a JSON array of calls, `[{"name": …, "parameters": {…}}]`, at least one
    (exactly one when parallel calls are off), each naming one of the tools with valid arguments."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "parameters": _rebased(parameters, f"#/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, (name, parameters) in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema(schema)


@dataclass(frozen=True)
class CallBlock:
    """A model's calls as its format writes them (app/tools/formats.py's CallTag): a block begins with
    `trigger` and `begin`, holds one call (or, with a `separator`, a list of them), each an opening of
    `calls` (one per tool: its name, the opening, its schema, whether it is strict), with `numbered` an
    index (digits) and that text after the opening, the arguments as JSON and `close`, and ends with
    `end`. `tokens`: the tokenizer's added tokens (text → id), which llguidance reads as special
    whatever their flag (Qwen's `<tool_call>`): a marker that is one is named as that token. With
    `spaced`, whitespace may come after the trigger, between calls and before the end, as the
    format's parsers allow. With `whole` (Llama 3's JSON calls), the calls are the whole output, the
    trigger optional before them, each a JSON object `{"name": …, whole: arguments}`: text may not
    begin (after whitespace) with `{`, which its parser reads as a call, nor with the trigger."""

    trigger: str
    begin: str
    calls: tuple[tuple[str, str, dict[str, Any], bool], ...]
    close: str
    end: str
    separator: str | None
    tokens: Mapping[str, int]
    numbered: str | None = None
    whole: str | None = None
    spaced: bool = False

    def rules(self, opened: str) -> list[str]:
        """The Lark rules of `block`, opened by `opened` (the trigger and whatever comes before it)."""
        ws = " WS?" if self.spaced else ""
        # Spaced, a separator's own whitespace is any (`,\n` as well as `, `).
        separator = (self.separator or "").strip() if self.spaced else self.separator
        more = f" ({self.literal(separator)}{ws} call)*" if separator is not None else ""
        rules = [f"block: {opened}{ws} {self.literal(self.begin)} call{more}{ws} {self.literal(self.end)}"]
        rules.append(f"call: {' | '.join(f'call_{i}' for i in range(len(self.calls)))}")
        index = "" if self.numbered is None else f" /[0-9]{{1,6}}/ {self.literal(self.numbered)}"
        for i, (_, opening, schema, strict) in enumerate(self.calls):
            json_of = _json_of(schema, strict)
            rules.append(f"call_{i}: {self.literal(opening)}{index} {json_of} {self.literal(self.close)}")
        return rules

    def literal(self, text: str) -> str:
        return _literal(text, self.tokens)


def tool_calls_in_text(block: CallBlock) -> str:
    """tool_choice "auto" with a strict tool: the model writes what it likes, but a block of calls, once
    it writes the trigger, is held to the format's shape, each call to one of the tools and that tool's
    arguments (JSON of its schema, written as the other grammars write it; `strict` false: keywords the
    grammar library does not implement are ignored), as llguidance's structural tags do: a trigger
    that is a token is named as one (and the text may not spell it, which the parser would read as a
    call), and one written as text ends the free text where it is written (a lazy lexeme)."""
    if block.whole is not None:
        lark = ["%llguidance {}", "start: TEXT | block", f"TEXT: /{_not_beginning(block)}/", "WS: /[ \\t\\r\\n]+/"]
        lark += block.rules(f"WS? ({block.literal(block.trigger)} WS?)?")
        return from_text("grammar", "\n".join(lark) + "\n")
    text = "/(.|\\n)*/"
    if block.trigger in block.tokens:  # the text may not spell it
        text += rf" & ~/(.|\n)*{_escaped(block.trigger)}(.|\n)*/"
    lark = ["%llguidance {}", "start: block* TEXT", f"TEXT: {text}", "WS: /[ \\t\\r\\n]+/"]
    if block.trigger in block.tokens:
        lark += block.rules(f"TEXT {block.literal(block.trigger)}")
    else:
        lark += [f"trigger[lazy]: TEXT {json.dumps(block.trigger)}", *block.rules("trigger")]
    return from_text("grammar", "\n".join(lark) + "\n")


def answer_or_calls(answer: tuple[dict[str, Any], bool], block: CallBlock) -> str:
    """tool_choice "auto" with a JSON response format: the output is either the answer, JSON of the
    format's schema (`answer`: the schema and whether it is strict), or blocks of calls from its first
    token, each as `tool_calls_in_text` holds them (no text before or between them, which the format
    would not allow), so that the model may still call a tool."""
    if block.whole is not None:
        return _answer_or_whole_calls(answer, block)
    lark = ["%llguidance {}", "start: answer | blocks", f"answer: {_json_of(*answer)}"]
    lark += ["blocks: block (WS block)* WS?", "WS: /[ \\t\\r\\n]+/"]
    lark += block.rules(block.literal(block.trigger))
    return from_text("grammar", "\n".join(lark) + "\n")


def _answer_or_whole_calls(answer: tuple[dict[str, Any], bool], block: CallBlock) -> str:
    """`answer_or_calls` where the calls are the whole output: the answer or one call, as one JSON
    value (a call's opening spelt as text would be one lexeme and the answer's `{` another, and the
    lexer, which does not go back, could not choose between them), or the trigger and calls. The
    parser reads any object with a `name` at the answer's start as a call: an answer whose schema
    has no `name` of its own may not have one, so that no call passes as the answer unchecked (one
    that has is read as a call, whatever the grammar)."""
    schema, strict = answer
    own = schema.get("properties"), schema.get("required")
    if any(isinstance(names, dict | list) and "name" in names for names in own):
        answer_schema = _rebased(schema, "#/anyOf/0")
    else:  # whatever its root ($ref, anyOf, a list of types): the answer, and no `name` in it
        answer_schema = {"allOf": [_rebased(schema, "#/anyOf/0/allOf/0"), {"properties": {"name": False}}]}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                block.whole: _rebased(parameters, f"#/anyOf/{i}/properties/{block.whole}"),
            },
            "required": ["name", block.whole],
            "additionalProperties": False,
        }
        for i, (name, _, parameters, _) in enumerate(block.calls, start=1)
    ]
    either = {"anyOf": [answer_schema, *calls]}
    strict = strict and all(call[3] for call in block.calls)  # one JSON value: strict if all its parts are
    lark = ["%llguidance {}", "start: first | block", f"first: {_json_of(either, strict)}"]
    lark += ["WS: /[ \\t\\r\\n]+/", *block.rules(f"{block.literal(block.trigger)} WS?")]
    return from_text("grammar", "\n".join(lark) + "\n")


def _not_beginning(block: CallBlock) -> str:
    """A regex of the text that does not begin, after whitespace, with `{` (what Llama 3's parser
    reads as a call, whatever its keys and spacing) or the trigger spelt as text: a call cannot pass for
    text. The text's whitespace is the block's, which the lexer cannot give back: where the trigger is
    not a token, it comes first."""
    starts = ["{", block.trigger]
    assert len({text[0] for text in starts}) == len(starts), starts
    space = " \\t\\r\\n"
    other = [f"[^{_in_class(''.join(text[0] for text in starts))}{space}](.|\\n)*"]
    for text in starts:
        other += [f"{_escaped(text[:i])}([^{_in_class(text[i])}](.|\\n)*)?" for i in range(1, len(text))]
    return f"[{space}]*({'|'.join(other)})?"


def _escaped(text: str) -> str:
    """`text` as a regex that matches it (llguidance's Rust syntax; `/` ends the Lark regex)."""
    return "".join(f"\\{c}" if c in "\\.+*?()|[]{}^$/" else c for c in text)


def _in_class(chars: str) -> str:
    return "".join(f"\\{c}" if c in "\\]^-[/" else c for c in chars)


def _json_of(schema: dict[str, Any], strict: bool) -> str:
    """JSON of `schema` in a Lark grammar, written as the other grammars write it."""
    return "%json " + json.dumps({**schema, "x-guidance": dict(JSON_OPTIONS, lenient=not strict)})


def _literal(text: str, tokens: Mapping[str, int]) -> str:
    """`text` in a Lark grammar: quoted, but for the markers in it that are tokens of `tokens` (a `<…>`
    or `[…]` the tokenizer adds), which are named by id: the model writes each as one token, not as
    its text (Mistral's `[TOOL_CALLS]` has no name llguidance reads, which takes only `<…>` ones)."""
    named = sorted((t for t in tokens if t in text and MARKER.fullmatch(t)), key=len, reverse=True)
    parts, at = [], 0
    for match in re.finditer("|".join(map(re.escape, named)), text) if named else ():
        parts += [json.dumps(text[at : match.start()])] if match.start() > at else []
        parts.append(f"<[{tokens[match.group()]}]>")
        at = match.end()
    parts += [json.dumps(text[at:])] if at < len(text) else []
    return " ".join(parts)


def _rebased(schema: Any, base: str) -> Any:
    """`schema` placed at `base` (a "#/…" pointer) inside another: its references within itself ("#",
    "#/$defs/…", as pydantic writes them) pointed at its new place. A part under an `$id` of its own
    (the tool's root included) resolves its references against that, and is kept as it is."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        elif key in VALUE_KEYWORDS:
            rebased[key] = value
        else:
            rebased[key] = _rebased(value, base)
    return rebased
