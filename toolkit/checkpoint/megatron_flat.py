"""Adam's state in Megatron-Core's flat distributed-optimizer buffers, found by parameter name.

Megatron-Core's distributed optimizer keeps the fp32 main weights and Adam's moments in flat buffers shaped like
DDP's param-and-grad buffer (`_ParamAndGradBuffer`): one per model chunk; the chunk's parameters in reverse
registration order, each starting on a multiple of 64 elements; cut into buckets, a new one after a bucket reaches
`bucket_size` elements and around a tied embedding shared between pipeline stages. Megatron-LM's default torch_dist
format for it, `dp_reshardable`, saves those buckets as they are, one tensor per bucket and field:
`optimizer.distributed.dp_group_idx_G.gbuf_idx_C.dtype_(P, G').bucket_idx_K.{param,exp_avg,exp_avg_sq}` (G: the
rank's index in its model-parallel group, tp_rank + tp x pp_rank; C: the model chunk; each tensor as long as its
bucket without the end padding), one saved chunk per parameter range and padding gap. Megatron-LM's legacy format
saves the same buckets coalesced in `distrib_optim.pt` (LegacyFlatState). Where each parameter lies is not saved.

So the layout is recomputed from the model, and accepted only when it is proved:
- the parameters of each chunk, with their TP-shard sizes, in one of Megatron's two registration orders: the local
  layer spec's, and Transformer Engine's (the input norm lives inside linear_qkv, after linear_proj; the pre-MLP norm
  inside linear_fc1, where the local spec's order has it anyway);
- laid out with the 64-element alignment, they end each bucket exactly at its saved length, and every parameter
  begins and ends on a boundary of the saved chunks. Exactly one order may fit;
- then, as each parameter is read, its fp32 main weights rounded to the model's dtype must equal its saved weights
  (the source checks it: toolkit/checkpoint/megatron_sources.py). A wrong layout cannot pass that.
"""
from __future__ import annotations

import json
import math
import re

import torch

from toolkit.checkpoint.dist_keys import FIELDS, SAVED_AS
from toolkit.checkpoint.megatron_lm import ORDERS, rank_dir, registration_order
from toolkit.checkpoint.torch_dist_optim import optimizer_parts, param_groups, saved_scaler, saved_step
from toolkit.errors import Problem, ToolkitError
from toolkit.families.entries import Entry, iter_entries
from toolkit.format import paths

ALIGN = 64
_BUCKET = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")


def is_flat_key(fqn: str) -> bool:
    return _BUCKET.match(fqn) is not None


