"""Recipe + layout -> Megatron-Core's configuration, as plain data (no processes, no GPUs).

The runtime turns these dicts into `initialize_model_parallel(**...)`, `TransformerConfig(**...)`,
`DistributedDataParallelConfig(**...)`, `OptimizerConfig(**...)` and `GPTModel(**...)` calls; tests check them
as data. The Llama architecture in Megatron terms: RMSNorm, SwiGLU (gated linear unit with SiLU), RoPE, grouped
query attention through query groups, no biases, untied embeddings unless the recipe ties them; each model family
adds its own TransformerConfig fields (toolkit/families/: Qwen2's add_qkv_bias, Qwen3's qk_layernorm).
"""
from __future__ import annotations

from toolkit.errors import Problem
from toolkit.families import family_named
from toolkit.families.mapping import LLAMA3_ROPE_FIXED
from toolkit.layout import Layout, padded_vocab_size
from toolkit.recipe.presets import normal_rope
from toolkit.recipe.schema import Recipe


def _dtype(precision: str):
    # torch is imported here, not at the top: `toolkit plan` reads these dicts and must start in well under 2 s.
    import torch  # lazy: keeps validate/render free of torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]



def to_parallel_kwargs(layout: Layout) -> dict:
    """Arguments of parallel_state.initialize_model_parallel."""
    return {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
            "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
            "context_parallel_size": layout.cp, "order": "tp-cp-ep-dp-pp",
            **({"expert_model_parallel_size": layout.ep} if layout.ep > 1 else {})}


def _recompute(mode: str) -> dict:
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def to_architecture_kwargs(r: Recipe) -> dict:
    """The TransformerConfig fields that fix the shapes (torch-free: the planner reads them), the family's own
    fields (add_qkv_bias, qk_layernorm) included."""
    m = r.model
    family = family_named(m.family)
    moe = family.megatron_from_recipe(m) if family.megatron_from_recipe else {}
    return {**moe, "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.intermediate_size,
            "num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_kv_heads or m.num_attention_heads,
            "kv_channels": m.head_dim or m.hidden_size // m.num_attention_heads, "add_qkv_bias": False,
            **family_named(m.family).megatron_fields}


def to_transformer_config_kwargs(r: Recipe, layout: Layout, on_gpu: bool) -> dict:
    """TransformerConfig fields for the recipe's model. Fusions that need GPU kernels are on only on GPUs."""
    m, precision = r.model, r.training.precision
    import torch.nn.functional as F  # lazy: keeps validate/render free of torch

    dtype = _dtype(precision)
    # the fused causal softmax kernel ignores an attention mask: packed chat data needs its mask applied
    packed_chat = r.data.kind == "chat" and r.data.packing
    return {
        **to_architecture_kwargs(r),
        "normalization": "RMSNorm", "layernorm_epsilon": m.rms_norm_eps,
        "gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": m.initializer_range,
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "context_parallel_size": layout.cp, "sequence_parallel": layout.sp,
        **({"expert_model_parallel_size": layout.ep} if layout.ep > 1 else {}),
        "params_dtype": dtype, "pipeline_dtype": dtype, "bf16": precision == "bf16", "fp16": precision == "fp16",
        "bias_activation_fusion": on_gpu, "masked_softmax_fusion": on_gpu and not packed_chat, "bias_dropout_fusion": on_gpu,
        "apply_rope_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
        "use_cpu_initialization": not on_gpu, "deallocate_pipeline_outputs": on_gpu,
        **_recompute(r.training.activation_checkpointing),
    }


def to_gpt_model_kwargs(r: Recipe, layout: Layout) -> dict:
    """GPTModel arguments other than config, spec and the per-stage pre/post_process flags."""
    m = r.model
    rope = normal_rope(m.rope_scaling or {})
    return {"vocab_size": padded_vocab_size(m.vocab_size, layout.tp, r.parallel.megatron.make_vocab_size_divisible_by),
            "max_sequence_length": r.data.seq_len, "position_embedding_type": "rope", "rotary_base": int(m.rope_theta),
            "rope_scaling": rope.get("rope_type") == "llama3", "rope_scaling_factor": float(rope.get("factor", 8.0)),
            "share_embeddings_and_output_weights": m.tie_word_embeddings, "parallel_output": True}


def to_ddp_config_kwargs(r: Recipe, layout: Layout) -> dict:
    mc = r.parallel.megatron
    distributed = layout.zero_stage == 1
    return {"grad_reduce_in_fp32": True, "overlap_grad_reduce": mc.overlap_grad_reduce,
            "overlap_param_gather": mc.overlap_param_gather and distributed,
            "use_distributed_optimizer": distributed, "bucket_size": mc.bucket_size, "average_in_collective": True}


