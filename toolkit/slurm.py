"""Slurm batch scripts for a recipe: checked against nodes x GPUs with the recipe's own rules, then rendered.

    toolkit slurm render --recipe llama7b_zero3 --nodes 4 --gpus-per-node 8 > job.sbatch && sbatch job.sbatch
    toolkit slurm render --all          # rewrite the shipped scripts in slurm/ (SHIPPED below)

A rendered script is a short header: #SBATCH lines, this job's inputs (recipe, overrides, ranks per node, device)
and the lines that source slurm/job.sh, the job body shared by every script (shellcheck checks both). The body
runs one torchrun per node under srun, after an all-reduce preflight (toolkit/preflight.py). Slurm sends SIGUSR1
`signal_seconds` before the time limit; the trainer checkpoints one or two steps later, leaves
<output_dir>/preempted.json and exits with REQUEUE_EXIT (toolkit/train/preempt.py); the body then requeues the
job, which resumes from that checkpoint (checkpoint.resume: auto). Only the standard library and the recipe
loader are imported here, so anything may import the constants below cheaply.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from toolkit.errors import Problem, RecipeError, ToolkitError
from toolkit.format.paths import check_write_path, write_replacing
from toolkit.recipe import load_recipe, resolve
from toolkit.recipe.loader import REPO_ROOT

REQUEUE_EXIT = 75
"""EX_TEMPFAIL: checkpoint written after a preemption signal; the job script requeues the job."""
PREEMPTED_MARKER = "preempted.json"
"""What rank 0 leaves in <output_dir> with that checkpoint. The script requeues on it, not on the exit code alone:
torchrun reports any failed worker as exit 1, and srun the highest code of its tasks (or 128 + signal)."""
SLURM_DIR = REPO_ROOT / "slurm"
JOB_SH = SLURM_DIR / "job.sh"
"""The job body every rendered script sources (from the submission folder, the repository root) and runs. It sets
REQUEUE_EXIT and MARKER_NAME to the two constants above (a test keeps them in sync)."""
CPUS_PER_GPU = 8
"""Default --cpus-per-task is this many cores per GPU (1 per rank with --cpu); --cpus-per-task overrides."""

SHIPPED: dict[str, dict] = {
    "llama7b_zero3": {"recipe": "llama7b_zero3", "nodes": 4, "gpus_per_node": 8},
    # --signal-seconds as `toolkit slurm render` advises for each (toolkit/plan/signal.py): 120 s was less than two
    # steps and a save of the 70B, 8B and 13B layouts (a trial of 2026-12-07)
    "llama13b_tp4_pp2": {"recipe": "llama13b_tp4_pp2", "nodes": 2, "gpus_per_node": 8, "signal_seconds": 240},
    "llama3_8b_zero3": {"recipe": "llama3_8b_zero3", "nodes": 2, "gpus_per_node": 8, "signal_seconds": 240},
    "llama70b_tp8_pp4": {"recipe": "llama70b_tp8_pp4", "nodes": 8, "gpus_per_node": 8, "signal_seconds": 420},
    "tiny_zero3_cpu": {"recipe": "tiny_zero3", "nodes": 1, "gpus_per_node": 2, "cpu": True, "time": "00:20:00"},
    "tiny_tp2_cpu": {"recipe": "tiny_tp2", "nodes": 1, "gpus_per_node": 2, "cpu": True, "time": "00:20:00"},
}
"""The scripts in slurm/: file stem -> render_job arguments. `toolkit slurm render --all` writes them."""


def render_job(recipe_name_or_path: str, nodes: int, gpus_per_node: int, overrides: list[str] | None = None,
               partition: str | None = None, time: str | None = None, account: str | None = None,
               job_name: str | None = None, signal_seconds: int = 120, cpu: bool = False,
               cpus_per_task: int | None = None, mem: str | None = None) -> str:
    """The sbatch script that trains `recipe_name_or_path` on nodes x gpus_per_node ranks (CPU ranks with `cpu`).
    Raises RecipeError with every problem (arguments, recipe, layout for that world size) before anything else.
    `mem`: #SBATCH --mem; a GPU job asks for all of each node's memory (0) unless told otherwise."""
    overrides = list(overrides or [])
    problems = check_job_args(nodes, gpus_per_node, partition, time, account, job_name, signal_seconds, cpus_per_task,
                              mem)
    try:
        recipe = load_recipe(recipe_name_or_path, overrides)
    except RecipeError as e:
        raise RecipeError(e.source, problems + e.problems) from None
    world = nodes * gpus_per_node
    problems += check_world_size(recipe.parallel.world_size, nodes, gpus_per_node, cpu)
    plan = None
    try:
        plan = resolve(recipe, world, source=recipe_name_or_path) if world > 0 else None
    except RecipeError as e:
        problems += e.problems
    if plan is not None:
        problems += check_tp_in_node(plan.layout, gpus_per_node)
    if problems:
        raise RecipeError(recipe_name_or_path, problems)
    command = _command_line(recipe_name_or_path, nodes, gpus_per_node, overrides, partition=partition, time=time,
                            account=account, job_name=job_name, signal_seconds=signal_seconds, cpu=cpu,
                            cpus_per_task=cpus_per_task, mem=mem)
    # without --mem a cluster's per-CPU default applies, which can be too little for a checkpoint save's or an
    # offload's host memory (no --mem was rendered until 2026-12-07); a CPU rehearsal shares its node
    node_mem = mem if mem is not None or cpu else "0"
    mem_lines = [] if node_mem is None else [f"#SBATCH --mem={node_mem}"]
    if node_mem == "0":
        mem_lines.insert(0, "# --mem=0: all of each node's memory (render with --mem SIZE to ask for less)")
    header = [
        "#!/bin/bash",
        (f"# Slurm job for recipe {recipe_name_or_path}: {nodes} node{'s' * (nodes > 1)} x {gpus_per_node} "
         f"{'CPU ranks' if cpu else 'GPUs'}; {plan.layout.describe()}"),
        f"# {plan.batch.describe()} sequences of {recipe.data.seq_len} tokens",
        f"# Rendered by `{command}`: re-render rather than edit.",
        "# Submit from the repository root (the job runs there; Slurm does not create logs/):",
        "#     mkdir -p logs && sbatch THIS_FILE [--set KEY=VALUE ...]",
        f"#SBATCH --job-name={job_name or recipe.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([] if cpu else [f"#SBATCH --gpus-per-node={gpus_per_node}"]),
        f"#SBATCH --cpus-per-task={cpus_per_task or gpus_per_node * (1 if cpu else CPUS_PER_GPU)}",
        *mem_lines,
        *(f"#SBATCH --{k}={v}" for k, v in (("time", time), ("partition", partition), ("account", account)) if v),
        "#SBATCH --output=logs/%x-%j.out",
        f"#SBATCH --signal=USR1@{signal_seconds}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "",
        "# ---- this job's inputs; the job itself is slurm/job.sh, the same for every rendered script ----",
        f"RECIPE={shlex.quote(recipe_name_or_path)}",
        (f"OVERRIDES=({' '.join(a for o in overrides for a in ('--set', shlex.quote(o)))})"
         "  # --set KEY=VALUE, given to validate and to training alike"),
        f"RANKS_PER_NODE={gpus_per_node}  # torchrun --nproc_per_node: " + ("CPU ranks" if cpu else "one per GPU"),
        f"DEVICE={'cpu' if cpu else 'cuda'}  # cuda: NCCL on GPUs; cpu: gloo on CPU cores (a rehearsal)",
        "",
        "# sbatch runs a copy of this file from its spool folder: the job body is found from the submission folder",
        f"JOB_BODY=${{SLURM_SUBMIT_DIR:-$PWD}}/{JOB_SH.relative_to(REPO_ROOT)}",
        '[[ -f $JOB_BODY ]] || { echo "error: no $JOB_BODY: submit from the repository root" >&2; exit 2; }',
        f"# shellcheck source={JOB_SH.relative_to(REPO_ROOT)}",
        'source "$JOB_BODY"',
        'main "$@"',
    ]
    return "\n".join(header) + "\n"


