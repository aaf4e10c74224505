"""The optimizer state of a Megatron-Core torch_dist checkpoint, by parameter name.

What Megatron-Core 0.16 saves (`optimizer.sharded_state_dict(model_sharded_state_dict, metadata=...)`):
- the plain optimizer (Float16/FP32Optimizer): `optimizer.state.exp_avg.<model key>`, `optimizer.state.exp_avg_sq.
  <model key>` and, for a 16-bit model, `optimizer.state.fp32_param.<model key>`, each a ShardedTensor of the model
  parameter's global shape and sharding; the shared Adam step is common.pt's `optimizer[.optimizer].state.common_step`
  (the inner `optimizer` level with a 16-bit model's Float16Optimizer only);
- the distributed optimizer with `distrib_optim_sharding_type: fully_reshardable` (Megatron-LM's
  `--dist-ckpt-optim-fully-reshardable`, and the toolkit's own `checkpoint.format: torch_dist`): the same per-parameter
  tensors, named `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>` (`param`: the fp32 main weights), with
  the step in common.pt's param groups and `param_state_sharding_type` beside them;
- the distributed optimizer with `dp_reshardable` (Megatron-LM's default): flat per-bucket buffers
  (`optimizer.distributed.dp_group_idx_*...bucket_idx_*.exp_avg`) whose parameter offsets are not saved: this class
  only recognises them (`sharding`), toolkit/checkpoint/megatron_flat.py recomputes and proves the layout;
- Megatron-Core's own default for the distributed optimizer, `fully_sharded_model_space`, cannot be saved by 0.16
  (its ShardedTensors carry a flattened_range, which 0.16 refuses), so no such checkpoint exists.
With several chained optimizers and `chained_optim_avoid_prefix` off, every key is prefixed `chained_N.`.

Each tensor is matched to its parameter by the model key in its own name, never by position.
"""
from __future__ import annotations

import json
import re

import torch

from toolkit.checkpoint.source_base import NO_OPTIMIZER_STATE
from toolkit.errors import Problem
from toolkit.format.names import MASTER

_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)$")
_FIELD = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": MASTER, "param": MASTER}
READ = (None, "fully_reshardable")  # param_state_sharding_type: None is the plain optimizer


def optimizer_parts(state) -> list[dict]:
    """The per-inner-optimizer common state dicts (one, or one per chained optimizer)."""
    if isinstance(state, dict) and state and all(isinstance(k, int) for k in state):
        return [state[k] for k in sorted(state)]
    if isinstance(state, (list, tuple)):
        return list(state)
    return [state] if isinstance(state, dict) else []


def saved_step(part: dict):
    # Float16 and distributed optimizers nest torch's state dict under "optimizer"; FP32Optimizer saves it bare
    opt = part.get("optimizer") if isinstance(part.get("optimizer"), dict) else part
    step = (opt.get("state") or {}).get("common_step")  # plain optimizer
    if step is None:  # distributed optimizer: torch Adam's step kept in the param groups
        steps = {g.get("step") for g in opt.get("param_groups") or [] if g.get("step") is not None}
        step = steps.pop() if len(steps) == 1 else None
    return int(step.item() if torch.is_tensor(step) else step) if step is not None else None


GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
"""What Megatron-Core's distributed optimizer matches saved param groups to its own by (load_state_dict)."""


def param_groups(parts: list) -> list[dict] | None:
    """The param groups of a Megatron optimizer's saved state (hyperparameters and step, without `params`): of its
    single optimizer, or of a mixture of experts' dense one (chained before the experts' own, whose groups are all
    `is_expert_parallel`: expert_groups makes those from the dense ones); None for other chains or groups without
    Megatron's identifying keys."""
    groups = [_groups(p) for p in parts]
    if len(groups) == 2 and groups[1] and all(g["is_expert_parallel"] for g in groups[1]):
        groups = groups[:1]
    return groups[0] if len(groups) == 1 else None


