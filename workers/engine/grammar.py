"""Grammar matchers for constrained decoding (llguidance), one per constrained sequence.

The API turns response_format and forced tool choices into llguidance grammars (schemas/guided.py);
here each is compiled against the model's tokenizer. The sampler asks a sequence's matcher for the
tokens allowed next (a bit mask) and the output processor feeds it each token drawn.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from schemas.errors import ConstraintFailed

logger = logging.getLogger(__name__)

_SHIFTS: dict[torch.device, torch.Tensor] = {}


class GrammarCompiler:
    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: Collection[int]) -> None:
        # Built once per worker: the vocabulary's byte strings and token trie. llguidance holds the GIL
        # meanwhile, seconds for a 130k-150k vocabulary on a CPU core, so a worker builds it before it
        # serves (workers/serving/main.py; the times are in docs/operations.md).
        started = time.monotonic()
        self.tokenizer = LLTokenizer(
            _within(tokenizer_file.read_text(encoding="utf-8"), vocab_size),
            n_vocab=vocab_size,
            eos_token=list(eos_ids) or None,
        )
        logger.info("grammar engine: %d-token vocabulary read in %.1f s", vocab_size, time.monotonic() - started)

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher at the grammar's start; ConstraintFailed if the grammar does not compile."""
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintFailed(f"The output constraint cannot be compiled: {matcher_error(matcher)}.")
        return matcher


def _within(tokenizer: str, vocab_size: int) -> str:
    """The tokenizer.json text without the added tokens past the model's logits (a pad token added
    beyond the embedding, say), which the model never draws and llguidance refuses (it takes no
    vocabulary smaller than the tokenizer's)."""
    data = json.loads(tokenizer)
    added = data.get("added_tokens") or []
    if all(token["id"] < vocab_size for token in added):
        return tokenizer
    data["added_tokens"] = [token for token in added if token["id"] < vocab_size]
    return json.dumps(data, ensure_ascii=False)


def matcher_error(matcher: LLMatcher) -> str:
    """A failed matcher's reason: the first line of its error (the rest is a dump of its state)."""
    return (matcher.get_error() or "unknown error").splitlines()[0]


def follow(matcher: LLMatcher, token: int) -> None:
    """Advance `matcher` past a drawn token. ConstraintFailed where the grammar engine fails on it (a
    limit of its own some schemas reach only as the output is drawn, such as the lexer's expressions
    for a long `{n}` repeat); ValueError where the token is one the grammar forbids (the sampler drew
    outside the mask: a bug here, not the request's)."""
    if matcher.consume_token(token):
        return
    if matcher.is_error():
        raise ConstraintFailed(
            f"The output constraint could not be followed: {matcher_error(matcher)}. The schema asks for more "
            "than the grammar engine builds; simplify it (fewer or shorter repeats, alternatives or properties)."
        )
    raise ValueError(f"the grammar refused token {token}")


def allowed_tokens(matchers: Sequence[Any], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(matchers), vocab] booleans on `device`: the tokens each matcher allows next. The matchers
    fill one bit per token on the host; one transfer carries the bits and the device unpacks them (on
    a CPU, numpy's unpackbits does it in one pass)."""
    words = (vocab + 31) // 32
    bits = torch.empty((len(matchers), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), words * 4)
    if device.type == "cpu":
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(unpacked[:, :vocab].view(np.bool_))
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    on_device = bits.to(device, non_blocking=False)
    return ((on_device.unsqueeze(-1) >> shifts) & 1).reshape(len(matchers), words * 32)[:, :vocab].bool()
