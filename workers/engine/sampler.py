"""Batched token selection: one pass over the batch's logits, every row with its own parameters.

Order, as in vLLM: the log probabilities a request asked for are taken from the model's own
distribution first (before any of what follows, vLLM's default "raw" logprobs); then the constraints
(logit_bias, min_tokens holding back EOS and stop token ids, allowed_token_ids, bad_words, a
grammar's mask, after a reasoning where the model reasons, the end of a reasoning past its thinking
budget), repetition penalty
(transformers semantics, over prompt and output), presence/frequency penalties (OpenAI semantics,
over output counts), temperature (0 = greedy), top-k, top-p, min-p, then one draw per row.
Per-request parameters become columns of tensors, so a step costs the same few kernels whatever the
mix of requests:

- top-k takes the k best with `topk` (no sort of the vocabulary); top-p then works on those k
  candidates. Only a batch in which some row samples with top-p and no top-k sorts the vocabulary.
- The draw is inverse-CDF: each row needs one uniform number, computed on the host from the row's
  seed and its count of generated tokens (a counter-based hash), so a seeded request picks the same
  tokens whatever else is in the batch, without a generator or a kernel per row.
- Penalties work on each penalised sequence's history (its token ids, kept in rows of one buffer):
  a gather, the penalty and a scatter, in proportion to the history rather than the vocabulary.
- The chosen ids stay on the device (`draw`) until the engine reads them, in one transfer.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from schemas.sampling import SamplingParams
from workers.engine.grammar import allowed_tokens
from workers.engine.reasoning import Reasoning

# Temperatures below this pick greedily (as vLLM does): dividing by 1e-300 would overflow to inf - inf = NaN.
GREEDY_BELOW = 1e-5
_MASK64 = (1 << 64) - 1


class Sampled(Protocol):
    """What the sampler reads of a sequence: its parameters, prompt and generated tokens, and how many
    tokens have been drawn for it (`sampled`: ahead of `output_ids` while a step is in flight)."""

    params: SamplingParams
    output_ids: list[int]
    sampled: int
    matcher: Any  # an llguidance LLMatcher for a constrained sequence, else None

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...


@dataclass
class TokenLogprobs:
    """Log probabilities of a step's draws for the rows that asked (`rows`, places in the batch): the
    drawn token's [rows], and the `k` best [rows, k] with their ids."""

    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def entries(self, tokens: list[int], wanted: list[int]) -> dict[int, list[Any]]:
        """Batch row → [token, logprob, [[id, logprob], …]] with each row's own number of alternatives."""
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return {
            row: [tokens[row], chosen[i], [[ids[i][j], values[i][j]] for j in range(wanted[i])]]
            for i, row in enumerate(self.rows)
        }


@dataclass
class Drawn:
    tokens: torch.Tensor  # [batch], on the device
    logprobs: TokenLogprobs | None = None
    wanted: list[int] | None = None  # alternatives per row of `logprobs`