def _command_line(recipe: str, nodes: int, gpus_per_node: int, overrides: list[str], **options) -> str:
    """The `toolkit slurm render` command that gives this script (defaults left out)."""
    cmd = ["toolkit", "slurm", "render", "--recipe", recipe, "--nodes", str(nodes), "--gpus-per-node",
           str(gpus_per_node), *(a for o in overrides for a in ("--set", o))]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (None, False) and not (key == "signal_seconds" and value == 120):
            cmd += [flag, str(value)]
    return shlex.join(cmd)


def check_job_args(nodes: int, gpus_per_node: int, partition: str | None, time: str | None, account: str | None,
                   job_name: str | None, signal_seconds: int, cpus_per_task: int | None,
                   mem: str | None = None) -> list[Problem]:
    """Slurm arguments that sbatch would refuse, or that would make the preemption signal useless."""
    out = [Problem(flag, f"{v} must be at least 1", "give a positive count")
           for flag, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node),
                           ("--cpus-per-task", cpus_per_task or 1)) if v < 1]
    for flag, value in (("--partition", partition), ("--account", account), ("--job-name", job_name)):
        if value is not None and not re.fullmatch(r"[A-Za-z0-9._,-]+", value):
            out.append(Problem(flag, f"{value!r} has characters Slurm names do not use",
                               "use letters, digits, '.', '_', '-' (partitions may be a comma list)"))
    if mem is not None and not re.fullmatch(r"\d+[KMGT]?", mem):
        out.append(Problem("--mem", f"{mem!r} is not a Slurm memory size",
                           "use a number with an optional unit K, M, G or T, e.g. 500G, or 0 (all of it)"))
    limit = time_limit_seconds(time) if time is not None else None
    if limit == -1:
        out.append(Problem("--time", f"{time!r} is not a Slurm time limit",
                           "use MINUTES, HH:MM:SS, D-HH or D-HH:MM:SS, e.g. 24:00:00 or 2-00:00:00"))
    if not 0 <= signal_seconds <= 65535:
        out.append(Problem("--signal-seconds", f"{signal_seconds} is outside Slurm's 0..65535",
                           "use the seconds a checkpoint needs, with a margin (default 120)"))
    elif limit and limit > 0 and signal_seconds >= limit:
        out.append(Problem("--signal-seconds", f"{signal_seconds} s before the end is not within the time limit "
                           f"{time} ({limit} s): the signal would come at the start",
                           "lengthen --time or lower --signal-seconds"))
    return out


