"""Sampling and stopping parameters: validated once at the edge, carried in the job as-is."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_SEED = 2**64 - 1
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 262_144  # a whole vocabulary of today's largest (Gemma's 262,144)
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """What the worker needs to pick and stop tokens for one sequence.

    temperature 0 means greedy; top_k -1 means off; seed is always set by the API (the client's, or
    one the server picked) so that every answer can be reproduced. `logprobs` is the number of
    alternatives reported beside each sampled token's log probability (None: none reported);
    `prompt_logprobs` the same for every prompt token after the first. `grammar` is an llguidance
    grammar (schemas/guided.py) that every output token must follow, or None. vLLM's
    `allowed_token_ids` (empty: every token) are the only tokens it may draw; `bad_words` are token
    sequences its output never completes: the last token of each is banned wherever the output ends
    in the ones before it (the API tokenizes the words). With `thinking_budget` (vLLM's
    thinking_token_budget), once the reasoning has run that many tokens its end (`thinking_end`, the
    tokens of `</think>`) is forced; it begins after `thinking_start` in the output, or at once where
    that is empty (the prompt leaves the model inside it). With a `grammar` and `thinking_end`, the
    grammar constrains only the output after the reasoning (workers/engine/reasoning.py), which may
    then begin only at the start of the output.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bad_words: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    return_token_ids: bool = False  # vLLM's: each event carries the ids of the tokens whose text it carries
    thinking_budget: int | None = None
    thinking_start: tuple[int, ...] = field(default_factory=tuple)
    thinking_end: tuple[int, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_output(self) -> bool:
        """Its next token's constraints depend on the tokens just drawn (a grammar is the engine's to
        see): a bad word of several tokens, a thinking budget."""
        return self.thinking_budget is not None or any(len(word) > 1 for word in self.bad_words)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stop"] = list(self.stop)
        data["stop_token_ids"] = list(self.stop_token_ids)
        data["logit_bias"] = [list(pair) for pair in self.logit_bias]
        data["allowed_token_ids"] = list(self.allowed_token_ids)
        data["bad_words"] = [list(word) for word in self.bad_words]
        data["thinking_start"] = list(self.thinking_start)
        data["thinking_end"] = list(self.thinking_end)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(
            **{
                **data,
                "stop": tuple(data.get("stop") or ()),
                "stop_token_ids": tuple(data.get("stop_token_ids") or ()),
                "logit_bias": tuple((int(t), float(b)) for t, b in data.get("logit_bias") or ()),
                "allowed_token_ids": tuple(data.get("allowed_token_ids") or ()),
                "bad_words": tuple(tuple(word) for word in data.get("bad_words") or ()),
                "thinking_start": tuple(data.get("thinking_start") or ()),
                "thinking_end": tuple(data.get("thinking_end") or ()),
            }
        )
