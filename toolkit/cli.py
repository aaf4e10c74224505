"""The `toolkit` command: validate, show and render recipes; inspect and convert checkpoints.

Heavy imports (torch, deepspeed, megatron) happen inside the subcommands that need them, so `validate` is fast.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import RecipeError, ToolkitError
from toolkit.repo import REPO_ROOT

if TYPE_CHECKING:
    from toolkit.recipe import Plan

DS_CONFIG_DIR = REPO_ROOT / "ds_configs"
# Each command imports what it needs (tests/test_layers.py: LAZY_FOR_STARTUP): the recipe schema, the planner and
# the doctor took 0.3 s to import here, which `toolkit convert` of a checkpoint never uses.


class _Parser(argparse.ArgumentParser):
    """argparse with the toolkit's error style: one line naming the problem and the fix, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def count(what: str, most: int):
    """An argparse type: a whole number from 1 to `most` (0, negatives and absurd sizes are typos, not defaults)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number; give {what}") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range; give {what}, from 1 to {most:,}")
        return value
    return parse


def amount(what: str, most: float):
    """An argparse type: a finite number above 0 and at most `most` (nan, inf, 0 and negatives are refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number; give {what}") from None
        if not (math.isfinite(value) and 0 < value <= most):
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range; give {what}, above 0 and at most "
                                             f"{most:,.0f}")
        return value
    return parse


RANKS = 1 << 20  # more ranks than any cluster has; the planner's search stays bounded
_WORLD = count("the number of ranks, e.g. 8", RANKS)


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="shipped recipe name (see `toolkit show --list`) or YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one recipe key, e.g. --set training.steps=20 (repeatable; wins over the file)")
    p.add_argument("--world-size", type=_WORLD, default=None,
                   help="ranks to check the layout against (default: the recipe's parallel.world_size)")


def _plan(args) -> Plan:
    from toolkit.recipe import load_recipe, resolve  # lazy: per command (above)

    return resolve(load_recipe(args.recipe, args.overrides), args.world_size, source=args.recipe)


def cmd_validate(args) -> int:
    from toolkit.adapters.megatron import check_megatron_model  # lazy: per command (above)

    plan = _plan(args)
    model_problems = check_megatron_model(plan.recipe) if plan.layout.backend == "megatron" else []
    if model_problems:  # no machine runs them (until 2026-12-07 a note, with exit 0)
        raise RecipeError(args.recipe, model_problems)
    if plan.layout.backend == "deepspeed" and plan.recipe.parallel.deepspeed.config:
        from toolkit.adapters.deepspeed import build_ds_config  # lazy: per command (above)

        build_ds_config(plan)  # the user's JSON against the recipe, as training reads it (unread until 2026-12-08)
    print(f"ok: {plan.recipe.name}: {plan.layout.describe()}")
    print(f"    {plan.batch.describe()} sequences of {plan.recipe.data.seq_len} tokens "
          f"= {plan.batch.global_batch * plan.recipe.data.seq_len:,} tokens per step")
    for note in plan.notes:
        print(f"    {note}")
    if plan.layout.backend == "megatron":
        from toolkit.adapters.megatron import check_megatron  # lazy: per command (above)
        from toolkit.megatron.runtime import te_available  # lazy: pulls in torch; validate stays a light command

        for p in check_megatron(plan.recipe, te_available())[len(model_problems):]:
            print(f"    note: launched on this machine, the run would stop at: {p.key}: {p.message}")
    return 0


def cmd_show(args) -> int:
    import yaml  # lazy: per command (above)

    from toolkit.recipe import list_recipes  # lazy: per command (above)
    from toolkit.recipe.schema import explain  # lazy: per command (above)

    listing = [f"--{n}" for n in ("list", "explain") if getattr(args, n)]
    given = [f"--{n.replace('_', '-')}" for n in ("recipe", "overrides", "world_size")
             if getattr(args, n, None) not in (None, [])]
    if len(listing) > 1 or (listing and given):
        raise ToolkitError(f"toolkit show: {' and '.join(listing + given)} do not go together; "
                           "--list, --explain and --recipe each print one thing (pass one of them)")
    if args.list:
        print("\n".join(list_recipes()))
        return 0
    if args.explain:
        print("\n".join(explain()))
        return 0
    if not args.recipe:
        raise ToolkitError("toolkit show needs --recipe NAME (or --list / --explain)")
    plan = _plan(args)
    print(f"# {plan.layout.describe()}")
    for note in plan.notes:
        print(f"# {note}")
    print(yaml.safe_dump(plan.resolved(), sort_keys=False), end="")
    return 0


