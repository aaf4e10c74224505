"""Reading Hugging Face safetensors checkpoints (never pickles)."""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.errors import ToolkitError
from toolkit.format import paths
from toolkit.format import safetensors_stream as st


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
