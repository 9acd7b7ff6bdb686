"""The bytes each token stands for, read once from the tokenizer's vocabulary and decoder.

A model writes bytes, not characters: a byte-level BPE token (GPT-2, Llama 3, Qwen) or a
SentencePiece byte-fallback token (`<0xE6>`: Llama 2, Mistral, Gemma, Phi-3) may be a part of a
character, and a run of them may never form one. Decoding token ids to text through the tokenizer
(`decode`, `DecodeStream`) only sees the text it made, where an incomplete character and bytes that
can never form one look alike (U+FFFD). Knowing each token's bytes, the detokenizer hands them to an
incremental UTF-8 decoder, which knows the difference.

The bytes come from the tokenizer's decoder, as tokenizers' own decoders compute them for one token:
ByteLevel maps each character back to its byte; Metaspace and Replace turn "▁" into a space;
ByteFallback turns `<0xNN>` into byte NN. What a decoder does to the whole text after `Fuse` (Llama 2's
`Strip` of the first space) depends on the text's start, not on a token, and belongs to the prompt's
first token, not to generated ones. Any other decoder is read by difference: a token's text is what
decoding it after a fixed token adds.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character → byte map (the ByteLevel pre-tokenizer's and decoder's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(frozen=True)
class Vocabulary:
    """`pieces[id]`: the bytes token `id` stands for; `special`: the ids that skip_special_tokens drops."""

    pieces: Sequence[bytes]
    special: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Tokenizer, on_demand: bool = False) -> Vocabulary:
        """Every token's bytes, read now (the worker's detokenizer reads them all); `on_demand`: each
        token's read when first asked for (the API's logprobs, a few tokens of a large vocabulary:
        reading all 128k-150k of one holds an API process for seconds)."""
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        special = frozenset(i for i, token in added.items() if token.special)
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        steps = _token_steps(decoder)
        if steps is None:
            logger.info("decoder %s: token bytes are read by difference", (decoder or {}).get("type"))
        read = _token_reader(tokenizer, steps)
        pieces = _OnDemand(read, size) if on_demand else tuple(read(i) for i in range(size))
        return cls(pieces, special)

    def bytes_of(self, token: int, skip_special_tokens: bool = True) -> bytes:
        if skip_special_tokens and token in self.special:
            return b""
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def text_of(self, token: int) -> str:
        """One token's text, special or not (a stop token written out); invalid bytes as U+FFFD."""
        return self.bytes_of(token, skip_special_tokens=False).decode("utf-8", "replace")


def _token_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The decoder's steps that apply to each token on its own (those before a Fuse), or None when
    some step is not one this module knows."""
    if decoder is None:
        return None
    chain = decoder["decoders"] if decoder["type"] == "Sequence" else [decoder]
    steps = []
    for step in chain:
        kind = step["type"]
        if kind == "Fuse":
            break  # from here on the steps see the whole text
        if kind == "Replace" and "String" not in step["pattern"]:
            return None
        if kind not in ("ByteLevel", "Metaspace", "Replace", "ByteFallback", "Strip"):
            return None
        steps.append(step)
    return steps


def _apply(steps: list[dict[str, Any]], token: str) -> bytes:
    piece: str | bytes = token
    for step in steps:
        if isinstance(piece, bytes):
            break  # a byte token is final
        kind = step["type"]
        if kind == "ByteLevel":
            alphabet = _ALPHABET
            piece = bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
        elif kind == "Metaspace":
            piece = piece.replace(step.get("replacement", "▁"), " ")
        elif kind == "Replace":
            piece = piece.replace(step["pattern"]["String"], step["content"])
        elif kind == "ByteFallback":
            match = _BYTE_TOKEN.match(piece)
            piece = bytes([int(match.group(1), 16)]) if match else piece
        elif kind == "Strip":
            content, start, stop = step["content"], step["start"], step["stop"]
            for _ in range(start):
                piece = piece.removeprefix(content)
            for _ in range(stop):
                piece = piece.removesuffix(content)
    return piece if isinstance(piece, bytes) else piece.encode()


def _token_reader(tokenizer: Tokenizer, steps: list[dict[str, Any]] | None) -> Any:
    """A token's bytes by the decoder's per-token `steps`; where they are unknown (None), by difference:
    what decoding it after a fixed token adds."""
    if steps is not None:
        return lambda token: _apply(steps, tokenizer.id_to_token(token) or "")
    anchor = tokenizer.token_to_id("a") or 0
    base = tokenizer.decode([anchor], skip_special_tokens=False)
    return lambda token: tokenizer.decode([anchor, token], skip_special_tokens=False).removeprefix(base).encode()


class _OnDemand(Sequence[bytes]):
    """The tokens' bytes, each read the first time it is asked for and kept."""

    def __init__(self, read: Any, size: int) -> None:
        self.read, self.size = read, size
        self.known: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, token: int) -> bytes:  # type: ignore[override]
        if not 0 <= token < self.size:
            raise IndexError(token)
        piece = self.known.get(token)
        if piece is None:
            piece = self.known[token] = self.read(token)
        return piece


_ALPHABET = byte_level_alphabet()
