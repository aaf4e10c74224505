"""Fault injection against real 2-rank training runs, both backends: kill a rank (SIGKILL) at a chosen phase
of a chosen step, or preempt the job with two SIGUSR1s, or damage the newest checkpoint on disk; relaunch; check
that no completed checkpoint was lost, that a damaged one was never resumed from, and that every step after the
resume has the uninterrupted run's loss, bit for bit.

    python tests/fault_harness.py --trials 40 --seed 1 [--backends deepspeed megatron] [--out report.json]

The test suite runs a few trials (tests/test_fault_injection.py); the long run is this command.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import REPO, free_port, read_metrics, run_ranks, signal_process_tree  # noqa: E402
from toolkit.train.faults import PHASES  # noqa: E402

STEPS, INTERVAL = 8, 2
RUN = [f"training.steps={STEPS}", "training.schedule.warmup_steps=2", "logging.interval=1",
       f"checkpoint.interval={INTERVAL}", "checkpoint.keep=100", "logging.sample_prompt=", "logging.tensorboard=false"]
BACKENDS = {"deepspeed": "tiny_zero2", "megatron": "tiny_tp2", "megatron_td": "tiny_tp2"}
EXTRA = {"megatron_td": ("checkpoint.format=torch_dist",)}
"""Overrides of a backend's runs beyond RUN: megatron_td saves through Megatron-Core's dist_checkpointing.save
(the same training, so the same reference losses as megatron's)."""
KINDS = (*PHASES, "torn", "signal", "corrupt")
SAVE_PHASES = ("save-files", "save-flushed", "save-meta", "torn")


@dataclass
class Trial:
    backend: str
    kind: str
    step: int
    rank: int
    killed: bool = False
    resumed_from: int | None = None
    exact: bool = False
    lost: list[str] = field(default_factory=list)
    corrupt_accepted: bool = False
    note: str = ""


def _args(recipe: str, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return ["recipes/train.py", "--recipe", recipe,
            *(a for s in [f"output_dir={out}", *RUN, *extra] for a in ("--set", s))]


def _cmd(recipe: str, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
            str(free_port()), *_args(recipe, out, extra)]


def _env(fault: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    env.pop("TOOLKIT_FAULT", None)
    if fault:
        env["TOOLKIT_FAULT"] = fault
    return env


def run(recipe: str, out: Path, fault: str | None = None, timeout: float = 600,
        extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """A run to its end or its fault, through conftest's launcher (torchrun, or the warm launcher)."""
    return run_ranks(_args(recipe, out, extra), 2, _env(fault), "torchrun", timeout,
                     preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))


def _saved(text: str) -> list[str]:
    """Checkpoints the run reported complete ("[toolkit] saved .../step_X") before it ended."""
    return re.findall(r"\[toolkit\] saved \S*/(step_\d+)", text)


def _resumed(text: str) -> int | None:
    m = re.search(r"resumed from \S*/step_(\d+) at step (\d+)", text)
    return int(m.group(2)) if m else None


def _preempt(recipe: str, out: Path, step: int, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Two SIGUSR1s to every process: one once step `step` is logged, one as soon as a save is under way."""
    proc = subprocess.Popen(_cmd(recipe, out, extra), cwd=REPO, env=_env(None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))
    end = time.monotonic() + 600
    metrics = out / "metrics.jsonl"
    while time.monotonic() < end and proc.poll() is None:
        if metrics.is_file() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines()):
            break
        time.sleep(0.02)
    signal_process_tree(proc.pid, signal.SIGUSR1)
    while time.monotonic() < end and proc.poll() is None:
        if any(not (t / "toolkit_meta.json").exists() for t in (out / "checkpoints").glob("step_*")):
            signal_process_tree(proc.pid, signal.SIGUSR1)
            break
        time.sleep(0.002)
    text, _ = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, "")


def _damage_newest(out: Path) -> str | None:
    """Flip one byte in the middle of the largest file of the newest complete checkpoint (bit rot, a bad copy)."""
    tags = sorted(p for p in (out / "checkpoints").glob("step_*") if (p / "toolkit_meta.json").exists())
    if not tags:
        return None
    victim = max((p for p in tags[-1].iterdir() if p.name != "toolkit_meta.json"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return tags[-1].name


def _verifies(tag_dir: Path) -> bool:
    from toolkit.train.checkpoint import is_intact

    return is_intact(tag_dir)


def trial(t: Trial, recipe: str, out: Path, reference: list[float]) -> Trial:
    damaged, extra = None, EXTRA.get(t.backend, ())
    if t.kind == "signal":
        first = _preempt(recipe, out, t.step, extra)
        t.killed = first.returncode != 0
    elif t.kind == "corrupt":
        first = run(recipe, out, f"forward@{t.step}:{t.rank}", extra=extra)  # die mid-step, rot the newest checkpoint
        t.killed = first.returncode != 0
        damaged = _damage_newest(out)
    else:
        phase = "save-flushed" if t.kind == "torn" else t.kind
        fault = f"{phase}@{t.step}:{t.rank}" + (":torn" if t.kind == "torn" else "")
        first = run(recipe, out, fault, extra=extra)
        t.killed = first.returncode != 0
    reported = _saved(first.stdout + first.stderr)
    second = run(recipe, out, extra=extra)
    text = second.stdout + second.stderr
    if second.returncode != 0:
        t.note = f"relaunch failed ({second.returncode}): {text[-1500:]}"
        return t
    t.resumed_from = _resumed(text)
    ckpts = out / "checkpoints"
    t.lost = [tag for tag in reported if tag != damaged and not _verifies(ckpts / tag)]
    newest = max((int(tag.split("_")[1]) for tag in reported if tag != damaged), default=None)
    if newest is not None and (t.resumed_from or 0) < newest:  # a completed checkpoint was passed over
        t.lost.append(f"step_{newest:08d} (resumed from {t.resumed_from})")
    if t.resumed_from is not None:
        chosen = ckpts / f"step_{t.resumed_from:08d}"
        t.corrupt_accepted = chosen.name == damaged or not _verifies(chosen)
    losses = {m["step"]: m["loss"] for m in read_metrics(out)}  # the relaunch's records overwrite the first's
    t.exact = all(losses.get(s) == reference[s - 1] for s in range((t.resumed_from or 0) + 1, STEPS + 1))
    return t


def draw(rng: random.Random, backend: str, kind: str | None = None) -> Trial:
    kind = kind or rng.choice(KINDS)
    step = rng.choice(range(INTERVAL, STEPS, INTERVAL)) if kind in SAVE_PHASES else rng.randint(2, STEPS - 1)
    rank = 0 if kind == "save-meta" else rng.randint(0, 1)
    return Trial(backend, kind, step, rank)


def campaign(trials: list[Trial], work: Path, references: dict[str, list[float]] | None = None) -> dict:
    """Run the trials; `references` (backend -> losses of the uninterrupted STEPS-step run) saves those launches."""
    references = dict(references or {})
    done = []
    for i, t in enumerate(trials):
        recipe = BACKENDS[t.backend]
        if t.backend not in references:
            ref_out = work / f"reference_{t.backend}"
            proc = run(recipe, ref_out, extra=EXTRA.get(t.backend, ()))
            assert proc.returncode == 0, proc.stderr[-3000:]
            references[t.backend] = [m["loss"] for m in read_metrics(ref_out)]
        done.append(trial(t, recipe, work / f"trial_{i:03d}_{t.backend}_{t.kind}", references[t.backend]))
    return report(done)


def report(done: list[Trial]) -> dict:
    by = {}
    for backend in sorted({t.backend for t in done}):
        ts = [t for t in done if t.backend == backend]
        by[backend] = {"trials": len(ts), "kills_per_phase": dict(Counter(t.kind for t in ts if t.killed)),
                       "resumed_exactly": sum(t.exact and not t.note for t in ts),
                       "checkpoints_lost": sum(len(t.lost) for t in ts),
                       "corrupt_checkpoints_accepted": sum(t.corrupt_accepted for t in ts),
                       "relaunch_failures": sum(bool(t.note) for t in ts)}
    return {"summary": by, "trials": [asdict(t) for t in done]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="trials per backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--work", type=Path, default=Path("runs/fault_injection"))
    ap.add_argument("--out", type=Path, help="write the report here as JSON")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # every kind in turn (shuffled), so that even a short campaign covers each phase; steps and ranks at random
    kinds = [KINDS[i % len(KINDS)] for i in range(args.trials)]
    trials = [draw(rng, b, k) for b in args.backends for k in rng.sample(kinds, len(kinds))]
    start = time.monotonic()
    result = campaign(trials, args.work)
    result["seconds"] = round(time.monotonic() - start)
    print(json.dumps(result["summary"], indent=2))
    for t in result["trials"]:
        print(f"{t['backend']:<9} {t['kind']:<13} step {t['step']} rank {t['rank']}: killed={t['killed']} "
              f"resumed_from={t['resumed_from']} exact={t['exact']} lost={t['lost']} "
              f"corrupt_accepted={t['corrupt_accepted']} {t['note'][:200]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
