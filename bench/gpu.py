"""Training throughput, MFU and peak GPU memory of a ~1B Llama on one GPU, each backend as users launch it,
next to what `toolkit plan` predicts for the same layout.

    python bench/gpu.py                          # 1.1B Llama, seq 4096, bf16, 1 GPU: 3 cases, budget 8 minutes
    python bench/gpu.py --gpus 8 --out runs/bench_gpu_8.json
    python bench/gpu.py --cases deepspeed-zero3 --batch-per-gpu 8
    python bench/gpu.py --tiny                   # the same code path on CPU: tiny model, 2 steps, about a minute

The model is TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 query / 4 KV heads, SwiGLU 5632, vocab 32000)
at sequence 4096 in bf16, 4 sequences (16k tokens) per GPU per step. Cases, each a fresh training run started
by the launcher users use, on --gpus processes of one node:
  deepspeed-zero1   `deepspeed --num_gpus N recipes/train.py`, ZeRO-1, micro-batch 4
  deepspeed-zero3   the same with ZeRO-3 (parameters partitioned, gathered layer by layer)
  megatron-tp1      `torchrun --nproc_per_node N recipes/train.py`, Megatron-Core TP1 + distributed optimizer:
                    the Transformer Engine layer spec when it imports, micro-batch 4; otherwise the local spec,
                    whose attention materialises the s x s scores (3.5 GiB per layer per sequence at 4096), so it
                    runs micro-batch 1 x 4 accumulation with selective recomputation of the attention core
Each run trains warm-up steps (not measured: CUDA context, allocator growth, fused-kernel autotuning) then the
measured steps, logging every step. Printed per case, and written to --out as JSON:
  tokens/s          trained tokens per second over the measured steps, all GPUs together
  TFLOP/s per GPU   model FLOPs (toolkit/metrics.py flops_per_token: 6 x non-embedding parameters +
                    attention scores, recomputation not counted) x tokens/s / GPUs
  MFU               TFLOP/s per GPU / the device's dense bf16 peak (metrics.PEAK_TFLOPS, or --peak-tflops)
  peak memory       torch.cuda.max_memory_allocated() of each training process, read just before the final
                    checkpoint save (so it is the training steps' peak), the largest over the ranks
  plan              `toolkit plan`'s estimate for the same recipe and layout: predicted GPU bytes of the busiest
                    rank (model states + activations + framework buffers) and step time
The plan models Transformer Engine layers for Megatron; a local-spec run is reported next to it but marked as
not modelled (`plan_models_run: false`).

Data: the shipped demo corpus and its 512-id tokenizer with model.vocab_size = 32000. Every matmul, the dense
embedding gradient and the softmax over all 32000 logits are computed whatever ids the batch holds, so speed
and memory are those of a 32k-vocabulary model; the loss is not meaningful (it falls quickly). The corpus gives
116 sequences of 4096 tokens: enough for a global batch of up to 116 (it is reused across epochs).

Needs: the CUDA build of torch plus this repo's pins (deepspeed, megatron-core, transformers, datasets,
tokenizers, safetensors, pydantic, pyyaml, tensorboard, ninja: `pip install -e .`); DeepSpeed JIT-compiles its
fused Adam on the first run, which needs nvcc (a PyTorch *devel* image, or pre-build it with
DS_BUILD_FUSED_ADAM=1). transformer-engine is optional. Checkpoints go under --workdir and are deleted after
each case (~15 GiB each at 1.1B: bf16 weights + fp32 master weights and Adam moments).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from toolkit.proc import free_port, process_tree  # noqa: E402
GiB = 2**30

SHAPES = {  # recipe model keys
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_attention_heads=32,
               num_kv_heads=4, max_position_embeddings=4096),  # TinyLlama-1.1B's shape
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_attention_heads=4,
                 num_kv_heads=2, max_position_embeddings=256),  # the `tiny` preset
}
CASES = ("deepspeed-zero1", "deepspeed-zero3", "megatron-tp1")
PROBE = """
import json, torch
from toolkit.metrics import detect_peak_tflops
out = {"cuda": torch.cuda.is_available(), "count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
if out["cuda"]:
    from toolkit.megatron.runtime import te_available
    p = torch.cuda.get_device_properties(0)
    out.update(name=p.name, memory_gib=p.total_memory / 2**30, peak_tflops=detect_peak_tflops("cuda", "bf16"),
               te=te_available(), cuda_version=torch.version.cuda)
print(json.dumps(out))
"""


# ---- the training process (launched by deepspeed / torchrun as `bench/gpu.py --worker DIR <train.py args>`) ----

def worker(argv: list[str]) -> int:
    """recipes/train.py's main, plus each rank's peak GPU memory written to DIR. The toolkit does not log memory,
    so the peak is read here: before the final checkpoint save (the training steps) and after the run."""
    import importlib.util

    import torch

    i = argv.index("--worker")
    peak_dir, rest = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    on_gpu = torch.cuda.is_available()  # before Megatron's CPU shim can answer torch.cuda queries

    def peak() -> dict:
        if not on_gpu:
            return {"allocated": None, "reserved": None}
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}

    from toolkit.train import checkpoint as ckpt

    peaks, real_save = {}, ckpt.save

    def save(*args, **kwargs):  # the loop saves only at its end here (checkpoint.interval = steps)
        peaks.setdefault("train", peak())
        return real_save(*args, **kwargs)

    ckpt.save = save
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "recipes" / "train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    sys.argv = [str(REPO / "recipes" / "train.py"), *rest]
    rc = entry.main()
    peaks["run"] = peak()
    rank = int(os.environ.get("RANK", "0"))
    (peak_dir / f"peak_memory_rank{rank}.json").write_text(json.dumps({"rank": rank, "on_gpu": on_gpu, **peaks}))
    return rc


# ---- the driver -----------------------------------------------------------------------------------------------

def probe_device() -> dict:
    """GPU name, memory, count, bf16 peak and Transformer Engine, asked in a child process: the driver itself
    never creates a CUDA context, which would hold GPU memory while the cases run."""
    proc = subprocess.run([sys.executable, "-c", PROBE], check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise SystemExit(f"probing the device failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def versions() -> dict:
    out = {}
    for dist in ("torch", "deepspeed", "megatron-core", "transformers", "transformer-engine",
                 "transformer_engine", "flash-attn"):
        try:
            out[dist.replace("_", "-")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out.setdefault(dist.replace("_", "-"), None)
    return out


def write_recipe(path: Path, shape: dict, seq: int, precision: str, steps: int) -> None:
    """The base recipe every case starts from; the cases add their layout with --set."""
    import yaml

    recipe = {
        "name": "bench_gpu",
        "description": "bench/gpu.py: a Llama-shaped model trained for a few steps to measure speed and memory",
        "model": shape,
        "data": {"paths": ["recipes/data/demo_corpus/train.jsonl"], "tokenizer": "recipes/data/demo_tokenizer",
                 "seq_len": seq},
        "training": {"steps": steps, "precision": precision, "optimizer": {"lr": 3.0e-4},
                     "schedule": {"warmup_steps": 0, "decay": "constant"}},
        "checkpoint": {"interval": steps, "keep": 1, "resume": "never"},  # one save, after the last step
        "logging": {"interval": 1, "tensorboard": False, "sample_prompt": None},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def case_layout(case: str, gpus: int, batch_per_gpu: int, micro: int | None, te: bool) -> tuple[dict, str]:
    """(recipe keys, label) of one case."""
    local = case.startswith("megatron") and not te
    micro = micro or (1 if local else batch_per_gpu)
    if batch_per_gpu % micro:
        raise SystemExit(f"--micro-batch {micro} does not divide --batch-per-gpu {batch_per_gpu}")
    keys = {"training.micro_batch_size": micro, "training.grad_accum_steps": batch_per_gpu // micro,
            "training.global_batch_size": batch_per_gpu * gpus, "parallel.world_size": gpus}
    if case.startswith("deepspeed"):
        stage = int(case[-1])
        keys |= {"parallel.backend": "deepspeed", "parallel.zero_stage": stage}
        label = f"DeepSpeed ZeRO-{stage}"
    else:
        keys |= {"parallel.backend": "megatron", "parallel.tp": 1, "parallel.zero_stage": 1,
                 "parallel.megatron.transformer_impl": "local" if local else "transformer_engine",
                 "training.activation_checkpointing": "selective" if local else "none"}
        label = "Megatron TP1 distopt " + ("local spec + selective recompute" if local else "Transformer Engine")
    return keys, f"{label}, micro {micro} x {batch_per_gpu // micro} x {gpus} GPU"


def launch(case: str, recipe: Path, sets: list[str], gpus: int, case_dir: Path, timeout: int, on_gpu: bool) -> dict:
    """One case in fresh processes under the launcher users use. Returns rc, wall seconds and the log's tail."""
    bin_dir = Path(sys.executable).parent
    port = str(free_port())
    if case.startswith("deepspeed"):
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(gpus), "--master_port", port]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(gpus), "--master_port", port]
    cmd += [str(Path(__file__).resolve()), "--worker", str(case_dir), "--recipe", str(recipe)]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           # a cache of our own: the tokenized corpus is shared by the cases, never by another job on the machine
           "HF_DATASETS_CACHE": str(case_dir.parent / "datasets_cache")}
    if not on_gpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    log = case_dir / "train.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in reversed(process_tree(proc.pid)):  # the launchers start their workers in new sessions
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            rc = f"timed out after {timeout} s"
    # what a user types for the same run (the worker wrapper only adds the peak-memory readout)
    user = [Path(cmd[0]).name, *cmd[1:3], "recipes/train.py", *cmd[8:]]
    return {"command": " ".join(user), "rc": rc,
            "wall_s": time.perf_counter() - start, "log_tail": log.read_text()[-3000:]}


