"""A checkpoint directory holding step_* entries the toolkit did not write: training refuses to start (one line,
on every rank, nothing written), and neither a save nor a prune ever writes into or deletes such an entry, even
when one appears during the run. The toolkit's own debris (a crashed save: its marker, written first, or an
empty folder) is still cleared."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import run_ranks
from test_checkpoint_integrity import StandIn

from toolkit.errors import ToolkitError
from toolkit.format import names
from toolkit.train import checkpoint as ckpt


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / '.store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(root: Path, step: int) -> Path:
    return ckpt.save(StandIn(bytes([step]) * 4096), root, step, {"consumed_micro_batches": step},
                     {"layout": {"dp": 1}, "backend": "x"})


def snapshot(folder: Path) -> dict:
    """Every entry under `folder` (links not followed): kind, size, mtime and bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file"
        data = os.readlink(p) if kind == "link" else p.read_bytes() if kind == "file" else None
        out[str(p.relative_to(folder))] = (kind, st.st_size if kind == "file" else None, st.st_mtime_ns, data)
    return out


def _plant_user_folder(root: Path, name: str = "step_00000001") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "my_notes.txt").write_text("the user's own file, not a checkpoint\n")
    return folder


def _message(root: Path, entry: str, more: str = "", why: str = "no toolkit_meta.json or toolkit_started.json in "
             "it") -> str:
    return (f"checkpoint.dir {root} holds {entry}{more}, which the toolkit did not write ({why}); move it out of "
            f"{root} or choose another checkpoint.dir. Nothing in {root} was written or deleted")


def test_training_refuses_a_checkpoint_dir_holding_a_foreign_step_folder(tmp_path):
    """The reported loss: a user's step_00000001/ in checkpoint.dir, then a run with keep: 1 saving every step.
    The run refuses to start; the folder survives byte for byte and nothing is added beside it."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    _plant_user_folder(root)
    before = snapshot(out)
    sets = [f"output_dir={out}", "parallel.world_size=1", "model.preset=tiny", "training.steps=3",
            "checkpoint.interval=1", "checkpoint.keep=1", "training.schedule.warmup_steps=0",
            "logging.sample_prompt="]
    proc = run_ranks(["recipes/train.py", "--recipe", "tiny_zero1", *[a for s in sets for a in ("--set", s)]], 1,
                     dict(os.environ), "python")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"error: {_message(root, 'step_00000001')}"], proc.stderr[-3000:]
    assert snapshot(out) == before  # refused before the run folder, its log or TensorBoard file were made


@pytest.mark.parametrize("plant", ["folder", "link", "file", "other_name"])
def test_every_kind_of_foreign_entry_is_refused_before_anything_is_written(world_of_one, tmp_path, plant):
    root = tmp_path / "ckpt"
    _save(root, 1)
    _save(root, 2)
    elsewhere = _save(tmp_path / "elsewhere", 5)  # a complete toolkit checkpoint, but outside checkpoint.dir
    entry = {"folder": "step_00000003", "link": "step_00000005", "file": "step_00000004",
             "other_name": "step_00000002.backup"}[plant]
    if plant == "folder":
        _plant_user_folder(root, entry)
    elif plant == "link":  # saving would write through it, pruning would fail on it
        (root / entry).symlink_to(elsewhere, target_is_directory=True)
    elif plant == "file":
        (root / entry).write_text("not a folder")
    else:  # the user's copy of a checkpoint, meta file and all: pruning must not take it for one of its own
        _plant_user_folder(root, entry)
        (root / entry / "toolkit_meta.json").write_bytes((root / "step_00000002" / "toolkit_meta.json").read_bytes())
    before, outside = snapshot(root), snapshot(tmp_path / "elsewhere")
    for resume in ("auto", "never"):
        with pytest.raises(ToolkitError) as err:
            ckpt.find_resume(root, resume)
        # a link is named as one (it was "no toolkit_meta.json ... in it", which its target holds: trial K)
        assert str(err.value) == (_message(root, entry, why="a link: a run writes its step folders itself, never "
                                           "through a link") if plant == "link" else _message(root, entry))
    assert snapshot(root) == before and snapshot(tmp_path / "elsewhere") == outside


@pytest.mark.parametrize("name", names.ROOT_FILES)
def test_a_users_pointer_or_script_in_a_folder_without_checkpoints_is_refused(world_of_one, tmp_path, name):
    """A save writes `latest_complete`, DeepSpeed's `latest` and its zero_to_fp32.py beside the step folders: a
    user's own files of those names were replaced (a trial of 2026-12-07). In a folder holding none of the toolkit's
    checkpoints they are the user's."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / name).write_text("the user's own\n")
    before = snapshot(root)
    for resume in ("auto", "never"):
        with pytest.raises(ToolkitError) as err:
            ckpt.find_resume(root, resume)
        assert str(err.value) == (f"checkpoint.dir {root} holds {name}, which the toolkit did not write (a name a run "
                                  "writes beside its checkpoints, in a folder holding none of the toolkit's); move it "
                                  f"out of {root} or choose another checkpoint.dir. Nothing in {root} was written or "
                                  "deleted")
    assert snapshot(root) == before
    (root / name).unlink()
    _save(root, 1)  # beside the toolkit's own checkpoints they are the toolkit's: resumed as before
    assert ckpt.find_resume(root, "auto") == root / "step_00000001"


