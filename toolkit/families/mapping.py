"""How a model family is written down: its dims, and each Megatron-Core parameter as a keyword mapping from the
Hugging Face tensors it is made of (`qkv(q=..., k=..., v=...)`, `gated_mlp(gate=..., up=...)`), with the typed rule
that splits and merges it. A family file (llama.py) is a list of these; nothing in it depends on argument order."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from toolkit.errors import Problem, ToolkitError
from toolkit.families.rules import QKV, GatedMLP, Replicated, RowParallel, Rule, VocabParallel
from toolkit.layout import padded_vocab_size

HF_LAYER = "model.layers.{i}"  # {i}: global layer number
MEGATRON_LAYER = "decoder.layers.{j}"  # {j}: index of the layer within its pipeline chunk
REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")


@dataclass(frozen=True)
class Dims:
    """The shapes a checkpoint needs for conversion; padded_vocab is Megatron's (it depends on tp)."""

    family: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int
    padded_vocab: int
    tied: bool
    experts: int = 0
    """Routed experts per layer (mixture-of-experts families; 0 for a dense MLP)."""
    moe_ffn: int = 0
    """Width of one expert's SwiGLU MLP."""
    topk: int = 0
    """Experts each token is routed to."""


def config_getter(config: Any) -> Callable[..., Any]:
    """get(key, default) over a transformers config object or a plain config.json dict."""
    return config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)


_WHOLE = ("num_key_value_heads", "head_dim")  # optional sizes, besides REQUIRED's
_NUMBERS = ("rms_norm_eps", "rope_theta")

LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Megatron-Core's rope_scaling (Megatron-LM's --use-rope-scaling) is Llama 3.1's llama3 scheme with these constants
and any factor (--rope-scaling-factor)."""


def rope_of(config: Mapping) -> tuple[float, dict]:
    """(rope_theta, the scaling as a dict with its rope_type; {} for none) of a Hugging Face config, whether it
    spells them as transformers 5 does (rope_parameters) or as before (rope_theta, rope_scaling)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = config.get("rope_theta") or rope.pop("rope_theta", None) or 10000
    rope.pop("rope_theta", None)
    kind = rope.pop("type", None)  # the older spelling; rope_type wins where both are given
    rope.setdefault("rope_type", kind or "default")
    return float(theta), ({} if rope.get("rope_type", "default") == "default" else rope)


_SAME = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps", "tie_word_embeddings",
         "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob")


def model_differences(a: Mapping, b: Mapping) -> list[str]:
    """What in Hugging Face config `b` makes another model than `a` of the same weights (values that change the
    logits; a field that only one of them sets is the library's default in the other and not compared): the check
    of a conversion's output config, which a Megatron-LM or torch_dist target rebuilds from the arguments it wrote."""
    def derived(c: Mapping) -> dict:
        heads = c.get("num_attention_heads") or 1
        return {"num_key_value_heads": c.get("num_key_value_heads") or heads,
                "head_dim": c.get("head_dim") or (c.get("hidden_size") or 0) // heads,
                "experts": c.get("num_experts") or c.get("num_local_experts") or 0, "rope": rope_of(c)}
    da, db = derived(a), derived(b)
    out = [f"{k} {b[k]!r} (the source's: {a[k]!r})" for k in _SAME if k in a and k in b and a[k] != b[k]]
    ffn = "intermediate_size"  # a mixture of experts' is moe_intermediate_size (its dense one may be unused)
    if not da["experts"] and ffn in a and ffn in b and a[ffn] != b[ffn]:
        out.append(f"{ffn} {b[ffn]!r} (the source's: {a[ffn]!r})")
    out += [f"{k} {db[k]!r} (the source's: {da[k]!r})" for k in da if da[k] != db[k]]
    return out


