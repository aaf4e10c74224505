"""Reading Megatron-LM's legacy checkpoints (`--ckpt-format torch`) without running code hidden in them.

Layout: <root>/latest_checkpointed_iteration.txt and <root>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
(`_PPP` with pipeline parallelism, `_EEE` the expert-parallel rank of a mixture of experts at
--expert-model-parallel-size > 1, as Megatron-LM's get_checkpoint_name names them), each holding `args` (an
argparse.Namespace), `iteration`, `model` (or model0, model1, ... per virtual chunk), and optimizer and RNG state. An
expert-parallel rank's file holds its own routed experts (`mlp.experts.local_experts.{x}`, x its local index) and
a copy of everything else. Files are read by the caller's loader: torch.load(weights_only=True) with an explicit
allow-list (toolkit/format/safe_load.py), or without torch where only the weights' byte offsets are needed
(toolkit/format/pt_zip.py, for `toolkit convert --no-verify`). This module imports neither.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.families import family_named
from toolkit.families.entries import rank_key
from toolkit.families.mapping import LLAMA3_ROPE_FIXED, local_spec_name
from toolkit.format import paths


def iteration_dir(path: Path) -> Path:
    """The iter_* folder of a Megatron-LM checkpoint root (via its tracker file) or the folder itself."""
    if path.name.startswith("iter_"):
        return path
    tracker = path / "latest_checkpointed_iteration.txt"
    if not (tracker.is_symlink() or tracker.exists()):
        raise ToolkitError(f"{path} is not a Megatron-LM checkpoint: no latest_checkpointed_iteration.txt")
    text = paths.pointer(tracker)  # never read through a link out of the folder, nor a pipe or a huge file
    if text != "release" and not (text.isascii() and text.isdigit() and len(text) <= 18):  # an int64, as Megatron's
        raise ToolkitError(f"{tracker} holds {text[:80]!r}, not an iteration number or 'release'; write the number "
                           "of the iteration to convert into it")
    folder = paths.inside(path, "release" if text == "release" else f"iter_{int(text):07d}", str(tracker))
    if not folder.is_dir():
        raise ToolkitError(f"{tracker} points at {folder.name}, which does not exist; pass an existing iter_* folder "
                           "itself, or write the number of a saved iteration into the tracker")
    return folder


def is_torch_dist(it_dir: Path) -> bool:
    """Whether an iteration folder is Megatron-Core's torch_dist (toolkit/checkpoint/torch_dist.py), not legacy."""
    return (it_dir / "metadata.json").is_file() or (it_dir / ".metadata").is_file()


def rank_dir(tp: int, pp: int, pp_size: int, ep: int = 0, ep_size: int = 1) -> str:
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return name + (f"_{ep:03d}" if ep_size > 1 else "")


def rank_file(it_dir: Path, tp: int, pp: int, pp_size: int, ep: int = 0, ep_size: int = 1) -> Path:
    return it_dir / rank_dir(tp, pp, pp_size, ep, ep_size) / "model_optim_rng.pt"


