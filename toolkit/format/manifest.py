"""The manifest of a checkpoint folder (every file with its size and checksum), checking a folder against it, and
whether a disk can hold the next checkpoint.

Schema versions of toolkit_meta.json's "files":
  1  {name: size}                                    sizes only (checkpoints written before checksums)
  2  {name: {"bytes": size, "sha256": hex digest}}    sizes and SHA-256 (checkpoints written before 2026-12-05)
  3  {name: {"bytes": size, "xxh3_128": hex digest}}  sizes and XXH3-128
Readers accept all three; a version-1 checkpoint is verified by size alone, each other file by the digest it has.

The checksum finds files that changed after the save (a cut-short copy, a bad disk, an edit), not a forger: anyone
who can change a file can change the manifest beside it. So it is XXH3-128, not SHA-256: about 11x the speed here
(16.7 against 1.5 GiB/s a core), which matters because every checkpoint written or converted is hashed once and
read once, and on a 2-core machine the SHA-256 of a toolkit -> toolkit conversion (source checked, output hashed)
took as much CPU as the copy itself. A checkpoint's files are hashed by the ranks that wrote them, in parallel,
while the bytes are still in the page cache. Verification spreads the files over the ranks the same way (`share`).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from xxhash import xxh3_128

from toolkit.errors import ToolkitError
from toolkit.format import paths

_WINDOW = 8 * 2**20  # hash_range maps this much of a file at a time (its pages count as resident while mapped)
_SLICE = 4 * 2**20  # and hashes it this much at a time

SCHEMA_VERSION = 3
DIGEST = "xxh3_128"
"""The checksum written into new manifests."""
DIGESTS = {"xxh3_128": xxh3_128, "sha256": hashlib.sha256}
"""Every checksum a manifest may hold (the older first written by schema 2), by its key in the manifest."""
META = "toolkit_meta.json"
STARTED = "toolkit_started.json"
"""Written first when a save begins (names.mark_started); not part of the manifest."""


def new_hash(algorithm: str = DIGEST):
    """A fresh hash object (update, hexdigest) of one of DIGESTS."""
    return DIGESTS[algorithm]()


def hash_range(fd: int, begin: int, end: int, into) -> None:
    """Feed bytes [begin, end) of an open file to the hash object `into`, through read-only maps of 8 MiB windows:
    no copy into a buffer (0.4 s for 2 GiB in the page cache here, against 0.4-1.1 s by reads into a buffer, whose
    fresh pages this VM is slow to hand out). Each window's end is checked against the file's size first (a map read
    past the end would fault). Falls back to positioned reads where a map cannot be made."""
    at = begin
    while at < end:
        start = at - at % mmap.ALLOCATIONGRANULARITY
        stop = min(end, start + _WINDOW)
        if os.fstat(fd).st_size < stop:
            raise ToolkitError(f"a file being hashed ends before byte {stop}: it was truncated while being read")
        try:
            m = mmap.mmap(fd, stop - start, access=mmap.ACCESS_READ, offset=start)
        except (OSError, ValueError):  # a file system that cannot map it
            _read_range(fd, at, end, into)
            return
        with m:
            view = memoryview(m)
            try:
                for k in range(at - start, stop - start, _SLICE):  # XXH3 holds the GIL: ~0.25 ms a slice
                    into.update(view[k:min(k + _SLICE, stop - start)])
            finally:
                view.release()
        at = stop


def _read_range(fd: int, at: int, end: int, into) -> None:
    buf = memoryview(bytearray(min(_SLICE, end - at)))
    while at < end:
        got = os.preadv(fd, [buf[:min(len(buf), end - at)]], at)
        if got <= 0:
            raise ToolkitError(f"a file being hashed ended at byte {at}, before {end}: it was truncated while being "
                               "read")
        into.update(buf[:got])
        at += got


def file_entry(path: Path, fsync: bool = False, algorithm: str = DIGEST) -> dict:
    """{"bytes", algorithm: hex digest} of one file; with fsync=True its data is also forced to disk (a rank's own
    files, before the checkpoint may be declared complete)."""
    with path.open("rb") as f:
        digest = new_hash(algorithm)
        hash_range(f.fileno(), 0, os.fstat(f.fileno()).st_size, digest)
        digest = digest.hexdigest()
        if fsync:
            os.fsync(f.fileno())
        return {"bytes": os.fstat(f.fileno()).st_size, algorithm: digest}


def entries(paths: Iterable[Path], fsync: bool = False) -> dict[str, dict]:
    return {p.name: file_entry(p, fsync) for p in paths}


def _threads(n: int) -> ThreadPoolExecutor:
    """Files are hashed (and fsynced) in parallel: hashlib and the file reads release the GIL."""
    return ThreadPoolExecutor(max(1, min(n, os.cpu_count() or 1, 8)))


def complete(tag_dir: Path, known: dict[str, dict]) -> dict[str, dict]:
    """The manifest of a folder: the `known` entries (hashed by the ranks that wrote them) plus an entry for every
    other file in it, so the manifest never depends on which rank claimed what."""
    files = dict(known)
    todo = [p for p in sorted(tag_dir.iterdir()) if p.is_file() and p.name not in (META, STARTED)
            and p.name not in files]
    with _threads(len(todo)) as pool:
        files.update(zip((p.name for p in todo), pool.map(lambda p: file_entry(p, fsync=True), todo)))
    return dict(sorted(files.items()))


def total_bytes(files: dict) -> int:
    return sum(e["bytes"] if isinstance(e, dict) else int(e) for e in files.values())


def share(files: dict, rank: int, world: int) -> set[str]:
    """The names rank `rank` of `world` checks: largest first, each to the least-loaded rank (the same answer on
    every rank)."""
    load, mine = [0] * world, set()
    for name, entry in sorted(files.items(), key=lambda kv: (-_size(kv[1]), kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += _size(entry)
        if r == rank:
            mine.add(name)
    return mine


def _size(entry) -> int:
    return entry["bytes"] if isinstance(entry, dict) else int(entry)


def read_meta(tag_dir: Path) -> dict:
    """toolkit_meta.json, or a ToolkitError that says what is wrong with it."""
    path = tag_dir / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ToolkitError(f"{path} is missing: the save never completed") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ToolkitError(f"{path} is unreadable ({e}): the save was cut short or the file was edited") from None
    if not isinstance(meta, dict):
        raise ToolkitError(f"{path} holds a {type(meta).__name__}, not the checkpoint's metadata")
    return meta


def verify(tag_dir: Path, checksums: bool | set[str] = True) -> list[str]:
    """What is wrong with a checkpoint folder against its manifest: one line per bad file, [] when it matches.
    `checksums`: hash every file (True), none (False), or only the named ones (a rank's share)."""
    try:
        meta = read_meta(tag_dir)
    except ToolkitError as e:
        return [str(e).replace(f"{tag_dir / META}", META, 1)]
    files = meta.get("files") or {}  # none: written before manifests existed
    problems, to_hash = [], []
    if isinstance(meta.get("schema_version"), int) and meta["schema_version"] >= 2:
        # complete() lists every file of the folder: one it does not list was added, or its entry removed, after the
        # save, and a reader would take it unchecked
        if not isinstance(files, dict) or not files:
            return [f"{META} lists no files (schema {meta['schema_version']} lists every file it saved): it was edited"]
        problems += [f"{p.name} is not in the manifest (added after the save, or its entry removed from {META})"
                     for p in sorted(tag_dir.iterdir()) if p.name not in files and p.name not in (META, STARTED)
                     and (p.is_file() or p.is_symlink())]
    for name, entry in files.items():
        want = _size(entry)
        try:
            path = paths.inside(tag_dir, name, META)
        except ToolkitError as e:
            problems.append(str(e))
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != want:
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {want}")
        elif _digest_of(entry) and (checksums is True or bool(checksums) and name in checksums):
            to_hash.append((name, path, _digest_of(entry)))
    with _threads(len(to_hash)) as pool:
        digests = list(pool.map(lambda job: file_entry(job[1], algorithm=job[2])[job[2]], to_hash))
    problems += [f"{name} does not match its {algorithm} in the manifest (the file or the manifest changed after the "
                 "save)" for (name, _, algorithm), got in zip(to_hash, digests) if got != files[name][algorithm]]
    return problems


def _digest_of(entry) -> str | None:
    """The checksum an entry holds (the first of DIGESTS), None for schema 1's sizes only."""
    return next((k for k in DIGESTS if k in entry), None) if isinstance(entry, dict) else None


def describe_check(files: dict) -> str:
    """How a manifest is checked, for the log."""
    kinds = {_digest_of(e) for e in files.values()}
    if None in kinds:
        return f"{len(files)} files, sizes only (no checksums)"
    return f"{len(files)} files, sizes and {' / '.join(sorted(kinds))}"


# ------------------------------------------------------------------ disk space
def free_bytes(folder: Path) -> int:
    """Bytes a non-root user may still write where `folder` is (or would be created). Tests replace this."""
    probe = Path(folder).absolute()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def require_space(folder: Path, needed: int, free: int, what: str, basis: str) -> None:
    """Refuse (before anything is written) when `free` bytes at `folder` cannot hold `needed`."""
    if free < needed:
        raise ToolkitError(f"not enough disk space for {what}: it needs about {needed:,} bytes ({basis}), but "
                           f"{folder} has {free:,} bytes free. Nothing was written and existing files are "
                           "untouched; free space there or write somewhere larger")
