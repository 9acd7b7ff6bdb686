"""The batched sampler: penalties, temperature, top-k, top-p and per-row seeded draws."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from schemas.sampling import SamplingParams
from workers.engine.sampler import Sampler, uniform

VOCAB = 8
CPU = torch.device("cpu")


@dataclass(eq=False)
class Row:
    """A sequence as the sampler reads it."""

    params: SamplingParams
    prompt_ids: tuple[int, ...] = (0,)
    output_ids: list[int] = field(default_factory=list)
    sampled: int = 0
    matcher: object = None


def row(prompt: tuple[int, ...] = (0,), **params) -> Row:  # type: ignore[no-untyped-def]
    return Row(SamplingParams(max_tokens=4, **params), prompt)


def draw(sampler: Sampler, logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """One step: sample (from a copy: penalties change the logits in place), and append each token to
    its row, as the engine does."""
    tokens = sampler.sample(logits.clone(), rows)
    for r, token in zip(rows, tokens, strict=True):
        r.output_ids.append(token)
    return tokens


def test_greedy_picks_the_largest_logit() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 0]])
    assert Sampler(VOCAB, CPU).sample(logits, [row(temperature=0.0), row(temperature=0.0)]) == [1, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # Tokens 0 and 1 are in the prompt: 2.0 / 2 = 1.0 loses to the unseen 1.5; -2.0 * 2 stays last.
    logits = torch.tensor([[2.0, -2.0, 1.5, -3.0, -9, -9, -9, -9]])
    sampler = Sampler(VOCAB, CPU)
    assert sampler.sample(logits.clone(), [row(prompt=(0, 1), temperature=0.0, repetition_penalty=2.0)]) == [2]
    assert sampler.sample(logits.clone(), [row(prompt=(0, 1), temperature=0.0, repetition_penalty=1.0)]) == [0]
    logits = torch.tensor([[-9.0, -2.0, -9, -3.5, -9, -9, -9, -9]])
    assert sampler.sample(logits, [row(prompt=(1,), temperature=0.0, repetition_penalty=2.0)]) == [3]


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    sampler = Sampler(VOCAB, CPU)
    penalised = row(prompt=(5,), temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Each step: token 2 leads until its penalty (0.5 + 0.25 per occurrence) drops it below token 3.
    logits = torch.tensor([[0, 0, 1.0, 0.2, 0, 0.9, 0, 0]])
    picks = [draw(sampler, logits, [penalised])[0] for _ in range(3)]
    # 1.0 > 0.9 (5 is a prompt token: OpenAI's penalties ignore it); then 1.0 - 0.75 = 0.25 < 0.9; then
    # 0.9 - 0.75 = 0.15 < 0.25
    assert picks == [2, 5, 2]


def test_penalties_apply_per_row_and_neutral_rows_stay_unchanged_beside_them() -> None:
    sampler = Sampler(VOCAB, CPU)
    logits = torch.tensor([[0, 1.0, 0.9, 0, 0, 0, 0, 0]] * 2)
    penalised, neutral = row(temperature=0.0, presence_penalty=1.0), row(temperature=0.0)
    assert draw(sampler, logits, [penalised, neutral]) == [1, 1]
    assert draw(sampler, logits, [penalised, neutral]) == [2, 1]
    assert len(sampler.history.rows) == 1  # only the penalised row keeps a history
    assert not sampler.history.counting or sampler.history.counts.shape[0] == sampler.history.ids.shape[0]


def test_a_released_history_row_serves_the_next_sequence_afresh() -> None:
    sampler = Sampler(VOCAB, CPU)
    logits = torch.tensor([[0, 1.0, 0.9, 0, 0, 0, 0, 0]])
    first = row(temperature=0.0, presence_penalty=1.0)
    draw(sampler, logits, [first])
    sampler.release(first)
    second = row(temperature=0.0, presence_penalty=1.0)
    assert draw(sampler, logits, [second]) == [1]  # nothing of `first`'s token 1 is left in its row


def test_top_k_draws_only_among_the_k_best() -> None:
    sampler = Sampler(VOCAB, CPU)
    logits = torch.tensor([[1.0, 4.0, 3.9, 2.0, 0, 0, 0, 0]])
    picks = {draw(sampler, logits, [row(seed=s, top_k=2)])[0] for s in range(1, 60)}
    assert picks == {1, 2}


def test_top_p_draws_from_the_smallest_set_reaching_p_and_always_one() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]]).clamp(min=1e-9)
    sampler = Sampler(VOCAB, CPU)
    assert {draw(sampler, probs.log(), [row(seed=s, top_p=0.8)])[0] for s in range(1, 80)} == {0, 1}
    assert {draw(sampler, probs.log(), [row(seed=s, top_p=0.01)])[0] for s in range(1, 20)} == {0}
    # Beside a row with a top-k (the candidates path), a top-p row keeps the same set.
    beside = [row(seed=s, top_p=0.8, top_k=3) for s in range(1, 80)]
    assert {draw(sampler, probs.log().repeat(2, 1), [r, row(seed=5, top_k=1)])[0] for r in beside} == {0, 1}


def test_draws_follow_the_distribution() -> None:
    logits = torch.tensor([[0.7, 0.2, 0.1, 0, 0, 0, 0, 0]]).clamp(min=1e-9).log()
    sampler = Sampler(VOCAB, CPU)
    counts = Counter(draw(sampler, logits, [row(seed=s)])[0] for s in range(1, 2001))
    assert set(counts) == {0, 1, 2}
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[1] / 2000 - 0.2) < 0.05


def test_top_k_one_is_greedy_whatever_the_seed() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    sampler = Sampler(VOCAB, CPU)
    assert {sampler.sample(logits, [row(seed=s, top_k=1)])[0] for s in range(1, 20)} == {best}


def test_same_seed_same_draws_and_independent_of_other_rows() -> None:
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(VOCAB, CPU)
    alone = row(seed=11)
    draws_alone = [draw(sampler, logits, [alone])[0] for _ in range(10)]
    batched, other = row(seed=11), row(seed=99, top_k=3, repetition_penalty=1.5)
    draws_batched = [draw(sampler, logits.repeat(2, 1), [other, batched])[1] for _ in range(10)]
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # a draw per step, not one number for the sequence


def test_top_k_holds_beside_a_row_that_samples_the_whole_vocabulary() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.9, 2.0, 0, 0, 0, 0]]).repeat(2, 1)
    sampler = Sampler(VOCAB, CPU)
    picks = {draw(sampler, logits, [row(seed=s, top_k=2, temperature=2.0), row(seed=s)])[0] for s in range(1, 60)}
    assert picks == {1, 2}


@pytest.mark.parametrize("neighbour", [{"top_p": 0.5}, {"top_k": 2}, {"min_p": 0.2}, {"temperature": 0.0}])
def test_a_rows_draws_do_not_depend_on_what_its_neighbours_ask(neighbour: dict) -> None:
    """The same seed, the same logits, the same parameters: the same tokens, whatever the other rows
    of the batch need (a sort for top-p, candidates for top-k, or nothing)."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    for params in ({}, {"top_p": 0.9}, {"top_k": 5}, {"top_k": 3, "top_p": 0.8, "min_p": 0.05}):
        sampler = Sampler(VOCAB, CPU)
        alone = [draw(sampler, logits, [row(seed=s, **params)])[0] for s in range(1, 40)]
        beside = [
            draw(sampler, logits.repeat(2, 1), [row(seed=9, **neighbour), row(seed=s, **params)])[1]
            for s in range(1, 40)
        ]
        assert alone == beside, params