def read(path: Path, load) -> tuple[argparse.Namespace, dict, int, dict]:
    """(args, {rank_key(pp_rank, tp_rank, ep_rank, ep): [chunk state dicts with local-spec names]}, iteration,
    {that rank key: the file's "optimizer" and "opt_param_scheduler" (None without them)}); `load(file)` gives a rank
    file's contents."""
    it_dir = iteration_dir(path)
    paths.check_tree(path, it_dir.glob("mp_rank_*/model_optim_rng.pt"), f"Megatron-LM checkpoint {path}")
    first = min(it_dir.glob("mp_rank_*/model_optim_rng.pt"), default=None)
    if first is None:
        raise ToolkitError(f"{it_dir} holds no mp_rank_*/model_optim_rng.pt files")
    args = load(first)["args"]
    tp, pp, vpp = layout_of_args(args)
    ep = expert_parallel_size(args)
    ranks = [(p, t, e) for p in range(pp) for t in range(tp) for e in range(ep)]
    missing = [str(rank_file(it_dir, t, p, pp, e, ep)) for p, t, e in ranks
               if not rank_file(it_dir, t, p, pp, e, ep).is_file()]
    if missing:
        raise ToolkitError(f"{it_dir} is incomplete for tp={tp} pp={pp}{f' ep={ep}' if ep > 1 else ''}: missing "
                           f"{', '.join(missing[:4])}")
    used = {rank_dir(t, p, pp, e, ep) for p, t, e in ranks}
    extra = sorted(d.name for d in it_dir.glob("mp_rank_*") if d.is_dir() and d.name not in used)
    if extra:  # rank folders of another layout: a save of another tp or pp copied over this one
        raise ToolkitError(f"{it_dir} holds {', '.join(extra[:4])}, which its args' layout (tp={tp} pp={pp}"
                           f"{f' ep={ep}' if ep > 1 else ''}) does not use: it mixes saves of two layouts; re-copy the "
                           "iteration folder from one save")
    shards, iteration, optimizers = {}, None, {}
    for p, t, e in ranks:
        file = rank_file(it_dir, t, p, pp, e, ep)
        state = load(file)
        if iteration is not None and state.get("iteration") != iteration:
            raise ToolkitError(f"{it_dir} mixes two saves: {file} is iteration {state.get('iteration')}, "
                               f"{rank_file(it_dir, 0, 0, pp, 0, ep)} iteration {iteration}; re-copy the iteration "
                               "folder from one save")
        other = state.get("args")
        differ = [f"{k} {_arg(other, k)} against {_arg(args, k)}" for k in _SAME_ARGS
                  if _arg(other, k) != _arg(args, k)]
        if differ:
            raise ToolkitError(f"{it_dir} mixes two saves: {file}'s args differ from {first}'s "
                               f"({', '.join(differ[:3])}); re-copy the iteration folder from one save")
        iteration = state.get("iteration", iteration)
        optimizers[rank_key(p, t, e, ep)] = {k: state.get(k) for k in ("optimizer", "opt_param_scheduler")}
        shards[rank_key(p, t, e, ep)] = model_chunks(state, vpp, file)
    return args, shards, iteration, optimizers


_SAME_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "expert_model_parallel_size", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "group_query_attention", "padded_vocab_size", "num_experts",
              "untie_embeddings_and_output_weights", "use_distributed_optimizer", "kv_channels")
"""Args every rank file of one save holds alike: the model's shape and the layout it was saved at."""


def _arg(args, name: str):
    return getattr(args, name, None)


def model_chunks(state: dict, vpp: int, file: Path | str = "a rank file") -> list[dict]:
    """A rank file's model chunks (`model`, or `model0..N` with virtual pipeline chunks) as {local-spec name: tensor},
    without the `_extra_state` objects; one line when the file holds other chunks than its args' layout gives."""
    keys = ["model"] if vpp == 1 else [f"model{c}" for c in range(vpp)]
    held = sorted(k for k in state if re.fullmatch(r"model\d*", k))
    if held != sorted(keys) or not all(isinstance(state[k], dict) for k in keys):
        raise ToolkitError(f"{file} holds the model chunks {held or 'none'}, but its args' layout (virtual pipeline "
                           f"size {vpp}) gives {keys}: the file and its args are of different saves, or the file "
                           "was edited; re-copy the checkpoint")
    return [{local_spec_name(k): v for k, v in state[key].items() if not k.endswith("_extra_state") and v is not None}
            for key in keys]


LLAMA_ARGS = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "add_bias_linear": False,
              "rotary_percent": 1.0, "multi_latent_attention": False, "window_size": None, "rotary_interleaved": False,
              "apply_layernorm_1p": False, "apply_residual_connection_post_layernorm": False}
"""Megatron-LM arguments (when present) that every family the converters know has (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE: RMSNorm, SwiGLU, RoPE over the whole head, no linear biases, no sliding window); anything else is another
architecture (interleaved or interpolated RoPE, LayerNorm's 1 + weight, a residual after the norm, multi-token
prediction layers included). `--use-rope-scaling` is Llama 3.1's RoPE scaling (hf_config). Three arguments tell the
families apart: `--add-qkv-bias` (Qwen2), `--qk-layernorm` (Qwen3) and, with
it, `--num-experts` (Qwen3-MoE)."""
NO_OP_ARGS = {"rotary_seq_len_interpolation_factor": (None, 1), "mtp_num_layers": (None, 0)}
"""Arguments that change nothing at these values (conversion scripts pass --rotary-seq-len-interpolation-factor 1)."""

