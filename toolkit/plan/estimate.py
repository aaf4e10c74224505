"""Memory, FLOPs, communication and step time of one layout on one cluster: the numbers `toolkit plan` prints.

Model states come from the per-framework accounting (deepspeed_states, megatron_states), pinned to real
allocations by tests; activations from the per-op accounting (activations), pinned to autograd's saved tensors.
The time model on top is deliberately simple and stated: compute at a fixed fraction of peak, the pipeline
bubble, tensor/context-parallel collectives on the critical path, data-parallel collectives hidden behind the
compute they can overlap, and the optimizer step at HBM, CPU-Adam or NVMe speed. It ranks layouts; it does not
promise seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.layout import Layout
from toolkit.metrics import count_params, flops_per_token
from toolkit.plan import activations as act
from toolkit.plan.choice import Choice, apply
from toolkit.plan.deepspeed_states import deepspeed_buffer_bytes, deepspeed_state_bytes
from toolkit.plan.hardware import Cluster
from toolkit.plan.megatron_states import chunk_params, megatron_params, megatron_state_bytes
from toolkit.plan.types import CPU, GPU, NVME, StateBytes
from toolkit.recipe.schema import Recipe

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Comm:
    what: str
    dim: str
    group: int
    bytes: float
    """Bytes each GPU sends per optimizer step (ring algorithms: all-reduce 2(n-1)/n, gathers (n-1)/n)."""
    link: str
    seconds: float
    exposed: float
    """Seconds not hidden behind compute."""


@dataclass
class Memory:
    states: StateBytes
    activations: int
    activation_notes: list[str]
    buffers: dict[str, int]
    reserve: int
    stage: str
    """Which pipeline stage is the busiest (the one these numbers are for)."""
    cpu_per_node: int = 0
    nvme_per_node: int = 0

    @property
    def gpu(self) -> int:
        """Bytes of tensors on the busiest rank's GPU (the CUDA reserve is outside, in Cluster.usable_gpu_bytes)."""
        return self.states.on(GPU) + self.activations + sum(self.buffers.values())


