"""Exact per-rank model-state bytes of a DeepSpeed run, and estimates of its transient GPU buffers, from the recipe.

Pure arithmetic over the Hugging Face Llama parameter list, following what DeepSpeed 0.19.8 allocates for the
config toolkit/adapters/deepspeed.py writes: the optimizer wrapper each precision and ZeRO stage gets, the two
parameter groups of toolkit.model.param_groups, ZeRO-1/2 flat groups padded to 2 x dp elements, ZeRO-3's
per-parameter partitions and persistent small parameters. Instant for a 70B model (no torch model is built).
tests/test_plan_deepspeed_states.py pins every number to the tensors DeepSpeed really holds in tiny 2- and 3-rank
runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from toolkit.errors import ToolkitError
from toolkit.families import family_named
from toolkit.layout import derive_batch
from toolkit.plan.types import CPU, GPU, KINDS, NVME, StateBytes
from toolkit.recipe.schema import ModelConfig, Recipe

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASTER_BYTES = 4       # fp32 master weights (ZeRO-1/2 also clone them in fp32 training)
ADAM_BYTES = 8         # exp_avg + exp_avg_sq, both fp32, allocated at the first step
NCCL_ALIGN = 2         # stage_1_and_2.py: nccl_start_alignment_factor; flat groups pad to a multiple of 2 x dp
SUB_GROUP_SIZE = 10**9          # zero_optimization.sub_group_size default (the adapter does not set it)
MAX_PARAMS_IN_CPU = 10**9       # offload_param.max_in_cpu default: NVMe param offload keeps this many in CPU RAM
ALLREDUCE_ELEMENTS = 500_000_000  # engine.py MEMORY_OPT_ALLREDUCE_SIZE: ZeRO-0 all-reduce bucket


def llama_params(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of Hugging Face's LlamaForCausalLM (or the family's causal LM: Qwen2 adds
    q/k/v biases, Qwen3 per-head q/k norms), in registration order (the order model.parameters() yields and
    DeepSpeed flattens). A tied lm_head is the embedding, listed once."""
    h, heads, inter = m.hidden_size, m.num_attention_heads, m.intermediate_size
    d = m.head_dim or h // heads
    q, kv = heads * d, (m.num_kv_heads or heads) * d
    family = family_named(m.family)
    out = [("model.embed_tokens.weight", (m.vocab_size, h))]
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out += [(p + f"self_attn.{name}_proj.weight", (rows, h))]
            out += [(p + f"self_attn.{name}_proj.bias", (rows,))] if family.qkv_bias else []
        out += [(p + "self_attn.o_proj.weight", (h, q))]
        out += [(p + f"self_attn.{n}_norm.weight", (d,)) for n in ("q", "k") if family.qk_norm]
        if family.moe:  # transformers 5 holds the experts fused in 3-D tensors, then the router
            e, f = m.num_experts, m.moe_intermediate_size
            out += [(p + "mlp.experts.gate_up_proj", (e, 2 * f, h)), (p + "mlp.experts.down_proj", (e, h, f)),
                    (p + "mlp.gate.weight", (e, h))]
        else:
            out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not m.tie_word_embeddings:
        out.append(("lm_head.weight", (m.vocab_size, h)))
    return out


def param_group_numels(m: ModelConfig) -> list[list[int]]:
    """Element counts of toolkit.model.param_groups' groups (decay: matrices; no decay: norms), in model order.
    DeepSpeed drops an empty group, and flattens and pads each remaining group on its own."""
    params = llama_params(m)
    decay = [math.prod(s) for _, s in params if len(s) >= 2]
    no_decay = [math.prod(s) for _, s in params if len(s) < 2]
    return [g for g in (decay, no_decay) if g]


@dataclass(frozen=True)
class _Run:
    """What the arithmetic reads from a recipe."""

    stage: int
    dp: int
    precision: str
    width: int                 # bytes of one 16-bit (or fp32) weight / gradient element
    offload_optimizer: str
    offload_params: str
    groups: list[list[int]]
    persistence_threshold: int
    accum: int                 # micro-batches accumulated per optimizer step (1 where it changes nothing)

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"