def test_the_uniform_depends_only_on_seed_and_counter_and_lies_inside_zero_one() -> None:
    values = [uniform(seed, counter) for seed in (0, 1, 2**64 - 1) for counter in range(100)]
    assert all(0.0 < v < 1.0 for v in values)
    assert uniform(7, 3) == uniform(7, 3) and uniform(7, 3) != uniform(7, 4) != uniform(8, 3)
    assert len(set(values)) == len(values)


def test_low_temperature_concentrates_on_the_best_token() -> None:
    logits = torch.tensor([[1.0, 1.5, 0, 0, 0, 0, 0, 0]])
    sampler = Sampler(VOCAB, CPU)
    assert {draw(sampler, logits, [row(seed=s, temperature=0.01)])[0] for s in range(1, 50)} == {1}


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.6e-232},
        {"temperature": 1e-6, "top_p": 0.5},
        {"temperature": 1e308},
        {"temperature": 1.0, "repetition_penalty": 1e-300},
        {"temperature": 0.7, "presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 2.0},
    ],
)
def test_extreme_valid_parameters_still_pick_a_token(params: dict) -> None:
    """Found by tests/test_fuzz.py: a temperature of 1.6e-232 made a NaN that failed the whole batch."""
    logits = torch.tensor([[3.0, -1.0, 50.0, 0.5], [1.0, 2.0, 3.0, 4.0]])
    rows = [
        Row(SamplingParams(max_tokens=4, seed=7, **params), (2, 0)),
        Row(SamplingParams(max_tokens=4, temperature=0), (1,)),
    ]
    tokens = Sampler(4, CPU).sample(logits, rows)
    assert all(0 <= t < 4 for t in tokens)
    assert tokens[1] == 3  # its greedy neighbour in the batch is untouched


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]]) + 1e-12)
    kept = {Sampler(VOCAB, CPU).sample(logits.clone(), [row(seed=s, min_p=0.5)])[0] for s in range(1, 200)}
    assert kept == {0, 1}  # 0.3 ≥ 0.5 × 0.5; 0.1 is not
    wide = {Sampler(VOCAB, CPU).sample(logits.clone(), [row(seed=s, min_p=0.15)])[0] for s in range(1, 200)}
    assert wide == {0, 1, 2}


