"""Export a Megatron-backend checkpoint (any TP x PP x VPP) to a Hugging Face model folder.

    python -m toolkit.megatron.export runs/tiny_tp2_pp2/checkpoints/step_00000200 out/hf_model

The layout and architecture come from the checkpoint's own toolkit_meta.json; the merge rules are the shared
ones in toolkit.checkpoint (the same that load Hugging Face weights into the Megatron backend).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from toolkit.errors import ToolkitError
from toolkit.megatron.checkpoint import rank_tag


def read_megatron_shards(tag_dir: Path, meta: dict) -> dict:
    """{(pp_rank, tp_rank): [chunk state dicts]} from the per-rank model files."""
    layout = meta["layout"]
    shards = {}
    for pp in range(layout["pp"]):
        for tp in range(layout["tp"]):
            path = tag_dir / f"model_{rank_tag(tp, pp)}.pt"
            if not path.is_file():
                raise ToolkitError(f"{path} is missing: the checkpoint is incomplete for its layout "
                                   f"tp={layout['tp']} pp={layout['pp']}")
            shards[(pp, tp)] = torch.load(path, weights_only=True, map_location="cpu")["chunks"]
    return shards


def export_hf(tag_dir: str | Path, out_dir: str | Path) -> Path:
    """Write config.json and model.safetensors of the checkpoint's model to out_dir (which must not exist)."""
    from safetensors.torch import save_file

    from toolkit.checkpoint import LlamaDims, megatron_to_hf
    from toolkit.model import to_hf_config
    from toolkit.recipe.schema import Recipe

    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    meta_path = tag_dir / "toolkit_meta.json"
    if not meta_path.is_file():
        raise ToolkitError(f"{tag_dir} has no toolkit_meta.json: not a complete checkpoint of this toolkit")
    if out_dir.exists():
        raise ToolkitError(f"{out_dir} already exists; choose a new folder (nothing is overwritten)")
    meta = json.loads(meta_path.read_text())
    if meta.get("backend") != "megatron":
        raise ToolkitError(f"{tag_dir} was written by the {meta.get('backend')} backend, not megatron")
    recipe = Recipe.model_validate(meta["recipe"])
    layout = meta["layout"]
    config = to_hf_config(recipe.model)
    dims = LlamaDims.from_hf(config, layout["tp"], recipe.parallel.megatron.make_vocab_size_divisible_by)
    state = megatron_to_hf(read_megatron_shards(tag_dir, meta), dims, layout["tp"], layout["pp"], layout["vpp"])
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out_dir)  # appears whole or not at all
    return out_dir


if __name__ == "__main__":
    try:
        print(f"wrote {export_hf(sys.argv[1], sys.argv[2])}")
    except (ToolkitError, IndexError) as e:
        print(f"error: {e}" if isinstance(e, ToolkitError) else __doc__, file=sys.stderr)
        sys.exit(2)