@dataclass
class Estimate:
    choice: Choice
    memory: Memory
    model_flops: float
    hardware_flops: float
    comms: list[Comm]
    bubble: float
    times: dict[str, float]
    step_s: float
    tokens: int
    mfu: float | None
    problems: list[str] = field(default_factory=list)
    """Why it does not fit (empty when it does)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


# ---- memory ----------------------------------------------------------------------------------------------------

def _states(r: Recipe, c: Choice, pp_rank: int) -> StateBytes:
    if c.backend == "deepspeed":

        return deepspeed_state_bytes(r, c.dp)

    layout = Layout("megatron", c.world, c.dp, c.tp, c.pp, c.vpp, c.cp, c.sp, c.zero, c.ep)
    return megatron_state_bytes(r, layout, pp_rank=pp_rank)  # dp ranks differ by under one bucket's padding


def in_flight(c: Choice, pp_rank: int) -> int:
    """Chunk micro-batches (each L / (pp vpp) layers) whose activations a pipeline rank holds at its peak.

    1F1B: rank i runs pp - i forwards before its first backward. Interleaved (vpp chunks): the warm-up is
    2(pp - i - 1) + (vpp - 1) pp chunk forwards, plus the one in flight (Megatron's schedule), never more than
    the step has. Full memory is first-stage: pp micro-batches of its layers, or L (1 + (pp-1)/(pp vpp)) layers."""
    if c.pp == 1:
        return 1
    if c.vpp == 1:
        return min(c.pp - pp_rank, c.accum)
    return min(2 * (c.pp - pp_rank - 1) + (c.vpp - 1) * c.pp + 1, c.accum * c.vpp)


def _impl(c: Choice) -> str:
    return "hf" if c.backend == "deepspeed" else "megatron"


def _attention(r: Recipe, c: Choice) -> str:
    """GPU plans use fused attention (flash / Transformer Engine: no s x s scores), except for Megatron's local
    layer spec when the recipe asks for it, which materialises them."""
    return "unfused" if c.backend == "megatron" and r.parallel.megatron.transformer_impl == "local" else "flash"


def activation_bytes(r: Recipe, c: Choice, pp_rank: int) -> tuple[int, list[str]]:
    """Activation bytes a rank holds at its peak: saved tensors of its in-flight layers, the recompute transient,
    and the embedding / logits tensors of the first / last stage."""
    m, seq, prec = r.model, r.data.seq_len, r.training.precision
    kw = dict(tp=c.tp, sp=c.sp, cp=c.cp, precision=prec, impl=_impl(c), attention=_attention(r, c))
    per_layer = act.layer_activation_bytes(m, seq, c.micro, recompute=c.recompute, **kw)
    chunks = in_flight(c, pp_rank)
    layers_per_chunk = m.num_layers // (c.pp * c.vpp)
    held = chunks * layers_per_chunk * per_layer
    notes = [f"{per_layer / 2**20:,.1f} MiB per layer per micro-batch x {chunks * layers_per_chunk} layer-micro-batches"
             f" in flight ({chunks} x {layers_per_chunk} layers)"]
    if c.recompute == "full":
        transient = act.layer_activation_bytes(m, seq, c.micro, recompute="none", **kw)
        held += transient
        notes.append(f"+ {transient / 2**20:,.1f} MiB: one layer's activations rebuilt during its backward")
    first, last = pp_rank == 0, pp_rank == c.pp - 1
    extra = act.model_extra_activation_bytes(m, seq, c.micro, first=first, last=last, **kw)
    held += extra * (chunks if first and not last else 1)
    if extra:
        notes.append(f"+ {extra / 2**20:,.1f} MiB embedding/logits/loss tensors on this stage")
    return held, notes


def _buffers(r: Recipe, c: Choice) -> dict[str, int]:
    if c.backend == "deepspeed":

        return deepspeed_buffer_bytes(r, c.dp)
    return {}  # Megatron's DDP buckets are views into the grad buffer, counted in the states


def _host_bytes(s: StateBytes, gpus_per_node: int) -> tuple[int, int]:
    """(CPU bytes, NVMe bytes) per node for the offloaded model states of all its ranks."""
    return s.on(CPU) * gpus_per_node, s.on(NVME) * gpus_per_node


def _state_key(c: Choice) -> tuple:
    """What model states depend on: not the micro-batch, accumulation or recomputation."""
    return (c.backend, c.dp, c.tp, c.pp, c.vpp, c.cp, c.zero, c.offload_optimizer, c.offload_params)


def memory(r: Recipe, c: Choice, cluster: Cluster, cache: dict | None = None) -> Memory:
    """The busiest rank: the first pipeline stage (most in-flight activations) or the last (logits, and the
    output layer), whichever needs more. `cache` shares model states between layouts that differ only in
    batch or recomputation (one search evaluates thousands)."""
    cache = {} if cache is None else cache
    best = None
    for pp_rank in sorted({0, c.pp - 1}):
        key = (*_state_key(c), pp_rank)
        if key not in cache:
            cache[key] = _states(r, c, pp_rank)
        states = cache[key]
        acts, notes = activation_bytes(r, c, pp_rank)
        stage = "only stage" if c.pp == 1 else ("first stage" if pp_rank == 0 else "last stage")
        mem = Memory(states, acts, notes, _buffers(r, c), int(cluster.reserve_gib * 2**30), stage,
                     *_host_bytes(states, min(cluster.gpus_per_node, c.world)))
        if best is None or mem.gpu > best.gpu:
            best = mem
    return best


# ---- FLOPs, communication, time ---------------------------------------------------------------------------------

def flops(r: Recipe, c: Choice) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per step: recomputation adds a forward of the layers (full) or of the
    attention core (selective)."""
    m, seq = r.model, r.data.seq_len
    tokens = c.micro * c.accum * c.dp * seq
    model = flops_per_token(m, seq) * tokens
    attn_fwd = 4 * m.num_layers * m.hidden_size * seq * tokens
    layers = count_params(m)["non_embedding"] - (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size)
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2 * layers * tokens + attn_fwd}[c.recompute]
    return model, model + extra


def bubble(c: Choice) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1), interleaved (p-1)/(v m + p-1)."""
    if c.pp == 1:
        return 0.0
    return (c.pp - 1) / (c.vpp * c.accum + c.pp - 1)


OVERLAP_COST = 0.2
"""Fraction of an overlapped collective's time that still slows the compute it hides behind (its kernels take
SMs and memory bandwidth): overlap is never free, so ZeRO-3's per-micro-batch gathers are not."""


def exposed(seconds: float, hide_s: float) -> float:
    hidden = min(seconds, hide_s)
    return seconds - hidden + OVERLAP_COST * hidden


def _ring(n: int, kind: str) -> float:
    return 0.0 if n == 1 else (2 if kind == "all-reduce" else 1) * (n - 1) / n


