"""`toolkit convert SRC DST --to {hf,megatron,torch_dist,megatron_lm,deepspeed}`: any supported checkpoint to any
supported layout, streaming, verified, and all-or-nothing.

Sources (toolkit/checkpoint/sources.py) read their layout from their own files: Hugging Face folders, the
toolkit's Megatron checkpoints (any TP x PP x VPP, with optimizer state), Megatron-LM's legacy layout, Megatron-Core
torch_dist checkpoints (toolkit/checkpoint/torch_dist.py) and the toolkit's DeepSpeed checkpoints (ZeRO 0-3, from
the model states or with fp32=True the fp32 master weights).
Targets: a Hugging Face folder (sharded safetensors + index, config, tokenizer files), or a toolkit Megatron
checkpoint directory at a new TP x PP x VPP that the Megatron backend resumes from when the source carried
optimizer state, a Megatron-Core torch_dist checkpoint (toolkit/checkpoint/torch_dist_write.py) or Megatron-LM's
legacy layout (toolkit/checkpoint/megatron_lm_write.py). DeepSpeed
targets change the data-parallel size of a DeepSpeed checkpoint, the toolkit's or a plain one, ZeRO-3 included
(toolkit/checkpoint/deepspeed_reshard.py).

Streaming: one Megatron parameter at a time is read (positioned reads of safetensors, or memory-mapped legacy
files), merged to its Hugging Face tensors, split for the target and written at its offset in the target file, so
peak memory is a few times the largest parameter, whatever the model size. The output is built in a hidden folder
beside DST, verified, then renamed into place; an existing DST is replaced only with overwrite=True, and only
once the new one is complete.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from toolkit.checkpoint import byte_ranges, output
from toolkit.checkpoint.deepspeed_plain import is_plain
from toolkit.checkpoint.deepspeed_reshard import reshard_deepspeed, reshard_plain
from toolkit.checkpoint.hf_io import SHARD_BYTES, shard_layout, write_index
from toolkit.checkpoint.megatron_lm_write import MegatronLMTarget
from toolkit.checkpoint.plain_to_hf import convert_plain_to_hf
from toolkit.checkpoint.sources import TOKENIZER_FILES, WEIGHT, Source, follow_pointer, meta_shards, open_source
from toolkit.checkpoint.torch_dist_write import TorchDistTarget
from toolkit.checkpoint.universal import UniversalSource, is_universal, resolve_universal, write_universal
from toolkit.checkpoint.verify import Digests, import_early, read_back, release, verify_logits
from toolkit.errors import ToolkitError
from toolkit.families.entries import holders, iter_entries, rank_key
from toolkit.families.registry import family_of_config
from toolkit.families.rules import views
from toolkit.format import manifest, paths, safe_load
from toolkit.format import safetensors_stream as st
from toolkit.format.names import (META, OPTIM_GROUPS, OPTIM_SCHEDULER, POINTER, SCHEMA_VERSION, chunk_key, model_file,
                                  optim_file, plain_group, tag_for)
from toolkit.recipe.loader import REPO_ROOT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Progress:
    """Bytes written, rate and ETA on stderr: one updating line on a terminal, a line every 10 s otherwise."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > (0.5 if self.tty else 10) or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = max(self.total - self.done, 0) / rate if rate else 0  # serialized bytes may exceed the tensors
            line = (f"converting: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB, "
                    f"{rate / 2**20:.0f} MiB/s, ETA {eta:.0f} s")
            print(("\r" + line) if self.tty else line, end="" if self.tty and self.done < self.total else "\n",
                  file=sys.stderr, flush=True)


def _cast(t: torch.Tensor, dtype: torch.dtype | None, field: str) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and field == WEIGHT else t