def _all_alone(args, command: str, what: str, names: tuple[str, ...]) -> None:
    """`--all` (rewrite the shipped files) with another option: refused, not ignored (until 2026-12-07)."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) not in (None, False, [])]
    if given:
        raise ToolkitError(f"{command} --all rewrites the shipped {what} in {REPO_ROOT} and takes no "
                           f"{', '.join(given)}; drop --all to render one recipe (or drop {', '.join(given)})")


def cmd_render_ds(args) -> int:
    if args.all:
        _all_alone(args, "toolkit render ds-config", "DeepSpeed configs", ("recipe", "overrides"))
        from toolkit.adapters.deepspeed import write_shipped_configs  # lazy: per command (above)

        for out in write_shipped_configs(DS_CONFIG_DIR):
            print(f"wrote {out}")
        return 0
    if not args.recipe:
        raise ToolkitError("toolkit render ds-config needs --recipe NAME (or --all)")
    plan = _plan(args)
    if plan.layout.backend != "deepspeed":
        raise ToolkitError(f"recipe {args.recipe} uses backend {plan.layout.backend!r}; there is no DeepSpeed "
                           "config to render")
    from toolkit.adapters.deepspeed import build_ds_config  # lazy: per command (above)

    print(json.dumps(build_ds_config(plan, args.device), indent=2))
    return 0


def cmd_render_megatron(args) -> int:
    plan = _plan(args)
    if plan.layout.backend != "megatron":
        raise ToolkitError(f"recipe {args.recipe} uses backend {plan.layout.backend!r}; there is no Megatron "
                           "config to render")
    from toolkit.adapters.megatron import to_json_dict  # lazy: per command (above)

    print(json.dumps(to_json_dict(plan.recipe, plan.layout, args.device == "cuda"), indent=2))
    return 0


def cmd_inspect(args) -> int:
    from toolkit.checkpoint.inspect import inspect, render  # lazy: pulls in torch (seconds) for this command only

    report = inspect(args.checkpoint)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["complete"] else 1


def cmd_convert(args) -> int:
    """`toolkit convert`. Ctrl-C and SIGTERM (scancel, a Slurm time limit, docker stop, kill) stop it: the partial
    output is removed on the way out (toolkit/checkpoint/output.py scratch_folder, stop_on_signals), an existing DST
    is left as it was, and one line says so (before, SIGTERM killed the process and left a hidden
    `.DST.partial-PID`)."""
    from toolkit.checkpoint.output import stop_on_signals  # lazy: as _convert's imports

    before = _identity(args.dst)
    with stop_on_signals() as got:
        try:
            return _convert(args)
        except KeyboardInterrupt:
            name = {signal.SIGTERM: "SIGTERM"}.get(got[0] if got else None, "Ctrl-C")
            if _identity(args.dst) not in (before, None):  # it came once the output was in place (output.replace)
                print(f"error: interrupted ({name}) just after {args.dst} was written: it is complete",
                      file=sys.stderr)
            else:
                print(f"error: interrupted ({name}): the conversion stopped and its partial output was removed; "
                      f"{args.dst} is as it was. Run the same command again to convert", file=sys.stderr)
            return 128 + (got[0] if got else signal.SIGINT)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _convert(args) -> int:
    from toolkit.checkpoint.copy_only import convert_by_copy  # lazy: `validate` and `plan` never need it
    from toolkit.checkpoint.output import left_behind  # lazy: as above

    if args.vpp > 1 and args.pp == 1:  # as the recipe's check (toolkit/recipe/checks.py): Megatron would not run it
        raise ToolkitError(f"--vpp {args.vpp} virtual chunks need pipeline parallelism, but --pp is 1; pass --pp 2 or "
                           "more, or drop --vpp. Nothing was written")

    if args.verify and args.no_verify:
        raise ToolkitError("--verify and --no-verify contradict each other: pass one (verification is the default)")
    for name, value in (("SRC", args.src), ("DST", args.dst)):
        if not value.strip():  # Path("") is "." (the working folder), which the user did not name
            raise ToolkitError(f"{name} is empty; give the checkpoint folder's path. Nothing was written")
    dst = Path(args.dst)
    if dst.name in ("", ".", ".."):  # "." or "a/..": a folder named by where it is, which has no name to swap in
        args.dst = os.path.abspath(dst)  # until 2026-12-07 `DST=. --overwrite` ended in a traceback
        dst = Path(args.dst)
    if ".." in dst.parts[:-1]:  # `a/new/../out`: mkdir would make a/new (left behind) just to walk back out of it
        args.dst = str(Path(os.path.realpath(dst.parent)) / dst.name)
    for line in left_behind(Path(args.dst)):  # what a killed conversion to DST left beside it (SIGKILL)
        print(f"note: {line}", file=sys.stderr)
    if "torch" not in sys.modules:  # read once, when torch loads its OpenMP runtime
        # the verification's forward: OpenMP's threads sleep between its parallel regions instead of spinning,
        # which took a fifth of the check's CPU time from its hash threads on 2 cores (docs/performance.md)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    options = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, dtype=args.dtype, vocab_size=args.vocab_size,
                   fp32=args.fp32, weights_only=args.weights_only, overwrite=args.overwrite,
                   verify=not args.no_verify, dp=args.dp, progress=not args.quiet, config=args.config,
                   verbose=args.verbose, divisible_by=args.divisible_by, tokenizer=args.tokenizer)
    out, announced = convert_by_copy(args.src, args.dst, args.to, **options, verifier=_copy_check)
    if out is not None:  # a conversion that only copies bytes: made without loading torch
        print(f"wrote {out}")
        return 0
    from toolkit.checkpoint.convert import convert  # lazy: pulls in torch (seconds) for this command only

    gc.freeze()  # the imports' objects (torch's: hundreds of thousands) out of the collector's sight: every full
    # collection of a conversion (rank files unpickle many small objects) would walk them all again
    try:
        out = convert(args.src, args.dst, args.to, **options, copy=False, announced=announced)
    finally:
        gc.unfreeze()  # collectable again (main() also runs inside other processes, e.g. the tests')
    print(f"wrote {out}")
    return 0


def _copy_check():
    """The full path's check of a verified conversion the copy path made (run on its background thread)."""
    from toolkit.checkpoint.convert import CopyCheck  # lazy: pulls in torch, while the copy writes

    return CopyCheck


