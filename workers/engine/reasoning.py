"""Where a sequence of a reasoning model is in its reasoning (`<think>…</think>`), read from its output
as it grows, each token once.

Two things follow it: a thinking budget (the sampler forces the reasoning's end once it has run that
many tokens), and a grammar (a response_format, a forced tool call), which constrains only what comes
after the reasoning, as vLLM's structured outputs do with a reasoning parser: the model reasons
freely, then answers in the grammar. The parameters name the reasoning's tokens (`thinking_start`,
`thinking_end`); without an opening the output starts inside it (the prompt opened it). Under a
grammar the model may open it only at the start of its output (the grammar's first token, or the
opening), and once it has drawn the opening's first token the rest of the opening follows.
"""

from __future__ import annotations

from schemas.sampling import SamplingParams


class Reasoning:
    """`at_start`: the reasoning can begin only at the start of the output (under a grammar); else
    wherever the output writes the opening (a thinking budget alone)."""

    def __init__(self, params: SamplingParams, at_start: bool = False) -> None:
        self.opening, self.closing = params.thinking_start, params.thinking_end
        self.at_start = at_start
        self.began: int | None = None if self.opening else 0  # where the reasoning's text begins
        self.ended: int | None = None  # where the answer begins: just past the closing
        self.never = False  # the output began otherwise than with the opening (`at_start`)
        self.read = 0  # output tokens read so far

    def update(self, output: list[int]) -> None:
        """Read the tokens the output gained since the last call."""
        for end in range(self.read + 1, len(output) + 1):
            if self.began is None and not self.never:
                if _ends_with(output, end, self.opening) and (end == len(self.opening) or not self.at_start):
                    self.began = end
                elif self.at_start and not _opens(output[:end], self.opening):
                    self.never = True
            elif self.began is not None and self.ended is None and _ends_with(output, end, self.closing):
                self.ended = end
        self.read = len(output)

    @property
    def inside(self) -> bool:
        return self.began is not None and self.ended is None

    def opening_next(self, output: list[int]) -> int | None:
        """The opening's next token while the output is a proper beginning of it, else None."""
        if self.began is None and len(output) < len(self.opening) and _opens(output, self.opening):
            return self.opening[len(output)]
        return None

    def answering(self, output: list[int]) -> bool:
        """Whether the output's last token is the answer's (what a grammar follows): past the reasoning,
        or where none began and it is no beginning of the opening."""
        if self.began is not None:
            return self.ended is not None and len(output) > self.ended
        return not _opens(output, self.opening)

    def forced(self, output: list[int], budget: int) -> int | None:
        """The token the output must take next under a thinking `budget`: the next of the closing
        tokens once the reasoning has run it, else None."""
        if not self.inside:
            return None
        assert self.began is not None
        past = len(output) - (self.began + budget)
        return self.closing[past] if 0 <= past < len(self.closing) else None


def _opens(output: list[int], opening: tuple[int, ...]) -> bool:
    """Whether the output so far is a beginning of the opening (the whole of it included)."""
    return len(output) <= len(opening) and tuple(output) == opening[: len(output)]


def _ends_with(output: list[int], end: int, tokens: tuple[int, ...]) -> bool:
    """Whether output[:end] ends with `tokens`."""
    return bool(tokens) and end >= len(tokens) and tuple(output[end - len(tokens) : end]) == tokens