class _WriteBehind:
    """Writes run on one background thread (pwrite releases the GIL)
    while the next parameter is read and split. At most `depth` parameters wait to be written, so memory stays a few
    parameters' worth. `seconds` adds up the thread's time in writes. Files that hash themselves as they are written
    (Writer.track_hash) are caught up on a second thread after each write, overlapped with the next ones."""

    def __init__(self, bar: Progress, depth: int = 2):

        self.pool, self.pending, self.bar, self.depth = ThreadPoolExecutor(1), [], bar, depth
        self.hasher, self.hashing = ThreadPoolExecutor(1), []
        self.seconds = self.hash_seconds = 0.0

    def submit(self, writes: list) -> None:
        while len(self.pending) >= self.depth:
            self.bar.add(self.pending.pop(0).result())
        self.pending.append(self.pool.submit(self._run, writes))

    def _run(self, writes: list) -> int:
        t0 = time.monotonic()
        n = sum(w.write_ranges(k, t) if isinstance(t, list) else w.write(k, t) for w, k, t in writes)
        self.seconds += time.monotonic() - t0
        touched = list({id(w): w for w, _, _ in writes if getattr(w, "tracks_hash", False)}.values())
        if touched:
            self.hashing = [f for f in self.hashing if not f.done() or f.result()]  # result() raises its error
            self.hashing.append(self.hasher.submit(self._catch_up, touched))
        return n

    def _catch_up(self, writers: list) -> None:
        t0 = time.monotonic()
        for w in writers:
            w.catch_up()
        self.hash_seconds += time.monotonic() - t0

    def __enter__(self) -> _WriteBehind:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            while self.pending and exc_type is None:
                self.bar.add(self.pending.pop(0).result())
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.hasher.shutdown(wait=True, cancel_futures=exc_type is not None)
        if exc_type is None:
            for f in self.hashing:
                f.result()


class HFTarget:
    """A Hugging Face folder: config.json, model.safetensors or model-0000i-of-0000n.safetensors + index."""

    raw_bytes = True  # safetensors files: byte ranges can be copied in (toolkit/checkpoint/byte_ranges.py)

    def __init__(self, folder: Path, source: Source, dtype: torch.dtype | None, shard_bytes: int = SHARD_BYTES):
        self.folder, self.dims = folder, source.dims()
        self.fields = (WEIGHT,)
        out_dtype = dtype or source.dtype()
        files, shards, self.total = shard_layout([(n, s, out_dtype) for e in iter_entries(self.dims, 1, 1)
                                                  if e.reads_back for n, s in zip(e.hf_names, e.hf_shapes)],
                                                 shard_bytes)
        self.writers = [st.Writer(folder / f, spec, {"format": "pt"}) for f, spec in zip(files, shards)]
        self._where = {name: w for w, spec in zip(self.writers, shards) for name in spec}
        write_index(folder, files, shards, self.total)
        config = dict(source.config)
        config["torch_dtype"] = str(out_dtype).replace("torch.", "")
        family = family_of_config(config)
        if not config.get("architectures"):  # absent, or None in a config made from a config class (no model saved it)
            config["architectures"] = [family.hf_architecture]  # vLLM and others pick the model class from it
        (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
        _copy_tokenizer(source, folder)

    def writes(self, entry, field: str, hf_tensors: list[torch.Tensor]) -> list[tuple[st.Writer, str, torch.Tensor]]:
        """(file, key, tensor) for each tensor this parameter puts in the folder."""
        if not entry.reads_back:
            return []
        return [(self._where[n], n, t) for n, t in zip(entry.hf_names, hf_tensors)]

    def close(self) -> None:
        for w in self.writers:
            w.close()


def _copy_tokenizer(source: Source, folder: Path) -> None:
    """Carry the tokenizer along: from a Hugging Face source folder, or the recipe's local tokenizer folder."""
    where = getattr(source, "folder", None)
    if where is None and source.meta and source.meta.get("recipe"):

        tok = Path(source.meta["recipe"].get("data", {}).get("tokenizer") or "")
        where = tok if tok.is_absolute() else REPO_ROOT / tok
    if where is not None and Path(where).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(where) / name).is_file():
                shutil.copy2(paths.inside(Path(where), name, f"{where} (its tokenizer file)"), folder / name)