def _groups(part) -> list[dict] | None:
    if not isinstance(part, dict):
        return None
    opt = part.get("optimizer") if isinstance(part.get("optimizer"), dict) else part
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(
            isinstance(g, dict) and all(k in g for k in GROUP_KEYS) for g in groups):
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def expert_groups(groups: list[dict], wd_mults: set[float]) -> list[dict]:
    """The param groups of a mixture of experts' expert optimizer (Megatron-Core's at ep > 1) made from the dense
    optimizer's: Megatron-Core builds both from the same optimizer config, keyed (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr); the experts' are the groups of their weight-decay multipliers with
    is_expert_parallel set."""
    return [{**g, "is_expert_parallel": True} for g in groups if g.get("wd_mult") in wd_mults]


def saved_scaler(part: dict) -> dict:
    sd = part.get("grad_scaler") or {}
    return {k: (v.item() if torch.is_tensor(v) else v) for k, v in sd.items()} if isinstance(sd, dict) else {}


class OptimizerState:
    """Which optimizer fields a torch_dist checkpoint carries for the given parameters, and where.

    fields: ("exp_avg", "exp_avg_sq"[, "master" for a 16-bit model]), or () with `note` saying why none convert.
    meta: the toolkit's optimizer-file metadata (step, grad scalers)."""

    def __init__(self, reader, weights: dict[str, tuple], sixteen_bit: bool):
        """weights: {weight sharded key: its global shape} of every parameter the conversion reads."""
        self.fields: tuple[str, ...] = ()
        self.note: str | None = None
        self.meta: dict[str, str] = {}
        self.problems: list[Problem] = []
        self.sharding: set = set()
        self.scalers: list[dict] = []
        self.groups: list[dict] | None = None  # Megatron's param groups (param_groups)
        self.distributed = False
        self._where: dict[tuple[str, str], str] = {}
        parts = optimizer_parts(reader.common.get("optimizer"))
        if not parts:
            self.note = NO_OPTIMIZER_STATE
            return
        kinds = {p.get("param_state_sharding_type") for p in parts}
        self.sharding, self.scalers, self.groups = kinds, [saved_scaler(p) for p in parts], param_groups(parts)
        self.distributed = bool(kinds - {None})  # a sharding type is the distributed optimizer's
        unread = sorted(str(k) for k in kinds if k not in READ)
        if kinds == {"dp_reshardable"}:  # flat buffers: toolkit/checkpoint/megatron_flat.py reads them
            return
        if unread:
            self.note = (f"its distributed-optimizer state is saved as {', '.join(unread)}, which is not converted: "
                         "weights only. Re-save it in Megatron-LM with --dist-ckpt-optim-fully-reshardable (or its "
                         "default, dp_reshardable) to convert the optimizer state too")
            return
        for fqn in reader.tensor_names():
            m = _KEY.match(fqn)
            if m and m.group(2) in weights:
                self._where[(_FIELD[m.group(1)], m.group(2))] = fqn
        fields = ["exp_avg", "exp_avg_sq"] + ([MASTER] if sixteen_bit else [])  # fp32: the mains are the weights
        steps = {saved_step(p) for p in parts}
        if steps == {None} and not self._where:
            self.note = "its optimizer has not taken a step: weights only"
            return
        if len(steps) != 1 or None in steps:
            self.problems.append(Problem("common.pt", f"optimizer steps {sorted(map(str, steps))}, not one shared step",
                                         "convert a checkpoint saved by one Megatron optimizer"))
        for w, shape in weights.items():
            for f in fields:
                fqn = self._where.get((f, w))
                if fqn is None:
                    self.problems.append(Problem(w, f"has no optimizer {f} (optimizer.state.*.{w})",
                                                 "convert with --weights-only, or re-save the checkpoint with its "
                                                 "optimizer state"))
                elif reader.shape(fqn) != shape:
                    self.problems.append(Problem(fqn, f"has shape {reader.shape(fqn)}, its parameter {shape}",
                                                 "the optimizer state belongs to another model: re-save it"))
        self.fields = tuple(fields)
        self.meta = {"step": str(steps.pop() if len(steps) == 1 else 0),
                     "grad_scalers": json.dumps(self.scalers)}

    def key(self, field: str, weight_fqn: str) -> str:
        return self._where[(field, weight_fqn)]
