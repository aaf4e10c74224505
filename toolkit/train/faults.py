"""Fault injection for the reliability tests: `TOOLKIT_FAULT=phase@step[:rank]` makes that rank die by SIGKILL
(no cleanup, no flush: what a lost node looks like) when it reaches `phase` of step `step` (1-based, the step
being trained or saved). `phase@step:rank:torn` first truncates the largest file the rank has written into the
checkpoint being saved, as a write cut off half-way would.

Outside the tests the variable is unset and every fault point is one comparison against None.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

PHASES = ("forward", "backward", "optimizer", "save-files", "save-flushed", "save-meta")
_SPEC = os.environ.get("TOOLKIT_FAULT")


def parse(spec: str) -> tuple[str, int, int | None, bool]:
    """"backward@3:1" -> ("backward", 3, 1, False); the rank may be omitted (every rank), ":torn" appended."""
    phase, _, rest = spec.partition("@")
    parts = rest.split(":")
    if phase not in PHASES or not parts[0].isdigit():
        raise ValueError(f"TOOLKIT_FAULT={spec!r}: expected PHASE@STEP[:RANK][:torn] with PHASE in {PHASES}")
    rank = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return phase, int(parts[0]), rank, parts[-1] == "torn"


_step = 0  # the step being trained, set by the loop: the backends' fault points do not otherwise know it


def begin_step(step: int) -> None:
    global _step
    _step = step


def point(phase: str, step: int | None = None, rank: int | None = None, written: list[Path] | None = None) -> None:
    """Die here if TOOLKIT_FAULT names this phase, step (default: the step being trained) and rank (default: this
    process's). `written`: the checkpoint files this rank has written so far (for a torn write).

    Training phases: "forward" after a micro-batch's forward, "backward" after the step's backward passes,
    "optimizer" after the optimizer step, before the step is over. Saving: "save-files" after the framework
    wrote this rank's files, "save-flushed" after they are hashed and flushed (before the ranks meet), "save-meta"
    after rank 0 wrote the manifest, before the latest pointers moved."""
    if _SPEC is None:
        return
    want, at, who, torn = parse(_SPEC)
    step = _step if step is None else step
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    if (want, at) != (phase, step) or (who is not None and who != rank):
        return
    if torn and written:
        victim = max((p for p in written if p.is_file()), key=lambda p: p.stat().st_size)
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    os.kill(os.getpid(), signal.SIGKILL)