def megatron_rope_args(config: Mapping, where: str) -> dict:
    """Megatron-LM's RoPE arguments of a Hugging Face config: rotary_base, and Llama 3.1's scaling as
    use_rope_scaling + rope_scaling_factor. One line for what Megatron's arguments cannot say (a base that is not
    a whole number, any other scaling), so that no checkpoint is written whose args give other logits."""
    theta, scaling = rope_of(config)
    if theta != int(theta):
        raise ToolkitError(f"{where}: rope_theta {theta} is not a whole number, which Megatron-LM's --rotary-base "
                           "must be; convert --to hf or --to megatron instead")
    if not scaling:
        return {"rotary_base": int(theta)}
    fixed = all(float(scaling.get(k, v)) == v for k, v in LLAMA3_ROPE_FIXED.items())
    if scaling.get("rope_type") == "llama3" and fixed:
        return {"rotary_base": int(theta), "use_rope_scaling": True,
                "rope_scaling_factor": float(scaling.get("factor", 8.0))}
    raise ToolkitError(f"{where}: RoPE scaling {scaling} has no Megatron-LM arguments (Megatron-Core has Llama 3.1's "
                       f"llama3 scaling with {LLAMA3_ROPE_FIXED} and any factor); the output would give other logits: "
                       "convert --to hf or --to megatron instead")


