"""What the toolkit costs over hand-written DeepSpeed and Megatron-Core scripts, measured in the same run.

    python bench/overhead.py                              # both backends, 4 repetitions, about 4 minutes on 2 cores
    python bench/overhead.py --backends megatron --reps 5 --json out.json
    python bench/overhead.py --reps 1 --warmup 1 --steps 2   # about 1.5 minutes; what the test suite runs

For each backend the same recipe (tiny_zero3 for DeepSpeed, tiny_tp2 for Megatron-Core: the 4-layer tiny
Llama on the demo corpus, 2 CPU ranks under torchrun, gloo, OMP_NUM_THREADS=1) is trained two ways:
  toolkit   recipes/train.py, unchanged (bench/overhead_toolkit.py only adds the step clock)
  raw       a minimal hand-written script: bench/overhead_raw_deepspeed.py (deepspeed.initialize over a
            transformers Llama, with the DeepSpeed JSON the toolkit renders) or bench/overhead_raw_megatron.py
            (GPTModel, DDP, get_megatron_optimizer and get_forward_backward_func called directly, with the
            Megatron-Core arguments toolkit/adapters/megatron.py derives; it reuses the toolkit's CPU shim and
            local layer spec, which are environment glue, not training code)
Same seed, data, batch, schedule, logging interval and number of steps. Launches alternate (toolkit, raw, then
raw, toolkit, ...) and the backends interleave, so drift of the machine reaches both sides alike. Before them, one
untimed launch of each raw script fills the file cache (torch, DeepSpeed, Megatron-Core, the tokenizer, the
datasets cache): the first launch on a cold cache takes 15-20 s longer to start, and would otherwise land on
whichever side happens to go first (--no-cache-warmup skips it).

Both sides tick the same clock (bench/overhead_clock.py) at the start of every step, right before the step's
batch is fetched. Reported from rank 0, per launch, over the --steps steps after --warmup steps:
  wall s/step   the median step's wall time: the steady-state step time (robust to other processes' bursts)
  mean s/step   the mean, which also weighs in the logging steps (every logging.interval steps)
  CPU s/step    the median step's CPU time of the process: the work done, which a busy machine disturbs less
  first step s  from the process start (the kernel's start time: interpreter start-up and imports count) to
                the end of the first step; and the CPU seconds the process spent until then
and per backend the toolkit/raw ratio of each repetition's pair (the first step: toolkit - raw), as median
[min .. max] over the repetitions, and for the ratios their geometric mean with a 95% confidence interval
(Student's t over the pairs' log ratios; two or more repetitions). Targets: wall ratio within 1.03, first step
within +1.5 s. The verdict line reads the wall ratio's interval: "met" when its upper end is within 1.03,
"consistent" when only the geometric mean is (more --reps narrow the interval), "missed" when the mean is not.
CPU only (CUDA_VISIBLE_DEVICES is emptied for every launch). The machine is shared and noisy: read the spread,
compare within one run, not across runs. The last logged loss of both sides is printed as a check that they
did the same work (same seed and data: it should agree to the printed digits).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))
from toolkit.proc import free_port  # noqa: E402

RAW_SCRIPTS = {"deepspeed": BENCH / "overhead_raw_deepspeed.py", "megatron": BENCH / "overhead_raw_megatron.py"}
DEFAULT_RECIPES = {"deepspeed": "tiny_zero3", "megatron": "tiny_tp2"}


def toolkit_overrides(steps: int, out_dir: Path) -> list[str]:
    """Train exactly `steps` steps into a fresh folder; the one checkpoint is written after the last step (untimed).
    The LR warm-up is shortened to fit so short a run (the schedule changes numbers, not the work)."""
    return [f"training.steps={steps}", f"training.schedule.warmup_steps={max(1, steps // 4)}",
            f"output_dir={out_dir}", f"checkpoint.interval={steps}",
            "checkpoint.resume=never", "logging.sample_prompt=null"]


def build_spec(backend: str, recipe: str, steps: int, nproc: int) -> dict:
    """What the hand-written script needs, from the toolkit's own resolution of the recipe: the same DeepSpeed JSON
    or Megatron-Core arguments, the same data, seed, batch, schedule and logging interval."""
    from toolkit.recipe import load_recipe, resolve
    from toolkit.train.schedule import lr_multiplier

    plan = resolve(load_recipe(recipe, toolkit_overrides(steps, Path("unused"))), nproc)
    r, layout, batch = plan.recipe, plan.layout, plan.batch
    if layout.backend != backend:
        raise SystemExit(f"recipe {recipe} uses backend {layout.backend}, not {backend}")
    if r.data.hub_dataset or r.data.format not in ("auto", "json") or not r.data.packing:
        raise SystemExit(f"recipe {recipe}: the hand-written scripts read packed local JSON data only")
    t, s = r.training, r.training.schedule
    spec = {"recipe": recipe, "steps": steps, "seed": t.seed, "tokenizer": r.data.tokenizer, "seq_len": r.data.seq_len,
            "data_files": [str(REPO / p) if not Path(p).is_absolute() else p for p in r.data.paths],
            "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum, "log_interval": r.logging.interval,
            "weight_decay": t.optimizer.weight_decay, "peak_lr": t.optimizer.lr,
            "lrs": [t.optimizer.lr * lr_multiplier(i, s.warmup_steps, t.steps, s.decay, s.min_lr / t.optimizer.lr)
                    for i in range(steps)],
            "layout": layout.describe()}
    if backend == "deepspeed":
        from toolkit.adapters.deepspeed import build_ds_config
        from toolkit.model import to_hf_config

        spec.update(ds_config=build_ds_config(plan, "cpu"), hf_config=to_hf_config(r.model).to_dict())
    else:
        spec["megatron"] = _megatron_args(r, layout)
    return spec


def _megatron_args(r, layout) -> dict:
    """toolkit/adapters/megatron.py's arguments as JSON (dtypes by name; the activation is SiLU, set by the script)."""
    from toolkit.adapters import megatron as mcfg

    if layout.vpp > 1 or layout.cp > 1:
        raise SystemExit("the hand-written Megatron script supports TP, PP and DP only (no vpp, no cp)")

    def plain(d: dict) -> dict:
        return {k: str(v).replace("torch.", "") if "dtype" in k else v for k, v in d.items() if k != "activation_func"}

    return {"initialize_model_parallel": mcfg.to_parallel_kwargs(layout),
            "TransformerConfig": plain(mcfg.to_transformer_config_kwargs(r, layout, on_gpu=False)),
            "GPTModel": mcfg.to_gpt_model_kwargs(r, layout),
            "DistributedDataParallelConfig": mcfg.to_ddp_config_kwargs(r, layout),
            "OptimizerConfig": plain(mcfg.to_optimizer_config_kwargs(r, layout))}