def measure(case_dir: Path, warmup: int, tokens_per_step: int, flops_token: float, gpus: int,
            peak_tflops: float | None) -> dict:
    """Throughput over the steps after the warm-up, from the run's own metrics.jsonl; peak memory per rank.

    The time is the span between the record of the last warm-up step and the last record: each is stamped after
    the loop's loss all-reduce, which waits for the GPU, so all the measured steps' GPU work lies between them.
    The loop's own per-interval tokens/s stops its clock before that sync (kept as `loop_tokens_per_s`)."""
    records = [json.loads(x) for x in (case_dir / "metrics.jsonl").read_text().splitlines()]
    start = next((r for r in records if r["step"] == warmup), None)
    timed = [r for r in records if r["step"] > warmup]
    if start is None or not timed:
        raise ValueError(f"metrics.jsonl lacks step {warmup} (the last warm-up step) or any step after it")
    seconds = max(timed[-1]["time"] - start["time"], 1e-3)  # stamps are rounded to the millisecond
    tokens_s = tokens_per_step * len(timed) / seconds
    tflops = flops_token * tokens_s / gpus / 1e12
    loop_seconds = sum(tokens_per_step / r["tokens_per_s"] for r in timed)  # each record covers one step
    peaks = [json.loads(p.read_text()) for p in sorted(case_dir.glob("peak_memory_rank*.json"))]
    train = [(p.get("train") or p["run"]) for p in peaks]
    alloc = [t["allocated"] for t in train if t["allocated"] is not None]
    return {"measured_steps": len(timed), "step_s": seconds / len(timed), "tokens_per_s": tokens_s,
            "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None,
            "loop_tokens_per_s": tokens_per_step * len(timed) / loop_seconds,
            "final_loss": records[-1]["loss"], "ranks_reporting_memory": len(peaks),
            "peak_mem_phase": "training steps" if all("train" in p for p in peaks) else "whole run",
            "peak_mem_gib": max(alloc) / GiB if alloc else None,
            "peak_mem_run_gib": max((p["run"]["allocated"] or 0) for p in peaks) / GiB if alloc else None,
            "peak_reserved_gib": max(t["reserved"] for t in train) / GiB if alloc else None}


