"""toolkit.plan.deepspeed_states against what DeepSpeed 0.19.8 really allocates, byte for byte.

Tiny real runs (gloo on CPU, torchrun, the toolkit's own DeepSpeedBackend) take one optimizer step (Adam's moments
exist from then on), then the micro-batches of the next. After each of their backward passes, where gradients
rest until the next micro-batch or the optimizer step, every rank counts the bytes of the tensors its engine
holds, by kind, each storage once (untyped_storage, so padding and shared flat buffers count as allocated):
weights (module parameters, ZeRO-3 ds_tensor partitions and gathered persistent parameters), fp32 masters (the
wrapper's fp32 groups / partitions), Adam exp_avg + exp_avg_sq (optimizer.state) and gradient storage (.grad of
parameters and masters, ZeRO-1/2 averaged_gradients / all_grad_tensors / CPU accumulators, ZeRO-3's
gradient-partition buffer), the largest over the micro-batches. Each must equal deepspeed_state_bytes(recipe,
dp, rank) exactly; none needs a tolerance.

Run as a script, this file is the worker:
    torchrun --nproc_per_node 2 tests/test_plan_deepspeed_states.py CASES.json OUT_DIR

Not pinned here: placement (on a CPU-only machine every tensor is on the CPU; the offload cases still pin the
bytes), the GPU-only FusedAdam path (FP16_Optimizer, which holds the same unpadded bytes as the
FP16_UnfusedOptimizer measured here) and NVMe offload (needs libaio; modelled from DeepSpeed's code).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs from a bare checkout

BF16 = "training.precision=bf16"
MIX = "parallel.deepspeed.stage3_param_persistence_threshold=10000"  # tiny-4l: norms + k/v persist, the rest split
# Hidden 50 (5 heads of 10, 1 kv head), 3 layers, tied vocab 513: both groups need alignment padding, ZeRO-1/2
# ranks keep different gradient amounts, and at dp=3 ZeRO-3 pads most parameters (2500 = 3 x 833 + 1).
ODD = ["model.hidden_size=50", "model.num_attention_heads=5", "model.num_kv_heads=1", "model.intermediate_size=130",
       "model.num_layers=3", "model.vocab_size=513", "model.tie_word_embeddings=true"]
ACCUM2 = "training.micro_batch_size=4"  # global 16 over 2 ranks: 2 accumulated micro-batches per step
DP3 = ["training.global_batch_size=6", "training.micro_batch_size=2"]
# Short sequences keep the runs fast; a small reduce bucket keeps DeepSpeed's bucket buffers small on CPU (and
# makes ZeRO-1/2 reduce in several buckets).
COMMON = ["data.seq_len=16", "parallel.deepspeed.reduce_bucket_size=200000"]

CASES_DP2 = {
    "zero0_fp32": ("tiny_zero0", []),
    "zero0_bf16": ("tiny_zero0", [BF16]),
    "zero1_fp32": ("tiny_zero1", []),
    "zero1_bf16_odd": ("tiny_zero1", [BF16, *ODD]),
    "zero2_bf16_odd": ("tiny_zero2", [BF16, *ODD]),
    "zero2_bf16_offload": ("tiny_zero2", [BF16, "parallel.offload_optimizer=cpu"]),
    "zero3_bf16": ("tiny_zero3", [BF16, MIX]),
    "zero3_fp32_all_persistent": ("tiny_zero3", []),  # default threshold 1e5: every tiny-4l parameter persists
    "zero3_bf16_offload_optimizer": ("tiny_zero3_offload", [BF16, MIX, "parallel.offload_params=none"]),
    "zero3_bf16_offload_both": ("tiny_zero3_offload", [BF16, MIX]),
    "zero0_bf16_accum2": ("tiny_zero0", [BF16, ACCUM2]),
    "zero1_bf16_odd_accum2": ("tiny_zero1", [BF16, *ODD, ACCUM2]),
    "zero2_bf16_odd_accum2": ("tiny_zero2", [BF16, *ODD, ACCUM2]),
    "zero1_bf16_offload_accum2": ("tiny_zero1", [BF16, "parallel.offload_optimizer=cpu", ACCUM2]),
    "zero2_bf16_offload_odd_accum2": ("tiny_zero2", [BF16, *ODD, "parallel.offload_optimizer=cpu", ACCUM2]),
    "zero3_bf16_accum2": ("tiny_zero3", [BF16, MIX, ACCUM2]),
    "zero3_bf16_offload_both_accum2": ("tiny_zero3_offload", [BF16, MIX, ACCUM2]),
}
CASES_DP3 = {
    "zero2_bf16_odd_dp3": ("tiny_zero2", [BF16, *ODD, *DP3]),
    "zero3_bf16_odd_dp3": ("tiny_zero3", [BF16, *ODD, *DP3, MIX.replace("10000", "1000")]),  # norms, k, v persist
}
KINDS = ("weights", "grads", "master", "moments")


# ---- the worker (runs under torchrun) ---------------------------------------------------------------------------

class Ledger:
    """Bytes by kind; a storage is counted once, under the first kind that claims it."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()
        self.bytes = dict.fromkeys((*KINDS, "persistent"), 0)

    def add(self, kind: str, t) -> None:
        if t is None or t.numel() == 0:
            return
        s = t.untyped_storage()
        key = (str(t.device), s.data_ptr())
        if key not in self.seen:
            self.seen.add(key)
            self.bytes[kind] += s.nbytes()  # the whole allocation: padding and straddling included


