"""The vectorised sampler: penalties, temperature, top-k, top-p and per-row generators."""

from __future__ import annotations

import pytest
import torch

from schemas.sampling import SamplingParams
from workers.sampler import SamplingState, apply_penalties, filter_top_k_top_p, sample

VOCAB = 8
CPU = torch.device("cpu")


def state(prompt: tuple[int, ...] = (), **params) -> SamplingState:  # type: ignore[no-untyped-def]
    return SamplingState.create(SamplingParams(max_tokens=4, **params), prompt or (0,), VOCAB, CPU)


def test_greedy_picks_the_largest_logit() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 0]])
    assert sample(logits, [state(temperature=0.0), state(temperature=0.0)]) == [1, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0, 0, 0, 0]])
    out = apply_penalties(logits, [state(prompt=(0, 1), repetition_penalty=2.0)])
    assert out[0, :4].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    s = state(prompt=(5,), presence_penalty=0.5, frequency_penalty=0.25)
    s.record(2)
    s.record(2)
    s.record(3)
    out = apply_penalties(torch.zeros(1, VOCAB), [s])
    assert out[0, 2].item() == -(0.5 + 2 * 0.25)
    assert out[0, 3].item() == -(0.5 + 0.25)
    assert out[0, 5].item() == 0.0  # a prompt token is not penalised by OpenAI's penalties


def test_penalties_apply_per_row() -> None:
    a, b = state(presence_penalty=1.0), state()
    a.record(1)
    b.record(1)
    out = apply_penalties(torch.zeros(2, VOCAB), [a, b])
    assert out[0, 1].item() == -1.0 and out[1, 1].item() == 0.0


def test_only_penalised_sequences_keep_a_history_and_neutral_rows_stay_unchanged_beside_them() -> None:
    neutral, penalised = state(prompt=(4,)), state(prompt=(4,), repetition_penalty=2.0, frequency_penalty=1.0)
    for token in (1, 1, 2):
        neutral.record(token)
        penalised.record(token)
    assert neutral.seen is None and neutral.counts is None  # no history for a sequence no penalty reads
    assert penalised.counts.tolist()[:3] == [0, 2, 1]
    logits = torch.tensor([[1.0, 1.0, -1.0, 0, 3.0, 0, 0, 0]] * 2)
    out = apply_penalties(logits.clone(), [neutral, penalised])
    assert out[0].tolist() == logits[0].tolist()
    assert out[1, :5].tolist() == [1.0, 0.5 - 2.0, -2.0 - 1.0, 0.0, 1.5]


def test_top_k_keeps_the_k_best_per_row() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0, 0, 0, 0]] * 2)
    out = filter_top_k_top_p(logits, [2, -1], [1.0, 1.0])
    assert torch.isfinite(out[0]).tolist() == [False, True, True, False, False, False, False, False]
    assert torch.isfinite(out[1]).all()


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_one() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]]).clamp(min=1e-9)
    kept = torch.isfinite(filter_top_k_top_p(probs.log(), [-1], [0.8]))[0].tolist()
    assert kept[:4] == [True, True, False, False]
    kept = torch.isfinite(filter_top_k_top_p(probs.log(), [-1], [0.01]))[0].tolist()
    assert kept[:4] == [True, False, False, False]


def test_top_k_one_is_greedy_whatever_the_seed() -> None:
    logits = torch.randn(1, VOCAB)
    best = int(logits.argmax())
    assert {sample(logits, [state(seed=s, top_k=1)])[0] for s in range(1, 20)} == {best}


def test_same_seed_same_draws_and_independent_of_other_rows() -> None:
    logits = torch.zeros(1, VOCAB)
    alone = [sample(logits, [state(seed=11)])[0]]
    a = state(seed=11)
    draws_alone = [sample(logits, [a])[0] for _ in range(10)]
    b, other = state(seed=11), state(seed=99)
    draws_batched = [sample(logits.repeat(2, 1), [b, other])[0] for _ in range(10)]
    assert draws_alone == draws_batched
    assert alone[0] == draws_alone[0]


def test_low_temperature_concentrates_on_the_best_token() -> None:
    logits = torch.tensor([[1.0, 1.5, 0, 0, 0, 0, 0, 0]])
    s = state(seed=5, temperature=0.01)
    assert {sample(logits, [s])[0] for _ in range(50)} == {1}


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
    states = [SamplingState.create(SamplingParams(max_tokens=4, seed=7, **params), [2, 0], 4, torch.device("cpu"))]
    states.append(SamplingState.create(SamplingParams(max_tokens=4, temperature=0), [1], 4, torch.device("cpu")))
    tokens = sample(logits, states)
    assert all(0 <= t < 4 for t in tokens)
    assert tokens[1] == 3  # its greedy neighbour in the batch is untouched
