"""Grammar matchers for constrained decoding (llguidance), one per constrained sequence.

The API turns response_format and forced tool choices into llguidance grammars (schemas/guided.py);
here each is compiled against the model's tokenizer. The sampler asks a sequence's matcher for the
tokens allowed next (a bit mask) and the output processor feeds it each token drawn.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer


class GrammarCompiler:
    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: Collection[int]) -> None:
        # Built once per worker (about a second for a 150k vocabulary): the vocabulary's byte strings.
        self.tokenizer = LLTokenizer(
            tokenizer_file.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=list(eos_ids) or None
        )

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher at the grammar's start; ValueError if the grammar does not compile."""
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"The output constraint cannot be compiled: {matcher.get_error()}")
        return matcher
