"""The Qwen3-MoE family (model_type qwen3_moe: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per
head, no bias) with every MLP a mixture of experts: a router (`mlp.gate`, no bias) scores the experts with a softmax,
each token goes through its top-k, and with norm_topk_prob their weights are renormalised to sum to 1. No shared
expert. Chosen over Mixtral because it builds on the qwen3 family (same attention map) and is the MoE people
fine-tune today; Mixtral would be the same map with Llama's attention.

On disk (save_pretrained of transformers 5.24, and the published checkpoints) each expert is its own
`mlp.experts.{e}.gate_proj / up_proj / down_proj`; in memory transformers 5 fuses them into 3-D `gate_up_proj` and
`down_proj` tensors, converting on load and save. The map below speaks the on-disk names, one gated_mlp(gate=, up=)
per expert. Megatron-Core's local spec (what runs without Transformer Engine) builds a SequentialMLP:
`mlp.router.weight` and `mlp.experts.local_experts.{x}.linear_fc1 / linear_fc2`, {x} the expert's index on its
expert-parallel rank."""
from __future__ import annotations

import re
from typing import Any

from toolkit.errors import ToolkitError
from toolkit.families import llama, qwen3
from toolkit.families.mapping import (
    HF_LAYER,
    MEGATRON_LAYER,
    Dims,
    Family,
    ParamMap,
    config_getter,
    expert,
    gated_mlp,
    read_dims,
    refuse_unhonoured,
    replicated,
    row_parallel,
)


def dims(config: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    get = config_getter(config)
    if get("attention_bias", False):
        raise ToolkitError("qwen3_moe config sets attention_bias; released Qwen3-MoE models have none and the map has "
                           "no entries for it: add them to toolkit/families/qwen3_moe.py to support it")
    if get("decoder_sparse_step", 1) != 1 or get("mlp_only_layers"):
        raise ToolkitError(f"qwen3_moe config has dense layers (decoder_sparse_step: {get('decoder_sparse_step', 1)}, "
                           f"mlp_only_layers: {get('mlp_only_layers')}); the map has every layer a mixture of experts "
                           "as in the released models: set decoder_sparse_step 1 and mlp_only_layers []")
    refuse_unhonoured("qwen3_moe", config)
    # the published config.json files say num_experts; transformers 5 writes num_local_experts (its attribute_map)
    experts = get("num_experts") or get("num_local_experts")
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", get("num_experts_per_tok")),
                              ("moe_intermediate_size", get("moe_intermediate_size"))) if not v]
    if missing:
        raise ToolkitError(f"qwen3_moe config is missing {', '.join(missing)}; pass the model's own config.json")
    base = read_dims("qwen3_moe", config, tp, divisible_by, tied_default=False)
    return Dims(**{**base.__dict__, "experts": experts, "moe_ffn": get("moe_intermediate_size"),
                   "topk": get("num_experts_per_tok")})


def layer(d: Dims) -> list[ParamMap]:
    L, M = HF_LAYER, MEGATRON_LAYER
    attention = [pm for pm in qwen3.layer(d) if ".mlp." not in pm.megatron_name]
    experts = [m for e in range(d.experts) for m in expert(
        e,
        gated_mlp(f"{M}.mlp.experts.local_experts.{{x}}.linear_fc1.weight", d, ffn=d.moe_ffn,
                  gate=f"{L}.mlp.experts.{e}.gate_proj.weight", up=f"{L}.mlp.experts.{e}.up_proj.weight"),
        row_parallel(f"{M}.mlp.experts.local_experts.{{x}}.linear_fc2.weight",
                     weight=f"{L}.mlp.experts.{e}.down_proj.weight", shape=(d.hidden, d.moe_ffn)))]
    # the router is replicated on every TP rank (Megatron's TopKRouter is a plain parameter)
    return [*attention, replicated(f"{M}.mlp.router.weight", weight=f"{L}.mlp.gate.weight",
                                   shape=(d.experts, d.hidden)), *experts]


