"""A mixture of experts (Qwen3-MoE) in the checkpoints Megatron-Core's own code writes, from one 2-rank launch of
tests/megatron_moe_writer.py with real GPTModels: weights at EP2 in Megatron-LM's legacy layout and torch_dist, both
ways; and the distributed optimizer's flat state (Megatron-LM's distrib_optim.pt and its default torch_dist format,
dp_reshardable) at EP1 and EP2, where Megatron-Core chains a second optimizer for the experts. The Megatron backend's
own default format for that state (distopt_*.pt, the same save_parameter_state files) is checked on a real EP2 run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, launch, run_ranks
from safetensors.torch import load_file
from test_megatron_native import NO_TORCH
from test_moe import moe  # noqa: F401  (the module-scoped fixture: a tiny Qwen3-MoE as transformers saves it)

from toolkit.checkpoint.convert import convert
from toolkit.checkpoint.inspect import inspect
from toolkit.errors import ToolkitError
from toolkit.format import safetensors_stream as st

VOCAB = 500
QUIET = {"progress": False, "log": lambda *_: None}


@pytest.fixture(scope="module")
def native(moe, tmp_path_factory):  # noqa: F811
    """The writer's launch: it writes OUT/legacy (weights at EP2), OUT/legacy_distopt_ep2, OUT/dp_reshardable_ep1 and
    OUT/dp_reshardable_ep2 (the distributed optimizer's flat state after two bf16 Adam steps) and OUT/legacy_plain_ep2
    (the plain optimizer's), each with live.safetensors (the live optimizer's state by name), then loads what
    `toolkit convert` wrote (--to torch_dist, --to megatron_lm --ep 2) with Megatron-Core's own code."""
    folder, _, _ = moe
    root = tmp_path_factory.mktemp("moe_native")
    td = convert(folder, root / "td", "torch_dist", **QUIET)
    lm = convert(folder, root / "lm", "megatron_lm", ep=2, **QUIET)
    proc = run_ranks(["tests/megatron_moe_writer.py", str(folder), str(root / "native"), str(td / "iter_0000000"),
                      str(lm)], 2, dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"root": root / "native", "stdout": proc.stdout, "lm": lm}


@pytest.mark.slow
def test_megatron_lm_moe_checkpoints_both_ways_against_megatron_core(moe, native, tmp_path):  # noqa: F811
    """- a Megatron-LM legacy checkpoint written from Megatron-Core's own state dicts at EP2 (mp_rank_00_000 and
      mp_rank_00_001, each its own 2 experts, args with Megatron-LM's MoE arguments) converts to Hugging Face bit for
      bit, and to the legacy layout at TP2 x EP2 and back;
    - what `toolkit convert --to torch_dist` writes loads with Megatron-Core's dist_checkpointing.load at EP2 and at
      EP1 x DP2, and what `--to megatron_lm --ep 2` writes loads into EP2 GPTModels with strict=True, every weight
      equal to what the HF mapping gives."""
    _, _, disk = moe
    assert sorted(p.name for p in (native["lm"] / "iter_0000000").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    for line in ("loaded 1x1x1x2", "loaded 1x1x1", "loaded legacy 1x1x1x2"):
        assert line in native["stdout"].splitlines(), (line, native["stdout"][-2000:])
    legacy = native["root"] / "legacy"
    report = inspect(legacy)
    assert report["complete"] and report["layout"] == {"tp": 1, "pp": 1, "vpp": 1, "ep": 2}, report
    assert report["architecture"]["num_experts"] == 4
    back = convert(legacy, tmp_path / "back", "hf", vocab_size=VOCAB, **QUIET)
    got = load_file(str(back / "model.safetensors"))
    assert set(got) == set(disk) and all(torch.equal(got[k], disk[k]) for k in disk)
    wide = convert(legacy, tmp_path / "wide", "megatron_lm", tp=2, ep=2, vocab_size=VOCAB, **QUIET)
    again = load_file(str(convert(wide, tmp_path / "again", "hf", vocab_size=VOCAB, **QUIET) / "model.safetensors"))
    assert all(torch.equal(again[k], disk[k]) for k in disk)


@pytest.mark.slow
def test_moe_checkpoints_convert_without_torch_as_the_full_path_does(native, tmp_path):
    """`--no-verify` to Hugging Face reads Megatron-Core's expert-parallel files without torch
    (toolkit/checkpoint/pickled_copy.py): the legacy layout at EP2 (each rank file its own experts) and torch_dist
    with the experts stacked by global index (EP2, with the distributed optimizer's state, not carried to Hugging
    Face); byte for byte what the verified full path writes."""
    kinds = ["legacy", "dp_reshardable_ep2"]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, str(tmp_path / "fast"),
                           *[x for k in kinds for x in (str(native["root"] / k), k)]], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("RESULT ", 1)[1]) == {"codes": [0, 0], "loaded": []}, proc.stderr
    assert proc.stdout.count("file to file, torch-free") == len(kinds), proc.stdout
    for k in kinds:
        full = convert(native["root"] / k, tmp_path / "full" / k, "hf", vocab_size=VOCAB, **QUIET)
        assert {p.name: p.read_bytes() for p in full.iterdir()} == {
            p.name: p.read_bytes() for p in (tmp_path / "fast" / k).iterdir()}, k


