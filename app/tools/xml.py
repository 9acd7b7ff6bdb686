"""Qwen3-Coder's tool calls (also Qwen3.5's and Nemotron 3 Nano's): parameters as tagged text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The values are text, so each is typed by the function's parameter schema (a `string` stays a
string; a number, boolean, object or array is read as JSON when it is one) and the arguments are
written as a JSON object, one member per parameter as soon as the parameter closes, so the pieces
concatenate to `json.dumps` of the arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from app.tools.pieces import MAX_HEADER, Arguments, CallStart, Piece, StateReader, Text, expect, held

OPENER, CLOSER = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=(?P<name>[^>\n]+)>")
PARAMETER = re.compile(r"<parameter=(?P<key>[^>\n]+)>")
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"


def typed(value: str, schema: Any) -> str:
    """A parameter's text as JSON, typed by its schema: text for strings and unknown parameters."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind not in (None, "string"):
        try:
            return json.dumps(json.loads(value), ensure_ascii=False)
        except ValueError:
            if kind == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower()
    return json.dumps(value, ensure_ascii=False)


class XmlCalls(StateReader):
    """Reads Qwen3-Coder calls as they stream; `tools` maps each function to its parameters schema."""

    def __init__(self, tools: Mapping[str, Any]) -> None:
        self.tools = tools
        self.buffer = ""
        self.state = "content"
        self.raw = ""  # a section's text before its call started, given back if it is not one
        self.properties: Mapping[str, Any] = {}
        self.members = 0

    def close(self) -> list[Piece]:
        text = self.buffer if self.state == "content" else self.raw + self.buffer if self.state == "function" else ""
        self.buffer, self.state = "", "content"
        return [Text(text)] if text else []

    def _take(self, length: int) -> str:
        taken, self.buffer = self.buffer[:length], self.buffer[length:]
        return taken

    def _content(self, pieces: list[Piece]) -> bool:
        at = self.buffer.find(OPENER)
        if at >= 0:
            pieces.append(Text(self._take(at)))
            self.raw, self.state = self._take(len(OPENER)), "function"
            return True
        keep = held(self.buffer, (OPENER,))
        pieces.append(Text(self._take(len(self.buffer) - keep)))
        return False

    def _function(self, pieces: list[Piece]) -> bool:
        self.raw += self._take(len(self.buffer) - len(self.buffer.lstrip()))
        if not self.buffer:
            return False
        match = FUNCTION.match(self.buffer)
        if match is None:
            found = expect(self.buffer, "<function=")
            if found == "no" or (found == "yes" and len(self.buffer) > MAX_HEADER):
                pieces.append(Text(self.raw))
                self.raw, self.state = "", "content"
                return True
            return False
        self._take(match.end())
        name = match.group("name").strip()
        parameters = self.tools.get(name)
        self.properties = parameters.get("properties", {}) if isinstance(parameters, Mapping) else {}
        pieces += [CallStart(name), Arguments("{")]
        self.raw, self.members, self.state = "", 0, "parameters"
        return True

    def _parameters(self, pieces: list[Piece]) -> bool:
        self._take(len(self.buffer) - len(self.buffer.lstrip()))
        if not self.buffer:
            return False
        match = PARAMETER.match(self.buffer)
        if match is not None:
            end = self.buffer.find(PARAMETER_END, match.end())
            if end < 0:
                return False
            value = self.buffer[match.end() : end].removeprefix("\n").removesuffix("\n")
            key = match.group("key").strip()
            member = f"{json.dumps(key, ensure_ascii=False)}: {typed(value, self.properties.get(key))}"
            pieces.append(Arguments((", " if self.members else "") + member))
            self.members += 1
            self._take(end + len(PARAMETER_END))
            return True
        if expect(self.buffer, "<parameter=") != "no" and len(self.buffer) < MAX_HEADER:
            return False  # a parameter's tag, still coming
        if expect(self.buffer, FUNCTION_END) == "wait":
            return False
        self._take(len(FUNCTION_END) if self.buffer.startswith(FUNCTION_END) else 0)
        pieces.append(Arguments("}"))
        self.state = "closer"
        return True

    def _closer(self, pieces: list[Piece]) -> bool:
        return self._optional_closer(CLOSER, strip_after=True)