def plan(recipe: Path, sets: list[str], gpus: int, device: dict) -> dict:
    """`toolkit plan`'s numbers for this recipe and layout on a cluster of this device."""
    from toolkit.plan.choice import from_recipe
    from toolkit.plan.estimate import estimate
    from toolkit.plan.hardware import Cluster
    from toolkit.recipe import load_recipe

    r = load_recipe(str(recipe), sets)
    extra = {"peak_tflops": device["peak_tflops"]} if device.get("peak_tflops") else {}
    cluster = Cluster(gpus=gpus, gpus_per_node=gpus, gpu_memory_gib=device.get("memory_gib") or 80.0, **extra)
    e = estimate(r, from_recipe(r, gpus), cluster)
    m = e.memory
    return {"layout": e.choice.label(), "gpu_gib": m.gpu / GiB, "states_gib": m.states.on("gpu") / GiB,
            "activations_gib": m.activations / GiB, "buffers_gib": sum(m.buffers.values()) / GiB,
            "step_s": e.step_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "fits": e.fits,
            "problems": e.problems}


def run_case(case: str, args, recipe: Path, device: dict, flops_token: float, seq: int) -> dict:
    keys, label = case_layout(case, args.gpus, args.batch_per_gpu, args.micro_batch, device.get("te", False))
    case_dir = (args.workdir / case).resolve()
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    overrides = [f"{k}={v}" for k, v in keys.items()]
    if args.peak_tflops:
        overrides.append(f"logging.peak_tflops={args.peak_tflops}")
    sets = [*overrides, f"output_dir={case_dir}"]
    print(f"\n== {case}: {label}", flush=True)
    row = {"case": case, "label": label, "overrides": overrides, "ok": False, "error": None}
    try:
        row["plan"] = plan(recipe, sets, args.gpus, device)
    except Exception as e:  # noqa: BLE001 - the planner's failure is reported, the measurement still runs
        row["plan"], row["plan_error"] = None, f"{type(e).__name__}: {e}"
    row["plan_models_run"] = not (case.startswith("megatron") and not device.get("te"))
    row |= launch(case, recipe, sets, args.gpus, case_dir, args.case_timeout, device["cuda"])
    try:
        if row["rc"] != 0:
            raise RuntimeError(f"the run failed ({row['rc']}); see {case_dir / 'train.log'}")
        tokens_per_step = args.batch_per_gpu * args.gpus * seq
        row |= measure(case_dir, args.warmup, tokens_per_step, flops_token, args.gpus, device.get("peak_tflops"))
        p = row["plan"] or {}
        row["mem_vs_plan"] = row["peak_mem_gib"] / p["gpu_gib"] if row["peak_mem_gib"] and p.get("gpu_gib") else None
        row["ok"] = True
        del row["log_tail"]
    except (RuntimeError, ValueError, OSError, KeyError) as e:
        row["error"] = str(e)
        print(f"   FAILED: {e}\n{row['log_tail'][-1500:]}", flush=True)
    shutil.rmtree(case_dir / "checkpoints", ignore_errors=True)
    _print_row(row)
    return row


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _print_row(row: dict) -> None:
    p = row.get("plan") or {}
    if row["ok"]:
        ratio = row["mem_vs_plan"]
        print(f"   {row['tokens_per_s']:,.0f} tokens/s | {row['tflops_per_gpu']:.3g} TFLOP/s per GPU | "
              f"MFU {_fmt(row['mfu'], '.1%')} | peak {_fmt(row['peak_mem_gib'], '.1f')} GiB "
              f"(plan {_fmt(p.get('gpu_gib'), '.1f')} GiB, x{_fmt(ratio, '.2f')}"
              f"{'' if row['plan_models_run'] else ', plan models TE layers'}) | step {row['step_s']:.3f} s "
              f"(plan {_fmt(p.get('step_s'), '.3g')} s) | {row['wall_s']:.0f} s wall", flush=True)
    else:
        print(f"   no numbers: {row['error']} (plan {_fmt(p.get('gpu_gib'), '.1f')} GiB, {row['wall_s']:.0f} s wall)",
              flush=True)


