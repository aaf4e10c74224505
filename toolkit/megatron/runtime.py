"""Megatron-Core runtime wiring: process groups, GPTModel chunks, DDP, optimizer, and one training step.

Order matters and follows Megatron-LM: model-parallel groups exist before any model is built (layers ask them
for their TP/PP rank); models are built, loaded with weights, then wrapped in DDP (which allocates the
gradient buffers over the final parameters); the optimizer is built last over the DDP-wrapped chunks.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from toolkit.adapters import megatron as mcfg
from toolkit.checkpoint.hf_io import LazyHFState
from toolkit.errors import ToolkitError
from toolkit.families import dims_from_hf, iter_entries
from toolkit.families.mapping import local_spec_name
from toolkit.layout import Layout
from toolkit.megatron import cpu_shim
from toolkit.megatron.local_spec import local_block_spec
from toolkit.model import to_hf_config
from toolkit.recipe.schema import Recipe
from toolkit.train import faults


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return torch.cuda.is_available()


def init_parallel(r: Recipe, layout: Layout, on_gpu: bool) -> None:
    from megatron.core import parallel_state  # lazy: Megatron runs only
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # lazy: Megatron runs only

    if not on_gpu:

        cpu_shim.install()
    parallel_state.initialize_model_parallel(**mcfg.to_parallel_kwargs(layout))
    # As Megatron-LM does: pipeline stages get different seeds, or every stage would initialise its first layer
    # like stage 0's. TP ranks share the seed (CPU init builds the full matrix, then splits it).
    seed = r.training.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def uses_transformer_engine(r: Recipe, on_gpu: bool) -> bool:
    impl = r.parallel.megatron.transformer_impl
    return impl == "transformer_engine" or (impl == "auto" and on_gpu and te_available())


def layer_spec(r: Recipe, on_gpu: bool, tconfig, vp_stage: int | None):
    """Transformer Engine layers when asked for, or by default on GPUs where TE imports; else the local spec
    (with an RMSNorm that supports sequence parallelism)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs  # lazy: Megatron runs only


    if uses_transformer_engine(r, on_gpu):
        # the family's q/k norms (Qwen3) and experts (Qwen3-MoE: SequentialMLP, the local spec's parameter names)
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=tconfig.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=tconfig.qk_layernorm)
    return local_block_spec(tconfig, vp_stage)


def build_chunks(r: Recipe, layout: Layout, on_gpu: bool) -> list:
    """One GPTModel per virtual pipeline chunk of this rank (one chunk without interleaving)."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only
    from megatron.core.models.gpt import GPTModel  # lazy: Megatron runs only
    from megatron.core.transformer.transformer_config import TransformerConfig  # lazy: Megatron runs only

    tconfig = TransformerConfig(**mcfg.to_transformer_config_kwargs(r, layout, on_gpu))
    kwargs = mcfg.to_gpt_model_kwargs(r, layout)
    chunks = []
    for vp in range(layout.vpp):
        vp_stage = vp if layout.vpp > 1 else None
        chunk = GPTModel(tconfig, layer_spec(r, on_gpu, tconfig, vp_stage), pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage, **kwargs)
        chunks.append(chunk.cuda() if on_gpu else chunk)
    return chunks


def load_hf_weights(chunks: list, hf_path: str, r: Recipe, layout: Layout) -> None:
    """Fill this rank's chunks from a Hugging Face checkpoint through the shared Llama mapping rules, reading only
    the tensors this pipeline rank holds, one parameter at a time (memory-mapped safetensors)."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only


    dims = dims_from_hf(to_hf_config(r.model), layout.tp, r.parallel.megatron.make_vocab_size_divisible_by)
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()  # a routed expert is read only by the rank holding it
    states: list[dict] = [{} for _ in chunks]
    with LazyHFState(hf_path) as hf:
        for entry in iter_entries(dims, layout.pp, layout.vpp, layout.ep):
            if entry.pp_rank == pp_rank and entry.ep_rank in (None, ep_rank):
                tensors = [hf[name] for name in entry.hf_names]
                states[entry.chunk][entry.megatron_name] = entry.to_megatron(tensors, layout.tp)[tp_rank]
    for chunk, state in zip(chunks, states):
        load_chunk_state(chunk, state)


