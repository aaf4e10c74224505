"""Run under torchrun with 2 ranks: checkpoints written by Megatron-Core's own code from real GPTModels, laid out as
Megatron-LM 0.16 lays them out, in one launch.

    torchrun --nproc_per_node 2 tests/megatron_native_writer.py HF_TIED HF_UNTIED OUT [TORCH_DIST_ITER LEGACY_TIED
        LEGACY_UNTIED [HF_QWEN2 HF_QWEN3 [HF_ODD]]]

OUT/legacy: the legacy layout (`--ckpt-format torch`, `--no-save-optim`) at TP1 x PP2 x VPP2 from HF_TIED (4 layers,
tied embeddings): iter_0000003/mp_rank_00_00{0,1}/model_optim_rng.pt holding args (an argparse.Namespace with the
objects a real run's args hold: AttnBackend, signal.Signals, torch dtypes), checkpoint_version, iteration, model0 and
model1 (each chunk's state_dict_for_save_checkpoint()) and rng_state (numpy arrays and dtypes, torch RNG bytes).
OUT/torch_dist: `dist_checkpointing.save` at TP2 from HF_UNTIED of the state dict Megatron-LM's save_checkpoint builds
(args, checkpoint_version, iteration, and `model` = the GPTModel's sharded_state_dict()).
With TOOLKIT_TORCH_DIST_ITER (a torch_dist iter folder `toolkit convert --to torch_dist` wrote from HF_UNTIED), the
same launch then loads it with Megatron-Core's own `dist_checkpointing.load` at TP2 and at TP1 x PP2
(tests/megatron_dist_load_probe.py) and prints "loaded 2x1x1" and "loaded 1x2x1" when every weight matched; and
loads the legacy checkpoints `toolkit convert --to megatron_lm` wrote (from HF_TIED at TP1 x PP2 x VPP2, from
HF_UNTIED at TP2) into GPTModels with strict=True ("loaded legacy 1x2x2", "loaded legacy 2x1x1").
OUT/optim_plain, OUT/optim_distopt, OUT/optim_dp_reshardable: torch_dist with the optimizer state after two Adam
steps of Megatron-Core's own optimizer in bf16 (get_megatron_optimizer): plain at TP2, and distributed at DP2 saved as
fully_reshardable and as dp_reshardable (Megatron-LM's default), each with live.safetensors beside it (the live
optimizer's state by name; torch_dist_optim). More dp_reshardable ones: OUT/dp_reshardable_buckets (DP2, buckets of
5000 elements, so several per chunk), OUT/dp_reshardable_tp2 (TP2) and OUT/dp_reshardable_pp2_vpp2 (from HF_TIED at
PP2 x VPP2 in fp32: the tied embedding's copies in buckets of their own). Before saving, the parameters are gathered
as Megatron-LM's save_checkpoint gathers them (with the overlapped parameter gather, a rank holds the last step's
values in the ranges other DP ranks own until the next forward).
OUT/fps_distopt and OUT/fps_dp_reshardable: the distributed optimizer at DP2 again, both sharding types, saved through
Megatron-LM's default FullyParallelSaveStrategyWrapper (replicated shards spread over the data-parallel ranks' files).
OUT/legacy_distopt, OUT/legacy_distopt_buckets (from HF_ODD, hidden size 48, a bucket per parameter), OUT/legacy_distopt_tp2,
OUT/legacy_distopt_pp2_vpp2: Megatron-LM's legacy layout with the distributed optimizer's distrib_optim.pt (its own
save_parameter_state), each with live.safetensors. OUT/legacy_plain_tp2, OUT/legacy_plain_pp2_vpp2 (fp32, tied) and
OUT/legacy_plain_qwen2: the same with the plain optimizer (its state_dict in model_optim_rng.pt).
With HF_QWEN2 and HF_QWEN3 (other families), the same launch also writes OUT/legacy_qwen2 (the legacy layout at TP2,
args with --add-qkv-bias) and OUT/torch_dist_qwen3 (torch_dist at TP1 x PP2, args with --qk-layernorm and kv_channels
apart from hidden_size / heads), as Megatron-LM writes those families.
Megatron-LM itself (megatron.training) is not installed here; its save_checkpoint's layout is reproduced around
Megatron-Core's objects. The __main__ guard matters: dist_checkpointing's writer spawns a process that re-imports it.
"""
import argparse
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.recipe import load_recipe, resolve  # noqa: E402
from toolkit.train.dist import init_distributed  # noqa: E402


