"""The data pipeline: packing, disjoint per-rank shards whose union is the single-process batch, epochs, resume."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from toolkit.data import DataStream, build_dataset
from toolkit.errors import ToolkitError
from toolkit.recipe import load_recipe


@pytest.fixture(scope="module")
def dataset():
    r = load_recipe("tiny_zero0", ["data.seq_len=64"])
    return build_dataset(r.data, AutoTokenizer.from_pretrained(r.data.tokenizer))


def test_packing_gives_full_blocks_with_document_separators(dataset):
    row = dataset[0]
    assert row["input_ids"].shape == (64,) and torch.equal(row["input_ids"], row["labels"])
    eos = AutoTokenizer.from_pretrained("recipes/data/demo_tokenizer").eos_token_id
    assert any((dataset[i]["input_ids"] == eos).any() for i in range(5))


def _ids(batches):
    return [tuple(x.tolist()) for b in batches for x in b["input_ids"]]


def test_ranks_get_disjoint_shards_that_add_up_to_the_single_process_step(dataset):
    single = DataStream(dataset, micro_batch=4, grad_accum=2, dp=1, dp_rank=0, seed=3)
    ranks = [DataStream(dataset, micro_batch=4, grad_accum=1, dp=2, dp_rank=r, seed=3) for r in (0, 1)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch
    for _ in range(3):
        a, b = (_ids(s.next_step()) for s in ranks)
        assert not set(a) & set(b), "ranks must see different data"
        assert sorted(a + b) == sorted(_ids(single.next_step()))


def test_epochs_reshuffle_and_resume_continues_exactly(dataset):
    s = DataStream(dataset, micro_batch=8, grad_accum=1, dp=2, dp_rank=1, seed=3)
    first = _ids(s.next_step())
    for _ in range(s.steps_per_epoch - 1):
        s.next_step()
    assert s.state_dict() == {"epoch": 0, "consumed_micro_batches": s.steps_per_epoch}
    assert _ids(s.next_step()) != first and s.epoch == 1  # set_epoch reshuffled the second epoch
    state = s.state_dict()
    expected = [_ids(s.next_step()) for _ in range(3)]
    resumed = DataStream(dataset, micro_batch=8, grad_accum=1, dp=2, dp_rank=1, seed=3)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_step()) for _ in range(3)] == expected


def test_too_little_data_for_one_step_is_a_clear_error(dataset):
    with pytest.raises(ToolkitError, match="cannot fill one step"):
        DataStream(dataset, micro_batch=len(dataset), grad_accum=1, dp=2, dp_rank=0, seed=0)


def test_unpacked_documents_are_padded_and_masked():
    r = load_recipe("tiny_zero0", ["data.packing=false", "data.seq_len=256"])
    ds = build_dataset(r.data, AutoTokenizer.from_pretrained(r.data.tokenizer))
    row = ds[0]
    pad = row["labels"] == -100
    assert pad.any() and (row["input_ids"][pad] == 3).all()  # <pad> id 3 in the demo tokenizer
