"""Grammar libraries side by side: what each adds per decode step for a batch of JSON-constrained
sequences, on the demo model's tokenizer (or any tokenizer.json given), on this host's CPU.

`python bench/grammar_backends.py [--tokenizer DIR]`. For each installed library (llguidance, which
tokenline uses, and xgrammar if it is installed)
and each batch size, a step is: fill the batch's token bitmask on the host, apply it to [batch, vocab]
float32 logits, take the best allowed token per row and feed it to that row's matcher. A matcher
whose output completes starts again. Medians over `--steps` steps, after a warm-up, against the
same step without a grammar (the argmax alone); compilation time is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_file: Path, vocab: int, eos: int) -> None:
        import llguidance

        sys.path.insert(0, str(ROOT))
        from schemas.guided import json_schema
        from workers.engine.grammar import allowed_tokens

        self.allowed_tokens = allowed_tokens

        self.llguidance = llguidance
        started = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab, eos_token=[eos])
        self.grammar = json_schema(SCHEMA)
        self.compile_seconds = time.perf_counter() - started
        self.vocab = vocab

    def matcher(self) -> Any:
        return self.llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> None:  # as tokenline's sampler does
        logits.masked_fill_(~self.allowed_tokens(matchers, self.vocab, logits.device), float("-inf"))

    def accept(self, matcher: Any, token: int) -> bool:
        """Feed the token; True when the output is complete."""
        assert matcher.consume_token(token), matcher.get_error()
        return matcher.is_stopped() or (matcher.is_accepting() and token == self.tokenizer.eos_token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_file: Path, vocab: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        started = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        self.compile_seconds = time.perf_counter() - started
        self.vocab = vocab

    def matcher(self) -> Any:
        return self.xgr.GrammarMatcher(self.compiled)

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        bits = self.xgr.allocate_token_bitmask(len(matchers), self.vocab)
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bits, i)
        self.xgr.apply_token_bitmask_inplace(logits, bits)

    def accept(self, matcher: Any, token: int) -> bool:
        assert matcher.accept_token(token)
        return matcher.is_terminated()


def run(backend: Any, batch: int, steps: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(batch)
    matchers = [backend.matcher() for _ in range(batch)]
    plain: list[float] = []
    constrained: list[float] = []
    for step in range(steps + 10):
        logits = torch.randn((batch, backend.vocab), generator=generator)
        started = time.perf_counter()
        logits.clone().argmax(dim=-1).tolist()
        middle = time.perf_counter()
        backend.mask(logits, matchers)
        tokens = logits.argmax(dim=-1).tolist()
        for i, token in enumerate(tokens):
            if backend.accept(matchers[i], token):
                matchers[i] = backend.matcher()
        ended = time.perf_counter()
        if step >= 10:  # warm-up
            plain.append(middle - started)
            constrained.append(ended - middle)
    added = statistics.median(constrained) - statistics.median(plain)
    return {"added_ms_per_step": round(added * 1e3, 3), "added_ms_per_token": round(added * 1e3 / batch, 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "demo")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    config = json.loads((args.tokenizer / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    torch.set_num_threads(1)
    for kind in (Llguidance, Xgrammar):
        try:
            backend = kind(args.tokenizer / "tokenizer.json", vocab, eos)
        except ImportError:
            print(json.dumps({"backend": kind.name, "installed": False}))
            continue
        for batch in (int(b) for b in args.batches.split(",")):
            result = run(backend, batch, args.steps)
            row = {"backend": kind.name, "vocab": vocab, "batch": batch, **result}
            print(json.dumps({**row, "compile_ms": round(backend.compile_seconds * 1e3, 1)}))


if __name__ == "__main__":
    main()