def read_dims(family: str, config: Any, tp: int, divisible_by: int, tied_default: bool) -> Dims:
    """Dims from an HF config. `tied_default` is what the family's config class assumes when the key is absent."""
    get = config_getter(config)
    missing = [key for key in REQUIRED if get(key) is None]
    if missing:
        raise ToolkitError(f"{family} config is missing {', '.join(missing)}; pass the model's config.json, which "
                           f"names all of: {', '.join(REQUIRED)}")
    wrong = [f"{key} = {get(key)!r}" for key in (*REQUIRED, *_WHOLE) if get(key) is not None
             and (isinstance(get(key), bool) or not isinstance(get(key), int) or get(key) < 1)]
    wrong += [f"{key} = {get(key)!r}" for key in _NUMBERS if get(key) is not None
              and (isinstance(get(key), bool) or not isinstance(get(key), (int, float)))]
    if wrong:  # a float or a string where a size goes would reach the output's shapes (and its config)
        raise ToolkitError(f"{family} config gives {', '.join(wrong)}: sizes must be positive whole numbers and "
                           "rms_norm_eps and rope_theta numbers (JSON 32, not 32.0 or \"32\"); correct config.json")
    heads, vocab = get("num_attention_heads"), get("vocab_size")
    tied = get("tie_word_embeddings")
    return Dims(family=family, hidden=get("hidden_size"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                head_dim=get("head_dim") or get("hidden_size") // heads, ffn=get("intermediate_size"),
                layers=get("num_hidden_layers"), vocab=vocab, padded_vocab=padded_vocab_size(vocab, tp, divisible_by),
                tied=tied_default if tied is None else bool(tied))


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of, in its rule's `parts` order (built only by the
    keyword constructors below); names may hold {i} / {j} layer placeholders."""

    hf_names: tuple[str, ...]
    megatron_name: str
    rule: Rule
    hf_shapes: tuple[tuple[int, ...], ...]
    expert: int | None = None
    """The global expert index of an expert's parameter: it lives on expert-parallel rank expert // (experts / ep),
    whose Megatron name holds the local index in {x}; None for parameters every expert-parallel rank holds."""


def mapping(megatron: str, rule: Rule, **parts: tuple[str, tuple[int, ...]]) -> ParamMap:
    """Megatron parameter `megatron` from the HF tensors named by keyword, one per part of the rule."""
    if set(parts) != set(rule.parts):
        raise ToolkitError(f"{megatron}: {type(rule).__name__} takes the parts {', '.join(rule.parts)}, the mapping "
                           f"names {', '.join(sorted(parts))}: name each part once by keyword")
    ordered = [parts[p] for p in rule.parts]
    return ParamMap(tuple(name for name, _ in ordered), megatron, rule, tuple(tuple(s) for _, s in ordered))


def replicated(megatron: str, *, weight: str, shape: tuple[int, ...]) -> ParamMap:
    return mapping(megatron, Replicated(), weight=(weight, shape))


def row_parallel(megatron: str, *, weight: str, shape: tuple[int, ...]) -> ParamMap:
    return mapping(megatron, RowParallel(), weight=(weight, shape))


def vocab_parallel(megatron: str, dims: Dims, *, weight: str) -> ParamMap:
    return mapping(megatron, VocabParallel(dims.vocab, dims.padded_vocab), weight=(weight, (dims.vocab, dims.hidden)))


def qkv(megatron: str, dims: Dims, *, q: str, k: str, v: str) -> ParamMap:
    """Megatron's fused linear_qkv from HF's separate q, k and v projections."""
    q_rows, kv_rows, h = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.hidden
    return mapping(megatron, QKV(dims.heads, dims.kv_heads, dims.head_dim),
                   q=(q, (q_rows, h)), k=(k, (kv_rows, h)), v=(v, (kv_rows, h)))


def qkv_bias(megatron: str, dims: Dims, *, q: str, k: str, v: str) -> ParamMap:
    """Megatron's linear_qkv.bias from HF's q, k and v biases: grouped per query group exactly like the weight."""
    q_rows, kv_rows = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    return mapping(megatron, QKV(dims.heads, dims.kv_heads, dims.head_dim),
                   q=(q, (q_rows,)), k=(k, (kv_rows,)), v=(v, (kv_rows,)))


def gated_mlp(megatron: str, dims: Dims, *, gate: str, up: str, ffn: int | None = None) -> ParamMap:
    """Megatron's fused linear_fc1 from HF's gate and up projections (`ffn`: an expert's width, else the MLP's)."""
    rows = ffn or dims.ffn
    return mapping(megatron, GatedMLP(), gate=(gate, (rows, dims.hidden)), up=(up, (rows, dims.hidden)))


def expert(e: int, *maps: ParamMap) -> list[ParamMap]:
    """These parameters belong to routed expert e (placed on its expert-parallel rank, see ParamMap.expert)."""
    return [ParamMap(pm.hf_names, pm.megatron_name, pm.rule, pm.hf_shapes, expert=e) for pm in maps]


@dataclass(frozen=True)
class Family:
    """A model family: which HF configs it takes, how its dims are read, and its weight map."""

    name: str
    model_types: tuple[str, ...]
    """The HF config's `model_type` values this family converts."""
    hf_architecture: str
    """The transformers class a converted Hugging Face folder names in config.json."""
    dims: Callable[[Any, int, int], Dims]
    """(config, tp, make_vocab_size_divisible_by) -> Dims; raises ToolkitError on what the map cannot express."""
    layer: Callable[[Dims], list[ParamMap]]
    embedding: Callable[[Dims], ParamMap]
    final_norm: Callable[[Dims], ParamMap]
    output: Callable[[Dims], ParamMap]
    """The output layer; tied models take it from the embeddings (HF has no lm_head then)."""
    hf_config_class: str = "LlamaConfig"
    """The transformers config class a recipe's model section becomes (toolkit/model.py)."""
    hf_config_fields: Mapping[str, Any] = field(default_factory=dict)
    """Fixed fields of that config beyond the recipe's (e.g. Mistral's sliding_window: None)."""
    megatron_fields: Mapping[str, Any] = field(default_factory=dict)
    """Megatron-Core TransformerConfig fields beyond Llama's (add_qkv_bias, qk_layernorm); the adapter, the local
    layer spec and the planner's parameter arithmetic all read them here."""
    modules: Mapping[str, Mapping[str, str]] | None = None
    """{Megatron name (with {j}): {rule part: transformers parameter name (with {i})}}, written apart from the map
    above: `toolkit convert`'s logit check places a Megatron checkpoint's weights into transformers' modules by
    it, so a mistake in either disagrees with the other instead of cancelling out."""

    @property
    def qkv_bias(self) -> bool:
        return bool(self.megatron_fields.get("add_qkv_bias"))

    hf_config_from_recipe: Callable[[Any], Mapping[str, Any]] | None = None
    """The family's own transformers config fields from a recipe's model section (MoE: experts, top-k)."""
    in_memory: Callable[[str, Dims], tuple[tuple[str, ...], Callable] | None] | None = None
    """For a parameter name of transformers' model that is not stored under its own name (Qwen3-MoE's fused
    experts): the stored tensors it is made of, and the function that makes it from them; None for the others."""
    from_memory: Callable[[str, Dims], tuple[str, Callable] | None] | None = None
    """The inverse, for checkpoints of transformers' model (DeepSpeed's): the name of the tensor a stored name
    lives in, and the function that takes it out; None for a name stored as itself."""
    megatron_from_recipe: Callable[[Any], Mapping[str, Any]] | None = None
    """The family's own TransformerConfig fields that depend on the recipe's model section (MoE: num_moe_experts,
    moe_router_topk, ...), beyond the fixed megatron_fields."""

    @property
    def moe(self) -> bool:
        return self.megatron_from_recipe is not None

    @property
    def qk_norm(self) -> bool:
        return bool(self.megatron_fields.get("qk_layernorm"))


