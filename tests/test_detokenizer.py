"""Incremental detokenization: deltas join to the full decode, and no half character is emitted."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from workers.engine.detokenizer import IncrementalDetokenizer

TEXT = "hello world 你好世界 ascend 昇腾 model 123 推理服务!"


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model / "tokenizer.json"))


def test_deltas_join_to_the_decoded_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: ").ids)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == TEXT


def test_a_multibyte_character_split_over_byte_tokens_is_held_until_complete(tokenizer: Tokenizer) -> None:
    # Byte-level BPE: encode each UTF-8 byte of 昇 as its own token.
    vocab = tokenizer.get_vocab()
    alphabet = dict(zip(range(256), _byte_level_alphabet(), strict=True))
    byte_ids = [vocab[alphabet[b]] for b in "昇".encode()]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in byte_ids]
    assert deltas == ["", "", "昇"]


def test_no_delta_contains_a_replacement_character_for_valid_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    assert all("\ufffd" not in detok.push(i) for i in ids)


def test_flush_drops_an_incomplete_trailing_character(tokenizer: Tokenizer) -> None:
    vocab = tokenizer.get_vocab()
    alphabet = dict(zip(range(256), _byte_level_alphabet(), strict=True))
    detok = IncrementalDetokenizer(tokenizer)
    first_two = [vocab[alphabet[b]] for b in "腾".encode()[:2]]
    assert [detok.push(i) for i in [vocab[alphabet[ord("a")]], *first_two]] == ["a", "", ""]
    assert detok.flush() == ""


def test_special_tokens_are_not_emitted(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer.token_to_id("<|im_end|>")) == ""


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte → printable character map, as used by ByteLevel pre-tokenizers."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
