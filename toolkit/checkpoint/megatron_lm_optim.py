"""Writing the optimizer state in Megatron-LM's legacy layout (`toolkit convert --to megatron_lm`): the distributed
optimizer's (DistOptimWriter) from a source of the distributed optimizer, the plain optimizer's (PlainOptimWriter,
its state_dict by position: toolkit/checkpoint/megatron_plain.py) from a source of the plain one.

Beside each model-parallel rank's model_optim_rng.pt, `distrib_optim.pt` as Megatron-Core's save_parameter_state
writes it: {"buckets_coalesced": True, C: {(param dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": one fp32
tensor per field, "numel_unpadded"}}} for each model chunk C, the parameters where Megatron-Core's DDP puts them
(toolkit/checkpoint/megatron_flat.py: the local spec's registration order, 64-aligned, the buckets without their end
padding one after the other). model_optim_rng.pt then also holds `optimizer` (the distributed optimizer's
state_dict: the source's param groups, with the step) and `opt_param_scheduler`, both the source's, so Megatron-LM's
load_checkpoint takes all of it (`--use-distributed-optimizer --no-load-rng`).

The args written say `--use-distributed-optimizer` without `--overlap-grad-reduce`: no bucket cuts but the tied
embedding's. Where every parameter's size is a multiple of 64 elements (true of real models: hidden sizes, heads and
vocabulary padding are), a cut moves nothing in the coalesced buffers, so the file fits a run at any
`--ddp-bucket-size`, with or without `--overlap-grad-reduce`, at any data-parallel size; otherwise Megatron-Core's
own length check refuses the mismatch on load.

optimizer_plan, which decides what of a source's optimizer state a Megatron-LM target writes, serves the torch_dist
writer too (toolkit/checkpoint/torch_dist_write.py).

Memory: the buffers are memory-mapped scratch files in the output folder (page cache, not anonymous memory), each
removed once its rank file is written.

A mixture of experts written at ep > 1 gets Megatron-Core's two chained optimizers: the dense parameters' and the
routed experts' (buffers of their own, each expert-parallel rank's experts under their local indices). Each rank's
`optimizer` is then the list of their two state_dicts, and its distrib_optim.pt the list of their two
save_parameter_state states (the dense one in expert-parallel rank 0's file, None in the others, as Megatron-Core's
ChainedOptimizer writes it). The experts' param groups are the dense ones' for the experts' weight-decay multipliers,
marked is_expert_parallel (torch_dist_optim.expert_groups).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from toolkit.checkpoint.dist_keys import SAVED_AS
from toolkit.checkpoint.megatron_flat import buffer_entries, coalesced
from toolkit.checkpoint.megatron_lm import LOCAL_ORDER
from toolkit.checkpoint.megatron_plain import positions, wd_groups, wd_mult
from toolkit.checkpoint.pt_skeleton import slots
from toolkit.checkpoint.torch_dist_optim import expert_groups
from toolkit.families.entries import iter_entries

WEIGHT = "weight"


def optimizer_plan(target, source) -> tuple[dict | None, str | None]:
    """What a Megatron-LM target (legacy or torch_dist) writes of the source's optimizer state: ({"fields", "groups"
    (the param groups, with the step), "expert_groups" (a mixture of experts' expert optimizer's, for a target at
    ep > 1; else None), "step", "scheduler", "scaler", "distributed" (the source's optimizer is the distributed one:
    the target's is too), "args" (the source's Megatron-LM args, which fix the plain optimizer's param groups)}, None); (None, why not) when the source has state that cannot be written; (None, None) when it has
    none. Written from a source that carries Megatron's param groups and scheduler state, which Megatron-LM's load
    needs (a toolkit source makes its scheduler state from the recipe: sources.ToolkitMegatronSource)."""
    have = {f for f in source.fields if f != WEIGHT}
    if not {"exp_avg", "exp_avg_sq"} <= have:
        return None, None
    if source.optimizer_groups is None or source.scheduler is None:
        return None, ("the source carries no Megatron optimizer param groups and scheduler state, which Megatron-LM's "
                      "load needs (Megatron-LM's checkpoints do, and the toolkit's since 2026-12-05, with their "
                      "recipe): weights only")
    if target.out_dtype != source.dtype():
        return None, f"not written at another dtype than the source's ({source.dtype()}): weights only"
    if not source.optimizer_distributed:  # the plain optimizer's positions follow from its standard groups
        saved, standard = [g.get("wd_mult") for g in source.optimizer_groups], wd_groups(target.dims, source.args)
        if getattr(source.args, "decoupled_lr", None) is not None or sorted(map(str, saved)) != sorted(
                map(str, standard)) or len(set(map(str, saved))) != len(saved):
            return None, (f"its plain optimizer's param groups (wd_mult {saved}) are not Megatron's standard ones for "
                          f"this model ({sorted(standard)}), which fix where each parameter's state goes: weights only")
    meta = getattr(source, "optimizer_meta", None) or {}
    step = float(meta.get("step") or target.step)
    scalers = [s for s in json.loads(meta.get("grad_scalers") or "[]") if s]
    scaler = dict(scalers[0]) if scalers else None  # the scale a float: a tensor in the files (_scaler)
    groups = [{**g, "step": step} for g in source.optimizer_groups]  # one step, as Megatron's load asserts
    experts = {wd_mult(e.megatron_name, len(e.rule.shard_shape(e.hf_shapes, 1)), source.args)
               for e in iter_entries(target.dims, 1, 1, 1) if e.ep_rank is not None}
    return {"fields": ("exp_avg", "exp_avg_sq") + (("master",) if "master" in have else ()),
            "groups": groups, "expert_groups": expert_groups(groups, experts) if getattr(target, "ep", 1) > 1 else None,
            "step": step, "scheduler": source.scheduler, "scaler": scaler,
            "distributed": source.optimizer_distributed, "args": source.args}, None


def _scaler(plan_scaler: dict) -> dict:
    """The grad scaler's state as Megatron-Core's state_dict holds it: the scale a tensor."""
    return {k: torch.tensor(v) if k == "scale" else v for k, v in plan_scaler.items()}


def optimizer_writer(target, source) -> tuple[DistOptimWriter | None, str | None]:
    """(writer, None), or (None, why not or None): optimizer_plan. The distributed optimizer's state for a source of
    the distributed optimizer, the plain optimizer's for one of the plain optimizer."""
    plan, note = optimizer_plan(target, source)
    if not plan:
        return None, note
    return (DistOptimWriter if plan["distributed"] else PlainOptimWriter)(target, plan), None


class DistOptimWriter:
    """The distributed optimizer's buffers of a Megatron-LM legacy target, filled as the parameters are written: one
    set per rank (p, t) and buffer (None: the dense one; e: expert-parallel rank e's experts, at ep > 1)."""

    def __init__(self, target, plan: dict):
        self.target, self.fields = target, plan["fields"]
        self.has_master = "master" in self.fields
        self.groups, self.scheduler, self.scaler = plan["groups"], plan["scheduler"], plan["scaler"]
        self.expert_groups = plan["expert_groups"]
        self.step, self.source_args = plan["step"], plan["args"]
        args = target._args  # what fixes the layout below (megatron_flat.bucket_size gives None)
        args.use_distributed_optimizer, args.overlap_grad_reduce = plan["distributed"], False
        args.no_save_optim = False
        args.ddp_bucket_size, args.data_parallel_size = None, 1
        tp, pp, vpp = target.layout
        self.ep = getattr(target, "ep", 1)
        self.named = buffer_entries(target.dims, pp, vpp, self.ep)
        self._place: dict[tuple[int, int, int | None], tuple[int, dict]] = {}
        for (p, c, b), named in self.named.items():
            n, placed = coalesced(target.dims, named, LOCAL_ORDER, target.layout, p, c, None, b is None)
            if placed is None:
                raise RuntimeError(f"internal: no distributed-optimizer layout for stage {p} chunk {c} buffer {b}")
            self._place[(p, c, b)] = (n, placed)
        self.total = 3 * 4 * tp * sum(n for n, _ in self._place.values())
        self.scratch = target.root / ".distrib_optim_scratch"
        self._buffers: dict[tuple[int, int, int | None], dict[int, dict[str, torch.Tensor]]] = {}

    def _buffer(self, p: int, t: int, b: int | None) -> dict[int, dict[str, torch.Tensor]]:
        if (p, t, b) not in self._buffers:
            self.scratch.mkdir(exist_ok=True)
            chunks = {}
            for c in range(self.target.layout[2]):
                n = self._place[(p, c, b)][0]
                chunks[c] = {}
                for key in SAVED_AS.values():
                    f = self.scratch / f"{p}_{t}_{c}_{b}_{key}"
                    with open(f, "wb") as out:
                        out.truncate(n * 4)  # zeros: the gaps between parameters, as Megatron's buffers hold
                    chunks[c][key] = torch.from_file(str(f), shared=True, size=n, dtype=torch.float32)
            self._buffers[(p, t, b)] = chunks
        return self._buffers[(p, t, b)]

    def _buffers_of(self, e: int) -> list[int | None]:
        """The buffers of expert-parallel rank e's optimizers: the dense one, and at ep > 1 its experts'."""
        return [None, e] if self.ep > 1 else [None]

    def put(self, entry, field: str, pieces: list[torch.Tensor]) -> None:
        """One field of a parameter, as its TP shards, into the buffers (the weights are the main weights of an
        fp32 model)."""
        if field == WEIGHT and self.has_master:
            return
        key = "param" if field == WEIGHT else SAVED_AS[field]
        b = entry.ep_rank if self.ep > 1 else None
        _, placed = self._place[(entry.pp_rank, entry.chunk, b)]
        start, end = placed[entry.megatron_name]
        for t, piece in enumerate(pieces):
            self._buffer(entry.pp_rank, t, b)[entry.chunk][key][start:end].copy_(piece.reshape(-1))

    def _chained(self, states: list):
        """One optimizer's entry, or the list of a mixture of experts' two (ChainedOptimizer's state_dict)."""
        return states if self.ep > 1 else states[0]

    def extra(self, p: int, t: int, e: int = 0) -> dict:
        """What the rank's model_optim_rng.pt holds beside the model (written before the stage's parameters come)."""
        states = []
        for groups in (self.groups, self.expert_groups)[:len(self._buffers_of(e))]:
            optimizer = {"optimizer": {"param_groups": [dict(g) for g in groups]}}
            if self.scaler:
                optimizer["grad_scaler"] = _scaler(self.scaler)
            states.append(optimizer)
        return {"optimizer": self._chained(states), "opt_param_scheduler": self.scheduler}

    def extra_slots(self, p: int, t: int, e: int = 0) -> tuple[dict, list]:
        """extra() for the torch-free writer of the rank file (pt_skeleton.slots): its objects, and the bytes of its
        tensors, written when the file is finished (after the stage's parameters filled the buffers)."""
        return slots(self.extra(p, t, e))

    def finish(self, p: int, t: int, e: int, folder: Path) -> None:
        """Once the stage is complete and its model_optim_rng.pt finished: writes the rank's distrib_optim.pt (the
        dense state only in expert-parallel rank 0's, as Megatron-Core's ChainedOptimizer saves it)."""
        dtypes = (self.target.out_dtype, torch.float32)  # Megatron-LM's params, and its fp32 gradient buffers
        states = []
        for b in self._buffers_of(e):
            chunks = self._buffer(p, t, b)
            states.append(None if b is None and e > 0 else {"buckets_coalesced": True, **{
                c: {dtypes: {**bufs, "numel_unpadded": self._place[(p, c, b)][0]}} for c, bufs in chunks.items()}})
        torch.save(self._chained(states), folder / "distrib_optim.pt")
        del states, chunks
        self._done(p, t, e)

    def _done(self, p: int, t: int, e: int) -> None:
        """Rank (p, t, e)'s files are written: its buffers are released (the dense one after the last expert-parallel
        rank's, whose files hold the plain optimizer's dense state too)."""
        for b in self._buffers_of(e):
            if b is not None or e == self.ep - 1:
                del self._buffers[(p, t, b)]
                for c in range(self.target.layout[2]):
                    for key in SAVED_AS.values():
                        os.unlink(self.scratch / f"{p}_{t}_{c}_{b}_{key}")

    def close(self) -> None:
        if self.scratch.is_dir():
            self.scratch.rmdir()


class PlainOptimWriter(DistOptimWriter):
    """The plain optimizer's state of a Megatron-LM legacy target (toolkit/checkpoint/megatron_plain.py): in each
    rank's model_optim_rng.pt, the optimizer's state_dict with every parameter's state at the position Megatron-Core's
    param groups give it at the new layout (local spec), as views of the same scratch buffers."""

    def extra(self, p: int, t: int, e: int = 0) -> dict:
        """The optimizer's state_dict in the rank's model_optim_rng.pt (each of a mixture of experts' two): views of
        the scratch buffers, which the stage's parameters fill before the file is finished (pt_write.Skeleton.
        finish writes them)."""
        tp, states = self.target.layout[0], []
        for b, chosen in zip(self._buffers_of(e), (self.groups, self.expert_groups)):
            chunks = self._buffer(p, t, b)
            state, groups, mains = {}, [], []
            for group, members in zip(chosen, positions(self.target.dims, self.target.layout, p, chosen,
                                                        self.source_args, b, self.ep)):
                ids, group_mains = [], []
                for c, n in members:
                    start, end = self._place[(p, c, b)][1][n]
                    entry = self.named[(p, c, b)][n]
                    shape = tuple(entry.rule.shard_shape(entry.hf_shapes, tp))
                    def view(key: str, chunks=chunks, c=c, start=start, end=end, shape=shape) -> torch.Tensor:
                        return chunks[c][key][start:end].view(shape)
                    state[len(state)] = {"step": torch.tensor(float(self.step)), "exp_avg": view("exp_avg"),
                                         "exp_avg_sq": view("exp_avg_sq")}  # torch's Adam keeps a step per parameter
                    ids.append(len(state) - 1)
                    group_mains.append(view("param"))
                groups.append({**group, "params": ids})
                mains.append(group_mains)
            optimizer = {"state": state, "param_groups": groups}
            if self.has_master:  # Float16OptimizerWithFloat16Params's state_dict
                optimizer = {"optimizer": optimizer, "fp32_from_fp16_params": mains}
                if self.scaler:
                    optimizer["grad_scaler"] = _scaler(self.scaler)
            states.append(optimizer)
        return {"optimizer": self._chained(states), "opt_param_scheduler": self.scheduler}

    def finish(self, p: int, t: int, e: int, folder: Path) -> None:
        """Once the rank file is finished (the views' bytes written): the scratch buffers released."""
        self._done(p, t, e)
