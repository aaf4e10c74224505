"""The qwen3_moe family and expert parallelism against the real libraries (tiny random models from transformers'
own Qwen3MoeConfig; nothing downloaded). Logits at TP1 (fast), TP2, PP2 and EP2 (slow) are checked with the other
families in tests/test_families.py's shared launches; here: the map by name (a gate/up swap fails fast), layout
rules, HF <-> Megatron EP2 conversion bit-exact, and EP2 training against the single-process loop; Megatron-Core's
torch_dist format with experts (read, written, loaded by Megatron-Core at EP2 and EP1; an EP2 run with the distributed
optimizer saved in it resumes at TP2 x EP2); Megatron-LM's MoE arguments. Checkpoints written by Megatron-Core's own
code at EP2 and the distributed optimizer's flat state of a mixture of experts: tests/test_moe_native.py."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import REPO, launch, read_metrics, run_ranks
from reference import reference_losses
from safetensors.torch import load_file
from test_families import tiny_model
from test_megatron_parity import LOSS_RTOL, SCHEDULE, STEPS

from toolkit.checkpoint import megatron_lm
from toolkit.checkpoint.convert import convert
from toolkit.checkpoint.inspect import inspect
from toolkit.checkpoint.torch_dist import Reader
from toolkit.errors import RecipeError, ToolkitError
from toolkit.families import dims_from_hf, hf_to_megatron, megatron_to_hf, qwen3_moe
from toolkit.model import to_hf_config
from toolkit.recipe import load_recipe, resolve
from toolkit.train.checkpoint import _check_reshard


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved as transformers saves it (per-expert gate/up/down tensors on disk)."""
    folder = tmp_path_factory.mktemp("moe") / "hf"
    model = tiny_model("qwen3_moe")
    model.save_pretrained(folder)
    return folder, model, load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The training tests' shared start: tiny_qwen3_moe's Hugging Face weights (decisive routing, as in
    test_families; no load-balancing loss, as Megatron's and transformers' aux losses are different functions) and
    the single-process transformers loop's losses from them."""
    import transformers

    folder = tmp_path_factory.mktemp("moe_start") / "hf"
    torch.manual_seed(7)
    model = transformers.Qwen3MoeForCausalLM(to_hf_config(load_recipe(
        "tiny_qwen3_moe", ["model.router_aux_loss_coef=0"]).model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    model.save_pretrained(folder)
    return folder, reference_losses(folder, STEPS, SCHEDULE)


def test_expert_fc1_is_gate_then_up_as_transformers_fuses_them(moe):
    """transformers 5 fuses each expert's on-disk gate_proj and up_proj into gate_up_proj[e] = cat(gate, up) when it
    loads (its own conversion, the oracle here); Megatron's linear_fc1 of a gated MLP is [gate; up] too. So at TP1
    local expert e's fc1 must equal transformers' gate_up_proj[e] and fc2 its down_proj[e]: a map with gate= and up=
    exchanged fails here, in the fast suite."""
    folder, model, disk = moe
    shards = hf_to_megatron(disk, dims_from_hf(model.config), tp=1, pp=1)[(0, 0)][0]
    for i, layer in enumerate(model.model.layers):
        router = shards[f"decoder.layers.{i}.mlp.router.weight"]
        assert torch.equal(router, layer.mlp.gate.weight)
        for e in range(4):
            fc1 = shards[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            fc2 = shards[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"]
            assert torch.equal(fc1, layer.mlp.experts.gate_up_proj[e]), (i, e)
            assert torch.equal(fc2, layer.mlp.experts.down_proj[e]), (i, e)


def test_ep2_splits_experts_and_round_trips_bit_exactly(moe):
    """At TP2 x EP2 each expert-parallel rank holds experts 2r, 2r+1 as its local 0, 1 (TP-split), and a copy of
    the rest; merging gives back the on-disk tensors bit for bit; differing copies are refused."""
    folder, model, disk = moe
    dims = dims_from_hf(model.config, tp=2)
    shards = hf_to_megatron(disk, dims, tp=2, pp=1, ep=2)
    assert set(shards) == {(0, t, e) for t in range(2) for e in range(2)}
    gate = disk["model.layers.1.mlp.experts.3.gate_proj.weight"]
    fc1 = shards[(0, 1, 1)][0]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1[:24], gate[24:])  # tp rank 1's half of expert 3's gate, then its half of up
    assert not any("local_experts.2" in k for s in shards.values() for k in s[0])
    back = megatron_to_hf(shards, dims, tp=2, pp=1, ep=2)
    assert set(back) == set(disk) and all(torch.equal(back[k], disk[k]) for k in disk)
    copy = shards[(0, 0, 1)][0]
    copy["decoder.layers.0.mlp.router.weight"] = copy["decoder.layers.0.mlp.router.weight"] + 1
    with pytest.raises(ToolkitError, match="differs between expert-parallel ranks"):
        megatron_to_hf(shards, dims, tp=2, pp=1, ep=2)


def test_convert_hf_to_megatron_ep2_and_back_is_bit_exact(moe, tmp_path):
    """`toolkit convert` both ways at TP2 x EP2 (its own read-back and logit checks on): one file per (tp, ep) rank,
    and the Hugging Face folder it writes back holds the saved tensors bit for bit and loads in transformers."""
    import transformers

    folder, model, disk = moe
    mega = convert(folder, tmp_path / "mg", "megatron", tp=2, ep=2, progress=False, log=lambda *_: None)
    tag = next(mega.glob("step_*"))
    assert sorted(p.name for p in tag.glob("model_*")) == [f"model_tp0{t}_pp000_ep00{e}.safetensors"
                                                            for t in range(2) for e in range(2)]
    assert json.loads((tag / "toolkit_meta.json").read_text())["layout"]["ep"] == 2
    back = convert(mega, tmp_path / "back", "hf", progress=False, log=lambda *_: None)
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(disk) and all(torch.equal(got[k], disk[k]) for k in disk)
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(back)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_a_gate_up_swap_in_the_expert_map_is_caught_by_verification(moe, tmp_path):
    """The conversion's logit check places Megatron tensors by the family's separate MODULES table and hashes them
    against what the conversion read: an expert map with gate= and up= exchanged fails it, naming the tensor, and
    nothing is written."""
    folder, _, _ = moe
    real = qwen3_moe.FAMILY.layer

    def swapped(d):
        return [dataclasses.replace(pm, hf_names=pm.hf_names[::-1]) if "linear_fc1" in pm.megatron_name else pm
                for pm in real(d)]

    object.__setattr__(qwen3_moe.FAMILY, "layer", swapped)  # a frozen dataclass; restored below
    try:
        with pytest.raises(ToolkitError, match=r"verification failed: model\.layers\.0\.mlp\.experts\.\d+\."
                                               r"(gate|up)_proj\.weight \(weight\) reads back different"):
            convert(folder, tmp_path / "bad", "megatron", ep=2, progress=False, log=lambda *_: None)
        assert not (tmp_path / "bad").exists()
    finally:
        object.__setattr__(qwen3_moe.FAMILY, "layer", real)


@pytest.mark.parametrize("sets,needle", [
    (["parallel.ep=3"], "4 experts are not divisible by ep = 3"),
    (["parallel.world_size=1"], "2 does not divide dp x cp = 1 x 1 = 1"),
    (["parallel.world_size=4", "parallel.tp=2"], "parallel.sp: false, but Megatron-Core trains a mixture of experts"),
    (["model.family=qwen3"], "model.family qwen3 has no experts"),
    (["parallel.backend=deepspeed"], "expert parallelism is Megatron-Core's"),
    (["model.family=llama", "parallel.ep=1"], "model.family llama has no experts, so it would be ignored"),
])
def test_layout_rules_for_ep_are_one_line_each(sets, needle):
    with pytest.raises(RecipeError) as e:
        resolve(load_recipe("tiny_qwen3_moe", sets))
    assert needle in str(e.value), str(e.value)


def test_planner_counts_total_and_active_parameters_of_qwen3_30b_a3b():
    """Qwen3-30B-A3B's model card: 30.5B parameters in total, 3.3B activated (the planner: 30.53B and 3.35B, the
    active count with the embeddings and output layer, which every token uses)."""
    from toolkit.metrics import count_params

    counts = count_params(load_recipe("tiny_zero0", ["model.preset=qwen3-30b-a3b"]).model)
    assert round(counts["total"] / 1e9, 1) == 30.5 and abs(counts["active"] / 1e9 - 3.3) < 0.06
    tiny = count_params(load_recipe("tiny_qwen3_moe").model)
    model = tiny_model("qwen3_moe", vocab_size=512)
    assert tiny["total"] == sum(p.numel() for p in model.parameters())
    per_expert = 3 * 48 * 64
    assert tiny["total"] - tiny["active"] == 2 * (4 - 2) * per_expert  # 2 layers, 2 of 4 experts skipped per token
    # and the plan says both in its first line (its --json has the counts under "parameters")
    from toolkit.plan.hardware import Cluster
    from toolkit.plan.report import header
    r = load_recipe("qwen3_30b_a3b_ep8_pp2")
    assert "30.53B parameters (3.35B active per token)" in header(r, Cluster(gpus=16, gpus_per_node=8), 256)


def test_real_size_recipe_is_qwen3_30b_a3b_and_ep_divides_its_experts_per_rank():
    """recipes/qwen3_30b_a3b_ep8_pp2: the published size (30.5B total, 3.3B active), and each of its ranks holds
    16 of the 128 experts of its 24 layers: about 2.6B parameters instead of 15.3B without expert parallelism."""
    from toolkit.metrics import count_params, flops_per_token
    from toolkit.plan.megatron_states import megatron_params

    r = load_recipe("qwen3_30b_a3b_ep8_pp2")
    plan = resolve(r)
    assert (plan.layout.ep, plan.layout.pp, plan.layout.dp) == (8, 2, 8)
    counts = count_params(r.model)
    assert round(counts["total"] / 1e9, 1) == 30.5 and abs(counts["active"] / 1e9 - 3.3) < 0.06
    per_rank = megatron_params(r, 1, 2, 1, 0, 0, ep=8)
    assert round(per_rank / 1e9, 1) == 2.6 and round(megatron_params(r, 1, 2, 1, 0, 0) / 1e9, 1) == 15.3
    # MFU counts the routed experts a token uses: 6 x the active non-embedding parameters + attention
    attention = 12 * 48 * 2048 * 4096
    assert flops_per_token(r.model, 4096) == 6 * (counts["active"] - counts["embedding"]) + attention


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 2), (2, 2, 1)], ids=["ep2", "ep2_tp2", "tp2_pp2"])
def test_ep2_training_reproduces_single_process_losses(start, tmp_path, tp, pp, ep):
    """From the same Hugging Face weights, Megatron-Core at EP2 (each expert-parallel rank holds 2 of the 4 experts,
    tokens exchanged by the alltoall dispatcher over gloo), alone on 2 ranks and with TP2 + sequence parallelism
    (Megatron-Core's requirement for MoE under TP) on 4, and at TP2 (+SP) x PP2 like every family, gives the
    single-process transformers loop's losses."""
    import transformers

    hf_in, want = start
    world = tp * pp * ep
    launch("tiny_qwen3_moe", ["model.preset=null", f"model.hf_path={hf_in}", "model.pretrained=true",
                              f"training.steps={STEPS}", *SCHEDULE, "logging.interval=1", "checkpoint.interval=1000",
                              f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", f"parallel.sp={tp > 1}",
                              f"parallel.world_size={world}"],
           nproc=world, out_dir=tmp_path / "run")
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    print(f"qwen3_moe TP{tp} x PP{pp} x EP{ep}:", got, "single process:", want)
    assert len(got) == STEPS and want[-1] < want[0] - 0.05
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    tag = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert json.loads((tag / "toolkit_meta.json").read_text())["layout"].get("ep", 1) == ep
    assert {p.name for p in tag.glob("model_*")} == {
        f"model_tp{t:02d}_pp{s:03d}" + (f"_ep{e:03d}" if ep > 1 else "") + ".safetensors"
        for t in range(tp) for s in range(pp) for e in range(ep)}
    # what the run wrote converts to Hugging Face (read back and logit-checked), and transformers loads it
    hf = convert(tmp_path / "run" / "checkpoints", tmp_path / "trained_hf", "hf", progress=False, log=lambda *_: None)
    assert transformers.Qwen3MoeForCausalLM.from_pretrained(hf).config.num_experts == 4


