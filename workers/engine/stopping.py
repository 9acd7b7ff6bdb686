"""Stop strings: the text before the first stop string is emitted; the stop string itself only with
`include_stop_str_in_output` (vLLM's parameter).

Text that could be the start of a stop string is held back until the next delta settles it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.pending = ""
        self.matched: str | None = None  # the stop string that was reached (vLLM's stop_reason)

    def push(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [(i, len(s), s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            at, length, self.matched = min(hits)
            return text[: at + length if self.include else at], True
        return self._hold_back(text), False

    def hold(self, delta: str) -> str:
        """Before min_tokens: no stop string is matched, but the end of the text that could begin one
        is held, so that one ending after min_tokens is found (as vLLM looks back from its first
        check). Returns the text safe to emit."""
        return self._hold_back(self.pending + delta) if self.stops else delta

    def _hold_back(self, text: str) -> str:
        """Keep the end of `text` that could begin a stop string pending; the rest is safe to emit."""
        hold = self._held_suffix(text)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        for length in range(min(len(text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return length
        return 0
