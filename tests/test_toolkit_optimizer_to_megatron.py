"""A toolkit run's optimizer state written into Megatron-LM's formats (`--to megatron_lm`, `--to torch_dist`): the
param groups the run saved, the state by name, and a scheduler state made from the recipe's schedule. Megatron-Core's
own optimizers load it with every moment and main weight equal to the run's, by name, and Megatron-Core's own
OptimizerParamScheduler continues the recipe's learning rate from it."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import REPO, UNINTERRUPTED, launch, run_ranks
from safetensors.torch import load_file, save_file

from toolkit.adapters.megatron import scheduler_state
from toolkit.checkpoint.convert import convert
from toolkit.recipe.loader import load_recipe
from toolkit.train.schedule import lr_multiplier


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_scheduler_state_continues_the_recipes_learning_rate_in_megatron_core(decay):
    """Loaded into Megatron-Core's OptimizerParamScheduler (as `--use-checkpoint-opt_param-scheduler` loads it) after
    each step of a 12-step run, the scheduler sets the learning rate the toolkit's next step would use (the same
    after the warm-up, one step behind in it: Megatron-LM's first iteration runs at lr 0) and the recipe's weight
    decay, times each group's wd_mult."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    r = load_recipe("tiny_zero0", ["training.steps=12", "training.schedule.warmup_steps=3",
                                   "training.global_batch_size=4", "training.micro_batch_size=2",
                                   f"training.schedule.decay={decay}"])
    t = r.training
    for step in range(t.steps):
        weights, norms = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.AdamW([{"params": [weights], "wd_mult": 1.0}, {"params": [norms], "wd_mult": 0.0}])
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=1,
                                        lr_decay_steps=2, lr_decay_style="linear", start_wd=0.5, end_wd=0.5,
                                        wd_incr_steps=1, wd_incr_style="constant",
                                        use_checkpoint_opt_param_scheduler=True)
        sched.load_state_dict(scheduler_state(r, step))
        want = t.optimizer.lr * lr_multiplier(step, 3, t.steps, decay, t.schedule.min_lr / t.optimizer.lr)
        if step < 3:
            want = t.optimizer.lr * step / 3
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), step
        sched.step(increment=0)  # the loaded weight decay applies from the next step() (Megatron-Core sets it after)
        assert [g["weight_decay"] for g in opt.param_groups] == [t.optimizer.weight_decay, 0.0]
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), step


@pytest.mark.slow
@pytest.mark.parametrize("recipe,fmt", [("tiny_tp2", "toolkit"), ("tiny_tp2", "torch_dist"),
                                        ("tiny_dp2_distopt", "toolkit")])
