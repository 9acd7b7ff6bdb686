"""Tool calls in what a model writes: the formats of the model families (detected from the chat
template), read as the text streams. `reader(format)` answers a `CallReader` whose pieces are the
model's words (`Text`), the start of a call (`CallStart`) and its arguments as written (`Arguments`)."""

from __future__ import annotations

from app.tools.formats import FORMATS, STRICT_CALLS, call_tag, detect, reader
from app.tools.pieces import Arguments, CallReader, CallStart, Piece, Text

__all__ = [
    "FORMATS",
    "STRICT_CALLS",
    "Arguments",
    "CallReader",
    "CallStart",
    "Piece",
    "Text",
    "call_tag",
    "detect",
    "reader",
]
