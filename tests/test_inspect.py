"""`toolkit inspect` on the checkpoints the toolkit reads and writes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, launch
from toolkit.checkpoint.inspect import inspect
from toolkit.checkpoint.sources import open_source
from toolkit.errors import ToolkitError


def test_hugging_face_folder(tiny_hf_checkpoint):
    report = inspect(tiny_hf_checkpoint)
    assert report["format"] == "hf" and report["complete"]
    assert report["architecture"]["num_key_value_heads"] == 2 and report["architecture"]["num_hidden_layers"] == 2
    from toolkit.recipe import load_recipe
    from toolkit.metrics import count_params

    # the header count equals the architecture's parameter arithmetic
    assert report["parameters"] == count_params(load_recipe("tiny_zero0", ["model.preset=tiny"]).model)["total"]
    assert report["dtypes"] == {"F32": report["parameters"]}


@pytest.mark.parametrize("config,shown", [
    ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_local_experts": 8},
     {"num_experts": 8}),  # Mixtral's key, named as the Megatron formats' reports name it
    ({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_experts": 4, "head_dim": 32},
     {"num_experts": 4, "head_dim": 32}),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "num_experts": None},
     {}),  # the default head size and a null field: nothing to show
    # RoPE and the norm's epsilon (not shown until 2026-12-07), from either spelling of RoPE
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}},
     {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 10000.0,
      "rope_scaling": {"type": "linear", "factor": 2.0}},
     {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    ({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "sliding_window": 4096,
      "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
     {"sliding_window": 4096, "rope_theta": 1e6}),  # an active window; plain RoPE has no scaling to show
    ({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "sliding_window": 4096,
      "use_sliding_window": False}, {}),  # Qwen's window size that is off
])
def test_architecture_names_experts_and_head_size_one_way(config, shown):
    from toolkit.checkpoint.inspect import _hf_architecture

    got = _hf_architecture(config)
    assert got == {"model_type": config["model_type"], "hidden_size": 64, "num_attention_heads": 4, **shown}


@pytest.mark.slow
def test_training_checkpoint_and_damage(tmp_path):
    out = tmp_path / "run"
    launch("tiny_zero2", ["training.steps=2", "training.schedule.warmup_steps=1", "checkpoint.interval=1"], nproc=2,
           out_dir=out)
    root = out / "checkpoints"
    report = inspect(root)
    assert report["format"] == "deepspeed" and report["complete"] and report["step"] == 2
    assert report["layout"] == {"world_size": 2, "zero_stage": 2, "dp": 2}
    # DeepSpeed's own files say the dtypes, and the model is named by the Hugging Face config's keys, as in every other
    # format (no dtypes, and the recipe's own keys with MoE defaults on a dense Llama, until 2026-12-07)
    assert report["dtypes"] == {"F32 (model weights are the masters)": report["parameters"]}
    assert report["architecture"]["num_hidden_layers"] == 4 and report["architecture"]["model_type"] == "llama"
    assert not {"num_layers", "family", "norm_topk_prob", "router_aux_loss_coef"} & set(report["architecture"])
    assert report["checkpoints"] == {"step_00000001": "complete", "step_00000002": "complete"}
    # doctor's and the Slurm signal note's estimate of one save, against DeepSpeed's own files: ZeRO-2 keeps an fp32
    # copy of the weights even in fp32 training (the estimate was 25% low until 2026-12-07)
    from toolkit.metrics import checkpoint_bytes
    from toolkit.recipe import load_recipe

    on_disk = sum(f.stat().st_size for f in (root / "step_00000002").rglob("*") if f.is_file())
    estimate = checkpoint_bytes(load_recipe("tiny_zero2"))
    assert abs(on_disk - estimate) < 0.03 * on_disk, (on_disk, estimate)
    victim = next((root / "step_00000002").glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:100])  # truncated, as by a full disk
    proc = subprocess.run([sys.executable, "-m", "toolkit", "inspect", str(root / "step_00000002"), "--json"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1
    damaged = json.loads(proc.stdout)
    assert not damaged["complete"] and f"{victim.name} has 100 bytes" in damaged["problems"][0]
    older = inspect(root)
    assert older["step"] == 1  # the directory's latest intact checkpoint is the older one
    # the report is the directory's, with the step shown named and why convert refuses it (until 2026-12-07 the
    # headline named step 1 as INCOMPLETE, with step 2's problem under it)
    assert older["path"] == str(root) and older["shown"] == "step_00000001" and not older["complete"]
    # its bytes are the step's, said so, with the directory's beside them (the step's were the folder's until then)
    step_bytes = sum(f.stat().st_size for f in (root / "step_00000001").rglob("*") if f.is_file())
    all_bytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    assert older["bytes"] == step_bytes and older["directory_bytes"] == all_bytes > step_bytes
    from toolkit.checkpoint.inspect import render

    assert f"bytes on disk: {step_bytes:,} (step_00000001; the directory holds {all_bytes:,})" in render(older)
    assert any("convert reads step_00000002, the step latest_complete names" in p and
               str(root / "step_00000001") in p for p in older["problems"]), older["problems"]
    (root / "latest_complete").unlink()  # convert of the directory names the complete step to pass (it listed formats)
    with pytest.raises(ToolkitError, match=f"holds step_\\* folders but no latest_complete naming the newest complete "
                                           f"one: pass that folder itself, e.g. {root / 'step_00000001'}"):
        open_source(root)


def test_a_directory_whose_only_save_was_killed_is_reported_incomplete_not_refused(tmp_path, capsys):
    """A run killed during its first save leaves step_00000002/ with only toolkit_started.json: inspect exited 2
    with an error (not 1 with its report), called the step folder "unknown", and convert listed every format."""
    from toolkit import cli

    run = tmp_path / "checkpoints"
    (run / "step_00000002").mkdir(parents=True)
    (run / "step_00000002" / "toolkit_started.json").write_text("{}")
    capsys.readouterr()
    assert cli.main(["inspect", str(run)]) == 1
    out = capsys.readouterr().out
    assert "toolkit checkpoint, INCOMPLETE" in out and "step_00000002: incomplete: toolkit_meta.json is missing" in out
    assert inspect(run / "step_00000002")["format"] == "toolkit"
    assert cli.main(["convert", str(run), str(tmp_path / "out"), "--to", "hf"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {run} holds no complete toolkit checkpoint: its newest, step_00000002, is incomplete "
        f"(toolkit_meta.json is missing: the save never completed); resume the run to write a complete one, or see "
        f"`toolkit inspect {run}`")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ToolkitError, match="is not a checkpoint this toolkit reads"):
        inspect(tmp_path)


def test_a_step_folder_pruned_while_inspect_reads_it_is_left_out(tmp_path, monkeypatch):
    """A running save prunes old step folders: one that vanished between the listing and its manifest check raised a
    FileNotFoundError traceback in `inspect` (a trial of 2026-12-07). It is left out of the report."""
    import shutil

    from toolkit.checkpoint import inspect as inspect_module
    from toolkit.format import manifest

    for step in (1, 2):
        tag = tmp_path / f"step_{step:08d}"
        tag.mkdir()
        (tag / "weights.bin").write_bytes(bytes(64))
        (tag / "toolkit_meta.json").write_text(json.dumps({"schema_version": manifest.SCHEMA_VERSION, "step": step,
                                                           "files": manifest.entries([tag / "weights.bin"])}))
    real = manifest.verify

    def pruned_meanwhile(tag_dir, *args, **kwargs):
        if tag_dir.name == "step_00000001":
            shutil.rmtree(tag_dir)
            (tag_dir / "weights.bin").stat()  # what the check's own reads then meet
        return real(tag_dir, *args, **kwargs)

    monkeypatch.setattr(inspect_module.manifest, "verify", pruned_meanwhile)
    report = inspect_module.inspect_root(tmp_path)
    assert report["checkpoints"] == {"step_00000002": "complete"}


def test_bytes_on_disk_count_no_link_target_and_a_killed_conversion_is_named(tiny_hf_checkpoint, tmp_path):
    """Until 2026-12-07 a symbolic link in the folder added its target's size (a 1 GiB file elsewhere made the
    checkpoint 1 GiB bigger), and a `.DST.partial-PID` that a killed conversion left was named only by the next
    conversion."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_checkpoint, folder)
    own = inspect(folder)["bytes"]
    assert own == sum(p.stat().st_size for p in folder.iterdir())
    (tmp_path / "big.bin").write_bytes(b"\0" * 2**20)
    (folder / "notes.bin").symlink_to(tmp_path / "big.bin")
    assert inspect(folder)["bytes"] == own
    gone = 4194999  # above Linux's largest pid_max: no process has it
    (tmp_path / f".out.partial-{gone}").mkdir()
    with pytest.raises(ToolkitError, match=rf"out does not exist; {tmp_path}/\.out\.partial-{gone} \(0 bytes\) is "
                                           "the unfinished output of a conversion to"):
        inspect(tmp_path / "out")
    shutil.copytree(tiny_hf_checkpoint, tmp_path / "out")
    report = inspect(tmp_path / "out")
    assert report["complete"] and len(report["left_behind"]) == 1 and f"process {gone}" in report["left_behind"][0]
