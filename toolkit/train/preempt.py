"""Preemption and time limits: a signal asks for a checkpoint at the next step boundary and a clean exit.

Slurm sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@N`) and SIGTERM when it preempts or requeues
a job. The handler only notes the signal; the training loop asks every rank at each step boundary whether any
rank got one (a one-integer all-reduce on a CPU process group, so GPUs are not synchronised), and then all
ranks save a checkpoint together, rank 0 writes <output_dir>/preempted.json, and the run exits with
REQUEUE_EXIT. The job script requeues the job when it finds that file; the requeued run resumes from the
checkpoint (checkpoint.resume: auto). A second signal during the save changes nothing: the save is not
interrupted, and a checkpoint only counts once its manifest is written.

Launchers: torchrun and the deepspeed launcher treat SIGUSR1 as fatal; start them with SIGUSR1 ignored (the
shipped sbatch scripts do) and the training processes, which install their own handler, still get it.
"""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
REQUEUE_EXIT = 75  # EX_TEMPFAIL: "checkpoint written after a preemption signal; run again to continue"
MARKER = "preempted.json"


class Preempted(Exception):
    """Raised after the preemption checkpoint is complete."""

    exit_code = REQUEUE_EXIT

    def __init__(self, step: int, tag_dir: Path, signal_name: str):
        super().__init__(f"preempted by {signal_name}: checkpoint {tag_dir} written at step {step}; run the job "
                         "again (the shipped sbatch scripts requeue it) to resume from there")
        self.step, self.tag_dir = step, tag_dir


class PreemptionWatch:
    """Notes preemption signals; agreed() tells every rank whether any rank got one."""

    def __init__(self):
        self.count, self.name, self._old = 0, None, {}
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:  # collective: every rank builds it, in step
            # control messages go over a CPU group: no device synchronisation in the step loop
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:  # runs between bytecodes: never interrupts a save halfway
        self.count += 1
        self.name = self.name or signal.Signals(signum).name

    def agreed(self) -> bool:
        """Collective: True on every rank when any rank has been signalled."""
        if self._group is None:
            return self.count > 0
        flag = torch.tensor([1 if self.count else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and self.name is None:
            self.name = "a signal on another rank"
        return bool(flag.item())

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def write_marker(out_dir: Path, step: int, tag_dir: Path, signal_name: str) -> None:
    path = Path(out_dir) / MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{MARKER}.tmp")
    tmp.write_text(json.dumps({"step": step, "checkpoint": str(tag_dir), "signal": signal_name}))
    tmp.replace(path)


def clear_marker(out_dir: Path) -> dict | None:
    """Remove a previous run's marker; returns what it said (None if there was none)."""
    path = Path(out_dir) / MARKER
    if not path.is_file():
        return None
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        said = {}
    path.unlink(missing_ok=True)
    return said