class MegatronTarget:
    """A toolkit Megatron checkpoint directory: <dst>/step_XXXXXXXX/{model,optim}_tpTT_ppPPP.safetensors,
    toolkit_meta.json (layout, model config, recipe when known, manifest) and the latest_complete pointer."""

    raw_bytes = True  # safetensors files: byte ranges can be copied in (toolkit/checkpoint/byte_ranges.py)

    def __init__(self, root: Path, source: Source, tp: int, pp: int, vpp: int, dtype: torch.dtype | None,
                 weights_only: bool, ep: int = 1):

        self.root, self.source, self.layout, self.ep = root, source, (tp, pp, vpp), ep
        self.dims = source.dims(tp)
        self.fields = (WEIGHT,) if weights_only else source.fields
        self.step = int(source.step or 0)
        self.tag_dir = root / tag_for(self.step)
        self.tag_dir.mkdir(parents=True)
        out_dtype = dtype or source.dtype()
        optim_meta = dict(getattr(source, "optimizer_meta", None) or {})
        if source.optimizer_groups is not None:  # Megatron's, kept for a Megatron-LM or torch_dist target later
            optim_meta.setdefault(OPTIM_GROUPS, json.dumps([[plain_group(g) for g in source.optimizer_groups]]))
        if isinstance(source.scheduler, dict):
            optim_meta.setdefault(OPTIM_SCHEDULER, json.dumps(plain_group(source.scheduler)))
        self.writers: dict[tuple, st.Writer] = {}
        self.total = 0
        for rank, shapes in meta_shards(self.dims, tp, pp, vpp, ep).items():
            p, t, e = (*rank, None)[:3]  # e: the expert-parallel rank, in the key and file name only when ep > 1
            spec = {k: (s, out_dtype) for k, s in shapes.items()}
            self.writers[(*rank, WEIGHT)] = st.Writer(model_file(self.tag_dir, t, p, e), spec,
                                                      {"format": "toolkit-megatron"})
            self.total += sum(st.nbytes(s, d) for s, d in spec.values())
            extra = [f for f in self.fields if f != WEIGHT]
            if extra:
                spec = {f"{k}:{f}": (shape, torch.float32) for k, shape in shapes.items() for f in extra}
                self.writers[(*rank, "optim")] = st.Writer(optim_file(self.tag_dir, t, p, e), spec, optim_meta)
                self.total += sum(st.nbytes(s, d) for s, d in spec.values())
        for w in self.writers.values():  # the manifest's digests are taken as the files are written
            w.track_hash(manifest.DIGEST)

    def writes(self, entry, field: str, hf_tensors: list[torch.Tensor]) -> list[tuple[st.Writer, str, torch.Tensor]]:
        """(file, key, shard) for each TP rank's shard of this parameter."""

        key = chunk_key(entry.chunk, entry.megatron_name, None if field == WEIGHT else field)
        kind = WEIGHT if field == WEIGHT else "optim"
        pieces = entry.to_megatron(hf_tensors, self.layout[0])
        return [(self.writers[(*rank_key(entry.pp_rank, t, e, self.ep), kind)], key, piece)
                for t, piece in enumerate(pieces) for e in holders(entry, self.ep)]

    def close(self) -> None:
        writers = list(self.writers.values())
        with ThreadPoolExecutor(max(1, min(len(writers), 4))) as pool:  # fsync the files in parallel
            list(pool.map(lambda w: w.close(), writers))
        self._finish({w.path.name: w.manifest_entry() for w in writers})

    def _finish(self, known: dict[str, dict]) -> None:
        """Per-rank toolkit state (when the source has it), then the meta with its manifest, then the pointer."""

        tp, pp, vpp = self.layout
        src_meta = self.source.meta or {}
        old = src_meta.get("layout") or {}
        dp, cp = old.get("dp", 1), old.get("cp", 1)
        if (dp * cp) % self.ep:  # Megatron takes the expert-parallel ranks from dp x cp
            dp = self.ep
        # the optimizer state goes by parameter name, the plain optimizer's, whichever optimizer the source had
        resumable = self.fields != (WEIGHT,) and src_meta.get("recipe")
        layout = {"world_size": tp * pp * cp * dp, "zero_stage": 0, "dp": dp, "tp": tp, "pp": pp, "vpp": vpp, "cp": cp,
                  **({"ep": self.ep} if self.ep > 1 else {})}
        meta = {"schema_version": SCHEMA_VERSION, "step": self.step, "tag": self.tag_dir.name, "backend": "megatron",
                "layout": layout, "hf_config": self.source.config,
                "make_vocab_size_divisible_by": self.source.divisible_by,
                "converted_from": self.source.describe(), "weights_only": not resumable}
        if src_meta.get("recipe") and src_meta.get("backend") == "megatron":
            recipe = json.loads(json.dumps(src_meta["recipe"]))
            par = recipe.setdefault("parallel", {})
            par.update(tp=tp, pp=pp, vpp=vpp, world_size=layout["world_size"], dp=dp, ep=self.ep, zero_stage=0)
            meta["recipe"] = recipe
        if resumable:
            src_dir = self.source.tag_dir
            state = safe_load.load(src_dir / "toolkit_rank00000.pt")
            for rank in range(layout["world_size"]):
                # The data position is per data-parallel rank and dp is unchanged; RNG streams cannot map onto a
                # new set of ranks, so every rank starts from rank 0's (the families have no dropout; sampling is seeded).
                torch.save(state, self.tag_dir / f"toolkit_rank{rank:05d}.pt")
        meta["files"] = manifest.complete(self.tag_dir, known)
        (self.tag_dir / META).write_text(json.dumps(meta, indent=2, default=str))
        (self.root / POINTER).write_text(self.tag_dir.name)


