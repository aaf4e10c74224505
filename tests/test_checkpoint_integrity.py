"""Checkpoint manifests (sizes and SHA-256 of every file), the choice of the checkpoint to resume from (and the log
of every one skipped), old size-only manifests, and the disk-space check before a save.

Saves run through toolkit.train.checkpoint.save in a gloo world of one with a stand-in backend, so the collective
code paths run for real; the slow test does the same inside a real training run."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
import torch.distributed as dist
from conftest import REPO, run_ranks

from toolkit.format import manifest
from toolkit.errors import ToolkitError
from toolkit.train import checkpoint as ckpt


class StandIn:
    """The part of a backend the checkpoint code uses: one weights file per save."""

    name = "stand-in"

    def __init__(self, payload: bytes = b"w" * 4096):
        self.payload, self.loaded = payload, None

    def save_state(self, root: Path, tag: str) -> None:
        (root / tag).mkdir(parents=True, exist_ok=True)
        (root / tag / "weights.bin").write_bytes(self.payload)

    def rank_files(self, tag_dir: Path) -> list[str]:
        return ["weights.bin"]

    def checkpoint_bytes(self) -> int:
        return len(self.payload)

    def load_state(self, tag_dir: Path) -> None:
        self.loaded = (tag_dir / "weights.bin").read_bytes()


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / '.store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(root: Path, step: int, payload: bytes | None = None) -> Path:
    backend = StandIn(payload or bytes([step]) * 4096)
    return ckpt.save(backend, root, step, {"consumed_micro_batches": step}, {"layout": {"dp": 1}, "backend": "x"})


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_holds_size_and_xxh3_128_of_every_file(world_of_one, tmp_path):
    tag_dir = _save(tmp_path / "ckpt", 3)
    meta = json.loads((tag_dir / ckpt.META).read_text())
    assert meta["schema_version"] == 3 and meta["step"] == 3
    assert sorted(meta["files"]) == ["toolkit_rank00000.pt", "weights.bin"]
    for name, entry in meta["files"].items():
        data = (tag_dir / name).read_bytes()
        assert entry == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert (tmp_path / "ckpt" / ckpt.POINTER).read_text() == "step_00000003"
    assert ckpt.verify_manifest(tag_dir) == []


def test_schema_2_manifests_are_still_checked_by_their_sha256(world_of_one, tmp_path):
    """Checkpoints saved before XXH3-128 hold SHA-256 digests: they resume, and a changed byte is still found."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        tag_dir = _save(root, step)
        meta = json.loads((tag_dir / ckpt.META).read_text())
        meta["schema_version"] = 2
        meta["files"] = {name: {"bytes": e["bytes"], "sha256": hashlib.sha256((tag_dir / name).read_bytes()).hexdigest()}
                         for name, e in meta["files"].items()}
        (tag_dir / ckpt.META).write_text(json.dumps(meta))
    assert ckpt.verify_manifest(root / "step_00000002") == []
    _flip_a_byte(root / "step_00000002" / "weights.bin")
    lines: list[str] = []
    assert ckpt.find_resume(root, "auto", log=lines.append) == root / "step_00000001"
    assert lines == [
        f"[toolkit] skipping checkpoint {root}/step_00000002: weights.bin does not match its sha256 in the manifest "
        "(the file or the manifest changed after the save)",
        f"[toolkit] resuming from {root}/step_00000001: the newest checkpoint whose manifest verifies (2 files, "
        "sizes and sha256)"]