def to_optimizer_config_kwargs(r: Recipe, layout: Layout) -> dict:
    """The recipe's ZeRO-1 intent (zero_stage: 1) is Megatron's distributed optimizer."""
    t = r.training
    return {"optimizer": "adam", "lr": t.optimizer.lr, "min_lr": t.schedule.min_lr,
            "weight_decay": t.optimizer.weight_decay, "adam_beta1": t.optimizer.betas[0],
            "adam_beta2": t.optimizer.betas[1], "adam_eps": t.optimizer.eps, "decoupled_weight_decay": True,
            "clip_grad": t.grad_clip, "bf16": t.precision == "bf16", "fp16": t.precision == "fp16",
            "params_dtype": _dtype(t.precision), "initial_loss_scale": 2.0 ** t.fp16_initial_scale_power,
            "use_distributed_optimizer": layout.zero_stage == 1}


def scheduler_state(r: Recipe, step: int) -> dict | None:
    """Megatron-LM's OptimizerParamScheduler state (its state_dict()) that continues the recipe's schedule after
    `step` optimizer steps, for a Megatron-LM checkpoint written from a toolkit one; None without a global batch size.

    Megatron-LM counts samples (its iterations times the global batch size, B). After the warm-up W its learning rate
    at n samples is min + (max - min) * shape((n / B - W) / (D / B - W)) with D the decay samples, which is the
    toolkit's (toolkit/train/schedule.py lr_multiplier) at step n / B when D / B = W + max(1, steps - 1 - W). In the
    warm-up they differ by one step: Megatron-LM's k-th iteration runs at (k - 1) / W of the peak, the toolkit's at
    k / W. The weight decay is constant."""
    t, s = r.training, r.training.schedule
    batch = t.global_batch_size
    if not batch:
        return None
    return {"max_lr": t.optimizer.lr, "lr_warmup_steps": s.warmup_steps * batch, "num_steps": step * batch,
            "lr_decay_style": s.decay, "lr_decay_steps": (s.warmup_steps + max(1, t.steps - 1 - s.warmup_steps)) * batch,
            "min_lr": s.min_lr, "start_wd": t.optimizer.weight_decay, "end_wd": t.optimizer.weight_decay,
            "wd_incr_style": "constant", "wd_incr_steps": t.steps * batch}


def check_megatron_model(r: Recipe) -> list[Problem]:
    """What of the model Megatron-Core's GPTModel cannot express, on any machine (`validate` refuses it)."""
    out, rope = [], normal_rope(r.model.rope_scaling or {})
    if rope["rope_type"] != "default" and (rope["rope_type"] != "llama3"
                                           or any(float(rope.get(k, v)) != v for k, v in LLAMA3_ROPE_FIXED.items())):
        out.append(Problem("model.rope_scaling", f"{r.model.rope_scaling} cannot be expressed in Megatron-Core, which "
                           f"supports Llama 3.1 scaling with {LLAMA3_ROPE_FIXED} and any factor",
                           "use backend: deepspeed for other RoPE scalings"))
    if r.model.rope_theta != int(r.model.rope_theta):  # GPTModel's rotary_base is an int (until 2026-12-07: cut)
        out.append(Problem("model.rope_theta", f"{r.model.rope_theta} is not a whole number, and Megatron-Core's "
                           f"rotary_base is an integer (it would train {int(r.model.rope_theta)})",
                           "use backend: deepspeed for this model"))
    return out


def check_megatron(r: Recipe, te_available: bool) -> list[Problem]:
    """What the Megatron backend needs beyond the shared rules (run before any process starts): the model
    (check_megatron_model), and what this machine has."""
    p, out = r.parallel, check_megatron_model(r)
    if not te_available and p.cp > 1:
        out.append(Problem("parallel.cp", "context parallelism needs Transformer Engine's attention on GPUs "
                           "(Megatron-Core's local attention has none), and Transformer Engine is not importable here",
                           "run on GPU nodes with transformer-engine installed, or set cp: 1 for a CPU rehearsal"))
    if p.megatron.transformer_impl == "transformer_engine" and not te_available:
        out.append(Problem("parallel.megatron.transformer_impl", "transformer_engine, but Transformer Engine is not "
                           "importable here", "install transformer-engine on GPU nodes, or use auto/local"))
    return out


def to_json_dict(r: Recipe, layout: Layout, on_gpu: bool = True) -> dict:
    """Every Megatron-Core argument the recipe produces, as JSON-able data (`toolkit render megatron-config`)."""
    import torch  # lazy: keeps validate/render free of torch

    def plain(d: dict) -> dict:
        return {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else
                    getattr(v, "__name__", v) if callable(v) else v) for k, v in d.items()}

    return {"initialize_model_parallel": plain(to_parallel_kwargs(layout)),
            "TransformerConfig": plain(to_transformer_config_kwargs(r, layout, on_gpu)),
            "GPTModel": plain(to_gpt_model_kwargs(r, layout)),
            "DistributedDataParallelConfig": plain(to_ddp_config_kwargs(r, layout)),
            "OptimizerConfig": plain(to_optimizer_config_kwargs(r, layout))}
