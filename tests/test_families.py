"""The Mistral, Qwen2, Qwen3 and Qwen3-MoE families against the real libraries. Tiny random models are built with
transformers' own config classes (GQA: 4 heads, 2 kv heads; vocab 500, which every TP size pads; Qwen2 with q/k/v
biases and tied embeddings; Qwen3 with q/k norms and head_dim 32 != hidden 64 / 4 heads; Qwen3-MoE with 4 experts,
top 2), with every bias and norm weight randomised so that a mis-grouped bias or a swapped norm shows.
Megatron-Core's GPTModel, filled through each family's keyword map, must give transformers' logits at TP1 (fast: one
launch for all the families), TP2, PP2 and, for the MoE family, EP2 (slow; one two-rank launch); HF -> Megatron
TP2xPP2 -> HF must be bit-exact; the planner's counts must be the models' own."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import typing

import pytest
import torch
from conftest import REPO, free_port, launch, read_metrics
from reference import reference_losses
from safetensors.torch import load_file
from test_megatron_parity import LOSS_RTOL, SCHEDULE, STEPS

from toolkit.checkpoint.convert import convert
from toolkit.errors import ToolkitError
from toolkit.families import FAMILIES, dims_from_hf, hf_to_megatron
from toolkit.model import to_hf_config
from toolkit.recipe import load_recipe
from toolkit.recipe.schema import ModelConfig

PROBE = REPO / "tests" / "families_logits_probe.py"
LOGITS_ATOL = 1e-5  # fp32, as in test_family_logits.py; a wrong split, permutation or bias gives order 1
SHAPE = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {  # family -> (transformers config class, causal LM class, its own fields)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rms_norm_eps=1e-6)),
    # 4 experts of width 48, top 2 renormalised (as Qwen3-30B-A3B routes); no dense layer
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=32, rms_norm_eps=1e-6, num_experts=4,
                                                                 num_experts_per_tok=2, moe_intermediate_size=48,
                                                                 norm_topk_prob=True)),
}


def tiny_model(family: str, seed: int = 7, **change):
    import transformers

    config_cls, model_cls, own = CONFIGS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**SHAPE, **own, **change})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # biases start at 0 and norms at 1: make every element tell where it went
                p.copy_((1.0 if "norm" in name else 0.0) + 0.5 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(10)  # sharper attention than a random init gives, so that positions and heads matter
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)  # decisive routing: no near-tie between experts that rounding could flip
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in CONFIGS:
        model = tiny_model(family)
        model.save_pretrained(root / family)
        out[family] = (root / family, model)
    return out


def probe(models, layouts: list[tuple[int, ...]], out_dir) -> dict:
    """Megatron's logits for every family at every layout ({(tp, pp[, ep]): {family: result}}), from one torchrun
    launch (all layouts use the same number of ranks; an ep > 1 layout runs on ranks of its dp, MoE families only)."""
    nproc = {max(lay[0] * lay[1], lay[2] if len(lay) > 2 else 1) for lay in layouts}.pop()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(PROBE), ",".join("x".join(map(str, lay)) for lay in layouts), str(out_dir),
           *(str(f) for f, _ in models.values())]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    def name(lay):
        return f"tp{lay[0]}_pp{lay[1]}" + (f"_ep{lay[2]}" if len(lay) > 2 else "")

    return {lay: {family: torch.load(out_dir / f"{family}_{name(lay)}.pt", weights_only=True)
                  for family in models if len(lay) < 3 or "moe" in family} for lay in layouts}


def assert_logits_match(models, got: dict, where: str, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    from toolkit.plan.megatron_states import chunk_params

    for family, (folder, model) in models.items():
        if family not in got:
            continue
        assert got[family]["family"] == family  # the recipe took the family from config.json's model_type
        # the planner's per-rank parameters (q/k/v bias, q/k norms, router and local experts) are what Megatron built
        r = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={folder}", "parallel.backend=megatron"])
        planned = [(re.sub(r"layers\.\d+\.", "layers.N.", n), k)
                   for n, k, _ in chunk_params(r, tp, pp, 1, pp - 1, 0, ep)]
        built = [(re.sub(r"layers\.\d+\.", "layers.N.", n), k) for n, k in got[family]["params"]]
        assert planned == built, f"{family} at {where}: the planner's parameters differ from Megatron's"
        with torch.no_grad():
            want = model(got[family]["ids"]).logits
        diff = (got[family]["logits"] - want).abs().max().item()
        print(f"{family} {where}: max |logit difference| to transformers: {diff:.2e}")
        assert diff < LOGITS_ATOL, f"{family} at {where}: Megatron-Core logits differ from transformers by {diff:.2e}"


def test_megatron_core_logits_equal_transformers_tp1(models, tmp_path):
    assert_logits_match(models, probe(models, [(1, 1)], tmp_path)[(1, 1)], "TP1")


@pytest.mark.slow
def test_megatron_core_logits_equal_transformers_tp2_and_pp2(models, tmp_path):
    """TP2, then PP2, then (the MoE family) EP2 with Megatron's alltoall token dispatch over gloo, on the same two
    ranks of one launch."""
    got = probe(models, [(2, 1), (1, 2), (1, 1, 2)], tmp_path)
    assert "qwen3_moe" in got[(1, 1, 2)]
    for (tp, pp, *ep), per_family in got.items():
        assert_logits_match(models, per_family, f"TP{tp} x PP{pp}" + (f" x EP{ep[0]}" if ep else ""), tp, pp,
                            ep[0] if ep else 1)


def test_hf_to_megatron_tp2_pp2_and_back_is_bit_exact(models, tmp_path):
    for family, (folder, model) in models.items():
        mega = convert(folder, tmp_path / f"{family}_tp2pp2", "megatron", 2, 2, progress=False, log=lambda *_: None)
        back = convert(mega, tmp_path / f"{family}_back", "hf", progress=False, log=lambda *_: None)
        # the tensors as saved (save_pretrained drops a tied lm_head; transformers 5 stores MoE experts one by one)
        got, want = load_file(str(back / "model.safetensors")), load_file(str(folder / "model.safetensors"))
        assert set(got) == set(want), family
        assert all(torch.equal(got[n], want[n]) for n in got), family
        config = json.loads((back / "config.json").read_text())
        assert config["model_type"] == family and config["architectures"] == [CONFIGS[family][1]]


def test_qkv_bias_is_grouped_per_query_group_like_the_weight(models):
    """Tag each q/k/v row: column 0 of the weight equals the bias. Megatron adds linear_qkv.bias to the rows of
    linear_qkv.weight, so on every TP rank the two must still agree row by row (a bias split as a plain column,
    or grouped differently from the weight, breaks it)."""
    folder, model = models["qwen2"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(2):
        for p in "qkv":
            state[f"model.layers.{i}.self_attn.{p}_proj.weight"][:, 0] = state[f"model.layers.{i}.self_attn.{p}_proj.bias"]
    dims = dims_from_hf(model.config, tp=2)
    shards = hf_to_megatron(state, dims, tp=2, pp=1)
    for tp_rank in range(2):
        chunk = shards[(0, tp_rank)][0]
        for j in range(2):
            w, b = (chunk[f"decoder.layers.{j}.self_attention.linear_qkv.{x}"] for x in ("weight", "bias"))
            assert torch.equal(w[:, 0], b), (tp_rank, j)
    q3 = hf_to_megatron(models["qwen3"][1].state_dict(), dims_from_hf(models["qwen3"][1].config, tp=2), tp=2, pp=1)
    norm = models["qwen3"][1].model.layers[1].self_attn.k_norm.weight
    assert all(torch.equal(q3[(0, r)][0]["decoder.layers.1.self_attention.k_layernorm.weight"], norm) for r in (0, 1))


def test_recipe_takes_family_from_hf_config_and_plans_its_exact_parameters(models):
    from toolkit.metrics import count_params
    from toolkit.plan.deepspeed_states import llama_params

    for family, (folder, model) in models.items():
        r = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={folder}"])
        assert r.model.family == family
        assert count_params(r.model)["total"] == sum(p.numel() for p in model.parameters())
        # the DeepSpeed planner's parameter list is the model's, in registration order (biases, q/k norms included)
        assert llama_params(r.model) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={models['qwen3'][0]}"]).model.head_dim == 32


def test_the_schema_accepts_exactly_the_registered_families():
    assert set(typing.get_args(ModelConfig.model_fields["family"].annotation)) == {f.name for f in FAMILIES.values()}


@pytest.mark.parametrize("family,change,needle", [
    ("mistral", dict(sliding_window=4096), "sets sliding_window: 4096"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64), "sets sliding_window: 64"),
    ("qwen3", dict(hidden_act="gelu"), "sets hidden_act: gelu"),
])
def test_what_megatron_cannot_honour_is_refused(family, change, needle, tmp_path):
    model = tiny_model(family, **change)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ToolkitError, match=needle):
        convert(tmp_path / "hf", tmp_path / "out", "megatron", 2, progress=False, log=lambda *_: None)
    assert not (tmp_path / "out").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    from toolkit.recipe.presets import unsupported_hf_config

    problems = unsupported_hf_config(config, "config.json")
    assert problems and needle.split(":")[0] in problems[0].render(), [p.render() for p in problems]
    # a Hugging Face target keeps what transformers' model does (Mistral v0.1 was refused here until 2026-12-07)
    convert(tmp_path / "hf", tmp_path / "bf16", "hf", dtype="bf16", progress=False, log=lambda *_: None)
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert all(written[k] == v for k, v in change.items()), written


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_tp2_pp2_training_reproduces_single_process_losses(family, tmp_path):
    """Each family's tiny recipe trained at TP2 x PP2 on 4 ranks from the same initial weights gives the plain
    single-process loop's losses. Qwen2: biases, tied embeddings (the output layer is a stored copy on the last
    stage); Qwen3: per-head q/k norms, replicated over TP although each TP rank normalises other heads, so their
    gradients must be summed over TP."""
    import transformers

    torch.manual_seed(7)
    model = getattr(transformers, CONFIGS[family][1])(to_hf_config(load_recipe(f"tiny_{family}").model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    want = reference_losses(tmp_path / "hf", STEPS, SCHEDULE)
    launch("tiny_tp2_pp2", ["model.preset=null", f"model.hf_path={tmp_path / 'hf'}", "model.pretrained=true",
                            f"training.steps={STEPS}", *SCHEDULE, "logging.interval=1", "checkpoint.interval=1000"],
           nproc=4, out_dir=tmp_path / "run")
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    print(f"{family} TP2xPP2:", got, "single process:", want)
    assert len(got) == STEPS and want[-1] < want[0] - 0.05
    assert got == pytest.approx(want, rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_deepspeed_zero3_run_of_the_family_trains_and_converts_back_to_hf(family, tmp_path):
    """Each dense family's tiny recipe trains with DeepSpeed ZeRO-3 on 2 ranks (transformers' own model class of the
    family) and its checkpoint directory converts with --fp32 to a Hugging Face folder of that class, whose weights
    equal DeepSpeed's own zero_to_fp32 bit for bit. Qwen2 is tests/test_deepspeed_convert.py's ZeRO-3 run,
    Qwen3-MoE tests/test_moe.py's."""
    import transformers
    from test_deepspeed_convert import _zero_to_fp32

    launch(f"tiny_{family}", ["parallel.zero_stage=3", "training.steps=4", "checkpoint.interval=4",
                              "training.schedule.warmup_steps=2", "logging.interval=1", "logging.sample_prompt="],
           nproc=2, out_dir=tmp_path / "run")
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    tag = tmp_path / "run" / "checkpoints" / "step_00000004"
    hf = convert(tag.parent, tmp_path / "hf", "hf", fp32=True, progress=False, log=lambda *_: None)
    assert json.loads((hf / "config.json").read_text())["architectures"] == [CONFIGS[family][1]]
    got, want = load_file(str(hf / "model.safetensors")), _zero_to_fp32(tag)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(hf)).__name__ == CONFIGS[family][1]


