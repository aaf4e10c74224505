"""Names in a toolkit checkpoint directory, shared by the writers (training, both backends) and the readers
(conversion, inspection).

  <checkpoint dir>/
    step_00000050/                 one checkpoint (tag_for(step))
      toolkit_started.json         written first, before any other file of the save (STARTED): the folder is
                                   the toolkit's own, so the debris of a crashed save may be removed
      toolkit_rank00000.pt         a rank's RNG states and data position (rank_file)
      toolkit_meta.json            written last: step, layout, recipe, manifest (META, manifest.py)
      model_tpTT_ppPPP.safetensors the Megatron backend's weights of rank (tp, pp), keys chunk_key(c, name)
      optim_tpTT_ppPPP.safetensors its optimizer state, keys chunk_key(c, name, field) for OPTIM_FIELDS / MASTER
      ...                          or DeepSpeed's own files (engine.save_checkpoint)
    latest                         DeepSpeed's pointer (DEEPSPEED_POINTER), so DeepSpeed's own tools work
    latest_complete                the toolkit's pointer (POINTER), replaced only once a checkpoint is complete
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.format.manifest import META, SCHEMA_VERSION, STARTED  # noqa: F401 - named with the rest

OUTPUT_MARK = ".toolkit_output.json"
"""In every folder `toolkit convert` writes: the names it wrote there, so --overwrite replaces only such a folder."""
POINTER = "latest_complete"
DEEPSPEED_POINTER = "latest"
TAG_GLOB = "step_*"
_TAG = re.compile(r"step_\d{8,}")
OPTIM_FIELDS = ("exp_avg", "exp_avg_sq")
"""Adam's moments, stored per parameter under these field names."""
MASTER = "master"
"""The fp32 main weights of a model trained in 16-bit, stored under this field name."""
OPTIM_GROUPS = "param_groups"
"""Optimizer file metadata: JSON, for each inner optimizer, its param groups without their params (plain_group):
Megatron-Core's hyperparameters and weight-decay multipliers, which a Megatron-LM or torch_dist checkpoint written
from this one needs (toolkit/checkpoint/sources.py)."""
OPTIM_SCHEDULER = "opt_param_scheduler"
"""Optimizer file metadata: JSON, Megatron-LM's scheduler state, kept from a Megatron-LM or torch_dist source."""


def plain_group(group: dict) -> dict:
    """A param group's JSON-able entries (numbers, strings, booleans, None, lists of numbers; a one-element tensor as
    its number), without its params."""
    out = {}
    for k, v in group.items():
        if hasattr(v, "item") and not isinstance(v, (bool, int, float)):
            v = v.item() if getattr(v, "numel", lambda: 0)() == 1 else None
        v = list(v) if isinstance(v, tuple) else v
        if k != "params" and (v is None or isinstance(v, (bool, int, float, str)) or (
                isinstance(v, list) and all(isinstance(x, (int, float)) for x in v))):
            out[k] = v
    return out


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"toolkit_rank{rank:05d}.pt"


def is_complete(tag_dir: Path) -> bool:
    """A checkpoint is complete once its meta file exists: it is written last, after every rank's files."""
    return (tag_dir / META).is_file()


def complete_tags(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(TAG_GLOB) if own(p) and is_complete(p))


def own(tag_dir: Path) -> bool:
    """Whether the toolkit wrote this step folder, so that it may write into it or delete it: a real folder (not a
    link) named as tag_for names them, holding the meta file (a complete save) or the marker a save writes before
    anything else (the debris of a crashed save), or nothing at all (a crash between the two)."""
    if tag_dir.is_symlink() or not tag_dir.is_dir() or not _TAG.fullmatch(tag_dir.name):
        return False
    return (tag_dir / META).is_file() or (tag_dir / STARTED).is_file() or not any(tag_dir.iterdir())


# What a run writes beside its step folders: the toolkit's pointer, and DeepSpeed's own (with its consolidation
# scripts, which DeepSpeed's save copies into the folder)
ROOT_FILES = (POINTER, DEEPSPEED_POINTER, "zero_to_fp32.py", "zero_to_torch.py")


def foreign(root: Path) -> list[Path]:
    """The step_* entries of a checkpoint directory that the toolkit did not write (see own), and, in a folder
    holding no step folder of the toolkit's, any of the files a run writes beside them (ROOT_FILES): a user's own
    `latest` or `zero_to_fp32.py`, which a save would replace (it did until 2026-12-07)."""
    if not root.is_dir():
        return []
    steps = list(root.glob(TAG_GLOB))
    found = sorted(p for p in steps if not own(p))
    if not any(own(p) for p in steps):
        found += [root / name for name in ROOT_FILES if os.path.lexists(root / name)]
    return found


def refuse_foreign(root: Path, what: str = "checkpoint.dir") -> None:
    """Refuse a checkpoint directory holding step_* entries (or files beside them) the toolkit did not write: it
    would save into them, replace them, and delete them when pruning."""
    found = foreign(root)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        why = ("a link: a run writes its step folders itself, never through a link" if found[0].is_symlink() else
               f"no {META} or {STARTED} in it" if found[0].name.startswith("step_") else
               "a name a run writes beside its checkpoints, in a folder holding none of the toolkit's")
        raise ToolkitError(f"{what} {root} holds {found[0].name}{more}, which the toolkit did not write ({why}); move "
                           f"it out of {root} or choose another {what}. Nothing in {root} was written or deleted")


def mark_started(tag_dir: Path, step: int) -> None:
    """Create the folder of a save and its STARTED marker, before any other file of the save (rank 0)."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(tag_dir / STARTED, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, f'{{"step": {step}}}\n'.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_tag(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """The (tp, pp) part of a Megatron per-rank file name; with expert parallelism (ep > 1) also the expert-parallel
    rank, whose file holds its own routed experts and a copy of everything else (tpTT_ppPPP_epEEE)."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}" + (f"_ep{ep_rank:03d}" if ep_rank is not None else "")


def model_file(tag_dir: Path, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> Path:
    return tag_dir / f"model_{rank_tag(tp_rank, pp_rank, ep_rank)}.safetensors"


def optim_file(tag_dir: Path, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> Path:
    return tag_dir / f"optim_{rank_tag(tp_rank, pp_rank, ep_rank)}.safetensors"


def chunk_key(chunk: int, name: str, field: str | None = None) -> str:
    """The key of a parameter (field None) or of one of its optimizer tensors in the Megatron per-rank files."""
    return f"chunk{chunk}.{name}" + (f":{field}" if field else "")


def split_key(key: str) -> tuple[int, str, str | None]:
    """(chunk, name, field) of a key written by chunk_key."""
    head, _, rest = key.partition(".")
    name, _, field = rest.partition(":")
    if not head.startswith("chunk") or not head[5:].isdigit() or not name:
        raise ToolkitError(f"{key!r} is not a toolkit Megatron checkpoint key (chunk<c>.<name>[:<field>])")
    return int(head[5:]), name, field or None
