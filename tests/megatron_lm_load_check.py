"""By hand, not collected by pytest: Megatron-LM's own `load_checkpoint` on what `toolkit convert` writes.

Megatron-LM's `megatron.training` is in no package the test machines can install (the megatron-core wheel and sdist
leave it out), so CI cannot run this. With a source checkout of Megatron-LM at the tag matching the pinned
megatron-core, on a CPU machine:

    git clone --depth 1 --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/megatron-lm
    pip install --target /tmp/mlm-deps six && pip install --no-deps --target /tmp/mlm-deps triton
    python tests/megatron_lm_load_check.py --megatron-lm /tmp/megatron-lm --deps /tmp/mlm-deps --work /tmp/mlm-check

(`six` and `triton` are imported by `megatron.training` and not by megatron-core; a CUDA build of torch brings triton.)
It makes a tiny Llama and converts it `--to torch_dist --tp 2` and `--to megatron_lm --tp 2`. It trains four runs
of 6 steps, checkpointing at step 4: `tiny_tp2` (plain optimizer), `tiny_dp2_distopt` (the distributed optimizer at
DP2) in fp32 and in bf16, and `tiny_tp2_pp2`, and converts each step 4 with its optimizer state: at TP2, at DP2, and
at TP1 x PP2 and TP1 x PP2 x VPP2 (other layouts than the run's), to both formats (the fp32 distributed optimizer to
torch_dist only: RUNS says why); one torch_dist output written at TP2 is loaded at TP1 x DP2 (Megatron-Core's
resharding load). For each of the twelve outputs it starts 2 gloo ranks that set
Megatron-LM's arguments from the model's config plus exactly the flags `toolkit convert` printed ("to continue in
Megatron-LM: ..."), build model, optimizer and scheduler with Megatron-LM's own functions, and call
`megatron.training.checkpointing.load_checkpoint`. Then, per output:
- in fp32 without pipeline stages, the loaded model's logits against transformers' for the converted model (in this
  process, which never installs the CPU shim), at most 1e-5 apart;
- two of Megatron-LM's own `train_step`s on the batches the toolkit trained on (each data-parallel rank its own):
  after a weights-only load, step 1's loss against transformers' loss on those batches; after a load with optimizer
  state, steps 5 and 6 against the toolkit run's own losses (Adam's moments, step and the schedule must all have
  come through); 1e-5 relative in fp32, 1e-4 in bf16 (the same state stepped by two Megatron setups rounds apart:
  8.5e-6 on 2026-12-08).
Exit 0 when every check holds. The CPU-only workarounds (`_cpu_workarounds`, `CPU_FLAGS`) are each for a GPU, Apex or
Transformer Engine that is not there; none changes what is loaded.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# no GPU, Apex or Transformer Engine: gloo, and no fused kernels (the toolkit's own runs leave them off on CPU too)
CPU_FLAGS = ["--distributed-backend", "gloo", "--no-rope-fusion", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
             "--no-bias-dropout-fusion", "--no-create-attention-mask-in-dataloader"]
RUN = ["training.steps=6", "training.schedule.warmup_steps=2", "logging.interval=1", "checkpoint.interval=4",
       "logging.tensorboard=false"]


def _toolkit(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"toolkit {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def _printed_flags(out: str) -> list[str]:
    """The flags `toolkit convert` printed for Megatron-LM, without `--load DST`."""
    line = next(x for x in out.splitlines() if x.startswith("to continue in Megatron-LM: "))
    flags = line.removeprefix("to continue in Megatron-LM: ").split()
    at = flags.index("--load")
    return flags[:at] + flags[at + 2:]


def _model_flags(hf: Path) -> list[str]:
    c = json.loads((hf / "config.json").read_text())
    return ["--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
            "--num-attention-heads", c["num_attention_heads"], "--group-query-attention",
            "--num-query-groups", c["num_key_value_heads"], "--ffn-hidden-size", c["intermediate_size"],
            "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", c["rms_norm_eps"],
            "--position-embedding-type", "rope", "--rotary-base", c.get("rope_theta") or 10000,
            *([] if c.get("tie_word_embeddings") else ["--untie-embeddings-and-output-weights"]),
            "--disable-bias-linear", "--max-position-embeddings", c["max_position_embeddings"],
            # the NullTokenizer adds one end-of-document id: V - 1 gives the model's V rows
            "--tokenizer-type", "NullTokenizer", "--vocab-size", c["vocab_size"] - 1]


def _optimizer_flags(recipe, tp: int, pp: int) -> list[str]:
    t, o, s = recipe.training, recipe.training.optimizer, recipe.training.schedule
    return ["--seq-length", recipe.data.seq_len, "--micro-batch-size", t.micro_batch_size,
            "--global-batch-size", t.global_batch_size, "--train-iters", t.steps, "--lr", o.lr,
            "--min-lr", s.min_lr, "--lr-decay-style", s.decay, "--lr-warmup-iters", s.warmup_steps,
            "--weight-decay", o.weight_decay, "--adam-beta1", o.betas[0], "--adam-beta2", o.betas[1],
            "--adam-eps", o.eps, "--clip-grad", t.grad_clip, "--seed", t.seed,
            "--attention-dropout", 0, "--hidden-dropout", 0, "--tensor-model-parallel-size", tp,
            "--pipeline-model-parallel-size", pp, "--transformer-impl", "local",
            # the toolkit's DistributedDataParallelConfig (`toolkit render megatron-config`): gradients reduced in
            # fp32, averaged in the collective
            "--accumulate-allreduce-grads-in-fp32", "--ddp-average-in-collective",
            *(["--bf16"] if t.precision == "bf16" else [])]


def _batches(recipe, out: Path, port: int) -> None:
    """The micro-batches of the toolkit run's steps, as its data stream hands them to each data-parallel rank."""
    import torch
    import torch.distributed as dist

    from toolkit.data import DataStream
    from toolkit.recipe import resolve
    from toolkit.run import _load_tokenizer, build_data

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    plan = resolve(recipe, recipe.parallel.world_size)
    r, layout, batch = plan.recipe, plan.layout, plan.batch
    dataset, _ = build_data(r, batch.global_batch, _load_tokenizer(r), [])
    ranks = []
    for dp_rank in range(layout.dp):
        stream = DataStream(dataset, batch.micro_batch, batch.grad_accum, layout.dp, dp_rank, r.training.seed,
                            r.data.num_workers, shuffle=r.data.blend is None)
        ranks.append([stream.next_step() for _ in range(r.training.steps)])
    torch.save(ranks, out)
    dist.destroy_process_group()