def chunk_state(chunk) -> dict:
    """A chunk's tensors under local-spec names (whatever the spec), without Megatron's _extra_state entries."""

    return {local_spec_name(k): v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


def load_chunk_state(chunk, state: dict) -> None:
    """Copy tensors (local-spec names) into a chunk; anything missing or unexpected is an error."""
    own = chunk_state(chunk)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k}: {tuple(state[k].shape)} in the weights, {tuple(v.shape)} in the model"
              for k, v in own.items() if k in state and v.shape != state[k].shape]
    if missing or unexpected or shapes:
        raise ToolkitError(f"the weights do not fit this model chunk (missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}, shapes {shapes[:4]}); check that model.* matches the checkpoint's "
                           "architecture and that the checkpoint was written at this layout")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def wrap_and_optimize(chunks: list, r: Recipe, layout: Layout):
    """DDP around each chunk, then Megatron's optimizer (distributed when zero_stage is 1)."""
    # lazy: Megatron runs only
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lazy: Megatron runs only

    ddp_config = DistributedDataParallelConfig(**mcfg.to_ddp_config_kwargs(r, layout))
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c,
                                       disable_bucketing=i > 0)  # later chunks reduce after the first, as in Megatron-LM
               for i, c in enumerate(chunks)]
    config = wrapped[0].module.config
    config.finalize_model_grads_func = finalize_model_grads  # DP reduce + tied-embedding sync across stages
    config.no_sync_func = _one_or_list([w.no_sync for w in wrapped])
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = _one_or_list([w.start_grad_sync for w in wrapped])
    if ddp_config.overlap_param_gather:
        config.param_sync_func = _one_or_list([w.start_param_sync for w in wrapped])
    optimizer = get_megatron_optimizer(OptimizerConfig(**mcfg.to_optimizer_config_kwargs(r, layout)), wrapped)
    return wrapped, optimizer


def _one_or_list(items: list):
    """Megatron's schedules take a single model/iterator/hook without interleaving and a list with it."""
    return items if len(items) > 1 else items[0]


def _batch_tensors(micro: dict, device) -> dict:
    """Megatron's GPTModel scores position t against labels[t] (no internal shift, unlike Hugging Face): shift
    here and mask the last position, so the loss is the same mean over the same seq_len - 1 predictions. With
    context parallelism, Megatron's own splitter keeps this rank's 2 load-balanced chunks of every sequence."""
    from megatron.core.utils import get_batch_on_this_cp_rank  # lazy: Megatron runs only

    ids = micro["input_ids"].to(device)
    labels = torch.roll(micro["labels"].to(device), shifts=-1, dims=1)
    mask = torch.ones_like(labels, dtype=torch.float32)
    mask[:, -1] = 0
    mask[labels == -100] = 0
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    batch = {"tokens": ids, "labels": labels.masked_fill(labels == -100, 0), "loss_mask": mask,
             "position_ids": positions}
    if "position_ids" in micro:  # packed chat data: each conversation restarts at 0 and sees only itself
        batch["position_ids"] = micro["position_ids"].to(device)
        batch["attention_mask"] = packed_attention_mask(batch["position_ids"])
    return get_batch_on_this_cp_rank(batch)


def packed_attention_mask(position_ids):
    """Megatron's boolean attention mask [b, 1, s, s] (True = masked) for sequences packed back to back, each
    starting at position 0: causal, and never across a sequence boundary. RoPE depends only on the distance between
    positions, so with this mask a packed conversation computes what it would alone."""
    doc = (position_ids == 0).cumsum(-1)
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)
    causal = torch.ones(position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool,
                        device=position_ids.device).tril()
    return (~(same & causal)).unsqueeze(1)


def _loss(mask, output_tensor, norm=None):
    """Mean loss over the micro-batch's predicted tokens. Under context parallelism each rank holds part of every
    sequence: divide by the token count of the whole CP group. Megatron-Core's schedule (0.16, a loss function
    returning two values) then multiplies by cp, because the gradient reduction averages over dp x cp ranks, so
    the CP ranks' losses add up to the sequence's mean (tests/test_megatron_loss.py).

    With `norm` (chat data, see token_norm) the loss is per token of the whole step instead: the micro-batch's sum
    divided by norm = (the step's loss tokens over all DP ranks) / (dp x micro-batches), so after the schedule's
    division by the micro-batch count (and its multiplication by cp) and the gradient average over dp x cp ranks,
    the step's gradient is that of the mean over all its loss tokens, whatever the micro-batch and DP sizes."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only

    local = (output_tensor.float() * mask).sum()
    totals = torch.stack([local.detach(), mask.sum()])
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        torch.distributed.all_reduce(totals, group=ps.get_context_parallel_group())
    if norm is not None:
        return local / norm, {"loss": (totals[0] / norm).clone()}
    loss = local / totals[1]
    return loss, {"loss": (totals[0] / totals[1]).clone()}  # a copy: the schedule scales `loss` in place


def token_norm(batches: list[dict], device):
    """(loss tokens of this step over all data-parallel ranks) / (dp x micro-batches), at least 1 token."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only

    n = torch.stack([(b["labels"][:, 1:] != -100).sum() for b in batches]).sum().double().to(device)
    torch.distributed.all_reduce(n, group=ps.get_data_parallel_group())
    return n.clamp(min=1).float() / (ps.get_data_parallel_world_size() * len(batches))