def summary(rows: list[dict]) -> list[str]:
    """The cases as a Markdown table (what docs/performance.md quotes)."""
    out = ["| case | tokens/s | TFLOP/s per GPU | MFU | peak GiB | plan GiB | peak / plan | step s | plan step s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("plan") or {}
        if not r["ok"]:
            out.append(f"| {r['label']} | failed: {r['error']} | | | | {_fmt(p.get('gpu_gib'), '.1f')} | | | |")
            continue
        note = "" if r["plan_models_run"] else " (TE modelled)"
        out.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.3g} | {_fmt(r['mfu'], '.1%')} | "
                   f"{_fmt(r['peak_mem_gib'], '.1f')} | {_fmt(p.get('gpu_gib'), '.1f')}{note} | "
                   f"{_fmt(r.get('mem_vs_plan'), '.2f')} | {r['step_s']:.3g} | {_fmt(p.get('step_s'), '.3g')} |")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="processes (GPUs) per case, on this node (default 1)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--tiny", action="store_true", help="tiny model, seq 128, 1 warm-up + 1 measured step; runs on "
                    "CPU (fp32) when there is no GPU: what the test suite runs so the benchmark cannot rot")
    ap.add_argument("--seq-len", type=int, default=None, help="default 4096 (tiny: 128)")
    ap.add_argument("--batch-per-gpu", type=int, default=None, help="sequences per GPU per step (default 4; tiny 2)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: --batch-per-gpu (1 for Megatron's "
                    "local spec)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first, at least 1 (default 3; "
                    "tiny 1)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 10; tiny 1)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of one GPU, for MFU and the "
                    "plan (default: detected from the device name)")
    ap.add_argument("--case-timeout", type=int, default=600, help="seconds before a case is killed (default 600)")
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_gpu", help="run folders (default "
                    "runs/bench_gpu); each case's checkpoints are deleted when it ends")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default <workdir>/results.json)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    args.seq_len = args.seq_len or (128 if args.tiny else 4096)
    args.batch_per_gpu = args.batch_per_gpu or (2 if args.tiny else 4)
    args.warmup = args.warmup or (1 if args.tiny else 3)  # at least 1: its record starts the clock
    args.steps = args.steps or (1 if args.tiny else 10)
    args.out = args.out or args.workdir / "results.json"
    device = probe_device()
    if not device["cuda"] and not args.tiny:
        ap.error("no CUDA GPU here: this benchmark is for a GPU machine (--tiny runs its code path on CPU)")
    if device["cuda"] and args.gpus > device["count"]:
        ap.error(f"--gpus {args.gpus}, but this machine has {device['count']} GPU(s)")
    if args.peak_tflops:
        device["peak_tflops"] = args.peak_tflops
    precision = "bf16" if device["cuda"] else "fp32"  # the CPU rehearsal trains in fp32, as the tiny recipes do
    return _run(args, cases, device, precision, t0)


