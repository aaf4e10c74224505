"""Prepared data (`toolkit data prepare`) and weighted blends (`data.blend`), read through Megatron-Core's own
IndexedDataset, BlendedMegatronDatasetBuilder and GPTDataset: what prepare writes, the blend's proportions, the
same sequences for both backends, the held-out set of a blend (eval.split: documents never trained on; eval.blend:
datasets of their own), and bad input refused in one line with nothing written."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import launch, write_corpus
from toolkit.cli import main
from toolkit.data import DataStream
from toolkit.data.heldout import eval_micro_batches, eval_sequences
from toolkit.data.indexed import check_prepared, index_mismatch
from toolkit.errors import RecipeError, ToolkitError
from toolkit.recipe import load_recipe, resolve
from toolkit.run import build_data, build_train_data, check_before_start

TOKENIZER = "recipes/data/demo_tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """Megatron-Core's BlendedDataset asks for the rank when it caches its indices: a one-rank gloo group, as a
    single-process run has."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _plan(recipe: str, out_dir: Path, sets: list[str] = (), world: int = 2):
    return resolve(load_recipe(recipe, [f"output_dir={out_dir}", *sets]), world)


def test_prepare_writes_what_megatron_reads_back(prepared_blend, tokenizer, tmp_path):
    """Megatron-Core's own IndexedDataset reads back one document per text document: its ids, then EOS."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [json.loads(line)["text"] for line in prepared_blend["corpus_a"].read_text().splitlines()]
    ds = IndexedDataset(prepared_blend["a"])
    assert len(ds) == len(texts) == 300 and ds.index.dtype.__name__ == "uint16"
    for i in (0, 1, 150, 299):
        want = tokenizer(texts[i], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert ds[i].tolist() == want
    record = json.loads(Path(prepared_blend["a"] + ".tokenizer.json").read_text())
    assert record["vocab_size"] == len(tokenizer) and record["documents"] == 300
    assert record["tokens"] == int(ds.sequence_lengths.sum()) and record["workers"] == 2
    assert not list(prepared_blend["root"].glob("*.partial"))
    # one worker writes the same bytes as two (the fixture's)
    assert main(["data", "prepare", "--input", str(prepared_blend["corpus_a"]), "--output", str(tmp_path / "a1"),
                 "--tokenizer", TOKENIZER, "--workers", "1", "--quiet"]) == 0
    for ext in (".bin", ".idx"):
        assert Path(prepared_blend["a"] + ext).read_bytes() == (tmp_path / f"a1{ext}").read_bytes()


def _token_set(prefix: str) -> set[int]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return {t for i in range(len(ds)) for t in ds[i].tolist()}


def test_blend_draws_in_proportion_over_1000_samples(prepared_blend, tokenizer, tmp_path):
    """0.7/0.3 over 1000 samples (125 steps x global batch 8), each sample told apart by its own tokens."""
    plan = _plan(prepared_blend["recipe"], tmp_path, ["training.steps=125", "training.global_batch_size=8",
                                                      "training.micro_batch_size=8"], world=1)
    data = build_train_data(plan.recipe, plan.batch.global_batch, tokenizer)
    assert len(data) == 1000
    only_a = _token_set(prepared_blend["a"]) - _token_set(prepared_blend["b"])
    stream = DataStream(data, 8, 1, 1, 0, seed=0, shuffle=False)
    sources = []
    for _ in range(125):
        for row in stream.next_step()[0]["input_ids"]:
            sources.append("a" if set(row.tolist()) & only_a else "b")
    share = Counter(sources)["a"] / len(sources)
    assert abs(share - 0.7) < 3 * (0.7 * 0.3 / 1000) ** 0.5  # three standard errors
    assert sources == ["a" if data.source_of(i) == 0 else "b" for i in range(1000)]  # the stream reads in order
    assert (tmp_path / "data_cache").is_dir()  # Megatron's index caches: in the run's folder ...
    assert sorted(p.name for p in prepared_blend["root"].iterdir() if "cache" in p.name) == []  # ... not by the data


def test_both_backends_are_fed_the_same_sequences(prepared_blend, tokenizer, tmp_path):
    """The loop builds the data with one function whatever the backend; per step, the union over data-parallel
    ranks of what each rank's stream yields is the same set of sequences for DeepSpeed ZeRO-2 (dp 2), Megatron
    TP2 (dp 1) and Megatron DP2 with the distributed optimizer, all built from the same prepared files."""
    steps = 4

    def global_batches(recipe: str, sets: list[str]) -> tuple[list[list[tuple]], list[tuple]]:
        """(each step's sequences, the held-out sequences evaluated), over all data-parallel ranks."""
        plan = _plan(prepared_blend["recipe"], tmp_path / recipe,
                     [f"training.steps={steps}", f"parallel.backend={'deepspeed' if recipe == 'ds' else 'megatron'}",
                      *sets])
        data, held = build_data(plan.recipe, plan.batch.global_batch, tokenizer)
        b, dp = plan.batch, plan.layout.dp
        streams = [DataStream(data, b.micro_batch, b.grad_accum, dp, rank, 1234, shuffle=False) for rank in range(dp)]
        count = eval_sequences(len(held), plan.recipe.eval.batches, b.global_batch)
        evaluated = sorted(tuple(row.tolist()) for rank in range(dp)
                           for micro in eval_micro_batches(held, count, b.micro_batch, dp, rank)
                           for row in micro["input_ids"])
        return [sorted(tuple(row.tolist()) for s in streams for micro in s.next_step() for row in micro["input_ids"])
                for _ in range(steps)], evaluated

    deepspeed, held = global_batches("ds", ["parallel.zero_stage=2"])  # the recipe's eval.split 0.1, one batch
    assert global_batches("tp2", ["parallel.tp=2", "parallel.zero_stage=0"]) == (deepspeed, held)
    assert global_batches("dp2", ["parallel.zero_stage=1"]) == (deepspeed, held)
    assert len({seq for step in deepspeed for seq in step}) == steps * 16  # 16 distinct sequences per step
    assert all(len(seq) == 64 for step in deepspeed for seq in step)
    assert len(set(held)) == len(held) == 16 and not set(held) & {seq for step in deepspeed for seq in step}


def _documents(blended, samples) -> list[set[int]]:
    """Per source of a Megatron-Core BlendedDataset, the document ids its `samples` read (GPTDataset's document
    and sample indices: sample j spans document_index[sample_index[j][0] .. sample_index[j + 1][0]])."""
    out = [set() for _ in blended.datasets]
    for i in samples:
        k, j = int(blended.dataset_index[i]), int(blended.dataset_sample_index[i])
        ds = blended.datasets[k]
        out[k] |= set(ds.document_index[ds.sample_index[j][0]:ds.sample_index[j + 1][0] + 1].tolist())
    return out


def test_split_of_a_blend_holds_out_documents_never_trained_on(prepared_blend, tokenizer, tmp_path):
    """eval.split 0.1 over a 2-source blend is Megatron's split string "0.9,0.1,0": the held-out samples read only
    the last 10% of each source's documents, which no training sample reads; the builder is asked for what
    evaluation reads (eval.batches x global batch), the same samples whatever training.steps; the documents are
    held out with evaluation off too."""
    plan = _plan(prepared_blend["recipe"], tmp_path / "on", ["training.steps=20"])  # eval: interval 4, batches 1
    train, held = build_data(plan.recipe, plan.batch.global_batch, tokenizer)
    assert len(train) == 20 * 16 and len(held) == 16
    trained = _documents(train.dataset, range(len(train)))
    evaluated = _documents(held.dataset, range(len(held)))
    for k, docs in enumerate((300, 200)):
        assert evaluated[k] and evaluated[k] <= set(range(docs * 9 // 10, docs)), k  # the tail of each source
        assert trained[k] and not trained[k] & evaluated[k] and max(trained[k]) < docs * 9 // 10, k
    off = _plan(prepared_blend["recipe"], tmp_path / "off", ["training.steps=20", "eval.interval=0"])
    train_off, held_off = build_data(off.recipe, off.batch.global_batch, tokenizer)
    assert held_off is None and all(train[i]["input_ids"].equal(train_off[i]["input_ids"]) for i in range(len(train)))
    shorter = _plan(prepared_blend["recipe"], tmp_path / "shorter", ["training.steps=5"])
    _, held_shorter = build_data(shorter.recipe, shorter.batch.global_batch, tokenizer)
    assert all(held[i]["input_ids"].equal(held_shorter[i]["input_ids"]) for i in range(16))  # not on training.steps
    whole = _plan(prepared_blend["recipe"], tmp_path / "whole",
                  ["training.steps=20", "eval.split=null", "eval.interval=0"])
    assert max(_documents(build_train_data(whole.recipe, 16, tokenizer).dataset, range(320))[0]) >= 270


def test_split_that_holds_out_no_document_of_a_source_is_refused(prepared_blend, tokenizer, tmp_path):
    plan = _plan(prepared_blend["recipe"], tmp_path / "run", ["eval.split=0.002"])  # 0.6 of a's 300, 0.4 of b's 200
    with pytest.raises(ToolkitError, match=r"^eval\.split: 0\.002 of the 200 documents of \S+/b holds out none; "
                                           r"raise eval\.split to at least 0\.005, or add documents to that source$"):
        build_data(plan.recipe, plan.batch.global_batch, tokenizer)
    assert not (tmp_path / "run").exists()  # refused before Megatron-Core writes its index caches


def test_eval_blend_is_the_validation_split_of_its_own_blend(prepared_blend, tokenizer, tmp_path):
    """eval.blend is Megatron's blend_per_split for the valid split: the held-out samples are read from its
    datasets only, training reads the same samples as without it, and with eval.batches null the builder is asked
    for as many whole global batches as the held-out documents fill once."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    plan = _plan(prepared_blend["recipe_megatron"], tmp_path / "on", ["training.steps=6"])  # eval: batches 2
    train, held = build_data(plan.recipe, plan.batch.global_batch, tokenizer)
    assert len(held) == 32 and held.dataset.dataset_path == prepared_blend["held"]
    no_eval = _plan(prepared_blend["recipe_megatron"], tmp_path / "off", ["training.steps=6", "eval.blend=null", "eval.interval=0"])
    alone = build_train_data(no_eval.recipe, 16, tokenizer)
    assert all(train[i]["input_ids"].equal(alone[i]["input_ids"]) for i in range(len(train)))
    everything = _plan(prepared_blend["recipe_megatron"], tmp_path / "all", ["training.steps=6", "eval.batches=null"])
    _, held_all = build_data(everything.recipe, 16, tokenizer)
    documents = IndexedDataset(prepared_blend["held"])  # kept while its memory-mapped lengths are read
    once = int(documents.sequence_lengths.sum()) // 64
    assert len(held_all) == 16 * (once // 16) > 32
    big = _plan(prepared_blend["recipe_megatron"], tmp_path / "big", ["eval.batches=null", "training.steps=2",
                                                                      "training.global_batch_size=256"])
    with pytest.raises(ToolkitError, match=rf"^eval\.blend: the held-out documents fill {once} samples of 64 tokens, "
                                           "fewer than one global batch of 256; set eval.batches"):
        build_data(big.recipe, big.batch.global_batch, tokenizer)


# ---- bad input: one line naming the problem and the fix, exit code 2, nothing written --------------------------

def _prepare(capsys, tmp_path, inputs, tokenizer=TOKENIZER):
    code = main(["data", "prepare", "--input", *map(str, inputs), "--output", str(tmp_path / "out" / "x"),
                 "--tokenizer", tokenizer, "--quiet"])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("content,says", [("", "is empty"), ('{"text": ""}\n{"text": ""}\n', "holds no text"),
                                          ("\x00\x01binary", "NUL bytes")])
def test_prepare_refuses_a_corpus_without_text(content, says, capsys, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(content)
    code, err = _prepare(capsys, tmp_path, [corpus])
    assert code == 2 and says in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # not even the output's folder


def test_prepare_names_a_row_without_text_in_its_own_options(capsys, tmp_path):
    """Rows past the checked head without text were dropped without a word; the head check's fix named recipe
    keys (data.text_field) to a command-line user."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a fine story about a cat"}\n' * 300 + '{"body": "x"}\n')
    code, err = _prepare(capsys, tmp_path, [corpus])
    assert code == 2 and err == ("error: --input: row 301 has no text under 'text'; fix or remove that row (or set "
                                 "--text-field to the key that holds the text)"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]
    corpus.write_text('{"body": "x"}\n')
    code, err = _prepare(capsys, tmp_path, [corpus])
    assert code == 2 and "line 1 has no text string under 'text' (its keys: body)" in err, err
    assert "set --text-field to the key" in err and "data." not in err


def test_prepare_refuses_a_missing_input_and_an_existing_output(prepared_blend, capsys, tmp_path):
    code, err = _prepare(capsys, tmp_path, [tmp_path / "nope.jsonl"])
    assert code == 2 and "matches no file" in err and len(err.splitlines()) == 1
    code = main(["data", "prepare", "--input", str(prepared_blend["corpus_b"]), "--output", prepared_blend["b"],
                 "--tokenizer", TOKENIZER, "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "already exists" in err and "--overwrite" in err


@pytest.mark.parametrize("weights,says", [((0.7, -0.3), "must be above 0"), ((0.0, 0.0), "they sum to 0"),
                                          ((), "empty list")])
def test_blend_weights_must_be_positive(weights, says, prepared_blend, capsys):
    blend = "[" + ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip((prepared_blend["a"], prepared_blend["b"]),
                                                                        weights)) + "]"
    code = main(["validate", "--recipe", prepared_blend["recipe"], "--set", f"data.blend={blend}"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "data.blend" in err, err


def test_blend_path_without_bin_and_idx_is_refused_before_start(prepared_blend, tmp_path):
    shutil.copy(prepared_blend["a"] + ".bin", tmp_path / "half.bin")  # the .idx is missing
    r = load_recipe(prepared_blend["recipe"], [f"output_dir={tmp_path / 'run'}", "data.blend=[{path: "
                                               f"{tmp_path / 'half'}}}, {{path: {tmp_path / 'none'}}}]",
                                               "eval.split=null", f"eval.blend=[{{path: {tmp_path / 'none'}}}]"])
    with pytest.raises(RecipeError) as e:
        check_before_start(r)
    assert [p.key for p in e.value.problems] == ["data.blend[0].path", "data.blend[1].path", "eval.blend[0].path"]
    assert "has no .idx file" in e.value.problems[0].message and ".bin or .idx" in e.value.problems[1].message
    assert not (tmp_path / "run").exists()


def test_an_index_beside_another_preparations_bin_is_refused(prepared_blend, tokenizer, tmp_path):
    """.bin/.idx pairs mixed up in a copy: Megatron-Core's reader takes any .idx. A shorter index made a run read a
    part of the .bin with wrong document bounds; a longer one failed mid-step with a traceback (a trial of
    2026-12-07). Now one line per source before anything starts, whichever side is longer, and a record that
    disagrees with its files."""
    a, b = prepared_blend["a"], prepared_blend["b"]
    for name, bin_, idx, record in (("long", a, b, a), ("short", b, a, b), ("record", a, a, b)):
        for suffix, src in ((".bin", bin_), (".idx", idx), (".tokenizer.json", record)):
            shutil.copy(src + suffix, tmp_path / (name + suffix))
    assert index_mismatch(a) is None and index_mismatch(b) is None
    r = load_recipe(prepared_blend["recipe"], [f"output_dir={tmp_path / 'run'}", "eval.split=null",
                                               "data.blend=[" + ", ".join(f"{{path: {tmp_path / n}}}" for n in
                                                                          ("long", "short", "record")) + "]"])
    problems = check_prepared(r.data, tokenizer)
    assert [p.key for p in problems] == ["data.blend[0].path", "data.blend[1].path", "data.blend[2].path"]
    assert "long.idx indexes" in problems[0].message and "different preparations" in problems[0].message
    assert "short.idx indexes" in problems[1].message
    assert "record.tokenizer.json records" in problems[2].message and "prepare" in problems[2].fix
    with pytest.raises(RecipeError):
        build_data(resolve(r, 2).recipe, 16, tokenizer)
    assert not (tmp_path / "run").exists()
    (tmp_path / "short.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x02" * 30)
    assert "is not a Megatron-Core index" in index_mismatch(str(tmp_path / "short"))


@pytest.mark.slow
def test_data_prepared_with_another_tokenizer_is_refused(prepared_blend, tmp_path):
    """A tokenizer with the same size but two ids swapped is another vocabulary: a real launch stops on it (in
    data.blend and in eval.blend) with one line per source, exit code non-zero, and no output folder."""
    other = tmp_path / "other_tokenizer"
    shutil.copytree(TOKENIZER, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    x, y = sorted(vocab, key=vocab.get)[300:302]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    corpus = write_corpus(tmp_path / "c.jsonl", ["cat", "dog", "sun"], 50, 3)
    assert main(["data", "prepare", "--input", str(corpus), "--output", str(tmp_path / "c"), "--tokenizer",
                 str(other), "--quiet"]) == 0
    c = f"[{{path: {tmp_path / 'c'}}}]"  # for training and as the held-out eval.blend: both are checked
    proc = launch(prepared_blend["recipe"], [f"data.blend={c}", "eval.split=null", f"eval.blend={c}",
                                              "parallel.backend=megatron", "parallel.zero_stage=0"],
                  nproc=1, out_dir=tmp_path / "run", launcher="python", check=False)
    assert proc.returncode != 0
    assert "data.blend[0].path" in proc.stderr and "was prepared with tokenizer" in proc.stderr, proc.stderr[-2000:]
    assert "eval.blend[0].path" in proc.stderr and "2 problems" in proc.stderr
    assert not (tmp_path / "run").exists()