def recipe(hf: str, tp: int, pp: int, vpp: int, extra: tuple = ()):
    return load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={hf}", "model.pretrained=true",
                                      "parallel.backend=megatron", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                      f"parallel.vpp={vpp}", "training.global_batch_size=2",
                                      "training.micro_batch_size=1", *extra])


def megatron_lm_args(r, layout) -> argparse.Namespace:
    """The model-defining subset of pretrain_gpt.py's args, plus the non-tensor objects every real run's args hold."""
    from megatron.core.transformer.enums import AttnBackend

    from toolkit.families import dims_from_hf
    from toolkit.model import to_hf_config

    m = r.model
    dims = dims_from_hf(to_hf_config(m), layout.tp, 128)
    return argparse.Namespace(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None, num_layers=m.num_layers,
        hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size, num_attention_heads=m.num_attention_heads,
        group_query_attention=True, num_query_groups=m.num_kv_heads,
        kv_channels=m.head_dim or m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings, norm_epsilon=m.rms_norm_eps, rotary_base=int(m.rope_theta),
        untie_embeddings_and_output_weights=not m.tie_word_embeddings, padded_vocab_size=dims.padded_vocab,
        make_vocab_size_divisible_by=128, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        add_bias_linear=False, params_dtype=torch.float32, main_grads_dtype=torch.float32, bf16=False,
        attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM, ckpt_format="torch", seed=1234,
        data_path=["/data/corpus_text_document"], tokenizer_type="HuggingFaceTokenizer",
        add_qkv_bias=m.family == "qwen2", qk_layernorm=m.family == "qwen3")  # --add-qkv-bias, --qk-layernorm


def build(hf: str, tp: int, pp: int, vpp: int, extra: tuple = ()):
    from toolkit.megatron import runtime

    r = recipe(hf, tp, pp, vpp, extra)
    layout = resolve(r, dist.get_world_size()).layout
    runtime.init_parallel(r, layout, on_gpu=False)
    chunks = runtime.build_chunks(r, layout, on_gpu=False)
    runtime.load_hf_weights(chunks, hf, r, layout)
    return r, layout, chunks


def legacy(hf: str, out: Path, tp: int = 1, pp: int = 2, vpp: int = 2) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    r, layout, chunks = build(hf, tp, pp, vpp)
    state = {"args": megatron_lm_args(r, layout), "checkpoint_version": 3.0, "iteration": 3,
             "num_floating_point_operations_so_far": 0}
    for i, chunk in enumerate(chunks):
        state["model" if vpp == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
    state["rng_state"] = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                           "rng_tracker_states": get_cuda_rng_tracker().get_states()}]
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    folder = out / "iter_0000003" / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "model_optim_rng.pt")
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("3")
    dist.barrier()
    ps.destroy_model_parallel()


def torch_dist(hf: str, out: Path, tp: int = 2, pp: int = 1) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    r, layout, chunks = build(hf, tp, pp, 1)
    state = {"args": megatron_lm_args(r, layout), "checkpoint_version": 3.0, "iteration": 5,
             "num_floating_point_operations_so_far": 0, "model": chunks[0].sharded_state_dict()}
    state["args"].ckpt_format = "torch_dist"
    folder = out / "iter_0000005"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # with the content metadata Megatron-LM 0.16's save_checkpoint stores (no optimizer: no sharding type)
    dist_checkpointing.save(state, str(folder),
                            content_metadata={"singleton_local_shards": False, "chained_optim_avoid_prefix": True})
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("5")
    dist.barrier()
    ps.destroy_model_parallel()


