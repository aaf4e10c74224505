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


def _corpus_ids(tok, texts):
    """Every document's ids with EOS after it, concatenated: what packing cuts into blocks."""
    return [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def test_packing_cuts_the_whole_corpus_and_leaves_out_only_its_last_partial_block(dataset):
    """Block k is tokens [64 k, 64 (k + 1)) of the concatenated corpus. Packing each map batch of 1,000 documents
    on its own dropped a partial block per batch (a trial of 2026-12-07: 10.8% of a corpus of short documents at
    seq_len 4096)."""
    import json

    tok = AutoTokenizer.from_pretrained("recipes/data/demo_tokenizer")
    lines = open("recipes/data/demo_corpus/train.jsonl", encoding="utf-8").read().splitlines()
    assert len(lines) > 1000, "the corpus must span more than one map batch for this test to mean anything"
    flat = _corpus_ids(tok, [json.loads(x)["text"] for x in lines])
    assert len(dataset) == len(flat) // 64
    got = torch.stack([dataset[i]["input_ids"] for i in range(len(dataset))]).flatten().tolist()
    assert got == flat[:len(dataset) * 64]


def test_short_documents_over_several_map_batches(tmp_path):
    from toolkit.recipe.schema import DataConfig

    texts = [f"story {i} " + "a little girl " * (i % 7) for i in range(2500)]
    (tmp_path / "short.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    cfg = DataConfig(paths=[str(tmp_path / "short.jsonl")], tokenizer="recipes/data/demo_tokenizer", seq_len=512)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    ds = build_dataset(cfg, tok)
    flat = _corpus_ids(tok, texts)
    assert len(ds) == len(flat) // 512 and len(ds) >= 3
    assert ds[len(ds) - 1]["input_ids"].tolist() == flat[(len(ds) - 1) * 512:len(ds) * 512]


def test_text_field_wins_over_a_text_column_of_the_same_rows(tmp_path):
    """{"text": title, "content": body} with data.text_field content trains on the bodies. It trained on the
    titles, without a word (a trial of 2026-12-07)."""
    from toolkit.data import check_files
    from toolkit.recipe.schema import DataConfig

    rows = [{"text": "TITLE", "content": f"once upon a time there was a girl number {i}"} for i in range(40)]
    path = tmp_path / "two.jsonl"
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(paths=[str(path)], tokenizer="recipes/data/demo_tokenizer", seq_len=32, text_field="content")
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    ds = build_dataset(cfg, tok)
    flat = _corpus_ids(tok, [r["content"] for r in rows])
    assert len(ds) == len(flat) // 32 and ds[0]["input_ids"].tolist() == flat[:32]
    typo = DataConfig(paths=[str(path)], tokenizer=cfg.tokenizer, text_field="contnet")
    (problem,) = check_files(typo)
    assert "line 1 has no text string under 'contnet' (its keys: text, content)" in problem.message


def test_a_row_without_text_past_the_checked_head_names_its_row(tmp_path):
    from toolkit.recipe.schema import DataConfig

    path = tmp_path / "late.jsonl"
    path.write_text('{"text": "a fine story about a cat"}\n' * 300 + '{"body": "x"}\n')
    cfg = DataConfig(paths=[str(path)], tokenizer="recipes/data/demo_tokenizer", seq_len=16)
    with pytest.raises(ToolkitError, match=r"^data.paths: row 301 has no text under 'text'; fix or remove"):
        build_dataset(cfg, AutoTokenizer.from_pretrained(cfg.tokenizer))


def test_a_line_past_the_checked_head_that_is_not_json_is_named_by_its_line(tmp_path):
    """`datasets` says "JSON parse error ... in row 2500", counted from 0 within a block of the file (until
    2026-12-07 that was the line shown); the line is found once the load has failed."""
    from toolkit.recipe.schema import DataConfig

    good, path = tmp_path / "good.jsonl", tmp_path / "broken.jsonl"
    good.write_text('{"text": "a fine story about a cat"}\n' * 50)
    path.write_text('{"text": "a fine story about a cat"}\n' * 2500 + '{"text": "cut\n' + '{"text": "x"}\n' * 9)
    cfg = DataConfig(paths=[str(good), str(path)], tokenizer="recipes/data/demo_tokenizer", seq_len=16)
    with pytest.raises(ToolkitError, match=rf"^data.paths: {path} line 2501 is not JSON \(Invalid control character "
                                           r"at column 14\); fix or remove that line$"):
        build_dataset(cfg, AutoTokenizer.from_pretrained(cfg.tokenizer))
