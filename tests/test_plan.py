"""`toolkit plan`: the classic cases choose what the published Megatron-Core and DeepSpeed recipes use, with the
reasoning printed; the table and --json carry the same numbers; --write saves a recipe that validates; bad input
is refused without writing; the pipeline arithmetic is Megatron's own schedule's."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO
from toolkit.plan.choice import Choice, from_recipe
from toolkit.plan.estimate import bubble, estimate, in_flight
from toolkit.plan.hardware import Cluster
from toolkit.plan.search import reasons, search
from toolkit.recipe import load_recipe

LONG = ["data.seq_len=131072", "model.max_position_embeddings=131072"]


def plan(recipe: str, sets: list[str], **cluster):
    r = load_recipe(recipe, sets)
    s = search(r, Cluster(**cluster), r.training.global_batch_size)
    assert s.best is not None
    return s.best.choice, reasons(r, s.best, s)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


# ---- the classic cases ------------------------------------------------------------------------------------------

def test_7b_on_8x80gb_is_plain_data_parallel_with_sharded_optimizer_states():
    """NeMo / Megatron-Bridge pretrain Llama 2 7B at TP1 PP1 with the distributed optimizer; DeepSpeed's Llama
    examples use ZeRO-1/2 on one node. Plain DDP (ZeRO-0) does not fit 80 GB: 16 bytes per parameter."""
    c, why = plan("llama7b_zero3", [], gpus=8, gpu_memory_gib=80)
    assert (c.backend, c.tp, c.pp, c.cp, c.dp, c.zero, c.offload_optimizer) == ("deepspeed", 1, 1, 1, 8, 1, "none")
    text = "\n".join(why)
    assert "the model is the problem" in text and "ZeRO-0: does not fit" in text
    assert "Megatron distributed optimizer: +0% step time" in text  # the other backend's equivalent is a tie


def test_70b_on_64x80gb_is_tp_inside_a_node_and_pp_across_nodes():
    """Megatron-Bridge's Llama 3 70B recipe: TP4 x PP4 (x VP5) with the distributed optimizer and sequence
    parallelism; Megatron-LM's 70B runs use TP8 x PP4 or TP4 x PP4. TP stays inside a node."""
    c, why = plan("llama70b_tp8_pp4", [], gpus=64, gpus_per_node=8, gpu_memory_gib=80)
    assert (c.backend, c.tp, c.pp, c.cp, c.sp, c.zero) == ("megatron", 4, 4, 1, True, 1)
    text = "\n".join(why)
    assert "ZeRO-0: does not fit" in text and "are ties" in text


def test_7b_on_one_24gb_gpu_offloads_the_optimizer_to_cpu():
    """DeepSpeed's ZeRO-Offload recipe for one GPU: ZeRO-2 with the optimizer (fp32 masters, moments, gradients)
    in CPU RAM, the 16-bit weights on the GPU, activation checkpointing."""
    c, why = plan("llama7b_zero3", [], gpus=1, gpus_per_node=1, gpu_memory_gib=24, cpu_memory_gib=128)
    assert (c.backend, c.zero, c.offload_optimizer, c.offload_params, c.recompute) == \
        ("deepspeed", 2, "cpu", "none", "full")
    text = "\n".join(why)
    assert "none: does not fit" in text  # no layout without offload fits 24 GB


def test_8b_at_128k_context_on_16_gpus_uses_context_parallel():
    """Megatron-Bridge's llama3_8b_128k recipe: CP8 x TP4 x PP2 with sequence parallelism (64 GPUs); at 16 GPUs
    the same shape is CP8 x TP2: the sequence, not the model, is what does not fit."""
    c, why = plan("llama3_8b_tp2_cp2", LONG, gpus=16, gpu_memory_gib=80)
    assert (c.backend, c.cp, c.tp, c.sp) == ("megatron", 8, 2, True)
    assert "the sequence is the problem" in "\n".join(why)


def test_nothing_fits_says_what_is_missing():
    proc = cli("--recipe", "llama70b_tp8_pp4", "--gpus", "8", "--gpu-memory", "24", "--cpu-memory", "64",
               "--nvme", "100")
    assert proc.returncode == 1
    assert "Nothing fits" in proc.stdout and "GPUs of" in proc.stdout and "more GPUs: 64 would fit" in proc.stdout
    assert "CPU RAM: needs" in proc.stdout


def test_no_valid_layout_names_the_batch_or_the_model():
    batch = cli("--recipe", "tiny_zero0", "--gpus", "3", "--backend", "deepspeed")
    assert batch.returncode == 1 and "Nothing fits: no layout of 3 GPUs is valid for this recipe." in batch.stdout
    assert ("no valid layout: global batch 16 is not divisible by micro-batch x data-parallel size in any layout "
            "of 3 GPUs; a multiple of 3 is (e.g. --set training.global_batch_size=18)") in batch.stdout
    both = cli("--recipe", "tiny_zero0", "--gpus", "3")  # tp 3 at dp 1 divides the batch, not the 4 heads
    assert both.returncode == 1 and "divides only over data-parallel size 1 on 3 GPUs" in both.stdout