def _trained(hf: str, tp: int, zero_stage: int, precision: str, pp: int, vpp: int, extra: tuple):
    """Two Adam steps of Megatron-Core's optimizer (get_megatron_optimizer: plain, or distributed when zero_stage is
    1) on random tokens; the parameters then gathered as Megatron-LM's save_checkpoint gathers them (with the
    overlapped parameter gather, a rank holds the last step's values in the ranges other DP ranks own until the next
    forward). (recipe, layout, DDP-wrapped chunks, optimizer, the live state by name: _live_state)."""
    from megatron.core import parallel_state as ps

    from toolkit.megatron import runtime

    r, layout, chunks = build(hf, tp, pp, vpp, (f"parallel.zero_stage={zero_stage}", f"training.precision={precision}",
                                               "data.seq_len=16", *extra))
    wrapped, optimizer = runtime.wrap_and_optimize(chunks, r, layout)
    g = torch.Generator().manual_seed(7 + ps.get_data_parallel_rank())
    for _ in range(2):
        n = r.training.global_batch_size // layout.dp
        batches = [{"input_ids": (ids := torch.randint(0, 500, (1, 16), generator=g)), "labels": ids.clone()}
                   for _ in range(n)]
        runtime.train_step(wrapped, optimizer, batches, r, 1e-2, torch.device("cpu"))
    for w in wrapped:
        if w.use_forward_hook:
            w.disable_forward_pre_hook()
    return r, layout, wrapped, optimizer, _live_state(wrapped, optimizer, zero_stage == 1)


def _save_live(out: Path, live: dict) -> None:
    from safetensors.torch import save_file

    save_file(live, str(out / "live.safetensors"))


def torch_dist_optim(hf: str, outs: dict, tp: int, zero_stage: int, precision: str, pp: int = 1, vpp: int = 1,
                     extra: tuple = (), args_for=megatron_lm_args, fully_parallel: bool = False) -> None:
    """_trained, then dist_checkpointing.save of {args, iteration, model, optimizer} as Megatron-LM's
    save_checkpoint builds it, into each folder of `outs` ({folder: metadata["distrib_optim_sharding_type"] or None}).
    Beside each, live.safetensors: Megatron's own state by name ("<name>:exp_avg", ":exp_avg_sq", ":master"), gathered
    from the live optimizer (TP shards and, for the distributed optimizer, its data-parallel ranks' buffer ranges).
    `fully_parallel`: through FullyParallelSaveStrategyWrapper over the data-parallel group, as Megatron-LM 0.16 saves
    by default (--ckpt-fully-parallel-save is on unless --no-ckpt-fully-parallel-save): each replicated shard is
    written by one data-parallel rank, spread over all of them, not all by the first."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    r, layout, wrapped, optimizer, live = _trained(hf, tp, zero_stage, precision, pp, vpp, extra)
    scheduler = scheduler_for(optimizer)
    for _ in range(2):
        scheduler.step(increment=r.training.global_batch_size)
    for out, sharding in outs.items():
        meta = {"chained_optim_avoid_prefix": True, **({"distrib_optim_sharding_type": sharding} if sharding else {})}
        model = {f"model{i}" if vpp > 1 else "model": w.module.sharded_state_dict(metadata=meta)
                 for i, w in enumerate(wrapped)}
        args = args_for(r, layout)
        args.ckpt_format, args.use_distributed_optimizer = "torch_dist", zero_stage == 1
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 2, "num_floating_point_operations_so_far": 0,
                 **model, "optimizer": optimizer.sharded_state_dict(model, metadata=meta),
                 "opt_param_scheduler": scheduler.state_dict()}
        folder = Path(out) / "iter_0000002"
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        # the content metadata Megatron-LM 0.16's save_checkpoint stores (its _build_sharded_state_dict_metadata)
        saved = {"singleton_local_shards": False, **meta, **({"distrib_optim_fully_reshardable_mem_efficient": False}
                                                              if sharding == "fully_reshardable" else {})}
        strategy = None
        if fully_parallel:  # Megatron-LM's save_checkpoint, with its default ckpt_fully_parallel_save
            strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                        ps.get_data_parallel_group(with_context_parallel=True), False)
        dist_checkpointing.save(state, str(folder), strategy, content_metadata=saved)
        if dist.get_rank() == 0:
            (Path(out) / "latest_checkpointed_iteration.txt").write_text("2")
            _save_live(Path(out), live)
        dist.barrier()
    ps.destroy_model_parallel()


def scheduler_for(optimizer, from_checkpoint: bool = False):
    """Megatron-Core's learning-rate and weight-decay scheduler, as Megatron-LM's get_optimizer_param_scheduler
    builds it (cosine decay after a warmup); from_checkpoint: as `--use-checkpoint-opt_param-scheduler` builds it
    (what it loads replaces these values)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2,
                                   lr_decay_steps=200, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                   wd_incr_steps=200, wd_incr_style="constant",
                                   use_checkpoint_opt_param_scheduler=from_checkpoint)


