"""The Megatron backend end to end on CPU: trains, checkpoints per rank, and resumes exactly."""
from __future__ import annotations

import json

import pytest

from conftest import launch, read_metrics

COMMON = ["training.steps=6", "training.schedule.warmup_steps=2", "logging.interval=1", "checkpoint.interval=1000"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,nproc", [("tiny_tp2_pp2", 4), ("tiny_dp2_distopt", 2)])
def test_resume_reproduces_uninterrupted_run(recipe, nproc, tmp_path):
    launch(recipe, COMMON, nproc=nproc, out_dir=tmp_path / "straight")
    straight = read_metrics(tmp_path / "straight")
    launch(recipe, [*COMMON, "training.stop_at_step=3"], nproc=nproc, out_dir=tmp_path / "split")
    tag = tmp_path / "split" / "checkpoints" / "step_00000003"
    meta = json.loads((tag / "toolkit_meta.json").read_text())
    assert meta["backend"] == "megatron" and meta["layout"]["world_size"] == nproc
    proc = launch(recipe, COMMON, nproc=nproc, out_dir=tmp_path / "split")
    assert "resumed from" in proc.stdout
    split = read_metrics(tmp_path / "split")
    assert [m["step"] for m in split] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in split] == [m["loss"] for m in straight]  # bit-identical on CPU


@pytest.mark.slow
def test_tp2_pp2_trains_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    launch("tiny_tp2_pp2", ["training.steps=30", "training.schedule.warmup_steps=5", "checkpoint.interval=15"],
           nproc=4, out_dir=out)
    losses = [m["loss"] for m in read_metrics(out)]
    assert losses[-1] < losses[0] - 1.0, losses
    files = sorted(p.name for p in (out / "checkpoints" / "step_00000030").iterdir())
    assert files == ["model_tp00_pp000.pt", "model_tp00_pp001.pt", "model_tp01_pp000.pt", "model_tp01_pp001.pt",
                     "toolkit_meta.json", *[f"toolkit_rank{r:05d}.pt" for r in range(4)]]


def test_resume_on_another_layout_is_refused(tmp_path):
    """A checkpoint written at TP2 is not silently loaded into a PP2 run (conversion is `toolkit convert`'s job)."""
    launch("tiny_tp2", ["training.steps=1", "training.schedule.warmup_steps=1"], nproc=2, out_dir=tmp_path / "run")
    proc = launch("tiny_pp2", ["training.steps=2", "training.schedule.warmup_steps=1"], nproc=2,
                  out_dir=tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert "was written with" in proc.stderr and "pp=1" in proc.stderr and "pp=2" in proc.stderr