@pytest.mark.slow
def test_deepspeed_zero3_trains_the_hf_moe_model_and_converts_back(start, tmp_path):
    """The DeepSpeed backend trains transformers' Qwen3MoeForCausalLM itself (fused 3-D expert tensors, partitioned
    by ZeRO-3 on 2 ranks; DeepSpeed's own MoE layer is not used: it replaces a model's MLP with its own, which an HF
    checkpoint does not fit), with the single-process loop's losses; its checkpoint converts to a Hugging Face
    folder stored per expert, as transformers saves, that transformers loads. `checkpoint.export_hf` does the same in
    the training process: until 2026-12-07 it failed there after ZeRO-3 ("'Qwen3MoeExperts' object has no attribute
    'config'"), and its config held no token ids."""
    import transformers

    hf_in, want = start
    launch("tiny_qwen3_moe", ["model.preset=null", f"model.hf_path={hf_in}", "model.pretrained=true",
                              "parallel.backend=deepspeed", "parallel.ep=1", "parallel.zero_stage=3",
                              f"training.steps={STEPS}", *SCHEDULE, "logging.interval=1", "checkpoint.interval=1000",
                              "checkpoint.export_hf=true"],
           nproc=2, out_dir=tmp_path / "run")
    exported = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO / load_recipe("tiny_qwen3_moe").data.tokenizer)
    assert exported["eos_token_id"] == tokenizer.eos_token_id is not None
    assert exported["bos_token_id"] == tokenizer.bos_token_id
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    print("qwen3_moe DeepSpeed ZeRO-3:", got, "single process:", want)
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    hf = convert(tmp_path / "run" / "checkpoints", tmp_path / "trained_hf", "hf", progress=False, log=lambda *_: None)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in load_file(str(hf / "model.safetensors"))
    assert transformers.Qwen3MoeForCausalLM.from_pretrained(hf).config.num_experts == 4


