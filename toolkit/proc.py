"""Local processes and ports, shared by the launch code, the benchmarks and the tests: a free TCP port, and a
process with all its descendants (torchrun and the deepspeed launcher start their workers in sessions of their
own, so a process-group signal would miss them); the torch extensions cache DeepSpeed's JIT ops are built into, and
the build locks a killed build leaves there."""
from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
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



def extensions_dir() -> Path:
    """The torch extensions cache of this Python environment: one folder per sys.prefix (a venv, a conda env).
    torch's default folder is keyed only by the Python and CUDA versions, so environments with different DeepSpeed
    or torch builds share it, and each rejects the other's build and recompiles (shm_comm: 45-58 s per launch).
    Keyed on the environment, each op is built once per environment and then reused by every run and test."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    name = Path(sys.prefix).name.lstrip(".") or "env"  # `.venv` would make a hidden folder
    return cache / "torch_extensions" / f"{name}-{key}"


def use_own_extensions_cache() -> None:
    """Point DeepSpeed's JIT builds at extensions_dir(), unless the user chose a TORCH_EXTENSIONS_DIR. torch
    reads the variable when an op is loaded, so this must run before the backend starts (train() does it)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))


def extensions_in_use() -> Path:
    """The extensions cache DeepSpeed's JIT builds go to: the user's TORCH_EXTENSIONS_DIR, else extensions_dir()."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or extensions_dir())


def nearest_existing(path: Path) -> Path | None:
    """`path` made absolute, or the nearest folder above it that exists: where it would be made."""
    path = Path(path).absolute()
    return next((p for p in [path, *path.parents] if p.exists()), None)


def cannot_write(folder: Path) -> str | None:
    """Why `folder` (or the folders it would be made in) cannot be written by this user, or None."""
    existing = nearest_existing(folder)
    if existing is None or not existing.is_dir():
        return f"{existing} is a file" if existing is not None else "no folder above it exists"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user (or is on a read-only file system)"
    return None


def open_by_any_process(path: Path) -> bool:
    """Whether some process (that this user may inspect) holds `path` open, from /proc/*/fd."""
    target = os.path.realpath(path)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:  # the process ended, or it is not ours to read
            continue
    return False


def abandoned_build_locks(extensions: Path, min_age_s: float = 10.0) -> list[Path]:
    """`lock` files in a torch extensions cache that no process holds: torch's FileBaton keeps the lock file open
    while it builds an op and removes it when done, so a lock nobody holds was left by a build that was killed.
    Every later load of that op waits for it forever."""
    def unheld(lock: Path) -> bool:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # gone: released
            return False
        return age >= min_age_s and not open_by_any_process(lock)

    suspects = [lock for lock in sorted(Path(extensions).glob("*/lock")) if unheld(lock)]
    if suspects:  # a build that just finished closes its lock a moment before it deletes it: look again
        time.sleep(1.0)
    return [lock for lock in suspects if unheld(lock)]
