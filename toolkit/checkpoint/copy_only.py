"""`toolkit convert` between Hugging Face folders, the toolkit's Megatron layouts, Megatron-LM's legacy layout and
Megatron-Core's torch_dist, as file-to-file copies, without loading torch to write them.

Such a conversion moves bytes and nothing else: every output tensor is byte ranges of the source files
(toolkit/checkpoint/byte_ranges.py works out which, by running the family's own rules on numpy address arrays).
The files are safetensors, whose headers are JSON, or torch.save zips: a reader of our own finds where a source's
tensors lie without torch (toolkit/checkpoint/pickled_copy.py), and the Megatron-LM and torch_dist writers lay their
files out without torch (toolkit/format/pt_write.py). So this path reads the headers, plans each parameter's
ranges, and copies them in the kernel (os.copy_file_range, or gathered from maps for row-sized ranges), through the
same targets, write-behind threads, all-or-nothing output folder and source checksum check as the full path
(toolkit/checkpoint/convert.py). Its output is byte-identical to the full path's. What it saves is the full path's
fixed cost: importing torch took 1.3-1.8 s on the 2-core test machine, as long as copying 2 GiB
(docs/performance.md).

Verified (the default), the output is checked once written by the full path's own verification
(convert.CopyCheck: toolkit/checkpoint/verify.py verify_output), whose imports (torch, transformers) and source
load on a background thread while the bytes are copied (_Verification).

It takes a conversion only when nothing in writing it needs tensors: no dtype cast, weights only (a
Hugging Face target, --weights-only, or a source without optimizer state), a toolkit source that stores its
Hugging Face config (conversions do; a training run's is made from its recipe, which needs transformers), and
--vocab-size only for a Megatron-LM or torch_dist source (it is their true vocabulary; for the others it would
not change anything). Anything else, and anything unexpected in the source (a file that does not open, a pickle
naming anything outside the reader's allow-list, a tensor the rules cannot address, copies of a replicated tensor
that differ), returns None before or while writing: the partial output is removed and the full path converts it,
reporting any problem in its own words.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

from toolkit.checkpoint import byte_ranges, output
from toolkit.checkpoint.megatron_lm_write import MegatronLMTarget
from toolkit.checkpoint.pickled_copy import open_megatron
from toolkit.checkpoint.safetensors_sources import (TOKENIZER_FILES, HFSource, ToolkitWeights, follow_pointer,
                                                    stored_config)
from toolkit.checkpoint.source_base import WEIGHT, Source, layout_notes, optimizer_note, read_for
from toolkit.checkpoint.streaming import Progress, SourceCheck, WriteBehind, report, writers
from toolkit.checkpoint.targets import HFTarget, MegatronTarget
from toolkit.checkpoint.torch_dist_write import TorchDistTarget
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries
from toolkit.families.rules import views
from toolkit.format import file_copy, manifest
from toolkit.format.names import META, POINTER


class _NotByCopy(Exception):
    """A parameter whose bytes are not source byte ranges: the full path converts this checkpoint."""


def convert_by_copy(src: str | Path, dst: str | Path, to: str, tp: int = 1, pp: int = 1, vpp: int = 1,
                    dtype: str | None = None, vocab_size: int | None = None, fp32: bool = False,
                    weights_only: bool = False, overwrite: bool = False, verify: bool = True, dp: int | None = None,
                    progress: bool = True, log=print, config: str | Path | None = None, verbose: bool = False,
                    ep: int = 1, verifier=None, divisible_by: int | None = None,
                    tokenizer: Path | None = None) -> tuple[Path | None, bool]:
    """convert.convert's conversion, made here when it only copies bytes (the module docstring): (DST, True), or
    (None, whether it had begun: its "converting" line and the reason it stopped are printed) when the full path
    must make it (nothing is left behind then). `verifier`: for a verified conversion, a function that imports and
    returns the full path's check (convert.CopyCheck); without one a verified conversion is left to the full path."""
    tokenizer = check_tokenizer_folder(to, tokenizer)
    if (not byte_ranges.ENABLED or (verify and verifier is None) or dtype is not None or fp32 or dp is not None
            or config is not None or to not in ("hf", "megatron", "megatron_lm", "torch_dist")
            or (divisible_by is not None and to == "hf")
            or (to == "hf" and (tp, pp, vpp, ep) != (1, 1, 1, 1))):
        return None, False
    src, dst = Path(src), Path(dst)
    output.check_destination(src, dst, overwrite)  # the full path's first check: its refusals are the same
    source = _open(src, weights_only or to == "hf", vocab_size)
    if source is not None:
        source = read_for(source, to, tp, divisible_by, lambda rows: _open(src, weights_only or to == "hf",
                                                                           vocab_size, rows))
    if source is None:
        return None, False
    begun, checker = False, None
    try:
        with output.scratch_folder(dst, "partial") as tmp, SourceCheck(source.unchecked) as check:
            target = (HFTarget(tmp, source, None, tokenizer=tokenizer) if to == "hf"
                      else MegatronLMTarget(tmp, source, tp, pp, vpp, None, ep, True) if to == "megatron_lm"
                      else TorchDistTarget(tmp, source, tp, pp, vpp, None, True, ep) if to == "torch_dist"
                      else MegatronTarget(tmp, source, tp, pp, vpp, None, True, ep))
            manifest.require_space(dst.parent, target.total, manifest.free_bytes(tmp), str(dst),
                                   "the tensors to write")
            log(f"converting {source.describe()} at {src} -> {to}"
                + (f" tp={tp} pp={pp} vpp={vpp}" if to != "hf" else "") + (f" ep={ep}" if ep > 1 else "")
                + f" ({', '.join(target.fields)}; {output.size_text(target.total)} to write; file to file, "
                + ("verified after" if verify else "torch-free") + ")")
            for note in layout_notes(source, to, tp) + [getattr(target, "tokenizer_note", None)]:
                if note:
                    log(note)
            if to != "hf" and getattr(source, "optimizer_note", None):
                log(f"optimizer state: {optimizer_note(source.optimizer_note, src)}")
            begun = True
            checker = (_Verification(verifier, src, source.config, vocab_size, weights_only or to == "hf",
                                     source.rows)
                       if verify else None)
            _copy(source, target, pp, vpp, progress, log, verbose, check, verify)
            if checker is not None:
                checker.check(tmp if to == "hf" else target.tag_dir, target.fields, tmp if to == "hf" else None, log,
                              verbose)
            output.replace(tmp, dst, overwrite)
            if hasattr(target, "megatron_lm_flags"):  # docs/convert.md, "Continuing in Megatron-LM or Megatron-Bridge"
                log(f"to continue in Megatron-LM: --load {dst} {target.megatron_lm_flags()}")
    except _NotByCopy as e:
        if checker is not None:
            checker.join()  # the full path imports the same modules: not from two threads at once
        if verbose:  # otherwise the full path's own lines follow (and its error, if it refuses the source)
            log(f"{e}: converting through memory instead")
        return None, begun
    finally:
        source.close()
        if checker is not None:
            checker.close()
    return dst, True


