"""Calls framed by a format's markers, read as the model writes them.

Most formats frame each call the same way: an opener that starts the tool section, then calls, each
a header that names the function and the arguments as one JSON value (DeepSeek, Kimi, functionary,
Mistral's `name[ARGS]{…}`), or a JSON object `{"name": …, "arguments": {…}}` (Hermes/Qwen, Llama,
Nemotron, granite, Mistral's array), with separators, closers and an end marker around them. One
`Framing` describes a format; `FramedCalls` reads any of them, holding back only what may still turn
out to be a marker. A call exists once its name is out (after a header, with the `{` of its
arguments); from then on its arguments stream as the model writes them, and a call cut short keeps what was
written. Text that looked like a call but is not one stays the model's words, as vLLM does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.tools.bodies import ArgumentsBody, Body, ObjectBody
from app.tools.pieces import MAX_HEADER, Arguments, Piece, Text, expect, held


@dataclass(frozen=True)
class Framing:
    """How a format frames its calls. Whitespace between the parts is free."""

    opener: str  # starts a tool section in the model's words
    header: re.Pattern[str] | None = None  # before each call; captures `name` (and `id`); None: object calls
    header_start: str = ""  # the literal each header begins with
    keep_opener: bool = False  # the opener is the first call's header (Hermes, functionary)
    begin: str = ""  # after the opener, before the first call: "[" of an array
    separator: str = ""  # between two calls
    closer: tuple[str, ...] = ()  # after each call's arguments, in order, each one optional
    end: tuple[str, ...] = ()  # closes the section: the first is required, the rest optional
    at_start: bool = False  # a section opens only the output (Llama 3's JSON)
    bare: bool = False  # with at_start: a call may also begin without the opener
    forced: bool = False  # the output is calls only (tool_choice required): nothing else is words
    keys: tuple[str, ...] = ("arguments", "parameters")

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.opener,) if self.opener else ()


class FramedCalls:
    """Reads one `Framing`'s calls out of a choice's text as it streams."""

    def __init__(self, framing: Framing) -> None:
        self.framing = framing
        self.buffer = ""
        self.state = "begin" if framing.forced else "content"
        self.spoken = False  # words came before any call (at_start formats then stay words)
        self.raw = ""  # the section's text since the last complete call, given back if no call follows
        self.calls = 0
        self.body: Body | None = None
        self.closer_at = 0

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return [p for p in pieces if not isinstance(p, (Text, Arguments)) or p.text]

    def close(self) -> list[Piece]:
        """At the end: held words go out; a section with no call in it is words after all; a call cut
        short keeps the arguments written (forced output has no words)."""
        body = self.body
        if self.state == "content":
            text = self.buffer
        elif self.state in ("done", "closer", "end") or self.framing.forced or (body is not None and body.started):
            text = ""
        else:
            text = self.raw + (body.raw() if body is not None else "") + self.buffer
            text = text if not self.calls else text.strip()
        self.buffer, self.state, self.body = "", "done", None
        return [Text(text)] if text else []

    def _step(self, pieces: list[Piece]) -> bool:
        """One move of the machine; False when it must wait for more text."""
        return getattr(self, f"_{self.state}")(pieces)

    def _done(self, pieces: list[Piece]) -> bool:
        self.buffer = ""
        return False

    def _content(self, pieces: list[Piece]) -> bool:
        framing = self.framing
        if framing.at_start:
            return self._content_at_start(pieces)
        at = self.buffer.find(framing.opener)
        if at >= 0:
            pieces.append(Text(self.buffer[:at]))
            self.buffer = self.buffer[at:]
            self._enter()
            return True
        keep = held(self.buffer, framing.markers)
        pieces.append(Text(self.buffer[: len(self.buffer) - keep]))
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _content_at_start(self, pieces: list[Piece]) -> bool:
        framing = self.framing
        stripped = self.buffer.lstrip(" \t\r\n")  # the whitespace a strict tool's grammar takes before a call
        if self.spoken or (stripped and not self._may_open(stripped)):
            self.spoken = True
            pieces.append(Text(self.buffer))
            self.buffer = ""
            return False
        if stripped.startswith(framing.opener) or (framing.bare and stripped.startswith("{")):
            self.buffer = stripped
            self._enter()
            return True
        return False  # only whitespace, or the start of the opener

    def _may_open(self, text: str) -> bool:
        framing = self.framing
        return framing.opener.startswith(text) or text.startswith(framing.opener) or (framing.bare and text[0] == "{")

    def _enter(self) -> None:
        framing = self.framing
        self.raw, self.calls = "", 0
        if not framing.keep_opener and self.buffer.startswith(framing.opener):
            self._take(len(framing.opener))
        self.state = "begin"

    def _take(self, length: int) -> None:
        self.raw += self.buffer[:length]
        self.buffer = self.buffer[length:]

    def _skip_space(self) -> bool:
        """Skip whitespace; False when nothing else is there yet."""
        stripped = self.buffer.lstrip()
        self._take(len(self.buffer) - len(stripped))
        return bool(self.buffer)

    def _begin(self, pieces: list[Piece]) -> bool:
        if not self._skip_space():
            return False
        if not self.framing.begin:
            self.state = "between"
            return True
        found = expect(self.buffer, self.framing.begin)
        if found == "yes":
            self._take(len(self.framing.begin))
            self.state = "between"
            return True
        return found == "no" and self._fail(pieces)

    def _between(self, pieces: list[Piece]) -> bool:
        framing = self.framing
        if not self._skip_space():
            return False
        for literal, then in ((framing.separator, "between"), (framing.end[0] if framing.end else "", "end")):
            if self.calls and literal:
                found = expect(self.buffer, literal)
                if found == "yes":
                    self._take(len(literal))
                    self.raw, self.state, self.closer_at = "", then, 1
                    return True
                if found == "wait":
                    return False
        return self._call(pieces)

    def _call(self, pieces: list[Piece]) -> bool:
        """A call's header (or the `{` of a call object) starts here, may still, or does not."""
        framing = self.framing
        if framing.header is None:
            if self.buffer[0] != "{":
                return self._fail(pieces)
            self.body = ObjectBody(framing.keys)
        else:
            found = expect(self.buffer, framing.header_start)
            if found == "no":
                return self._fail(pieces)
            match = framing.header.match(self.buffer) if found == "yes" else None
            if match is None:
                too_long = len(self.buffer) > len(framing.header_start) + MAX_HEADER
                return too_long and self._fail(pieces)
            self._take(match.end())
            if "name" in match.re.groupindex:
                self.body = ArgumentsBody(match.group("name"), match.groupdict().get("id"))
            else:
                self.body = ObjectBody(framing.keys)
        self.state = "body"
        return True

    def _body(self, pieces: list[Piece]) -> bool:
        assert self.body is not None
        text, self.buffer = self.buffer, ""
        out, rest = self.body.feed(text)
        if self.body.failed:
            self.buffer = self.body.raw() + (rest or "")
            self.body = None
            return self._fail(pieces)
        if out:
            self.raw = ""
        pieces += out
        if rest is None:
            return False
        self.buffer, self.body, self.calls = rest, None, self.calls + 1
        self.state, self.closer_at = "closer", 0
        return True

    def _closer(self, pieces: list[Piece]) -> bool:
        if not self._literals(self.framing.closer):
            return False
        self.raw, self.state = "", "between"
        return True

    def _end(self, pieces: list[Piece]) -> bool:
        if not self._literals(self.framing.end):
            return False
        self.raw = ""
        self.state = "done" if self.framing.forced else "content"
        self.buffer = self.buffer.lstrip()
        return True

    def _fail(self, pieces: list[Piece]) -> bool:
        """What follows is not a call: the section's words since the last call go back to the
        content (forced output has no words: it is dropped)."""
        if self.framing.forced:
            self.state = "done"
            return True
        given = self.raw
        if not self.calls and not given:  # nothing taken yet: step past the opener, or loop on it
            opener = self.framing.opener
            size = len(opener) if opener and self.buffer.startswith(opener) else 1
            given, self.buffer = self.buffer[:size], self.buffer[size:]
        if self.calls:
            given, self.buffer = given.strip(), self.buffer.lstrip()
        pieces.append(Text(given))
        self.raw, self.state = "", "content"
        self.spoken = self.spoken or self.framing.at_start
        return True

    def _literals(self, literals: tuple[str, ...]) -> bool:
        """Take `literals` in order, each optional and after optional space: False while the text
        may still become the next one."""
        while self.closer_at < len(literals):
            if not self._skip_space():
                return False
            found = expect(self.buffer, literals[self.closer_at])
            if found == "wait":
                return False
            if found == "yes":
                self._take(len(literals[self.closer_at]))
            self.closer_at += 1
        return True
