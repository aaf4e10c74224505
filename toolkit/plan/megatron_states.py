"""Exact parameters and model-state bytes per rank of a Megatron-Core layout, from the recipe alone.

Pure arithmetic that follows Megatron-Core 0.16's allocation rules (GPTModel with the local layer spec,
`DistributedDataParallel`'s param-and-grad buffers, `Float16OptimizerWithFloat16Params`, the distributed optimizer,
torch's AdamW), so `toolkit plan` can size a 70B layout instantly. tests/test_plan_megatron_states.py pins every
rule against tensors Megatron really allocates in tiny multi-process runs, and against a meta-device build of
llama70b_tp8_pp4.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from toolkit.adapters import megatron as mcfg
from toolkit.errors import ToolkitError
from toolkit.layout import Layout
from toolkit.plan.types import StateBytes
from toolkit.recipe.schema import Recipe

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ALIGN_PARAM = 64     # distributed optimizer: each parameter starts 64 elements (128 bytes of 16-bit) aligned
ALIGN_BUCKET = 128   # ... and each bucket ends on a multiple of lcm(dp x cp, 128) elements, so it splits evenly


@dataclass(frozen=True)
class Buffer:
    """One DDP param-and-grad buffer (one per model chunk: every parameter has the same dtype): its padded size,
    where each parameter sits in it, and its buckets, all in elements."""

    numel: int
    params: tuple[tuple[int, int], ...]
    buckets: tuple[tuple[int, int], ...]
    shard_world: int = 1  # the data-parallel ranks it is reduced (and, distributed, sharded) over


def _dims(r: Recipe, tp: int) -> dict:
    """The shapes Megatron builds, read from the same adapter the runtime uses (so vocab padding, kv_channels
    and query groups cannot drift from what runs)."""
    one = Layout("megatron", tp, 1, tp=tp)
    t, g = mcfg.to_architecture_kwargs(r), mcfg.to_gpt_model_kwargs(r, one)
    heads, groups = t["num_attention_heads"], t["num_query_groups"]
    sizes = {"num_attention_heads": heads, "num_query_groups": groups, "ffn_hidden_size": t["ffn_hidden_size"]}
    problems = [f"{name} {n} is not divisible by tp {tp}" for name, n in sizes.items() if n % tp]
    if problems:
        raise ToolkitError(f"Megatron cannot split this model at tp={tp}: {'; '.join(problems)}; choose a tp that "
                           "divides all of them")
    return {"h": t["hidden_size"], "ffn": t["ffn_hidden_size"], "d": t["kv_channels"], "heads": heads,
            "groups": groups, "vocab": g["vocab_size"], "tied": g["share_embeddings_and_output_weights"],
            "qkv_bias": t.get("add_qkv_bias", False), "qk_norm": t.get("qk_layernorm", False),
            "experts": t.get("num_moe_experts") or 0, "moe_ffn": t.get("moe_ffn_hidden_size") or 0}


def layers_of_chunk(num_layers: int, pp: int, vpp: int, pp_rank: int, vp: int) -> range:
    """Global (0-based) layer indices of virtual chunk `vp` on stage `pp_rank`: interleaved, chunk-major."""
    per = num_layers // (pp * vpp)
    start = (vp * pp + pp_rank) * per
    return range(start, start + per)


def chunk_params(r: Recipe, tp: int, pp: int, vpp: int, pp_rank: int, vp: int,
                 ep: int = 1) -> list[tuple[str, int, bool]]:
    """(name, elements on one TP rank, shared_embedding) of one chunk's parameters, in registration order (the
    order DDP lays them out, reversed). TP ranks all hold the same counts: Megatron splits whole heads and query
    groups, the FFN evenly, and pads the vocabulary to a multiple of tp. A mixture of experts holds the router and
    experts / ep local experts on each expert-parallel rank."""
    m = _dims(r, tp)
    if r.model.num_layers % (pp * vpp):
        raise ToolkitError(f"model.num_layers {r.model.num_layers} is not divisible by pp x vpp = {pp} x {vpp}")
    key = (*_shape_key(r, tp, m), pp, vpp, pp_rank, vp, ep)
    if key not in _CHUNKS:
        _CHUNKS[key] = tuple(_chunk_params(m, r.model.num_layers, tp, pp, vpp, pp_rank, vp, ep))
    return list(_CHUNKS[key])


_CHUNKS: dict[tuple, tuple[tuple[str, int, bool], ...]] = {}


def _shape_key(r: Recipe, tp: int, dims: dict | None = None) -> tuple:
    """What the per-rank arithmetic depends on in the recipe, at tp: the memo key of the planner's caches (it asks
    again for every layout, and a mixture of experts' chunk has thousands of entries)."""
    return tuple(sorted((dims or _dims(r, tp)).items())), r.model.num_layers, tp


