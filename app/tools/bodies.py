"""A call's body, read as it streams: the arguments after a header that named the function
(`ArgumentsBody`), or a JSON call object `{"name": …, "arguments": {…}}` (`ObjectBody`). Both follow
the JSON with the partial-JSON scanner and send the arguments as written."""

from __future__ import annotations

from typing import Protocol

from app.tools.pieces import Arguments, CallStart, Piece
from app.tools.scanner import JsonValue


class Body(Protocol):
    failed: bool

    @property
    def started(self) -> bool:
        """Its call has gone out (it will not be given back as words)."""
        ...

    def feed(self, text: str) -> tuple[list[Piece], str | None]:
        """Pieces, and the text after the body once it has ended (None while it goes on)."""
        ...

    def raw(self) -> str:
        """All the text the body took (to give back as words when it is not a call)."""
        ...


class ArgumentsBody:
    """A call whose name came in its header: the body is the arguments, one JSON object."""

    def __init__(self, name: str, call_id: str | None = None) -> None:
        self.name, self.call_id = name, call_id
        self.value = JsonValue()
        self.sent: int | None = None  # how much of the value has gone out
        self.failed = False

    @property
    def started(self) -> bool:
        return self.sent is not None

    def feed(self, text: str) -> tuple[list[Piece], str | None]:
        rest = self.value.feed(text)
        value = self.value
        if value.start is None:
            return [], None
        pieces: list[Piece] = []
        if self.sent is None:
            if value.text[value.start : value.start + 1] != "{":
                self.failed = True
                return [], rest
            pieces.append(CallStart(self.name, self.call_id))
            self.sent = value.start
        upto = value.end if value.done else len(value.text)
        if upto is not None and upto > self.sent:
            pieces.append(Arguments(value.text[self.sent : upto]))
            self.sent = upto
        return pieces, (rest if value.done else None)

    def raw(self) -> str:
        return self.value.text


class ObjectBody:
    """A call written as a JSON object: `{"name": …, "arguments": {…}}` (or `parameters`). The name
    may follow the arguments; these wait for it. Arguments given as a string go out decoded, once."""

    def __init__(self, keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.keys = keys
        self.value = JsonValue()
        self.started = False
        self.sent = 0
        self.failed = False

    def feed(self, text: str) -> tuple[list[Piece], str | None]:
        rest = self.value.feed(text)
        value = self.value
        if value.start is None:
            return [], None
        if value.text[value.start : value.start + 1] != "{":
            self.failed = True
            return [], rest
        pieces: list[Piece] = []
        if not self.started:
            name = value.value_of("name")
            if not isinstance(name, str):
                if value.done:
                    self.failed = True
                    return [], rest
                return [], None
            pieces.append(CallStart(name))
            self.started = True
        pieces += self._arguments()
        if value.done:
            return pieces, rest
        return pieces, None

    def _arguments(self) -> list[Piece]:
        value = self.value
        member = next((value.members[k] for k in self.keys if k in value.members), None)
        if member is None:
            return [Arguments("{}")] if value.done else []
        if value.text[member.start] not in "{[":  # a string (or worse): sent whole once it ends
            if self.sent == 0 and (member.end is not None or value.done):
                self.sent = -1
                decoded = value.value_of(member.key)
                return [Arguments(decoded if isinstance(decoded, str) else value.text[member.start : member.end])]
            return []
        start = max(self.sent, member.start)
        upto = member.end if member.end is not None else len(value.text)
        if upto <= start:
            return []
        self.sent = upto
        return [Arguments(value.text[start:upto])]

    def raw(self) -> str:
        return self.value.text