def _by_name(tag) -> tuple[dict, dict]:
    tensors, meta = st.load(tag / "optim_tp00_pp000.safetensors")
    assert all(k.startswith("chunk0.") for k in tensors)
    return {k.removeprefix("chunk0."): v for k, v in tensors.items()}, meta


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["legacy_distopt_ep2", "dp_reshardable_ep1", "dp_reshardable_ep2",
                                  "legacy_plain_ep2"])
def test_moe_optimizer_state_converts_by_name(kind, native, tmp_path):
    """A mixture of experts' optimizer state converts with the weights. At EP2 Megatron-Core gives the routed experts
    a second, chained optimizer (over the expert-data-parallel group) and, with the distributed optimizer, buffers of
    their own: Megatron-LM's distrib_optim.pt then holds the two optimizers' flat states (the dense one only in
    expert-parallel rank 0's file), and its default torch_dist format their buffers under `chained_0.` and
    `chained_1.` with one dp_group_idx per expert-parallel rank; the plain optimizer's model_optim_rng.pt holds the two
    state dicts, keyed by position. At EP1 the experts share the dense buffers. Converted to EP1, every parameter's
    exp_avg, exp_avg_sq and fp32 main weights equal the live optimizer's, by name, each expert's under its global
    index, and the step is kept."""
    got, meta = _by_name(convert(native["root"] / kind, tmp_path / "one", "megatron", ep=1, vocab_size=VOCAB,
                                 **QUIET) / "step_00000002")
    assert meta["step"] == "2"
    live = load_file(str(native["root"] / kind / "live.safetensors"))
    assert set(got) == set(live) and sum(".local_experts." in k for k in live) == 2 * 4 * 2 * 3
    items = list(live.items())
    for i, (k, want) in enumerate(items):
        rows = VOCAB if k.startswith(("embedding.", "output_layer.")) else None  # vocabulary padding is dropped
        assert torch.equal(got[k][:rows], want[:rows]), k
        assert not any(want.shape == y.shape and torch.equal(want, y) for _, y in items[i + 1:]), k  # swaps would show