def test_logit_bias_moves_one_rows_tokens_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 0.2, 0, 0, 0, 0, 0]] * 2)
    rows = [row(temperature=0.0, logit_bias=((1, -100.0), (5, 2.0))), row(temperature=0.0)]
    assert Sampler(VOCAB, CPU).sample(logits, rows) == [5, 1]


def test_logprobs_are_the_models_distribution_before_penalties_and_bias() -> None:
    logits = torch.tensor([[1.0, 3.0, 0.2, 0, 0, 0, 0, 0]])
    expected = logits.log_softmax(dim=-1)[0]
    rows = [row(temperature=0.0, logprobs=2, repetition_penalty=2.0, prompt=(1,), logit_bias=((0, 50.0),))]
    drawn = Sampler(VOCAB, CPU).draw(logits.clone(), rows)
    assert drawn.tokens.tolist() == [0]  # the bias picked token 0
    (entry,) = drawn.logprobs.entries(drawn.tokens.tolist(), drawn.wanted).values()
    assert entry[0] == 0 and entry[1] == pytest.approx(expected[0].item())
    assert [t for t, _ in entry[2]] == [1, 0] and entry[2][0][1] == pytest.approx(expected[1].item())


def test_allowed_token_ids_leave_a_row_only_those_tokens_and_its_neighbours_all() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0, 0, 0, 0]] * 2)
    sampler = Sampler(VOCAB, CPU)
    restricted = row(temperature=0.0, allowed_token_ids=(2, 3))
    free = row(temperature=0.0)
    assert draw(sampler, logits, [restricted, free]) == [3, 1]
    # Sampled, it draws among its allowed tokens alone, however unlikely they are.
    sampled = row(temperature=1.0, seed=7, allowed_token_ids=(0, 6))
    assert {draw(sampler, logits[:1], [sampled])[0] for _ in range(4)} <= {0, 6}
    sampler.release(sampled)
    assert id(sampled) not in sampler.allowed


def test_bad_words_ban_a_one_token_word_always_and_a_longer_one_where_its_start_ends_the_output() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 0, 0, 0, 0]])
    sampler = Sampler(VOCAB, CPU)
    assert draw(sampler, logits, [row(temperature=0.0, bad_words=((1,),))]) == [2]
    # (4, 1): token 1 is banned only right after 4; (4, 5, 2) bans 2 only after 4 then 5.
    words = ((4, 1), (4, 5, 2))
    assert draw(sampler, logits, [Row(SamplingParams(max_tokens=4, temperature=0.0, bad_words=words))]) == [1]
    after_4 = Row(SamplingParams(max_tokens=4, temperature=0.0, bad_words=words), output_ids=[4], sampled=1)
    assert draw(sampler, logits, [after_4]) == [2]
    after_45 = Row(SamplingParams(max_tokens=4, temperature=0.0, bad_words=words), output_ids=[4, 5], sampled=2)
    assert draw(sampler, logits, [after_45]) == [1]  # (4, 1) is not begun: 5 ends the output
    after_145 = Row(SamplingParams(max_tokens=4, temperature=0.0, bad_words=((4, 5, 1),)), output_ids=[1, 4, 5])
    assert draw(sampler, logits, [after_145]) == [2]
    # The prompt is not the output: a word begun in the prompt does not count.
    assert draw(sampler, logits, [row(prompt=(4,), temperature=0.0, bad_words=((4, 1),))]) == [1]


def test_a_thinking_budget_forces_the_end_of_reasoning_once_spent_and_not_after_it_ended() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 0, 0, 0, 0]])
    sampler = Sampler(VOCAB, CPU)
    # Inside the reasoning from the start (no opening): 2 tokens of it, then the closing (6, 7).
    inside = row(temperature=0.0, thinking_budget=2, thinking_end=(6, 7))
    assert [draw(sampler, logits, [inside])[0] for _ in range(5)] == [1, 1, 6, 7, 1]
    # Sampled too, and with a budget of 0 the closing comes first.
    sampled = row(temperature=1.0, seed=3, thinking_budget=0, thinking_end=(6,))
    assert draw(sampler, logits, [sampled]) == [6]
    # With an opening (5), the budget counts from after it; a reasoning the model closes itself
    # within its budget is left alone.
    opened = row(temperature=0.0, thinking_budget=1, thinking_start=(5,), thinking_end=(6,))
    opened.output_ids, opened.sampled = [2, 5], 2
    assert [draw(sampler, logits, [opened])[0] for _ in range(3)] == [1, 6, 1]
    closed = row(temperature=0.0, thinking_budget=2, thinking_end=(6,))
    closed.output_ids, closed.sampled = [6], 1
    assert [draw(sampler, logits, [closed])[0] for _ in range(3)] == [1, 1, 1]
    sampler.release(inside)
    assert id(inside) not in sampler.reasoning
