"""All-or-nothing output folders for `toolkit convert`: built in a hidden folder beside the destination, which is
removed (with any parent folders it needed) when anything fails, and disk errors reported as what they are. Every
output carries a mark naming what it holds (names.OUTPUT_MARK); an existing destination is replaced (--overwrite)
only when it is such a folder and holds nothing else, at any depth: never a folder the toolkit did not write, nor a
file a user added to one."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.format import paths
from toolkit.format.names import OUTPUT_MARK


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before anything is read or written, a destination that exists (without overwrite), that is not a
    folder `toolkit convert` wrote (with overwrite), or that overlaps the source."""
    src, dst = Path(src), Path(dst)
    if dst.is_symlink():
        raise ToolkitError(f"{dst} is a symbolic link; choose a destination that is not one (the toolkit never "
                           "writes through a link). Nothing was written")
    real_src, real_dst = paths.resolve(src), paths.resolve(dst)
    if real_dst == real_src or real_src in real_dst.parents or real_dst in real_src.parents:  # before "exists":
        # its advice (--overwrite) would only lead here
        raise ToolkitError(f"{dst} overlaps the source {src} (the same folder, inside it, or holding it: "
                           "--overwrite would delete the source); write the conversion somewhere else")
    if dst.exists() and not dst.is_dir():  # --overwrite replaces only folders toolkit convert wrote
        raise ToolkitError(f"{dst} is a file; a checkpoint is a folder: choose another destination (--overwrite "
                           "replaces only a folder toolkit convert wrote). Nothing was written")
    if dst.exists() and not overwrite:
        raise ToolkitError(f"{dst} already exists; pass --overwrite to replace it (it is replaced only after the "
                           "new checkpoint is complete and verified)")
    if dst.exists():
        foreign = not_written_by_us(dst)
        if foreign:
            raise ToolkitError(f"{dst} holds {foreign}, which toolkit convert did not write; --overwrite replaces "
                               "only a folder written by toolkit convert: move it away yourself or choose another "
                               "destination. Nothing was written")


