"""The model from a recipe: the Hugging Face causal LM of its family (LlamaForCausalLM, Qwen2ForCausalLM, ...),
random or from local pretrained weights."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.errors import ToolkitError
from toolkit.families import family_named
from toolkit.format import paths
from toolkit.format import safetensors_stream as st
from toolkit.recipe.presets import normal_rope
from toolkit.recipe.schema import ModelConfig


def to_hf_config(m: ModelConfig, tokenizer=None):
    """The transformers config (LlamaConfig, Qwen2Config, ...) equivalent to the recipe's model section."""
    import transformers  # lazy: heavy; model paths only

    family = family_named(m.family)

    rope = {**normal_rope(m.rope_scaling or {}), "rope_theta": m.rope_theta}  # `type`, the older spelling, too
    own = family.hf_config_from_recipe(m) if family.hf_config_from_recipe else {}
    return getattr(transformers, family.hf_config_class)(
        **family.hf_config_fields, **own, head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_heads or m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings, rope_parameters=rope, rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings, initializer_range=m.initializer_range,
        attention_dropout=0.0, use_cache=False,
        bos_token_id=getattr(tokenizer, "bos_token_id", None), eos_token_id=getattr(tokenizer, "eos_token_id", None),
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
    )


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The tokenizer's special ids that a training run records in its checkpoints' metadata (`tokens`)."""


def released_config(m: ModelConfig, tokens: dict | None = None) -> dict:
    """The config.json a conversion of a training checkpoint writes: to_hf_config's, without the training-time
    use_cache=False, which would turn generate()'s KV cache off by default in the released model, and with the
    special token ids the run's tokenizer had (`tokens`, from its metadata; null until 2026-12-07, so generate() of
    an exported model never stopped at the end-of-sequence token)."""
    config = to_hf_config(m).to_dict()
    config.pop("use_cache", None)
    config.update({k: v for k, v in (tokens or {}).items()
                   if k in TOKEN_IDS and (isinstance(v, int) and not isinstance(v, bool))})
    return config


def build_model(m: ModelConfig, seed: int, tokenizer=None, zero3_config: dict | None = None):
    """The family's causal LM (e.g. LlamaForCausalLM) in fp32 (DeepSpeed casts for mixed precision).

    With `zero3_config` it is built inside deepspeed.zero.Init, so each parameter is partitioned as it is created
    and the whole model never materialises on one rank. Random initialisation runs after construction, through
    transformers' own init functions in the same module order with and without ZeRO-3 (gathered per module,
    filled on rank 0), so a seed gives the same initial weights at every ZeRO stage and world size.
    """
    import transformers  # lazy: heavy; model paths only
    from transformers.initialization import no_init_weights  # lazy: heavy; model paths only

    cfg = to_hf_config(m, tokenizer)
    contexts = [no_init_weights()]
    if zero3_config is not None:
        import deepspeed  # lazy: DeepSpeed paths only
        from transformers.integrations.deepspeed import prevent_arange_dtype_change  # lazy: heavy; model paths only

        # keeps RoPE's integer arange buffers integer under zero.Init's dtype casting
        contexts += [prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=zero3_config)]
    # The class is looked up (its module imported) before zero.Init: a module class defined inside it gets DeepSpeed's
    # __init__ hook under transformers' own wrapper, and leaving zero.Init put back the __init__ from before that
    # wrapper, so a Qwen3-MoE model built later in the process (checkpoint.export_hf's verification) had experts
    # without `config` and failed (a trial of 2026-12-07).
    architecture = getattr(transformers, family_named(m.family).hf_architecture)
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        model = architecture(cfg)
    if m.pretrained:
        load_hf_weights(model, Path(m.hf_path), zero3=zero3_config is not None)
    else:
        torch.manual_seed(seed)  # same seed on every rank -> same initial weights everywhere
        if zero3_config is not None:
            from transformers.integrations.deepspeed import initialize_weights_zero3  # lazy: heavy; model paths only

            initialize_weights_zero3(model)
        else:
            model.initialize_weights()
    model.tie_weights()
    return model


def load_hf_weights(model, folder: Path, zero3: bool) -> None:
    """Copy a Hugging Face safetensors checkpoint into `model` one tensor at a time (bounded memory).
    Under ZeRO-3 each parameter is gathered, filled on rank 0, and re-partitioned on exit."""

    params = dict(model.named_parameters())
    seen: set[str] = set()
    family = family_named(model.config.model_type)
    dims = family.dims(model.config, 1, 128) if family.from_memory else None
    pending: dict[str, list] = {}  # a fused parameter (MoE experts) -> its stored parts read so far
    for file in sorted(folder.glob("*.safetensors")):
        # the toolkit's own reader: byte ranges checked, and never a file linked from outside the folder
        with st.Reader(paths.inside(folder, file.name, "model.hf_path")) as f:
            for key in f.keys():
                fused = family.from_memory(key, dims) if family.from_memory else None
                if fused is not None and fused[0] in params:  # transformers 5 keeps the experts in 3-D tensors
                    parts = pending.setdefault(fused[0], [])
                    parts.append((fused[1], f.get(key)))
                    if len(parts) == len(family.in_memory(fused[0], dims)[0]):  # all of it read: fill it at once
                        _copy_parts(params[fused[0]], pending.pop(fused[0]), zero3)
                        seen.add(fused[0])
                    continue
                if key not in params:
                    raise ToolkitError(f"model.hf_path: {file.name} holds {key!r}, which this model does not have; "
                                       "is model.* (or the preset) the architecture of these weights?")
                _copy_into(params[key], f.get(key), key, zero3)
                seen.add(key)
    missing = [k for k in params if k not in seen and not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    missing += sorted(pending)  # fused parameters some of whose parts were not in the files
    if missing:
        raise ToolkitError(f"model.hf_path: {folder} lacks {len(missing)} weights the model needs, e.g. "
                           f"{missing[:3]}; the checkpoint is incomplete or of another architecture")


def _copy_parts(param, parts: list, zero3: bool) -> None:
    """Fill a fused parameter from its stored parts, each with the function that gives its slice of the parameter
    (a view, written in place); under ZeRO-3 gathered once for all of them."""
    def fill(full) -> None:
        with torch.no_grad():
            for take, tensor in parts:
                view = take(full)
                if tuple(view.shape) != tuple(tensor.shape):
                    raise ToolkitError(f"model.hf_path: a part of {tuple(full.shape)} is {tuple(tensor.shape)} in the "
                                       f"checkpoint but {tuple(view.shape)} in the model; set model.* to the "
                                       "checkpoint's architecture (or use model.hf_path alone)")
                view.copy_(tensor)

    if not zero3:
        fill(param)
        return
    import deepspeed  # lazy: DeepSpeed paths only

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if dist.get_rank() == 0:
            fill(param)


def _copy_into(param, tensor, key: str, zero3: bool) -> None:
    shape = tuple(param.ds_shape) if zero3 else tuple(param.shape)
    if tuple(tensor.shape) != shape:
        raise ToolkitError(f"model.hf_path: {key} has shape {tuple(tensor.shape)} in the checkpoint but {shape} in "
                           "the model; set model.* to the checkpoint's architecture (or use model.hf_path alone)")
    if not zero3:
        with torch.no_grad():
            param.copy_(tensor)
        return
    import deepspeed  # lazy: DeepSpeed paths only

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                param.copy_(tensor)


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and embeddings), none on norm weights: the same split Megatron-Core makes, so
    both backends train the same way. ZeRO-3 partitions hold their real shape in ds_shape."""
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(sum of the per-token cross-entropy, number of predicted tokens) of a causal LM, as float64: position t
    predicts labels[t + 1], labels of -100 are not predicted (Hugging Face's shift and ignore index)."""
    target = labels[:, 1:].reshape(-1)
    scores = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    total = torch.nn.functional.cross_entropy(scores, target, ignore_index=-100, reduction="sum")
    return torch.stack([total.double(), (target != -100).sum().double()])