class _Verification:
    """The verification of a conversion made here: the full path's check (`verifier()`, convert.CopyCheck), run on
    the output once it is written. torch, the check, transformers' model class and the source as the full path reads
    it are loaded on a background thread while the bytes are copied (start-up that took 1.5-2 s before the first
    byte was written when the full path made verified conversions)."""

    def __init__(self, verifier, src: Path, config: dict, vocab_size: int | None, weights_only: bool,
                 rows: int | None = None):
        self.loaded, self.error, self.closed, self.frozen, self.lock = None, None, False, False, threading.Lock()
        self.thread = threading.Thread(target=self._load, args=(verifier, src, config, vocab_size, weights_only,
                                                                rows), daemon=True)
        self.thread.start()

    def _load(self, verifier, src: Path, config: dict, vocab_size: int | None, weights_only: bool,
              rows: int | None) -> None:
        # no collections while the imports make their objects (hundreds of thousands: six full collections walked
        # them, 0.4 s of CPU here), and out of the collector's sight afterwards (as cli.cmd_convert does for the full
        # path); close() gives them back
        collecting = gc.isenabled()
        gc.disable()
        try:
            check = verifier()(src, config, vocab_size, weights_only, rows)
            with self.lock:
                if self.closed:  # the conversion ended (it failed) while this ran
                    check.close()
                else:
                    self.loaded = check
        except BaseException as e:  # noqa: BLE001 - raised on the conversion's thread, by check()
            self.error = e
        finally:
            with self.lock:
                if not self.closed:
                    gc.freeze()
                    self.frozen = True
            if collecting:
                gc.enable()

    def join(self) -> None:
        self.thread.join()

    def check(self, written: Path, fields: tuple[str, ...], hf_folder: Path | None, log, verbose: bool) -> None:
        t0 = time.monotonic()
        self.join()
        if self.error is not None:
            raise self.error
        t1 = time.monotonic()
        self.loaded.run(written, fields, hf_folder, log)
        if verbose:  # the wait: what the imports and the source's opening took beyond the copy they overlapped
            log(f"phases: import-wait {t1 - t0:.1f} s (the check's imports and source, beyond the copy); verify "
                f"{time.monotonic() - t1:.1f} s")

    def close(self) -> None:
        """Close the check's source; a thread still loading (the conversion failed first) closes it itself."""
        with self.lock:
            self.closed = True
            if self.loaded is not None:
                self.loaded.close()
            if self.frozen:
                gc.unfreeze()
                self.frozen = False


