"""A step as the engine hands it to the model runner: plain arrays, vLLM's `SchedulerOutput` shape.

The engine (engine/batch.py) builds it from its scheduler's plan; the runner, each attention backend
and a tensor-parallel group's other ranks read nothing else: no request, no sequence object.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBatch:
    """The step's tokens packed one sequence after the other.

    - `token_ids`, `positions`: per packed token; `token_ids` is 0 where `pending` takes a token drawn
      on the device by the step before ((place in the step, row of that step's draws)).
    - Per scheduled sequence: `query_start` (its first place), `query_len` (its new tokens),
      `context_len` (its tokens once this step has run: the keys its queries attend), `prompt_len`,
      `sample` (its last new token draws the next one), `block_tables` (its blocks in the pool) and
      `rings` (its ring in the sliding-window layers' slots, -1 for none).
    - `keep`: the places whose logits come back, in order (the sampling rows first, then the prompt
      positions scored for prompt logprobs).
    """

    token_ids: list[int] = field(default_factory=list)
    pending: list[tuple[int, int]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=list)
    query_len: list[int] = field(default_factory=list)
    context_len: list[int] = field(default_factory=list)
    prompt_len: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    rings: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sequences(self) -> int:
        return len(self.query_start)

    @property
    def prompt_tokens(self) -> int:
        """Tokens computed for prompts (prefill chunks), not decodes."""
        return sum(n for n, s in zip(self.query_len, self.sample, strict=True) if n > 1 or not s)

    @property
    def decodes(self) -> int:
        return sum(1 for n, s in zip(self.query_len, self.sample, strict=True) if n == 1 and s)

    def slots(self, block_size: int) -> list[int]:
        """The pool slot of each packed token, from its sequence's block table."""
        out: list[int] = []
        for end, count, blocks in zip(self.context_len, self.query_len, self.block_tables, strict=True):
            out += [blocks[p // block_size] * block_size + p % block_size for p in range(end - count, end)]
        return out

    def add(
        self,
        tokens: list[int],
        start: int,
        prompt_len: int,
        blocks: list[int],
        ring: int,
        sample: bool,
    ) -> int:
        """Append a sequence's new tokens at positions [start, start + len(tokens)); its first place."""
        place = len(self.token_ids)
        self.token_ids += tokens
        self.positions += range(start, start + len(tokens))
        self.query_start.append(place)
        self.query_len.append(len(tokens))
        self.context_len.append(start + len(tokens))
        self.prompt_len.append(prompt_len)
        self.sample.append(sample)
        self.block_tables.append(blocks)
        self.rings.append(ring)
        return place
