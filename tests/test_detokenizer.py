"""Incremental detokenization on the tokenizer formats users load: byte-level BPE (the demo model,
SmolLM2's real tokenizer) and SentencePiece byte-fallback (Llama 2 / Mistral / Phi-3's layout and
Gemma's). Deltas join to the decoded text; no half character is emitted; bytes that can never form a
character go out at once as U+FFFD; only a character's possible start (at most three bytes) waits."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from schemas.vocabulary import Vocabulary, byte_level_alphabet
from workers.engine.detokenizer import IncrementalDetokenizer

TEXT = "hello world 你好世界 ascend 昇腾 model 123 推理服务! 🙂 naïve café 𝄞"
FORMATS = ("byte-level", "smollm2", "llama2", "gemma")

pytestmark = pytest.mark.fetched  # SmolLM2's tokenizer, through a parameter


@pytest.fixture(scope="module", params=FORMATS)
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    name = request.param
    if name == "byte-level":
        path = request.getfixturevalue("demo_model")
    elif name == "smollm2":
        path = request.getfixturevalue("smollm2")
    else:
        path = request.getfixturevalue("sentencepiece_models")[name]
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


@pytest.fixture(scope="module")
def byte_fallback(sentencepiece_models: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_file(str(sentencepiece_models["llama2"] / "tokenizer.json"))


def byte_token(tokenizer: Tokenizer, value: int) -> int:
    """The id of the token that stands for one byte, in either format."""
    spm = tokenizer.token_to_id(f"<0x{value:02X}>")
    if spm is not None:
        return spm
    return tokenizer.token_to_id(next(c for c, b in byte_level_alphabet().items() if b == value))


def test_every_tokens_bytes_are_what_the_tokenizer_decodes_it_to(tokenizer: Tokenizer) -> None:
    vocabulary = Vocabulary.of(tokenizer)
    anchor = tokenizer.encode("a", add_special_tokens=False).ids[-1]
    base = tokenizer.decode([anchor], skip_special_tokens=False)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert len(vocabulary.pieces) == size
    for token in range(size):
        expected = tokenizer.decode([anchor, token], skip_special_tokens=False)
        assert (base.encode() + vocabulary.pieces[token]).decode("utf-8", "replace") == expected, token
    # The API's, read token by token as logprobs name them: the same bytes, none read before it is asked.
    on_demand = Vocabulary.of(tokenizer, on_demand=True)
    assert len(on_demand.pieces) == size and not on_demand.pieces.known  # type: ignore[attr-defined]
    assert [on_demand.bytes_of(t, False) for t in reversed(range(size))] == list(reversed(vocabulary.pieces))
    assert on_demand.special == vocabulary.special and on_demand.bytes_of(size) == b""


def test_deltas_join_to_the_decoded_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(Vocabulary.of(tokenizer))
    deltas = [detok.push(i) for i in ids]
    anchor = tokenizer.encode("a", add_special_tokens=False).ids[-1]
    after_a = tokenizer.decode([anchor, *ids]).removeprefix(tokenizer.decode([anchor]))
    assert "".join(deltas) == after_a
    assert after_a.lstrip() == TEXT  # (a SentencePiece tokenizer may prepend a space)
    assert not any("\ufffd" in d for d in deltas)


def test_a_character_split_over_byte_tokens_is_held_until_complete(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(Vocabulary.of(tokenizer))
    assert [detok.push(byte_token(tokenizer, b)) for b in "🙂".encode()] == ["", "", "", "🙂"]


def test_bytes_that_cannot_form_a_character_go_out_at_once_and_the_stream_goes_on(byte_fallback: Tokenizer) -> None:
    """The run that made tokenizers' DecodeStream raise "Invalid prefix encountered": é, then a
    three-byte start cut by an ASCII byte, then a word."""
    word = byte_fallback.encode("word", add_special_tokens=False).ids
    assert byte_fallback.id_to_token(word[0]).startswith("▁")
    ids = [byte_token(byte_fallback, b) for b in (0xC3, 0xA9, 0xE1, 0x56)] + word
    detok = IncrementalDetokenizer(Vocabulary.of(byte_fallback))
    deltas = [detok.push(i) for i in ids]
    assert deltas[:4] == ["", "é", "", "\ufffdV"]
    assert "".join(deltas[4:]) == " word"


def test_every_token_of_a_run_that_never_forms_a_character_is_its_own_delta(tokenizer: Tokenizer) -> None:
    """A continuation byte (0x80-0xBF) never begins a UTF-8 character: 200 such tokens are 200
    deltas, none held back."""
    detok = IncrementalDetokenizer(Vocabulary.of(tokenizer))
    tokens = [byte_token(tokenizer, 0xA9), byte_token(tokenizer, 0x80)] * 100
    assert [detok.push(t) for t in tokens] == ["\ufffd"] * 200


def test_at_most_a_characters_possible_start_waits(byte_fallback: Tokenizer) -> None:
    detok = IncrementalDetokenizer(Vocabulary.of(byte_fallback))
    start = [byte_token(byte_fallback, b) for b in (0xF0, 0x9F, 0x99)]
    assert [detok.push(t) for t in start] == ["", "", ""]
    # A fourth byte that does not continue it: the three held bytes were never a character.
    assert detok.push(byte_token(byte_fallback, 0x41)) == "\ufffdA"


def test_flush_drops_a_character_cut_short(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(Vocabulary.of(tokenizer))
    pushed = [detok.push(byte_token(tokenizer, b)) for b in b"a" + "腾".encode()[:2]]
    assert pushed == ["a", "", ""]
    assert detok.flush() == ""


def test_special_tokens_are_skipped_unless_asked_for(demo_model: Path) -> None:
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    vocabulary = Vocabulary.of(tokenizer)
    end = tokenizer.token_to_id("<|im_end|>")
    assert IncrementalDetokenizer(vocabulary).push(end) == ""
    assert IncrementalDetokenizer(vocabulary, skip_special_tokens=False).push(end) == "<|im_end|>"
    assert vocabulary.text_of(end) == "<|im_end|>"
