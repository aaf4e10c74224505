"""Every valid layout of a recipe on N GPUs, estimated, ranked by step time, and the reason for each choice.

The enumeration follows the source documents' decision order: data parallel with the least ZeRO sharding that
fits, offload only when nothing fits on the GPUs, tensor parallel inside a node, pipeline parallel for depth,
context parallel for long sequences, recomputation only as much as memory needs. Validity is the recipe's own
rules (heads divisible by tp, layers by pp x vpp, ...), so the planner never proposes what `validate` refuses.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from toolkit.metrics import count_params
from toolkit.plan import activations as act
from toolkit.plan.choice import Choice, apply
from toolkit.plan.estimate import Estimate, estimate
from toolkit.plan.hardware import Cluster
from toolkit.recipe.checks import check_backend, check_model_parallel, check_offload
from toolkit.recipe.schema import Recipe

BACKENDS = ("deepspeed", "megatron")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_options(r: Recipe) -> list[int]:
    return sorted({1, r.training.micro_batch_size or 1})


def _valid(r: Recipe, c: Choice) -> bool:
    rc = apply(r, c)
    if check_model_parallel(rc) or check_backend(rc) or check_offload(rc):
        return False
    if c.cp > 1 and r.parallel.megatron.transformer_impl == "local":
        return False  # context parallelism lives in Transformer Engine's attention
    return not (c.backend == "megatron" and c.vpp > 1 and c.accum % c.pp)


def _deepspeed(r: Recipe, n: int, global_batch: int) -> Iterator[Choice]:
    for micro in _micro_options(r):
        if global_batch % (micro * n):
            continue
        accum = global_batch // (micro * n)
        for zero in (0, 1, 2, 3):
            for opt in ("none", "cpu", "nvme"):
                for params in (("none", "cpu", "nvme") if zero == 3 else ("none",)):
                    for rec in ("none", "full"):
                        yield Choice("deepspeed", n, zero=zero, offload_optimizer=opt, offload_params=params,
                                     recompute=rec, micro=micro, accum=accum)


def _megatron(r: Recipe, cluster: Cluster, global_batch: int) -> Iterator[Choice]:
    n, layers = cluster.gpus, r.model.num_layers
    for tp in [t for t in _divisors(cluster.gpus_per_node) if n % t == 0]:
        for cp in [c for c in (1, 2, 4, 8, 16, 32) if n % (tp * c) == 0]:
            for pp in [p for p in _divisors(layers) if n % (tp * cp * p) == 0]:
                dp = n // (tp * cp * pp)
                for micro in _micro_options(r):
                    if global_batch % (micro * dp):
                        continue
                    accum = global_batch // (micro * dp)
                    vpps = [1] + [v for v in _divisors(layers // pp) if v > 1 and pp > 1]
                    # mixture of experts: every ep dividing the experts and dp x cp
                    eps = [e for e in _divisors(dp * cp) if (r.model.num_experts or 1) % e == 0]
                    for vpp in vpps:
                        for ep in eps:
                            for zero in (0, 1):
                                for rec in ("none", "selective", "full"):
                                    yield Choice("megatron", dp, tp, pp, vpp, cp, tp > 1, zero, recompute=rec,
                                                 micro=micro, accum=accum, ep=ep)


def candidates(r: Recipe, cluster: Cluster, global_batch: int, backends=BACKENDS) -> list[Choice]:
    out: list[Choice] = []
    if "deepspeed" in backends:
        out += _deepspeed(r, cluster.gpus, global_batch)
    if "megatron" in backends:
        out += _megatron(r, cluster, global_batch)
    return [c for c in out if _valid(r, c)]


TOLERANCE = 0.10
"""Step-time estimates closer than this are ties: the time model is not more precise than that, so among them
the layout earliest in the decision order wins (fewer moving parts, the recipe's own backend)."""


def long_context(r: Recipe) -> tuple[bool, int, int]:
    """(whether the sequence, not the model, is the problem; activation bytes of one sequence through all layers
    unsplit and without recomputation; model-state bytes of the whole model at 16 bytes per parameter)."""
    acts = r.model.num_layers * act.layer_activation_bytes(r.model, r.data.seq_len, 1, precision=r.training.precision,
                                                           impl="megatron", attention="flash")
    states = 16 * count_params(r.model)["total"]
    return acts > states, acts, states


def _decision_order(c: Choice, backend: str, long: bool) -> tuple:
    """Fewer moving parts first: no offload, the recipe's backend, then the parallel dimensions in the order the
    binding constraint asks for (long sequences: context parallel before tensor parallel; big models: tensor
    parallel inside a node before pipeline, pipeline before context; then expert parallel), the lowest ZeRO stage
    (ZeRO-2 with CPU offload, the combination ZeRO-Offload is built on), the least recomputation."""
    dims = (c.pp, c.tp, c.cp) if long else (c.cp, c.pp, c.tp)
    zero = abs(c.zero - 2) if c.offload_optimizer != "none" else c.zero
    return (c.offload_params != "none", c.offload_optimizer != "none", c.backend != backend, *dims, c.ep, zero,
            ("none", "selective", "full").index(c.recompute), c.vpp, -c.micro)


@dataclass
class Search:
    estimates: list[Estimate]
    """Every valid layout: the chosen one first, then the others that fit by step time, then those that do not
    fit by memory."""

    @property
    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    @property
    def best(self) -> Estimate | None:
        return self.estimates[0] if self.estimates and self.estimates[0].fits else None


def search(r: Recipe, cluster: Cluster, global_batch: int, backends=BACKENDS) -> Search:
    cache: dict = {}
    ests = [estimate(r, c, cluster, cache) for c in candidates(r, cluster, global_batch, backends)]
    fit = sorted((e for e in ests if e.fits), key=lambda e: e.step_s)
    rest = sorted((e for e in ests if not e.fits), key=lambda e: e.memory.gpu)
    if fit:
        ties = [e for e in fit if e.step_s <= fit[0].step_s * (1 + TOLERANCE)]
        long = long_context(r)[0]
        chosen = min(ties, key=lambda e: _decision_order(e.choice, r.parallel.backend, long))
        fit.remove(chosen)
        fit.insert(0, chosen)
    return Search(fit + rest)


# ---- why ----------------------------------------------------------------------------------------------------------

# The decision order, as (field, heading): each line of the reasons compares the chosen value with the others.
ORDER = [("backend", "backend"),
         ("zero", "1. data parallel, sharding only as far as memory needs (DDP/ZeRO-1 -> ZeRO-2 -> ZeRO-3)"),
         ("offload_optimizer", "2. offload optimizer states only when nothing fits on the GPUs"),
         ("offload_params", "2. offload parameters (ZeRO-Infinity) only as a last resort"),
         ("tp", "3. tensor parallel inside a node, for layers too big for one GPU"),
         ("pp", "4. pipeline parallel, for many layers (across nodes)"),
         ("vpp", "4b. interleaved pipeline chunks, to shrink the bubble"),
         ("cp", "5. context parallel, for long sequences"),
         ("ep", "5b. expert parallel (mixture of experts), when the experts do not fit or their gradients' reduction "
                "costs more than an all-to-all per MoE layer"),
         ("recompute", "6. recompute activations only as much as memory needs"),
         ("micro", "micro-batch size")]


def _value(c: Choice, name: str) -> str:
    v = getattr(c, name)
    if name == "zero":
        return f"ZeRO-{v}" if c.backend == "deepspeed" else ("Megatron distributed optimizer" if v else "Megatron DDP")
    return str(v)


def reasons(r: Recipe, best: Estimate, s: Search) -> list[str]:
    """For each decision in the order, the chosen value and the best layout with each other value: how much
    slower it is, or why it does not fit. Estimates are ranked, so the first one seen per value is its best."""
    fastest = min((e for e in s.fitting), key=lambda e: e.step_s)
    long, acts, states = long_context(r)
    gib = 2**30
    out = [f"the binding constraint: one sequence's activations through all layers ({acts / gib:,.0f} GiB unsplit) "
           + ("outweigh" if long else "are below") + f" the model states ({states / gib:,.0f} GiB): "
           + ("the sequence is the problem, so context parallel comes before tensor and pipeline parallel" if long
              else "the model is the problem, so tensor parallel (inside a node), then pipeline, before context")]
    if fastest is not best:
        out.append(f"estimates within {TOLERANCE:.0%} are ties (the time model is not more precise): the fastest, "
                   f"{fastest.choice.label()} at {fastest.step_s:.1f} s, is {best.step_s / fastest.step_s - 1:.0%} "
                   "ahead, so #1 is the tie earliest in the decision order")
    for name, heading in ORDER:
        first: dict[str, Estimate] = {}
        for e in s.estimates:
            first.setdefault(_value(e.choice, name), e)
        chosen = _value(best.choice, name)
        parts = []
        for v, e in first.items():
            if v == chosen:
                continue
            if e.fits:
                parts.append(f"{v}: {e.step_s / best.step_s - 1:+.0%} step time at best ({e.choice.label()})")
            else:
                parts.append(f"{v}: does not fit ({e.problems[0]}, smallest: {e.choice.label()})")
        if parts:
            out.append(f"{heading}: {chosen}\n      " + "\n      ".join(parts))
    return out


def nearest_fit(s: Search, r: Recipe, cluster: Cluster, global_batch: int, backends=BACKENDS) -> list[str]:
    """When nothing fits: what is missing, in terms a user can change (bigger GPUs, more host memory or NVMe,
    more GPUs), each with the layout it would make fit."""
    if not s.estimates:
        return [_no_layout(r, cluster, global_batch, backends)]
    gib, out = 2**30, []
    host_ok = [e for e in s.estimates if not any(p.startswith(("CPU", "NVMe")) for p in e.problems)]
    if host_ok:
        small = min(host_ok, key=lambda e: e.memory.gpu)
        need = small.memory.gpu / gib / cluster.headroom + cluster.reserve_gib
        out.append(f"GPU memory: the smallest footprint is {small.memory.gpu / gib:,.1f} GiB per GPU "
                   f"({small.choice.label()}), {cluster.usable_gpu_bytes / gib:,.1f} GiB are usable: GPUs of "
                   f"{need:,.0f} GiB or more would fit it")
    gpu_ok = [e for e in s.estimates if not any(p.startswith("GPU") for p in e.problems)]
    if gpu_ok:
        small = min(gpu_ok, key=lambda e: (e.memory.cpu_per_node, e.memory.nvme_per_node))
        out.append(f"host memory: {small.choice.label()} fits the GPUs, but "
                   + "; ".join(p for p in small.problems))
    for more in (2, 4, 8, 16):
        bigger = Cluster(**{**cluster.__dict__, "gpus": cluster.gpus * more})
        found = search(r, bigger, global_batch, backends).best
        if found:
            out.append(f"more GPUs: {bigger.gpus} would fit ({found.choice.label()}, "
                       f"{found.memory.gpu / gib:,.1f} GiB per GPU)")
            break
    else:
        out.append(f"more GPUs: not even {16 * cluster.gpus} fit at global batch {global_batch}")
    if "deepspeed" not in backends:
        out.append("offload: only the deepspeed backend offloads to CPU/NVMe (try --backend any)")
    return out


def _no_layout(r: Recipe, cluster: Cluster, global_batch: int, backends) -> str:
    """Why no layout of these GPUs is valid: the batch (no micro-batch x data-parallel size divides the global
    batch) or the model (heads, layers or experts divide over none of those that do)."""
    batched = [c for c in (*(_deepspeed(r, cluster.gpus, global_batch) if "deepspeed" in backends else ()),
                           *(_megatron(r, cluster, global_batch) if "megatron" in backends else ()))]
    if not batched:
        fit = -(-global_batch // cluster.gpus) * cluster.gpus
        return (f"no valid layout: global batch {global_batch} is not divisible by micro-batch x data-parallel size "
                f"in any layout of {cluster.gpus} GPUs; a multiple of {cluster.gpus} is "
                f"(e.g. --set training.global_batch_size={fit})")
    dps = sorted({c.dp for c in batched})
    return (f"no valid layout: global batch {global_batch} divides only over data-parallel size "
            f"{', '.join(map(str, dps))} on {cluster.gpus} GPUs, and the model's heads, layers or experts do not "
            f"divide over the tensor/pipeline/expert sizes that leaves; a global batch that is a multiple of "
            f"{cluster.gpus} opens the others (`toolkit validate --world-size {cluster.gpus}` names the problems)")
