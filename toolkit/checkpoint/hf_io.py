"""Reading Hugging Face safetensors checkpoints (never pickles)."""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.errors import ToolkitError


class LazyHFState:
    """A read-only mapping over a Hugging Face checkpoint's safetensors files that reads a tensor only when asked
    (memory-mapped), so a rank can take the few tensors it needs from a checkpoint larger than its memory."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: list = []
        self._where: dict[str, object] = {}

    def __enter__(self) -> "LazyHFState":
        from safetensors import safe_open

        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ToolkitError(f"{self.folder} holds no *.safetensors files; save the model with safe_serialization")
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._handles.append(handle)
            self._where.update({k: handle for k in handle.keys()})
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
        self._where.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ToolkitError(f"{self.folder} has no tensor {name!r}: the checkpoint is incomplete or of another "
                               "architecture than the recipe's model section")
        return self._where[name].get_tensor(name)