def forward_step(device, data_iterator, model, norm=None):
    b = _batch_tensors(next(data_iterator), device)
    out = model(b["tokens"], b["position_ids"], attention_mask=b.get("attention_mask"), labels=b["labels"])
    faults.point("forward")
    return out, partial(_loss, b["loss_mask"], norm=norm)


def train_step(wrapped: list, optimizer, batches: list[dict], r: Recipe, lr: float, device) -> tuple:
    """One optimizer step over `batches` (this rank's micro-batches). Returns (mean loss on the last pipeline
    stage, or None elsewhere; grad norm)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: Megatron runs only

    for w in wrapped:
        w.zero_grad_buffer()
    optimizer.zero_grad()
    wd = r.training.optimizer.weight_decay
    for g in optimizer.param_groups:  # what OptimizerParamScheduler would do: lr, and wd x the group's wd_mult
        g["lr"] = lr * g.get("lr_mult", 1.0)
        g["weight_decay"] = wd * g.get("wd_mult", 1.0)  # 0 for norms and biases
    norm = token_norm(batches, device) if r.data.kind == "chat" else None  # chat: mean over the step's tokens
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, device, norm=norm), data_iterator=_one_or_list([iter(batches) for _ in wrapped]),
        model=_one_or_list(wrapped), num_microbatches=len(batches),
        seq_length=r.data.seq_len, micro_batch_size=batches[0]["input_ids"].shape[0], forward_only=False)
    faults.point("backward")
    _, grad_norm, _ = optimizer.step()
    faults.point("optimizer")
    loss = torch.stack([x["loss"] for x in losses]).mean() if losses else None
    return loss, grad_norm


def _eval_loss(mask, output_tensor):
    """(sum of token losses, token count) of this rank's part of the micro-batch; no averaging here (the loop sums
    both over every rank, then divides)."""
    local = (output_tensor.double() * mask).sum()
    return local, {"sum": local.detach().clone(), "count": mask.sum().double()}


def eval_forward_step(device, data_iterator, model):
    b = _batch_tensors(next(data_iterator), device)
    out = model(b["tokens"], b["position_ids"], attention_mask=b.get("attention_mask"), labels=b["labels"])
    return out, partial(_eval_loss, b["loss_mask"])


@contextmanager
def params_synced(wrapped: list):
    """Every rank's model parameters up to date for the duration, as Megatron-LM's evaluate and save_checkpoint do.
    With the distributed optimizer's overlapped parameter gather, a rank updates only the range it owns after a step
    and gathers the rest in the next forward's pre-hooks, so until then the other ranges hold the previous step's
    values: a checkpoint saved then would mix two steps."""
    hooked = [w for w in wrapped if w.use_forward_hook]
    for w in hooked:  # gathers the updated parameters now (synchronously), then leaves the hooks off
        w.disable_forward_pre_hook()
    try:
        yield
    finally:
        for w in hooked:
            w.enable_forward_pre_hook()


def eval_step(wrapped: list, batches: list[dict], r: Recipe, device) -> torch.Tensor:
    """Forward only (no gradients, eval mode) over this rank's held-out micro-batches through Megatron's schedule.
    Returns (sum of token losses, token count) as float64: non-zero on the last pipeline stage's tensor-parallel
    rank 0 only (the other TP ranks hold the same numbers), so summing it over every rank counts each token once;
    context-parallel ranks each hold part of every sequence, so their sums add up."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only
    from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: Megatron runs only

    for w in wrapped:
        w.eval()
    try:
        with params_synced(wrapped), torch.no_grad():
            out = get_forward_backward_func()(
                forward_step_func=partial(eval_forward_step, device),
                data_iterator=_one_or_list([iter(batches) for _ in wrapped]), model=_one_or_list(wrapped),
                num_microbatches=len(batches), seq_length=r.data.seq_len,
                micro_batch_size=batches[0]["input_ids"].shape[0], forward_only=True)
    finally:
        for w in wrapped:
            w.train()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    if out and ps.get_tensor_model_parallel_rank() == 0:
        total[0] = torch.stack([x["sum"] for x in out]).sum()
        total[1] = torch.stack([x["count"] for x in out]).sum()
    return total