def test_a_foreign_folder_appearing_during_the_run_is_never_written_nor_pruned(world_of_one, tmp_path):
    root = tmp_path / "ckpt"
    assert ckpt.find_resume(root, "auto") is None
    _save(root, 1)
    user = _plant_user_folder(root, "step_00000002")  # at the step the run saves next
    older = _plant_user_folder(root, "step_00000000")  # older than every checkpoint: prune's debris rule
    backup = root / "step_00000001.bak"  # the user's copy of a checkpoint, meta file and manifest included
    shutil.copytree(root / "step_00000001", backup)
    before = snapshot(user), snapshot(older), snapshot(backup)
    with pytest.raises(ToolkitError) as err:
        _save(root, 2)
    assert str(err.value) == (f"checkpoint.dir {root} holds step_00000002, which the toolkit did not write; move it "
                              f"out of {root} or choose another checkpoint.dir. Nothing in {root} was written or "
                              "deleted")
    for step in (3, 4, 5):  # several saves, each pruned to keep: 1
        _save(root, step)
        ckpt.prune(root, 1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000000", "step_00000001.bak", "step_00000002",
                                                          "step_00000005"]
    assert (snapshot(user), snapshot(older), snapshot(backup)) == before


def test_the_toolkits_own_debris_is_still_cleared(world_of_one, tmp_path):
    """A crashed save leaves its marker (written before any other file) or, killed before that, an empty folder:
    both are the toolkit's and are pruned once a newer checkpoint is complete; a crash at the step being saved is
    cleared by the save."""
    root = tmp_path / "ckpt"
    (root / "step_00000001").mkdir(parents=True)
    (root / "step_00000001" / names.STARTED).write_text('{"step": 1}')
    (root / "step_00000001" / "weights.bin").write_bytes(b"partial")
    (root / "step_00000002").mkdir()
    (root / "step_00000003").mkdir()
    (root / "step_00000003" / names.STARTED).write_text('{"step": 3}')
    (root / "step_00000003" / "zero_pp_rank_7_mp_rank_00_optim_states.pt").write_bytes(b"from another world size")
    assert ckpt.find_resume(root, "auto") is None
    tag_dir = _save(root, 3)
    assert sorted(p.name for p in tag_dir.iterdir()) == ["toolkit_meta.json", "toolkit_rank00000.pt",
                                                         names.STARTED, "weights.bin"]
    assert [p.name for p in ckpt.prune(root, 1)] == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003"]


def test_a_save_writes_its_marker_before_any_other_file(world_of_one, tmp_path):
    seen = []

    class Watching(StandIn):
        def save_state(self, root: Path, tag: str) -> None:
            seen.append(sorted(p.name for p in (root / tag).iterdir()))
            super().save_state(root, tag)

    ckpt.save(Watching(), tmp_path / "ckpt", 7, {}, {"layout": {"dp": 1}, "backend": "x"})
    assert seen == [[names.STARTED]]
