"""Exact resume: N steps in one go equal N/2 steps, a restart from the checkpoint, and N/2 more."""
from __future__ import annotations

import json

import pytest

from conftest import UNINTERRUPTED, launch, read_metrics
from reference import assert_blend_val_loss

STEPS = 8
COMMON = [f"training.steps={STEPS}", "training.schedule.warmup_steps=2", "logging.interval=1",
          "checkpoint.interval=1000"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["blend", "tiny_zero3"])
def test_resume_reproduces_uninterrupted_run(recipe, uninterrupted, tmp_path, request):
    if recipe == "blend":  # ZeRO-2 (tiny_zero2) on the tiny model, reading a 0.7/0.3 data.blend of prepared data
        recipe = request.getfixturevalue("prepared_blend")["recipe"]
    straight = uninterrupted(recipe, STEPS)

    launch(recipe, [*COMMON, "training.stop_at_step=4"], nproc=2, out_dir=tmp_path / "split")
    ckpt = tmp_path / "split" / "checkpoints"
    assert (ckpt / "latest_complete").read_text() == "step_00000004"
    meta = json.loads((ckpt / "step_00000004" / "toolkit_meta.json").read_text())
    assert meta["step"] == 4 and meta["layout"]["world_size"] == 2
    proc = launch(recipe, COMMON, nproc=2, out_dir=tmp_path / "split")
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert ("from a blend of 2 prepared datasets" in proc.stdout) == recipe.endswith("_blend.yaml")
    split = read_metrics(tmp_path / "split")

    assert [m["step"] for m in split] == list(range(1, STEPS + 1))
    assert [m.get("resumed_from") for m in split] == [None] * 4 + [4] + [None] * (STEPS - 5)  # the launch's first
    # bit-identical on CPU: same layout, same data position, same RNG, optimizer and scheduler state
    assert [m["loss"] for m in split] == [m["loss"] for m in straight]
    assert [m["lr"] for m in split] == [m["lr"] for m in straight]
    if recipe.endswith("_blend.yaml"):  # eval.split 0.1 of each source's documents, one global batch every 4 steps
        assert "eval: every 4 steps and at the end, 16 of 16 held-out sequences (eval.split 0.1)" in proc.stdout
        assert_blend_val_loss(recipe, tmp_path / "split", COMMON, split, straight, [4, 8])


@pytest.mark.slow
def test_a_resume_at_another_micro_batch_size_continues_the_same_data(uninterrupted, stopped, tmp_path):
    """The same global batch as micro 4 x 2 accumulation instead of micro 8: the saved data position counts micro-
    batches of 8. It was read as micro-batches of 4 (half as many sequences), so the run trained again on what it
    had seen (a trial of 2026-12-07: step 5's loss 5.76 against 5.86)."""
    import shutil

    straight = uninterrupted("tiny_zero3", STEPS)
    shutil.copytree(stopped("tiny_zero3", STEPS, 4), tmp_path / "split")
    launch("tiny_zero3", [f"training.steps={STEPS}", *UNINTERRUPTED, "training.micro_batch_size=4"], nproc=2,
           out_dir=tmp_path / "split")
    split = read_metrics(tmp_path / "split")
    assert [m["step"] for m in split] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in split[:4]] == [m["loss"] for m in straight[:4]]  # the first launch's records
    for a, b in zip(split[4:], straight[4:]):  # the same sequences, their gradients summed in another order
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])


def test_a_resumed_launch_marks_its_first_record_and_purges_tensorboards_later_steps(tmp_path):
    """A launch killed after its checkpoint of step 3 had logged steps 4-5; the rerun logs them again. metrics.jsonl
    keeps both launches' records, the rerun's first marked resumed_from=3 (so the last record of a step is the run's);
    TensorBoard keeps only the rerun's steps 4-5 (purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from toolkit.metrics import RunLog

    def record(step: int, loss: float) -> dict:
        return {"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 1.0, "tflops_per_rank": 1.0}

    killed = RunLog(str(tmp_path), enabled=True, tensorboard=True)
    for step in range(1, 6):
        killed.step(record(step, 10.0 + step))
    killed.close()
    rerun = RunLog(str(tmp_path), enabled=True, tensorboard=True)
    rerun.resumed(3)
    for step in (4, 5):
        rerun.step(record(step, 20.0 + step))
    rerun.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("resumed_from")) for m in lines] == [(1, None), (2, None), (3, None), (4, None),
                                                                   (5, None), (4, 3), (5, None)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (3, 13.0),
                                                                          (4, 24.0), (5, 25.0)]
    assert "train/resumed_from" not in events.Tags()["scalars"]
