"""Preemption and time limits: a signal asks for a checkpoint one or two steps later and a clean exit.

Slurm sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@N`) and SIGTERM when it preempts or requeues
a job. The handler only notes the signal; at each step boundary every rank posts whether it got one, as a
one-integer all-reduce on a CPU process group of its own that runs in the background (no GPU synchronisation,
and the step never waits for the other ranks), and reads the result posted at the previous boundary. So every
rank learns of a signal at the same boundary, one or two steps after it arrives (`--signal=USR1@N` must leave
time for two steps and a checkpoint save); then all ranks save a checkpoint together, rank 0 writes
<output_dir>/preempted.json, and the run exits with REQUEUE_EXIT. The job script requeues the job when it
finds that file; the requeued run resumes from the checkpoint (checkpoint.resume: auto). A second signal during
the save changes nothing: the save is not interrupted, and a checkpoint only counts once its manifest is
written (Megatron-Core's torch_dist save runs helper processes, which are kept from these signals:
toolkit/megatron/torch_dist_ckpt.py).

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


_EARLY: list[str] = []
"""SIGUSR1s noted between process start (watch_early) and the PreemptionWatch that takes them over."""


def _note_early(signum, frame) -> None:
    _EARLY.append(signal.Signals(signum).name)


def _catch(sig: int, handler):
    """Install `handler` for `sig` with SA_RESTART; returns the handler it replaces. Python installs its handlers
    without it, so a signal that lands while a library (a shared object's loader, a C++ reader, a file system
    that honours interrupts) waits in a system call makes that call fail with EINTR, which few of them retry. A
    rank died during start-up, just after such a signal, on the CI machine of 2026-12-07 (its message was not
    kept; it never happened here). The handlers here only take a note: nothing needs the call cut short."""
    old = signal.signal(sig, handler)
    if callable(handler):
        signal.siginterrupt(sig, False)
    return old


def watch_early() -> None:
    """Note SIGUSR1 from the start of the process, before the model, the engine and a resumed checkpoint are built:
    Slurm sends the time-limit warning once, and the launcher's workers start with it ignored (`trap '' USR1`), so
    one that came during start-up was lost and the job ran into its time limit without a checkpoint or a requeue
    (until 2026-12-07). SIGTERM keeps its default until the watch exists: a job stopped while it starts just ends."""
    if threading.current_thread() is threading.main_thread():
        _catch(signal.SIGUSR1, _note_early)


def finished() -> None:
    """The run is over (done, or its preemption checkpoint complete): a time-limit warning now has nothing to save.
    Ignore it: Python gives a caught signal back its default action while the interpreter shuts down, so a SIGUSR1
    in the last second of a finished run killed the rank (exit -10) and the launcher reported the job failed."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


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
        self.count, self.name, self._old = len(_EARLY), (_EARLY[0] if _EARLY else None), {}
        self._group, self._pending = None, None
        if dist.is_initialized() and dist.get_world_size() > 1:  # collective: every rank builds it, in step
            # control messages go over a CPU group of their own: no device synchronisation in the step loop, and
            # the all-reduce left running in the background never queues up with the training's collectives
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = _catch(sig, self._note)

    def _note(self, signum, frame) -> None:  # runs between bytecodes: never interrupts a save halfway
        self.count += 1
        self.name = self.name or signal.Signals(signum).name

    def agreed(self) -> bool:
        """Collective, once per step boundary on every rank: True on every rank, at the same boundary, once any rank
        has been signalled. It does not wait for the other ranks: it reads the all-reduce posted at the previous
        boundary (long finished: a step ran in between) and posts this boundary's, which runs in the background.
        A synchronous all-reduce here cost 1.4-2.6 ms per step on 2 CPU ranks (the ranks' skew plus gloo's
        latency; bench/overhead.py's DeepSpeed case), and more across many nodes."""
        if self._group is None:
            return self.count > 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag.item():  # every rank got the same answer: none posts another
                self.name = self.name or "a signal on another rank"
                return True
        flag = torch.tensor([1 if self.count else 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return False

    def settle(self) -> None:
        """Collective: wait for the all-reduce still running from the last boundary (every rank posted it), before
        the process group goes away. Call it when the loop has ended normally on every rank."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def close(self) -> None:
        for sig, old in self._old.items():
            _catch(sig, old)
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
