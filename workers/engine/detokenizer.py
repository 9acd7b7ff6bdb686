"""Incremental detokenization: each token's bytes (schemas/vocabulary.py) through an incremental UTF-8
decoder.

Text goes out as soon as its bytes form characters. Only bytes that may still complete a character
(at most three: a valid start of a UTF-8 sequence) wait for the next token; bytes that can never form
one become U+FFFD at once, one per maximal invalid subsequence, as tokenizers' own lossy decoding
writes them. Byte-level BPE and SentencePiece byte-fallback tokenizers go the same way.
"""

from __future__ import annotations

import codecs

from schemas.vocabulary import Vocabulary


class IncrementalDetokenizer:
    def __init__(self, vocabulary: Vocabulary, skip_special_tokens: bool = True) -> None:
        self.vocabulary = vocabulary
        self.skip_special_tokens = skip_special_tokens
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        return self.decoder.decode(self.vocabulary.bytes_of(token_id, self.skip_special_tokens))

    def flush(self) -> str:
        """At the end: the bytes still held are a character cut short (by max_tokens, say): dropped."""
        self.decoder.reset()
        return ""
