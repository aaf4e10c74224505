"""Fast: the torch_dist optimizer-state map (toolkit/checkpoint/torch_dist_optim.py) finds each parameter's Adam
state by the model key inside the tensor's own name, whatever order the checkpoint lists them in, and says in one
line what it cannot read. The real files, from Megatron-Core's own optimizer, are tested in test_megatron_native.py."""
from __future__ import annotations

import random

import torch

from toolkit.checkpoint.torch_dist_optim import OptimizerState, is_optimizer_key

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


def test_flat_buffer_formats_and_no_optimizer_are_said_not_guessed():
    dp = _Reader(W, {"optimizer": {"param_state_sharding_type": "dp_reshardable"}})
    state = OptimizerState(dp, W, True)
    assert state.fields == () and "dp_reshardable" in state.note and "--dist-ckpt-optim-fully-reshardable" in state.note
    none = OptimizerState(_Reader(W, {"iteration": 1}), W, True)
    assert none.fields == () and "no optimizer state" in none.note