def convert(src: str | Path, dst: str | Path, to: str, tp: int = 1, pp: int = 1, vpp: int = 1,
            dtype: str | None = None, vocab_size: int | None = None, fp32: bool = False, weights_only: bool = False,
            overwrite: bool = False, verify: bool = True, dp: int | None = None, progress: bool = True,
            log=print, config: str | Path | None = None, verbose: bool = False, ep: int = 1) -> Path:
    """Convert SRC into DST (see the module docstring). Returns DST. `config`: the Hugging Face config of a plain
    DeepSpeed checkpoint (toolkit/checkpoint/plain_to_hf.py)."""
    src, dst = Path(src), Path(dst)
    if to == "universal":  # DeepSpeed's universal checkpoint from a ZeRO checkpoint (toolkit/checkpoint/universal.py)
        return write_universal(src, dst, overwrite, log)
    if to == "hf" and is_universal(src):
        if dtype is not None and dtype not in DTYPES:
            raise ToolkitError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return convert_plain_to_hf(src, dst, config, fp32, DTYPES[dtype] if dtype else None, overwrite, verify, log,
                                   reader=UniversalSource, resolve=resolve_universal, kind="universal")
    if to == "hf" and is_plain(src):
        if dtype is not None and dtype not in DTYPES:
            raise ToolkitError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return convert_plain_to_hf(src, dst, config, fp32, DTYPES[dtype] if dtype else None, overwrite, verify, log)
    output.check_destination(src, dst, overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise ToolkitError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if to == "deepspeed":
        return _to_deepspeed(src, dst, dp, overwrite, log)
    if to not in ("hf", "megatron", "torch_dist", "megatron_lm"):
        raise ToolkitError(f"--to {to!r} is not one of hf, megatron, torch_dist, megatron_lm, deepspeed, universal")
    if to == "hf" and (tp, pp, vpp) != (1, 1, 1):
        raise ToolkitError("--tp/--pp/--vpp describe a Megatron target; a Hugging Face folder is not sharded")
    if ep > 1 and to == "hf":
        raise ToolkitError(f"--ep {ep}: expert-parallel files are written in the toolkit's Megatron layout and "
                           "Megatron-LM's legacy one; a Hugging Face folder holds every expert in one model: drop --ep")
    # a Hugging Face target carries no optimizer state: it never reads (nor can be stopped by) the source's
    source, check = _open_checking(src, vocab_size, fp32, weights_only or to == "hf")
    try:
        with output.scratch_folder(dst, "partial") as tmp, check:
            cast = DTYPES[dtype] if dtype else None
            target = (HFTarget(tmp, source, cast) if to == "hf"
                      else TorchDistTarget(tmp, source, tp, pp, vpp, cast, weights_only, ep) if to == "torch_dist"
                      else MegatronLMTarget(tmp, source, tp, pp, vpp, cast, ep, weights_only) if to == "megatron_lm"
                      else MegatronTarget(tmp, source, tp, pp, vpp, cast, weights_only, ep))
            manifest.require_space(dst.parent, target.total, manifest.free_bytes(tmp), str(dst),
                                   "the tensors to write")
            log(f"converting {source.describe()} at {src} -> {to}"
                + (f" tp={tp} pp={pp} vpp={vpp}" if to != "hf" else "") + (f" ep={ep}" if ep > 1 else "")
                + f" ({', '.join(target.fields)}; {target.total / 2**30:.2f} GiB to write)")
            if to != "hf" and (getattr(source, "optimizer_note", None)
                                                      or getattr(target, "note", None)):
                log(f"optimizer state: {source.optimizer_note or target.note}")
            digests = Digests() if verify else None
            if verify:
                import_early(family_of_config(source.config).hf_architecture)
            _write(source, target, cast, pp, vpp, progress, log, verbose, digests, check)
            if verify:
                t0 = time.monotonic()
                _verify(source, tmp if to == "hf" else target.tag_dir, target.fields, cast, log, digests,
                        tmp if to == "hf" else None)
                if verbose:
                    log(f"phases: verify {time.monotonic() - t0:.1f} s")
            output.replace(tmp, dst)
    finally:
        source.close()
    return dst


class _SourceCheck:
    """A toolkit checkpoint source's checksums, checked on a background thread while the conversion reads it
    (open_source checked its manifest's sizes). wait() raises what the manifest check found; so does leaving the
    block on any error: a damaged source is reported as damaged, whatever failed first, and nothing is written."""

    def __init__(self, folder: Path | None):
        self.folder, self.pool = folder, ThreadPoolExecutor(1) if folder is not None else None
        self.future = self.pool.submit(manifest.verify, folder) if self.pool else None

    def wait(self) -> None:
        problems = self.future.result() if self.future else []
        if problems:
            raise ToolkitError(f"{self.folder} is not a complete checkpoint: {'; '.join(problems)}")

    def __enter__(self) -> _SourceCheck:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, Exception):
                self.wait()
        finally:
            if self.pool:
                self.pool.shutdown(wait=True, cancel_futures=True)


