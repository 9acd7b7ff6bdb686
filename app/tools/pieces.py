"""The pieces a choice's text splits into as it streams: the model's words, the start of a call, and
a piece of a call's arguments; the protocol of a format's reader; and the two questions every reader
asks of text still arriving (may it become this marker? does it begin with it?)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MAX_HEADER = 256  # characters a call's header may take before the text is taken for words


@dataclass(frozen=True)
class Text:
    """The model's words, outside any call: content."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A new call: the function's name, and the model's own id for it when the format has one."""

    name: str
    id: str | None = None


@dataclass(frozen=True)
class Arguments:
    """The next piece of the current call's arguments."""

    text: str


Piece = Text | CallStart | Arguments


class CallReader(Protocol):
    """A choice's text after any reasoning, as it streams: `feed` answers the pieces that are sure,
    `close` the rest."""

    def feed(self, text: str) -> list[Piece]: ...

    def close(self) -> list[Piece]: ...


class StateReader:
    """A reader written as a small state machine over its buffered text: `feed` runs the method
    `_<state>` until one answers that it needs more text (False), and answers the non-empty pieces."""

    buffer: str
    state: str

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while getattr(self, f"_{self.state}")(pieces):
            pass
        return [p for p in pieces if not isinstance(p, Text) or p.text]

    def _optional_closer(self, closer: str, strip_after: bool = False) -> bool:
        """After optional space, take `closer` if the text begins with it, then back to words; False
        while the text may still become it."""
        stripped = self.buffer.lstrip()
        if not stripped:
            return False
        found = expect(stripped, closer)
        if found == "wait":
            return False
        rest = stripped[len(closer) :] if found == "yes" else stripped
        self.buffer = rest.lstrip() if strip_after and found == "yes" else rest
        self.state = "content"
        return True


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `markers` (and may yet become it)."""
    longest = max((len(m) for m in markers), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        if any(m.startswith(text[-length:]) for m in markers):
            return length
    return 0


def expect(text: str, literal: str) -> str:
    """'yes' when `text` begins with `literal`, 'wait' when it may still, else 'no'."""
    if text.startswith(literal):
        return "yes"
    return "wait" if literal.startswith(text) else "no"