def comms(r: Recipe, c: Choice, cluster: Cluster, compute_s: float, params: int,
          cache: dict | None = None) -> list[Comm]:
    """Each collective of a step, with the compute it can hide behind (overlap as the frameworks configure it)."""
    m, seq, b = r.model, r.data.seq_len, DTYPE_BYTES[r.training.precision]
    out: list[Comm] = []
    act_bytes = seq // c.cp * c.micro * m.hidden_size * b  # one [s/cp, b, h] activation
    layers_here = m.num_layers // c.pp
    micro_s = compute_s / c.accum  # one micro-batch of this rank's compute

    def add(what, dim, group, nbytes, span, hide_s):
        link = cluster.link(span)
        sec = nbytes / cluster.bandwidth(link)
        out.append(Comm(what, dim, group, nbytes, link, sec, exposed(sec, hide_s)))

    if c.tp > 1:
        per_layer = 4 + 2 * (c.recompute == "full")  # fwd 2, bwd 2, + the recomputed forward
        what = "TP all-gather/reduce-scatter (sequence parallel)" if c.sp else "TP all-reduce"
        add(what, "tp", c.tp, per_layer * layers_here * c.accum * _ring(c.tp, "all-reduce") * act_bytes,
            c.tp, 0.0)
    if c.cp > 1:
        kv = 2 * seq // c.cp * c.micro * (m.num_kv_heads or m.num_attention_heads) // c.tp * \
            (m.hidden_size // m.num_attention_heads) * b
        nbytes = 3 * (c.cp - 1) * kv * layers_here * c.accum  # K,V around the ring forward; K,V + dK,dV backward
        attn_s = micro_s * c.accum * 0.15  # the attention compute the ring exchange overlaps (TE)
        add("CP ring exchange of K/V", "cp", c.cp, nbytes, c.tp * c.cp, attn_s)
    if c.ep > 1 and m.num_experts:
        add("EP all-to-all token dispatch and combine", "ep", c.ep, _alltoall_bytes(r, c, act_bytes) * layers_here,
            c.tp * c.ep, 0.0)
    if c.pp > 1:
        boundary = act_bytes // (c.tp if c.sp else 1)
        nbytes = 2 * boundary * c.accum * c.vpp
        add("PP send/recv of activations and their gradients", "pp", c.pp, nbytes, c.world, 0.0)
    out += _dp_comms(r, c, cluster, micro_s, params, _rank_expert_params(r, c, {} if cache is None else cache))
    return out


def _alltoall_bytes(r: Recipe, c: Choice, act_bytes: int) -> float:
    """Bytes one GPU sends through Megatron's alltoall dispatcher per MoE layer and step: each of its tokens goes to
    top-k experts, and with uniform routing (ep - 1) / ep of those copies leave the rank; a dispatch and a combine in
    the forward, both again in the backward (and in the recomputed forward). Megatron runs them on the critical
    path (no overlap). Megatron-Core 0.16 builds the EP groups from its expert rank generator (order tp-ep-dp-pp,
    no cp, expert tp = tp), so a group is ep blocks of tp consecutive ranks: the span the caller gives."""
    tokens_share = act_bytes / (c.tp if c.sp else 1)  # the rank's [s/cp(/tp), b, h] slice of the activations
    per_pass = 2 * (r.model.num_experts_per_tok or 1) * tokens_share * (c.ep - 1) / c.ep
    return per_pass * (2 + (c.recompute == "full")) * c.accum


def _rank_params(r: Recipe, c: Choice, cache: dict) -> int:
    """Parameters whose gradients one rank reduces: the whole model under DeepSpeed, its TP/PP share under
    Megatron (the larger of the first and last stage)."""
    key = ("params", c.backend, c.tp, c.pp, c.vpp, c.ep)
    if key not in cache:
        if c.backend == "megatron":

            cache[key] = max(megatron_params(r, c.tp, c.pp, c.vpp, 0, p, c.ep) for p in {0, c.pp - 1})
        else:
            cache[key] = count_params(r.model)["total"]
    return cache[key]


def _rank_expert_params(r: Recipe, c: Choice, cache: dict) -> int:
    """Expert weights on one Megatron rank under expert parallelism (0 at ep = 1, where Megatron-Core reduces them
    with the rest), on the larger of the first and last stage."""
    if c.backend != "megatron" or c.ep == 1:
        return 0
    key = ("experts", c.tp, c.pp, c.vpp, c.ep)
    if key not in cache:
        cache[key] = max(sum(n for vp in range(c.vpp) for name, n, _ in chunk_params(r, c.tp, c.pp, c.vpp, p, vp, c.ep)
                             if ".local_experts." in name) for p in {0, c.pp - 1})
    return cache[key]


def _dp_comms(r: Recipe, c: Choice, cluster: Cluster, micro_s: float, params: int, experts: int = 0) -> list[Comm]:
    """Gradient reduction and parameter gathers over the data-parallel group; Megatron reduces gradients over
    dp x cp (context-parallel ranks hold the same weights), and under expert parallelism the `experts` of them over
    the expert-data-parallel ranks, dp x cp / ep."""
    group = c.dp * c.cp
    if group == 1:
        return []
    b = DTYPE_BYTES[r.training.precision]
    span = c.world if c.backend == "deepspeed" else c.tp * group
    link = cluster.link(span)
    bw = cluster.bandwidth(link)
    gather = _ring(group, "all-gather") * params * b
    out = []

    def add(what, nbytes, hide_s):
        sec = nbytes / bw
        out.append(Comm(what, "dp", group, nbytes, link, sec, exposed(sec, hide_s)))

    backward = micro_s * 2 / 3
    if c.backend == "megatron":
        edp = group // c.ep
        ring = _ring(group, "all-gather") * (params - experts) + _ring(edp, "all-gather") * experts
        gather, grad = ring * b, ring * 4  # grad_reduce_in_fp32
        if c.zero == 1:
            add("DP gradient reduce-scatter (fp32)", grad, backward)
            add("DP parameter all-gather", gather, micro_s / 3)
        else:
            add("DP gradient all-reduce (fp32)", 2 * grad, backward)
        return out
    if c.zero == 3:
        # Parameters are gathered for every micro-batch's forward and backward; gradients reduce-scattered in each.
        add("ZeRO-3 parameter all-gathers (forward and backward)", 2 * gather * c.accum, micro_s * c.accum)
        add("ZeRO-3 gradient reduce-scatter", gather * c.accum, backward * c.accum)
    elif c.zero == 2:
        add("ZeRO-2 gradient reduce-scatter (every micro-batch)", gather * c.accum, backward * c.accum)
        add("ZeRO-2 parameter all-gather after the step", gather, 0.0)
    else:
        add("gradient all-reduce" if c.zero == 0 else "ZeRO-1 gradient reduce + parameter all-gather",
            2 * gather, backward)
    return out


def optimizer_seconds(s: StateBytes, c: Choice, cluster: Cluster) -> float:
    """The optimizer step: Adam streams its states once through HBM on the GPU; with offload, CPU Adam on the node's
    share of cores plus the gradient and parameter copies over PCIe; NVMe adds reading and writing the states."""
    owned = s.master // 4 if s.master else s.weights // 4  # fp32 elements the rank updates
    gpn = min(cluster.gpus_per_node, c.world)
    if s.placement.get("moments", GPU) == GPU:
        return 2 * (s.master + s.moments + s.grads + s.weights) / (cluster.hbm_gbps * 1e9)
    sec = owned / (cluster.cpu_adam_params_per_s / gpn) + owned * 6 / (cluster.pcie_gbps * 1e9)
    if s.placement.get("moments") == NVME:
        sec += 2 * (s.master + s.moments) * gpn / (cluster.nvme_gbps * 1e9)
    return sec


def estimate(r: Recipe, c: Choice, cluster: Cluster, cache: dict | None = None) -> Estimate:
    rc = apply(r, c)
    model_f, hw_f = flops(rc, c)
    peak = cluster.peak_tflops * 1e12 * cluster.matmul_efficiency
    compute = hw_f / c.world / peak
    bub = bubble(c)
    cache = {} if cache is None else cache
    mem = memory(rc, c, cluster, cache)
    params = _rank_params(rc, c, cache)
    cs = comms(rc, c, cluster, compute, params, cache)
    times = {"compute": compute, "bubble": compute * bub / (1 - bub)}
    for dim in ("tp", "cp", "ep", "pp", "dp"):
        times[dim] = sum(x.exposed for x in cs if x.dim == dim)
    times["optimizer"] = optimizer_seconds(mem.states, c, cluster)
    if c.offload_params != "none":  # ZeRO-3 fetches every parameter from the host for each forward and backward
        partition = count_params(r.model)["total"] * DTYPE_BYTES[r.training.precision] / c.dp
        times["param offload"] = 2 * c.accum * partition / (cluster.pcie_gbps * 1e9)
    step = sum(times.values())
    tokens = c.micro * c.accum * c.dp * r.data.seq_len
    # MFU is against the 16-bit peak: an fp32 run has none to compare with, as training says (it printed one against
    # the bf16 peak until 2026-12-07)
    mfu = None if r.training.precision == "fp32" else model_f / (step * c.world * cluster.peak_tflops * 1e12)
    est = Estimate(c, mem, model_f, hw_f, cs, bub, times, step, tokens, mfu)
    est.problems = fit_problems(mem, cluster)
    return est


def fit_problems(mem: Memory, cluster: Cluster) -> list[str]:
    gib, out = 2**30, []
    if mem.gpu > cluster.usable_gpu_bytes:
        out.append(f"GPU: needs {mem.gpu / gib:,.1f} GiB, {cluster.usable_gpu_bytes / gib:,.1f} GiB usable")
    if mem.cpu_per_node > cluster.usable_cpu_bytes:
        out.append(f"CPU RAM: needs {mem.cpu_per_node / gib:,.0f} GiB per node, {cluster.usable_cpu_bytes / gib:,.0f}"
                   " GiB usable")
    if mem.nvme_per_node > cluster.nvme_gib * gib:
        out.append(f"NVMe: needs {mem.nvme_per_node / gib:,.0f} GiB per node, {cluster.nvme_gib:,.0f} GiB there")
    return out
