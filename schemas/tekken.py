"""Mistral's `tekken.json` tokenizers, served where a model directory has no tokenizer.json.

Mistral's later releases (Magistral, Devstral, Mistral Small 3.x) ship their tokenizer only as
`tekken.json`, the format of Mistral's own library (mistral-common): a byte-level BPE in tiktoken's
form (each token's bytes, base64, in rank order; a merge is the pair whose joined bytes have the
lowest rank), a pre-tokenizing regex, and the control tokens that come first in the id space.
tokenline reads every model's tokenizer with the `tokenizers` library, so the same tokenizer is
written once as a tokenizer.json (and a tokenizer_config.json naming `<s>` and `</s>`), beside the
file or under `~/.cache/tokenline/tekken/` (schemas/derived.py), and read from there.

- The ids: the control tokens take ids 0 to `default_num_special_tokens` - 1 (those the file lists in
  `special_tokens`, then `<SPECIAL_i>` fillers), the BPE tokens follow in rank order, and the
  vocabulary is cut to `default_vocab_size`, as mistral-common reads it.
- Older files (Mistral Nemo's, Pixtral's) list no `special_tokens`; mistral-common then assumes its
  twenty original control tokens (`ORIGINAL_CONTROL_TOKENS`), and so does tokenline.
- The merges are derived from the ranks: every split of a token into two tokens is a merge, ordered
  by the rank of the token it makes; tokens found whole in the vocabulary are taken whole
  (`ignore_merges`), as tiktoken takes them. tests/test_tekken.py holds the result to tiktoken's
  encoding of the same ranks, token for token.
- A prompt encoded with its special tokens starts with `<s>`, as mistral-common encodes one; chat
  templates write `<s>` themselves and are encoded without.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from schemas.derived import derived_once
from schemas.vocabulary import byte_level_alphabet

FILE = "tekken.json"
# mistral-common's control tokens of files that list none (`Tekkenizer.DEPRECATED_SPECIAL_TOKENS`).
ORIGINAL_CONTROL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)
FILLER = "<SPECIAL_{}>"
# What tokenizer_config.json names, as transformers maps a tekken file's tokens.
NAMED = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


class TekkenError(ValueError):
    """The tekken.json file cannot be read as a tokenizer; the message names the file and why."""


def tokenizer_directory(file: Path) -> Path:
    """The directory of tokenizer.json and tokenizer_config.json derived from `file`, made if missing."""
    return derived_once(file, "tekken", lambda where: write(file, where))


def write(file: Path, where: Path) -> None:
    tokenizer = convert(file)
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps(NAMED, indent=2) + "\n", encoding="utf-8")


def convert(file: Path) -> Tokenizer:
    """The tokenizer `file` describes (TekkenError where it cannot be read as one)."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        config = data["config"]
        pattern = str(config["pattern"])
        ranked = [base64.b64decode(entry["token_bytes"]) for entry in data["vocab"]]
        controls = _controls(data, config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TekkenError(f"{file} cannot be read as a tekken tokenizer: {exc}") from None
    if config.get("default_vocab_size"):
        ranked = ranked[: int(config["default_vocab_size"]) - len(controls)]
    offset = len(controls)
    ranks = {piece: rank for rank, piece in enumerate(ranked)}
    text = {byte: char for char, byte in byte_level_alphabet().items()}
    vocab = {"".join(text[b] for b in piece): rank + offset for piece, rank in ranks.items()}
    vocab |= {token: id for id, token in enumerate(controls)}
    merges = []
    for piece, rank in ranks.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    tokenizer = Tokenizer(
        BPE(
            vocab,
            [("".join(text[b] for b in left), "".join(text[b] for b in right)) for *_, left, right in merges],
            fuse_unk=False,
            ignore_merges=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in controls])
    bos = NAMED["bos_token"]
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]),
        ]
    )
    return tokenizer


def _controls(data: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The control tokens by id: the file's `special_tokens` (ranks 0, 1, …) or the original twenty,
    then fillers up to `default_num_special_tokens`."""
    listed = data.get("special_tokens")
    if listed is None:
        tokens = list(ORIGINAL_CONTROL_TOKENS)
    else:
        ordered = sorted((int(entry["rank"]), str(entry["token_str"])) for entry in listed)
        if [rank for rank, _ in ordered] != list(range(len(ordered))):
            raise ValueError("special_tokens' ranks are not 0, 1, 2, …")
        tokens = [token for _, token in ordered]
    count = int(config.get("default_num_special_tokens") or len(tokens))
    if count < len(tokens):
        raise ValueError(f"default_num_special_tokens {count} is fewer than the {len(tokens)} special_tokens")
    return tokens + [FILLER.format(i) for i in range(len(tokens), count)]