def not_written_by_us(dst: Path) -> str | None:
    """The first entry under `dst`, at any depth, that its mark does not list (or what is wrong with the mark); None
    if all are. A mark written before marks listed subfolders' contents (2026-12-06: top-level names only) cannot
    vouch for what a subfolder holds now, so its subfolders count as not ours."""
    if not dst.is_dir():
        return "a file where a folder would go"
    try:
        mark_ = json.loads((dst / OUTPUT_MARK).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        mark_ = None
    listed = mark_.get("paths") if isinstance(mark_, dict) else None
    if not isinstance(listed, list):
        top = mark_.get("entries") if isinstance(mark_, dict) else None
        top = top if isinstance(top, list) else []  # no mark: nothing in it is ours (an empty folder holds nothing)
        for name in sorted(p.name for p in dst.iterdir() if p.name in top and p.is_dir() and not p.is_symlink()):
            return f"{name}/, whose files its mark (from a toolkit before 2026-12-06) does not list"
        listed = top
    extra = sorted(set(_entries(dst)) - set(listed))
    return extra[0] if extra else None


def _entries(folder: Path) -> list[str]:
    """Every file, folder and link under `folder` but its mark, as paths relative to it (links not followed)."""
    found = []
    for top, dirs, files in os.walk(folder):
        rel = Path(top).relative_to(folder)
        found += [(rel / name).as_posix() for name in dirs + files]
    return sorted(p for p in found if p != OUTPUT_MARK)


def mark(folder: Path) -> None:
    """Name everything in a finished output folder, at every depth (before it is moved into place)."""
    entries = _entries(folder)
    (folder / OUTPUT_MARK).write_text(json.dumps({"written_by": "toolkit convert", "paths": entries,
                                                  "entries": [e for e in entries if "/" not in e]}) + "\n")


def durable(folder: Path) -> None:
    """fsync every file and folder under `folder` (four at a time), so that what is renamed into place is on disk:
    a crash after the rename never leaves a DST of empty or partial files. Files their writer already synced
    (safetensors, the .distcp file) cost a system call each."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(paths.fsync, [p for p in [folder, *folder.rglob("*")] if not p.is_symlink()]))


def replace(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move the finished folder into place, once all of it is on disk. check_destination ran before the conversion,
    which takes minutes, so what it checked is checked again here, where it cannot change under the check:
    - without overwrite, DST must still be absent: the rename refuses a DST that another process (a second
      conversion to the same DST) put there meanwhile, instead of deleting it;
    - with overwrite, the old DST is first renamed aside, then checked again for files the toolkit did not write
      (a user's, added meanwhile); if there are any it is put back and the conversion refused.
    The old DST is removed once the new one is there. Ctrl-C and SIGTERM wait until that is done: between the
    renames DST would be missing, its old copy hidden beside it (stop_on_signals)."""
    mark(tmp)
    durable(tmp)
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    moved = False
    with _signals_held():
        if overwrite and dst.exists() and not dst.is_symlink():
            os.rename(dst, old)
            moved = True
            foreign = not_written_by_us(old)
            if foreign:
                os.rename(old, dst)  # back where it was (a folder only this process knows the hidden name of)
                raise ToolkitError(f"{dst} came to hold {foreign} while converting, which toolkit convert did not "
                                   "write; it is left as it was and the conversion was not moved into place: move "
                                   "that file away and run the command again")
        try:
            _rename_no_replace(tmp, dst)
        except FileExistsError:
            if moved and not os.path.lexists(dst):
                os.rename(old, dst)
            raise ToolkitError(f"{dst} appeared while converting (another process wrote it); it is left as it was "
                               "and this conversion was removed: give each conversion its own destination, or "
                               "pass --overwrite to replace a folder toolkit convert wrote") from None
        paths.fsync(dst.parent)  # the rename itself on disk
        if moved:
            shutil.rmtree(old, ignore_errors=True)


def _rename_no_replace(src: Path, dst: Path) -> None:
    """rename(2) that never replaces: FileExistsError when dst exists (a file, a link, a folder empty or not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:  # glibc >= 2.28: atomic
        at_fdcwd, rename_noreplace = -100, 1
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS):  # EINVAL/ENOSYS: a file system without the flag
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


_held = {"on": False, "got": []}  # inside replace()'s renames: the signals that came meanwhile


@contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait (stop_on_signals' handlers note them) until the block ends, then stop the conversion."""
    _held["on"] = True
    try:
        yield
    finally:
        _held["on"] = False
    if _held["got"]:
        raise KeyboardInterrupt


@contextmanager
def stop_on_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM (scancel, a Slurm time limit, docker stop, kill) both raise KeyboardInterrupt in the main
    thread, so the conversion stops through scratch_folder's clean-up; inside replace()'s renames they wait until
    DST is in place. Yields the list of signals received. A no-op off the main thread (no handlers can be set)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def stop(signum, _frame) -> None:
        got.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        if _held["on"]:
            _held["got"].append(signum)
        else:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        _held["got"].clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_SCRATCH_KINDS = ("partial", "reshard", "old")  # scratch_folder's kinds, and replace()'s hidden old DST


def left_behind(dst: Path) -> list[str]:
    """A line for each hidden folder beside `dst` that an earlier conversion to it left: SIGKILL (or a power cut)
    cannot be caught, so its `.DST.partial-PID` stays, or, between replace()'s two renames, DST's earlier copy stays
    hidden as `.DST.old-PID` with DST missing. Nothing is removed here: the lines name each one and what to do."""
    dst = Path(dst)
    try:
        siblings = list(dst.parent.iterdir()) if dst.parent.is_dir() else []
    except OSError:
        return []
    lines = []
    for path in sorted(siblings):
        kind, _, pid = path.name.removeprefix(f".{dst.name}.").rpartition("-")
        if not path.name.startswith(f".{dst.name}.") or kind not in _SCRATCH_KINDS or not pid.isdigit():
            continue
        if path.is_symlink() or not path.is_dir():
            continue
        if int(pid) != os.getpid() and _running(int(pid)):
            lines.append(f"{path} is being written by process {pid}, another conversion to {dst}: the later of the "
                         "two to finish replaces the other's output")
        elif kind == "old" and not dst.exists():
            lines.append(f"{dst} is missing and {path} is its earlier copy: a conversion was killed between the two "
                         f"renames that replace it. `mv {path} {dst}` puts it back")
        elif kind == "old":
            lines.append(f"{path} ({size_text(paths.regular_bytes(path))}) is an earlier copy of {dst} that a killed "
                         f"conversion left after writing the new one; remove it (`rm -r {path}`) once you no longer "
                         "need it")
        else:
            lines.append(f"{path} ({size_text(paths.regular_bytes(path))}) is the unfinished output of a conversion "
                         f"to {dst} by process {pid}, which is not running on this machine: unless a conversion on "
                         f"another node writes it, that one was killed; remove it (`rm -r {path}`) to free the space")
    return lines


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def size_text(n: float, unit_of: float | None = None) -> str:
    """Bytes as conversions print them: GiB with two decimals from 10 MiB (a model's familiar figure), MiB or KiB
    below, where "0.00 GiB" said nothing (until 2026-12-07). `unit_of`: choose the unit for this size instead (a
    progress line prints its count in its total's unit)."""
    scale_of = n if unit_of is None else unit_of
    if scale_of >= 2**30 / 100:
        return f"{n / 2**30:.2f} GiB"
    if scale_of >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if scale_of >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:,.0f} bytes"


def _outermost_new(path: Path) -> Path:
    """The outermost folder that creating `path` (with its parents) would make."""
    path = path.absolute()
    while not path.parent.exists():
        path = path.parent
    return path


@contextmanager
def scratch_folder(dst: Path, kind: str) -> Iterator[Path]:
    """A new hidden folder beside `dst` to build the output in; the block moves it into place when it is done. A
    destination that cannot be written is refused before anything else happens; when the block fails, everything
    this created is removed, and an OSError (a full or read-only disk) becomes a ToolkitError saying so."""
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{kind}-{os.getpid()}")
    created = _outermost_new(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        shutil.rmtree(created, ignore_errors=True)
        raise ToolkitError(f"cannot write {dst}: {created.parent} does not take new folders ({e.strerror}); choose "
                           "a destination you can write to. Nothing was written") from None
    try:
        yield tmp
    except OSError as e:
        shutil.rmtree(created, ignore_errors=True)
        where = f" ({e.filename})" if e.filename else ""
        raise ToolkitError(f"writing {dst} failed: {e.strerror or e}{where}; the partial output was removed, "
                           "nothing was written") from None
    except BaseException:
        shutil.rmtree(created, ignore_errors=True)
        raise
