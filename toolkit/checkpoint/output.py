"""All-or-nothing output folders for `toolkit convert`: built in a hidden folder beside the destination, which is
removed (with any parent folders it needed) when anything fails, and disk errors reported as what they are."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import ToolkitError


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
        raise ToolkitError(f"writing {dst} failed: {e.strerror} ({e.filename}); the partial output was removed, "
                           "nothing was written") from None
    except BaseException:
        shutil.rmtree(created, ignore_errors=True)
        raise
