"""`toolkit convert --to hf` from Megatron-LM's legacy layout: weights, padding, safety, atomic output.

The Megatron-LM checkpoint is written here the way Megatron-LM writes it (the layout Megatron-LM core 0.16 writes): per-rank
model_optim_rng.pt files with an argparse.Namespace of arguments, Transformer Engine norm names, _extra_state
entries, a vocabulary padded to 128 x tp whose padding rows are not zero, numpy RNG state, and the tracker file.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from toolkit.families import dims_from_hf, hf_to_megatron
from toolkit.checkpoint.convert import convert_to_hf
from toolkit.errors import ToolkitError

VOCAB, TP, PP = 500, 2, 2
TE_NAMES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
            ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def hf_model_for():
    """The tiny untied GQA Llama the Megatron-LM checkpoints here are made from (seeded: the same every time)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=False))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return hf_model_for()


def _te(name: str) -> str:
    for local, te in TE_NAMES.items():
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def write_megatron_lm(root, hf_model, vpp: int = 1) -> None:
    """With vpp > 1, each rank file holds one state dict per virtual chunk (model0, model1, ...), as Megatron-LM's
    interleaved schedule saves them."""
    dims = dims_from_hf(hf_model.config, TP)
    shards = hf_to_megatron(hf_model.state_dict(), dims, TP, PP, vpp)
    args = argparse.Namespace(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, num_layers=4, hidden_size=64,
                              ffn_hidden_size=96, num_attention_heads=8, group_query_attention=True,
                              num_query_groups=2, max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=10000,
                              untie_embeddings_and_output_weights=True, padded_vocab_size=dims.padded_vocab,
                              make_vocab_size_divisible_by=128, params_dtype=torch.float32)
    for (p, t), chunks in shards.items():
        models = {}
        for c, state in enumerate(chunks):
            model = models[f"model{c}" if vpp > 1 else "model"] = {}
            for name, tensor in state.items():
                if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                    tensor = tensor.clone()
                    valid = max(0, VOCAB - t * tensor.shape[0])
                    tensor[valid:] = torch.randn_like(tensor[valid:])  # trained padding rows are not zero
                model[_te(name)] = tensor
                model[_te(name).rsplit(".", 1)[0] + "._extra_state"] = None
        folder = root / "iter_0000007" / f"mp_rank_{t:02d}_{p:03d}"
        folder.mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, **models,
                    "rng_state": [{"random_rng_state": None, "np_rng_state": np.random.get_state(),
                                   "torch_rng_state": torch.get_rng_state()}]}, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("7")


@pytest.fixture
def megatron_lm_ckpt(tmp_path, hf_model):
    write_megatron_lm(tmp_path / "mlm", hf_model)
    return tmp_path / "mlm"


def test_megatron_lm_to_hf_is_exact_and_loads(megatron_lm_ckpt, hf_model, tmp_path):
    from transformers import LlamaForCausalLM

    out = convert_to_hf(megatron_lm_ckpt, tmp_path / "hf", vocab_size=VOCAB)
    got = load_file(str(out / "model.safetensors"))
    want = hf_model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in got)  # padding rows dropped, everything else bit-exact
    loaded = LlamaForCausalLM.from_pretrained(out)
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, hf_model(ids).logits, atol=1e-6)  # the config maps back too


def test_megatron_lm_virtual_chunks_are_read_in_layer_order(hf_model, tmp_path):
    """vpp = 2: each rank file holds model0 and model1, whose local layer 0 are different global layers."""
    write_megatron_lm(tmp_path / "mlm", hf_model, vpp=2)
    out = convert_to_hf(tmp_path / "mlm", tmp_path / "hf", vocab_size=VOCAB, verify=False)
    got = load_file(out / "model.safetensors")
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(got[name], tensor), name


