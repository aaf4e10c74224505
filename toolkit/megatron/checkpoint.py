"""Per-rank checkpoint files of the Megatron backend, inside the toolkit's step_* folders.

  model_tpTT_ppPPP.pt      the (tp, pp) rank's model chunks and optimizer state, written by data-parallel rank 0
  distopt_tpTT_ppPPP.pt    with the distributed optimizer: its fp32 master weights and Adam moments, gathered
                           from the data-parallel ranks by Megatron's save_parameter_state

The layout (tp, pp, vpp, dp, ...) is recorded in the step folder's toolkit_meta.json by the toolkit's
checkpoint module, which also decides when a checkpoint is complete.
"""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.errors import ToolkitError


def rank_tag(tp_rank: int, pp_rank: int) -> str:
    """The (tp, pp) part of a per-rank file name."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}"


def _chunk_states(backend) -> list[dict]:
    from toolkit.megatron.runtime import chunk_state

    return [chunk_state(w.module) for w in backend.chunks]  # local-spec names: files do not depend on the spec


def _distributed(backend) -> bool:
    return backend.layout_meta["zero_stage"] == 1


def save_rank_state(backend, tag_dir: Path) -> None:
    from megatron.core import parallel_state as ps

    tag_dir.mkdir(parents=True, exist_ok=True)
    if _distributed(backend):  # collective over the data-parallel group: every DP rank takes part
        backend.optimizer.save_parameter_state(str(tag_dir / f"distopt_{backend.rank_tag}.pt"))
    if ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0:
        torch.save({"chunks": _chunk_states(backend), "optimizer": backend.optimizer.state_dict()},
                   tag_dir / f"model_{backend.rank_tag}.pt")


def load_rank_state(backend, tag_dir: Path) -> None:
    from toolkit.megatron.runtime import load_chunk_state

    path = tag_dir / f"model_{backend.rank_tag}.pt"
    if not path.is_file():
        raise ToolkitError(f"{path} is missing: the checkpoint was not written by this layout or is incomplete")
    # Megatron's optimizer state holds plain Python containers and tensors only, so weights_only loading works
    state = torch.load(path, weights_only=True, map_location=backend.device)
    for w, chunk_state in zip(backend.chunks, state["chunks"]):
        load_chunk_state(w.module, chunk_state)
    backend.optimizer.load_state_dict(state["optimizer"])
    if _distributed(backend):
        _load_distributed_state(backend.optimizer, tag_dir / f"distopt_{backend.rank_tag}.pt")


def _load_distributed_state(optimizer, path: Path) -> None:
    """Megatron's load_parameter_state, working around its torch-AdamW fallback (no Apex/TE, as on CPU): there
    load_state_dict restores each parameter's Adam "step" from the param groups, but load_parameter_state then
    expects "step" among the saved tensors, which save_parameter_state never writes. Set it aside meanwhile, and
    give each parameter its own step tensor: load_state_dict shares one, which torch's AdamW would then increment
    once per parameter per step, corrupting Adam's bias correction."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    steps = [{p: st.pop("step") for p, st in opt.state.items() if "step" in st} for opt in inner]
    with torch.no_grad():  # in fp32 the main params are views of the model's (leaf) params
        optimizer.load_parameter_state(str(path))
    for opt, saved in zip(inner, steps):
        for p, step in saved.items():
            opt.state[p]["step"] = step.detach().clone()