# ---- the command ------------------------------------------------------------------------------------------------

def test_table_and_json_carry_the_same_numbers_quickly():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = cli("--recipe", "llama70b_tp8_pp4", "--gpus", "64", "--gpus-per-node", "8", "--gpu-memory", "80")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert text.returncode == 0, text.stderr
    # The issue asks for under 2 s. The command's CPU time, not its wall time, is bounded here: the suite runs
    # beside other tests (pytest-xdist workers, training launches), which stretch wall time but not CPU time. What
    # keeps it fast is that planning never imports torch, DeepSpeed or Megatron (checked below); docs/plan.md gives
    # the measured wall time on an idle machine.
    assert cpu_s < 4, cpu_s
    data = json.loads(cli("--recipe", "llama70b_tp8_pp4", "--gpus", "64", "--json").stdout)
    first = data["ranked"][0]
    row = next(line for line in text.stdout.splitlines() if line.strip().startswith("1  "))
    assert first["layout"] in row and f"{first['step_s']:.3g}" in row
    own = data["recipe_layout"]
    assert own["layout"].startswith("Megatron tp8+sp pp4 vpp5 dp2 distopt")
    assert f"{own['memory_bytes']['gpu_total'] / 2**30:,.2f} GiB" in text.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys; from toolkit.cli import main; "
                            "main(['plan', '--recipe', 'llama7b_zero3', '--gpus', '8', '--json']); "
                            "sys.stderr.write(str(sorted(m for m in ('torch', 'deepspeed', 'megatron') "
                            "if m in sys.modules)))"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert probe.stderr.strip() == "[]", probe.stderr


def test_recipe_breakdown_shows_every_memory_kind_and_the_step():
    out = cli("--recipe", "llama7b_zero3", "--gpus", "8").stdout
    for word in ("weights", "gradients", "fp32 master weights", "Adam moments", "activations", "total on GPU",
                 "ZeRO-3 parameter all-gathers", "est. step time", "MFU"):
        assert word in out, word
    mega = cli("--recipe", "llama70b_tp8_pp4", "--gpus", "64").stdout
    assert "pipeline bubble: 0.1% = (pp-1)/(vpp x m + pp-1) with pp=4, vpp=5, m=512" in mega
    assert "TP all-gather/reduce-scatter (sequence parallel)" in mega and "nvlink" in mega and "network" in mega


def test_write_saves_a_recipe_that_validates_and_replans_to_itself(tmp_path):
    path = tmp_path / "planned.yaml"
    proc = cli("--recipe", "llama7b_zero3", "--gpus", "1", "--gpus-per-node", "1", "--gpu-memory", "24",
               "--cpu-memory", "128", "--set", "training.steps=30000", "--write", str(path))
    assert proc.returncode == 0, proc.stderr
    r = load_recipe(str(path))
    assert (r.parallel.zero_stage, r.parallel.offload_optimizer, r.training.steps) == (2, "cpu", 30000)
    # its own run folder: until 2026-12-07 it kept llama7b_zero3's and resumed (or refused) that run's checkpoints
    assert (r.name, r.out_dir, r.checkpoint_dir) == ("planned", "runs/planned", "runs/planned/checkpoints")
    c, _ = plan(str(path), [], gpus=1, gpus_per_node=1, gpu_memory_gib=24, cpu_memory_gib=128)
    assert (c.zero, c.offload_optimizer, c.recompute) == (r.parallel.zero_stage, "cpu", "full")
    again = cli("--recipe", "llama7b_zero3", "--gpus", "8", "--write", str(path))
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
    assert load_recipe(str(path)).parallel.offload_optimizer == "cpu"  # untouched


@pytest.mark.parametrize("args,message", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "12", "--gpus-per-node", "8"], "do not fill whole nodes"),
    (["--gpus", "8", "--gpu-memory", "2"], "--gpu-memory"),
])
def test_bad_cluster_arguments_are_refused_without_writing(tmp_path, args, message):
    path = tmp_path / "never.yaml"
    proc = cli("--recipe", "llama7b_zero3", *args, "--write", str(path))
    assert proc.returncode == 2 and message in proc.stderr and not path.exists()
    assert "recipe toolkit plan" not in proc.stderr, proc.stderr  # it read as a recipe of that name


# ---- the schedule arithmetic against Megatron's own ------------------------------------------------------------

@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 1, 2), (4, 5, 16), (2, 2, 4), (8, 2, 8), (4, 5, 4)])
def test_in_flight_micro_batches_are_megatrons_warmup_plus_one(pp, vpp, m):
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    for rank in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda rank=rank: rank)
        comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        total, all_warm, warm, _ = get_pp_rank_microbatches(m, vpp, pp, p2p_communicator=comm)
        expect = total if all_warm else min(warm + 1, total)
        assert in_flight(Choice("megatron", 1, pp=pp, vpp=vpp, accum=m), rank) == expect, rank


