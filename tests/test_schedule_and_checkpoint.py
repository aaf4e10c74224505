"""The LR schedule's shape, and how checkpoints are chosen for resume and pruned."""
from __future__ import annotations

import json
import math

import pytest

from toolkit.errors import ToolkitError
from toolkit.train import checkpoint as ckpt
from toolkit.train.schedule import lr_multiplier


def test_warmup_then_cosine_to_min_lr_at_the_last_step():
    f = [lr_multiplier(s, warmup=4, total=14, decay="cosine", min_ratio=0.1) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]       # step 0 already trains; peak at the end of warm-up
    assert f[4] == 1.0 and math.isclose(f[-1], 0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert math.isclose(f[9], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))


def test_linear_and_constant():
    assert math.isclose(lr_multiplier(9, 0, 10, "linear", 0.0), 0.0)
    assert math.isclose(lr_multiplier(5, 0, 11, "linear", 0.0), 0.5)
    assert lr_multiplier(99, 10, 100, "constant", 0.0) == 1.0


def _fake_ckpt(root, step, complete=True):
    d = root / ckpt.tag_for(step)
    d.mkdir(parents=True)
    (d / ckpt.STARTED).write_text(json.dumps({"step": step}))  # a save writes it first
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (d / ckpt.META).write_text(json.dumps({"step": step, "layout": {"world_size": 2, "zero_stage": 3},
                                               "files": {"mp_rank_00_model_states.pt": 1}}))
    return d


def test_resume_skips_incomplete_checkpoints_and_stale_pointers(tmp_path):
    _fake_ckpt(tmp_path, 10)
    _fake_ckpt(tmp_path, 20)
    _fake_ckpt(tmp_path, 30, complete=False)  # a crash mid-save
    assert ckpt.find_resume(tmp_path, "auto") == tmp_path / "step_00000020"
    (tmp_path / ckpt.POINTER).write_text("step_00000030")  # even a pointer to it is not trusted
    assert ckpt.find_resume(tmp_path, "auto") == tmp_path / "step_00000020"
    # an earlier run's complete checkpoints past where this run starts: refused, not mixed (a run with never saved
    # over them and pruned them, and auto then resumed the earlier run's newest, until 2026-12-07)
    with pytest.raises(ToolkitError, match=r"holds 2 complete checkpoint\(s\) of an earlier run past the step this run "
                                           r"starts from, scratch \(checkpoint.resume: never\): step_00000010, "
                                           r"step_00000020; .* Use another output_dir"):
        ckpt.find_resume(tmp_path, "never")
    with pytest.raises(ToolkitError, match=r"past the step this run starts from, step 10 .*: step_00000020;"):
        ckpt.find_resume(tmp_path, str(tmp_path / "step_00000010"))
    assert ckpt.find_resume(tmp_path, str(tmp_path / "step_00000020")) == tmp_path / "step_00000020"  # the newest
    assert ckpt.find_resume(tmp_path / "elsewhere", "never") is None  # an unused folder starts fresh
    assert ckpt.find_resume(tmp_path / "elsewhere", str(tmp_path / "step_00000010")) == tmp_path / "step_00000010"
    with pytest.raises(ToolkitError, match="neither a complete checkpoint"):
        ckpt.find_resume(tmp_path, str(tmp_path / "step_00000030"))


def test_fresh_directory_starts_from_scratch(tmp_path):
    assert ckpt.find_resume(tmp_path / "none", "auto") is None


def test_prune_keeps_the_newest_complete_and_removes_crash_debris(tmp_path):
    for s in (10, 20, 30):
        _fake_ckpt(tmp_path, s)
    _fake_ckpt(tmp_path, 25, complete=False)
    _fake_ckpt(tmp_path, 40, complete=False)  # possibly being written right now: newer than the newest complete
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020", "step_00000030", "step_00000040"]


