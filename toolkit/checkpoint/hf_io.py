"""Reading Hugging Face safetensors checkpoints (never pickles)."""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.errors import ToolkitError


def read_hf_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model folder's *.safetensors files."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ToolkitError(f"{folder} holds no *.safetensors files; save the model with safe_serialization")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