def _open(src: Path, weights_only: bool, vocab_size: int | None, rows: int | None = None) -> Source | None:
    """The source, when it is one this path reads (None otherwise, or when it does not open: the full path then
    says why). Its checksums are left to check while converting (source.unchecked), as the full path does.
    `vocab_size`: the true vocabulary of a Megatron-LM checkpoint (which its padded rows do not tell); a source of
    another kind is left to the full path when one is given."""
    if not src.is_dir() or src.is_symlink():
        return None
    if (not any((src / name).exists() for name in ("config.json", META, POINTER))
            and ((src / "latest_checkpointed_iteration.txt").is_file() or src.name.startswith("iter_"))):
        return open_megatron(src, vocab_size, weights_only, rows)  # as sources.open_source tells the kinds apart
    if vocab_size is not None:
        return None
    try:
        if (src / "config.json").is_file():
            # a Hugging Face folder, not a DeepSpeed checkpoint with a config beside it (those hold pickles)
            if any(src.glob("*.pt")) or any(src.glob("latest*")) or (src / "zero").exists():
                return None
            source = HFSource(src)
            if len(source.dtypes) == 1:
                return source
            source.close()  # weights of more than one dtype: the full path says so
            return None
        tag = follow_pointer(src)
        if not (tag / META).is_file() or manifest.verify(tag, False):
            return None
        meta = manifest.read_meta(tag)
        stored = stored_config(meta)
        if meta.get("backend") != "megatron" or meta.get("checkpoint_format") == "torch_dist" or stored is None:
            return None
        if not weights_only and (any(tag.glob("optim_*")) or any(tag.glob("distopt_*"))):
            return None  # optimizer state to carry: its param groups and per-rank state need torch
        source = ToolkitWeights(tag, meta, *stored, weights_only=True, rows=rows)
        source.unchecked = tag
        return source
    except (ToolkitError, OSError, ValueError, KeyError, TypeError):
        return None


def _copy(source: Source, target, pp: int, vpp: int, progress: bool, log, verbose: bool, check: SourceCheck,
          verify: bool) -> None:
    t0 = time.monotonic()
    bar = Progress(target.total, progress)
    plan_s = 0.0
    # past the page cache on request, where nothing reads the output back (docs/convert.md, "Writes past the page
    # cache": less CPU, slower where the page cache would have taken the whole output)
    direct = not verify and os.environ.get("TOOLKIT_DIRECT_IO") == "1"
    with views(), file_copy.writes_past_cache(direct), WriteBehind(bar, workers=writers(target)) as behind:
        for entry in iter_entries(target.dims, pp, vpp, getattr(target, "ep", 1)):
            t1 = time.monotonic()
            copies = byte_ranges.plan(source, target, entry, WEIGHT, None, WEIGHT, min_range=0)
            if copies is None:
                raise _NotByCopy(f"{entry.megatron_name} is not a copy of source byte ranges")
            plan_s += time.monotonic() - t1
            behind.submit(copies)
        check.wait()  # before the last writes are counted: a damaged source prints no "done" progress line
    report(target, behind, t0, plan_s, 0.0, 0.0, log, verbose)


def check_tokenizer_folder(to: str, tokenizer: str | Path | None) -> Path | None:
    """--tokenizer: a local folder holding tokenizer files, for an hf target."""
    if tokenizer is None:
        return None
    if to != "hf":
        raise ToolkitError(f"--tokenizer adds tokenizer files to a Hugging Face folder; --to {to} writes no "
                           "tokenizer: drop it")
    folder = Path(tokenizer)
    if not folder.is_dir() or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        names = ", ".join(TOKENIZER_FILES[:3])
        raise ToolkitError(f"--tokenizer {tokenizer}: not a folder holding tokenizer files ({names}, ...); give the "
                           "tokenizer's local folder. Nothing was written")
    return folder
