"""The one typed schema of a training recipe: every field, its default and what it means.

YAML files and `--set` overrides are views onto these classes; defaults live here and nowhere else.
Field docstrings double as the text `toolkit show --explain` prints and unknown-key errors list.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

Offload = Literal["none", "cpu", "nvme"]


class _Section(BaseModel):
    # extra="forbid": an unknown key is an error that lists the valid ones, never silently ignored.
    # allow_inf_nan=False: `lr: .inf` or `1e999` (YAML reads both as a float) is refused, not trained with.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=False,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value, info):
        """`true` where a number goes: pydantic's lax mode reads it as 1 (`world_size: true` validated as one
        rank; a trial of 2026-12-07). A key whose type takes a bool (or anything) still gets it."""
        if isinstance(value, bool):
            field = cls.model_fields[info.field_name]
            kinds = set(get_args(field.annotation)) or {field.annotation}
            if kinds & {int, float} and not kinds & {bool, Any}:
                raise ValueError("a boolean (true/false) is not a number")
        return value


class ModelConfig(_Section):
    family: Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"] = "llama"
    """Architecture family (toolkit/families/): llama (2, 3), mistral, qwen2 (Qwen2 and Qwen2.5: q/k/v biases), qwen3
    (dense Qwen3: per-head q/k RMSNorm), qwen3_moe (Qwen3-MoE: Qwen3 attention, a mixture of experts in every
    layer). With model.hf_path and no family set, config.json's model_type gives it."""
    preset: Optional[str] = None
    """Named size (the list: docs/recipes.md, "Model presets"); its values sit under any key you set yourself."""
    hf_path: Optional[str] = None
    """Local Hugging Face model folder; its config.json gives the architecture."""
    pretrained: bool = False
    """Load the weights in `hf_path` (fine-tuning) instead of a random initialisation."""
    vocab_size: int = Field(32000, gt=0)
    """Rows of the embedding table; must hold every id the tokenizer produces."""
    hidden_size: int = Field(4096, gt=0)
    """Width of the residual stream."""
    intermediate_size: int = Field(11008, gt=0)
    """Width of the SwiGLU MLP."""
    num_layers: int = Field(32, gt=0)
    """Number of transformer blocks."""
    num_attention_heads: int = Field(32, gt=0)
    """Query heads per layer."""
    num_kv_heads: Optional[int] = Field(None, gt=0)
    """Key/value heads (grouped-query attention); null means as many as query heads."""
    head_dim: Optional[int] = Field(None, gt=0)
    """Width of one attention head; null means hidden_size / num_attention_heads (Qwen3 sets it explicitly)."""
    max_position_embeddings: int = Field(4096, gt=0)
    """Longest sequence the position encoding is set up for."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    rope_scaling: Optional[dict] = None
    """RoPE scaling as Hugging Face spells it (e.g. Llama 3.1: rope_type llama3, factor 8, ...)."""
    rms_norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of the RMSNorm layers."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection."""
    initializer_range: float = Field(0.02, gt=0)
    """Std of the normal initialisation of a random model."""
    num_experts: Optional[int] = Field(None, gt=0)
    """Mixture-of-experts families (qwen3_moe): routed experts per layer."""
    num_experts_per_tok: Optional[int] = Field(None, gt=0)
    """Mixture-of-experts: experts each token is routed to (top-k)."""
    moe_intermediate_size: Optional[int] = Field(None, gt=0)
    """Mixture-of-experts: width of one expert's SwiGLU MLP."""
    norm_topk_prob: bool = True
    """Mixture-of-experts: renormalise the top-k routing weights to sum to 1 (Qwen3-MoE's released models do)."""
    router_aux_loss_coef: float = Field(0.001, ge=0)
    """Mixture-of-experts: weight of the load-balancing loss (Megatron's moe_aux_loss_coeff)."""


