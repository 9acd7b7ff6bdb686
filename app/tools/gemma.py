"""Gemma 4's tool calls: `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>`.

The arguments are written in the template's own notation (`format_argument`): bare keys, strings
between `<|"|>` marks, `true`/`false`, numbers, `{…}` and `[…]`. Each top-level argument is turned into
JSON as soon as it closes, so the pieces concatenate to `json.dumps` of the arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.tools.pieces import MAX_HEADER, Arguments, CallStart, Piece, StateReader, Text, expect, held

OPENER, CLOSER, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
HEADER = re.compile(r"<\|tool_call>call:(?P<name>[A-Za-z0-9_.:-]+)\{")
STRUCTURE = re.compile(r'<\|"\|>|[{}\[\],]')


class GemmaSyntaxError(ValueError):
    """Text that is not in the template's notation."""


def parse(text: str) -> Any:
    """A value in Gemma 4's notation, as Python."""
    value, end = _value(text, 0)
    if text[end:].strip():
        raise GemmaSyntaxError(text)
    return value


def _value(text: str, at: int) -> tuple[Any, int]:
    at = len(text) - len(text[at:].lstrip())
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise GemmaSyntaxError(text)
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", at):
        return _items(text, at + 1, "}", mapping=True)
    if text.startswith("[", at):
        return _items(text, at + 1, "]", mapping=False)
    bare = re.match(r"[^,}\]]*", text[at:])
    token = bare.group().strip() if bare else ""
    return _bare(token), at + (bare.end() if bare else 0)


def _items(text: str, at: int, close: str, mapping: bool) -> tuple[Any, int]:
    items: Any = {} if mapping else []
    while True:
        at = len(text) - len(text[at:].lstrip())
        if text.startswith(close, at):
            return items, at + 1
        if mapping:
            colon = text.find(":", at)
            if colon < 0:
                raise GemmaSyntaxError(text)
            key = text[at:colon].strip().removeprefix(QUOTE).removesuffix(QUOTE)
            items[key], at = _value(text, colon + 1)
        else:
            value, at = _value(text, at)
            items.append(value)
        at = len(text) - len(text[at:].lstrip())
        if text.startswith(",", at):
            at += 1
        elif not text.startswith(close, at):
            raise GemmaSyntaxError(text)


def _bare(token: str) -> Any:
    if token in ("true", "false"):
        return token == "true"
    if token in ("None", "null", ""):
        return None
    try:
        return json.loads(token)
    except ValueError:
        return token


class GemmaCalls(StateReader):
    """Reads Gemma 4 calls as they stream."""

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "content"
        self.depth = 0  # brackets open inside the arguments
        self.quoted = False
        self.scanned = 0  # how far into the buffer the current argument has been scanned
        self.members = 0

    def close(self) -> list[Piece]:
        text = self.buffer if self.state in ("content", "header") else ""
        self.buffer, self.state = "", "content"
        return [Text(text)] if text else []

    def _content(self, pieces: list[Piece]) -> bool:
        at = self.buffer.find(OPENER)
        if at >= 0:
            pieces.append(Text(self.buffer[:at]))
            self.buffer, self.state = self.buffer[at:], "header"
            return True
        keep = held(self.buffer, (OPENER,))
        pieces.append(Text(self.buffer[: len(self.buffer) - keep]))
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _header(self, pieces: list[Piece]) -> bool:
        match = HEADER.match(self.buffer)
        if match is None:
            if expect(self.buffer[len(OPENER) :], "call:") == "no" or len(self.buffer) > MAX_HEADER:
                pieces.append(Text(OPENER))
                self.buffer, self.state = self.buffer[len(OPENER) :], "content"
                return True
            return False
        pieces += [CallStart(match.group("name")), Arguments("{")]
        self.buffer = self.buffer[match.end() :]
        self.depth, self.quoted, self.scanned, self.members, self.state = 0, False, 0, 0, "arguments"
        return True

    def _arguments(self, pieces: list[Piece]) -> bool:
        """Scan to the end of the current top-level argument (a `,` or the closing `}`)."""
        for found in STRUCTURE.finditer(self.buffer, self.scanned):
            mark = found.group()
            self.scanned = found.end()
            if mark == QUOTE:
                self.quoted = not self.quoted
            elif self.quoted or (mark == "," and self.depth):
                continue
            elif mark in "{[":
                self.depth += 1
            elif mark in "]}" and self.depth:
                self.depth -= 1
            elif mark in ",}":
                self._member(self.buffer[: found.start()], pieces)
                self.buffer, self.scanned = self.buffer[found.end() :], 0
                if mark == "}":
                    pieces.append(Arguments("}"))
                    self.state = "closer"
                return True
        # A quote mark may be arriving: rescan its start next time.
        self.scanned = len(self.buffer) - held(self.buffer, (QUOTE,))
        return False

    def _member(self, text: str, pieces: list[Piece]) -> None:
        if not text.strip():
            return
        key, _, value = text.partition(":")
        try:
            decoded = parse(value)
        except GemmaSyntaxError:
            decoded = value.strip()
        member = f"{json.dumps(key.strip(), ensure_ascii=False)}: {json.dumps(decoded, ensure_ascii=False)}"
        pieces.append(Arguments((", " if self.members else "") + member))
        self.members += 1

    def _closer(self, pieces: list[Piece]) -> bool:
        return self._optional_closer(CLOSER)
