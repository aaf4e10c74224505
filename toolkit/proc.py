"""Local processes and ports, shared by the launch code, the benchmarks and the tests: a free TCP port, and a
process with all its descendants (torchrun and the deepspeed launcher start their workers in sessions of their
own, so a process-group signal would miss them)."""
from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, parents before children (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [root], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def signal_tree(root: int, sig: int) -> None:
    """Send `sig` to `root` and every descendant that is still there."""
    for pid in process_tree(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
