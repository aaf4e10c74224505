"""The demo path end to end: the `deepspeed` launcher, a loss that falls, a checkpoint, TensorBoard, a sample."""
from __future__ import annotations

import pytest

from conftest import launch, read_metrics


@pytest.mark.slow
def test_deepspeed_launcher_trains_zero3_and_checkpoints(tmp_path):
    out = tmp_path / "demo"
    proc = launch("tiny_zero3", ["training.steps=40", "training.schedule.warmup_steps=10", "checkpoint.interval=20",
                                 "logging.sample_tokens=8"], nproc=2, out_dir=out, launcher="deepspeed")
    losses = [m["loss"] for m in read_metrics(out)]
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 2.0, f"loss should fall clearly: {losses}"
    records = read_metrics(out)
    assert all(m["grad_norm"] > 0 and m["tokens_per_s"] > 0 and m["mfu"] is None for m in records)  # no CPU peak
    assert (out / "checkpoints" / "latest_complete").read_text() == "step_00000040"
    assert {p.name for p in (out / "checkpoints").glob("step_*")} == {"step_00000020", "step_00000040"}
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "[toolkit] sample: 'Once upon a time" in proc.stdout


@pytest.mark.slow
def test_plain_python_is_a_world_of_one(tmp_path):
    out = tmp_path / "single"
    proc = launch("tiny_zero1", ["training.steps=2", "logging.interval=1", "training.schedule.warmup_steps=1"],
                  nproc=1, out_dir=out, launcher="python")
    assert "deepspeed on 1 ranks" in proc.stdout
    assert "training.grad_accum_steps = global 16 / (micro 8 x dp 1) = 2 (derived)" in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