def refuse_unhonoured(family: str, config: Any) -> None:
    """Raise on HF config fields that add weights the family's map does not hold (an MLP bias): no conversion can
    carry them."""
    get = config_getter(config)
    if get("mlp_bias", False):
        raise ToolkitError(f"{family} config sets mlp_bias; only bias-free MLP weights are mapped: add bias entries to "
                           f"toolkit/families/{family}.py to support them")


def refuse_for_megatron(config: Any) -> None:
    """Raise on HF config fields that change the maths in ways the Megatron-Core layers we target do not follow:
    another activation than SwiGLU's silu, an active sliding attention window. Only a Megatron model is affected: a
    Hugging Face or DeepSpeed target keeps them, as transformers' model does (Mistral v0.1's sliding_window: 4096
    was refused for --to hf too until 2026-12-07)."""
    get = config_getter(config)
    family = get("model_type", "Llama")
    if get("hidden_act", "silu") not in ("silu", "swish"):  # swish: transformers' other name of silu
        raise ToolkitError(f"{family} config sets hidden_act: {get('hidden_act')}; the map targets SwiGLU (silu): "
                           "convert a model whose MLP uses silu")
    # Qwen configs keep a sliding_window number that is off unless use_sliding_window is true
    if get("sliding_window") and get("use_sliding_window", True):
        raise ToolkitError(f"{family} config sets sliding_window: {get('sliding_window')}; the Megatron-Core layers "
                           "this map targets attend to the whole sequence: convert a model without sliding-window "
                           "attention (sliding_window: null, or use_sliding_window: false), or convert --to hf")


