"""toolkit.plan.megatron_states against what Megatron-Core really allocates.

- Tiny layouts in real processes (gloo on CPU, tests/plan_megatron_probe.py): after one training step every rank's
  parameter count and the bytes of its parameters, DDP grad buffers, fp32 main params and Adam moments equal the
  planner's, exactly. The model has odd sizes (hidden 96, FFN 200, vocab 600) so that vocabulary padding, 64-element
  parameter alignment and bucket padding all occur; small buckets and tied embeddings exercise the bucket rules.
- llama70b_tp8_pp4 built by Megatron on the meta device for one rank: the same parameter count, with no memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, free_port
from toolkit.plan.megatron_states import (
    build_buffer,
    largest_megatron_state_bytes,
    layers_of_chunk,
    megatron_params,
    megatron_state_bytes,
    owned_by,
    rank_buffers,
    shard_elements,
)
from toolkit.recipe import load_recipe, resolve

PROBE = REPO / "tests" / "plan_megatron_probe.py"
ODD = ["model.hidden_size=96", "model.intermediate_size=200", "model.num_attention_heads=4", "model.num_kv_heads=2",
       "model.vocab_size=600", "data.seq_len=16", "training.micro_batch_size=1", "training.grad_accum_steps=2",
       "training.global_batch_size=null"]
BF16 = ["training.precision=bf16"]
SMALL_BUCKETS = ["parallel.megatron.bucket_size=30000"]
# name -> (recipe, overrides)
CASES_2 = {
    "tp2_bf16": ("tiny_tp2", BF16),
    "tp2_fp32": ("tiny_tp2", []),
    "pp2_bf16": ("tiny_pp2", BF16),
    "pp2_tied_bf16": ("tiny_pp2", [*BF16, "model.tie_word_embeddings=true"]),
    "pp2_vpp2_bf16": ("tiny_pp2_vpp2", BF16),
    "dp2_distopt_bf16": ("tiny_dp2_distopt", [*BF16, *SMALL_BUCKETS]),
    "dp2_distopt_fp32": ("tiny_dp2_distopt", []),
    "dp2_distopt_tied_fp16": ("tiny_dp2_distopt", ["training.precision=fp16", "model.tie_word_embeddings=true"]),
    # a mixture of experts at ep2: its experts in buffers of their own over the expert-data-parallel ranks
    "ep2_bf16": ("tiny_qwen3_moe", BF16),
    "ep2_distopt_bf16": ("tiny_qwen3_moe", [*BF16, "parallel.zero_stage=1", *SMALL_BUCKETS]),
}
DP2_PP2 = ["parallel.world_size=4", "parallel.zero_stage=1"]
CASES_4 = {
    "tp2_pp2_bf16": ("tiny_tp2_pp2", BF16),
    "pp2_dp2_distopt_tied_bf16": ("tiny_pp2", [*BF16, *DP2_PP2, *SMALL_BUCKETS, "model.tie_word_embeddings=true"]),
    "pp2_vpp2_dp2_distopt_bf16": ("tiny_pp2_vpp2", [*BF16, *DP2_PP2]),
    "ep2_dp4_distopt_bf16": ("tiny_qwen3_moe", [*BF16, "parallel.world_size=4", "parallel.zero_stage=1"]),
}
KINDS = ("weights", "grads", "master", "moments")
TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _recipe(name: str, overrides: list[str]):
    r = load_recipe(name, [*ODD, *overrides])
    return r, resolve(r, None).layout


def _run_probe(cases: dict, nproc: int, tmp) -> None:
    spec = tmp / f"cases{nproc}.json"
    spec.write_text(json.dumps([{"name": k, "recipe": rec, "overrides": [*ODD, *o]} for k, (rec, o) in cases.items()]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(PROBE), "measure", str(spec), str(tmp)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """{case: [per-rank measurements]}, from one 2-process and one 4-process launch (cases run in turn)."""
    tmp = tmp_path_factory.mktemp("plan_probe")
    _run_probe(CASES_2, 2, tmp)
    _run_probe(CASES_4, 4, tmp)
    out = {}
    for path in sorted(tmp.glob("*.rank*.json")):
        out.setdefault(path.name.split(".rank")[0], []).append(json.loads(path.read_text()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", [*CASES_2, *CASES_4])
def test_planner_matches_what_megatron_allocates(case, measured):
    recipe, overrides = {**CASES_2, **CASES_4}[case]
    r, layout = _recipe(recipe, overrides)
    ranks = measured[case]
    assert len(ranks) == layout.world_size
    for got in ranks:
        want = megatron_state_bytes(r, layout, pp_rank=got["pp_rank"], dp_rank=got["dp_rank"],
                                    tp_rank=got["tp_rank"])
        where = f"{case} rank tp{got['tp_rank']} pp{got['pp_rank']} dp{got['dp_rank']}"
        print(f"{where}: params {got['params']}, " + ", ".join(f"{k} {got[k]}" for k in KINDS))
        assert got["params"] == megatron_params(r, layout.tp, layout.pp, layout.vpp, got["tp_rank"], got["pp_rank"],
                                                layout.ep)
        assert {k: got[k] for k in KINDS} == {k: getattr(want, k) for k in KINDS}, where
        # nothing the planner leaves out: no gradient outside the DDP buffers, no Adam state but the moments and
        # torch's 4-byte `step` per parameter (noted, not counted)
        assert got["stray_grads"] == 0 and got["other_state"] == 0
        assert got["weight_dtypes"] == [TORCH_DTYPES[r.training.precision]]


@pytest.mark.slow
def test_llama70b_rank_built_on_meta_device_matches_planner(tmp_path):
    """One TP rank of the first and last pipeline stage of llama70b_tp8_pp4, built by Megatron with no memory."""
    r = load_recipe("llama70b_tp8_pp4", [])
    layout = resolve(r, None).layout
    for pp_rank in (0, layout.pp - 1):
        out = tmp_path / f"meta{pp_rank}.json"
        cmd = [sys.executable, str(PROBE), "meta", "llama70b_tp8_pp4", "0", str(pp_rank), str(out)]
        proc = subprocess.run(cmd,
                              cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-6000:]
        chunks = json.loads(out.read_text())
        assert len(chunks) == layout.vpp and all(c["devices"] == ["meta"] for c in chunks)
        for vp, chunk in enumerate(chunks):
            assert chunk["layers"] == list(layers_of_chunk(r.model.num_layers, layout.pp, layout.vpp, pp_rank, vp))
        total = sum(c["params"] for c in chunks)
        print(f"llama70b tp_rank 0 pp_rank {pp_rank}: {total} parameters in {len(chunks)} chunks")
        assert total == megatron_params(r, layout.tp, layout.pp, layout.vpp, 0, pp_rank)


def test_ranks_add_up_to_the_whole_model():
    """Over all TP and PP ranks the planner counts every parameter once (norms once per TP rank: they are
    replicated), plus the padded vocabulary rows."""
    for name in ("llama70b_tp8_pp4", "llama13b_tp4_pp2"):
        r = load_recipe(name, [])
        lay, m = resolve(r, None).layout, r.model
        h, kv = m.hidden_size, m.num_kv_heads or m.num_attention_heads
        layer = 2 * h + h * h + (m.num_attention_heads + 2 * kv) * (h // m.num_attention_heads) * h \
            + 3 * h * m.intermediate_size
        vocab = -(-m.vocab_size // (128 * lay.tp)) * 128 * lay.tp
        whole = m.num_layers * layer + h + 2 * vocab * h + (lay.tp - 1) * (2 * m.num_layers + 1) * h
        assert sum(megatron_params(r, lay.tp, lay.pp, lay.vpp, t, p)
                   for t in range(lay.tp) for p in range(lay.pp)) == whole


def test_distributed_optimizer_buffer_rules():
    """Hand-worked layout: params 64-aligned in reverse order, buckets closed at bucket_size and padded to
    lcm(dp, 128), a shared embedding alone in its bucket; dp shards cut through parameters."""
    params = [("emb", 300, True), ("a", 100, False), ("b", 70, False)]
    buf = build_buffer(params, shard_world=3, distributed=True, bucket_size=150)
    # b at 0..70; a at 128..228 (>= 150: bucket ends, padded to 384); emb alone at 384..684, padded to 768
    assert buf.params == ((0, 70), (128, 228), (384, 684))
    assert buf.buckets == ((0, 384), (384, 768)) and buf.numel == 768
    # shards of 128: rank0 b(70) + emb 384..512 (128); rank1 a(100) + emb 512..640; rank2 emb 640..684 (44)
    assert shard_elements(buf, 3) == [70 + 128, 100 + 128, 44]
    assert [owned_by(buf, 3, rank) for rank in range(3)] == [70 + 128, 100 + 128, 44]
    plain = build_buffer(params, shard_world=3, distributed=False, bucket_size=150)
    assert plain.numel == 470 and plain.buckets == ((0, 170), (170, 470))


@pytest.mark.parametrize("recipe,sets", [("llama70b_tp8_pp4", []), ("tiny_dp2_distopt", ["parallel.world_size=6", "training.global_batch_size=48"]),
                                         ("llama13b_tp4_pp2", ["parallel.zero_stage=1", "parallel.world_size=24",
                                                              "training.global_batch_size=510"])])
def test_one_rank_shard_equals_the_all_ranks_walk(recipe, sets):
    """The planner's one-rank fast path (owned_by) against the all-ranks walk, on real buffers."""
    r = load_recipe(recipe, sets)
    layout = resolve(r, None).layout
    for pp_rank in range(layout.pp):
        for buf in rank_buffers(r, layout, pp_rank):
            world = layout.dp * layout.cp
            assert [owned_by(buf, world, i) for i in range(world)] == shard_elements(buf, world)


def test_largest_rank_and_notes():
    r = load_recipe("llama70b_tp8_pp4", [])
    layout = resolve(r, None).layout
    rank, states = largest_megatron_state_bytes(r, layout)
    assert rank["pp_rank"] == layout.pp - 1  # the output layer and final norm outweigh the embedding by one norm
    assert states == megatron_state_bytes(r, layout, rank["pp_rank"], rank["dp_rank"])
    # bf16 + distributed optimizer, dp 2: 2 + 4 bytes per local param, (4 + 8) / 2 per param for the shards
    n = megatron_params(r, layout.tp, layout.pp, layout.vpp, 0, layout.pp - 1)
    assert (states.weights, states.grads, states.master, states.moments) == (2 * n, 4 * n, 2 * n, 4 * n)
    assert any("lcm" in line for line in states.notes)