MOE_ARGS = {"moe_router_score_function": "softmax", "moe_shared_expert_intermediate_size": None, "moe_layer_freq": 1,
            "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
            "moe_router_enable_expert_bias": False}
"""Megatron-LM's mixture-of-experts arguments (when present) of Qwen3-MoE: a softmax router without groups, expert
bias or scaling, no shared expert, experts in every layer. Qwen3-MoE's norm_topk_prob is `--moe-router-pre-softmax`
off (top-k of the logits, then a softmax over those k)."""


HF_FIELDS = ("model_type", "bos_token_id", "eos_token_id", "vocab_size")
"""Hugging Face config fields that no Megatron-LM argument holds. The toolkit's own Megatron-LM and torch_dist outputs
carry them in `args.toolkit_hf_fields`, an argument Megatron-LM neither sets nor reads, so that a Mistral comes back
as Mistral, the token ids come back, and the true vocabulary size needs no --vocab-size (all were lost until
2026-12-07). A run that Megatron-LM continues saves its own args without it."""


def hf_fields(config: dict) -> dict:
    """config's HF_FIELDS that are set (a string, or ids: an int or a list of ints)."""
    def plain(v):
        return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v))
    return {k: config[k] for k in HF_FIELDS if plain(config.get(k))}


def _own_fields(args: argparse.Namespace) -> dict:
    fields = getattr(args, "toolkit_hf_fields", None)
    return hf_fields(fields) if isinstance(fields, dict) else {}


def recorded_vocab(args: argparse.Namespace) -> int | None:
    """The true vocabulary size the toolkit's own output recorded (HF_FIELDS), when it fits the padded rows."""
    vocab = _own_fields(args).get("vocab_size")
    padded = getattr(args, "padded_vocab_size", None)
    return vocab if isinstance(vocab, int) and isinstance(padded, int) and 0 < vocab <= padded else None


def family_of_args(args: argparse.Namespace, where: Path | str = "the checkpoint's args") -> str:
    """The family Megatron-LM's args describe: qwen2 with add_qkv_bias, qwen3 with qk_layernorm, qwen3_moe with
    qk_layernorm and num_experts, else mistral when the tokenizer (--tokenizer-model) is Mistral's or the toolkit's
    own output says so (HF_FIELDS), else llama. Mistral 7B v0.2/v0.3 has exactly Llama's arguments and weights, so
    only those name it. One line when the args describe a model no family converts exactly."""
    wrong = [f"{k}={getattr(args, k)!r}" for k, v in LLAMA_ARGS.items() if hasattr(args, k) and getattr(args, k) != v]
    wrong += [f"{k}={getattr(args, k)!r}" for k, v in NO_OP_ARGS.items() if getattr(args, k, None) not in v]
    bias, qk_norm = bool(getattr(args, "add_qkv_bias", False)), bool(getattr(args, "qk_layernorm", False))
    experts = getattr(args, "num_experts", None)
    if bias and qk_norm:
        wrong.append("add_qkv_bias=True with qk_layernorm=True")
    if experts:
        every_layer = [1] * int(getattr(args, "num_layers", 0) or 0)  # moe_layer_freq may be a per-layer list
        wrong += [f"{k}={getattr(args, k)!r}" for k, v in MOE_ARGS.items()
                  if getattr(args, k, v) != v and not (k == "moe_layer_freq" and getattr(args, k) == every_layer)]
        if not qk_norm or bias:
            wrong.append(f"num_experts={experts} without qk_layernorm (a mixture of experts other than Qwen3-MoE's)")
    tokenizer = str(getattr(args, "tokenizer_model", None) or "")
    mistral = "mistral" in tokenizer.lower() or _own_fields(args).get("model_type") == "mistral"
    family = ("qwen3_moe" if experts else "qwen2" if bias else "qwen3" if qk_norm else
              "mistral" if mistral else "llama")
    if wrong:
        raise ToolkitError(f"{where}: the model is none of the families ({', '.join(wrong)}); only GPT models "
                           "with RMSNorm, SwiGLU, RoPE and no linear biases (Llama, Mistral; Qwen2 with "
                           "--add-qkv-bias; Qwen3 with --qk-layernorm; Qwen3-MoE with --qk-layernorm and "
                           "--num-experts, a softmax router and no shared expert) convert")
    return family


