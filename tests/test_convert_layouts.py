"""`toolkit convert` between Hugging Face and Megatron layouts: bit-exact chains, Megatron logits at every layout,
optimizer state carried to a new layout so training continues, and broken inputs refused with nothing written.

The tiny models have GQA (8 heads, 4 kv heads), a vocabulary of 500 (divisible neither by 128 nor by any TP
size, so every Megatron layout pads it), and come untied and tied.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, UNINTERRUPTED, launch, read_metrics
from convert_chains import CHAIN, VOCAB, hf_model
from convert_chains import chain as chain_for
from safetensors.torch import load_file

from toolkit.checkpoint.convert import convert
from toolkit.checkpoint.safetensors_sources import TOKENIZER_FILES
from toolkit.errors import ToolkitError


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def chain(request, tmp_path_factory):
    return chain_for(request.param, tmp_path_factory)


def test_chain_back_to_hf_is_bit_exact(chain):
    got = load_file(str(chain["back"] / "model.safetensors"))
    want = chain["model"].state_dict()
    if chain["tied"]:
        assert "lm_head.weight" not in got  # save_pretrained's convention: the tied head is the embedding
        want.pop("lm_head.weight")
    assert set(got) == set(want)
    for name in got:
        assert torch.equal(got[name], want[name]), name
    config = json.loads((chain["back"] / "config.json").read_text())
    assert config["tie_word_embeddings"] is chain["tied"] and config["num_key_value_heads"] == 4


def test_megatron_files_are_laid_out_as_asked(chain):
    tag = chain[(2, 2, 1)] / "step_00000000"
    meta = json.loads((tag / "toolkit_meta.json").read_text())
    assert meta["layout"] | {} == {"world_size": 4, "zero_stage": 0, "dp": 1, "tp": 2, "pp": 2, "vpp": 1, "cp": 1}
    assert meta["weights_only"] is True and meta["converted_from"] == "Hugging Face"
    carried = [f for f in meta["files"] if not f.startswith("model_")]  # the HF source's tokenizer files, carried
    assert set(carried) <= set(TOKENIZER_FILES), carried
    assert sorted(set(meta["files"]) - set(carried)) == [f"model_tp{t:02d}_pp{p:03d}.safetensors" for t in range(2)
                                                         for p in range(2)]
    first = load_file(str(tag / "model_tp01_pp000.safetensors"))
    assert first["chunk0.embedding.word_embeddings.weight"].shape == (256, 128)  # 500 padded to 512, split in two
    assert (first["chunk0.embedding.word_embeddings.weight"][VOCAB - 256:] == 0).all()  # the padding rows
    vpp = load_file(str(chain[(1, 2, 2)] / "step_00000000" / "model_tp00_pp001.safetensors"))
    assert {k.split(".")[0] for k in vpp} == {"chunk0", "chunk1"}  # layers 1 and 3 live on pipeline rank 1


@pytest.mark.slow
@pytest.mark.parametrize("tied,layout", [(False, CHAIN[0]), (False, CHAIN[1]), (False, CHAIN[2]),
                                         (True, CHAIN[0]), (True, CHAIN[2])],
                         ids=["untied-tp2pp2", "untied-tp4pp1", "untied-tp1pp2vpp2", "tied-tp2pp2", "tied-tp1pp2vpp2"])
def test_megatron_logits_from_converted_checkpoints_match_hugging_face(tied, layout, megatron_logits,
                                                                       tmp_path_factory):
    """Tied models are checked where the output layer is a stored copy on another stage (TP1 x PP1 at TP4 shares
    the embedding itself, as the untied TP4 case already exercises the TP4 split). The probe at each layout is
    shared with test_megatron_parity (conftest's megatron_logits)."""
    chain = chain_for(tied, tmp_path_factory)
    got = megatron_logits(*layout)["tied" if tied else "untied"]
    with torch.no_grad():
        want = chain["model"](got["ids"]).logits
    diff = (got["logits"] - want).abs().max().item()
    print(f"{layout} {'tied' if chain['tied'] else 'untied'}: max |logit difference| to HF: {diff:.2e}")
    assert diff < 1e-5  # fp32; a wrong split, permutation or padding gives differences of order 1


def test_cli_convert_and_inspect(chain, tmp_path):
    dst = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "toolkit", "convert", str(chain["hf"]), str(dst), "--to", "megatron",
                           "--tp", "2", "--dtype", "bf16"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "verified:" in proc.stderr + proc.stdout and "converting" in proc.stderr + proc.stdout
    shard = load_file(str(dst / "step_00000000" / "model_tp01_pp000.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in shard.values())
    proc = subprocess.run([sys.executable, "-m", "toolkit", "inspect", str(dst), "--json"], capture_output=True,
                          text=True, cwd=REPO)
    report = json.loads(proc.stdout)
    assert report["format"] == "megatron" and report["complete"] and report["layout"]["tp"] == 2
    assert report["parameters"] == sum(p.numel() for p in chain["model"].parameters())


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["truncate", "missing_rank", "metadata"])
def test_broken_megatron_source_is_refused_and_nothing_is_written(chain, damage, tmp_path):
    src = _copy(chain[(2, 2, 1)], tmp_path / "src")
    tag = src / "step_00000000"
    victim = tag / "model_tp01_pp001.safetensors"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
        match = "model_tp01_pp001.safetensors has .* bytes, the manifest says"
    elif damage == "missing_rank":
        victim.unlink()
        match = "model_tp01_pp001.safetensors is missing"
    else:  # the metadata claims another layout than the files hold
        meta = json.loads((tag / "toolkit_meta.json").read_text())
        meta["layout"]["tp"] = 1
        (tag / "toolkit_meta.json").write_text(json.dumps(meta))
        match = "does not match its toolkit_meta.json"
    for to in ("hf", "megatron"):
        with pytest.raises(ToolkitError, match=match):
            convert(src, tmp_path / "out", to, progress=False, log=lambda *_: None)
        assert not (tmp_path / "out").exists()
        assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no partial folder left behind


def test_broken_hf_source_is_refused(chain, tmp_path):
    src = _copy(chain["hf"], tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ToolkitError, match="is truncated"):
        convert(src, tmp_path / "out", "megatron", tp=2, progress=False, log=lambda *_: None)
    config = json.loads((src / "config.json").read_text())
    f.unlink()
    hf_model(False).save_pretrained(src)
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    with pytest.raises(ToolkitError, match="config.json gives"):
        convert(src, tmp_path / "out", "hf", progress=False, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_destination_overlapping_the_source_is_refused(chain, tmp_path):
    src = _copy(chain[(2, 2, 1)], tmp_path / "runs" / "ckpt")
    for dst in (src, src / "sub", tmp_path / "runs"):  # the last one would delete the source on --overwrite
        with pytest.raises(ToolkitError, match="overlaps the source"):
            convert(src, dst, "hf", overwrite=True, progress=False, log=lambda *_: None)
    assert (src / "latest_complete").is_file()


def test_impossible_target_layout_is_refused(chain, tmp_path):
    with pytest.raises(ToolkitError, match="4 layers do not split into pp x vpp = 3 x 1"):
        convert(chain["hf"], tmp_path / "out", "megatron", pp=3, progress=False, log=lambda *_: None)
    with pytest.raises(ToolkitError, match="8 attention heads are not divisible by tp = 3"):
        convert(chain["hf"], tmp_path / "out", "megatron", tp=3, progress=False, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tp2_pp2_training_checkpoint_resumes_at_tp1_pp2(uninterrupted, stopped, tmp_path):
    """Optimizer state (Adam moments, step) moves with the weights: 3 steps at TP2xPP2, convert to TP1xPP2,
    3 more steps there, and the losses continue those of the uninterrupted TP2xPP2 run (both runs shared with
    test_megatron_resume)."""
    straight = [m["loss"] for m in uninterrupted("tiny_tp2_pp2", 6, 4)]
    first = stopped("tiny_tp2_pp2", 6, 3, 4)
    moved = convert(first / "checkpoints", tmp_path / "tp1pp2", "megatron", tp=1, pp=2,
                    progress=False, log=lambda *_: None)
    meta = json.loads((moved / "step_00000003" / "toolkit_meta.json").read_text())
    assert meta["weights_only"] is False and meta["recipe"]["parallel"]["tp"] == 1
    optim = load_file(str(moved / "step_00000003" / "optim_tp00_pp000.safetensors"))
    assert any(k.endswith(":exp_avg_sq") for k in optim)
    proc = launch("tiny_tp2_pp2", ["training.steps=6", *UNINTERRUPTED, "parallel.tp=1", "parallel.world_size=2",
                                   f"checkpoint.resume={moved}"], nproc=2, out_dir=tmp_path / "second")
    assert "resumed from" in proc.stdout
    second = read_metrics(tmp_path / "second")
    assert [m["step"] for m in second] == [4, 5, 6]
    got = [m["loss"] for m in second]
    print("uninterrupted TP2xPP2:", straight[3:], "resumed at TP1xPP2:", got)
    # Only the reduction order differs between TP2 and TP1 (fp32); a lost optimizer state (fresh Adam moments
    # at step 4) moves the loss by ~1e-2 here, a wrong shard far more.
    assert got == pytest.approx(straight[3:], rel=1e-5)


@pytest.mark.slow
def test_distributed_optimizer_training_checkpoint_resumes_after_a_convert(uninterrupted, stopped, tmp_path):
    """The distributed optimizer's state in the Megatron backend's default format (Megatron's own distopt_*.pt flat
    buffers) moves with the weights: 2 steps at DP2 with the distributed optimizer, convert (read by parameter name,
    toolkit/checkpoint/megatron_flat.py), 2 more steps with the plain optimizer from the by-name state, and the
    losses continue those of the uninterrupted distributed-optimizer run. Resuming it with the distributed optimizer
    is refused in one line that names the saved layout (zero_stage=0)."""
    straight = [m["loss"] for m in uninterrupted("tiny_dp2_distopt", 4, 2)]
    first = stopped("tiny_dp2_distopt", 4, 2, 2)
    moved = convert(first / "checkpoints", tmp_path / "moved", "megatron", progress=False, log=lambda *_: None)
    optim = load_file(str(moved / "step_00000002" / "optim_tp00_pp000.safetensors"))
    assert any(k.endswith(":exp_avg_sq") for k in optim)
    again = ["training.steps=4", *UNINTERRUPTED, f"checkpoint.resume={moved}"]
    refused = launch("tiny_dp2_distopt", again, nproc=2, out_dir=tmp_path / "refused", check=False)
    assert refused.returncode != 0 and "was written with" in refused.stderr and "zero_stage=0" in refused.stderr
    assert not (tmp_path / "refused").exists()  # a refused resume leaves no run folder (it left TensorBoard's)
    proc = launch("tiny_dp2_distopt", [*again, "parallel.zero_stage=0"], nproc=2, out_dir=tmp_path / "second")
    assert "resumed from" in proc.stdout
    second = read_metrics(tmp_path / "second")
    assert [m["step"] for m in second] == [3, 4]
    got = [m["loss"] for m in second]
    print("uninterrupted DP2 distributed optimizer:", straight[2:], "resumed with the plain optimizer:", got)
    # a lost optimizer state (fresh Adam moments at step 3) moves the loss by ~1e-2 here
    assert got == pytest.approx(straight[2:], rel=1e-5)
    # the plain optimizer's files hold whole states per (tp, pp): they resume at another dp with no convert (this
    # was refused, with a convert to the same layout as the advice)
    proc = launch("tiny_dp2_distopt", [*again, "parallel.zero_stage=0", "parallel.world_size=1"], nproc=1,
                  out_dir=tmp_path / "dp1")
    assert "resumed from" in proc.stdout and "dp=1" in proc.stdout
    alone = [m["loss"] for m in read_metrics(tmp_path / "dp1")]
    print("resumed with the plain optimizer at DP1:", alone)
    assert alone == pytest.approx(straight[2:], rel=1e-5)


PADDED = ["model.vocab_size=600", "parallel.megatron.make_vocab_size_divisible_by=64", *UNINTERRUPTED]
"""A vocabulary of 600 padded by 64 x tp: 640 rows at TP1, TP2 and (by 32) TP4, 768 at TP4 by 64. The 40 padding
rows are trained: their logits are in Megatron's softmax."""


@pytest.fixture(scope="module")
def padded_runs(tmp_path_factory) -> tuple[list[float], Path]:
    """(the losses of 6 uninterrupted TP2 x PP2 steps, the checkpoints folder of the same run stopped at step 3 and
    saved as torch_dist)."""
    root = tmp_path_factory.mktemp("padded")
    launch("tiny_tp2_pp2", ["training.steps=6", *PADDED], nproc=4, out_dir=root / "straight")
    launch("tiny_tp2_pp2", ["training.steps=6", "training.stop_at_step=3", "checkpoint.format=torch_dist", *PADDED],
           nproc=4, out_dir=root / "first")
    return [m["loss"] for m in read_metrics(root / "straight")], root / "first" / "checkpoints"


@pytest.mark.slow
def test_trained_padding_rows_survive_a_relayout_so_the_loss_continues(padded_runs, tmp_path):
    """640 rows at TP2 and at TP1: a convert to TP1 keeps the 40 trained padding rows (and their Adam moments), so
    the loss continues the uninterrupted TP2 run's. Reset to zero, as convert did before, they moved the first
    resumed loss from 5.697 to 5.723 here."""
    straight, first = padded_runs
    moved = convert(first, tmp_path / "tp1pp2", "megatron", tp=1, pp=2, progress=False, log=lambda *_: None)
    launch("tiny_tp2_pp2", ["training.steps=6", *PADDED, "parallel.tp=1", "parallel.world_size=2",
                            f"checkpoint.resume={moved}"], nproc=2, out_dir=tmp_path / "second")
    got = [m["loss"] for m in read_metrics(tmp_path / "second")]
    print("uninterrupted TP2xPP2:", straight[3:], "resumed at TP1xPP2:", got)
    assert len(got) == 3 and got == pytest.approx(straight[3:], rel=1e-5)


@pytest.mark.slow
def test_a_resume_that_would_change_the_padding_is_refused_and_the_named_divisor_continues(padded_runs, tmp_path):
    """Megatron-Core's torch_dist load takes 640 saved rows into 768 without a word (the loss at the first resumed
    step went from 5.960 to 6.152 in a run like this one): the resume at TP4 is refused in one line naming the
    divisor that keeps 640 rows, and with it the run continues the uninterrupted losses."""
    straight, first = padded_runs
    at_tp4 = ["training.steps=6", *PADDED, "parallel.tp=4", "parallel.pp=1", f"checkpoint.resume={first}"]
    refused = launch("tiny_tp2_pp2", at_tp4, nproc=4, out_dir=tmp_path / "refused", check=False)
    assert refused.returncode != 0
    # no rank aborted in the teardown after its line (recipes/train.py _leave)
    assert "SIGABRT" not in refused.stderr and "terminate called" not in refused.stderr + refused.stdout
    assert ("pads the vocabulary (600) to 640 rows (64 x tp=2); this run pads it to 768 (64 x tp=4), and Megatron "
            "trains the padding rows, so this run would resume another model: set "
            "parallel.megatron.make_vocab_size_divisible_by: 32 (which pads it to 640 rows at tp=4)") in refused.stderr
    assert not (tmp_path / "refused").exists()
    # convert's --make-vocab-size-divisible-by writes the same: 640 rows at TP4, and a recipe that resumes so
    moved = convert(first, tmp_path / "tp4", "megatron", tp=4, divisible_by=32, progress=False, log=lambda *_: None)
    meta = json.loads(next(moved.glob("step_*/toolkit_meta.json")).read_text())
    recipe = meta["recipe"]["parallel"]["megatron"]
    assert meta["make_vocab_size_divisible_by"] == recipe["make_vocab_size_divisible_by"] == 32
    assert load_file(str(next(moved.glob("step_*/model_tp00_pp000.safetensors"))))[
        "chunk0.embedding.word_embeddings.weight"].shape[0] == 160  # 640 / 4
    launch("tiny_tp2_pp2", [*at_tp4, "parallel.megatron.make_vocab_size_divisible_by=32"], nproc=4,
           out_dir=tmp_path / "run")
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    print("uninterrupted TP2xPP2:", straight[3:], "resumed at TP4 by 32:", got)
    assert len(got) == 3 and got == pytest.approx(straight[3:], rel=1e-5)
