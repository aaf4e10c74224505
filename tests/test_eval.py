"""The eval section: its held-out data (a split that is never trained on, or files of their own), the sequences each
data-parallel rank evaluates, the token-weighted loss, and bad input refused with one line and nothing written.
That every layout gives the single-process validation loss is checked in the parity runs (test_zero_parity.py,
test_megatron_parity.py); that it falls on the demo corpus and reaches TensorBoard, in test_train_e2e.py."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from conftest import launch
from toolkit.data import build_dataset
from toolkit.data.heldout import build_heldout, check_eval_files, eval_micro_batches, eval_sequences
from toolkit.errors import RecipeError, ToolkitError
from toolkit.model import token_loss_sum
from toolkit.recipe import check_paths, load_recipe, resolve

SMALL = ["data.seq_len=64", "data.paths=[recipes/data/demo_corpus/valid.jsonl]"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained("recipes/data/demo_tokenizer")


def _heldout(r, tokenizer, **kwargs):
    return build_heldout(r, tokenizer, build_dataset(r.data, tokenizer), **kwargs)


def _rows(ds) -> list[tuple]:
    return [tuple(x.tolist()) for x in ds["input_ids"]]


def test_split_holds_out_the_tail_and_never_trains_on_it(tokenizer):
    whole, none = _heldout(load_recipe("tiny_zero0", SMALL), tokenizer)
    assert none is None
    train, held = _heldout(load_recipe("tiny_zero0", [*SMALL, "eval.split=0.1", "eval.interval=5"]), tokenizer)
    n = len(whole)
    assert len(held) == int(n * 0.1) > 0 and len(train) + len(held) == n
    assert _rows(train) + _rows(held) == _rows(whole)  # the tail, in order: deterministic and disjoint
    again, held_again = _heldout(load_recipe("tiny_zero0", [*SMALL, "eval.split=0.1"]), tokenizer)
    assert _rows(held_again) == _rows(held) and len(again) == len(train)  # held out even with evaluation off


def test_ranks_evaluate_exactly_the_single_process_sequences(tokenizer):
    _, held = _heldout(load_recipe("tiny_zero0", [*SMALL, "eval.split=0.3"]), tokenizer)
    count = eval_sequences(len(held), 2, 8)
    assert count == 16 and eval_sequences(len(held), None, 8) == 8 * (len(held) // 8)
    assert eval_sequences(len(held), 10_000, 8) == 8 * (len(held) // 8)  # capped at the full batches there are
    single = _rows(held.select(range(count)))
    mine = [eval_micro_batches(held, count, 2, 2, rank) for rank in (0, 1)]
    assert all(len(m) == 4 and all(b["input_ids"].shape == (2, 64) for b in m) for m in mine)
    dealt = [tuple(x.tolist()) for m in mine for b in m for x in b["input_ids"]]
    assert sorted(dealt) == sorted(single) and len(set(dealt)) == len(dealt) == count
    with pytest.raises(ToolkitError, match="cannot fill one global batch of 64"):
        eval_sequences(40, None, 64)


def test_token_loss_sum_is_hugging_faces_loss_times_its_token_count():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 50, (3, 12))
    labels = ids.clone()
    labels[1, 7:] = -100  # a padded row: its tail is not predicted
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    total, count = token_loss_sum(out.logits, labels).tolist()
    assert count == 3 * 11 - 5
    assert math.isclose(total / count, out.loss.item(), rel_tol=1e-6)
    shifted, _ = token_loss_sum(out.logits, torch.roll(labels, 1, dims=1)).tolist()
    assert not math.isclose(shifted, total, rel_tol=1e-3)  # the shift matters: a wrong one would be caught


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1"])
def test_split_outside_zero_one_is_refused(value):
    with pytest.raises(RecipeError, match=r"eval\.split: Input should be (greater|less) than"):
        load_recipe("tiny_zero0", [f"eval.split={value}"])


@pytest.mark.parametrize("sets,needle", [
    (["eval.interval=10"], "eval.interval: 10, but no held-out data is named"),
    (["eval.split=0.1", "eval.paths=[a.jsonl]"], "eval.split: set together with eval.paths"),
    (["eval.paths=[]"], "eval.paths: is an empty list"),
])
def test_eval_section_must_name_one_source(sets, needle):
    with pytest.raises(RecipeError) as e:
        resolve(load_recipe("tiny_zero0", sets))
    assert needle in str(e.value)


def test_split_that_leaves_nothing_on_one_side_is_refused(tokenizer):
    with pytest.raises(ToolkitError, match=r"eval\.split: 0\.001 of \d+ sequences of 64 tokens holds out no full"):
        _heldout(load_recipe("tiny_zero0", [*SMALL, "eval.split=0.001"]), tokenizer)
    with pytest.raises(ToolkitError, match=r"eval\.split: 0\.99 of \d+ sequences leaves \d for training, fewer than "
                                           "one global batch of 16"):
        _heldout(load_recipe("tiny_zero0", [*SMALL, "eval.split=0.99"]), tokenizer, global_batch=16)


def test_missing_or_bad_eval_paths_are_named_before_the_run_starts(tmp_path):
    r = load_recipe("tiny_zero0", ["eval.interval=5", f"eval.paths=[{tmp_path}/held/*.jsonl]"])
    assert [p.key for p in check_paths(r)] == ["eval.paths"]
    (tmp_path / "empty.jsonl").write_text("")
    r = load_recipe("tiny_zero0", ["eval.interval=5", f"eval.paths=[{tmp_path}/empty.jsonl]"])
    assert [(p.key, p.message) for p in check_eval_files(r)] == [("eval.paths", f"{tmp_path}/empty.jsonl is empty")]


def test_train_with_a_split_too_small_exits_with_one_line_and_writes_nothing(tmp_path):
    """The latest eval error (found after tokenizing) still comes before the output folder exists. A missing
    eval.paths file is refused earlier, in check_before_start, with the data.paths files (test above)."""
    out = tmp_path / "run"
    proc = launch("tiny_zero0", [*SMALL, "eval.interval=5", "eval.split=0.001"], nproc=1, out_dir=out,
                  launcher="python", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("error: eval.split: 0.001 of ") and "holds out no full sequence" in lines[-1]
    assert not out.exists()
