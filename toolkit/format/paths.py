"""Paths a checkpoint names (index entries, pointers, tokenizer files, manifest entries, per-rank files) are read
only when they resolve, links followed, inside the folder the user named: a checkpoint never makes the toolkit
open a file elsewhere. One exception, by its layout: a snapshot folder of the Hugging Face hub cache links its
files into its own repository's blobs folder."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from toolkit.errors import ToolkitError


def resolve(path: Path) -> Path:
    """`path` with every link followed; a link that loops (or cannot be followed) is refused in one line."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # RuntimeError: "Symlink loop from ..." (Python < 3.13)
        raise ToolkitError(f"{path} is a symbolic link that cannot be followed ({e}); point it at a real file or "
                           "folder") from None


def _homes(root: Path) -> list[Path]:
    """Where the files of `root` may live: root itself, and for a snapshot of the Hugging Face hub cache
    (<cache>/models--ORG--NAME/snapshots/REVISION, whose files are links to ../../blobs/HASH) that repository's
    blobs folder."""
    base = resolve(root)
    homes = [base]
    if base.parent.name == "snapshots" and base.parent.parent.name.startswith("models--"):
        homes.append(base.parent.parent / "blobs")
    return homes


def inside(root: Path, name: str | Path, what: str) -> Path:
    """root / name, refused unless it resolves inside root (`what` says where the name came from)."""
    path = Path(root) / name
    real = resolve(path)
    if not any(real == home or home in real.parents for home in _homes(root)):
        raise ToolkitError(f"{what} names {name}, which resolves to {real}, outside {root}; a checkpoint may only "
                           f"refer to files inside its own folder: copy the file into {root} (not a link out of it)")
    try:
        mode = real.stat().st_mode
    except OSError:
        return path  # missing: its reader says so
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a read of a FIFO waits forever (a trial of 2026-12-07)
        kind = "named pipe (FIFO)" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device file"
        raise ToolkitError(f"{path} is a {kind}, not a regular file; a checkpoint's files are regular files: replace "
                           "it with the file itself")
    return path


def pointer(file: Path) -> str:
    """The folder name a checkpoint's pointer file holds (DeepSpeed's `latest`, Megatron-LM's tracker, ...), read only
    from a regular file inside its folder, and refused in one line unless it is a short line of printable text."""
    file = Path(file)
    inside(file.parent, file.name, str(file.parent))
    if not file.is_file():
        raise ToolkitError(f"{file} is not a regular file; it should hold the name of the checkpoint folder to read")
    with open(file, "rb") as f:
        raw = f.read(256)
    text = raw.decode("utf-8", errors="replace").strip()
    if len(raw) == 256 or not text.isprintable():
        shown = "more than 255 bytes" if len(raw) == 256 else "characters no folder name has"
        raise ToolkitError(f"{file} holds {shown}, not the name of a checkpoint folder: write the name of the folder "
                           "to read into it (or pass that folder itself)")
    return text


def check_tree(root: Path, files, what: str) -> None:
    """inside() for each of `files` (paths under root, e.g. from a glob)."""
    for f in files:
        inside(root, Path(f).relative_to(root), what)


def fsync(path: Path) -> None:
    """Force a file's data, or a folder's entries (a rename in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_write_path(path: Path, overwrite: bool, option: str) -> None:
    """A file the user asked for (`plan --write`, `slurm render --out`) can be written: not a folder, not an existing
    file without overwrite, in a folder that exists and is writable. Checked before anything is written, so a typo
    leaves nothing behind. Write it with write_replacing."""
    path = Path(path)
    if path.is_dir():
        raise ToolkitError(f"{option} {path}: that is a folder; give a file path in it")
    if os.path.lexists(path) and not overwrite:
        raise ToolkitError(f"{path} exists; pass --overwrite to replace it, or choose another {option} path")
    folder = path.parent
    if not folder.is_dir():
        raise ToolkitError(f"{option} {path}: the folder {folder} does not exist; create it first (mkdir -p "
                           f"{folder}) or choose another path")
    if not os.access(folder, os.W_OK):
        raise ToolkitError(f"{option} {path}: the folder {folder} is not writable; choose another path")


def write_replacing(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a link at `path` is replaced
    itself, never written through, and a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def regular_bytes(folder: Path) -> int:
    """The bytes of the regular files under `folder`, as `inspect` reports them: a symbolic link's target is not
    counted (it may be anywhere, or another file of the folder; it was until 2026-12-07), nor a file removed while
    the folder is walked (a running save prunes old steps)."""
    total = 0
    for p in Path(folder).rglob("*"):
        try:
            info = p.lstat()
        except FileNotFoundError:
            continue
        total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total
