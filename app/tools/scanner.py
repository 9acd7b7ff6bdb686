"""Partial JSON: one JSON value followed as its text arrives, without parsing it.

A tool call's arguments stream to the client as the model writes them, so the gateway must know,
character by character, whether it is still inside the arguments: where the value starts, where it
ends (its closing bracket, outside any string), and for an object, where each top-level member's key
and value lie. It never rebuilds the value, so the text the client receives is the model's own and
the pieces concatenate to exactly the non-streamed arguments. A character JSON cannot hold outside a
string (`<` of a closing tag, say) ends the value there, as invalid, so a malformed call never
swallows the markup after it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_STRING_STOP = re.compile(r'["\\]')
_BARE = frozenset("-+.0123456789eEtrufalsn")
_WHITESPACE = frozenset(" \t\r\n")


@dataclass
class Member:
    """A top-level member of an object: its key, and where its value lies in the scanned text."""

    key: str
    start: int
    end: int | None = None


@dataclass
class JsonValue:
    """One JSON value's extent in `text` (everything fed so far). `end` is set once the value is
    complete; `valid` turns false when a character no JSON value may hold ends it early."""

    text: str = ""
    start: int | None = None
    end: int | None = None
    valid: bool = True
    members: dict[str, Member] = field(default_factory=dict)
    _pos: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _key_start: int | None = None  # a top-level key being read
    _key: str | None = None  # a top-level key whose value is awaited
    _member: Member | None = None  # the top-level member whose value is being read

    @property
    def done(self) -> bool:
        return self.end is not None

    def feed(self, text: str) -> str:
        """Scan `text`; what follows the value's end (if it ended in it) is returned unscanned."""
        if self.done:
            return text
        self.text += text
        while self._pos < len(self.text) and not self.done:
            self._step()
        if self.done:
            rest = self.text[self.end :]
            self.text = self.text[: self.end]
            return rest
        return ""

    def value_of(self, key: str) -> object:
        """A complete member's value, decoded (None when absent, unfinished or not JSON)."""
        member = self.members.get(key)
        if member is None or member.end is None:
            return None
        try:
            return json.loads(self.text[member.start : member.end])
        except ValueError:
            return None

    def _step(self) -> None:
        if self._in_string:
            self._string()
            return
        char = self.text[self._pos]
        if char in _WHITESPACE:
            self._pos += 1
        elif self.start is None:
            self._begin(char)
        elif char == '"':
            self._open_string()
        elif char in "{[":
            self._value_starts()
            self._depth += 1
            self._pos += 1
        elif char in "}]":
            self._close(char)
        elif char == ",":
            self._member_ends(self._pos)
            self._pos += 1
        elif char == ":":
            self._pos += 1
        elif char in _BARE:
            self._value_starts()
            self._pos += 1
        else:
            self._invalid()

    def _begin(self, char: str) -> None:
        if char not in '{["' and char not in _BARE:
            self._invalid()
            return
        self.start = self._pos
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth = 1
        self._pos += 1

    def _open_string(self) -> None:
        self._string_start = self._pos
        if self._depth == 1 and self._key is None and self._member is None and self.text[self.start or 0] == "{":
            self._key_start = self._pos
        else:
            self._value_starts()
        self._in_string = True
        self._pos += 1

    def _string(self) -> None:
        if self._escaped:
            self._escaped = False
            self._pos += 1
            return
        found = _STRING_STOP.search(self.text, self._pos)
        if found is None:
            self._pos = len(self.text)
            return
        self._pos = found.end()
        if found.group() == "\\":
            self._escaped = True
            return
        self._in_string = False
        if self._depth == 0:  # the value itself was a string
            self.end = self._pos
        elif self._key_start is not None:
            self._key = _decode_key(self.text[self._key_start : self._pos])
            self._key_start = None
        elif self._depth == 1 and self._member is not None and self._member.start == self._string_start:
            self._member.end = self._pos
            self._member = None

    def _value_starts(self) -> None:
        """A value begins at depth 1 of the top-level object: it is the awaited key's."""
        if self._depth == 1 and self._key is not None and self._member is None:
            self._member = Member(self._key, self._pos)
            self.members[self._key] = self._member
            self._key = None

    def _member_ends(self, at: int) -> None:
        if self._depth == 1 and self._member is not None:
            end = at
            while end > self._member.start and self.text[end - 1] in _WHITESPACE:
                end -= 1
            self._member.end = end
            self._member = None

    def _close(self, char: str) -> None:
        self._depth -= 1
        self._pos += 1
        if self._depth == 1 and self._member is not None:
            self._member.end = self._pos
            self._member = None
        elif self._depth == 0:
            self._member_ends(self._pos - 1)
            self.end = self._pos
        elif self._depth < 0:
            self._invalid()

    def _invalid(self) -> None:
        self.valid = False
        self.end = self._pos
        if self.start is None:
            self.start = self._pos


def _decode_key(raw: str) -> str:
    try:
        return str(json.loads(raw))
    except ValueError:
        return raw