class BlendSource(_Section):
    path: str
    """Prefix of a prepared dataset (`toolkit data prepare --output PREFIX`): PREFIX.bin and PREFIX.idx."""
    weight: float = Field(1.0)
    """Relative share of the samples drawn from this source (the weights are normalised; each must be > 0)."""


class DataConfig(_Section):
    kind: Literal["text", "chat"] = "text"
    """text: raw documents for pretraining; chat: conversations (a list of {role, content} per row) rendered through
    the tokenizer's own chat template, with the loss on assistant tokens only (docs/sft.md)."""
    messages_field: str = "messages"
    """kind chat: the column holding each row's conversation, a list of {role, content} objects."""
    paths: list[str] = Field(default_factory=lambda: ["recipes/data/demo_corpus/train.jsonl"])
    """Local text/jsonl/json/parquet files or globs, relative to the repo root or absolute."""
    hub_dataset: Optional[str] = None
    """A `datasets` hub name to use instead of `paths` (needs network access)."""
    format: Literal["auto", "text", "json", "parquet"] = "auto"
    """File format; auto picks it from the file extension."""
    text_field: str = "text"
    """Column holding the raw text in json/parquet files."""
    tokenizer: str = "recipes/data/demo_tokenizer"
    """Tokenizer folder (or hub name when online), loaded with AutoTokenizer."""
    seq_len: int = Field(128, gt=1)
    """Tokens per training sequence."""
    packing: bool = True
    """Concatenate documents (separated by EOS) and cut them into full seq_len blocks. kind chat: put several whole
    conversations in one sequence, each attending only to itself (padded instead where the backend cannot)."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank."""
    blend: Optional[list[BlendSource]] = None
    """Prepared datasets with weights, [{path, weight}], read through Megatron-Core's BlendedMegatronDatasetBuilder
    and GPTDataset on both backends; when set, paths, hub_dataset, format and text_field are not used."""


class EvalConfig(_Section):
    interval: Optional[int] = Field(None, ge=0)
    """Evaluate the validation loss every this many steps and after the last one (a step that evaluates is also
    logged); 0 or null turns evaluation off. Logged as val_loss and val_ppl (exp of val_loss)."""
    batches: Optional[int] = Field(None, gt=0)
    """Global batches per evaluation, each of training.global_batch_size held-out sequences (global, so every
    parallel layout evaluates the same sequences); null = every full global batch of the held-out data (with a
    data.blend: as many as the held-out documents fill once). The same sequences are evaluated each time. The value
    is the token-weighted mean loss over all of them."""
    split: Optional[float] = Field(None, gt=0, lt=1)
    """Hold out this fraction (between 0 and 1) of the packed training sequences for evaluation: the last ones of
    the corpus, always the same, and never trained on. With a data.blend: the last fraction of every source's
    documents (Megatron-Core's split string, e.g. "0.95,0.05,0"). Use one of split, paths and blend."""
    paths: Optional[list[str]] = None
    """Held-out files of their own (globs allowed; the format, text_field, tokenizer, seq_len and packing of the
    data section apply). Use one of split, paths and blend."""
    blend: Optional[list[BlendSource]] = None
    """Held-out prepared datasets of their own, [{path, weight}] like data.blend (which training must read): the
    validation split of Megatron-Core's builder (its blend_per_split), prepared with data.tokenizer. Use one of
    split, paths and blend."""


class OptimizerConfig(_Section):
    name: Literal["adamw"] = "adamw"
    """Optimizer; AdamW (fused on GPU, DeepSpeed's CPU Adam when offloaded)."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam beta1, beta2."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay."""


class ScheduleConfig(_Section):
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to the peak lr."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warm-up, down to min_lr at the last step."""
    min_lr: float = Field(0.0, ge=0)
    """Learning rate reached at the last step (cosine and linear)."""