@pytest.mark.slow
def test_moe_optimizer_state_that_does_not_fit_is_refused(native, tmp_path):
    """Where each expert-parallel rank's experts lie is proved, not assumed: with the two ranks' expert states swapped
    in distrib_optim.pt (the buffers fit, the experts are another rank's), and in model_optim_rng.pt (the plain
    optimizer's), the first expert read fails the check of its fp32 main weights against its saved weights; a file
    holding only the dense optimizer's state is refused by name. Each in one line (or the checks' heading, its one
    problem and the fix); none writes anything, and --weights-only still converts the weights."""
    src = tmp_path / "src"
    shutil.copytree(native["root"] / "legacy_distopt_ep2", src)
    files = [src / "iter_0000002" / f"mp_rank_00_00{e}" / "distrib_optim.pt" for e in (0, 1)]
    states = [torch.load(f, weights_only=True) for f in files]
    torch.save([states[0][0], states[1][1]], files[0])
    torch.save([None, states[0][1]], files[1])
    errors = []
    swapped = r"do not line up with the weights at decoder\.layers\.\d\.mlp\.experts"
    with pytest.raises(ToolkitError, match=swapped) as e:
        convert(src, tmp_path / "out", "megatron", ep=1, vocab_size=VOCAB, **QUIET)
    errors.append(e.value)
    torch.save([states[0][0]], files[0])
    with pytest.raises(ToolkitError, match=r"mp_rank_00_000/distrib_optim\.pt: is not the coalesced per-chunk buffers"
                       r" .* for its 2 chained optimizers") as e:
        convert(src, tmp_path / "out", "megatron", ep=1, vocab_size=VOCAB, **QUIET)
    errors.append(e.value)
    weights = convert(src, tmp_path / "weights", "megatron", ep=1, weights_only=True, vocab_size=VOCAB, **QUIET)
    assert not list((weights / "step_00000002").glob("optim_*"))
    plain = tmp_path / "plain"
    shutil.copytree(native["root"] / "legacy_plain_ep2", plain)
    files = [plain / "iter_0000002" / f"mp_rank_00_00{e}" / "model_optim_rng.pt" for e in (0, 1)]
    states = [torch.load(f, weights_only=False) for f in files]  # files this test copied from the writer's
    experts = [s["optimizer"][1] for s in states]
    for s, other in zip(states, reversed(experts)):
        s["optimizer"][1] = other
    for f, s in zip(files, states):
        torch.save(s, f)
    with pytest.raises(ToolkitError, match=r"plain optimizer's state does not line up with the weights at "
                       r"decoder\.layers\.\d\.mlp\.experts") as e:
        convert(plain, tmp_path / "out", "megatron", ep=1, vocab_size=VOCAB, **QUIET)
    errors.append(e.value)
    assert all(len(str(x).splitlines()) <= 3 for x in errors), errors
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_moe_run_distributed_optimizer_state_in_the_default_format_converts_by_name(tmp_path):
    """The Megatron backend's default format keeps an EP2 run's distributed-optimizer state as Megatron's own
    save_parameter_state files (distopt_tp00_pp000_ep00E.pt: the dense optimizer's buffers in the first, each rank's
    experts' in its own). Converted to EP1, and to TP2 x EP2, it equals, bit for bit, what the same run saved in the
    torch_dist format gives (fully_reshardable, per parameter by name; a different reader): every exp_avg, exp_avg_sq
    and fp32 main weight, experts included, and the step."""
    sets = ["training.steps=2", "training.schedule.warmup_steps=1", "checkpoint.interval=2", "training.precision=bf16",
            "parallel.zero_stage=1", "logging.sample_prompt=null"]
    got = {}
    for fmt, extra in (("default", ()), ("torch_dist", ("checkpoint.format=torch_dist",))):
        launch("tiny_qwen3_moe", [*sets, *extra], nproc=2, out_dir=tmp_path / fmt)
        tag = tmp_path / fmt / "checkpoints" / "step_00000002"
        if fmt == "default":
            assert {f"distopt_tp00_pp000_ep00{e}.pt" for e in (0, 1)} <= {p.name for p in tag.glob("*.pt")}
        for name, layout in (("ep1", {"ep": 1}), ("tp2_ep2", {"tp": 2, "ep": 2})):
            out = convert(tag, tmp_path / f"{fmt}_{name}", "megatron", **layout, **QUIET) / "step_00000002"
            got[(fmt, name)] = {p.name: st.load(p) for p in out.glob("optim_*.safetensors")}
    for name in ("ep1", "tp2_ep2"):
        flat, by_name = got[("default", name)], got[("torch_dist", name)]
        assert set(flat) == set(by_name) and len(flat) == (1 if name == "ep1" else 4)
        for f, (tensors, meta) in by_name.items():
            assert set(flat[f][0]) == set(tensors) and flat[f][1]["step"] == meta["step"] == "2"
            assert any(".local_experts." in k for k in tensors)
            for k in tensors:
                assert torch.equal(flat[f][0][k], tensors[k]), (f, k)


@pytest.mark.slow
def test_moe_optimizer_state_written_loads_in_megatron_core(moe, native, tmp_path):  # noqa: F811
    """`--to megatron_lm` writes a mixture of experts' optimizer state at any EP, from Megatron-LM's files of either
    optimizer and of either EP: at EP2 Megatron-Core's two chained optimizers (the dense one and the experts') load
    each expert-parallel rank's model_optim_rng.pt state dicts (and distrib_optim.pt states), at EP1 x DP2 its single
    one (tests/megatron_legacy_optim_probe.py), with every moment and fp32 main weight equal to the live optimizer's
    the source was saved from, by name, the step kept and the scheduler loaded. From an EP1 source the experts'
    param groups are made from the dense ones. `--to torch_dist --ep N` writes the state for a run at EP N:
    dist_checkpointing.load and the optimizers' load_state_dict take it at that EP, equal to the live state too."""
    folder = moe[0]
    specs = []
    for kind, eps in (("legacy_distopt_ep2", (2, 1)), ("legacy_plain_ep2", (2, 1)), ("dp_reshardable_ep1", (2,))):
        for ep in eps:
            for to in ("megatron_lm", "torch_dist"):
                out = convert(native["root"] / kind, tmp_path / f"{kind}_{to}{ep}", to, ep=ep, vocab_size=VOCAB,
                              **QUIET)
                specs.append(f"{out},{folder},{native['root'] / kind / 'live.safetensors'},bf16,1x1x1x{ep}")
    proc = run_ranks(["tests/megatron_legacy_optim_probe.py", *specs], 2, dict(os.environ), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for spec in specs:
        name, ep = spec.split(",")[0].rsplit("/", 1)[1], spec[-1]
        kind = "torch_dist " if "torch_dist" in name else "legacy plain " if "plain" in name else "legacy "
        assert f"loaded {kind}optim {name} 1x1x1{'x2' if ep == '2' else ''}" in proc.stdout, (name, proc.stdout[-2000:])