def recipe_dims(m: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    """The dims of a recipe's model section (toolkit.recipe.schema.ModelConfig, read by attribute)."""
    heads = m.num_attention_heads
    return Dims(family=m.family, hidden=m.hidden_size, heads=heads, kv_heads=m.num_kv_heads or heads,
                head_dim=m.head_dim or m.hidden_size // heads, ffn=m.intermediate_size, layers=m.num_layers,
                vocab=m.vocab_size, padded_vocab=padded_vocab_size(m.vocab_size, tp, divisible_by),
                tied=m.tie_word_embeddings, experts=m.num_experts or 0, moe_ffn=m.moe_intermediate_size or 0,
                topk=m.num_experts_per_tok or 0)


_COUNTS: dict[tuple[str, Dims], dict[str, int]] = {}


def param_count(family: Family, d: Dims) -> dict[str, int]:
    """Parameters of the Hugging Face model, summed over the family's own map (so a family's count is its map):
    total, embedding (the input embeddings) and non_embedding (everything else, an untied output layer included).
    Remembered per family and dims: the planner asks for thousands of layouts, and a mixture of experts' map has
    thousands of entries."""
    key = (family.name, d)
    if key not in _COUNTS:
        _COUNTS[key] = _param_count(family, d)
    return dict(_COUNTS[key])


def _param_count(family: Family, d: Dims) -> dict[str, int]:
    def numel(pm: ParamMap) -> int:
        return sum(math.prod(shape) for shape in pm.hf_shapes)

    embed = numel(family.embedding(d))
    per_layer = family.layer(d)
    body = d.layers * sum(numel(pm) for pm in per_layer) + numel(family.final_norm(d))
    lm_head = 0 if d.tied else numel(family.output(d))
    out = {"total": embed + body + lm_head, "embedding": embed, "non_embedding": body + lm_head}
    if d.experts:  # a token passes through topk of the routed experts: active = total - the experts it skips
        per_expert = sum(numel(pm) for pm in per_layer if pm.expert is not None) // d.experts
        out["active"] = out["total"] - d.layers * (d.experts - d.topk) * per_expert
    return out


def check_dims(dims: Dims, tp: int, pp: int, vpp: int, ep: int = 1) -> list[Problem]:
    """Problems splitting these dims over tp x pp x vpp (and ep expert-parallel ranks), with the arithmetic."""
    if min(tp, pp, vpp) < 1:
        return [Problem("parallel", f"tp = {tp}, pp = {pp}, vpp = {vpp}; each must be >= 1", "use 1 for none")]
    rules = [
        (dims.heads % dims.kv_heads == 0, "heads",
         f"{dims.heads} heads are not a multiple of {dims.kv_heads} kv heads",
         "check num_key_value_heads in the config"),
        (dims.heads % tp == 0, "tp", f"{dims.heads} attention heads are not divisible by tp = {tp}",
         f"choose tp dividing {dims.heads}"),
        # Megatron splits query groups across ranks when tp is a multiple of them, so both directions work
        (dims.kv_heads % tp == 0 or tp % dims.kv_heads == 0, "tp",
         f"tp = {tp} is neither a divisor nor a multiple of the {dims.kv_heads} kv heads",
         f"choose tp dividing {dims.kv_heads}, or a multiple of {dims.kv_heads} dividing {dims.heads}"),
        (dims.ffn % tp == 0, "tp", f"ffn size {dims.ffn} is not divisible by tp = {tp}",
         f"choose tp dividing {dims.ffn}"),
        (dims.padded_vocab >= dims.vocab and dims.padded_vocab % tp == 0, "padded_vocab",
         f"padded vocab {dims.padded_vocab} must be >= vocab {dims.vocab} and divisible by tp = {tp}",
         "build the dims with toolkit.families.dims_from_hf(config, tp=tp)"),
        (dims.layers % (pp * vpp) == 0, "pp x vpp", f"{dims.layers} layers do not split into pp x vpp = {pp} x {vpp} "
         f"= {pp * vpp} equal chunks", f"choose pp x vpp dividing {dims.layers}"),
        (ep >= 1 and (dims.experts or 1) % ep == 0, "ep",
         f"{dims.experts} experts do not split over ep = {ep} expert-parallel ranks" if dims.experts else
         f"a dense model has no experts to split over ep = {ep} expert-parallel ranks",
         f"choose ep dividing {dims.experts}" if dims.experts else "use ep = 1 for a dense model"),
        (not dims.experts or dims.moe_ffn % tp == 0, "tp",
         f"expert ffn size {dims.moe_ffn} is not divisible by tp = {tp}", f"choose tp dividing {dims.moe_ffn}"),
    ]
    return [Problem(key, message, fix) for ok, key, message, fix in rules if not ok]


# Megatron's Transformer Engine layer spec fuses the two norms into the linears that follow them; the local spec
# keeps them as modules. Checkpoints and weight loading speak local names; these translate.
TE_NORM_NAMES = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
                 ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight"}


def local_spec_name(name: str) -> str:
    """The local-spec name of a Megatron parameter that may carry a Transformer Engine spec name."""
    for te, local in TE_NORM_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name
