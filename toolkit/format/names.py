"""Names in a toolkit checkpoint directory, shared by the writers (training, both backends) and the readers
(conversion, inspection).

  <checkpoint dir>/
    step_00000050/                 one checkpoint (tag_for(step))
      toolkit_rank00000.pt         a rank's RNG states and data position (rank_file)
      toolkit_meta.json            written last: step, layout, recipe, manifest (META, manifest.py)
      model_tpTT_ppPPP.safetensors the Megatron backend's weights of rank (tp, pp), keys chunk_key(c, name)
      optim_tpTT_ppPPP.safetensors its optimizer state, keys chunk_key(c, name, field) for OPTIM_FIELDS / MASTER
      ...                          or DeepSpeed's own files (engine.save_checkpoint)
    latest                         DeepSpeed's pointer (DEEPSPEED_POINTER), so DeepSpeed's own tools work
    latest_complete                the toolkit's pointer (POINTER), replaced only once a checkpoint is complete
"""
from __future__ import annotations

from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.format.manifest import META, SCHEMA_VERSION  # noqa: F401 - named here with the rest of the folder

POINTER = "latest_complete"
DEEPSPEED_POINTER = "latest"
TAG_GLOB = "step_*"
OPTIM_FIELDS = ("exp_avg", "exp_avg_sq")
"""Adam's moments, stored per parameter under these field names."""
MASTER = "master"
"""The fp32 main weights of a model trained in 16-bit, stored under this field name."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"toolkit_rank{rank:05d}.pt"


def is_complete(tag_dir: Path) -> bool:
    """A checkpoint is complete once its meta file exists: it is written last, after every rank's files."""
    return (tag_dir / META).is_file()


def complete_tags(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(TAG_GLOB) if p.is_dir() and is_complete(p))


def rank_tag(tp_rank: int, pp_rank: int) -> str:
    """The (tp, pp) part of a Megatron per-rank file name."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}"


def model_file(tag_dir: Path, tp_rank: int, pp_rank: int) -> Path:
    return tag_dir / f"model_{rank_tag(tp_rank, pp_rank)}.safetensors"


def optim_file(tag_dir: Path, tp_rank: int, pp_rank: int) -> Path:
    return tag_dir / f"optim_{rank_tag(tp_rank, pp_rank)}.safetensors"


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
