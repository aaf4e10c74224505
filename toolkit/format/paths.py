"""Paths a checkpoint names (index entries, pointers, tokenizer files, manifest entries, per-rank files) are read
only when they resolve, links followed, inside the folder the user named: a checkpoint never makes the toolkit
open a file elsewhere."""
from __future__ import annotations

from pathlib import Path

from toolkit.errors import ToolkitError


def resolve(path: Path) -> Path:
    """`path` with every link followed; a link that loops (or cannot be followed) is refused in one line."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # RuntimeError: "Symlink loop from ..." (Python < 3.13)
        raise ToolkitError(f"{path} is a symbolic link that cannot be followed ({e}); point it at a real file or "
                           "folder") from None


def inside(root: Path, name: str | Path, what: str) -> Path:
    """root / name, refused unless it resolves inside root (`what` says where the name came from)."""
    path = Path(root) / name
    base, real = resolve(root), resolve(path)
    if real != base and base not in real.parents:
        raise ToolkitError(f"{what} names {name}, which resolves to {real}, outside {root}; a checkpoint may only "
                           f"refer to files inside its own folder: copy the file into {root} (not a link out of it)")
    return path


def check_tree(root: Path, files, what: str) -> None:
    """inside() for each of `files` (paths under root, e.g. from a glob)."""
    for f in files:
        inside(root, Path(f).relative_to(root), what)