def _run(r: Recipe, dp: int) -> _Run:
    p = r.parallel
    if dp < 1:
        raise ToolkitError(f"deepspeed_state_bytes: dp must be at least 1, got {dp}")
    if p.backend != "deepspeed":
        raise ToolkitError(f"deepspeed_state_bytes: recipe {r.name!r} uses backend {p.backend!r}; "
                           "use toolkit.plan.megatron_states for Megatron-Core layouts")
    return _Run(p.zero_stage, dp, r.training.precision, PARAM_BYTES[r.training.precision], p.offload_optimizer,
                p.offload_params, param_group_numels(r.model), p.deepspeed.stage3_param_persistence_threshold,
                _accum(r, dp))


def _accum(r: Recipe, dp: int) -> int:
    """Micro-batches per step; only ZeRO-1 and ZeRO-2 + offload hold more gradients when accumulating, so only
    they need a batch that splits over dp."""
    t, p = r.training, r.parallel
    if not (p.zero_stage == 1 or (p.zero_stage == 2 and p.offload_optimizer != "none")):
        return 1
    if t.grad_accum_steps is not None:
        return t.grad_accum_steps
    batch, _, problems = derive_batch(t.global_batch_size, t.micro_batch_size, None, dp)
    if batch is None:
        raise ToolkitError(f"deepspeed_state_bytes: {r.name}: the batch does not split over dp = {dp}: "
                           + "; ".join(p.render() for p in problems))
    return batch.grad_accum


def deepspeed_state_bytes(r: Recipe, dp: int, rank: int | None = None) -> StateBytes:
    """Model-state bytes data-parallel rank `rank` of `dp` holds (None: the rank holding the most).

    Weights, master and moments are what exists from the first optimizer step on. Grads is the most gradient
    storage held after any micro-batch's backward of a step, up to its optimizer step (ZeRO-1/2 ranks differ
    there: each keeps the whole gradient of every parameter that overlaps its partition)."""
    run = _run(r, dp)
    if rank is not None and not 0 <= rank < dp:
        raise ToolkitError(f"deepspeed_state_bytes: rank {rank} is outside dp = {dp} (0..{dp - 1})")
    ranks = [rank] if rank is not None else range(dp)
    build = {0: _zero0, 1: _zero12, 2: _zero12, 3: _zero3}[run.stage]
    if run.stage in (0, 3):  # every rank holds the same bytes
        ranks = [0]
    out = max((build(run, k) for k in ranks), key=lambda s: s.total)
    return replace(out, notes=out.notes + tuple(_notes_common(r)))


def _notes_common(r: Recipe) -> list[str]:
    if r.parallel.deepspeed.config:
        return [f"assumes the toolkit's generated DeepSpeed config; keys of your own {r.parallel.deepspeed.config} "
                "(e.g. data_types.grad_accum_dtype, sub_group_size) are not read"]
    return []


# ---- ZeRO-0 -----------------------------------------------------------------------------------------------------

def _zero0(run: _Run, rank: int) -> StateBytes:
    n = sum(map(sum, run.groups))
    if run.mixed:
        notes = [f"ZeRO-0 {run.precision}: DeepSpeed 0.19.8 wraps Adam in FP16_Optimizer (FP16_UnfusedOptimizer when "
                 "the basic optimizer is not FusedAdam) with the 16-bit dtype, not BF16_Optimizer (chosen only with "
                 "pipeline parallelism or data_types.grad_accum_dtype=fp32 at ZeRO-1)",
                 f"{run.precision} weights and .grad per parameter, unpadded; fp32 master copy of every parameter; "
                 "Adam moments over all of them, replicated on every rank"]
    else:
        notes = ["ZeRO-0 fp32: the bare optimizer steps the model's own fp32 parameters (no master copy); "
                 "fp32 .grad per parameter; Adam moments replicated on every rank"]
    return StateBytes(n * run.width, n * run.width, n * MASTER_BYTES if run.mixed else 0, n * ADAM_BYTES,
                      dict.fromkeys(KINDS, GPU), tuple(notes))