# the toolkit runs (name: recipe, ranks, overrides), each checkpointed at step 4 of 6 and converted with its
# optimizer state; the distributed optimizer also in bf16, as it is used, and for the legacy format only in bf16:
# Megatron-LM 0.16's legacy load of an fp32 one copies into the model's parameters outside no_grad, and fails,
# whatever wrote the files
RUNS = {"tiny_tp2": ("tiny_tp2", 2, []), "tiny_dp2_distopt": ("tiny_dp2_distopt", 2, []),
        "tiny_dp2_distopt_bf16": ("tiny_dp2_distopt", 2, ["training.precision=bf16"]),
        "tiny_tp2_pp2": ("tiny_tp2_pp2", 4, [])}
# name: (source: "hf" or a run, --to, tp, pp[, vpp, the tp Megatron-LM loads it at]); Megatron-LM loads each on 2
# ranks (dp = 2 / (tp x pp))
CASES = {"torch_dist, weights": ("hf", "torch_dist", 2, 1), "legacy, weights": ("hf", "megatron_lm", 2, 1),
         "torch_dist, optimizer": ("tiny_tp2", "torch_dist", 2, 1),
         "legacy, optimizer": ("tiny_tp2", "megatron_lm", 2, 1),
         "torch_dist, distributed optimizer at DP2": ("tiny_dp2_distopt", "torch_dist", 1, 1),
         "torch_dist, distributed optimizer at DP2, bf16": ("tiny_dp2_distopt_bf16", "torch_dist", 1, 1),
         "legacy, distributed optimizer at DP2, bf16": ("tiny_dp2_distopt_bf16", "megatron_lm", 1, 1),
         "torch_dist, TP2 x PP2 run at PP2": ("tiny_tp2_pp2", "torch_dist", 1, 2),
         "torch_dist, TP2 x PP2 run at PP2 x VPP2": ("tiny_tp2_pp2", "torch_dist", 1, 2, 2),
         "legacy, TP2 x PP2 run at PP2 x VPP2": ("tiny_tp2_pp2", "megatron_lm", 1, 2, 2),
         "torch_dist written at TP2, loaded at TP1 x DP2": ("tiny_tp2", "torch_dist", 2, 1, 1, 1),
         "legacy, TP2 x PP2 run at PP2": ("tiny_tp2_pp2", "megatron_lm", 1, 2)}