def test_bubble_fraction():
    assert bubble(Choice("megatron", 1, pp=4, accum=8)) == pytest.approx(3 / 11)
    assert bubble(Choice("megatron", 1, pp=4, vpp=5, accum=8)) == pytest.approx(3 / 43)
    assert bubble(Choice("deepspeed", 8, accum=8)) == 0


def test_local_layer_spec_is_planned_with_its_unfused_attention():
    """Megatron's local spec materialises the s x s attention scores and has no context parallelism: a recipe
    that asks for it is planned that way, not as Transformer Engine."""
    from toolkit.plan.choice import from_recipe
    from toolkit.plan.estimate import estimate

    te, local = (load_recipe("llama7b_tp2_pp2", [f"parallel.megatron.transformer_impl={impl}",
                                                 "training.activation_checkpointing=none"])
                 for impl in ("auto", "local"))
    cluster = Cluster(gpus=8)
    a, b = (estimate(r, from_recipe(r, 8), cluster).memory.activations for r in (te, local))
    assert b > 2 * a
    s = search(local, cluster, local.training.global_batch_size, backends=("megatron",))
    assert s.estimates and all(e.choice.cp == 1 for e in s.estimates)


def test_expert_parallel_all_to_all_is_costed_per_moe_layer_on_the_critical_path():
    """Qwen3-30B-A3B at ep8: each MoE layer of a stage sends, per micro-batch, its tokens' top-8 copies (7/8 of them
    leave the rank) in a dispatch and a combine, forward and backward, with no overlap. Inside a node the EP group
    (ep consecutive blocks of tp ranks) uses NVLink; spread over two nodes it crosses the network and costs ~9x
    more. Megatron-Core's expert groups leave cp out (ep blocks of tp ranks), so context parallelism does not widen
    them. ep1 and a dense model have no all-to-all."""
    r = load_recipe("qwen3_30b_a3b_ep8_pp2")
    cluster = Cluster(gpus=32, gpus_per_node=8)
    c = Choice("megatron", 16, 1, 2, 1, 1, False, 1, recompute="selective", micro=1, accum=16, ep=8)
    a2a = [x for x in estimate(r, c, cluster).comms if x.dim == "ep"]
    token_bytes = 4096 * 2048 * 2  # one micro-batch of [s, b, h] bf16 activations
    assert len(a2a) == 1 and a2a[0].link == "nvlink" and a2a[0].exposed == a2a[0].seconds
    assert a2a[0].bytes == pytest.approx(4 * 8 * token_bytes * 7 / 8 * 16 * 24)  # 4 passes, 16 micro, 24 layers
    with_cp = next(x for x in estimate(r, c.with_(cp=2, dp=8, accum=32), cluster).comms if x.dim == "ep")
    assert with_cp.link == "nvlink"  # tp x ep = 8: the EP group is the same 8 GPUs of a node
    wide = c.with_(tp=2, sp=True, dp=8, accum=32)  # tp x ep = 16 > 8 GPUs per node
    wide_a2a = next(x for x in estimate(r, wide, cluster).comms if x.dim == "ep")
    assert wide_a2a.link == "network" and wide_a2a.seconds > 8 * a2a[0].seconds * wide_a2a.bytes / a2a[0].bytes
    assert not [x for x in estimate(r, c.with_(ep=1), cluster).comms if x.dim == "ep"]
    dense = load_recipe("llama7b_zero3")
    assert not [x for x in estimate(dense, c.with_(ep=1, backend="megatron"), cluster).comms if x.dim == "ep"]


def test_model_flops_count_the_output_layer_tied_or_not():
    """The logits matmul costs the same whether the output layer shares the embeddings' weights: a tied one was left
    out until 2026-12-07 (7.5% of tiny_qwen2's FLOPs, about 25% of a Qwen2.5-0.5B's)."""
    from toolkit.metrics import flops_per_token

    tied = load_recipe("tiny_qwen2").model
    assert tied.tie_word_embeddings
    untied = tied.model_copy(update={"tie_word_embeddings": False})
    assert flops_per_token(tied, 128) == flops_per_token(untied, 128)


def test_an_fp32_recipe_gets_no_mfu():
    """Training prints no MFU for fp32 (no 16-bit peak to compare with); plan rated it against the bf16 peak."""
    r = load_recipe("tiny_zero2")
    assert r.training.precision == "fp32"
    assert estimate(r, from_recipe(r, 2), Cluster(gpus=2, gpus_per_node=2)).mfu is None
    bf16 = load_recipe("tiny_zero2", ["training.precision=bf16"])
    assert estimate(bf16, from_recipe(bf16, 2), Cluster(gpus=2, gpus_per_node=2)).mfu > 0