def test_megatron_lm_ties_embeddings_unless_told_not_to():
    """Megatron-LM ties the output layer to the embeddings unless --untie-embeddings-and-output-weights is given, so
    args without that flag (older checkpoints do not record it) mean a tied model."""
    from toolkit.checkpoint.megatron_lm import hf_config

    args = argparse.Namespace(num_attention_heads=8, hidden_size=64, ffn_hidden_size=96, num_layers=4,
                              max_position_embeddings=128)
    assert hf_config(args, VOCAB)["tie_word_embeddings"] is True
    args.untie_embeddings_and_output_weights = True
    assert hf_config(args, VOCAB)["tie_word_embeddings"] is False


def test_inspect_megatron_lm(megatron_lm_ckpt):
    from toolkit.checkpoint.inspect import inspect

    report = inspect(megatron_lm_ckpt)
    assert report["format"] == "megatron-lm" and report["complete"] and report["step"] == 7
    assert report["layout"] == {"tp": TP, "pp": PP, "vpp": 1}
    arch = report["architecture"]
    assert arch["num_key_value_heads"] == 2 and arch["vocab_size"] == "512 (padded, by 128 x tp=2)"
    assert report["dtypes"] == {"F32": report["parameters"]}  # from the rank files' records (none until 2026-12-07)


