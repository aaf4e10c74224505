"""Fast: the torch_dist optimizer-state map (toolkit/checkpoint/torch_dist_optim.py) finds each parameter's Adam
state by the model key inside the tensor's own name, whatever order the checkpoint lists them in, and says in one
line what it cannot read. The real files, from Megatron-Core's own optimizer, are tested in test_megatron_native.py."""
from __future__ import annotations

import random

import torch

from toolkit.checkpoint.dist_keys import is_optimizer_key
from toolkit.checkpoint.torch_dist_optim import OptimizerState

W = {"embedding.word_embeddings.weight": (8, 4), "decoder.layers.mlp.linear_fc1.weight": (2, 6, 4)}


class _Reader:
    def __init__(self, names: dict[str, tuple], common: dict):
        self._names, self.common = names, common

    def tensor_names(self):
        names = list(self._names)
        random.Random(0).shuffle(names)  # position says nothing
        return names

    def shape(self, fqn):
        return self._names[fqn]


def _plain(fields=("exp_avg", "exp_avg_sq", "fp32_param"), prefix="", step=torch.tensor(3.0)):
    names = {f"{prefix}optimizer.state.{f}.{w}": s for w, s in W.items() for f in fields}
    return _Reader({**W, **names}, {"optimizer": {"optimizer": {"state": {"common_step": step}, "param_groups": []}}})


def test_each_field_of_each_parameter_is_found_by_name():
    state = OptimizerState(_plain(prefix="chained_0."), W, sixteen_bit=True)
    assert not state.problems and state.fields == ("exp_avg", "exp_avg_sq", "master")
    assert state.meta["step"] == "3"
    for w in W:
        assert state.key("exp_avg", w) == f"chained_0.optimizer.state.exp_avg.{w}"
        assert state.key("exp_avg_sq", w) == f"chained_0.optimizer.state.exp_avg_sq.{w}"
        assert state.key("master", w) == f"chained_0.optimizer.state.fp32_param.{w}"
    assert is_optimizer_key("chained_1.optimizer.state.exp_avg.x") and not is_optimizer_key("output_layer.weight")


def test_fp32_model_has_no_master_and_distributed_layout_reads_param_and_group_step():
    names = {f"optimizer.state.{f}.{w}": s for w, s in W.items() for f in ("param", "exp_avg", "exp_avg_sq")}
    common = {"optimizer": {"optimizer": {"param_groups": [{"step": 5.0}, {"step": 5.0}]},
                            "param_state_sharding_type": "fully_reshardable"}}
    state = OptimizerState(_Reader({**W, **names}, common), W, sixteen_bit=False)
    assert not state.problems and state.fields == ("exp_avg", "exp_avg_sq") and state.meta["step"] == "5"
    bf16 = OptimizerState(_Reader({**W, **names}, common), W, sixteen_bit=True)
    assert bf16.key("master", "embedding.word_embeddings.weight") == "optimizer.state.param.embedding.word_embeddings.weight"