def test_resume_on_another_layout_is_refused_before_loading(tmp_path):
    d = _fake_ckpt(tmp_path, 10)
    with pytest.raises(ToolkitError, match="written with world_size=2, zero_stage=3, this run has dp=4, "
                                           "world_size=4, zero_stage=3"):
        ckpt.load(backend=None, tag_dir=d, layout_meta={"world_size": 4, "zero_stage": 3, "dp": 4})
    # another stage: `toolkit convert --to deepspeed` moves dp only, so the line must not send the user there
    with pytest.raises(ToolkitError, match=r"written at ZeRO stage 3, this run has stage 2: a ZeRO checkpoint resumes "
                                           r"at its own stage .* relaunch with parallel.zero_stage: 3") as e:
        ckpt.load(backend=None, tag_dir=d, layout_meta={"world_size": 2, "zero_stage": 2, "dp": 2})
    assert "--to deepspeed" not in str(e.value)


@pytest.mark.parametrize("saved, running", [("deepspeed", "megatron"), ("megatron", "deepspeed")])
def test_a_checkpoint_of_the_other_backend_is_refused_as_such(tmp_path, saved, running):
    """A Megatron run in the folder of a single-process DeepSpeed run (docs/sft.md's commands in order, trial K,
    2026-12-08) read the DeepSpeed checkpoint as Megatron files: "model_tp00_pp000.safetensors is missing: ... not
    written by this layout or is incomplete"; at TP2 it suggested a convert whose output cannot resume."""
    d = _fake_ckpt(tmp_path, 60)
    single = {"world_size": 1, "zero_stage": 0, "dp": 1}
    meta = json.loads((d / ckpt.META).read_text())
    (d / ckpt.META).write_text(json.dumps({**meta, "backend": saved, "layout": single}))
    layout = {**single, "tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1} if running == "megatron" else single
    with pytest.raises(ToolkitError, match=f"written by the {saved} backend and this run uses {running}: a run "
                                           f"resumes its own backend's checkpoints only; relaunch with "
                                           f"parallel.backend: {saved}, or start fresh in another output_dir"):
        ckpt.load(backend=None, tag_dir=d, layout_meta=layout)


def test_resume_skips_a_checkpoint_whose_files_no_longer_match_its_manifest(tmp_path):
    for step in (10, 20):
        d = _fake_ckpt(tmp_path, step)
        meta = json.loads((d / ckpt.META).read_text())
        meta["files"] = {"mp_rank_00_model_states.pt": 1}
        (d / ckpt.META).write_text(json.dumps(meta))
    (tmp_path / "step_00000020" / "mp_rank_00_model_states.pt").write_bytes(b"")  # truncated after the save
    (tmp_path / ckpt.POINTER).write_text("step_00000020")
    assert ckpt.verify_manifest(tmp_path / "step_00000020") == ["mp_rank_00_model_states.pt has 0 bytes, the "
                                                                "manifest says 1"]
    assert ckpt.find_resume(tmp_path, "auto") == tmp_path / "step_00000010"
    with pytest.raises(ToolkitError, match="does not match its manifest"):
        ckpt.find_resume(tmp_path, str(tmp_path / "step_00000020"))


def test_a_resume_with_other_data_or_schedule_says_so_in_one_line():
    """The saved data position and schedule step carry over whatever the recipe now says. A resume on other data
    (or, with a data.blend, other training.steps, which reorders it) went on without a word (a trial of
    2026-12-07). stop_at_step, the loader's workers and the logging do not change what is trained: no line."""
    from toolkit.recipe import load_recipe
    from toolkit.run import resume_notes

    saved = load_recipe("tiny_zero0", ["training.steps=6"]).model_dump(mode="json")
    same = load_recipe("tiny_zero0", ["training.steps=6", "training.stop_at_step=3", "data.num_workers=2",
                                      "logging.interval=1"])
    assert resume_notes(saved, same) == [] and resume_notes(None, same) == []
    other = load_recipe("tiny_zero0", ["training.steps=10", "data.paths=[other.jsonl]"])
    (line,) = resume_notes(saved, other)
    assert line.startswith("[toolkit] note: this run's recipe differs from the checkpoint's in data.paths "
                           "['recipes/data/demo_corpus/train.jsonl'] -> ['other.jsonl']; training.steps 6 -> 10: ")
