"""The plain optimizer's state (`--use-distributed-optimizer` off, Megatron-LM's default) by parameter name: read
from a Megatron-LM legacy checkpoint, and laid out for one.

Megatron-LM's save_checkpoint puts the optimizer's `state_dict()` in each model-parallel rank's model_optim_rng.pt.
For a 16-bit model (Float16OptimizerWithFloat16Params) that is {"optimizer": torch's state dict,
"fp32_from_fp16_params": the fp32 main weights, one list per param group[, "grad_scaler"]}; for an fp32 model
(FP32Optimizer) torch's state dict itself. Torch's state dict keys each parameter's state by its position: "state" {i: {"exp_avg", "exp_avg_sq"[,
"step"]}} and "param_groups" [{..., "params": [i, ...]}]. No name is saved.

The positions follow from how Megatron-Core builds the param groups (`_get_param_groups`): the rank's model chunks'
`named_parameters()` one chunk after the other, each parameter put in the group of its weight-decay multiplier (0 for
biases and 1-D parameters, Megatron-LM's standard rule; `--apply-wd-to-qk-layernorm` leaves the q/k norms at 1), the
groups in the saved order. The registration order is the checkpoint's own: a chunk's state dict lists its parameters
in the order named_parameters() does, so local and Transformer Engine files alike give it. Groups are matched by their
saved `wd_mult`, never by position. The layout is accepted when it is proved: every group holds exactly the parameters
the rule gives it, each state tensor has its parameter's shape, and, as each parameter is read, its fp32 main weights
rounded to the model's dtype equal its saved weights (16-bit models; an fp32 model's mains are its weights).

A mixture of experts at expert parallelism > 1 has two chained optimizers, each with such a state dict: the dense
parameters' and the routed experts' (Megatron-Core builds the experts' own optimizer, its groups marked
`is_expert_parallel`), so `optimizer` is a list of the two, and each expert-parallel rank's file holds its own
experts' state (local indices) and a copy of the dense state. At ep 1 the experts are in the one optimizer.
"""
from __future__ import annotations

import json

import torch

from toolkit.checkpoint.megatron_flat import buffer_entries
from toolkit.checkpoint.megatron_lm import LOCAL_ORDER, registration_order
from toolkit.checkpoint.torch_dist_optim import optimizer_parts, param_groups, saved_scaler
from toolkit.errors import Problem, ToolkitError
from toolkit.families.entries import iter_entries

FIELDS = ("exp_avg", "exp_avg_sq")


def wd_mult(name: str, ndim: int, args) -> float:
    """The weight-decay multiplier Megatron-Core's standard param groups give a parameter."""
    no_wd = ndim == 1 or name.endswith(".bias")
    if getattr(args, "apply_wd_to_qk_layernorm", False) and ("q_layernorm." in name or "k_layernorm." in name):
        no_wd = False
    return 0.0 if no_wd else 1.0


def _inner(part: dict, sixteen_bit: bool) -> tuple[dict | None, list | None]:
    """(torch's optimizer state dict, the fp32 mains per group or None) of one saved plain Megatron optimizer."""
    opt = part.get("optimizer") if sixteen_bit else part
    mains = part.get("fp32_from_fp16_params") if sixteen_bit else None
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(
            opt.get("param_groups"), list) or (sixteen_bit and not isinstance(mains, list)):
        return None, None
    return opt, mains


def _step(opt: dict):
    """The one Adam step of a torch state dict: per parameter (torch's Adam) or in the param groups (fused Adams)."""
    found = [s["step"] for s in opt["state"].values() if isinstance(s, dict) and "step" in s]
    found += [g["step"] for g in opt["param_groups"] if isinstance(g, dict) and g.get("step") is not None]
    return {float(s) if isinstance(s, (int, float)) or (torch.is_tensor(s) and s.numel() == 1) else str(s)
            for s in found}