def _masters(opt) -> list:
    """The fp32 tensors each wrapper hands its inner optimizer: FP16_Optimizer / FP16_UnfusedOptimizer groups,
    ZeRO-1/2 partitions, ZeRO-3 sub-group partitions; none for a bare optimizer (fp32 ZeRO-0)."""
    out = []
    for attr in ("fp32_groups_flat", "fp32_groups", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for item in getattr(opt, attr, []) or []:
            out += item if isinstance(item, list) else [item]
    return out


def count_states(engine) -> dict[str, int]:
    opt, params = engine.optimizer, list(engine.module.parameters())
    inner = getattr(opt, "optimizer", opt)
    led = Ledger()
    for p in params:  # ZeRO-3 partitions first, so a persistent parameter's whole copy counts apart
        led.add("weights", getattr(p, "ds_tensor", None))
    for p in params:
        led.add("persistent" if hasattr(p, "ds_tensor") else "weights", p.data)
    masters = _masters(opt)
    for m in masters:
        led.add("master", m)
    stepped = {(str(k.device), k.untyped_storage().data_ptr()) for k in inner.state}
    assert stepped <= led.seen, "the inner optimizer steps a tensor that is neither a weight nor a master"
    for st in inner.state.values():
        led.add("moments", st.get("exp_avg"))
        led.add("moments", st.get("exp_avg_sq"))
    for t in [*params, *masters]:
        led.add("grads", t.grad)
    for store in ("averaged_gradients", "all_grad_tensors"):  # ZeRO-1/2: views of grads_in_partition + pads
        for group in getattr(opt, store, {}).values():
            for g in group or []:
                led.add("grads", g)
    for g in getattr(opt, "accumulated_grads_in_cpu", {}).values():  # ZeRO-1/2 offload, accumulating
        led.add("grads", g)
    led.add("grads", getattr(opt, "grad_partitions_flat_buffer", None))  # ZeRO-3
    out = dict(led.bytes)
    out["weights"] += out["persistent"]
    return out


def run_case(info, recipe: str, overrides: list[str]) -> dict:
    import torch
    from transformers import AutoTokenizer

    from toolkit.recipe import load_recipe, resolve
    from toolkit.train.ds_backend import DeepSpeedBackend

    r = load_recipe(recipe, overrides)
    plan = resolve(r, info.world_size)
    backend = DeepSpeedBackend(plan, info, AutoTokenizer.from_pretrained(r.data.tokenizer))
    engine, gen = backend.engine, torch.Generator().manual_seed(info.rank)

    def forward_backward():
        ids = torch.randint(0, r.model.vocab_size, (plan.batch.micro_batch, r.data.seq_len), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)

    accum = plan.batch.grad_accum
    for _ in range(accum):  # one optimizer step: Adam allocates its moments
        forward_backward()
        engine.step()       # (a no-op between accumulation boundaries)
    grads = []
    for micro in range(accum):  # step 2: count after each backward, where gradients rest between micro-batches
        forward_backward()
        counted = count_states(engine)
        grads.append(counted["grads"])
        if micro < accum - 1:
            engine.step()
    counted = {"optimizer": type(engine.optimizer).__name__, **counted, "grads": max(grads), "grads_seen": grads}
    engine.destroy()
    return counted


def worker(cases_json: str, out_dir: str) -> None:
    from toolkit.train.dist import init_distributed, shutdown

    info = init_distributed()
    results = {}
    for name, (recipe, overrides) in json.loads(Path(cases_json).read_text()).items():
        results[name] = run_case(info, recipe, overrides)
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(results))
    shutdown()