def _open_checking(src: Path, vocab_size, fp32: bool, weights_only: bool) -> tuple[Source, _SourceCheck]:
    """The source, its checksums hashed in the background (_SourceCheck); a source that does not open is opened
    again with its checksums checked first, so a damaged file is reported as that."""
    try:
        source = open_source(src, vocab_size, fp32, weights_only, checksums=False)
    except ToolkitError:
        source = open_source(src, vocab_size, fp32, weights_only)
    return source, _SourceCheck(source.unchecked)


def _write(source: Source, target, cast, pp: int, vpp: int, progress: bool, log, verbose: bool = False,
           digests: Digests | None = None, check: _SourceCheck | None = None) -> None:
    t0 = time.monotonic()
    bar = Progress(target.total, progress)
    read_s = split_s = 0.0
    with views(), _WriteBehind(bar) as behind:  # pieces are written out at once: no compact copies needed
        for entry in iter_entries(target.dims, pp, vpp, getattr(target, "ep", 1)):
            for field in target.fields:
                t1 = time.monotonic()
                copies = byte_ranges.plan(source, target, entry, field, cast, WEIGHT)
                if copies is not None:  # file to file in the kernel; the weights are hashed when verified
                    if digests is not None and entry.reads_back and field != WEIGHT:
                        digests.add(entry.hf_names, field, [_cast(x, cast, field)
                                                            for x in source.read(entry.hf_names, field)])
                    read_s += time.monotonic() - t1
                    behind.submit(copies)
                    del copies
                    continue
                hf = [_cast(x, cast, field) for x in source.read(entry.hf_names, field)]
                if digests is not None and entry.reads_back and field != WEIGHT:
                    # the optimizer state, which the logit check does not read (it hashes the weights), is hashed
                    # here (the hash releases the GIL while the writer thread writes), so no queued write keeps
                    # the source tensors alive after their split: memory stays that of --no-verify
                    digests.add(entry.hf_names, field, hf)
                t2 = time.monotonic()
                writes = target.writes(entry, field, hf)
                split_s, read_s = split_s + time.monotonic() - t2, read_s + t2 - t1
                behind.submit(writes)
                del hf, writes
            release()  # what glibc kept of the tensors freed so far goes back: memory does not creep with layers
        if check is not None:  # before the last writes are counted: a damaged source prints no "done" progress line
            check.wait()
    t3 = time.monotonic()
    writers = getattr(target, "writers", [])
    writers = list(writers.values() if isinstance(writers, dict) else writers)
    kernel, gathered, user = (sum(getattr(w, attr, 0) for w in writers)
                              for attr in ("kernel_bytes", "gathered_bytes", "user_bytes"))
    target.close()
    log(f"wrote {target.total / 2**30:.2f} GiB in {time.monotonic() - t0:.1f} s")
    if verbose:
        log(f"phases: read {read_s - (digests.seconds if digests else 0):.1f} s, hash "
            f"{digests.seconds if digests else 0:.1f} s, split {split_s:.1f} s (main thread); write {behind.seconds:.1f} "
            f"s (writer thread, overlapped); manifest-hash {behind.hash_seconds:.1f} s (hash thread, overlapped); "
            f"close/fsync/manifest "
            f"{time.monotonic() - t3:.1f} s")
        log(f"copied file to file: {kernel / 2**20:.1f} MiB by copy_file_range, {gathered / 2**20:.1f} MiB by "
            f"pwritev from the mapped source (small ranges), {user / 2**20:.1f} MiB through a buffer where the kernel "
            f"would not copy (of {target.total / 2**30:.2f} GiB)")