class PlainLegacyState:
    """The plain optimizer's state of a Megatron-LM legacy checkpoint, by parameter name; see the module docstring.
    `fields`, `meta`, `groups`, `note` and `problems` as toolkit/checkpoint/megatron_flat.py's states have them."""

    def __init__(self, it_dir, args, dims, layout: tuple[int, int, int], sixteen_bit: bool, optimizers: dict,
                 order: dict, ep: int = 1):
        """optimizers: {rank_key(pp, tp, ep rank, ep): model_optim_rng.pt's "optimizer"}; order: {the same key: [[chunk's
        saved names in file order] per chunk]}; each saved tensor's shape is read from the state itself."""
        self.where, self.note, self.problems = it_dir, None, []
        self.fields: tuple[str, ...] = ()
        self.meta: dict[str, str] = {}
        self.groups: list[dict] | None = None
        self.distributed, self.order = False, None
        self._tp, self._sixteen = layout[0], sixteen_bit
        self._entries = {e.hf_names: e for e in iter_entries(dims, *layout[1:], ep) if e.reads_back}
        self._at: dict[tuple[str, int], tuple[dict, torch.Tensor | None]] = {}  # (entry, tp) -> (state, main)
        self._checked: set = set()
        if getattr(args, "decoupled_lr", None) is not None:
            self.note = "its optimizer has --decoupled-lr param groups, which are not converted: weights only"
            return
        tp, pp, vpp = layout
        chunks = buffer_entries(dims, pp, vpp, ep)
        steps, groups = set(), None
        for key, saved in sorted(optimizers.items()):
            p, t, e = key if ep > 1 else (*key, 0)
            rel = (f"{it_dir.name}/mp_rank_{t:02d}{'' if pp == 1 else f'_{p:03d}'}{'' if ep == 1 else f'_{e:03d}'}"
                   "/model_optim_rng.pt")
            parts = optimizer_parts(saved)
            if len(parts) != (2 if ep > 1 else 1):
                self.note = f"its optimizer is {len(parts)} chained optimizers, which are not converted: weights only"
                return
            for part, buffer in zip(parts, (None, e)):  # the dense optimizer, then at ep > 1 the experts'
                step = self._part(part, buffer, chunks, order[key], p, t, rel, args)
                if step is None:
                    break
                steps |= step
            groups = groups or param_groups(parts)
        if self.problems:
            return
        if len(steps) != 1 or not isinstance(next(iter(steps)), float):
            self.problems.append(Problem("model_optim_rng.pt", f"optimizer steps {sorted(map(str, steps))}, not one "
                                         "shared step",
                                         "convert a checkpoint saved by one Megatron optimizer"))
            return
        self.fields = FIELDS + (("master",) if sixteen_bit else ())
        self.groups = groups
        scalers = [saved_scaler(x) for x in optimizer_parts(next(iter(optimizers.values())))]
        self.meta = {"step": str(int(steps.pop())), "grad_scalers": json.dumps(scalers)}

    def _part(self, part: dict, buffer: int | None, chunks: dict, order: list, p: int, t: int, rel: str,
              args) -> set | None:
        """Place one saved optimizer's state (the dense one's, or expert-parallel rank `buffer`'s experts'); its Adam
        steps, or None after a problem."""
        tp, vpp, sixteen_bit = self._tp, len(order), self._sixteen
        opt, mains = _inner(part, sixteen_bit)
        if opt is None:
            self.problems.append(Problem(f"{rel} optimizer", "is not the state_dict of Megatron-Core's "
                                         f"{'Float16Optimizer' if sixteen_bit else 'FP32Optimizer'}",
                                         "convert with --weights-only"))
            return None
        named = {}  # this rank's parameters, in registration order: {(chunk, name): entry}
        for c in range(vpp):
            known = chunks[(p, c, buffer)]
            for n in order[c]:
                if n in known:
                    named[(c, n)] = known[n]
        by_wd: dict[float, list] = {}
        for (c, n), e in named.items():
            shape = e.rule.shard_shape(e.hf_shapes, tp)
            by_wd.setdefault(wd_mult(n, len(shape), args), []).append((c, n, e, tuple(shape)))
        saved_wd = [g.get("wd_mult") if isinstance(g, dict) else None for g in opt["param_groups"]]
        if sorted(map(str, saved_wd)) != sorted(map(str, by_wd)) or len(set(map(str, saved_wd))) != len(saved_wd):
            self.problems.append(Problem(f"{rel} optimizer", f"has param groups with wd_mult {saved_wd}, but "
                                         f"Megatron's standard groups of this model give {sorted(by_wd)}"
                                         + ("" if buffer is None else " for its experts"),
                                         "convert with --weights-only"))
            return None
        for g, (wd, group) in enumerate(zip(saved_wd, opt["param_groups"])):
            want, ids = by_wd[wd], group.get("params")
            main_group = mains[g] if mains is not None and g < len(mains) else None
            if not isinstance(ids, list) or len(ids) != len(want) or (
                    mains is not None and (not isinstance(main_group, list) or len(main_group) != len(want))):
                self.problems.append(Problem(f"{rel} optimizer", f"param group {g} (wd_mult {wd}) holds "
                                             f"{len(ids) if isinstance(ids, list) else '?'} parameters, this model "
                                             f"{len(want)} on this rank", "convert with --weights-only"))
                return None
            for i, (pid, (c, n, e, shape)) in enumerate(zip(ids, want)):
                st = opt["state"].get(pid) if isinstance(pid, int) else None
                main = main_group[i] if main_group is not None else None
                bad = not isinstance(st, dict) or any(not torch.is_tensor(st.get(f)) or tuple(st[f].shape) != shape
                                                      for f in FIELDS)
                if bad or (main is not None and (not torch.is_tensor(main) or tuple(main.shape) != shape)):
                    self.problems.append(Problem(f"{rel} optimizer", f"state {pid} is not shaped as {n} {shape}, "
                                                 "the parameter its position gives", "convert with --weights-only"))
                    return None
                if e.reads_back:
                    self._at[(_key(e), t)] = (st, main)
        return _step(opt)

    def read(self, hf_names, field: str, weights) -> list[torch.Tensor]:
        """A parameter's optimizer field as Hugging Face tensors, merged from its TP shards. The first time a
        parameter is read, its fp32 main weights rounded to the weights' dtype must equal `weights()`."""
        entry = self._entries[tuple(hf_names)]

        def merged(f: str) -> list[torch.Tensor]:
            shards = [self._at[(_key(entry), t)] for t in range(self._tp)]
            return list(entry.to_hf([(main if f == "master" else st[f]).float() for st, main in shards]).values())

        if self._sixteen and entry.hf_names not in self._checked:
            if not all(torch.equal(m.to(w.dtype), w) for m, w in zip(merged("master"), weights())):
                raise ToolkitError(f"{self.where}: the plain optimizer's state does not line up with the weights at "
                                   f"{entry.megatron_name} (its fp32 main weights are not its saved weights), so the "
                                   "parameter order is not what this model gives; convert with --weights-only")
            self._checked.add(entry.hf_names)
        return merged(field)