def test_toolkit_run_optimizer_state_loads_in_megatron_core(recipe, fmt, tmp_path):
    """Two bf16 steps of the Megatron backend (TP2 with the plain optimizer, saved in the toolkit's format and in
    checkpoint.format: torch_dist; DP2 with the distributed one), then
    --to megatron_lm at TP1 x PP2 and --to torch_dist: Megatron-Core's own optimizer loads each (the legacy files as
    Megatron-LM's load_checkpoint does, at the layout written; torch_dist through dist_checkpointing.load at TP2)
    with every Adam moment and fp32 main weight equal to the run's (its state converted to TP1, by name), the step
    kept, and the scheduler at the run's 2 steps of 2 samples (tests/megatron_legacy_optim_probe.py)."""
    launch(recipe, ["training.steps=2", "training.global_batch_size=2", "training.micro_batch_size=1",
                    "training.precision=bf16", f"checkpoint.format={fmt}", *UNINTERRUPTED], nproc=2,
           out_dir=tmp_path / "run")
    ckpt, quiet = tmp_path / "run" / "checkpoints", dict(progress=False, log=lambda *_: None)
    hf = convert(ckpt, tmp_path / "hf", "hf", **quiet)
    tp1 = convert(ckpt, tmp_path / "tp1", "megatron", tp=1, **quiet)
    live = tmp_path / "live.safetensors"  # the run's state by local-spec name at TP1 (chunk0.NAME:FIELD -> NAME:FIELD)
    save_file({k.split(".", 1)[1]: v for k, v in load_file(tp1 / "step_00000002" / "optim_tp00_pp000.safetensors")
               .items()}, live)
    lines = []
    lm = convert(ckpt, tmp_path / "lm", "megatron_lm", tp=1, pp=2, progress=False, log=lines.append)
    td = convert(ckpt, tmp_path / "td", "torch_dist", tp=1, pp=2, progress=False, log=lines.append)
    assert not any("weights only" in line for line in lines), lines
    distributed = recipe == "tiny_dp2_distopt"
    dist_flag = " --use-distributed-optimizer" if distributed else ""
    dist_flag += " --use-checkpoint-opt_param-scheduler"  # the recipe's schedule, not Megatron-LM's arguments
    assert f"to continue in Megatron-LM: --load {lm} --ckpt-format torch --transformer-impl local{dist_flag} " \
           "--no-load-rng" in lines, lines
    assert f"to continue in Megatron-LM: --load {td} --ckpt-format torch_dist{dist_flag}" in lines, lines
    assert bool(list(lm.rglob("distrib_optim.pt"))) == distributed
    # what Megatron-LM's load_checkpoint (and Megatron-Bridge's) read before they load a torch_dist checkpoint: the
    # content metadata its save stores (else a distributed optimizer's state is taken for dp_zero_gather_scatter), and
    # args saying there is optimizer state and no RNG state (else it asks for an rng_state the files do not have)
    from megatron.core.dist_checkpointing import load_content_metadata

    from toolkit.format import safe_load

    want = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            **({"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": False} if distributed else {})}
    it_dir = next(td.glob("iter_*"))
    with safe_load.weights_only_everywhere(it_dir):
        assert load_content_metadata(str(it_dir)) == want
    args = safe_load.load(it_dir / "common.pt")["args"]
    assert (args.no_save_rng, args.no_save_optim, args.use_distributed_optimizer) == (True, False, distributed)
    assert args.consumed_train_samples == 2 * 2  # where Megatron-LM's data continues: 2 steps of 2 samples
    legacy_args = safe_load.load(next(lm.glob("iter_*/mp_rank_*/model_optim_rng.pt")))["args"]
    assert (legacy_args.no_save_rng, legacy_args.no_save_optim, legacy_args.consumed_train_samples) == (True, False, 4)
    if fmt == "torch_dist":  # the run's own save: the same metadata, the RNG kept in the toolkit's own files
        saved = ckpt / "step_00000002"
        with safe_load.weights_only_everywhere(saved):
            assert load_content_metadata(str(saved)) == want
        assert safe_load.load(saved / "common.pt")["args"].no_save_rng is True
    specs = [f"{lm},{hf},{live},bf16,1x2x1,checkpoint", f"{td},{hf},{live},bf16,2x1x1,checkpoint"]
    proc = run_ranks([str(REPO / "tests" / "megatron_legacy_optim_probe.py"), *specs], 2, dict(os.environ),
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"loaded {'legacy' if distributed else 'legacy plain'} optim lm 1x2x1" in proc.stdout, proc.stdout[-2000:]
    assert "loaded torch_dist optim td 2x1x1" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_toolkit_moe_run_optimizer_state_loads_in_megatron_core(tmp_path):
    """A mixture of experts at EP2 with the distributed optimizer (Megatron-Core chains the experts' own optimizer
    after the dense one), two bf16 steps, then --to megatron_lm at EP2 and at EP1: Megatron-Core's own optimizers load
    each (the two chained ones at EP2, from each expert-parallel rank's files; one at EP1 x DP2) with every Adam moment
    and fp32 main weight equal to the run's by name, experts included, the step kept and the scheduler at the run's 2
    steps of 2 samples. --to torch_dist --ep 2 and --ep 1 write its state for a run at that EP: Megatron-Core's
    dist_checkpointing.load and the optimizers' load_state_dict take each at its EP, equal to the run's as well."""
    launch("tiny_qwen3_moe", ["training.steps=2", "training.global_batch_size=2", "training.micro_batch_size=1",
                              "training.precision=bf16", "parallel.zero_stage=1", *UNINTERRUPTED], nproc=2,
           out_dir=tmp_path / "run")
    ckpt, quiet = tmp_path / "run" / "checkpoints", dict(progress=False, log=lambda *_: None)
    hf = convert(ckpt, tmp_path / "hf", "hf", **quiet)
    ep1 = convert(ckpt, tmp_path / "ep1", "megatron", ep=1, **quiet)
    live = tmp_path / "live.safetensors"  # the run's state by local-spec name at EP1 (experts by global index)
    save_file({k.split(".", 1)[1]: v for k, v in load_file(ep1 / "step_00000002" / "optim_tp00_pp000.safetensors")
               .items()}, live)
    assert sum(".local_experts." in k for k in load_file(live)) == 2 * 4 * 2 * 3
    lines = []
    specs = []
    for ep in (2, 1):
        lm = convert(ckpt, tmp_path / f"lm{ep}", "megatron_lm", ep=ep, progress=False, log=lines.append)
        assert len(list(lm.rglob("distrib_optim.pt"))) == ep
        specs.append(f"{lm},{hf},{live},bf16,1x1x1x{ep},checkpoint")
    for ep in (2, 1):
        td = convert(ckpt, tmp_path / f"td{ep}", "torch_dist", ep=ep, progress=False, log=lines.append)
        specs.append(f"{td},{hf},{live},bf16,1x1x1x{ep},checkpoint")
    assert not any("weights only" in line for line in lines), lines
    proc = run_ranks([str(REPO / "tests" / "megatron_legacy_optim_probe.py"), *specs], 2, dict(os.environ),
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for line in ("loaded legacy optim lm2 1x1x1x2", "loaded legacy optim lm1 1x1x1",
                 "loaded torch_dist optim td2 1x1x1x2", "loaded torch_dist optim td1 1x1x1"):
        assert line in proc.stdout, (line, proc.stdout[-2000:])