def _file(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def prepare(work: Path) -> dict[str, dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.recipe import load_recipe

    work.mkdir(parents=True, exist_ok=False)
    os.chdir(REPO)  # the recipe's data paths are the repository's
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms other than ones, so that a norm left out or swapped shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(work / "hf")
    recipes = {}
    for i, (run, (recipe, ranks, extra)) in enumerate(RUNS.items()):
        sets = [*RUN, f"output_dir={work / run}", *extra]
        recipes[run] = load_recipe(recipe, sets)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                               "--master_port", str(29642 + i), "recipes/train.py", "--recipe", recipe,
                               *[a for s in sets for a in ("--set", s)]], cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"the toolkit run {run} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        _toolkit("convert", str(work / run / "checkpoints" / "step_00000004"), str(work / f"{run}_hf"), "--to", "hf",
                 cwd=work)
        _batches(recipes[run], work / f"{run}_batches.pt", 29650 + i)
    cases = {}
    for name, (source, to, tp, pp, *more) in CASES.items():
        vpp, load_tp = more[0] if more else 1, more[1] if len(more) > 1 else tp
        src = work / "hf" if source == "hf" else work / source / "checkpoints" / "step_00000004"
        hf = work / "hf" if source == "hf" else work / f"{source}_hf"
        dst = work / _file(name)
        flags = _printed_flags(_toolkit("convert", str(src), str(dst), "--to", to, "--tp", str(tp), "--pp", str(pp),
                                        "--vpp", str(vpp), cwd=work))
        layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
        chunks = ["--num-layers-per-virtual-pipeline-stage", layers // (pp * vpp)] if vpp > 1 else []
        run = "tiny_tp2" if source == "hf" else source  # a weights-only load trains on tiny_tp2's batches
        cases[name] = {"hf": str(hf), "run": run, "printed": flags, "pp": pp, "first_step": 1 if source == "hf" else 5,
                       "tolerance": 1e-4 if recipes[run].training.precision == "bf16" else 1e-5,
                       "argv": [str(a) for a in [*_model_flags(hf), *_optimizer_flags(recipes[run], load_tp, pp),
                                                 *chunks, *flags, *CPU_FLAGS, "--load", dst]]}
    (work / "cases.json").write_text(json.dumps(cases, indent=1))
    return cases


def _cpu_workarounds() -> None:
    """What Megatron-LM 0.16 needs on a machine without a GPU: the toolkit's CPU shim for Megatron-Core;
    torch.cuda.set_device, which a CPU build refuses, as a no-op (the shim reports one device); no build of the
    dataset helpers and fused CUDA kernels (no dataset is built, no fused kernel runs); a compute capability for
    validate_args' TP > 1 check, and the CUDA_DEVICE_MAX_CONNECTIONS it then wants (GPU users set it)."""
    import torch

    from toolkit.megatron import cpu_shim

    cpu_shim.install()
    torch.cuda.set_device = lambda *a, **k: None
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.utils as utils

    initialize._compile_dependencies = lambda: None
    arguments.get_device_arch_version = utils.get_device_arch_version = lambda: 9
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # torch's AdamW (standing in for Apex's and Transformer Engine's Adam) keeps each parameter's step in its state,
    # where they keep it in the param group; the distributed optimizer's loader copies every state key from the
    # file's tensors, which hold no step: it is set aside meanwhile (as the toolkit's own load does)
    from megatron.core.optimizer import distrib_optimizer

    copy = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def without_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        try:
            copy(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = without_step


def _megatron_batch(micro: dict) -> dict:
    """The toolkit's micro-batch as pretrain_gpt's forward_step takes it: labels shifted by one, the last position
    and ignored labels masked out."""
    import torch

    ids, labels = micro["input_ids"], torch.roll(micro["labels"], shifts=-1, dims=1)
    mask = torch.ones_like(labels, dtype=torch.float32)
    mask[:, -1] = 0
    mask[labels == -100] = 0
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous()
    return {"tokens": ids, "labels": labels.masked_fill(labels == -100, 0), "loss_mask": mask,
            "position_ids": positions}


def worker(work: Path, name: str) -> None:
    """One rank: Megatron-LM's arguments, model, optimizer and scheduler, its load_checkpoint, logits, two steps."""
    import torch

    case = json.loads((work / "cases.json").read_text())[name]
    _cpu_workarounds()
    sys.argv = [sys.argv[0], *case["argv"]]
    from functools import partial

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import get_timers
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (get_megatron_optimizer_config, get_model, get_optimizer_param_scheduler,
                                            train_step)
    from megatron.training.utils import unwrap_model

    initialize_megatron(allow_no_cuda=True)
    import pretrain_gpt
    from gpt_builders import gpt_builder
    from model_provider import model_provider

    args = get_args()
    model = get_model(partial(model_provider, gpt_builder), ModelType.encoder_or_decoder, wrap_with_ddp=True)
    config, overrides = get_megatron_optimizer_config(args)
    config.timers = get_timers()
    optimizer = get_megatron_optimizer(config, model, config_overrides=overrides,
                                       use_gloo_process_groups=args.enable_gloo_process_groups)
    scheduler = get_optimizer_param_scheduler(optimizer)
    # CPU only: torch's AdamW stands in for Apex's and Transformer Engine's Adam, and the distributed optimizer then
    # wants each parameter's Adam step before a load, and gives them all one step tensor, which torch's AdamW
    # advances once per parameter per step (the toolkit's own load works around both alike)
    from toolkit.megatron.torch_dist_ckpt import _prefill_adam_state, _unshare_steps

    if args.use_distributed_optimizer:
        _prefill_adam_state(optimizer)
    iteration, _ = load_checkpoint(model, optimizer, scheduler)
    if args.use_distributed_optimizer:
        _unshare_steps(optimizer)
    result = {"iteration": iteration, "consumed_train_samples": args.consumed_train_samples}
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    result["adam_steps"] = sorted({float(v["step"]) for o in inner for v in o.state.values() if "step" in v} |
                                  {float(g["step"]) for o in inner for g in o.param_groups if g.get("step")})

    vocab = json.loads((Path(case["hf"]) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = None
    if case["pp"] == 1 and not args.bf16:  # the whole model on every rank (a stage has only its layers), in fp32
        core = unwrap_model(model)[0].eval()
        with torch.no_grad():
            out = core(ids, torch.arange(16).unsqueeze(0).expand(2, -1), attention_mask=None)
            logits = gather_from_tensor_model_parallel_region(out)[..., :vocab].float()
        core.train()
    saved = torch.load(work / f"{case['run']}_batches.pt")  # [the run's data-parallel rank][step][micro-batch]
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    # at another dp than the run's (1): each rank takes its share of every step's micro-batches
    steps = saved[rank] if len(saved) == dp else [step[rank::dp] for step in saved[0]]
    # as Megatron-LM's train() sets the model config up before its loop: without finalize_model_grads, nothing
    # reduces the gradients over the data-parallel ranks
    cfg = get_model_config(model[0])
    cfg.grad_scale_func, cfg.timers, cfg.finalize_model_grads_func = optimizer.scale_loss, get_timers(), \
        finalize_model_grads
    result["losses"] = []
    for k, step in enumerate((case["first_step"], case["first_step"] + 1)):
        data = [RerunDataIterator(iter([_megatron_batch(m) for m in steps[step - 1]])) for _ in model]  # per chunk
        data = data[0] if len(data) == 1 else data
        loss, skipped, _, _, _, norm, *_ = train_step(pretrain_gpt.forward_step, data, model, optimizer, scheduler,
                                                      cfg, get_forward_backward_func(),
                                                      iteration=iteration + k)
        result["losses"].append(float(loss["lm loss"]) if loss and not skipped else None)
        result.setdefault("grad_norms", []).append(None if norm is None else float(norm))
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_data_parallel_rank() == 0:  # where train_step reports the loss
        torch.save({"ids": ids, "logits": logits, **result}, work / f"{_file(name)}.result.pt")
    dist.barrier()


def check(work: Path, cases: dict[str, dict], megatron_lm: Path, deps: Path | None) -> bool:
    import torch
    from transformers import LlamaForCausalLM

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (megatron_lm, deps, REPO) if p)}
    ok = True
    for name, case in cases.items():
        toolkit = {m["step"]: m["loss"] for m in map(json.loads, (work / case["run"] / "metrics.jsonl").open())
                   if "loss" in m}
        steps = torch.load(work / f"{case['run']}_batches.pt")[0]
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", "29643", __file__, "--work", str(work), "--case", name],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name}: Megatron-LM failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            ok = False
            continue
        got = torch.load(work / f"{_file(name)}.result.pt")
        hf = LlamaForCausalLM.from_pretrained(case["hf"], dtype=torch.float32).eval()
        with torch.no_grad():
            diff = 0.0 if got["logits"] is None else \
                (hf(input_ids=got["ids"]).logits.float() - got["logits"]).abs().max().item()
            if case["first_step"] == 1:  # transformers' loss on step 1's micro-batches (equal token counts)
                want = [sum(hf(input_ids=m["input_ids"], labels=m["labels"]).loss.item() for m in steps[0])
                        / len(steps[0])]
            else:
                want = [toolkit[5], toolkit[6]]
        losses = got["losses"][:len(want)]
        good = diff <= 1e-5 and all(g is not None and abs(g - w) <= case["tolerance"] * abs(w)
                                    for g, w in zip(losses, want))
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: flags as printed {' '.join(case['printed'])}; loaded iteration "
              f"{got['iteration']}, consumed samples {got['consumed_train_samples']}; logits vs transformers "
              f"{'max ' + format(diff, '.2e') if got['logits'] is not None else 'not taken (bf16, or a stage)'}; "
              f"Megatron-LM's losses {losses} against {want} (its gradient norms {got['grad_norms']}; Adam's step "
              f"after the load {got['adam_steps']})")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", type=Path, help="a Megatron-LM source checkout (core_v0.16.1)")
    p.add_argument("--deps", type=Path, help="a folder of the extra packages (six, triton) put on the path")
    p.add_argument("--work", type=Path, required=True, help="a new folder for the checkpoints and results")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a rank of one case, started by the check itself
    a = p.parse_args()
    if a.case:
        return worker(a.work, a.case)
    if not a.megatron_lm or not (a.megatron_lm / "megatron" / "training" / "checkpointing.py").is_file():
        sys.exit("--megatron-lm: give a Megatron-LM source checkout (it has megatron/training/checkpointing.py)")
    work = a.work.resolve()
    if work.exists():
        sys.exit(f"--work: {work} exists; give a new folder (the check writes its checkpoints there)")
    sys.exit(0 if check(work, prepare(work), a.megatron_lm.resolve(), a.deps and a.deps.resolve()) else 1)


if __name__ == "__main__":
    main()