def hf_config(args: argparse.Namespace, vocab_size: int, where: Path | str = "the checkpoint's args") -> dict:
    """A Hugging Face config.json of the family Megatron-LM's arguments describe (family_of_args), with the true
    vocabulary size."""
    family = family_named(family_of_args(args, where))
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    config = {"architectures": [family.hf_architecture], "model_type": family.model_types[0], "vocab_size": vocab_size,
              "hidden_size": args.hidden_size, "intermediate_size": args.ffn_hidden_size,
              "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_attention_heads,
              "num_key_value_heads": groups, "max_position_embeddings": args.max_position_embeddings,
              "rms_norm_eps": getattr(args, "norm_epsilon", 1e-5),
              "rope_theta": float(getattr(args, "rotary_base", 10000)),
              "tie_word_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
              "hidden_act": "silu", "torch_dtype": "float32", **family.hf_config_fields}
    if getattr(args, "use_rope_scaling", False):  # Megatron-Core's rope_scaling: llama3 with fixed constants
        config["rope_scaling"] = {"rope_type": "llama3", "factor": float(getattr(args, "rope_scaling_factor", 8.0)),
                                  **LLAMA3_ROPE_FIXED}
    config.update({k: v for k, v in _own_fields(args).items() if k not in ("model_type", "vocab_size")})  # token ids
    head_dim = getattr(args, "kv_channels", None)
    if head_dim and head_dim * args.num_attention_heads != args.hidden_size:  # Qwen3's own head size
        config["head_dim"] = head_dim
    if getattr(args, "num_experts", None):
        config.update(num_experts=args.num_experts, num_experts_per_tok=args.moe_router_topk,
                      moe_intermediate_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
                      norm_topk_prob=not getattr(args, "moe_router_pre_softmax", False),
                      router_aux_loss_coef=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0))
    return config


def layout_of_args(args: argparse.Namespace) -> tuple[int, int, int]:
    """(tp, pp, vpp) that Megatron-LM's arguments were saved at."""
    return (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


def expert_parallel_size(args: argparse.Namespace) -> int:
    return int(getattr(args, "expert_model_parallel_size", None) or 1)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
LOCAL_ORDER = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
               "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
               "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
               "mlp.linear_fc2.weight")
"""A local-spec TransformerLayer's parameters in registration order (SelfAttention builds linear_proj before
linear_qkv, then the q/k norms)."""
TE_ORDER = ("self_attention.linear_proj.weight", "input_layernorm.weight", *LOCAL_ORDER[2:])
"""Transformer Engine's: TELayerNormColumnParallelLinear registers its norm weight before its weight."""
ORDERS = {"local": LOCAL_ORDER, "transformer_engine": TE_ORDER}


def registration_order(names: Iterable[str], order: tuple[str, ...]) -> list[str]:
    """A chunk's local-spec parameter names in the order its GPTModel registers them (a mixture of experts' MLP:
    its router, then each local expert's linear_fc1 and linear_fc2, where a dense MLP's linears are)."""
    def key(name: str):
        if name == "embedding.word_embeddings.weight":
            return (0,)
        m = _LAYER.match(name)
        if m:
            rest, mlp = m.group(2), order.index("mlp.linear_fc1.weight")
            expert = _EXPERT.match(rest)
            if expert:
                return (1, int(m.group(1)), mlp, 1 + int(expert.group(1)), int(expert.group(2)))
            return (1, int(m.group(1)), mlp if rest == "mlp.router.weight" else order.index(rest), 0, 0)
        return (2,) if name == "decoder.final_layernorm.weight" else (3,)  # then output_layer.weight
    return sorted(names, key=key)