def check_world_size(recipe_world: int | None, nodes: int, per_node: int, cpu: bool) -> list[Problem]:
    """The recipe's parallel.world_size, when it names one, must be the job's nodes x ranks per node."""
    world = nodes * per_node
    if not recipe_world or world < 1 or recipe_world == world:
        return []
    what = "CPU ranks per node" if cpu else "GPUs per node"
    fixes = [f"--nodes {recipe_world // per_node} --gpus-per-node {per_node}"] * (recipe_world % per_node == 0)
    fixes += [f"--nodes {nodes} --gpus-per-node {recipe_world // nodes}"] * (recipe_world % nodes == 0 and not fixes)
    fix = f"render with {fixes[0]}, or " if fixes else ""
    return [Problem("parallel.world_size", f"the recipe is written for {recipe_world} ranks, but --nodes {nodes} x "
                    f"--gpus-per-node {per_node} ({what}) = {world}",
                    f"{fix}run it at {world} ranks with --set parallel.world_size={world} (dp and the batch "
                    "arithmetic are then derived and checked for that size)")]


def check_tp_in_node(layout, per_node: int) -> list[Problem]:
    """Tensor parallelism inside a node: its all-reduces run every layer, and across nodes they take most of the step
    (`toolkit plan` shows it); rendered without a word until 2026-12-07. Ranks are numbered node by node, so a tp
    that divides the ranks per node keeps every group on one node."""
    if layout.tp <= 1 or per_node % layout.tp == 0:
        return []
    return [Problem("parallel.tp", f"tp={layout.tp} does not divide the {per_node} ranks per node, so tensor-parallel "
                    "groups would span nodes (their all-reduces run every layer, over the network)",
                    f"render with --gpus-per-node a multiple of {layout.tp}, or lower parallel.tp and raise pp")]


def time_limit_seconds(limit: str) -> int | None:
    """Seconds in a Slurm --time value (None when unlimited, -1 when malformed)."""
    if limit.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?", limit)
    if m:
        d, h, mi, s = (int(x or 0) for x in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + s
    parts = [int(x) for x in limit.split(":")] if re.fullmatch(r"\d+(:\d+){0,2}", limit) else []
    if not parts:
        return -1
    h, mi, s = (0, parts[0], 0) if len(parts) == 1 else (0, *parts) if len(parts) == 2 else parts
    return (h * 60 + mi) * 60 + s


def write_job(script: str, out: str | Path, overwrite: bool = False) -> Path:
    """Write a rendered script; an existing file is kept unless `overwrite`. A link at `out` is replaced, not
    written through (it was until 2026-12-07), and a missing folder is not created (as `plan --write`)."""
    out = Path(out)
    check_write_path(out, overwrite, "--out")
    write_replacing(out, script)
    return out


def render_shipped(name: str) -> str:
    """The text of slurm/<name>.sbatch, from its SHIPPED entry."""
    args = dict(SHIPPED[name])
    return render_job(args.pop("recipe"), **args)


def write_shipped() -> list[Path]:
    """Rewrite slurm/<name>.sbatch for every entry of SHIPPED; every script is rendered before any is written."""
    scripts = {name: render_shipped(name) for name in SHIPPED}
    SLURM_DIR.mkdir(exist_ok=True)
    return [write_job(text, SLURM_DIR / f"{name}.sbatch", overwrite=True) for name, text in scripts.items()]