def penalised(params: SamplingParams) -> bool:
    """Whether a penalty reads this sequence's history (a neutral one leaves its row unchanged)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def uniform(seed: int, counter: int) -> float:
    """A number in (0, 1) determined by (seed, counter): splitmix64 of the pair, top 53 bits."""
    x = (seed * 0x9E3779B97F4A7C15 + counter * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return ((x >> 11) + 0.5) / float(1 << 53)


def banned_words(words: Seq[tuple[int, ...]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: the last token of each word whose tokens before
    it end the output (all of a one-token word's), as vLLM bans them."""
    banned = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and tuple(output[len(output) - head :]) == word[:head]):
            banned.append(word[-1])
    return banned


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """+inf (overflow) becomes the largest float, NaN becomes -inf; -inf (masked) stays."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


class PenaltyHistory:
    """What the penalties read, for each penalised sequence: a row of `ids` (its prompt and output
    token ids, padded with its first id) and, for the OpenAI penalties, a row of `counts` (output
    occurrences per token id). A step gathers the logits at a row's ids, penalises them and scatters
    them back (a token twice in the ids gets the same value twice): work in proportion to the
    history, not the vocabulary. Rows are taken at a sequence's first draw and given back by `release`;
    the buffers grow by doubling."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.ids = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.counting = False  # `counts` is kept (allocated at the first OpenAI penalty)
        # id(sequence) -> (row, sequence): the reference keeps the id from being reused until `release`
        self.rows: dict[int, tuple[int, Sampled]] = {}
        self.free: list[int] = []

    def rows_for(self, sequences: Seq[Sampled]) -> torch.Tensor:
        rows = []
        for sequence in sequences:
            held = self.rows.get(id(sequence))
            rows.append(self._take(sequence) if held is None else held[0])
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _reserve(self, rows: int, length: int) -> None:
        have_rows, have_length = self.ids.shape
        if rows > have_rows:
            grown = max(4, 2 * have_rows, rows)
            self.ids = torch.cat([self.ids, self.ids.new_zeros((grown - have_rows, have_length))])
            if self.counting:
                self.counts = torch.cat([self.counts, self.counts.new_zeros((grown - have_rows, self.vocab_size))])
            self.free += list(range(grown - 1, have_rows - 1, -1))
        if length > self.ids.shape[1]:
            grown = max(64, 2 * self.ids.shape[1], length)
            first = self.ids[:, :1] if self.ids.shape[1] else self.ids.new_zeros((self.ids.shape[0], 1))
            self.ids = torch.cat([self.ids, first.expand(-1, grown - self.ids.shape[1])], dim=1)  # padding

    def _take(self, sequence: Sampled) -> int:
        history = [*sequence.prompt_ids, *sequence.output_ids] or [0]
        self._reserve(len(self.rows) + 1, len(history) + 1)
        row = self.free.pop()
        ids = torch.tensor(history, dtype=torch.long, device=self.device).clamp(max=self.vocab_size - 1)
        self.ids[row] = ids[0]
        self.ids[row, : len(history)] = ids
        if self.counting:
            self._count_outputs(row, sequence)
        self.rows[id(sequence)] = (row, sequence)
        return row

    def _count_outputs(self, row: int, sequence: Sampled) -> None:
        self.counts[row] = 0
        if sequence.output_ids:
            ids = torch.tensor(sequence.output_ids, dtype=torch.long, device=self.device).clamp(max=self.vocab_size - 1)
            self.counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def need_counts(self, sequences: Seq[Sampled]) -> None:
        """Start counting outputs, once a sequence with an OpenAI penalty is sampled: rows already held
        by `sequences` are counted from their outputs (other rows' penalties do not read counts)."""
        if self.counting:
            return
        self.counting = True
        self.counts = torch.zeros((self.ids.shape[0], self.vocab_size), dtype=torch.int32, device=self.device)
        for sequence in sequences:
            held = self.rows.get(id(sequence))
            if held is not None:
                self._count_outputs(held[0], sequence)

    def record(self, rows: torch.Tensor, positions: list[int], tokens: torch.Tensor) -> None:
        """Each row's new token, at its position in the history."""
        self._reserve(0, max(positions) + 2)
        tokens = tokens.clamp(max=self.vocab_size - 1)
        self.ids[rows, torch.tensor(positions, dtype=torch.long, device=self.device)] = tokens
        if self.counting:
            self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def release(self, sequence: object) -> None:
        held = self.rows.pop(id(sequence), None)
        if held is not None:
            self.free.append(held[0])


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_ids: Collection[int] = ()) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.history = PenaltyHistory(vocab_size, device)
        # id(sequence) -> (sequence, its allowed_token_ids as a tensor), built at its first draw
        self.allowed: dict[int, tuple[Sampled, torch.Tensor]] = {}
        # id(sequence) -> (sequence, where its reasoning is), for a thinking budget or a grammar that
        # follows the reasoning (the sequence held: its id stays its own until `release`)
        self.reasoning: dict[int, tuple[Sampled, Reasoning]] = {}

    def release(self, sequence: object) -> None:
        """The sequence will not be sampled again: its penalty history row is free."""
        self.history.release(sequence)
        self.allowed.pop(id(sequence), None)
        self.reasoning.pop(id(sequence), None)

    def sample(self, logits: torch.Tensor, sequences: Seq[Sampled]) -> list[int]:
        """One token id per row of `logits` [batch, vocab] (float32; penalties modify it in place)."""
        return self.draw(logits, sequences).tokens.tolist()

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, sequences: Seq[Sampled]) -> Drawn:
        """`sample`, left on the device: the chosen ids [batch] as a tensor (and the log probabilities
        asked for), and each sequence's `sampled` counted up."""
        params = [s.params for s in sequences]
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = None
        if asked:
            raw = logits.index_select(0, torch.tensor(asked, device=logits.device)).log_softmax(dim=-1)
        self._constrain(logits, sequences)
        pen = [i for i, p in enumerate(params) if penalised(p)]
        if pen:
            self._penalise(logits, [sequences[i] for i in pen], pen)
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        chosen = logits.argmax(dim=-1) if all(greedy) else self._pick(logits, sequences, greedy)
        if pen:
            index = torch.tensor(pen, dtype=torch.long, device=logits.device)
            rows = self.history.rows_for([sequences[i] for i in pen])
            positions = [len(sequences[i].prompt_ids) + sequences[i].sampled for i in pen]
            self.history.record(rows, positions, chosen[index])
        for sequence in sequences:
            sequence.sampled += 1
        if raw is None:
            return Drawn(chosen)
        wanted = [params[i].logprobs or 0 for i in asked]
        at = torch.tensor(asked, device=logits.device)
        top_values, top_ids = raw.topk(max(wanted), dim=-1) if max(wanted) else (raw[:, :0], raw[:, :0].long())
        picked = raw.gather(1, chosen.index_select(0, at).unsqueeze(1)).squeeze(1)
        return Drawn(chosen, TokenLogprobs(asked, picked, top_values, top_ids), wanted)

    def _constrain(self, logits: torch.Tensor, sequences: Seq[Sampled]) -> None:
        """logit_bias, min_tokens (no EOS or stop token id before it), allowed_token_ids, bad_words and
        grammar masks, in place."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        banned_rows: list[int] = []
        banned_cols: list[int] = []
        constrained: list[int] = []
        opening: list[int | None] = []  # per constrained row: a reasoning's opening, allowed beside the grammar
        restricted: list[int] = []
        forced: list[tuple[int, int]] = []  # (row, the only token it may draw)
        for row, sequence in enumerate(sequences):
            params = sequence.params
            for token, bias in params.logit_bias:
                if token < logits.shape[-1]:
                    rows.append(row)
                    cols.append(token)
                    values.append(bias)
            if sequence.sampled < params.min_tokens:
                held = [t for t in (*self.eos_ids, *params.stop_token_ids) if t < logits.shape[-1]]
                banned_rows += [row] * len(held)
                banned_cols += held
            if params.bad_words:
                banned = banned_words(params.bad_words, sequence.output_ids)
                banned_rows += [row] * len(banned)
                banned_cols += banned
            if params.allowed_token_ids:
                restricted.append(row)
            reasoning = self._reasoning(sequence)
            if sequence.matcher is not None:
                # A grammar follows the reasoning: free inside it; at the start, the opening is allowed
                # beside the grammar's first tokens, and once begun it is written whole.
                next_opening = None if reasoning is None else reasoning.opening_next(sequence.output_ids)
                if reasoning is not None and reasoning.inside:
                    pass
                elif next_opening is not None and sequence.output_ids:
                    forced.append((row, next_opening))
                else:
                    constrained.append(row)
                    opening.append(next_opening)
            if params.thinking_budget is not None and reasoning is not None:
                token = reasoning.forced(sequence.output_ids, params.thinking_budget)
                if token is not None:
                    forced.append((row, token))
        device = logits.device
        if rows:
            index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
            logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
        if banned_rows:
            logits[torch.tensor(banned_rows, device=device), torch.tensor(banned_cols, device=device)] = float("-inf")
        if restricted:
            self._restrict(logits, restricted, sequences)
        if constrained:
            self._mask(logits, constrained, [sequences[r].matcher for r in constrained], opening)
        if forced:  # last: nothing else decides these rows' token
            at, tokens = (torch.tensor(column, device=device) for column in zip(*forced, strict=True))
            kept = logits[at, tokens]
            logits[at] = float("-inf")
            logits[at, tokens] = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))

    def _restrict(self, logits: torch.Tensor, rows: list[int], sequences: Seq[Sampled]) -> None:
        """Each row with allowed_token_ids keeps only those tokens."""
        keep = torch.zeros((len(rows), logits.shape[-1]), dtype=torch.bool, device=logits.device)
        for i, row in enumerate(rows):
            sequence = sequences[row]
            held = self.allowed.get(id(sequence))
            if held is None:
                ids = torch.tensor(sequence.params.allowed_token_ids, dtype=torch.long, device=logits.device)
                held = self.allowed[id(sequence)] = (sequence, ids)
            keep[i, held[1]] = True
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits.index_select(0, index).masked_fill(~keep, float("-inf"))

    def _reasoning(self, sequence: Sampled) -> Reasoning | None:
        """Where the sequence's reasoning is, read up to its last token, where it has a thinking budget
        or a grammar that follows its reasoning (its parameters name the reasoning's tokens)."""
        params = sequence.params
        if not params.thinking_end or (params.thinking_budget is None and sequence.matcher is None):
            return None
        held = self.reasoning.get(id(sequence))
        if held is None:
            held = self.reasoning[id(sequence)] = (sequence, Reasoning(params, at_start=sequence.matcher is not None))
        held[1].update(sequence.output_ids)
        return held[1]

    @staticmethod
    def _mask(logits: torch.Tensor, rows: list[int], matchers: list[Any], also: list[int | None]) -> None:
        """Each constrained row keeps only the tokens its grammar allows next (and its `also` token)."""
        allowed = allowed_tokens(matchers, logits.shape[-1], logits.device)
        for i, token in enumerate(also):
            if token is not None:
                allowed[i, token] = True
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
            return
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))

    def _penalise(self, logits: torch.Tensor, sequences: list[Sampled], index: list[int]) -> None:
        params = [s.params for s in sequences]
        openai = any(p.presence_penalty or p.frequency_penalty for p in params)
        if openai:
            self.history.need_counts(sequences)
        rows = self.history.rows_for(sequences)
        width = max(len(s.prompt_ids) + s.sampled for s in sequences)
        ids = self.history.ids.index_select(0, rows)[:, :width]  # [penalised rows, history]
        at = torch.tensor(index, dtype=torch.long, device=logits.device).unsqueeze(1)
        values = logits[at, ids]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = self._column([p.repetition_penalty for p in params])
            values = torch.where(values > 0, values / rep, values * rep)
        if openai:
            counts = self.history.counts[rows.unsqueeze(1), ids].float()
            values = values - self._column([p.frequency_penalty for p in params]) * counts
            values = values - self._column([p.presence_penalty for p in params]) * (counts > 0).float()
        logits[at, ids] = values

    def _pick(self, logits: torch.Tensor, sequences: Seq[Sampled], greedy: list[bool]) -> torch.Tensor:
        """Each row's draw over its own candidates, in vocabulary order whatever the other rows ask:
        top-k and top-p are thresholds on the row's values (the k-th best value, the least likely
        probability of the smallest set reaching p; ties at a threshold stay in), so that a row's token
        depends on its logits, parameters and seed alone, not on which path its neighbours need."""
        params = [s.params for s in sequences]
        vocab = logits.shape[-1]
        temperature = self._column([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
        top_k = [1 if g else (p.top_k if 0 < p.top_k < vocab else vocab) for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        values = _finite(logits / temperature)  # temperature keeps each row's order
        bounded = [k for k in top_k if k < vocab]
        if bounded:  # each row keeps the values at or above its k-th best (a row without top-k: all)
            best = values.topk(max(bounded), dim=-1).values
            kth = best.gather(1, self._column([min(k, best.shape[1]) - 1 for k in top_k], torch.long))
            kth = kth.masked_fill(self._column([k >= vocab for k in top_k], torch.bool), float("-inf"))
            values = values.masked_fill(values < kth, float("-inf"))
        probs = values.softmax(dim=-1)
        if any(p < 1.0 for p in top_p):  # the least probability of the smallest set reaching p
            ordered = probs.sort(dim=-1, descending=True).values
            kept = (ordered.cumsum(dim=-1) - ordered) < self._column(top_p)
            kept[:, 0] = True  # each row keeps at least its best token
            least = ordered.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < least, 0.0)
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        if any(min_p):  # tokens less likely than min_p times the row's best are dropped (the best stays)
            probs = probs.masked_fill(probs < self._column(min_p) * probs.amax(dim=-1, keepdim=True), 0.0)
        cdf = probs.cumsum(dim=-1)
        draws = self._column([self._uniform(s) for s in sequences]) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, draws, right=True).clamp(max=vocab - 1).squeeze(1)
        if any(greedy):  # greedy rows take their argmax
            tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), tokens)
        return tokens

    @staticmethod
    def _uniform(sequence: Sampled) -> float:
        seed = sequence.params.seed
        return uniform(seed if seed is not None else secrets.randbits(64), sequence.sampled)

    def _column(self, values: list[float] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)