class TrainingConfig(_Section):
    global_batch_size: Optional[int] = Field(None, gt=0)
    """Sequences per optimizer step over all data-parallel ranks; derived when null."""
    micro_batch_size: Optional[int] = Field(None, gt=0)
    """Sequences per rank per forward pass; derived when null."""
    grad_accum_steps: Optional[int] = Field(None, gt=0)
    """Micro-batches accumulated per optimizer step; derived when null."""
    steps: int = Field(100, gt=0)
    """Optimizer steps to train (the LR schedule spans them)."""
    stop_at_step: Optional[int] = Field(None, gt=0)
    """End this launch after this step with a checkpoint (the schedule still spans `steps`); relaunch resumes."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Training precision: bf16 or fp16 mixed precision (fp32 master weights), or plain fp32."""
    fp16_initial_scale_power: int = Field(16, ge=0, le=32)
    """fp16 only: dynamic loss scaling starts at 2**this."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: full (each block), selective (attention core, Megatron only), none."""
    seed: int = 1234
    """Seed for initialisation and data order; every rank uses the same seed."""


class DeepSpeedConfig(_Section):
    config: Optional[str] = None
    """A DeepSpeed JSON of your own; its "auto" values are filled from this recipe."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    """Elements per gradient reduce bucket."""
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    """Elements per all-gather bucket (ZeRO-1/2)."""
    stage3_prefetch_bucket_size: int = Field(50_000_000, gt=0)
    """ZeRO-3: elements of parameters prefetched ahead of use."""
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    """ZeRO-3: parameters smaller than this stay gathered (saves many small all-gathers)."""
    stage3_max_live_parameters: int = Field(1_000_000_000, gt=0)
    """ZeRO-3: upper bound on gathered parameter elements alive at once."""
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    """ZeRO-3: keep a parameter gathered if it is reused within this many elements."""
    gather_16bit_weights_on_save: bool = True
    """ZeRO-3: DeepSpeed's stage3_gather_16bit_weights_on_model_save, which lets engine.save_16bit_model() write
    whole 16-bit weights (for scripts that run the rendered JSON). The toolkit's checkpoints keep ZeRO's partitions;
    checkpoint.export_hf and `toolkit convert --to hf` write whole weights."""
    pin_memory: bool = True
    """Offload: page-locked CPU buffers (faster host-device copies)."""
    buffer_count: int = Field(5, gt=0)
    """NVMe offload: optimizer-state buffers in flight."""
    param_buffer_count: int = Field(5, gt=0)
    """NVMe offload: parameter buffers in flight."""
    param_buffer_size: int = Field(100_000_000, gt=0)
    """NVMe offload: elements per parameter buffer (must hold the largest parameter)."""
    aio_block_size: int = Field(1_048_576, gt=0)
    """NVMe offload: async I/O block size in bytes."""
    aio_queue_depth: int = Field(8, gt=0)
    """NVMe offload: async I/O queue depth."""
    aio_intra_op_parallelism: int = Field(1, gt=0)
    """NVMe offload: async I/O threads per request."""


class MegatronConfig(_Section):
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    """Layer implementation: Transformer Engine when importable on a GPU (auto), or Megatron's local modules."""
    overlap_grad_reduce: bool = True
    """Overlap the data-parallel gradient reduction with backward."""
    overlap_param_gather: bool = True
    """Distributed optimizer: overlap the parameter all-gather with the next forward."""
    bucket_size: Optional[int] = Field(None, gt=0)
    """Elements per gradient bucket; null = Megatron's default (max(40M, 1M x dp))."""
    make_vocab_size_divisible_by: int = Field(128, gt=0)
    """Pad the vocabulary to a multiple of this x tp (Megatron's rule)."""