def _verify(source: Source, written: Path, fields: tuple[str, ...], cast, log, digests: Digests,
            hf_folder: Path | None) -> None:
    """transformers' model must give the same logits with the output's weights as with the source's, and every
    tensor of the output read back must hash as the source's did when written (the weights on the logit check's
    read, the rest read again after it; toolkit/checkpoint/verify.py); memory one layer."""
    # the true vocabulary, for Megatron-LM-style outputs; the manifest's checksums were just taken from these files
    # (hashing them again would prove nothing the tensors' read-back does not)
    output_source = open_source(written, source.dims().vocab, checksums=False)
    try:
        proved = verify_logits(source, output_source, cast or source.dtype(), hf_folder, log, True, cast)
    finally:
        output_source.close()
    read_back(source, written, fields, digests, log, proved or set(), cast)  # the optimizer state, any weight left


def _to_deepspeed(src: Path, dst: Path, dp: int | None, overwrite: bool, log=print) -> Path:

    if dp is None:
        raise ToolkitError("--to deepspeed changes a DeepSpeed checkpoint's data-parallel size: pass --dp N")
    if is_plain(src):  # engine.save_checkpoint in the user's own script: ZeRO-1/2/3, DeepSpeed's files only
        return reshard_plain(src, dst, dp, overwrite, log)
    tag = follow_pointer(src)
    if tag.name.startswith("step_") and not (tag / META).is_file():
        raise ToolkitError(f"{tag} is not a complete checkpoint: {META} is missing: the save never completed")
    if not (tag / META).is_file() or manifest.read_meta(tag).get("backend") != "deepspeed":
        raise ToolkitError(f"{src} is not a toolkit DeepSpeed checkpoint; DeepSpeed runs load Hugging Face weights "
                           "directly (model.hf_path + model.pretrained: true), so convert other formats --to hf")

    return reshard_deepspeed(tag, dst, dp, overwrite=overwrite)


def convert_to_hf(src: str | Path, dst: str | Path, vocab_size: int | None = None, dtype: str | None = None,
                  overwrite: bool = False, verify: bool = True) -> Path:
    """Shorthand for convert(..., to="hf")."""
    return convert(src, dst, "hf", dtype=dtype, vocab_size=vocab_size, overwrite=overwrite, verify=verify,
                   progress=False, log=lambda *_: None)