def test_megatron_lm_to_megatron_relayout_is_exact(megatron_lm_ckpt, hf_model, tmp_path):
    from toolkit.checkpoint.convert import convert

    out = convert(megatron_lm_ckpt, tmp_path / "m", "megatron", tp=1, pp=1, vocab_size=VOCAB, progress=False,
                  log=lambda *_: None)
    back = convert_to_hf(out, tmp_path / "hf")
    got = load_file(str(back / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in hf_model.state_dict().items())


def stored_rows(folder, name: str) -> torch.Tensor:
    """The rows of vocabulary-parallel parameter `name` as a Megatron layout stores them (padding included), its TP
    shards concatenated, read from the files themselves: a Megatron-LM legacy folder's model_optim_rng.pt or a
    toolkit step folder's safetensors."""
    from safetensors import safe_open

    shards = {}
    for f in sorted(folder.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        for key, tensor in torch.load(f, weights_only=False)["model"].items():  # a file this test wrote or converted
            if key.endswith(name):
                shards[int(f.parent.name.split("_")[2])] = tensor
    for f in sorted(folder.glob("step_*/model_tp*_pp*.safetensors")):
        with safe_open(str(f), "pt") as reader:
            for key in reader.keys():
                if key.endswith(name):
                    shards[int(f.name.split("_")[1][2:])] = reader.get_tensor(key)
    assert shards, f"no {name} in {folder}"
    return torch.cat([shards[t] for t in sorted(shards)])


@pytest.mark.parametrize("copy", [True, False], ids=["file-to-file", "through-memory"])
def test_padding_rows_move_between_megatron_layouts(megatron_lm_ckpt, tmp_path, copy):
    """Megatron trains its padding rows (the output layer's are in the loss's softmax), so a conversion between
    Megatron layouts keeps the ones both paddings hold, as Megatron-LM's own converter does, and zeroes only rows
    the source never had. The fixture's 12 padding rows (vocabulary 500 padded to 512 at TP2) are random."""
    from toolkit.checkpoint.convert import convert

    names = ("word_embeddings.weight", "output_layer.weight")
    want = {n: stored_rows(megatron_lm_ckpt, n) for n in names}
    assert all(w.shape[0] == 512 and w[VOCAB:].abs().sum() > 0 for w in want.values())
    lines = []
    run = dict(vocab_size=VOCAB, progress=False, log=lines.append, copy=copy)
    tp1 = convert(megatron_lm_ckpt, tmp_path / "tp1", "megatron_lm", tp=1, pp=1, **run)  # 500 pads to 512 at TP1
    tp4 = convert(tp1, tmp_path / "tp4", "megatron", tp=4, pp=1, **run)  # and to 512 at TP4 (128 rows a rank)
    run.pop("vocab_size")
    td = convert(tp4, tmp_path / "td", "torch_dist", tp=2, pp=2, **run)
    back = convert(td, tmp_path / "back", "megatron_lm", tp=TP, pp=PP, vocab_size=VOCAB, **run)
    tp8 = convert(tp4, tmp_path / "tp8", "megatron", tp=8, pp=1, **run)  # 1024 rows at TP8: 512 more
    notes = [line for line in lines if line.startswith("vocabulary padding")]
    from toolkit.checkpoint.inspect import inspect

    assert inspect(tp4)["vocab_padding"] == "512 rows at tp=4 (by 128): 12 padding rows"
    assert inspect(tp1)["architecture"]["vocab_size"] == "512 (padded, by 128 x tp=1)"  # Megatron-LM: no true size
    assert notes[0] == ("vocabulary padding: 12 padding rows at tp=2 (by 128), all carried: the vocabulary pads to 512 "
                        "rows at tp=1 (by 128) too")
    assert notes[-1] == ("vocabulary padding: 12 padding rows at tp=4 (by 128), carried, and 512 zero rows added: "
                         "500 pads to 1024 rows at tp=8 (by 128), not 512; a run resumed from it trains a softmax "
                         "over 1024 rows (--make-vocab-size-divisible-by 64 keeps 512)")
    for n in names:
        for out in (tp1, tp4, back):
            assert torch.equal(stored_rows(out, n), want[n]), (out.name, n)
        wide = stored_rows(tp8, n)
        assert wide.shape[0] == 1024 and torch.equal(wide[:512], want[n]) and not wide[512:].any()
    # the round trip through three formats gives back the very files' tensors, padding and all (under the local
    # spec's names: the fixture has Transformer Engine's)
    for f in sorted(megatron_lm_ckpt.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        a = {_te(k): t for k, t in torch.load(f, weights_only=False)["model"].items() if isinstance(t, torch.Tensor)}
        again = torch.load(back / f.relative_to(megatron_lm_ckpt), weights_only=False)["model"]
        b = {_te(k): t for k, t in again.items() if isinstance(t, torch.Tensor)}
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
    hf = load_file(str(convert_to_hf(tp8, tmp_path / "hf") / "model.safetensors"))  # the padding rows never reach HF
    assert hf["lm_head.weight"].shape[0] == VOCAB and torch.equal(hf["lm_head.weight"], want[names[1]][:VOCAB])


def test_a_divisor_keeps_the_padded_size_at_a_new_tp(megatron_lm_ckpt, tmp_path):
    """500 pads to 512 rows at TP2 by 128 and to 1024 at TP8; --make-vocab-size-divisible-by 64 (which convert's note
    names) keeps 512 at TP8, in the args Megatron-LM reads and in the flags it is told to run with."""
    from toolkit.checkpoint.convert import convert

    lines = []
    convert(megatron_lm_ckpt, tmp_path / "wide", "megatron", tp=8, vocab_size=VOCAB, progress=False, log=lines.append)
    assert any(line.endswith("(--make-vocab-size-divisible-by 64 keeps 512)") for line in lines)
    lines.clear()
    out = convert(megatron_lm_ckpt, tmp_path / "tp8", "megatron_lm", tp=8, vocab_size=VOCAB, divisible_by=64,
                  progress=False, log=lines.append)
    args = torch.load(next(out.glob("iter_*/mp_rank_00/model_optim_rng.pt")), weights_only=False)["args"]
    assert (args.make_vocab_size_divisible_by, args.padded_vocab_size, args.tensor_model_parallel_size) == (64, 512, 8)
    assert "vocabulary padding: 12 padding rows at tp=2 (by 128), all carried: the vocabulary pads to 512 rows at " \
           "tp=8 (by 64) too" in lines
    assert any("--make-vocab-size-divisible-by 64" in line for line in lines if line.startswith("to continue in"))
    for name in ("word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(stored_rows(out, name), stored_rows(megatron_lm_ckpt, name))
    toolkit = convert(out, tmp_path / "toolkit", "megatron", tp=8, vocab_size=VOCAB, progress=False, log=print)
    meta = json.loads(next(toolkit.glob("step_*/toolkit_meta.json")).read_text())
    assert meta["make_vocab_size_divisible_by"] == 64  # the source's, kept: 512 rows at TP8 again
    lines.clear()  # a source without padding rows (500 at TP1 by 4) still says what a Megatron target adds
    unpadded = convert(out, tmp_path / "unpadded", "megatron_lm", tp=1, vocab_size=VOCAB, divisible_by=4,
                       progress=False, log=lines.append)
    convert(unpadded, tmp_path / "tp2", "megatron", tp=2, vocab_size=VOCAB, progress=False, log=lines.append)
    assert ("vocabulary padding: none at tp=1 (by 4); 4 zero rows added: 500 pads to 504 rows at tp=2 (by 4); a run "
            "resumed from it trains a softmax over 504 rows, not 500 (--make-vocab-size-divisible-by 2 keeps 500)") \
        in lines
    lines.clear()
    hf = convert(out, tmp_path / "hf_src", "hf", vocab_size=VOCAB, progress=False, log=lines.append)
    convert(hf, tmp_path / "from_hf", "torch_dist", tp=2, progress=False, log=lines.append)
    assert "vocabulary padding: 500 pads to 512 rows at tp=2 (by 128): 12 zero rows" in lines
    with pytest.raises(ToolkitError, match="--to hf has no padding: drop it"):
        convert(out, tmp_path / "hf", "hf", vocab_size=VOCAB, divisible_by=64, progress=False, log=print)
    assert not (tmp_path / "hf").exists()


def test_megatron_lm_needs_the_true_vocab_size(megatron_lm_ckpt, tmp_path):
    with pytest.raises(ToolkitError, match="stores 512 vocabulary rows, padded by Megatron to a multiple of 256; pass the true vocabulary size with --vocab-size"):
        convert_to_hf(megatron_lm_ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_missing_rank_is_refused_and_nothing_is_written(megatron_lm_ckpt, tmp_path):
    (megatron_lm_ckpt / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(ToolkitError, match="is incomplete for tp=2 pp=2: missing"):
        convert_to_hf(megatron_lm_ckpt, tmp_path / "hf", vocab_size=VOCAB)
    assert not (tmp_path / "hf").exists()


def test_truncated_file_is_refused(megatron_lm_ckpt, tmp_path):
    f = megatron_lm_ckpt / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ToolkitError, match="cannot read .*model_optim_rng.pt: the file is truncated or damaged"):
        convert_to_hf(megatron_lm_ckpt, tmp_path / "hf", vocab_size=VOCAB)
    assert not (tmp_path / "hf").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_is_refused_and_never_runs(megatron_lm_ckpt, tmp_path):
    marker = tmp_path / "pwned"
    f = megatron_lm_ckpt / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)  # our own fixture: trusted
    state["args"].evil = _Payload(marker)
    torch.save(state, f)
    with pytest.raises(ToolkitError, match="refused rather than unpickled"):
        convert_to_hf(megatron_lm_ckpt, tmp_path / "hf", vocab_size=VOCAB)
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_existing_destination_needs_overwrite_and_survives_a_failure(megatron_lm_ckpt, tmp_path):
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("user data")
    proc = subprocess.run([sys.executable, "-m", "toolkit", "convert", str(megatron_lm_ckpt), str(dst), "--to", "hf",
                           "--vocab-size", str(VOCAB)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "already exists; pass --overwrite" in proc.stderr
    with pytest.raises(ToolkitError):  # a failing conversion with --overwrite leaves the old folder alone
        convert_to_hf(megatron_lm_ckpt, dst, vocab_size=None, overwrite=True)
    assert (dst / "keep.txt").read_text() == "user data"
    with pytest.raises(ToolkitError, match="which toolkit convert did not write"):  # never deletes a user's folder
        convert_to_hf(megatron_lm_ckpt, dst, vocab_size=VOCAB, overwrite=True)
    assert (dst / "keep.txt").read_text() == "user data"
    (dst / "keep.txt").unlink()
    dst.rmdir()
    convert_to_hf(megatron_lm_ckpt, dst, vocab_size=VOCAB)
    first = (dst / "model.safetensors").stat().st_ino
    convert_to_hf(megatron_lm_ckpt, dst, vocab_size=VOCAB, overwrite=True)  # its own output: replaced
    assert (dst / "model.safetensors").is_file() and (dst / "model.safetensors").stat().st_ino != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial folders left


def test_what_appears_at_dst_while_converting_is_never_replaced_or_deleted(megatron_lm_ckpt, tmp_path, monkeypatch):
    """DST is checked before a conversion and again at the rename that puts it in place. Two conversions to one
    DST both printed `wrote DST` and one output silently replaced the other; a file a user added to an old output
    during an --overwrite conversion was deleted (a trial of 2026-12-07)."""
    from toolkit.checkpoint import output

    work = tmp_path / "work"
    dst, real_durable = work / "hf", output.durable
    convert_to_hf(megatron_lm_ckpt, work / "other", vocab_size=VOCAB)

    def another_conversion_lands(folder):  # just before this one's rename
        if not dst.exists():
            os.rename(work / "other", dst)
        return real_durable(folder)

    monkeypatch.setattr(output, "durable", another_conversion_lands)
    with pytest.raises(ToolkitError, match=r"hf appeared while converting \(another process wrote it\); it is left"):
        convert_to_hf(megatron_lm_ckpt, dst, vocab_size=VOCAB)
    theirs = (dst / "model.safetensors").stat().st_ino
    assert sorted(p.name for p in work.iterdir()) == ["hf"]  # this one's scratch folder is gone

    def user_adds_a_file(folder):
        (dst / "NOTES.txt").write_text("mine")
        return real_durable(folder)

    monkeypatch.setattr(output, "durable", user_adds_a_file)
    with pytest.raises(ToolkitError, match="hf came to hold NOTES.txt while converting, which toolkit convert did not"):
        convert_to_hf(megatron_lm_ckpt, dst, vocab_size=VOCAB, overwrite=True)
    assert (dst / "NOTES.txt").read_text() == "mine" and (dst / "model.safetensors").stat().st_ino == theirs
    assert sorted(p.name for p in work.iterdir()) == ["hf"]
    monkeypatch.setattr(output, "durable", real_durable)
    (dst / "NOTES.txt").unlink()
    convert_to_hf(megatron_lm_ckpt, dst, vocab_size=VOCAB, overwrite=True)  # its own output: replaced
    assert (dst / "model.safetensors").stat().st_ino != theirs and sorted(p.name for p in work.iterdir()) == ["hf"]


@pytest.mark.parametrize("to", ["megatron_lm", "torch_dist", "hf"])
def test_every_output_file_is_on_disk_before_it_is_renamed_into_place(megatron_lm_ckpt, tmp_path, monkeypatch, to):
    """Every file and folder of the output is fsynced before the rename that makes it DST (Megatron-LM's rank files
    and the .distcp were not): a crash just after a conversion never leaves a DST of empty files."""
    from toolkit.checkpoint import output
    from toolkit.checkpoint.convert import convert

    synced, real_fsync, real_rename = set(), os.fsync, output._rename_no_replace
    renamed = []

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def rename(a, b):
        renamed.append(str(a))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(output, "_rename_no_replace", rename)
    dst = convert(megatron_lm_ckpt, tmp_path / "out", to, tp=2 if to != "hf" else 1, vocab_size=VOCAB,
                  progress=False, log=lambda *_: None)
    scratch = renamed[-1]
    written = {str(p).replace(str(dst), scratch) for p in [dst, *dst.rglob("*")]}
    assert len(written) > 3 and written <= synced, sorted(written - synced)