def test_resume_takes_the_newest_that_verifies_and_logs_each_skipped(world_of_one, tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3, 4, 5):
        _save(root, step)
    _flip_a_byte(root / "step_00000005" / "weights.bin")  # same size: only the checksum sees it
    (root / "step_00000004" / "weights.bin").write_bytes(b"w" * 10)  # truncated
    (root / "step_00000003" / "toolkit_rank00000.pt").unlink()  # a rank's file lost
    (root / "step_00000006").mkdir()  # a crash during the save of step 6 (its marker is written first)
    (root / "step_00000006" / ckpt.STARTED).write_text('{"step": 6}')
    (root / "step_00000006" / "weights.bin").write_bytes(b"partial")
    lines: list[str] = []
    assert ckpt.find_resume(root, "auto", log=lines.append) == root / "step_00000002"
    assert lines == [
        f"[toolkit] skipping checkpoint {root}/step_00000006: toolkit_meta.json is missing: the save never completed",
        f"[toolkit] skipping checkpoint {root}/step_00000005: weights.bin does not match its xxh3_128 in the manifest "
        "(the file or the manifest changed after the save)",
        f"[toolkit] skipping checkpoint {root}/step_00000004: weights.bin has 10 bytes, the manifest says 4096",
        f"[toolkit] skipping checkpoint {root}/step_00000003: toolkit_rank00000.pt is missing",
        f"[toolkit] resuming from {root}/step_00000002: the newest checkpoint whose manifest verifies (2 files, "
        "sizes and xxh3_128)"]
    with pytest.raises(ToolkitError) as err:
        ckpt.find_resume(root, str(root / "step_00000005"))
    assert str(err.value) == (f"checkpoint.resume: {root}/step_00000005 does not match its manifest: weights.bin does "
                              "not match its xxh3_128 in the manifest (the file or the manifest changed after the save)")


def test_old_manifests_without_checksums_are_checked_by_size(world_of_one, tmp_path):
    root = tmp_path / "ckpt"
    tag_dir = _save(root, 1)
    meta = json.loads((tag_dir / ckpt.META).read_text())
    meta["schema_version"] = 1
    meta["files"] = {name: entry["bytes"] for name, entry in meta["files"].items()}  # as version 1 wrote it
    (tag_dir / ckpt.META).write_text(json.dumps(meta))
    lines: list[str] = []
    assert ckpt.find_resume(root, "auto", log=lines.append) == tag_dir
    assert lines[-1].endswith("(2 files, sizes only (no checksums))")
    _flip_a_byte(tag_dir / "weights.bin")
    assert ckpt.verify_manifest(tag_dir) == []  # what size-only manifests cannot see
    (tag_dir / "weights.bin").write_bytes(b"")
    assert ckpt.verify_manifest(tag_dir) == ["weights.bin has 0 bytes, the manifest says 4096"]


def test_a_full_disk_refuses_the_save_before_anything_is_written(world_of_one, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    monkeypatch.setattr(manifest, "free_bytes", lambda folder: 1000)
    with pytest.raises(ToolkitError) as err:  # no checkpoint yet: the size comes from the state in memory
        _save(root, 1)
    assert str(err.value) == (f"not enough disk space for checkpoint step_00000001: it needs about 4,096 bytes (the "
                              f"model and optimizer state on the 1 ranks), but {root} has 1,000 bytes free. Nothing "
                              "was written and existing files are untouched; free space there or write somewhere "
                              "larger")
    assert not root.exists()
    monkeypatch.undo()
    _save(root, 1)
    before = _snapshot(root)
    total = manifest.total_bytes(json.loads((root / "step_00000001" / ckpt.META).read_text())["files"])
    monkeypatch.setattr(manifest, "free_bytes", lambda folder: total - 1)
    with pytest.raises(ToolkitError, match=rf"it needs about {total:,} bytes \(the size of step_00000001\), but "
                                           rf"{root} has {total - 1:,} bytes free"):
        _save(root, 2)
    assert _snapshot(root) == before  # nothing written, the previous checkpoint untouched


def test_a_folder_left_by_a_crash_at_the_same_step_is_cleared_first(world_of_one, tmp_path):
    root = tmp_path / "ckpt"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / ckpt.STARTED).write_text('{"step": 2}')  # a save writes it first
    (root / "step_00000002" / "zero_pp_rank_7_mp_rank_00_optim_states.pt").write_bytes(b"from another world size")
    tag_dir = _save(root, 2)
    assert sorted(json.loads((tag_dir / ckpt.META).read_text())["files"]) == ["toolkit_rank00000.pt", "weights.bin"]
    assert sorted(p.name for p in tag_dir.iterdir()) == ["toolkit_meta.json", "toolkit_rank00000.pt",
                                                         "toolkit_started.json", "weights.bin"]