# ---- ZeRO-1 / ZeRO-2 --------------------------------------------------------------------------------------------

def flat_partition(numel: int, dp: int) -> tuple[int, int]:
    """(padded flat-group elements, elements of each rank's partition) of one ZeRO-1/2 parameter group."""
    align = NCCL_ALIGN * dp
    padded = -(-numel // align) * align
    return padded, padded // dp


def zero12_held_elements(group: list[int], dp: int) -> list[int]:
    """Per rank, the elements of the parameters of one group that overlap the rank's partition, each counted
    whole: a parameter straddling a partition boundary is counted by both ranks."""
    _, part = flat_partition(sum(group), dp)
    held, offset = [0] * dp, 0
    for n in group:
        for k in range(offset // part, (offset + n - 1) // part + 1):
            held[k] += n
        offset += n
    return held


def zero12_pad_elements(group: list[int], dp: int) -> list[int]:
    """Per rank, the elements of its partition past the group's end (the alignment padding: last ranks only)."""
    _, part = flat_partition(sum(group), dp)
    end = sum(group)
    return [part - max(0, min(end, (k + 1) * part) - k * part) for k in range(dp)]


def _zero12_grads(run: _Run, rank: int) -> tuple[int, str]:
    """(bytes, note) of the gradients a ZeRO-1/2 rank holds at its busiest point between backward passes."""
    held = sum(zero12_held_elements(g, run.dp)[rank] for g in run.groups)
    pad = sum(zero12_pad_elements(g, run.dp)[rank] for g in run.groups)
    shard = sum(flat_partition(sum(g), run.dp)[1] for g in run.groups)
    name, prec = f"ZeRO-{run.stage}", run.precision
    if run.offload_optimizer != "none":
        note = f"{name} + CPU offload: an fp32 gradient partition on the CPU next to the masters"
        if run.stage == 2 and run.accum > 1:
            # async_accumulate_grad_in_cpu_via_gpu: one CPU buffer per parameter in the partition, never freed
            return shard * MASTER_BYTES + held * run.width, note + (
                f", plus a whole {prec} CPU accumulator for each parameter overlapping the partition (accumulation)")
        return shard * MASTER_BYTES, note
    if run.stage == 1 and run.accum > 1:
        # ZeRO-1 reduces only at the accumulation boundary: until then autograd accumulates every full .grad
        return sum(map(sum, run.groups)) * run.width, (
            f"ZeRO-1 with {run.accum} accumulated micro-batches: the full {prec} .grad of every parameter is held "
            "between micro-batches (reduced and partitioned only at the boundary)")
    return (held + pad) * run.width, (
        f"{name}: rank {rank} keeps the whole {prec} gradient of every parameter overlapping its partition "
        f"(grads_in_partition, contiguous_gradients) plus zeros for the padding in it: {held + pad:,} elements")


def _zero12(run: _Run, rank: int) -> StateBytes:
    parts = [flat_partition(sum(g), run.dp) for g in run.groups]
    weights = sum(padded for padded, _ in parts) * run.width
    shard = sum(part for _, part in parts)
    name = f"ZeRO-{run.stage}"
    grads, grad_note = _zero12_grads(run, rank)
    notes = [f"{name}: the {run.precision} weights are flattened per parameter group (decay / no-decay) and "
             f"padded to a multiple of {NCCL_ALIGN} x dp = {NCCL_ALIGN * run.dp} elements, whole on every rank",
             f"{name}: fp32 masters (a separate clone, even in fp32 training) and Adam moments partitioned over "
             f"dp={run.dp}: {shard:,} elements per rank", grad_note]
    where = CPU if run.offload_optimizer != "none" else GPU
    placement = {"weights": GPU, "grads": where, "master": where, "moments": where}
    return StateBytes(weights, grads, shard * MASTER_BYTES, shard * ADAM_BYTES, placement, tuple(notes))


# ---- ZeRO-3 -----------------------------------------------------------------------------------------------------

def persistent_numels(run: _Run) -> list[int]:
    """Parameters ZeRO-3 never re-partitions (numel <= stage3_param_persistence_threshold): whole on every rank."""
    return [n for g in run.groups for n in g if n <= run.persistence_threshold]


def persistent_elements(run: _Run) -> int:
    """Elements the gathered persistent parameters occupy: after each step DeepSpeed re-gathers them with the
    blocking all-gather, which gives each its own buffer of ceil(numel / dp) x dp elements (padding included)."""
    return sum(-(-n // run.dp) * run.dp for n in persistent_numels(run))


def _zero3(run: _Run, rank: int) -> StateBytes:
    shard = sum(-(-n // run.dp) for g in run.groups for n in g)  # ceil(numel / dp) per parameter
    persist = persistent_elements(run) if run.offload_params == "none" else 0
    opt_off = run.offload_optimizer != "none"
    grads = shard * run.width + (shard * MASTER_BYTES if run.offload_optimizer == "cpu" else 0)
    opt_place = run.offload_optimizer if opt_off else GPU
    placement = {"weights": _param_place(run, shard), "grads": CPU if opt_off else GPU, "master": opt_place,
                 "moments": opt_place}
    return StateBytes((shard + persist) * run.width, grads, shard * MASTER_BYTES, shard * ADAM_BYTES, placement,
                      tuple(_zero3_notes(run, shard)))


def _param_place(run: _Run, shard: int) -> str:
    if run.offload_params == "nvme":
        # sub-groups that fit in max_in_cpu are moved into pinned CPU memory for good; only the rest is swapped
        return CPU if shard <= MAX_PARAMS_IN_CPU else NVME
    return CPU if run.offload_params == "cpu" else GPU


def _zero3_notes(run: _Run, shard: int) -> list[str]:
    persist = persistent_numels(run)
    notes = [f"ZeRO-3: every parameter is split into dp={run.dp} partitions of ceil(numel / dp) elements "
             f"({shard:,} per rank with padding); sub_group_size only splits the step, not these totals",
             f"ZeRO-3: {len(persist)} parameters of <= {run.persistence_threshold:,} elements "
             f"(stage3_param_persistence_threshold) stay gathered whole on every rank: {sum(persist):,} elements"]
    if run.offload_params != "none":
        notes.append(f"offload_params={run.offload_params}: the partitions live in a flat CPU buffer per group "
                     "(NVMe: whole sub-groups up to offload_param.max_in_cpu = 1e9 elements stay in CPU RAM); the "
                     "persistent parameters stay whole on the GPU: deepspeed_buffer_bytes['zero3_persistent_params']")
    if run.offload_optimizer == "nvme":
        notes.append("offload_optimizer=nvme: masters and moments are swapped per sub-group; a sub-group smaller "
                     "than the aio block (>= 1 MiB of fp32) is never swapped and stays in CPU RAM")
    notes.append("ZeRO-3: fp32 master partitions (one flat tensor per sub-group) and Adam moments over them")
    if not run.mixed:
        # stage3.py's alias branch compares tensor.device with a device-name string, which is never equal
        notes.append("ZeRO-3 fp32: DeepSpeed 0.19.8 still clones the fp32 partitions as masters (its no-copy branch "
                     "compares a torch.device with a string and never fires)")
    notes.append(_zero3_grad_note(run))
    return notes


def _zero3_grad_note(run: _Run) -> str:
    where = "CPU" if run.offload_optimizer != "none" else "GPU"
    note = (f"ZeRO-3: one {run.precision} gradient-partition buffer of the rank's partition size, on the {where} "
            "(allocated at init, kept for the whole run)")
    if run.offload_optimizer == "cpu":
        note += ", plus the fp32 gradient of each optimizer sub-group on the CPU"
    if run.offload_optimizer == "nvme":
        note += "; the fp32 gradients are swapped to NVMe with the optimizer states (not counted here)"
    return note


# ---- transient GPU buffers --------------------------------------------------------------------------------------

def deepspeed_buffer_bytes(r: Recipe, dp: int) -> dict[str, int]:
    """GPU bytes DeepSpeed needs besides the model states, by name: upper-bound ESTIMATES, not exact.

    These buffers come and go within a step (communication buckets, gathered ZeRO-3 parameters, the fp32
    gradient the optimizer step builds), so their peak depends on timing; each entry is the most one can hold.
    Two entries are exact model states that sit on the GPU while StateBytes places their kind on the CPU:
    'zero3_persistent_params' (offload_params: whole persistent parameters, partitions on the CPU) and
    'zero1_accumulated_grads' (ZeRO-1 + CPU offload with accumulation: full .grad between micro-batches)."""
    run = _run(r, dp)
    sizes = [n for g in run.groups for n in g]
    return {0: _buffers0, 1: _buffers12, 2: _buffers12, 3: _buffers3}[run.stage](run, r, sizes)


def _buffers0(run: _Run, r: Recipe, sizes: list[int]) -> dict[str, int]:
    # the engine flattens gradients into all-reduce buckets of up to 5e8 elements (plus the tensor that overflows)
    out = {"allreduce_bucket": min(sum(sizes), ALLREDUCE_ELEMENTS + max(sizes)) * run.width}
    if run.mixed:
        out["step_fp32_grads"] = sum(sizes) * MASTER_BYTES  # FP16_Optimizer.step: an fp32 flat copy per group
    return out


def _buffers12(run: _Run, r: Recipe, sizes: list[int]) -> dict[str, int]:
    ds = r.parallel.deepspeed
    # setup_buckets: one reduce bucket of reduce_bucket_size elements, two with overlap_comm (double buffering);
    # the all-gather after the step writes into the flat weights in place (allgather_bucket_size unused)
    count = (2 if ds.overlap_comm else 1) if ds.contiguous_gradients or run.offload_optimizer != "none" else 0
    out = {"reduce_buckets": count * ds.reduce_bucket_size * run.width}
    if run.offload_optimizer == "none":  # step(): one group's fp32 gradient partition at a time
        out["step_fp32_grad_partition"] = max(flat_partition(sum(g), run.dp)[1] for g in run.groups) * MASTER_BYTES
    else:
        out["offload_grad_staging"] = max(sizes) * run.width  # temp_grad_buffer_for_gpu_offload
        if run.stage == 1 and run.accum > 1:  # exact: the full .grad waits on the GPU for the boundary
            out["zero1_accumulated_grads"] = sum(sizes) * run.width
    return out


def _buffers3(run: _Run, r: Recipe, sizes: list[int]) -> dict[str, int]:
    ds = r.parallel.deepspeed
    gathered = [n for n in sizes if n > run.persistence_threshold]
    live = min(sum(gathered), ds.stage3_max_live_parameters + ds.stage3_prefetch_bucket_size)
    out = {"reduce_bucket": ds.reduce_bucket_size * run.width if ds.contiguous_gradients else 0,
           # gathered parameters in flight, and the flat all-gather output next to the largest one's copy
           "gathered_params": live * run.width,
           "largest_gather": 2 * (-(-max(gathered, default=0) // run.dp) * run.dp) * run.width}
    if run.offload_optimizer == "none":
        out["step_fp32_grad_subgroup"] = _largest_sub_group(run) * MASTER_BYTES
    if run.offload_params != "none":
        out["zero3_persistent_params"] = persistent_elements(run) * run.width
    return out


def _largest_sub_group(run: _Run) -> int:
    """Elements of the largest optimizer sub-group: parameters are added until the sum reaches sub_group_size."""
    best = 0
    for g in run.groups:
        acc = 0
        for n in g:
            acc += -(-n // run.dp)
            if acc >= SUB_GROUP_SIZE:
                best, acc = max(best, acc), 0
        best = max(best, acc)
    return best
