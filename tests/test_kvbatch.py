"""The batch's KV buffers (workers/engine/kv_cache.py) against plain tensors, and the engine's use of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import EngineCore
from workers.engine.kv_cache import KVBatch
from workers.models.loader import LoadedModel, load_model

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def prefill_layers(rows: list[list[float]]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """A prefill's keys and values per layer for these rows (left-padded to the longest), each position's
    keys filled with its row's numbers (plus 100 per layer, values negated), and its mask."""
    length = max(len(r) for r in rows)
    keys = torch.zeros(len(rows), HEADS, length, HEAD_DIM)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        keys[i, :, length - len(row) :] = torch.tensor(row).view(1, -1, 1)
        mask[i, length - len(row) :] = 1
    return [(keys + 100 * layer, -(keys + 100 * layer)) for layer in range(LAYERS)], mask


def real(kv: KVBatch) -> list[list[float]]:
    """Each row's real positions, read back from every layer's keys and values."""
    assert kv.cache is not None and kv.mask is not None
    rows = []
    for i in range(kv.rows):
        taken = kv.mask[i].bool()
        row = kv.cache.layers[0].keys[i, 0, taken, 0].tolist()
        for layer, slab in enumerate(kv.cache.layers):
            assert slab.keys.shape == (kv.rows, HEADS, kv.length, HEAD_DIM)
            want = torch.tensor(row).view(1, -1, 1).expand(HEADS, -1, HEAD_DIM) + 100 * layer
            assert torch.equal(slab.keys[i, :, taken], want)
            assert torch.equal(slab.values[i, :, taken], -slab.keys[i, :, taken])
        rows.append(row)
    return rows


def decode_step(kv: KVBatch, numbers: list[float]) -> None:
    """One decode step's new column, as the model writes it through the cache."""
    assert kv.cache is not None
    kv.grow()
    column = torch.tensor(numbers).view(-1, 1, 1, 1).expand(-1, HEADS, 1, HEAD_DIM)
    for layer in range(LAYERS):
        kv.cache.update(column + 100 * layer, -(column + 100 * layer), layer)


def test_rows_join_leave_and_decode_keep_every_rows_positions() -> None:
    kv = KVBatch()
    kv.append(*prefill_layers([[1, 2], [3, 4, 5]]))
    decode_step(kv, [6, 7])
    kv.append(*prefill_layers([[8, 9, 10, 11, 12, 13]]))  # longer than the columns in use: more padding on the left
    assert real(kv) == [[1, 2, 6], [3, 4, 5, 7], [8, 9, 10, 11, 12, 13]]
    decode_step(kv, [14, 15, 16])
    assert kv.drop([0]) == [2, 1]  # the last row takes the place of the first
    assert real(kv) == [[8, 9, 10, 11, 12, 13, 16], [3, 4, 5, 7, 15]]
    assert kv.next_positions().view(-1).tolist() == [7, 5]


def test_a_decode_step_writes_in_place_while_the_columns_last() -> None:
    kv = KVBatch()
    kv.append(*prefill_layers([[1, 2, 3], [4]]))
    slab = kv.cache.layers[0]  # type: ignore[union-attr]
    allocated = slab.key_slab.shape[2]
    assert allocated > kv.length  # room to decode into
    expected = [[1.0, 2.0, 3.0], [4.0]]
    for step in range(allocated - kv.length):
        before = slab.key_slab.data_ptr()
        decode_step(kv, [10 + step, 20 + step])
        expected[0].append(10 + step)
        expected[1].append(20 + step)
        assert slab.key_slab.data_ptr() == before
    decode_step(kv, [99, 98])  # past the columns allocated: they double
    assert slab.key_slab.shape[2] == 2 * allocated
    assert real(kv) == [[*expected[0], 99], [*expected[1], 98]]


def test_a_row_taking_a_freed_place_sees_none_of_the_former_rows_positions() -> None:
    kv = KVBatch()
    kv.append(*prefill_layers([[1, 2, 3, 4], [5, 6, 7, 8]]))
    kv.drop([0, 1])
    assert kv.rows == 0 and kv.cache is None
    kv.append(*prefill_layers([[1, 2, 3, 4], [5, 6, 7, 8]]))
    kv.drop([1])
    kv.append(*prefill_layers([[9]]))
    assert real(kv) == [[1, 2, 3, 4], [9]]
    padding = ~kv.mask[1].bool()  # type: ignore[union-attr]
    for slab in kv.cache.layers:  # type: ignore[union-attr]
        assert not slab.keys[1, :, padding].any() and not slab.values[1, :, padding].any()


def test_padding_columns_are_trimmed_once_they_are_half_of_the_columns() -> None:
    kv = KVBatch()
    kv.append(*prefill_layers([[1, 2, 3, 4, 5, 6], [7, 8]]))
    decode_step(kv, [9, 10])
    kv.drop([0])  # 4 of 7 columns are now padding for every row
    assert kv.length == 3 and real(kv) == [[7, 8, 10]]
    kv.append(*prefill_layers([[1, 2, 3, 4, 5]]))
    decode_step(kv, [11, 6])
    kv.drop([1])  # 2 of 6 columns are padding: kept
    assert kv.length == 6 and real(kv) == [[7, 8, 10, 11]]


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


def test_a_request_in_a_freed_row_generates_what_it_generates_alone(loaded: LoadedModel) -> None:
    def payload(request_id: str, prompt: str, max_tokens: int) -> JobPayload:
        ids = tuple(loaded.tokenizer.encode(prompt).ids)
        return JobPayload(request_id, "demo", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=4), "ch")

    def generate(engine: EngineCore, late: JobPayload | None = None) -> str:
        text = ""
        while engine.has_work or late is not None:
            if late is not None and not engine.requests.get("long"):
                engine.add_request(late)  # once the long prompt's row has gone
                late = None
            text += "".join(e.text or "" for e in engine.step().events if e.request_id == "new" and e.kind == "token")
        return text

    new = payload("new", "redis", 12)
    alone = generate(EngineCore.build(loaded, 2560, 1), new)
    engine = EngineCore.build(loaded, 2560, 4)
    engine.add_request(payload("long", "a long prompt whose row leaves early, with many words in it", 3))
    engine.add_request(payload("first", "hello", 30))
    engine.add_request(payload("other", "你好 世界", 30))
    assert generate(engine, new) == alone