def from_recipe_hf(m: Any) -> dict:
    """transformers' Qwen3MoeConfig fields from the recipe's model section."""
    return {"num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size, "norm_topk_prob": m.norm_topk_prob,
            "router_aux_loss_coef": m.router_aux_loss_coef}


def from_recipe_megatron(m: Any) -> dict:
    """Megatron-Core's MoE fields that reproduce transformers' routing exactly. HF: softmax over all experts, then the
    top k, renormalised when norm_topk_prob. Megatron (softmax score function): with pre_softmax, softmax then top k
    (HF without renormalising); without, top k of the logits then a softmax over those k, which is HF's renormalised
    softmax (softmax is monotone, and a softmax over k logits equals their full-softmax probabilities / their sum).
    The load-balancing loss is Megatron's own switch-style aux loss at HF's coefficient (router_aux_loss_coef); it
    is not HF's function (HF pools every layer's routing, Megatron sums per layer and divides by top-k), so training
    parity is checked against Megatron at one rank, not against HF."""
    return {"num_moe_experts": m.num_experts, "moe_router_topk": m.num_experts_per_tok,
            "moe_ffn_hidden_size": m.moe_intermediate_size, "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not m.norm_topk_prob, "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": m.router_aux_loss_coef, "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False, "moe_permute_fusion": False}


def in_memory(name: str, d: Dims):
    """transformers 5's fused expert tensors from the stored per-expert ones: gate_up_proj[e] = cat(gate_e, up_e)
    (its forward takes `gate, up = ....chunk(2)`), down_proj[e] = down_e."""
    import torch  # lazy: the families load torch-free (the planner reads them); only conversion checks fuse

    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
    if m is None:
        return None
    stem = f"model.layers.{m.group(1)}.mlp.experts"
    if m.group(2) == "down_proj":
        return tuple(f"{stem}.{e}.down_proj.weight" for e in range(d.experts)), torch.stack
    names = tuple(f"{stem}.{e}.{kind}_proj.weight" for e in range(d.experts) for kind in ("gate", "up"))

    def fuse(tensors):
        pairs = zip(tensors[0::2], tensors[1::2])  # (gate_e, up_e) by the names above
        return torch.stack([torch.cat([gate, up], 0) for gate, up in pairs])

    return names, fuse


def from_memory(name: str, d: Dims):
    """The inverse of in_memory, for checkpoints of transformers' model (DeepSpeed's): the fused tensor a stored
    per-expert name lives in, and the function that takes it out (gate: the first half of gate_up_proj[e])."""
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
    if m is None:
        return None
    stem, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down":
        return f"{stem}.down_proj", lambda fused: fused[e]
    half = {"gate": 0, "up": 1}[kind]
    return f"{stem}.gate_up_proj", lambda fused: fused[e].chunk(2, 0)[half]


# where verification puts a Megatron checkpoint's tensors in transformers' model (toolkit/checkpoint/verify.py);
# {e}: the routed expert, {x}: its index on its expert-parallel rank
MODULES = {k: v for k, v in qwen3.MODULES.items() if ".mlp." not in k}
MODULES["decoder.layers.{j}.mlp.router.weight"] = {"weight": "model.layers.{i}.mlp.gate.weight"}
MODULES["decoder.layers.{j}.mlp.experts.local_experts.{x}.linear_fc1.weight"] = {
    "gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight"}
MODULES["decoder.layers.{j}.mlp.experts.local_experts.{x}.linear_fc2.weight"] = {
    "weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight"}

FAMILY = Family(name="qwen3_moe", model_types=("qwen3_moe",), hf_architecture="Qwen3MoeForCausalLM", dims=dims,
                layer=layer, embedding=llama.embedding, final_norm=llama.final_norm, output=llama.output,
                hf_config_class="Qwen3MoeConfig",
                hf_config_fields={"use_sliding_window": False, "attention_bias": False, "decoder_sparse_step": 1,
                                  "mlp_only_layers": []},
                megatron_fields={"qk_layernorm": True}, modules=MODULES, in_memory=in_memory, from_memory=from_memory,
                hf_config_from_recipe=from_recipe_hf,
                megatron_from_recipe=from_recipe_megatron)