def legacy_optim(hf: str, out: Path, tp: int, precision: str, pp: int = 1, vpp: int = 1, extra: tuple = (),
                 distributed: bool = True, args_for=megatron_lm_args) -> None:
    """_trained with the distributed optimizer (or the plain one), then the legacy layout as Megatron-LM's
    save_checkpoint writes it (`--ckpt-format torch`): on each model-parallel rank of the first DP rank,
    model_optim_rng.pt with args (with the arguments that fix the buckets: use_distributed_optimizer,
    overlap_grad_reduce, ddp_bucket_size, data_parallel_size), iteration, model[0..], and optimizer.state_dict(); beside
    it distrib_optim.pt, written by the distributed optimizer's own save_parameter_state (gathered over DP).
    With expert parallelism, each expert-parallel rank's folder (mp_rank_TT[_PPP]_EEE) is written by the first rank of
    its expert-data-parallel group, as Megatron-LM does; its distrib_optim.pt holds the chained optimizers' two
    states. live.safetensors as for torch_dist_optim; args_for(recipe, layout) gives the args."""
    from megatron.core import parallel_state as ps

    from toolkit.adapters import megatron as mcfg

    r, layout, wrapped, optimizer, live = _trained(hf, tp, int(distributed), precision, pp, vpp, extra)
    scheduler = scheduler_for(optimizer)
    for _ in range(2):  # Megatron-LM steps it by the global batch size each iteration
        scheduler.step(increment=r.training.global_batch_size)
    args = args_for(r, layout)
    ddp = mcfg.to_ddp_config_kwargs(r, layout)
    args.use_distributed_optimizer, args.overlap_grad_reduce = distributed, ddp["overlap_grad_reduce"]
    args.ddp_bucket_size, args.data_parallel_size = r.parallel.megatron.bucket_size, layout.dp
    args.overlap_param_gather_with_optimizer_step = False
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep = ps.get_expert_model_parallel_world_size()
    folder = out / "iter_0000002" / ((f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
                                     + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""))
    first = (ps.get_expert_data_parallel_rank() if ep > 1 else ps.get_data_parallel_rank()) == 0
    if first:
        folder.mkdir(parents=True, exist_ok=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 2, "num_floating_point_operations_so_far": 0,
                 "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict()}
        for i, w in enumerate(wrapped):
            state["model" if vpp == 1 else f"model{i}"] = w.module.state_dict_for_save_checkpoint()
        torch.save(state, folder / "model_optim_rng.pt")
    dist.barrier()
    if distributed:
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))  # collective; the first DP rank writes
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("2")
        _save_live(out, live)
    dist.barrier()
    ps.destroy_model_parallel()