def launch(kind: str, backend: str, spec_path: Path, recipe: str, steps: int, nproc: int, work: Path) -> dict:
    """One torchrun launch of the toolkit or the raw script; returns rank 0's timings and the last logged loss."""
    out, times = work / f"{kind}_out", work / f"{kind}_times.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port())]
    if kind == "toolkit":
        sets = [a for o in toolkit_overrides(steps, out) for a in ("--set", o)]
        cmd = [*torchrun, str(BENCH / "overhead_toolkit.py"), "--times", str(times), "--", "--recipe", recipe, *sets]
    else:
        cmd = [*torchrun, str(RAW_SCRIPTS[backend]), "--spec", str(spec_path), "--times", str(times)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{kind} {backend} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
    rank0 = json.loads(Path(f"{times}.rank0").read_text())
    if kind == "toolkit":  # the toolkit's own log; the raw scripts save theirs with the ticks
        rank0["losses"] = [[m["step"], m["loss"]] for m in map(json.loads, (out / "metrics.jsonl").open())]
    losses = rank0["losses"]
    shutil.rmtree(out, ignore_errors=True)
    for f in work.glob(f"{kind}_times.json.rank*"):
        f.unlink()
    return {"ticks": rank0["ticks"], "process_start": rank0["process_start"], "last_loss": losses[-1][1]}


def summarize_launch(raw: dict, warmup: int, steps: int) -> dict:
    """Wall and CPU seconds per step over ticks[warmup]..ticks[warmup + steps]; seconds from the process start to
    the end of the first step."""
    ticks = raw["ticks"]
    if len(ticks) < warmup + steps + 1:
        raise SystemExit(f"expected {warmup + steps + 1} step ticks, got {len(ticks)}")
    timed = ticks[warmup:warmup + steps + 1]
    wall = [b[0] - a[0] for a, b in pairwise(timed)]
    cpu = [b[1] - a[1] for a, b in pairwise(timed)]
    return {"step_s": statistics.median(wall), "step_mean_s": statistics.fmean(wall), "step_min_s": min(wall),
            "step_max_s": max(wall), "step_cpu_s": statistics.median(cpu),
            "first_step_s": ticks[1][0] - raw["process_start"], "first_step_cpu_s": ticks[1][1],
            "last_loss": raw["last_loss"], "step_times_s": wall}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


METRICS = {"step_s": "wall s/step", "step_mean_s": "mean s/step", "step_cpu_s": "CPU s/step"}
TARGET_RATIO, TARGET_FIRST_STEP_S = 1.03, 1.5
# Student's t, two-sided 95%, for 1..30 degrees of freedom (beyond 30 the last entry: slightly conservative)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ratio_interval(ratios: list[float]) -> dict | None:
    """The geometric mean of the pairs' ratios and its 95% confidence interval (t over the log ratios: a ratio
    and its inverse are equally far from 1). None with a single pair, which has no spread to go by."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean, sem = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    t = T95[min(len(logs) - 1, len(T95)) - 1]
    return {"geomean": math.exp(mean), "low": math.exp(mean - t * sem), "high": math.exp(mean + t * sem)}


def verdict(s: dict) -> str:
    """What one backend's summary says about the two targets."""
    ci, first = s["step_s"]["ratio_ci"], s["first_step_s"]["diff"]["median"]
    if ci is None:
        wall = f"wall ratio {s['step_s']['ratio']['median']:.3f} from one pair: run --reps 2 or more for a verdict"
    elif ci["high"] <= TARGET_RATIO:
        wall = f"wall ratio target met (95% interval up to {ci['high']:.3f} <= {TARGET_RATIO})"
    elif ci["geomean"] <= TARGET_RATIO:
        wall = (f"wall ratio consistent with the target, not confirmed (mean {ci['geomean']:.3f}, 95% interval up to "
                f"{ci['high']:.3f}; more --reps narrow it)")
    else:
        wall = f"wall ratio target missed (mean {ci['geomean']:.3f} > {TARGET_RATIO})"
    ok = "met" if first <= TARGET_FIRST_STEP_S else "missed"
    return f"{wall}; first-step target {ok} ({first:+.2f} s, target <= +{TARGET_FIRST_STEP_S} s)"


def summarize_backend(rows: list[dict]) -> dict:
    """Per metric, both sides' values and the toolkit/raw ratio of each repetition's pair, as median [min .. max]."""
    pairs = {}
    for row in rows:
        pairs.setdefault(row["rep"], {})[row["kind"]] = row
    pairs = [p for _, p in sorted(pairs.items())]
    out = {m: {"toolkit": spread([p["toolkit"][m] for p in pairs]), "raw": spread([p["raw"][m] for p in pairs]),
               "ratio": spread([p["toolkit"][m] / p["raw"][m] for p in pairs]),
               "ratio_ci": ratio_interval([p["toolkit"][m] / p["raw"][m] for p in pairs])} for m in METRICS}
    for m in ("first_step_s", "first_step_cpu_s"):
        out[m] = {k: spread([p[k][m] for p in pairs]) for k in ("toolkit", "raw")}
        out[m]["diff"] = spread([p["toolkit"][m] - p["raw"][m] for p in pairs])
    out["last_loss"] = {k: pairs[-1][k]["last_loss"] for k in ("toolkit", "raw")}
    out["verdict"] = verdict(out)
    return out


def _fmt(s: dict, digits: int = 3, sign: str = "") -> str:
    return f"{s['median']:{sign}.{digits}f} [{s['min']:{sign}.{digits}f} .. {s['max']:{sign}.{digits}f}]"


def print_summary(summary: dict, reps: int) -> None:
    print(f"\nsummary: median [min .. max] over {reps} repetition{'s' * (reps > 1)}, and the ratios' geometric mean "
          f"(95% interval); targets: wall ratio <= {TARGET_RATIO}, first step diff <= +{TARGET_FIRST_STEP_S} s")
    for backend, s in summary.items():
        for i, (m, label) in enumerate(METRICS.items()):
            ci = s[m]["ratio_ci"]
            mean = f"  mean {ci['geomean']:.3f} ({ci['low']:.3f} .. {ci['high']:.3f})" if ci else ""
            print(f"  {backend if i == 0 else '':<10} {label:<13} toolkit {s[m]['toolkit']['median']:.4f}  raw "
                  f"{s[m]['raw']['median']:.4f}  ratio {_fmt(s[m]['ratio'])}{mean}")
        for m, label in (("first_step_s", "first step s"), ("first_step_cpu_s", "  CPU s")):
            f = s[m]
            print(f"  {'':<10} {label:<13} toolkit {f['toolkit']['median']:6.2f}  raw {f['raw']['median']:6.2f}  "
                  f"diff   {_fmt(f['diff'], 2, '+')}")
        print(f"  {'':<10} {'last loss':<13} toolkit {s['last_loss']['toolkit']:.4f}  raw {s['last_loss']['raw']:.4f}")
        print(f"  {'':<10} {'verdict':<13} {s['verdict']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="deepspeed,megatron", help="comma-separated (default deepspeed,megatron)")
    ap.add_argument("--reps", type=int, default=4, help="repetitions: toolkit/raw launch pairs per backend (default 4)")
    ap.add_argument("--warmup", type=int, default=3, help="steps per launch before timing starts (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per launch (default 30); each launch trains "
                    "warmup + steps + 1 steps, the end of the last one having no tick")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per launch (default 2)")
    ap.add_argument("--deepspeed-recipe", default=DEFAULT_RECIPES["deepspeed"], help="(default tiny_zero3)")
    ap.add_argument("--megatron-recipe", default=DEFAULT_RECIPES["megatron"], help="(default tiny_tp2)")
    ap.add_argument("--no-cache-warmup", action="store_true", help="skip the untimed launch per backend that "
                    "fills the file cache before the timed ones")
    ap.add_argument("--workdir", default=None, help="where launches write (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write every launch and the summary to this JSON file")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in RAW_SCRIPTS]
    if bad or not backends:
        ap.error(f"unknown backend(s) {bad}; choose from {', '.join(RAW_SCRIPTS)}")
    if args.reps < 1 or args.warmup < 1 or args.steps < 1:
        ap.error("--reps, --steps and --warmup must be at least 1 (the first step is never a steady-state one)")
    total = args.warmup + args.steps + 1
    recipes = {"deepspeed": args.deepspeed_recipe, "megatron": args.megatron_recipe}
    print(f"bench/overhead.py: {os.cpu_count()} CPUs, {args.nproc} ranks per launch (torchrun, gloo, CPU); "
          f"{args.reps} repetitions; {total} steps per launch, {args.steps} timed after {args.warmup}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_overhead_") as tmp:
        work = Path(tmp)
        specs = {}
        for b in backends:
            spec = build_spec(b, recipes[b], total, args.nproc)
            specs[b] = work / f"spec_{b}.json"
            specs[b].write_text(json.dumps(spec, indent=2))
            print(f"  {b}: {recipes[b]}, {spec['layout']}", flush=True)
        if not args.no_cache_warmup:
            for b in backends:
                t0 = time.perf_counter()
                launch("raw", b, specs[b], recipes[b], total, args.nproc, work)
                print(f"  cache warm-up {b} (raw, untimed): launch {time.perf_counter() - t0:.0f} s", flush=True)
        for rep in range(args.reps):
            for b in backends:
                order = ("toolkit", "raw") if rep % 2 == 0 else ("raw", "toolkit")
                for kind in order:
                    t0 = time.perf_counter()
                    row = summarize_launch(launch(kind, b, specs[b], recipes[b], total, args.nproc, work),
                                           args.warmup, args.steps)
                    row.update(backend=b, kind=kind, rep=rep + 1, wall_s=time.perf_counter() - t0)
                    rows.append(row)
                    print(f"  rep {rep + 1} {b:<10} {kind:<8} wall {row['step_s']:.4f} s/step (mean "
                          f"{row['step_mean_s']:.4f}, {row['step_min_s']:.4f} .. {row['step_max_s']:.4f}), CPU "
                          f"{row['step_cpu_s']:.4f}; first step {row['first_step_s']:5.2f} s (CPU "
                          f"{row['first_step_cpu_s']:.2f}); launch {row['wall_s']:.0f} s",
                          flush=True)
    summary = {b: summarize_backend([r for r in rows if r["backend"] == b]) for b in backends}
    print_summary(summary, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args) | {"recipes": recipes}, "launches": rows,
                                               "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