def test_each_rank_claims_the_deepspeed_files_it_wrote(tmp_path):
    """Every rank hashes (and flushes) its own files; DeepSpeed's names say whose they are."""
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_10_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    deepspeed = type("DeepSpeedLike", (), {})()  # no rank_files: the DeepSpeed naming applies

    def claimed(rank):
        return sorted(p.name for p in ckpt.own_files(deepspeed, tmp_path, rank))

    assert claimed(0) == ["mp_rank_00_model_states.pt", "toolkit_rank00000.pt"]
    assert claimed(1) == ["toolkit_rank00001.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                          "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert claimed(10) == ["bf16_zero_pp_rank_10_mp_rank_00_optim_states.pt", "toolkit_rank00010.pt"]


def test_load_restores_through_the_backend(world_of_one, tmp_path):
    tag_dir = _save(tmp_path / "ckpt", 4, payload=b"weights of step 4")
    backend = StandIn()
    state = ckpt.load(backend, tag_dir, {"dp": 1})
    assert backend.loaded == b"weights of step 4" and state["data"] == {"consumed_micro_batches": 4}


def test_inspect_names_the_file_that_fails(world_of_one, tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    _save(root, 2)
    _flip_a_byte(root / "step_00000002" / "weights.bin")
    proc = subprocess.run([sys.executable, "-m", "toolkit", "inspect", str(root / "step_00000002")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1
    assert ("  problem: weights.bin does not match its xxh3_128 in the manifest (the file or the manifest changed "
            "after the save)") in proc.stdout.splitlines()
    proc = subprocess.run([sys.executable, "-m", "toolkit", "inspect", str(root)], capture_output=True, text=True,
                          cwd=REPO)
    # step 1 is the newest intact one; it is not called complete, as convert would not read its stand-in backend
    assert proc.returncode == 1 and "  step: 1 (step_00000001, the newest intact step)" in proc.stdout.splitlines()
    assert (f"  problem: {root}/step_00000001/toolkit_meta.json names backend 'x'; expected megatron or deepspeed"
            in proc.stdout.splitlines())
    assert ("  step_00000002: incomplete: weights.bin does not match its xxh3_128 in the manifest (the file or the "
            "manifest changed after the save)") in proc.stdout.splitlines()


# A real training run whose second checkpoint finds the disk full: the free-space function is replaced in the
# training process (toolkit.format.manifest.free_bytes), as a full disk would answer after the first save.
FULL_AFTER_FIRST_SAVE = """
import runpy
import sys
sys.path.insert(0, {repo!r})
from toolkit.format import manifest
from toolkit.train import checkpoint as ckpt

real, saves = manifest.free_bytes, []
manifest.free_bytes = lambda folder: real(folder) if not saves else 12345
_save = ckpt.save
ckpt.save = lambda *a, **k: saves.append(_save(*a, **k)) or saves[-1]
sys.argv = ["recipes/train.py", "--recipe", "tiny_zero1", *sys.argv[1:]]
runpy.run_path("recipes/train.py", run_name="__main__")  # the real entry point, exit code included
"""


@pytest.mark.slow
def test_training_stops_with_a_clear_error_when_the_disk_is_full(tmp_path):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_AFTER_FIRST_SAVE.format(repo=str(REPO)))
    out = tmp_path / "run"
    sets = [f"output_dir={out}", "parallel.world_size=1", "model.preset=tiny", "training.steps=3",
            "checkpoint.interval=1", "training.schedule.warmup_steps=1", "logging.sample_prompt="]
    proc = run_ranks([str(script), *(a for s in sets for a in ("--set", s))], 1, dict(os.environ), "python")
    root = out / "checkpoints"
    first = root / "step_00000001"
    total = manifest.total_bytes(json.loads((first / ckpt.META).read_text())["files"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"not enough disk space for checkpoint step_00000002: it needs about {total:,} bytes (the size of "
            f"step_00000001), but {root} has 12,345 bytes free") in proc.stderr
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001"]  # nothing of step 2 was written
    assert ckpt.verify_manifest(first) == [] and (root / ckpt.POINTER).read_text() == "step_00000001"