def _run(args, cases: list[str], device: dict, precision: str, t0: float) -> int:
    from toolkit.recipe import load_recipe
    from toolkit.metrics import count_params, flops_per_token

    shape = SHAPES["tiny" if args.tiny else "1b"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    recipe = (args.workdir / "bench_gpu.yaml").resolve()
    write_recipe(recipe, shape, args.seq_len, precision, args.warmup + args.steps)
    model = load_recipe(str(recipe)).model
    params, flops_token = count_params(model), flops_per_token(model, args.seq_len)
    where = (f"{args.gpus} x {device['name']} ({device['memory_gib']:.0f} GiB, bf16 peak "
             f"{_fmt(device.get('peak_tflops'), '.0f', 'unknown')} TFLOP/s), Transformer Engine "
             f"{'yes' if device.get('te') else 'no'}" if device["cuda"] else f"CPU, {args.gpus} process(es)")
    print(f"bench/gpu.py on {where}")
    print(f"model: {params['total'] / 1e6:,.1f}M parameters ({params['non_embedding'] / 1e6:,.1f}M non-embedding), "
          f"{flops_token / 1e9:.3g} GFLOP per token at seq {args.seq_len}, {precision}")
    print(f"tokens per step: {args.batch_per_gpu} x {args.seq_len} x {args.gpus} GPU = "
          f"{args.batch_per_gpu * args.seq_len * args.gpus:,}; {args.warmup} warm-up + {args.steps} measured steps")
    rows = [run_case(c, args, recipe, device, flops_token, args.seq_len) for c in cases]
    result = {"benchmark": "bench/gpu.py", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "device": device, "gpus": args.gpus, "precision": precision, "versions": versions(),
              "model": {**shape, "params": params["total"], "non_embedding_params": params["non_embedding"]},
              "flops_per_token": flops_token, "seq_len": args.seq_len, "batch_per_gpu": args.batch_per_gpu,
              "warmup_steps": args.warmup, "measured_steps": args.steps, "recipe": recipe.read_text(),
              "cases": rows, "wall_s": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("\n" + "\n".join(summary(rows)))
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} cases ran; {result['wall_s']:.0f} s in all; numbers in {args.out}")
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