def lay_out(params: list[tuple[str, int]], sizes: list[int]) -> dict[str, tuple[int, int, int]] | None:
    """{name: (bucket, start, end)} of parameters (name, elements), given in registration order, in buckets of the
    given unpadded lengths; None when they do not fill the buckets exactly. Each parameter starts 64-aligned within
    its bucket (buckets start on multiples of 128); a bucket is full when the next start reaches its length (the
    shared-embedding cut closes a bucket at that padded start)."""
    placed, bucket, start = {}, 0, 0
    for name, numel in reversed(params):
        start = -(-start // ALIGN) * ALIGN
        if bucket < len(sizes) and start >= sizes[bucket] and start > 0:
            if start != sizes[bucket]:
                return None
            bucket, start = bucket + 1, 0
        if bucket >= len(sizes) or start + numel > sizes[bucket]:
            return None
        placed[name] = (bucket, start, start + numel)
        start += numel
        if start == sizes[bucket]:
            bucket, start = bucket + 1, 0
    return placed if bucket == len(sizes) else None


def bucket_sizes(params: list[tuple[str, int]], bucket_size: int | None, shared: set[str]) -> list[int]:
    """The unpadded lengths of the buckets DDP cuts a chunk's buffer into (`_ParamAndGradBuffer` with the
    distributed optimizer), parameters given in registration order: laid out in reverse, each 64-aligned; a bucket
    closes after the parameter that takes it to `bucket_size` elements (None: no cut) and around a parameter in
    `shared` (the tied embedding's copies between pipeline stages), before it at its aligned start and after it."""
    sizes, start, open_ = [], 0, False
    for name, numel in reversed(params):
        start = -(-start // ALIGN) * ALIGN
        if name in shared and open_:
            sizes.append(start)
            start = 0
        end, open_ = start + numel, True
        if (bucket_size is not None and end >= bucket_size) or name in shared:
            sizes.append(end)
            start, open_ = 0, False
        else:
            start = end
    if open_:
        sizes.append(end)
    return sizes


def bucket_size(args) -> int | None:
    """The bucket size Megatron-Core's DDP gives the first chunk of the first pipeline stage for Megatron-LM's args
    (the other chunks and stages get none): `ddp_bucket_size`, by default max(40M, 1M x data_parallel_size); none
    without `overlap_grad_reduce` or with `overlap_param_gather_with_optimizer_step`."""
    if not args.overlap_grad_reduce or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * args.data_parallel_size)


def buffer_entries(dims, pp: int, vpp: int, ep: int = 1) -> dict[tuple[int, int, int | None], dict[str, Entry]]:
    """{(pipeline stage, chunk, buffer): {local-spec name: entry}} of each of Megatron's buffers: buffer None is the
    dense one; with expert parallelism (ep > 1) the routed experts' parameters are not in it (DDP puts the parameters
    whose `allreduce` is False, the experts' at ep > 1, in buffers of their own, reduced over the expert-data-parallel
    group) but in buffer e of expert-parallel rank e, under their local names there."""
    chunks: dict[tuple[int, int, int | None], dict[str, Entry]] = {}
    for e in iter_entries(dims, pp, vpp, ep):
        group = e.ep_rank if ep > 1 else None
        chunks.setdefault((e.pp_rank, e.chunk, group), {})[e.megatron_name] = e
    return chunks


def coalesced(dims, named: dict[str, Entry], order: tuple[str, ...], layout: tuple[int, int, int], p: int, c: int,
              size: int | None, dense: bool = True) -> tuple[int, dict[str, tuple[int, int]] | None]:
    """(length, {name: (start, end)}) of one chunk's parameters in distrib_optim.pt's coalesced buffer (the buckets
    without their end padding, one after the other), given Megatron's registration order and the first chunk's
    bucket size; (0, None) when the parameters do not fill the buckets (cannot happen for sizes from bucket_sizes).
    dense: the dense buffer, where the tied embedding's copies are cut off; an expert buffer has none."""
    tp, pp, vpp = layout
    shared = set()
    if dense and dims.tied and pp > 1 and (p, c) == (0, 0):
        shared.add("embedding.word_embeddings.weight")
    if dense and dims.tied and pp > 1 and (p, c) == (pp - 1, vpp - 1):
        shared.add("output_layer.weight")
    params = _params(named, order, tp)
    sizes = bucket_sizes(params, size if (p, c) == (0, 0) else None, shared)
    placed = lay_out(params, sizes)
    if placed is None:
        return 0, None
    at = [sum(sizes[:k]) for k in range(len(sizes))]
    return sum(sizes), {m: (at[k] + s, at[k] + e) for m, (k, s, e) in placed.items()}


class _Flat:
    """Adam's state in flat buffers whose layout was recomputed: `fields` and `meta` as torch_dist_optim.
    OptimizerState has them, `note` when it is not read, `problems` when the buffers cannot be this model's."""

    what = "?"  # the buffers, for messages
    way_out = "convert with --weights-only"

    def __init__(self, dims, layout: tuple[int, int, int], ep: int = 1):
        self.note, self.problems, self.order = None, [], None
        self.groups: list[dict] | None = None  # Megatron's param groups (torch_dist_optim.param_groups)
        self.distributed = True
        self.fields: tuple[str, ...] = ()
        self.meta: dict[str, str] = {}
        self._where: dict[tuple[str, int], tuple] = {}  # (entry, tp rank) -> (start, end, fetch(field, start, end))
        self._checked: set[tuple[str, ...]] = set()
        self._tp = layout[0]
        self._entries = {e.hf_names: e for e in iter_entries(dims, *layout[1:], ep) if e.reads_back}

    def read(self, hf_names, field: str, weights) -> list[torch.Tensor]:
        """A parameter's optimizer field as Hugging Face tensors, merged from its TP shards' buffer ranges. The first
        time a parameter is read, its fp32 main weights, rounded to the weights' dtype, must equal `weights()` (its
        saved Hugging Face weights): the proof that the recomputed layout is the one Megatron used."""
        entry = self._entries[tuple(hf_names)]
        shape = entry.rule.shard_shape(entry.hf_shapes, self._tp)

        def merged(f: str) -> list[torch.Tensor]:
            shards = []
            for t in range(self._tp):
                start, end, fetch = self._where[(_at(entry), t)]
                shards.append(fetch(f, start, end).view(shape))
            return list(entry.to_hf(shards).values())

        if entry.hf_names not in self._checked:
            saved = weights()
            if not all(torch.equal(m.to(w.dtype), w) for m, w in zip(merged("master"), saved)):
                raise ToolkitError(f"{self.where}: the {self.what} do not line up with the weights at "
                                   f"{entry.megatron_name} (its fp32 main weights are not its saved weights), so "
                                   f"where Megatron put each parameter is not what this model gives; {self.way_out}")
            self._checked.add(entry.hf_names)
        return merged(field)


class FlatState(_Flat):
    """The dp_reshardable optimizer state of a torch_dist checkpoint, by parameter name. With expert parallelism
    (ep > 1) Megatron-Core chains two distributed optimizers: the dense one (`chained_0.`, dp_group_idx = tp_rank +
    tp x pp_rank) and the experts' (`chained_1.`, dp_group_idx = the rank in the expert tensor x expert x pipeline
    group, tp_rank + tp x ep_rank + tp x ep x pp_rank), whose buffers hold each expert-parallel rank's own experts."""

    what = "dp_reshardable optimizer buffers"
    way_out = "convert with --weights-only, or re-save it in Megatron-LM with --dist-ckpt-optim-fully-reshardable"

    def __init__(self, reader, dims, layout: tuple[int, int, int], sixteen_bit: bool, scalers: list[dict],
                 ep: int = 1):
        super().__init__(dims, layout, ep)
        self.reader, self.where = reader, reader.dir
        tp, pp, vpp = layout
        buckets: dict[tuple[str, int, int], dict[int, dict[str, str]]] = {}
        prefixes, dtypes = set(), set()
        for fqn in reader.tensor_names():
            m = _BUCKET.match(fqn)
            if m:
                prefixes.add(m.group(1) or "")
                dtypes.add(m.group(4))
                buckets.setdefault((m.group(1) or "", int(m.group(2)), int(m.group(3))), {}).setdefault(
                    int(m.group(5)), {})[FIELDS[m.group(6)]] = fqn
        chained = ("chained_0.", "chained_1.") if ep > 1 else None
        if len(dtypes) > 1 or (set(chained) != prefixes if chained else len(prefixes) > 1):
            what = (f"in {len(dtypes)} dtypes" if len(dtypes) > 1 else f"of the optimizers {sorted(prefixes)}, where "
                    f"this model at ep={ep} has {'two chained ones' if chained else 'one'}")
            self.note = (f"its distributed-optimizer state is saved as dp_reshardable flat buffers {what}, which is not "
                         "converted: weights only. Re-save it in Megatron-LM with --dist-ckpt-optim-fully-reshardable "
                         "to convert the optimizer state too")
            return
        dense = chained[0] if chained else next(iter(prefixes), "")
        want = {(dense, t + tp * p, c): (p, t, c, None) for p in range(pp) for t in range(tp) for c in range(vpp)}
        if chained:  # each expert-parallel rank's experts
            want.update({(chained[1], t + tp * e + tp * ep * p, c): (p, t, c, e) for p in range(pp)
                         for t in range(tp) for e in range(ep) for c in range(vpp)})
        if set(buckets) != set(want):
            self.problems.append(Problem("optimizer.distributed", f"holds buffers for (optimizer, model-parallel "
                                         f"rank, chunk) {sorted(buckets)[:4]}, but tp={tp} pp={pp} vpp={vpp} ep={ep} "
                                         f"gives {sorted(want)[:4]}", "the optimizer state belongs to another "
                                         "layout: re-save the checkpoint"))
            return
        chunks = buffer_entries(dims, pp, vpp, ep)
        orders = set()
        for (prefix, g, c), found in sorted(buckets.items()):
            p, t, _, group = want[(prefix, g, c)]
            where = f"{prefix}optimizer.distributed.dp_group_idx_{g}.gbuf_idx_{c}"
            ks = sorted(found)
            if ks != list(range(len(ks))) or any(set(found[k]) != set(FIELDS.values()) for k in ks):
                self.problems.append(Problem(where, f"has buckets {ks} with fields {[sorted(found[k]) for k in ks][:2]}",
                                             "the checkpoint is incomplete: re-copy it"))
                continue
            sizes = [reader.shape(found[k]["master"])[0] for k in ks]
            if any(reader.shape(found[k][f]) != (sizes[k],) for k in ks for f in FIELDS.values()):
                self.problems.append(Problem(where, "has fields of different lengths", "re-copy the checkpoint"))
                continue
            named = chunks[(p, c, group)]
            edges = [{x for b in reader.chunk_bounds(found[k]["master"]) for x in b} for k in ks]
            fits = {}
            for name, order in ORDERS.items():
                placed = lay_out(_params(named, order, tp), sizes)
                if placed and all(s in edges[k] and e in edges[k] for k, s, e in placed.values()):
                    fits[name] = placed
            if group is not None and fits:  # an expert buffer is the same in both orders
                fits = dict([next(iter(fits.items()))])
            if len(fits) != 1:
                self.problems.append(Problem(
                    where, f"has buckets of {sizes} elements, which fit {'both' if fits else 'neither'} of Megatron's "
                    f"parameter orders (local and Transformer Engine layer specs) for pipeline stage {p}, chunk {c} of "
                    "this model" + ("" if group is None else f", expert-parallel rank {group} of {ep}"),
                    self.way_out))
                continue
            (order, placed), = fits.items()
            if group is None:
                orders.add(order)
            for n, (k, s, e) in placed.items():
                self._where[(_at(named[n]), t)] = (s, e, _ranges(reader, found[k]))
        if len(orders) > 1:
            self.problems.append(Problem("optimizer.distributed", "the ranks' buffers fit different layer specs",
                                         "re-copy the checkpoint"))
        self.order = orders.pop() if len(orders) == 1 else None
        steps = {float(s) for s in self._steps() if s is not None}
        if len(steps) != 1:
            self.problems.append(Problem("optimizer.distributed.*.optimizer", f"optimizer steps {sorted(steps)}, not "
                                         "one shared step", "convert a checkpoint saved by one Megatron optimizer"))
        self.fields = ("exp_avg", "exp_avg_sq") + (("master",) if sixteen_bit else ())
        self.meta = {"step": str(int(steps.pop()) if len(steps) == 1 else 0), "grad_scalers": json.dumps(scalers)}

    def _steps(self) -> list:
        """The Adam steps in the param groups of each model-parallel rank's saved inner optimizer."""
        steps = []
        for name in self.reader.objects():
            if re.match(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.optimizer/", name):
                obj = self.reader.get_object(name)
                if self.groups is None and not name.startswith("chained_1."):  # the dense optimizer's
                    self.groups = param_groups(obj if isinstance(obj, list) else [obj])
                for part in obj if isinstance(obj, list) else [obj]:
                    groups = part.get("param_groups") if isinstance(part, dict) else None
                    steps += [g.get("step") for g in groups or [] if isinstance(g, dict)]
        return steps


def _at(entry: Entry) -> str:
    return f"{entry.pp_rank}.{entry.chunk}.{entry.ep_rank}.{entry.megatron_name}"


def _params(named: dict[str, Entry], order: tuple[str, ...], tp: int) -> list[tuple[str, int]]:
    """(name, elements of its TP shard) of a chunk's parameters, in registration order."""
    return [(n, math.prod(named[n].rule.shard_shape(named[n].hf_shapes, tp))) for n in registration_order(named, order)]


def _ranges(reader, fqns: dict[str, str]):
    return lambda field, start, end: reader.get_range(fqns[field], start, end)


class LegacyFlatState(_Flat):
    """The distributed optimizer's state in a Megatron-LM legacy checkpoint, by parameter name.

    Megatron-LM's save_checkpoint (`--ckpt-format torch`) writes `distrib_optim.pt` beside each model-parallel rank's
    model_optim_rng.pt: the optimizer's save_parameter_state, gathered from every DP rank onto the first. For each
    model chunk C it holds {C: {(param dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": one fp32 tensor,
    "numel_unpadded"}}}, with "buckets_coalesced": True: the chunk's buckets without their end padding, one after the
    other. Neither where the parameters lie nor where the buckets end is saved. The cuts follow from Megatron-LM's
    args as DDP makes them: buckets of `ddp_bucket_size` elements (default max(40M, 1M x data_parallel_size)), none
    without `overlap_grad_reduce` (or with `overlap_param_gather_with_optimizer_step`), on pipeline stages after the
    first, or in chunks after the first. The layout is accepted when the buckets add up to the saved length, one
    registration order fits (Transformer Engine's or the local spec's, told apart by the norms' main weights), and,
    as each parameter is read, its main weights rounded to the weights' dtype equal its saved weights."""

    what = "distrib_optim.pt buffers"

    def __init__(self, it_dir, args, dims, layout: tuple[int, int, int], sixteen_bit: bool, optimizers: dict,
                 weight, load, files: dict | None = None, ep: int = 1):
        """optimizers: {rank: model_optim_rng.pt's "optimizer"}; weight(pp, tp, chunk, name): a saved weight shard
        (of expert-parallel rank 0); load(path): a file's contents through the allow-list; files: {(pp, tp, ep rank):
        its save_parameter_state file}, Megatron-LM's mp_rank_*/distrib_optim.pt unless given (the toolkit's own:
        distopt_tpTT_ppPPP[_epEEE].pt). With expert parallelism (ep > 1) Megatron-Core chains two distributed
        optimizers, the dense one and the experts' (over the expert-data-parallel group), and each file holds a list
        of their two states: the dense state in expert-parallel rank 0's file (None in the others), and that rank's
        experts' state."""
        super().__init__(dims, layout, ep)
        self.where = it_dir
        tp, pp, vpp = layout
        files = files or {(p, t, e): it_dir / rank_dir(t, p, pp, e, ep) / "distrib_optim.pt" for p in range(pp)
                          for t in range(tp) for e in range(ep)}
        present = [f for f in files.values() if f.is_file()]
        paths.check_tree(it_dir, present, f"Megatron-LM checkpoint {it_dir}")  # no link out of the folder
        odd = [str(f.relative_to(it_dir)) for f in files.values() if f.exists() and not f.is_file()]
        if odd:  # not "no optimizer state": a damaged one
            self.problems.append(Problem(", ".join(odd[:4]), "is not a regular file",
                                         "replace it with the file the checkpoint was saved with, or convert with "
                                         "--weights-only"))
            return
        if not present:
            self.note = "it holds no distrib_optim.pt files (saved with --no-save-optim?): weights only"
            return
        if len(present) != len(files):
            missing = [str(f.relative_to(it_dir)) for f in files.values() if not f.is_file()]
            self.problems.append(Problem(", ".join(missing[:4]), "is missing, though other ranks have theirs",
                                         "re-copy the checkpoint, or convert with --weights-only"))
            return
        need = [k for k in ("overlap_grad_reduce", "data_parallel_size") if not hasattr(args, k)]
        if need:
            self.note = (f"its args lack {', '.join(need)}, which fix where the distributed optimizer put each "
                         "parameter: weights only")
            return
        size = bucket_size(args)
        chunks = buffer_entries(dims, pp, vpp, ep)
        orders = set()
        for (p, t, e), f in sorted(files.items()):
            rel = str(f.relative_to(it_dir))
            for group, state, at in self._states(load(f), e, ep, rel):
                for c in range(vpp):
                    named = chunks[(p, c, group)]
                    gbuf = state.get(c)
                    tensors = next(iter(gbuf.values())) if isinstance(gbuf, dict) and len(gbuf) == 1 else None
                    n = tensors.get("numel_unpadded") if isinstance(tensors, dict) else None
                    if not isinstance(n, int) or any(not torch.is_tensor(tensors.get(k)) or
                                                     tensors[k].shape != (n,) for k in FIELDS):
                        self.problems.append(Problem(f"{at} [{c}]", "does not hold one buffer of param, exp_avg and "
                                                     "exp_avg_sq of numel_unpadded elements",
                                                     "re-copy the checkpoint, or convert with --weights-only"))
                        continue
                    fits = {}
                    for name, order in ORDERS.items():
                        total, placed = coalesced(dims, named, order, layout, p, c, size, group is None)
                        if placed and total == n:
                            fits[name] = placed
                    decided = len({tuple(sorted(v.items())) for v in fits.values()}) > 1
                    if decided:  # told apart by the norms' mains
                        fits = {o: pl for o, pl in fits.items() if all(
                            torch.equal(tensors["param"][s:e_].to(w.dtype), w.flatten())
                            for m, (s, e_) in pl.items() if m.endswith("layernorm.weight")
                            for w in [weight(p, t, c, m)])}
                        if not fits:
                            self.problems.append(Problem(f"{at} [{c}]", "its main weights do not line up with the "
                                                         "saved weights (the norms') in either of Megatron's "
                                                         "parameter orders", self.way_out))
                            continue
                    if not fits:
                        self.problems.append(Problem(
                            f"{at} [{c}]", f"holds {n} elements, which no layout of Megatron's parameter orders "
                            f"(local and Transformer Engine layer specs) gives for pipeline stage {p}, chunk {c} of "
                            f"this model{'' if group is None else f', expert-parallel rank {group} of {ep}'} with "
                            f"buckets of {size or 'any'} elements", "convert with --weights-only"))
                        continue
                    order, placed = next(iter(fits.items()))
                    if decided or group is None:  # an expert buffer is the same in both orders
                        orders.add(order)
                    fetch = (lambda ts: lambda field, s, e_: ts[SAVED_AS[field]][s:e_])(tensors)
                    for m, (s, e_) in placed.items():
                        self._where[(_at(named[m]), t)] = (s, e_, fetch)
        steps = {saved_step(x) for o in optimizers.values() for x in optimizer_parts(o)}
        if self.problems:
            return
        if len(steps) != 1 or None in steps:
            self.problems.append(Problem("model_optim_rng.pt", f"optimizer steps {sorted(map(str, steps))}, not one "
                                         "shared step", "convert a checkpoint saved by one Megatron optimizer"))
        self.order = orders.pop() if len(orders) == 1 else None
        self.fields = ("exp_avg", "exp_avg_sq") + (("master",) if sixteen_bit else ())
        self.groups = param_groups(optimizer_parts(next(iter(optimizers.values()))))
        scalers = [saved_scaler(x) for x in optimizer_parts(next(iter(optimizers.values())))]
        self.meta = {"step": str(steps.pop() if len(steps) == 1 else 0), "grad_scalers": json.dumps(scalers)}

    def _states(self, state, e: int, ep: int, rel: str) -> list[tuple[int | None, dict, str]]:
        """(buffer, its save_parameter_state dict, where) of one file: the dense optimizer's (buffer None) and, with
        expert parallelism, expert-parallel rank e's experts' (buffer e)."""
        parts = state if isinstance(state, list) else [state]
        want = 2 if ep > 1 else 1
        dense = [(None, parts[0], rel)] if e == 0 or ep == 1 else []
        out = dense + ([(e, parts[1], f"{rel} (the experts' optimizer)")] if ep > 1 and len(parts) == 2 else [])
        if len(parts) != want or not all(isinstance(x, dict) and x.get("buckets_coalesced") is True
                                         for _, x, _ in out):
            self.problems.append(Problem(rel, "is not the coalesced per-chunk buffers Megatron-Core 0.16's "
                                         "save_parameter_state writes" + (f" for its {want} chained optimizers (dense "
                                         "and experts')" if ep > 1 else "") + " (an older or another optimizer's file)",
                                         "convert with --weights-only"))
            return []
        return out