def test_torch_dist_stacks_experts_by_global_index_and_round_trips_bit_exactly(moe, tmp_path):
    """`toolkit convert --to torch_dist` of a Qwen3-MoE: each expert linear is one tensor [layers, experts, ...] as
    Megatron-Core's SequentialMLP saves it (expert e of layer i at offsets (i, e)), the args name the experts as
    Megatron-LM's --num-experts/--moe-* do, and reading it back gives the on-disk tensors bit for bit."""
    folder, model, disk = moe
    root = convert(folder, tmp_path / "td", "torch_dist", progress=False, log=lambda *_: None)
    it = root / "iter_0000000"
    reader = Reader(it)
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert reader.shape(fc1) == (2, 4, 96, 64) and reader.shape("decoder.layers.mlp.router.weight") == (2, 4, 64)
    up = disk["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert torch.equal(reader.get(fc1, (1, 2))[48:], up)  # [gate; up] of expert 2 in layer 1
    args = reader.common["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.qk_layernorm) == (4, 2, 48, True)
    assert megatron_lm.family_of_args(args) == "qwen3_moe"
    back = convert(root, tmp_path / "back", "hf", vocab_size=model.config.vocab_size, progress=False,
                   log=lambda *_: None)
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(disk) and all(torch.equal(got[k], disk[k]) for k in disk)


def _moe_args(**change) -> argparse.Namespace:
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers=2, hidden_size=64,
                ffn_hidden_size=176, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                kv_channels=32, max_position_embeddings=256, padded_vocab_size=512, qk_layernorm=True, num_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=48, moe_router_pre_softmax=False, moe_aux_loss_coeff=0.001,
                moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
                normalization="RMSNorm", swiglu=True, add_bias_linear=False)
    return argparse.Namespace(**{**base, **change})


def test_megatron_lm_moe_args_give_qwen3_moe_and_others_are_refused_in_one_line():
    """Megatron-LM's own MoE arguments (as pretrain_gpt.py's --num-experts, --moe-router-topk, --moe-ffn-hidden-size,
    --moe-router-pre-softmax, --moe-layer-freq give them) name Qwen3-MoE; a shared expert, a sigmoid router, dense
    layers among the experts or experts without q/k norms (Mixtral-like) are another model: one line each."""
    args = _moe_args(moe_layer_freq=[1, 1])
    assert megatron_lm.family_of_args(args) == "qwen3_moe"
    config = megatron_lm.hf_config(args, 500)
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["norm_topk_prob"], config["head_dim"]) == ("qwen3_moe", 8, 2, 48, True, 32)
    for change, needle in (({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size=64"),
                           ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
                           ({"moe_layer_freq": [1, 0]}, "moe_layer_freq=[1, 0]"),
                           ({"qk_layernorm": False}, "num_experts=8 without qk_layernorm")):
        with pytest.raises(ToolkitError, match="none of the families") as e:
            megatron_lm.family_of_args(_moe_args(**change))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_resharding_load_refuses_to_cross_ep_1_and_ep_above_1_in_one_line(tmp_path):
    """Megatron-Core builds a separate optimizer for the experts only at ep > 1, so a torch_dist checkpoint's optimizer
    state does not load across that boundary (its own load fails with a KeyError deep in Megatron): refused before
    Megatron reads it, naming the conversion that moves it. ep 2 -> 4 or another TP/DP is allowed."""
    saved = {"zero_stage": 1, "tp": 1, "pp": 1, "vpp": 1, "dp": 2, "ep": 2}
    _check_reshard(tmp_path, saved, {**saved, "ep": 4, "tp": 2})
    with pytest.raises(ToolkitError, match=r"saved at parallel.ep 2, this run has ep 1") as e:
        _check_reshard(tmp_path, saved, {**saved, "ep": 1})
    assert "--to megatron --ep 1 --tp 1 --pp 1 --vpp 1" in str(e.value)
    with pytest.raises(ToolkitError, match=r"saved at parallel.ep 1, this run has ep 2"):
        _check_reshard(tmp_path, {**saved, "ep": 1}, saved)


@pytest.mark.slow
def test_ep2_torch_dist_distributed_optimizer_run_resumes_at_tp2_ep2_and_converts(start, tmp_path):
    """EP2 with the distributed optimizer, saved at step 2 in torch_dist by Megatron-Core's own dist_checkpointing
    (experts stacked by global index, fully_reshardable optimizer state, one optimizer per expert group), resumes
    through Megatron-Core's resharding load at TP2 x EP2 + SP on 4 ranks: steps 3-4 continue the single-process
    transformers losses. The last checkpoint converts to Hugging Face (transformers loads it) and, with its optimizer
    state, to the toolkit layout at EP1."""
    import transformers

    hf_in, want = start
    sets = ["model.preset=null", f"model.hf_path={hf_in}", "model.pretrained=true", f"training.steps={STEPS}",
            *SCHEDULE, "logging.interval=1", "checkpoint.interval=1000", "checkpoint.format=torch_dist",
            "parallel.zero_stage=1"]
    launch("tiny_qwen3_moe", [*sets, "training.stop_at_step=2"], nproc=2, out_dir=tmp_path / "run")
    tag = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert Reader(tag).shape("decoder.layers.mlp.experts.experts.linear_fc2.weight") == (2, 4, 64, 48)
    proc = launch("tiny_qwen3_moe", [*sets, "parallel.tp=2", "parallel.sp=true", "parallel.world_size=4"], nproc=4,
                  out_dir=tmp_path / "run")
    assert "resumed from" in proc.stdout
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    print("qwen3_moe EP2 distopt torch_dist, resumed at TP2 x EP2:", got, "single process:", want)
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    last = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert json.loads((last / "toolkit_meta.json").read_text())["layout"]["tp"] == 2
    hf = convert(last, tmp_path / "hf", "hf", progress=False, log=lambda *_: None)
    assert transformers.Qwen3MoeForCausalLM.from_pretrained(hf).config.num_experts == 4
    mega = convert(last, tmp_path / "mg", "megatron", ep=1, progress=False, log=lambda *_: None)
    optim = load_file(str(next(mega.glob("step_*")) / "optim_tp00_pp000.safetensors"))
    assert "chunk0.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight:exp_avg" in optim


def test_a_missing_expert_parallel_rank_file_and_ep_for_torch_dist_are_refused_in_one_line(moe, tmp_path):
    """A Megatron-LM legacy MoE checkpoint missing one expert-parallel rank's file names it, and `--to torch_dist
    --ep 2` says torch_dist has no expert-parallel files; neither writes anything."""
    folder, model, _ = moe
    lm = convert(folder, tmp_path / "lm", "megatron_lm", ep=2, progress=False, log=lambda *_: None)
    (lm / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(ToolkitError, match=r"is incomplete for tp=1 pp=1 ep=2: missing .*mp_rank_00_001") as e:
        convert(lm, tmp_path / "out", "hf", vocab_size=model.config.vocab_size, progress=False, log=lambda *_: None)
    assert "\n" not in str(e.value)
    with pytest.raises(ToolkitError, match=r"--ep 2: a torch_dist checkpoint's weights load at any ep .*the source "
                       r"has none\): drop --ep"):
        convert(folder, tmp_path / "td", "torch_dist", ep=2, progress=False, log=lambda *_: None)
    with pytest.raises(ToolkitError, match=r"--ep 2: .*a Hugging Face folder holds every expert"):
        convert(folder, tmp_path / "hf", "hf", ep=2, progress=False, log=lambda *_: None)
    assert not any((tmp_path / d).exists() for d in ("out", "td", "hf"))


AUX = 0.05  # a load-balancing loss strong enough to move 4 steps' losses by far more than the tolerance
ONE = "training.micro_batch_size=1"  # one sequence per micro-batch: every rank's micro-batches are the reference's


@pytest.fixture(scope="module")
def aux_start(start, tmp_path_factory):
    """start's weights with router_aux_loss_coef 0.05 in config.json, and transformers' own single-process losses from
    them with its load-balancing loss on (output_router_logits) and off."""
    hf_in, _ = start
    folder = tmp_path_factory.mktemp("moe_aux") / "hf"
    shutil.copytree(hf_in, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": AUX}))
    return (folder, reference_losses(folder, STEPS, [*SCHEDULE, ONE], router_logits=True),
            reference_losses(folder, STEPS, [*SCHEDULE, ONE]))


def _aux_sets(folder) -> list[str]:
    return ["model.preset=null", f"model.hf_path={folder}", "model.pretrained=true", f"training.steps={STEPS}",
            *SCHEDULE, ONE, "logging.interval=1", "checkpoint.interval=1000"]


@pytest.mark.slow
def test_deepspeed_trains_the_moe_with_transformers_load_balancing_loss(aux_start, tmp_path):
    """transformers adds Qwen3-MoE's load-balancing loss only with output_router_logits, which its config leaves off:
    the DeepSpeed backend turns it on when router_aux_loss_coef > 0 (it used to be silently ignored) and logs the LM
    loss. ZeRO-2 on 2 ranks gives the single-process transformers loop's losses with the aux loss, not those without."""
    folder, want, without = aux_start
    launch("tiny_qwen3_moe", [*_aux_sets(folder), "parallel.backend=deepspeed", "parallel.ep=1",
                              "parallel.zero_stage=2"], nproc=2, out_dir=tmp_path / "run")
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    print("qwen3_moe DeepSpeed with aux loss:", got, "transformers with:", want, "without:", without)
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    assert abs(want[-1] - without[-1]) > 100 * LOSS_RTOL * abs(want[-1])  # the aux loss changes the run


@pytest.mark.slow
def test_megatron_aux_loss_is_the_same_under_expert_parallelism(aux_start, tmp_path):
    """Megatron-Core's own load-balancing loss (per layer, switch-style: not transformers' function, which pools the
    layers, so the Megatron losses here are not the transformers ones) at router_aux_loss_coef: EP2 gives the EP1 x DP2
    losses, and the loss changes the run against transformers' losses without it."""
    folder, _, without = aux_start
    runs = {}
    for ep in (1, 2):
        launch("tiny_qwen3_moe", [*_aux_sets(folder), f"parallel.ep={ep}"], nproc=2, out_dir=tmp_path / f"ep{ep}")
        runs[ep] = [m["loss"] for m in read_metrics(tmp_path / f"ep{ep}")]
    print("qwen3_moe Megatron with aux loss, EP1 x DP2:", runs[1], "EP2:", runs[2], "transformers without:", without)
    assert runs[2] == pytest.approx(runs[1], rel=LOSS_RTOL)
    assert runs[1][0] == pytest.approx(without[0], rel=LOSS_RTOL)  # step 1: the same weights, the aux loss not in it
    assert abs(runs[1][-1] - without[-1]) > 100 * LOSS_RTOL * abs(without[-1])