def test_missing_or_misshapen_state_is_a_problem_naming_the_parameter():
    state = OptimizerState(_plain(fields=("exp_avg", "fp32_param")), W, sixteen_bit=True)
    assert [p.key for p in state.problems] == list(W) and "exp_avg_sq" in state.problems[0].message
    r = _plain()
    r._names["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = (4, 8)  # another model's
    assert [p.key for p in OptimizerState(r, W, True).problems] == [
        "optimizer.state.exp_avg.embedding.word_embeddings.weight"]


def test_flat_and_unknown_formats_and_no_optimizer_are_said_not_guessed():
    dp = _Reader(W, {"optimizer": {"param_state_sharding_type": "dp_reshardable"}})
    state = OptimizerState(dp, W, True)  # recognised here, read by toolkit/checkpoint/megatron_flat.py
    assert state.sharding == {"dp_reshardable"} and state.fields == () and state.note is None
    other = OptimizerState(_Reader(W, {"optimizer": {"param_state_sharding_type": "fully_sharded_model_space"}}), W, 1)
    assert other.fields == () and "fully_sharded_model_space" in other.note
    assert "--dist-ckpt-optim-fully-reshardable" in other.note
    none = OptimizerState(_Reader(W, {"iteration": 1}), W, True)
    assert none.fields == () and "no optimizer state" in none.note


def test_flat_layout_aligns_each_parameter_and_fills_each_bucket_exactly():
    from toolkit.checkpoint.megatron_flat import lay_out

    params = [("emb", 100), ("norm", 10), ("w", 64)]  # registration order: laid out in reverse
    assert lay_out(params, [64 + 10 + 54 + 100]) == {"w": (0, 0, 64), "norm": (0, 64, 74), "emb": (0, 128, 228)}
    # a bucket cut after norm (its length counts the 64-alignment padding a shared embedding's cut adds)
    assert lay_out(params, [74, 100]) == {"w": (0, 0, 64), "norm": (0, 64, 74), "emb": (1, 0, 100)}
    assert lay_out(params, [128, 100]) == {"w": (0, 0, 64), "norm": (0, 64, 74), "emb": (1, 0, 100)}
    for wrong in ([228 + 1], [227], [74, 99], [64, 10, 100, 1]):
        assert lay_out(params, wrong) is None, wrong


def test_bucket_cuts_follow_ddp_size_and_shared_embedding_rules():
    """The unpadded bucket lengths DDP gives (checked end to end against Megatron-Core's own save_parameter_state
    in test_megatron_native): no cut without a bucket size; a cut after the parameter that reaches it (at its end,
    unaligned); around a shared embedding, before it at the aligned start and after it."""
    from toolkit.checkpoint.megatron_flat import bucket_sizes, lay_out

    params = [("emb", 100), ("norm", 10), ("w", 64)]  # laid out in reverse: w, norm, emb
    assert bucket_sizes(params, None, set()) == [228]
    assert bucket_sizes(params, 70, set()) == [74, 100]  # w (64) is short of 70; norm takes it to 74
    assert bucket_sizes(params, 1, set()) == [64, 10, 100]
    assert bucket_sizes(params, None, {"emb"}) == [128, 100]  # the cut at norm's end, 64-aligned
    assert bucket_sizes([("a", 10), ("emb", 64)], None, {"emb"}) == [64, 10]  # first in its chunk: one cut, after
    for size, shared in ((None, set()), (70, set()), (1, set()), (None, {"emb"})):
        sizes = bucket_sizes(params, size, shared)
        assert lay_out(params, sizes) is not None, (size, shared)


def test_the_two_layer_specs_register_the_input_norm_in_different_places():
    from toolkit.checkpoint.megatron_lm import LOCAL_ORDER, TE_ORDER, registration_order

    names = ["output_layer.weight", "decoder.layers.1.mlp.linear_fc2.weight", "decoder.final_layernorm.weight",
             "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.input_layernorm.weight",
             "embedding.word_embeddings.weight", "decoder.layers.0.pre_mlp_layernorm.weight"]
    assert registration_order(names, LOCAL_ORDER) == [
        "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.linear_fc2.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    te = registration_order(names, TE_ORDER)
    assert te[1:3] == ["decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.input_layernorm.weight"]


def test_plain_optimizer_positions_follow_megatrons_weight_decay_groups_matched_by_wd_mult():
    """Megatron-Core's plain optimizer keys each parameter's state by its position in the param groups (checked end to
    end against its own files in test_megatron_native): biases and 1-D parameters in the wd_mult 0 group (the q/k
    norms in the other one with --apply-wd-to-qk-layernorm), each group in registration order over the rank's
    chunks, the tied output layer's copy included; the groups are found by their wd_mult, not by their place."""
    from argparse import Namespace

    from toolkit.checkpoint.megatron_plain import positions, wd_groups, wd_mult
    from toolkit.families.registry import dims_from_hf

    plain, qk_wd = Namespace(), Namespace(apply_wd_to_qk_layernorm=True)
    assert wd_mult("decoder.layers.0.self_attention.linear_qkv.bias", 1, plain) == 0.0
    assert wd_mult("decoder.layers.0.self_attention.linear_qkv.weight", 2, plain) == 1.0
    qk = "decoder.layers.0.self_attention.q_layernorm.weight"
    assert (wd_mult(qk, 1, plain), wd_mult(qk, 1, qk_wd), wd_mult("decoder.final_layernorm.weight", 1, qk_wd)) == (
        0.0, 1.0, 0.0)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 500, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "tie_word_embeddings": True}
    dims = dims_from_hf(config, tp=1)
    assert wd_groups(dims, plain) == {0.0, 1.0}
    layer = ["self_attention.linear_proj.weight", "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight",
             "mlp.linear_fc2.weight"]
    # PP2 x VPP2: the last stage holds layer 1 (chunk 0) and layer 3 (chunk 1), each its chunk's layer 0
    weights, norms = positions(dims, (1, 2, 2), 1, [{"wd_mult": 1.0}, {"wd_mult": 0.0}], plain)
    assert weights == [(c, f"decoder.layers.0.{n}") for c in (0, 1) for n in layer] + [(1, "output_layer.weight")]
    assert norms == [(c, f"decoder.layers.0.{n}") for c in (0, 1) for n in (
        "input_layernorm.weight", "pre_mlp_layernorm.weight")] + [(1, "decoder.final_layernorm.weight")]
    assert positions(dims, (1, 2, 2), 1, [{"wd_mult": 0.0}, {"wd_mult": 1.0}], plain) == [norms, weights]
    first, _ = positions(dims, (2, 2, 2), 0, [{"wd_mult": 1.0}, {"wd_mult": 0.0}], plain)
    assert first[0] == (0, "embedding.word_embeddings.weight")
    # what a Megatron-LM target writes of a plain source's state: only Megatron's standard groups, at its dtype
    from types import SimpleNamespace

    from toolkit.checkpoint.megatron_lm_optim import optimizer_plan

    def plan(groups, out_dtype=torch.bfloat16):
        source = SimpleNamespace(fields=("weight", "exp_avg", "exp_avg_sq", "master"), optimizer_groups=groups,
                                 scheduler={}, optimizer_distributed=False, args=plain, dtype=lambda: torch.bfloat16,
                                 optimizer_meta={"step": "2"})
        return optimizer_plan(SimpleNamespace(ep=1, dims=dims, out_dtype=out_dtype, step=2), source)

    ok, note = plan([{"wd_mult": 1.0}, {"wd_mult": 0.0}])
    assert note is None and not ok["distributed"] and ok["step"] == 2.0 and ok["fields"][-1] == "master"
    assert ok["groups"] == [{"wd_mult": 1.0, "step": 2.0}, {"wd_mult": 0.0, "step": 2.0}]
    assert plan([{"wd_mult": 1.0}, {"wd_mult": 0.5}]) == (None, (
        "its plain optimizer's param groups (wd_mult [1.0, 0.5]) are not Megatron's standard ones for this model "
        "([0.0, 1.0]), which fix where each parameter's state goes: weights only"))
    assert plan([{"wd_mult": 1.0}, {"wd_mult": 0.0}], torch.float32)[1].startswith("not written at another dtype")
