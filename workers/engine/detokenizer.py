"""Incremental detokenization that never emits half a character.

Built on the tokenizers library's `DecodeStream` (one call into Rust per token): it holds back the
bytes of an incomplete UTF-8 character until a later token completes it, and decodes invalid bytes
to U+FFFD, as vLLM does. A few prompt tokens seed the stream so that tokenizers which drop a leading
space decode the first token correctly.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(
            ids=list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self.held: list[int] = []  # tokens since the last text: an incomplete character

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        text = self.stream.step(self.tokenizer, token_id)
        if text is None:
            self.held.append(token_id)
            return ""
        self.held.clear()
        return text

    def flush(self) -> str:
        """At the end: what is still held back. Its last unit may be a character cut short (by
        max_tokens, say), which is dropped; bytes before it that never formed a character are U+FFFD."""
        if not self.held:
            return ""
        text = self.tokenizer.decode(self.held, skip_special_tokens=self.skip_special_tokens)
        self.held.clear()
        return text[:-1] if text.endswith(REPLACEMENT) else text
