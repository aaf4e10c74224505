"""Reading Hugging Face safetensors checkpoints (never pickles), and the shard layout a written folder takes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import ToolkitError
from toolkit.format import paths
from toolkit.format import safetensors_stream as st

if TYPE_CHECKING:
    import torch


class LazyHFState:
    """A read-only mapping over a Hugging Face checkpoint's safetensors files that reads a tensor only when asked
    (positioned reads through safetensors_stream, each file checked against its header on open), so a rank can
    take the few tensors it needs from a checkpoint larger than its memory."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._readers: list[st.Reader] = []
        self._where: dict[str, st.Reader] = {}

    def __enter__(self) -> "LazyHFState":
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ToolkitError(f"{self.folder} holds no *.safetensors files; save the model with safe_serialization")
        for f in files:
            reader = st.Reader(paths.inside(self.folder, f.name, str(self.folder)))  # never a link out of it
            self._readers.append(reader)
            self._where.update({k: reader for k in reader.keys()})
        return self

    def __exit__(self, *exc) -> None:
        for reader in self._readers:
            reader.close()
        self._readers.clear()
        self._where.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ToolkitError(f"{self.folder} has no tensor {name!r}: the checkpoint is incomplete or of another "
                               "architecture than the recipe's model section")
        return self._where[name].get(name)


SHARD_BYTES = 5 * 2**30
"""Bytes per Hugging Face shard: near transformers 4's save_pretrained default ("5GB", the Hub's common shard size);
transformers 5's is "50GB". Any sharding loads the same (from_pretrained follows the index)."""


def shard_layout(tensors: list[tuple[str, tuple, torch.dtype | str]], shard_bytes: int = SHARD_BYTES
                 ) -> tuple[list[str], list[dict], int]:
    """How save_pretrained lays tensors (name, shape, dtype) out in files: (file names, [{name: (shape, dtype)}] per
    file, total bytes). A new file starts when the next tensor would take the current one past `shard_bytes`."""
    shards: list[dict] = [{}]
    size = 0
    for name, shape, dtype in tensors:
        n = st.nbytes(shape, dtype)
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (shape, dtype)
        size += n
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(st.nbytes(s, d) for spec in shards for s, d in spec.values())
    return files, shards, total


def write_index(folder: Path, files: list[str], shards: list[dict], total: int) -> None:
    """model.safetensors.index.json, when the tensors take more than one file."""
    if len(files) > 1:
        weight_map = {name: f for f, spec in zip(files, shards) for name in spec}
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