def _chunk_params(m: dict, num_layers: int, tp: int, pp: int, vpp: int, pp_rank: int, vp: int,
                  ep: int) -> list[tuple[str, int, bool]]:
    h, d = m["h"], m["d"]
    first, last = pp_rank == 0 and vp == 0, pp_rank == pp - 1 and vp == vpp - 1
    shared = m["tied"] and pp > 1  # the tied copy on the last stage and its source each get their own bucket
    out = [("embedding.word_embeddings.weight", m["vocab"] // tp * h, shared)] if first else []
    for i in layers_of_chunk(num_layers, pp, vpp, pp_rank, vp):
        qkv_rows = (m["heads"] + 2 * m["groups"]) * d // tp
        # registration order: SelfAttention makes linear_proj, then linear_qkv (weight, bias), then the q/k norms
        out += [(f"decoder.layers.{i}.input_layernorm.weight", h, False),
                (f"decoder.layers.{i}.self_attention.linear_proj.weight", h * m["heads"] * d // tp, False),
                (f"decoder.layers.{i}.self_attention.linear_qkv.weight", qkv_rows * h, False)]
        out += [(f"decoder.layers.{i}.self_attention.linear_qkv.bias", qkv_rows, False)] if m["qkv_bias"] else []
        out += [(f"decoder.layers.{i}.self_attention.{n}_layernorm.weight", d, False)
                for n in ("q", "k") if m["qk_norm"]]
        out += [(f"decoder.layers.{i}.pre_mlp_layernorm.weight", h, False)]
        if m["experts"]:  # the router (replicated), then each local expert's fc1 and fc2 (TP-split like an MLP)
            out += [(f"decoder.layers.{i}.mlp.router.weight", m["experts"] * h, False)]
            out += [(f"decoder.layers.{i}.mlp.experts.local_experts.{x}.linear_fc{k}.weight", n, False)
                    for x in range(m["experts"] // ep)
                    for k, n in ((1, 2 * m["moe_ffn"] // tp * h), (2, h * m["moe_ffn"] // tp))]
            continue
        out += [(f"decoder.layers.{i}.mlp.linear_fc1.weight", 2 * m["ffn"] // tp * h, False),
                (f"decoder.layers.{i}.mlp.linear_fc2.weight", h * m["ffn"] // tp, False)]
    if last:
        out.append(("decoder.final_layernorm.weight", h, False))
        if not (m["tied"] and first):  # tied on a single stage: the output layer reads the embedding's weight
            out.append(("output_layer.weight", m["vocab"] // tp * h, shared))
    return out


def megatron_params(r: Recipe, tp: int, pp: int, vpp: int, tp_rank: int, pp_rank: int, ep: int = 1) -> int:
    """Parameters held by rank (tp_rank, pp_rank), over all its virtual chunks."""
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ToolkitError(f"rank (tp_rank {tp_rank}, pp_rank {pp_rank}) is outside tp {tp} x pp {pp}")
    key = (*_shape_key(r, tp), pp, vpp, pp_rank, ep)
    if key not in _TOTALS:
        _TOTALS[key] = sum(n for vp in range(vpp) for _, n, _ in chunk_params(r, tp, pp, vpp, pp_rank, vp, ep))
    return _TOTALS[key]


_TOTALS: dict[tuple, int] = {}


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_buffer(params: list[tuple[str, int, bool]], shard_world: int, distributed: bool,
                 bucket_size: int | None) -> Buffer:
    """Lay parameters out as `_ParamAndGradBuffer` does: in reverse registration order (roughly backward order),
    a new bucket once one reaches bucket_size elements or around a shared embedding (distributed optimizer only);
    with the distributed optimizer each parameter starts 64-aligned and each bucket ends on lcm(shard_world, 128)."""
    end_multiple = math.lcm(shard_world, ALIGN_BUCKET)
    start = bucket_start = 0
    placed, buckets, open_bucket = [], [], False

    def close(end: int) -> int:
        nonlocal bucket_start, open_bucket
        end = _pad(end, end_multiple) if distributed else end
        buckets.append((bucket_start, end))
        bucket_start, open_bucket = end, False
        return end

    for _, numel, shared in reversed(params):
        start = _pad(start, ALIGN_PARAM) if distributed else start
        own_bucket = shared and distributed
        if own_bucket and open_bucket:
            start = close(start)
        placed.append((start, start + numel))
        open_bucket = True
        if (bucket_size is not None and start + numel - bucket_start >= bucket_size) or own_bucket:
            start = close(start + numel)
        else:
            start += numel
    if open_bucket:
        close(start)
    return Buffer(buckets[-1][1] if buckets else 0, tuple(placed), tuple(buckets), shard_world)


def shard_elements(buf: Buffer, shard_world: int) -> list[int]:
    """Parameter elements (padding excluded) the distributed optimizer gives each data-parallel rank: rank i owns
    the i-th 1/shard_world of every bucket, whatever parameters that cuts through."""
    owned = [0] * shard_world
    for b0, b1 in buf.buckets:
        size = (b1 - b0) // shard_world
        for p0, p1 in buf.params:
            lo, hi = max(p0, b0), min(p1, b1)
            for rank in range((lo - b0) // size, (hi - 1 - b0) // size + 1) if hi > lo else ():
                owned[rank] += min(hi, b0 + (rank + 1) * size) - max(lo, b0 + rank * size)
    return owned


def owned_by(buf: Buffer, shard_world: int, rank: int) -> int:
    """shard_elements(buf, shard_world)[rank] for one rank: per bucket, only the (start-ordered, disjoint)
    parameters that reach into the rank's slice, found by bisection."""
    total = 0
    for b0, b1 in buf.buckets:
        size = (b1 - b0) // shard_world
        lo_s, hi_s = b0 + rank * size, b0 + (rank + 1) * size
        for p0, p1 in buf.params[max(0, bisect.bisect_right(buf.params, (lo_s, lo_s)) - 1):]:
            if p0 >= hi_s:
                break
            total += max(0, min(p1, hi_s) - max(p0, lo_s))
    return total


def _bucket_size(r: Recipe, layout: Layout) -> int | None:
    ddp = mcfg.to_ddp_config_kwargs(r, layout)
    if not ddp["overlap_grad_reduce"]:
        return None
    return ddp["bucket_size"] or max(40_000_000, 1_000_000 * layout.dp)


def rank_buffers(r: Recipe, layout: Layout, pp_rank: int) -> list[Buffer]:
    """The DDP buffers of one rank, one per virtual chunk, and at ep > 1 a second one per chunk for the experts:
    Megatron-Core marks expert weights `allreduce=False` only under expert parallelism and gives them their own
    buffer over the expert-data-parallel ranks (dp x cp / ep of them; the expert tensor-parallel size is tp).
    Only the first chunk of the first stage is bucketed: Megatron's DDP turns bucketing off for pp_rank > 0, and
    the toolkit (like Megatron-LM) for chunks after the first."""
    distributed, world = layout.zero_stage == 1, layout.dp * layout.cp
    size = _bucket_size(r, layout)
    key = (*_shape_key(r, layout.tp), layout.pp, layout.vpp, pp_rank, layout.ep, world, distributed, size)
    if key not in _BUFFERS:
        _BUFFERS[key] = tuple(_rank_buffers(r, layout, pp_rank, distributed, world, size))
    return list(_BUFFERS[key])


_BUFFERS: dict[tuple, tuple[Buffer, ...]] = {}


def _rank_buffers(r: Recipe, layout: Layout, pp_rank: int, distributed: bool, world: int,
                  size: int | None) -> list[Buffer]:
    out = []
    for vp in range(layout.vpp):
        params = chunk_params(r, layout.tp, layout.pp, layout.vpp, pp_rank, vp, layout.ep)
        split = layout.ep > 1
        experts = [q for q in params if split and ".local_experts." in q[0]]
        bucket = size if pp_rank == 0 and vp == 0 else None
        out.append(build_buffer([q for q in params if not (split and ".local_experts." in q[0])], world, distributed,
                                bucket))
        if experts:
            out.append(build_buffer(experts, world // layout.ep, distributed, bucket))
    return out


def _shard_rank(buf: Buffer, layout: Layout, dp_rank: int) -> int:
    """The rank in buf's shard group of the rank dp_rank of dp x cp: the expert-data-parallel rank is dp_rank // ep
    (Megatron orders a stage's ranks tp-cp-dp for dense weights and tp-ep-dp for experts)."""
    return dp_rank // (layout.dp * layout.cp // buf.shard_world)


def _owned(bufs: list[Buffer], layout: Layout) -> list[int]:
    world = layout.dp * layout.cp
    per_buffer = [(b, shard_elements(b, b.shard_world)) for b in bufs]
    return [sum(c[_shard_rank(b, layout, i)] for b, c in per_buffer) for i in range(world)]


def _notes(r: Recipe, layout: Layout, distributed: bool, sizes: list[int]) -> tuple[str, ...]:
    p = r.training.precision
    shared = r.model.tie_word_embeddings and layout.pp > 1
    multiple = math.lcm(layout.dp * layout.cp, ALIGN_BUCKET)
    aligned = all(n % multiple == 0 for n in sizes)
    notes = [
        (f"params: layers {r.model.num_layers} / (pp {layout.pp} x vpp {layout.vpp}) per chunk, chunk v of stage s "
         "holds layers (v x pp + s) x that onwards; column-parallel qkv/fc1 and row-parallel proj/fc2 split by tp, "
         "GQA splits whole query groups; norms replicated; rotary has no parameters"),
        ("params: embedding (vocab padded to make_vocab_size_divisible_by x tp) on the first chunk of stage 0, "
         "final norm and output layer on the last chunk of the last stage"
         + ("; tied: a second copy of the embedding on the last stage" if r.model.tie_word_embeddings else "")),
        f"weights: {PARAM_BYTES[p]} bytes/param ({p})"
        + ("; params remapped into the DDP param buffer, padding included" if distributed else ""),
        "grads: one fp32 DDP grad buffer per chunk (grad_reduce_in_fp32), padding included",
    ]
    if distributed:
        shard_world = layout.dp * layout.cp
        lcm = math.lcm(shard_world, ALIGN_BUCKET)
        notes += [(f"buffers: params 64-aligned, buckets padded to lcm(dp x cp = {shard_world}, 128) = {lcm}; only "
                   f"chunk 0 of stage 0 is bucketed (bucket_size {_bucket_size(r, layout)})"
                   + ("; the tied embedding and its copy get buckets of their own" if shared else "")),
                  ("optimizer: distributed; each dp rank owns 1/(dp x cp) of every bucket; master and moments cover "
                   "the parameter elements in its slices (padding excluded)"),
                  ("layer spec: buffer order is the local spec's; the Transformer Engine spec fuses the norms into "
                   "linear_qkv/linear_fc1 (same counts, other order), which changes nothing when every parameter "
                   f"size is a multiple of {lcm}" + (" (true here)" if aligned else
                                                    f" (not here: bucket padding may differ by < {lcm} per bucket)"))]
    if layout.ep > 1:
        notes.append(f"experts: {r.model.num_experts // layout.ep} local experts per layer ({r.model.num_experts} / ep "
                     f"{layout.ep}), in a buffer of their "
                     f"own reduced{' and sharded' if distributed else ''} over the dp x cp / ep = "
                     f"{layout.dp * layout.cp // layout.ep} expert-data-parallel rank(s)")
    if p == "fp32":
        notes.append("master: none (fp32 params are the optimizer's params; distributed shards are views)")
    else:
        notes.append("master: fp32 copy of every owned param element (4 bytes)")
    notes.append("moments: AdamW exp_avg + exp_avg_sq in fp32 (8 bytes per owned element); Adam's step counter "
                 "(torch's AdamW: 4 bytes per parameter tensor) is not counted")
    return tuple(notes)


def megatron_state_bytes(r: Recipe, layout: Layout, pp_rank: int = 0, dp_rank: int = 0,
                         tp_rank: int = 0) -> StateBytes:
    """Bytes of weights, grads, fp32 masters and Adam moments on one rank. dp_rank is the rank in the
    data-parallel (x context-parallel) group the distributed optimizer shards over."""
    shard_world = layout.dp * layout.cp
    if not 0 <= dp_rank < shard_world:
        raise ToolkitError(f"dp_rank {dp_rank} is outside dp x cp = {shard_world}")
    params = megatron_params(r, layout.tp, layout.pp, layout.vpp, tp_rank, pp_rank, layout.ep)
    distributed, p = layout.zero_stage == 1, r.training.precision
    bufs = rank_buffers(r, layout, pp_rank)
    sizes = [n for vp in range(layout.vpp)
             for _, n, _ in chunk_params(r, layout.tp, layout.pp, layout.vpp, pp_rank, vp, layout.ep)]
    buffered = sum(b.numel for b in bufs)
    owned = (sum(owned_by(b, b.shard_world, _shard_rank(b, layout, dp_rank)) for b in bufs) if distributed
             else params)
    grad_bytes = 4 if mcfg.to_ddp_config_kwargs(r, layout)["grad_reduce_in_fp32"] else PARAM_BYTES[p]
    return StateBytes(weights=PARAM_BYTES[p] * (buffered if distributed else params), grads=grad_bytes * buffered,
                      master=0 if p == "fp32" else 4 * owned, moments=8 * owned,
                      notes=_notes(r, layout, distributed, sizes))


def largest_megatron_state_bytes(r: Recipe, layout: Layout) -> tuple[dict, StateBytes]:
    """The rank with the most model-state bytes, as ({"tp_rank", "pp_rank", "dp_rank"}, its StateBytes). TP ranks
    are identical, so only pipeline stages and distributed-optimizer shards are compared."""
    ranks = []
    for pp_rank in range(layout.pp):
        dp_rank = 0
        if layout.zero_stage == 1:
            owned = _owned(rank_buffers(r, layout, pp_rank), layout)
            dp_rank = max(range(len(owned)), key=owned.__getitem__)
        ranks.append(({"tp_rank": 0, "pp_rank": pp_rank, "dp_rank": dp_rank},
                      megatron_state_bytes(r, layout, pp_rank, dp_rank)))
    return max(ranks, key=lambda rank: rank[1].total)
