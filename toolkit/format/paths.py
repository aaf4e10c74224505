"""Paths a checkpoint names (index entries, pointers, tokenizer files, manifest entries, per-rank files) are read
only when they resolve, links followed, inside the folder the user named: a checkpoint never makes the toolkit
open a file elsewhere. One exception, by its layout: a snapshot folder of the Hugging Face hub cache links its
files into its own repository's blobs folder."""
from __future__ import annotations

import os
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