# ---- the tests --------------------------------------------------------------------------------------------------

def _launch(cases: dict, nproc: int, tmp: Path) -> list[dict]:
    from conftest import run_ranks

    spec = tmp / "cases.json"
    spec.write_text(json.dumps({k: (rec, [*COMMON, *ov]) for k, (rec, ov) in cases.items()}))
    start = time.monotonic()
    proc = run_ranks([__file__, str(spec), str(tmp)], nproc, dict(os.environ))
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    print(f"{len(cases)} cases on {nproc} ranks: {time.monotonic() - start:.0f} s")
    return [json.loads((tmp / f"rank{k}.json").read_text()) for k in range(nproc)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[tuple[str, int], list[dict]]:
    """(case, dp) -> per-rank counts, from one torchrun launch per world size."""
    out = {}
    for cases, nproc in ((CASES_DP2, 2), (CASES_DP3, 3)):
        per_rank = _launch(cases, nproc, tmp_path_factory.mktemp(f"dp{nproc}"))
        out.update({(name, nproc): [ranks[name] for ranks in per_rank] for name in cases})
    return out


def _recipe(name: str):
    from toolkit.recipe import load_recipe

    recipe, overrides = {**CASES_DP2, **CASES_DP3}[name]
    return load_recipe(recipe, [*COMMON, *overrides])


@pytest.mark.slow
@pytest.mark.parametrize("name,dp", [(n, 2) for n in CASES_DP2] + [(n, 3) for n in CASES_DP3])
def test_state_bytes_match_what_deepspeed_allocates(name, dp, measured):
    from toolkit.plan.deepspeed_states import deepspeed_buffer_bytes, deepspeed_state_bytes

    r = _recipe(name)
    for rank, got in enumerate(measured[(name, dp)]):
        want = deepspeed_state_bytes(r, dp, rank)
        table = {k: (got[k], getattr(want, k)) for k in KINDS}
        print(f"{name} rank {rank} ({got['optimizer']}): measured vs computed {table}; grads after each "
              f"micro-batch {got['grads_seen']}")
        if r.parallel.offload_params != "none":
            # the persistent parameters stay whole on the GPU while the partitions live on the CPU: StateBytes
            # holds the partitions (placement cpu), the GPU copies are the exact 'zero3_persistent_params' buffer
            assert got["persistent"] == deepspeed_buffer_bytes(r, dp)["zero3_persistent_params"]
            got = {**got, "weights": got["weights"] - got["persistent"]}
        # ZeRO-1 + offload, accumulating: the full .grad on the GPU plus the fp32 partition on the CPU
        got = {**got, "grads": got["grads"] - deepspeed_buffer_bytes(r, dp).get("zero1_accumulated_grads", 0)}
        assert {k: got[k] for k in KINDS} == {k: getattr(want, k) for k in KINDS}, f"{name} rank {rank}"
    assert deepspeed_state_bytes(r, dp).total == max(deepspeed_state_bytes(r, dp, k).total for k in range(dp))


@pytest.mark.slow
def test_zero12_ranks_really_differ(measured):
    """The odd shape makes ZeRO-1/2 ranks keep different gradient amounts, so the per-rank rule is exercised."""
    for name, dp in (("zero2_bf16_odd", 2), ("zero2_bf16_odd_dp3", 3)):
        assert len({rank["grads"] for rank in measured[(name, dp)]}) > 1, name


def test_parameter_list_matches_hugging_face():
    """llama_params is what transformers builds (shapes and order), tied and untied, GQA and not."""
    import torch
    from transformers import LlamaForCausalLM

    from toolkit.model import to_hf_config
    from toolkit.plan.deepspeed_states import llama_params
    from toolkit.recipe import load_recipe
    from toolkit.metrics import count_params

    for overrides in ([], ODD, ["model.preset=llama2-70b"]):
        m = load_recipe("tiny_zero0", overrides).model
        with torch.device("meta"):
            model = LlamaForCausalLM(to_hf_config(m))
        assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == llama_params(m)
        assert sum(p.numel() for p in model.parameters()) == count_params(m)["total"]


def test_seventy_billion_is_instant():
    from toolkit.plan.deepspeed_states import deepspeed_buffer_bytes, deepspeed_state_bytes
    from toolkit.recipe import load_recipe

    start = time.perf_counter()
    for stage, off in ((0, "none"), (1, "cpu"), (2, "none"), (3, "none"), (3, "cpu")):
        r = load_recipe("tiny_zero0", ["model.preset=llama2-70b", BF16, f"parallel.zero_stage={stage}",
                                       f"parallel.offload_optimizer={off}", "training.grad_accum_steps=4",
                                       "training.global_batch_size=null"])
        s = deepspeed_state_bytes(r, 64)
        assert s.total > 0 and s.notes and deepspeed_buffer_bytes(r, 64)
    assert time.perf_counter() - start < 2.0


def test_relation_to_deepspeeds_own_estimators():
    """llama2-7b, bf16, 8 GPUs, against estimate_zero{2,3}_model_states_mem_needs (the numbers the *_all_cold
    helpers print), per GPU:

    ZeRO-2: theirs = 2 P + 18 P/8, counting 4 bytes/param of fp32 gradient partition and 2 of 16-bit gradient
    partition. DeepSpeed keeps the fp32 gradient only inside the step (ours: a transient buffer), and the 16-bit
    one is not P/8 but the whole gradient of every parameter overlapping the rank's partition (the embedding
    straddles). So theirs - ours = 4 P/8 - (our grads - 2 P/8).
    ZeRO-2 + CPU offload: theirs GPU = 2 P, ours GPU = the 16-bit weights: equal (P needs no padding here).
    ZeRO-3: theirs = 4 x largest layer + 18 P/8 = 2 (16-bit partition) + 4 (master) + 8 (Adam) + 4 (fp32 grads).
    Ours adds the bf16 gradient-partition buffer DeepSpeed keeps for the whole run (2 bytes/param) and the
    persistent parameters whole, and has no persistent fp32 gradient. So theirs = ours.weights - persistent +
    2 x master (their fp32 grads are master-sized) + moments + 4 x largest layer; exact here because 8 divides
    every llama2-7b parameter (otherwise ours is larger by the ceil(numel/dp) padding)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from toolkit.plan.deepspeed_states import deepspeed_buffer_bytes, deepspeed_state_bytes, llama_params
    from toolkit.plan.types import GPU
    from toolkit.recipe import load_recipe
    from toolkit.metrics import count_params

    def recipe(stage, off="none"):
        return load_recipe("tiny_zero0", ["model.preset=llama2-7b", BF16, f"parallel.zero_stage={stage}",
                                          f"parallel.offload_optimizer={off}", "training.global_batch_size=null"])

    gpus, r2 = 8, recipe(2)
    p = count_params(r2.model)["total"]
    ours = deepspeed_state_bytes(r2, gpus)
    _, theirs = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=gpus, cpu_offload=False)
    assert theirs - ours.total == 4 * p // gpus - (ours.grads - 2 * p // gpus)
    _, theirs = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=gpus, cpu_offload=True)
    assert theirs == deepspeed_state_bytes(recipe(2, "cpu"), gpus).on(GPU)

    r3 = recipe(3)
    largest = r3.model.vocab_size * r3.model.hidden_size
    ours = deepspeed_state_bytes(r3, gpus)
    _, theirs, _ = estimate_zero3_model_states_mem_needs(p, largest, num_gpus_per_node=gpus, cpu_offload=False,
                                                         cpu_offload_params=False)
    threshold = r3.parallel.deepspeed.stage3_param_persistence_threshold
    persistent = 2 * sum(n for n in (math.prod(s) for _, s in llama_params(r3.model)) if n <= threshold)
    assert theirs == ours.weights - persistent + 2 * ours.master + ours.moments + 4 * largest
    assert deepspeed_buffer_bytes(r3, gpus)["largest_gather"] == 4 * largest  # their gathered-layer allowance


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