class ParallelConfig(_Section):
    backend: Literal["deepspeed", "megatron"] = "deepspeed"
    """Which engine runs the recipe."""
    world_size: Optional[int] = Field(None, gt=0)
    """Ranks this recipe is written for; used by validate/render when no launcher says otherwise."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 0 plain data parallel, 1 shard optimizer, 2 + gradients, 3 + parameters."""
    offload_optimizer: Offload = "none"
    """Where optimizer states live: GPU (none), CPU RAM, or NVMe."""
    offload_params: Offload = "none"
    """Where ZeRO-3 parameters live between uses: GPU (none), CPU RAM, or NVMe."""
    nvme_path: Optional[str] = None
    """Folder on a fast local NVMe drive, required by nvme offload."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel size (Megatron)."""
    pp: int = Field(1, gt=0)
    """Pipeline-parallel size (Megatron)."""
    vpp: int = Field(1, gt=0)
    """Virtual pipeline chunks per stage (interleaved 1F1B, Megatron)."""
    sp: bool = False
    """Sequence parallelism on top of tensor parallelism (Megatron)."""
    cp: int = Field(1, gt=0)
    """Context-parallel size (Megatron)."""
    ep: int = Field(1, gt=0)
    """Expert-parallel size (Megatron, mixture-of-experts families): the routed experts are split over ep ranks,
    carved out of the data-parallel ranks, so ep must divide the experts and dp x cp."""
    dp: Optional[int] = Field(None, gt=0)
    """Data-parallel size; derived as world_size / (tp*pp*cp) when null."""
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    """DeepSpeed-specific tuning."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Megatron-Core-specific tuning."""


class CheckpointConfig(_Section):
    dir: Optional[str] = None
    """Where checkpoints go; defaults to <output_dir>/checkpoints."""
    interval: int = Field(100, gt=0)
    """Save every this many steps (and at the end)."""
    keep: int = Field(2, gt=0)
    """Complete checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint if any; never; or a checkpoint folder (never and a folder
    are refused where checkpoint.dir holds an earlier run's complete checkpoints past the step the run starts from)."""
    export_hf: bool = False
    """At the end of training, convert the last checkpoint to a Hugging Face folder, <output_dir>/hf (with the
    tokenizer of data.tokenizer), as `toolkit convert --to hf` would."""
    format: Literal["toolkit", "torch_dist"] = "toolkit"
    """toolkit: per-rank safetensors files (both backends); torch_dist (Megatron backend only): Megatron-Core's
    dist_checkpointing of the model and optimizer, resumable at another TP/PP/DP layout with no convert step."""


class LoggingConfig(_Section):
    interval: int = Field(10, gt=0)
    """Log every this many steps (the only steps that sync the host with the device)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <output_dir>/tensorboard."""
    sample_prompt: Optional[str] = None
    """At the end of training, print the model's greedy continuation of this text (a visible sanity check); with
    data.kind chat, its reply to this text as a user turn."""
    sample_tokens: int = Field(48, gt=0)
    """Tokens to generate for sample_prompt."""
    peak_tflops: Optional[float] = Field(None, gt=0)
    """Dense peak TFLOP/s of one device for MFU; detected for known GPUs when null."""


class Recipe(_Section):
    name: str = "run"
    """Run name, used in logs and the default output folder."""
    description: str = ""
    """What the recipe is for and the hardware it targets."""
    output_dir: Optional[str] = None
    """Folder for logs, metrics and checkpoints; defaults to runs/<name>."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model architecture and weights."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training data and tokenizer."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Validation loss: how often, how much, and the held-out data."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Batch, optimizer, schedule and precision."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Backend and parallel layout."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint cadence and resume."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """What is logged and how often."""

    @property
    def out_dir(self) -> str:
        return self.output_dir or f"runs/{self.name}"

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.out_dir}/checkpoints"


def explain(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """`toolkit show --explain`: every key with its default and meaning, sections indented."""
    lines = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"{prefix}{name}:  # {f.description}")
            lines += explain(ann, prefix + "  ")
        else:
            default = f.get_default(call_default_factory=True)
            lines.append(f"{prefix}{name}: {json.dumps(default, default=str)}  # {f.description}")
    return lines
