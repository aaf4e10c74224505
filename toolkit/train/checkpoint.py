"""Resumable checkpoints for the DeepSpeed backend.

Layout of <checkpoint dir>:
  step_00000050/            DeepSpeed's own files (engine.save_checkpoint), plus
    toolkit_rank00000.pt    this rank's RNG states and data position (read with weights_only=True)
    toolkit_meta.json       written last, by rank 0, after every rank finished: step, layout, recipe, and the
                          manifest (every file of the checkpoint with its size)
  latest                    DeepSpeed's pointer (so DeepSpeed's zero_to_fp32 tooling works)
  latest_complete           the toolkit's pointer, replaced atomically only once a checkpoint is complete

A checkpoint without toolkit_meta.json is incomplete and is never resumed from.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from toolkit.errors import ToolkitError

SCHEMA_VERSION = 1
META = "toolkit_meta.json"
POINTER = "latest_complete"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:])}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / META).is_file()


def is_intact(tag_dir: Path) -> bool:
    """Complete, and every file still has the size the manifest recorded."""
    return is_complete(tag_dir) and not verify_manifest(tag_dir)


def complete_tags(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))


def save(backend, root: Path, step: int, data_state: dict, meta: dict) -> Path:
    """Save on every rank; mark complete (meta, then pointers) only after all ranks have written their files."""
    tag = tag_for(step)
    tag_dir = root / tag
    backend.save_state(root, tag)
    torch.save({"rng": rng_state(), "data": data_state, "step": step},
               tag_dir / f"toolkit_rank{dist.get_rank():05d}.pt")
    dist.barrier()  # every rank's files are written before rank 0 declares the checkpoint complete
    if dist.get_rank() == 0:
        # the manifest: every file of the checkpoint with its size, so a reader can tell a complete one
        files = {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir()) if p.is_file() and p.name != META}
        meta = {"schema_version": SCHEMA_VERSION, "step": step, "tag": tag, **meta, "files": files}
        _write_atomic(tag_dir / META, json.dumps(meta, indent=2))
        _write_atomic(root / "latest", tag)
        _write_atomic(root / POINTER, tag)
    dist.barrier()
    return tag_dir


def prune(root: Path, keep: int) -> list[Path]:
    """Rank 0: delete complete checkpoints beyond the newest `keep`, and incomplete ones older than the newest
    complete one (debris of a crash). Called only after a newer checkpoint is complete."""
    done = complete_tags(root)
    if not done:
        return []
    newest = done[-1].name
    stale = done[:-keep] + [p for p in root.glob("step_*") if p.is_dir() and not is_complete(p) and p.name < newest]
    for p in stale:
        shutil.rmtree(p)
    return stale


def find_resume(root: Path, resume: str) -> Path | None:
    """The checkpoint folder to resume from: None to start fresh."""
    if resume == "never":
        return None
    if resume != "auto":
        p = Path(resume)
        if is_complete(p):
            problems = verify_manifest(p)
            if problems:
                raise ToolkitError(f"checkpoint.resume: {p} does not match its manifest: {'; '.join(problems)}")
            return p
        if (p / POINTER).is_file():
            return find_resume(p, "auto")
        raise ToolkitError(f"checkpoint.resume: {resume} is neither a complete checkpoint (a step_* folder with "
                           f"{META}) nor a checkpoint directory with a {POINTER} pointer")
    pointer = root / POINTER
    if pointer.is_file():
        tag_dir = root / pointer.read_text().strip()
        if is_intact(tag_dir):
            return tag_dir
    intact = [p for p in complete_tags(root) if is_intact(p)]  # oldest to newest; damaged ones are skipped
    return intact[-1] if intact else None


def _describe(layout: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(layout.items()))


def load(backend, tag_dir: Path, layout_meta: dict) -> dict:
    """Restore the backend's model and optimizer state, then this rank's RNG. Returns the saved toolkit state."""
    meta = json.loads((tag_dir / META).read_text())
    saved = meta.get("layout", {})
    if saved != layout_meta:
        if "tp" in layout_meta:
            move = (f"toolkit convert {tag_dir} NEW_DIR --to megatron --tp {layout_meta['tp']} --pp "
                    f"{layout_meta['pp']} --vpp {layout_meta['vpp']}")
        else:
            move = f"toolkit convert {tag_dir} NEW_DIR --to deepspeed --dp {layout_meta['dp']}"
        raise ToolkitError(f"checkpoint {tag_dir} was written with {_describe(saved)}, this run has "
                           f"{_describe(layout_meta)}; relaunch with the saved layout, move the checkpoint to this "
                           f"layout with `{move}` and resume from NEW_DIR (checkpoint.resume), or set "
                           "checkpoint.resume: never to start fresh")
    backend.load_state(tag_dir)
    state = torch.load(tag_dir / f"toolkit_rank{dist.get_rank():05d}.pt", weights_only=True)
    set_rng_state(state["rng"])
    return state


def verify_manifest(tag_dir: Path) -> list[str]:
    """What is wrong with a checkpoint folder against its manifest (missing or resized files); [] if complete."""
    meta_path = tag_dir / META
    if not meta_path.is_file():
        return [f"{META} is missing: the save never completed"]
    files = json.loads(meta_path.read_text()).get("files") or {}  # none: written before manifests existed
    problems = []
    for name, size in files.items():
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {size}")
    return problems