def _key(entry) -> str:
    return f"{entry.pp_rank}.{entry.chunk}.{entry.ep_rank}.{entry.megatron_name}"


def wd_groups(dims, args) -> set[float]:
    """The weight-decay multipliers of Megatron-Core's standard param groups for this model."""
    return {wd_mult(e.megatron_name, len(e.rule.shard_shape(e.hf_shapes, 1)), args) for e in iter_entries(dims, 1, 1)}


def positions(dims, layout: tuple[int, int, int], p: int, groups: list[dict], args, buffer: int | None = None,
              ep: int = 1) -> list[list[tuple[int, str]]]:
    """Where Megatron-Core's plain optimizer puts a rank's parameters at a layout of the local spec: for each of
    `groups` (matched by wd_mult), its (chunk, local-spec name) in position order. At ep > 1, of the dense
    optimizer (buffer None) or of expert-parallel rank `buffer`'s experts' optimizer."""
    tp, pp, vpp = layout
    chunks = buffer_entries(dims, pp, vpp, ep)
    out = [[] for _ in groups]
    index = {g.get("wd_mult"): i for i, g in enumerate(groups)}
    for c in range(vpp):
        named = chunks[(p, c, buffer)]
        for n in registration_order(named, LOCAL_ORDER):
            shape = named[n].rule.shard_shape(named[n].hf_shapes, tp)
            out[index[wd_mult(n, len(shape), args)]].append((c, n))
    return out