def cmd_data_prepare(args) -> int:
    from toolkit.data.indexed import prepare  # lazy: pulls in torch and megatron for this command only

    s = prepare(args.input, args.output, args.tokenizer, workers=args.workers, text_field=args.text_field,
                fmt=args.format, hub_dataset=args.hub_dataset, overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote {args.output}.bin/.idx: {s['documents']:,} documents, {s['tokens']:,} tokens in {s['seconds']:.1f} s "
          f"({s['tokens'] / max(s['seconds'], 1e-9):,.0f} tokens/s, {args.workers} workers); tokenizer recorded in "
          f"{args.output}.tokenizer.json")
    return 0


def cmd_slurm_render(args) -> int:
    from toolkit.slurm import render_job, write_job, write_shipped  # lazy: per command (above)

    if args.all:
        _all_alone(args, "toolkit slurm render", "scripts", ("recipe", "nodes", "gpus_per_node", "out", "overrides",
                                                             "partition", "time", "account", "job_name", "cpu",
                                                             "mem"))
        for path in write_shipped():
            print(f"wrote {path}")
        return 0
    if args.recipe is None or args.nodes is None or args.gpus_per_node is None:
        raise ToolkitError("toolkit slurm render needs --recipe NAME --nodes N --gpus-per-node G (or --all)")
    script = render_job(args.recipe, args.nodes, args.gpus_per_node, args.overrides, partition=args.partition,
                        time=args.time, account=args.account, job_name=args.job_name,
                        signal_seconds=args.signal_seconds, cpu=args.cpu, cpus_per_task=args.cpus_per_task,
                        mem=args.mem)
    if args.out:
        print(f"wrote {write_job(script, args.out, overwrite=args.overwrite)}")
    else:
        print(script, end="")
    if not args.cpu:
        from toolkit.plan import signal_note  # lazy: per command (above)

        for note in signal_note(args.recipe, args.overrides, args.nodes, args.gpus_per_node, args.signal_seconds):
            print(note, file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    from toolkit.plan import command as plan_command  # lazy: per command (above)

    return plan_command.run(args)


def cmd_doctor(args) -> int:
    from toolkit import doctor  # lazy: per command (above)
    from toolkit.plan import offload_host_bytes  # lazy: per command (above)
    from toolkit.recipe import load_recipe  # lazy: per command (above)

    recipe = load_recipe(args.recipe, args.overrides) if args.recipe is not None else None
    findings = doctor.run(recipe, nodes=args.nodes, offload_need=lambda per_node: offload_host_bytes(recipe, per_node))
    print(json.dumps(doctor.as_json(findings), indent=2) if args.json else doctor.render(findings))
    return 1 if any(f.status == doctor.FAIL for f in findings) else 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="toolkit", description="Train Llama models on DeepSpeed or Megatron-Core from "
                                 "one recipe: validate, show and render recipes; inspect and convert checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a recipe for a world size and print its batch arithmetic")
    _recipe_args(p)
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("show", help="print the fully resolved recipe (defaults, base, presets, overrides, derived)")
    _recipe_args(p)
    p._option_string_actions["--recipe"].required = False
    p.add_argument("--list", action="store_true", help="list the shipped recipes")
    p.add_argument("--explain", action="store_true", help="list every recipe key with its default and meaning")
    p.set_defaults(func=cmd_show)
    render = sub.add_parser("render", help="render framework configs from a recipe")
    rsub = render.add_subparsers(dest="what", required=True)
    p = rsub.add_parser("ds-config", help="print the DeepSpeed JSON a recipe runs with")
    _recipe_args(p)
    p._option_string_actions["--recipe"].required = False
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="render for GPUs (default) or CPU")
    p.add_argument("--all", action="store_true", help="rewrite ds_configs/<name>.json for every shipped recipe")
    p.set_defaults(func=cmd_render_ds)
    p = sub.add_parser("inspect", help="format, layout, architecture, size, step and completeness of a checkpoint")
    p.add_argument("checkpoint", help="a Hugging Face folder, a step_* folder, or a checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("convert", help="convert a checkpoint to another format or parallel layout (streaming, "
                       "verified, all-or-nothing)", description="Convert SRC to DST. SRC's format and layout are "
                       "read from its own files: a Hugging Face folder, a toolkit Megatron or DeepSpeed checkpoint "
                       "(step_* folder or its directory), a plain DeepSpeed checkpoint (the folder engine.save_checkpoint "
                       "wrote, or a global_step* folder in it), a universal one (--to hf), or Megatron-LM's (legacy or torch_dist).")
    p.add_argument("src", help="the checkpoint to read")
    p.add_argument("dst", help="the folder to write (must not exist unless --overwrite)")
    p.add_argument("--to", choices=["hf", "megatron", "torch_dist", "megatron_lm", "deepspeed", "universal"],
                   required=True,
                   help="hf: a Hugging Face folder; megatron: a toolkit Megatron checkpoint at --tp/--pp/--vpp "
                   "(with the optimizer state when SRC has it, so training resumes on the new layout); torch_dist: "
                   "Megatron-Core's distributed checkpoint and megatron_lm: Megatron-LM's legacy layout, at --tp/--pp/--vpp "
                   "(with the optimizer state when SRC has it); deepspeed: "
                   "a DeepSpeed ZeRO checkpoint (the toolkit's or a plain one) at another data-parallel size (--dp); universal: DeepSpeed's universal "
                   "checkpoint of a ZeRO-1/2/3 one, which engine.load_checkpoint loads at any DP size with ds_config checkpoint.load_universal")
    p.add_argument("--tp", type=count("a tensor-parallel size, e.g. 2", RANKS), default=1, help="tensor-parallel size of a Megatron target (default 1)")
    p.add_argument("--pp", type=count("a pipeline-parallel size, e.g. 2", RANKS), default=1, help="pipeline-parallel size of a Megatron target (default 1)")
    p.add_argument("--vpp", type=count("virtual chunks per rank, e.g. 2", 1024), default=1, help="virtual pipeline chunks per rank (default 1)")
    p.add_argument("--ep", type=count("an expert-parallel size, e.g. 2", RANKS), default=1,
                   help="expert-parallel size of a toolkit Megatron or Megatron-LM legacy target, mixture-of-experts models; "
                        "of a torch_dist target, the run's that loads its optimizer state (default 1)")
    p.add_argument("--dp", type=count("a data-parallel size, e.g. 4", RANKS), default=None, help="data-parallel size of a DeepSpeed target")
    p.add_argument("--vocab-size", type=count("the vocabulary size, e.g. 32000", 1 << 24), default=None, help="true vocabulary size (Megatron-LM sources)")
    p.add_argument("--make-vocab-size-divisible-by", type=count("a divisor, e.g. 64", 1 << 24), metavar="N",
                   dest="divisible_by", help="Megatron targets: pad the vocabulary to N x --tp (default: the source's N)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast the weights")
    p.add_argument("--fp32", action="store_true", help="DeepSpeed sources: take the fp32 master weights from the "
                   "optimizer files instead of the model states")
    p.add_argument("--config", default=None, help="plain DeepSpeed checkpoints (engine.save_checkpoint without "
                   "the toolkit): the model's Hugging Face folder or config.json, when the checkpoint holds none")
    p.add_argument("--weights-only", action="store_true", help="leave the optimizer state behind")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="--to hf: copy the tokenizer files of this local "
                   "folder into DST (a training run's checkpoint holds none; its recipe's data.tokenizer is not read)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST, once the new checkpoint is complete, if DST is an earlier output of "
                   "toolkit convert (its .toolkit_output.json lists every entry) or empty")
    p.add_argument("--verify", action="store_true", help="read every tensor back and check its hash (XXH3-128), shape "
                   "and dtype against the source's, and run transformers' model on the output's weights layer by "
                   "layer (the default; kept for clarity)")
    p.add_argument("--no-verify", action="store_true", help="skip the read-back and logit checks")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--verbose", action="store_true", help="also print the time of each phase (read, split, write, "
                   "verify)")
    p.set_defaults(func=cmd_convert)
    p = rsub.add_parser("megatron-config", help="print the Megatron-Core arguments a recipe runs with")
    _recipe_args(p)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="render for GPUs (default) or CPU")
    p.set_defaults(func=cmd_render_megatron)
    p = sub.add_parser("plan", help="per-GPU memory, FLOPs, communication and step time of a recipe's layout, and "
                       "every layout that fits N GPUs, ranked")
    p.add_argument("--recipe", required=True, help="shipped recipe name or YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one recipe key (repeatable)")
    p.add_argument("--gpus", type=count("the number of GPUs, e.g. 8", RANKS), required=True, help="GPUs to plan for")
    p.add_argument("--gpus-per-node", type=count("GPUs per node, e.g. 8", 1024), default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-memory", type=amount("one GPU's memory in GiB, e.g. 80", 100_000), default=80.0, metavar="GiB", help="memory of one GPU (default 80)")
    p.add_argument("--cpu-memory", type=amount("host RAM per node in GiB, e.g. 1024", 10_000_000), default=None, metavar="GiB", help="host RAM per node (default 1024)")
    p.add_argument("--nvme", type=amount("local NVMe per node in GiB, e.g. 3500", 100_000_000), default=None, metavar="GiB", help="local NVMe per node (default 3500)")
    p.add_argument("--peak-tflops", type=amount("one GPU's dense 16-bit TFLOPS, e.g. 989", 1_000_000), default=None, help="dense 16-bit peak of one GPU (default 989, H100)")
    p.add_argument("--backend", choices=["any", "deepspeed", "megatron"], default="any",
                   help="layouts of one backend only (default: both)")
    p.add_argument("--top", type=count("how many layouts to show, e.g. 8", 100_000), default=8, help="ranked layouts to show (default 8)")
    p.add_argument("--json", action="store_true", help="the same numbers as JSON")
    p.add_argument("--write", metavar="PATH", help="save the fastest layout that fits as a recipe (base: this one)")
    p.add_argument("--overwrite", action="store_true", help="let --write replace an existing file")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("doctor", help="check this machine and launch environment: versions, GPUs, NCCL, "
                       "DeepSpeed ops, compilers, libaio, network settings, disk for checkpoints")
    p.add_argument("--recipe", help="judge only what this recipe uses; check its checkpoint directory's free disk "
                   "and its nvme_path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (repeatable)")
    p.add_argument("--nodes", type=count("the number of nodes, e.g. 2", 65_536), default=None, help="nodes of the job to check the network settings for "
                   "(default: SLURM_JOB_NUM_NODES, else 1)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_doctor)
    data = sub.add_parser("data", help="prepare training data")
    p = data.add_subparsers(dest="what", required=True).add_parser(
        "prepare", help="tokenize text/jsonl/parquet files (or a hub dataset) once into Megatron-Core's indexed "
        "dataset (PREFIX.bin/.idx), for data.blend", description="Tokenize documents once, in parallel, into "
        "Megatron-Core's indexed dataset format with its own IndexedDatasetBuilder (EOS appended to each document). "
        "PREFIX.tokenizer.json records the tokenizer, so a recipe with another one is refused.")
    p.add_argument("--input", nargs="+", default=[], help="text/jsonl/json/parquet files or globs")
    p.add_argument("--hub-dataset", default=None, help="a `datasets` hub name instead of --input (needs network)")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx, "
                   "PREFIX.tokenizer.json")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (or hub name), as the recipe's data.tokenizer")
    p.add_argument("--workers", type=count("worker processes, e.g. 8", 4096), default=1,
                   help="tokenizing processes (default 1)")
    p.add_argument("--text-field", default="text", help="column holding the text in json/parquet (default text)")
    p.add_argument("--format", choices=["auto", "text", "json", "parquet"], default="auto",
                   help="input format (default: from the extension)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_data_prepare)
    slurm = sub.add_parser("slurm", help="Slurm batch scripts for a recipe")
    p = slurm.add_subparsers(dest="what", required=True).add_parser(
        "render", help="print (or --out) the sbatch script that trains a recipe on nodes x GPUs, checked first",
        description="Render an sbatch script: one torchrun per node under srun, an all-reduce preflight, and a "
        "requeue when the trainer checkpoints after Slurm's SIGUSR1. The layout is checked for nodes x GPUs first.")
    p.add_argument("--recipe", help="shipped recipe name (see `toolkit show --list`) or YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one recipe key (repeatable); the job passes it to training too")
    p.add_argument("--nodes", type=count("the number of nodes, e.g. 2", 65_536), help="nodes to allocate (one torchrun each)")
    p.add_argument("--gpus-per-node", type=count("ranks per node, e.g. 8", 1024), help="GPUs per node, one rank each (with --cpu: CPU ranks per node)")
    p.add_argument("--partition", help="#SBATCH --partition")
    p.add_argument("--time", help="#SBATCH --time, e.g. 24:00:00 (default: the partition's limit)")
    p.add_argument("--account", help="#SBATCH --account")
    p.add_argument("--job-name", help="#SBATCH --job-name (default: the recipe's name)")
    p.add_argument("--signal-seconds", type=count("seconds, e.g. 120", 65_535), default=120,  # Slurm's own limit
                   help="send SIGUSR1 this long before the time limit, to checkpoint and requeue (default 120)")
    p.add_argument("--cpus-per-task", type=count("cores per node, e.g. 64", 100_000), default=None,
                   help="cores per node for its torchrun (default 8 per GPU, or 1 per rank with --cpu)")
    p.add_argument("--mem", help="#SBATCH --mem per node, e.g. 500G (default 0: all of it; none with --cpu)")
    p.add_argument("--cpu", action="store_true", help="CPU nodes: no GPUs requested, gloo instead of NCCL")
    p.add_argument("--out", help="write the script to this file instead of printing it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--all", action="store_true", help="rewrite slurm/*.sbatch (toolkit.slurm.SHIPPED)")
    p.set_defaults(func=cmd_slurm_render)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except RecursionError:  # a JSON or pickle file nested thousands deep (no library writes one) where no reader
        # of ours names the file: one line all the same
        print("error: an input file nests deeper than Python can read (a JSON or pickle file no library writes); "
              "re-copy or re-save it. Nothing was written", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `toolkit plan ... | head`: the reader left; not an error of ours
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at interpreter exit
        return 0


def entry() -> None:
    """The `toolkit` command: main(), then an exit that skips the interpreter's teardown. After a conversion that has
    imported torch and transformers the teardown took 0.3-0.5 s on the 2-core VM (docs/performance.md), with every
    file already written, closed and renamed into place and every worker thread joined; standard output, standard
    error and logging are flushed first. An exception main() does not handle still ends the usual way."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left (`| head`) or a closed stream: nothing more to say
            pass
    os._exit(0 if code is None else int(code))  # as sys.exit(code) would end it


if __name__ == "__main__":
    entry()
