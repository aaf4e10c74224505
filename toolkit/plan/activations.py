"""Activation memory of one decoder layer of the dense families (Llama, Mistral, Qwen2, Qwen3), and of the model's two
ends, on one rank for one micro-batch. Qwen2's q/k/v biases keep nothing more (a linear's bias needs no saved tensor
for its gradient); Qwen3's per-head q/k RMSNorms keep what a norm keeps, over q and k, and its head_dim may differ
from hidden / heads (toolkit/families/: the family's qk_layernorm).

Pure arithmetic, written as a per-op account of the tensors autograd keeps for backward (what each op passes to
save_for_backward, one storage counted once, weights excluded), so every term names the op that holds it. Three
implementations, because they save different tensors:

- "hf": transformers' LlamaDecoderLayer with sdpa attention, as the DeepSpeed backend builds it. With no padding
  mask transformers passes is_causal and enable_gqa (only where the fused kernels take it), and torch runs a
  flash-style kernel on CPU and on CUDA alike: it keeps q, k, v (k, v at kv heads), the output and a float32
  logsumexp, with no s x s term. Measured on CPU; CUDA's flash kernel saves the same set (not run here).
- "megatron_local": Megatron-Core's TransformerLayer with the toolkit's local spec and the unfused settings it uses
  off GPUs (torch RMSNorm, DotProductAttention materialising [b, heads, s, s] scores, unfused SwiGLU). On GPUs the
  same spec gets fused SwiGLU, fused softmax and torch's fused RMSNorm, which keep less; that variant is not modelled.
- "megatron_te": the GPU layer (Transformer Engine spec: norms fused into the following linear, fused/flash
  attention keeping output + logsumexp, fused SwiGLU). It cannot run here: its terms are derived from the same
  per-op rules and the TE/Megatron sources, not measured (tests/test_plan_activations.py measures the other two).
  "megatron" picks megatron_te when attention == "flash" and megatron_local otherwise; "flash" means megatron_te.

Notation in the comments: t tokens of the layer on this rank (micro x seq / cp), h hidden, f ffn / tp, n heads / tp,
g kv heads / tp, d head dim, p bytes of the training dtype, r = tp under sequence parallelism (tensors outside the
tensor-parallel region are split along the sequence) else 1.

Recompute: "full" keeps only the layer input (HF's non-reentrant checkpoint and Megatron's uniform recompute with
recompute_num_layers = 1 both save it, Megatron its sequence-parallel shard); the layer's other tensors are rebuilt
one layer at a time during backward, a transient the planner adds once. "selective" (Megatron only) recomputes the
core attention: its checkpoint keeps q, the rope'd k and the fused qkv output (v is a view of it) instead.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import ToolkitError
from toolkit.families import family_named
from toolkit.layout import padded_vocab_size
from toolkit.recipe.schema import ModelConfig

IMPLS = ("hf", "megatron_local", "megatron_te")
RECOMPUTE = ("none", "selective", "full")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
F32, I64 = 4, 8


@dataclass(frozen=True)
class _Dims:
    """Per-rank sizes of one micro-batch in one layer."""

    b: int
    s: int  # sequence on this rank (seq / cp)
    h: int
    n: int  # query heads on this rank
    g: int  # kv heads on this rank
    d: int
    f: int  # ffn width on this rank
    p: int  # bytes per activation element
    r: int  # sequence split of the tensors outside the TP region (tp under SP, else 1)
    qk_norm: bool = False  # per-head RMSNorm over q and k (Qwen3)

    @property
    def t(self) -> int:
        return self.b * self.s

    @property
    def th(self) -> int:
        """Elements of one [t, h] tensor outside the tensor-parallel region on this rank."""
        return self.t * self.h // self.r


def resolve_impl(impl: str, attention: str | None = None) -> str:
    """The implementation name in IMPLS for `impl` (with the planner's aliases "megatron" and "flash")."""
    if impl == "megatron":
        return "megatron_te" if attention == "flash" else "megatron_local"
    return "megatron_te" if impl == "flash" else impl


def _check(impl: str, tp: int, sp: bool, cp: int, recompute: str, precision: str, seq: int) -> None:
    problems = []
    if impl not in IMPLS:
        problems.append(f"impl {impl!r} is not one of {IMPLS} (or the aliases 'megatron', 'flash')")
    if recompute not in RECOMPUTE:
        problems.append(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    if precision not in DTYPE_BYTES:
        problems.append(f"precision {precision!r} is not one of {tuple(DTYPE_BYTES)}")
    if tp < 1 or cp < 1 or seq % cp:
        problems.append(f"tp = {tp}, cp = {cp} must be >= 1 and cp must divide seq = {seq}")
    if impl == "hf" and (tp > 1 or cp > 1 or sp or recompute == "selective"):
        problems.append("the Hugging Face layer (DeepSpeed backend) has no tp, sp, cp or selective recompute")
    if impl == "megatron_local" and cp > 1:
        problems.append("Megatron's local attention has no context parallelism (it needs Transformer Engine)")
    if problems:
        raise ToolkitError("activation estimate: " + "; ".join(problems))


def _dims(m: ModelConfig, seq: int, micro: int, tp: int, sp: bool, cp: int, precision: str) -> _Dims:
    kv = m.num_kv_heads or m.num_attention_heads
    return _Dims(b=micro, s=seq // cp, h=m.hidden_size, n=m.num_attention_heads // tp, g=max(kv // tp, 1),
                 d=m.head_dim or m.hidden_size // m.num_attention_heads, f=-(-m.intermediate_size // tp),
                 p=DTYPE_BYTES[precision], r=tp if sp else 1, qk_norm=family_named(m.family).qk_norm)


# ---- one layer ----------------------------------------------------------------------------------------------------

def _hf_layer(x: _Dims) -> dict[str, int]:
    t, th, p = x.t, x.th, x.p
    # LlamaRMSNorm upcasts: pow and mul keep the fp32 copy of the input, mul keeps rsqrt [t, 1], and the weight
    # multiply keeps the normalised tensor cast back to the training dtype. (In fp32 the copy is the input itself.)
    norm = F32 * th + F32 * t + p * th
    heads = t * (x.n + x.g)  # rows of the q and k per-head norms (Qwen3): the same three tensors over [t, n + g, d]
    qk = {"q_k_norms": F32 * heads * x.d + F32 * heads + p * heads * x.d} if x.qk_norm else {}
    return qk | {
        "input_norm": norm,
        "qkv_proj_input": p * th,  # q/k/v_proj share their input; RoPE keeps only the shared cos/sin tables
        "sdpa_q_k_v": p * t * x.d * (x.n + 2 * x.g),  # rope'd q and k, v, at kv heads (enable_gqa, no repeat)
        "sdpa_output": p * t * x.n * x.d,  # laid out [b, s, n, d]: the same storage is o_proj's input
        "sdpa_logsumexp": F32 * x.b * x.n * x.s,
        "post_attention_norm": norm,
        "mlp_input": p * th,  # gate_proj and up_proj share it
        "mlp_gate_silu_up_product": 4 * p * t * x.f,  # silu input, silu output, up output, down_proj input
    }


def _megatron_local_layer(x: _Dims, recompute: str) -> dict[str, int]:
    t, th, p, q = x.t, x.th, x.p, x.t * x.n * x.d
    # torch.nn.RMSNorm off CUDA is the composite: fp32 upcast of the input, rstd, and the fp32 normalised tensor
    # the weight multiply keeps (the fused CUDA kernel would keep input + rstd only).
    norm = 2 * F32 * th + F32 * t // x.r
    # q and k norms (Qwen3) run on this rank's heads of every token, never sequence-split: the same composite. In fp32
    # there is no upcast copy: q arrives as a tensor of its own, k as a view of the fused qkv output, which it keeps
    # whole (under selective recompute the checkpoint keeps that already)
    heads = t * (x.n + x.g)
    if p != F32:
        qk = 2 * F32 * heads * x.d
    else:
        qk = F32 * t * x.d * (2 * x.n + x.g) + (0 if recompute == "selective" else F32 * t * x.d * (x.n + 2 * x.g))
    out = {"q_k_norms": qk + F32 * heads} if x.qk_norm else {}
    out |= {"input_norm": norm,
           "linear_qkv_input": p * th,  # column-parallel input; under SP its shard, re-gathered in backward
           "rope_cos_sin": 4 * p * x.s * x.d}  # cos and sin rebuilt in the training dtype for q and for k
    if recompute == "selective":
        out |= {"checkpoint_q_k": p * t * x.d * (x.n + x.g),  # rope'd q and k, saved by the checkpoint
                "checkpoint_v_qkv_output": p * t * x.d * (x.n + 2 * x.g)}  # v is a view: the whole fused qkv
    else:
        scores = x.b * x.n * x.s * x.s
        out |= {"attention_q": p * q,  # baddbmm keeps q and k
                "attention_k_v_repeated": 2 * p * q,  # repeat_interleave to every query head: k for baddbmm, v for bmm
                "causal_mask": x.s * x.s,  # bool [s, s], built in each layer's softmax
                "softmax_fp32": F32 * scores,  # softmax output, kept for its backward
                "probs": p * scores if p != F32 else 0}  # cast back to the training dtype for bmm (fp32: same tensor)
    return out | {
        "linear_proj_input": p * q,  # row-parallel: always this rank's heads
        "pre_mlp_norm": norm,
        "linear_fc1_input": p * th,
        "linear_fc1_output": 2 * p * t * x.f,  # silu keeps a view of its gate half: the whole [t, 2f] output
        "silu_linear_product": 3 * p * t * x.f,  # silu output, x_linear + offset (a copy), linear_fc2 input
    }


def _megatron_te_layer(x: _Dims, recompute: str) -> dict[str, int]:
    t, th, p, q = x.t, x.th, x.p, x.t * x.n * x.d
    norm = p * th + F32 * x.t // x.r  # TE LayerNormLinear keeps its input and rsigma ...
    heads = t * (x.n + x.g)  # TE's RMSNorm over q and k (Qwen3) likewise: input and rsigma per head
    out = {"q_k_norms": p * heads * x.d + F32 * heads} if x.qk_norm else {}
    out |= {"input_norm": norm, "linear_qkv_ln_out": p * th,  # ... and ln_out (the shard under SP) for wgrad
           "rope_cos_sin": 4 * p * x.s * x.d}  # the toolkit sets apply_rope_fusion off
    if recompute == "selective":
        out |= {"checkpoint_q_k": p * t * x.d * (x.n + x.g), "checkpoint_v_qkv_output": p * t * x.d * (x.n + 2 * x.g)}
    else:  # fused/flash attention: q, k, v at kv heads, output, fp32 softmax statistics [b, n, s]. v arrives as a
        # strided view of the fused qkv output, which TE's get_qkv_layout copies to a contiguous tensor first
        out |= {"attention_q_k_v": p * t * x.d * (x.n + 2 * x.g), "attention_lse": F32 * x.b * x.n * x.s}
    return out | {
        "attention_output": p * q,  # also linear_proj's input (same storage)
        "pre_mlp_norm": norm, "linear_fc1_ln_out": p * th,
        "linear_fc1_output": 2 * p * t * x.f,  # fused SwiGLU keeps only its input
        "linear_fc2_input": p * t * x.f,
    }


def layer_activation_terms(model: ModelConfig, seq: int, micro: int, *, tp: int = 1, sp: bool = False, cp: int = 1,
                           recompute: str = "none", precision: str = "bf16", impl: str = "hf",
                           attention: str | None = None) -> dict[str, int]:
    """Bytes one layer keeps for backward on one rank for one micro-batch, per op (see the module docstring)."""
    impl = resolve_impl(impl, attention)
    _check(impl, tp, sp, cp, recompute, precision, seq)
    x = _dims(model, seq, micro, tp, sp, cp, precision)
    if recompute == "full":
        return {"layer_input": x.p * x.th}  # held by the checkpoint; Megatron's under SP is the sequence shard
    if impl == "hf":
        return _hf_layer(x)
    return _megatron_local_layer(x, recompute) if impl == "megatron_local" else _megatron_te_layer(x, recompute)


def layer_activation_bytes(model: ModelConfig, seq: int, micro: int, **kw) -> int:
    """Sum of layer_activation_terms: what one layer holds between its forward and its backward."""
    return sum(layer_activation_terms(model, seq, micro, **kw).values())


# ---- outside the layers ---------------------------------------------------------------------------------------

def model_extra_activation_terms(model: ModelConfig, seq: int, micro: int, *, first: bool = True, last: bool = True,
                                 tp: int = 1, sp: bool = False, cp: int = 1, recompute: str = "none",
                                 precision: str = "bf16", impl: str = "hf", attention: str | None = None,
                                 vocab_multiple: int = 128) -> dict[str, int]:
    """Bytes kept outside the layers on one rank for one micro-batch, per op: the embedding's ids on the first
    pipeline stage; the final norm, the output layer's input, the logits and the loss on the last.

    Kept until backward only. The loss forward and backward also need one more float32 [t, vocab / tp] at its
    peak (the upcast logits, then the gradient of the softmax), a transient not counted here."""
    impl = resolve_impl(impl, attention)
    _check(impl, tp, sp, cp, recompute, precision, seq)
    x = _dims(model, seq, micro, tp, sp, cp, precision)
    t, th, p, out = x.t, x.th, x.p, {}
    if impl == "hf":
        vocab = model.vocab_size
        if first:  # embedding keeps the ids; the rotary cos/sin tables [s, d] are shared by every layer
            out |= {"input_ids": I64 * t, "rope_cos_sin": 2 * p * x.s * x.d}
        if last:
            out |= {"final_norm": F32 * th + F32 * t + p * th, "lm_head_input": p * th,
                    "logits": p * t * vocab,  # returned in the model output, which the loop holds through backward
                    "log_softmax_fp32": F32 * t * vocab,  # cross entropy on logits.float(): keeps its log-softmax
                    "labels_and_loss": I64 * t + 2 * F32}  # shifted labels, loss and nll's total weight
        return out
    vocab = padded_vocab_size(model.vocab_size, tp, vocab_multiple) // tp
    if first:  # embedding keeps the ids (with tp > 1, shifted into its vocab shard) and the out-of-shard mask
        out["input_ids"] = I64 * t + (t if tp > 1 else 0)
    if recompute == "full":  # every layer's checkpoint saves the fp32 rotary table [s, 1, 1, d]: one storage
        out["rope_freqs"] = F32 * x.s * x.d
    if last:
        norm = 2 * F32 * th + F32 * t // x.r if impl == "megatron_local" else p * th + F32 * t // x.r
        out |= {"final_norm": norm, "output_layer_input": p * th,  # column-parallel: the shard under SP
                "vocab_parallel_softmax_fp32": F32 * t * vocab,  # logits.float() -> softmax kept for backward
                "target_mask_and_ids": t + I64 * t, "per_token_loss": F32 * t}
    return out


def model_extra_activation_bytes(model: ModelConfig, seq: int, micro: int, **kw) -> int:
    """Sum of model_extra_activation_terms."""
    return sum(model_extra_activation_terms(model, seq, micro, **kw).values())