def test_megatron_padding_of_a_pretrained_vocabulary_is_said_with_a_divisor_that_avoids_it():
    """Megatron's loss is a softmax over its padding rows too, so a pretrained 600-token model at tp=2 (padded to
    768) starts at another loss than transformers' (7.70 against 7.63 in a trial of 2026-12-07, said nowhere)."""
    from toolkit.recipe import resolve
    from toolkit.run import vocab_padding_notes

    r = load_recipe("tiny_tp2", ["model.pretrained=true", "model.hf_path=/x", "model.vocab_size=600"])
    (note,) = vocab_padding_notes(r, resolve(r).layout)
    assert note.startswith("vocabulary padding: 600 rows pad to 768 at tp=2 (by 128); Megatron's loss is a softmax "
                           "over the 168 zero padding rows too") and "make_vocab_size_divisible_by: 100 pads none" in note
    fixed = load_recipe("tiny_tp2", ["model.pretrained=true", "model.hf_path=/x", "model.vocab_size=600",
                                     "parallel.megatron.make_vocab_size_divisible_by=100"])
    assert vocab_padding_notes(fixed, resolve(fixed).layout) == []
    assert vocab_padding_notes(load_recipe("tiny_tp2"), resolve(load_recipe("tiny_tp2")).layout) == []  # random init


def test_a_dropout_in_the_pretrained_config_is_said(tmp_path):
    """attention_dropout 0.1 was trained as 0.0 and exported as 0.0 without a word (a trial of 2026-12-07)."""
    from toolkit.run import dropout_notes

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "attention_dropout": 0.1,
                                                      "hidden_dropout": 0.0}))
    r = load_recipe("tiny_zero0", [f"model.hf_path={tmp_path}"])
    assert dropout_notes(r) == ["model.hf_path: its config sets attention_dropout: 0.1; the toolkit trains without "
                                "dropout, and a Hugging Face export of this run writes 0.0"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "attention_dropout": 0.0}))
    assert dropout_notes(r) == []