def _live_state(wrapped: list, optimizer, distributed: bool) -> dict:
    """{local-spec name at TP1 x PP1:field: full tensor} of the live optimizer's Adam moments and fp32 mains: TP shards
    gathered along each parameter's partition_dim (which the state shares with the parameter) into Megatron's TP1
    layout, every pipeline stage's chunks under their global layer numbers (the tied output layer's copy of the
    embeddings left out, as a one-stage model has none), and every expert-parallel rank's routed experts under their
    global indices."""
    from megatron.core import parallel_state as ps

    names = {}
    for w in wrapped:
        for n, q in w.module.named_parameters():
            if getattr(q, "shared_embedding", False) and n.startswith("output_layer."):
                continue
            parts = n.split(".")
            if n.startswith("decoder.layers."):  # the chunk's local layer index -> the global one (1-based there)
                parts[2] = str(w.module.decoder.layers[int(parts[2])].layer_number - 1)
            if "local_experts" in parts:  # the expert-parallel rank's local expert index -> the global one
                i = parts.index("local_experts") + 1
                per_rank = w.module.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
                parts[i] = str(int(parts[i]) + per_rank * ps.get_expert_model_parallel_rank())
            names[q] = ".".join(parts)
    out = {}
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if distributed:  # dp_zero: each buffer's buckets without their end padding, one after the other
            world = o.get_parameter_state_dp_zero(return_on_all_ranks=True)
            for gbuf_idx, buffer in enumerate(o.buffers):
                tensors = next(iter(world[gbuf_idx].values()))
                before = [sum(b.numel_unpadded for b in buffer.buckets[:i]) for i in range(len(buffer.buckets))]
                for q, (start, end, bucket) in buffer.param_index_map.items():
                    if q not in names:
                        continue
                    at = start - buffer.buckets[bucket].offset + before[bucket]
                    for field, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("master", "param")):
                        out[f"{names[q]}:{field}"] = (tensors[key][at:at + end - start].reshape(q.shape).clone(), q)
        else:
            mains = ([(q, m) for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups) for q, m in zip(mg, fg)]
                     if hasattr(o, "float16_groups") else [(q, q) for g in o.optimizer.param_groups for q in g["params"]])
            for q, m in mains:
                if q not in names:
                    continue
                st = o.optimizer.state[m]
                out.update({f"{names[q]}:exp_avg": (st["exp_avg"], q), f"{names[q]}:exp_avg_sq": (st["exp_avg_sq"], q)})
                if m is not q:
                    out[f"{names[q]}:master"] = (m.detach(), q)
    full = {}
    tp = ps.get_tensor_model_parallel_world_size()
    for k, (v, q) in sorted(out.items()):
        if tp > 1 and getattr(q, "tensor_model_parallel", False):
            parts = [torch.empty_like(v) for _ in range(tp)]
            dist.all_gather(parts, v.contiguous(), group=ps.get_tensor_model_parallel_group())
            if "linear_fc1." in k:  # each TP rank holds cat(its gate shard, its up shard): TP1's is cat(gate, up)
                parts = [h for i in (0, 1) for h in (x.chunk(2, dim=0)[i] for x in parts)]
            v = torch.cat(parts, dim=q.partition_dim)
        full[k] = v.detach().float().contiguous().clone()
    if ps.get_pipeline_model_parallel_world_size() > 1:  # every stage's tensors, on every rank
        stages = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, full, group=ps.get_pipeline_model_parallel_group())
        full = {k: v for stage in stages for k, v in stage.items()}
    if ps.get_expert_model_parallel_world_size() > 1:  # every expert-parallel rank's experts, on every rank
        ranks = [None] * ps.get_expert_model_parallel_world_size()
        dist.all_gather_object(ranks, full, group=ps.get_expert_model_parallel_group())
        full = {k: v for rank in ranks for k, v in rank.items()}
    return full


def main(hf_tied: str, hf_untied: str, out: str, torch_dist_iter: str | None = None, legacy_tied: str | None = None,
         legacy_untied: str | None = None, hf_qwen2: str | None = None, hf_qwen3: str | None = None,
         hf_odd: str | None = None) -> None:
    init_distributed(with_deepspeed=False)
    legacy(hf_tied, Path(out) / "legacy")
    torch_dist(hf_untied, Path(out) / "torch_dist")
    # the optimizer state, plain (TP2, bf16) and distributed (DP2, bf16; Megatron-LM's two sharding types)
    torch_dist_optim(hf_untied, {Path(out) / "optim_plain": None}, 2, 0, "bf16")
    torch_dist_optim(hf_untied, {Path(out) / "optim_distopt": "fully_reshardable",
                                 Path(out) / "optim_dp_reshardable": "dp_reshardable"}, 1, 1, "bf16")
    # Megatron-LM's default flat buffers at other layouts: DP2 cut into several buckets; TP2; PP2 x VPP2 with the
    # tied embeddings in buckets of their own
    torch_dist_optim(hf_untied, {Path(out) / "dp_reshardable_buckets": "dp_reshardable"}, 1, 1, "bf16",
                     extra=("parallel.megatron.bucket_size=5000",))
    torch_dist_optim(hf_untied, {Path(out) / "dp_reshardable_tp2": "dp_reshardable"}, 2, 1, "bf16")
    # Megatron-LM's default save strategy at DP2 (fully parallel: the two DP ranks share the writing)
    torch_dist_optim(hf_untied, {Path(out) / "fps_distopt": "fully_reshardable",
                                 Path(out) / "fps_dp_reshardable": "dp_reshardable"}, 1, 1, "bf16", fully_parallel=True)
    torch_dist_optim(hf_tied, {Path(out) / "dp_reshardable_pp2_vpp2": "dp_reshardable"}, 1, 1, "fp32", pp=2, vpp=2)
    # Megatron-LM's legacy files with the distributed optimizer (distrib_optim.pt): DP2 in bf16 in one bucket and in
    # a bucket per parameter; TP2; PP2 x VPP2 with tied embeddings in fp32
    legacy_optim(hf_untied, Path(out) / "legacy_distopt", 1, "bf16")
    if hf_odd:  # hidden size 48: its norms end off the 64-element alignment, so each bucket cut moves what follows
        legacy_optim(hf_odd, Path(out) / "legacy_distopt_buckets", 1, "bf16", extra=("parallel.megatron.bucket_size=1",))
    legacy_optim(hf_untied, Path(out) / "legacy_distopt_tp2", 2, "bf16")
    legacy_optim(hf_tied, Path(out) / "legacy_distopt_pp2_vpp2", 1, "fp32", pp=2, vpp=2)
    # Megatron-LM's default, the plain optimizer, in model_optim_rng.pt (its state keyed by position): TP2 in bf16,
    # PP2 x VPP2 with tied embeddings in fp32, and Qwen2 (biases: in the no-weight-decay group) in bf16
    legacy_optim(hf_untied, Path(out) / "legacy_plain_tp2", 2, "bf16", distributed=False)
    legacy_optim(hf_tied, Path(out) / "legacy_plain_pp2_vpp2", 1, "fp32", pp=2, vpp=2, distributed=False)
    if hf_qwen2:
        legacy_optim(hf_qwen2, Path(out) / "legacy_plain_qwen2", 1, "bf16", distributed=False)
    if hf_qwen2:
        legacy(hf_qwen2, Path(out) / "legacy_qwen2", tp=2, pp=1, vpp=1)
        torch_dist(hf_qwen3, Path(out) / "torch_dist_qwen3", tp=1, pp=2)
    if torch_dist_iter:
        from megatron_dist_load_probe import check, check_legacy

        for tp, pp in ((2, 1), (1, 2)):
            check(hf_untied, torch_dist_iter, tp, pp, 1)
        check_legacy(hf_tied, legacy_tied, 1, 2, 2)
        check_legacy(hf_untied, legacy_untied, 2, 1, 1)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:10])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
