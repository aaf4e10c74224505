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

A conversion that only moves bytes (no cast, weights only; from a safetensors, Megatron-LM or torch_dist source) is
written by toolkit/checkpoint/copy_only.py without torch, and verified, unless --no-verify, by the same check as
here (toolkit/checkpoint/verify.py verify_output); convert() tries it first, and the `toolkit convert` command before
it imports this module.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from toolkit.checkpoint import byte_ranges, copy_only, output
from toolkit.checkpoint import verify as verification
from toolkit.checkpoint.deepspeed_plain import is_plain
from toolkit.checkpoint.deepspeed_reshard import reshard_deepspeed, reshard_plain
from toolkit.checkpoint.megatron_lm_optim import optimizer_plan, optimizer_writer
from toolkit.checkpoint.megatron_lm_write import MegatronLMTarget
from toolkit.checkpoint.megatron_sources import MegatronLMSource, TorchDistSource
from toolkit.checkpoint.plain_to_hf import convert_plain_to_hf
from toolkit.checkpoint.safetensors_sources import require_one_dtype
from toolkit.checkpoint.source_base import MEGATRON_TARGETS, layout_notes, optimizer_note, read_for
from toolkit.checkpoint.sources import (WEIGHT, DeepSpeedHFSource, Source, follow_pointer, not_a_checkpoint,
                                       open_source)
from toolkit.checkpoint.streaming import Progress, SourceCheck, WriteBehind, report, writers
from toolkit.checkpoint.targets import HFTarget, MegatronTarget
from toolkit.checkpoint.torch_dist_write import TorchDistTarget
from toolkit.checkpoint.universal import UniversalSource, is_universal, resolve_universal, write_universal
from toolkit.checkpoint.verify import release
from toolkit.checkpoint.verify_hash import Digests
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries
from toolkit.families.registry import family_of_config
from toolkit.families.rules import views
from toolkit.format import manifest, safe_load
from toolkit.format.names import MASTER, META, POINTER

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _refuse_unused(to: str, tp: int, pp: int, vpp: int, ep: int, dtype: str | None, weights_only: bool,
                   vocab_size: int | None, fp32: bool, config, divisible_by: int | None) -> None:
    """--to deepspeed and --to universal rewrite a DeepSpeed checkpoint's files as they are (at another --dp, or as
    DeepSpeed's universal layout): the options of the other targets change nothing there, and were ignored in silence
    until 2026-12-07 (`--to deepspeed --dp 1 --dtype bf16` wrote fp32)."""
    if to not in ("deepspeed", "universal"):
        return
    unused = [flag for flag, given in (
        ("--tp/--pp/--vpp", (tp, pp, vpp) != (1, 1, 1)), ("--ep", ep != 1), ("--dtype", dtype is not None),
        ("--weights-only", weights_only), ("--vocab-size", vocab_size is not None), ("--fp32", fp32),
        ("--config", config is not None),
        ("--make-vocab-size-divisible-by", divisible_by is not None)) if given]
    if unused:
        what = "at another data-parallel size (--dp)" if to == "deepspeed" else "in DeepSpeed's universal layout"
        many = len(unused) > 1
        raise ToolkitError(f"--to {to} rewrites a DeepSpeed checkpoint's own files {what}, their dtypes and state as "
                           f"they are: {', '.join(unused)} {'do' if many else 'does'} not apply to it; drop "
                           f"{'them' if many else 'it'} (--to hf writes another dtype, or the weights alone)")


def _check_cast(source: Source, cast: torch.dtype | None, weights_only: bool, src: Path, dtype: str | None) -> None:
    """A cast that narrows the weights of a source whose optimizer state travels with them and that keeps no fp32
    master copy (an fp32 run's weights are its master weights) is refused: the resumed run would go on from the
    rounded weights, as if nothing had changed (its recipe still says fp32). It was written until 2026-12-07."""
    if cast is None or weights_only or source.fields == (WEIGHT,) or MASTER in source.fields:
        return
    was = source.dtype()
    if cast.itemsize < was.itemsize:
        raise ToolkitError(f"--dtype {dtype} would round {src}'s {str(was).removeprefix('torch.')} weights, which are "
                           "its run's master weights (it keeps no other copy), and carry its optimizer state with "
                           f"them: a run resumed from it would go on from rounded weights. Add --weights-only for a "
                           f"{dtype} copy of the model, or leave out --dtype to keep the run resumable")


def _cast(t: torch.Tensor, dtype: torch.dtype | None, field: str, name: str = "a weight") -> torch.Tensor:
    """The weight in `dtype`. A cast to float16 that turns finite values into infinities is refused: the output's
    logits would be NaN, and the verification, which compares the output with the cast source, said "verified" until
    2026-12-07 (float16's largest value is 65504; bfloat16 has float32's range)."""
    if dtype is None or field != WEIGHT:
        return t
    out = t.to(dtype)
    if dtype == torch.float16 and t.dtype != dtype and t.is_floating_point():
        overflow = torch.isinf(out) & torch.isfinite(t)
        if overflow.any():
            raise ToolkitError(f"--dtype fp16: {int(overflow.sum()):,} values of {name} (up to "
                               f"{t[overflow].abs().max().item():.4g}, in {str(t.dtype).removeprefix('torch.')}) are "
                               "beyond float16's range (65504) and would "
                               "be written as infinities; use --dtype bf16 (float32's range), or keep the dtype")
    return out


def _known(src: Path) -> bool:
    """Whether some reader takes `src`, by its names alone (what it is comes from open_source)."""
    markers = ("config.json", META, POINTER, "latest_checkpointed_iteration.txt")
    return src.name.startswith(("step_", "iter_")) or any((src / m).is_file() for m in markers) or is_plain(src) \
        or is_universal(src)


def convert(src: str | Path, dst: str | Path, to: str, tp: int = 1, pp: int = 1, vpp: int = 1,
            dtype: str | None = None, vocab_size: int | None = None, fp32: bool = False, weights_only: bool = False,
            overwrite: bool = False, verify: bool = True, dp: int | None = None, progress: bool = True,
            log=print, config: str | Path | None = None, verbose: bool = False, ep: int = 1, copy: bool = True,
            announced: bool = False, divisible_by: int | None = None, tokenizer: str | Path | None = None) -> Path:
    """Convert SRC into DST (see the module docstring). Returns DST. `config`: the Hugging Face config of a plain
    DeepSpeed checkpoint (toolkit/checkpoint/plain_to_hf.py). `copy`: try the torch-free copy-only path first
    (toolkit/checkpoint/copy_only.py); `announced`: it already printed the "converting" line (and why it stopped).
    `divisible_by`: a Megatron target's make_vocab_size_divisible_by (default: the source's). `tokenizer`: a folder
    whose tokenizer files an hf target gets (outside SRC, so only when named)."""
    src, dst = Path(src), Path(dst)
    tokenizer = copy_only.check_tokenizer_folder(to, tokenizer)
    _refuse_unused(to, tp, pp, vpp, ep, dtype, weights_only, vocab_size, fp32, config, divisible_by)
    if divisible_by is not None and to not in MEGATRON_TARGETS:
        raise ToolkitError(f"--make-vocab-size-divisible-by pads the vocabulary of a Megatron target (--to megatron, "
                           f"torch_dist or megatron_lm); --to {to} has no padding: drop it")
    # before any branch returns (a universal or plain DeepSpeed source took --dp, --tp and --pp in silence until
    # 2026-12-07)
    if dp is not None and to != "deepspeed":
        raise ToolkitError(f"--dp sets the data-parallel size of a DeepSpeed target (--to deepspeed); drop it for "
                           f"--to {to}")
    if to == "hf" and (tp, pp, vpp) != (1, 1, 1):
        raise ToolkitError("--tp/--pp/--vpp describe a Megatron target; a Hugging Face folder is not sharded")
    if ep > 1 and to == "hf":
        raise ToolkitError(f"--ep {ep}: expert-parallel files are written in the toolkit's Megatron layout and "
                           "Megatron-LM's legacy one; a Hugging Face folder holds every expert in one model: drop --ep")
    if to == "universal":  # DeepSpeed's universal checkpoint from a ZeRO checkpoint (toolkit/checkpoint/universal.py)
        return write_universal(src, dst, overwrite, log)
    if vocab_size is not None and (is_universal(src) or is_plain(src)):
        raise ToolkitError(f"--vocab-size gives the true vocabulary of a Megatron-LM or torch_dist checkpoint; {src} is a "
                           "DeepSpeed one, whose model's config gives it: drop --vocab-size")
    if is_universal(src) and to != "hf":
        raise ToolkitError(f"{src} is a DeepSpeed universal checkpoint, which DeepSpeed itself loads at any "
                           "data-parallel size (with \"checkpoint\": {\"load_universal\": true} in its ds_config): it converts --to hf, "
                           "and that folder on to any other format")
    if is_universal(src):  # --to hf (any other target was refused above)
        if dtype is not None and dtype not in DTYPES:
            raise ToolkitError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return convert_plain_to_hf(src, dst, config, fp32, DTYPES[dtype] if dtype else None, overwrite, verify, log,
                                   reader=UniversalSource, resolve=resolve_universal, kind="universal",
                                   tokenizer=tokenizer)
    if to == "hf" and is_plain(src):
        if dtype is not None and dtype not in DTYPES:
            raise ToolkitError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return convert_plain_to_hf(src, dst, config, fp32, DTYPES[dtype] if dtype else None, overwrite, verify, log,
                                   tokenizer=tokenizer)
    # read by the two branches above only: never ignored silently (a plain checkpoint's own refusal comes below)
    if config is not None and not is_plain(src):
        if not _known(src):
            raise not_a_checkpoint(src) if src.exists() else ToolkitError(f"{src} does not exist")
        raise ToolkitError(f"--config gives the model of a DeepSpeed checkpoint (plain or universal) converted --to hf; "
                           f"{src} --to {to} reads its own: drop --config")
    if copy:
        copied, announced = copy_only.convert_by_copy(src, dst, to, tp, pp, vpp, dtype, vocab_size, fp32,
                                                      weights_only, overwrite, verify, dp, progress, log, config,
                                                      verbose, ep, lambda: CopyCheck, divisible_by, tokenizer)
        if copied is not None:  # bytes only: copied file to file
            return copied
    output.check_destination(src, dst, overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise ToolkitError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if to == "deepspeed":
        return _to_deepspeed(src, dst, dp, overwrite, log)
    if to not in ("hf", "megatron", "torch_dist", "megatron_lm"):
        raise ToolkitError(f"--to {to!r} is not one of hf, megatron, torch_dist, megatron_lm, deepspeed, universal")
    # a Hugging Face target carries no optimizer state: it never reads (nor can be stopped by) the source's
    source, check = _open_checking(src, vocab_size, fp32, weights_only or to == "hf", to, tp, divisible_by)
    try:
        recorded = source.config["vocab_size"]
        if vocab_size is not None and not isinstance(source, (MegatronLMSource, TorchDistSource)) \
                and vocab_size != recorded:
            raise ToolkitError(f"--vocab-size {vocab_size}: {src} records its vocabulary ({recorded}); "
                               "--vocab-size gives the true vocabulary of a Megatron-LM or torch_dist checkpoint, "
                               "whose padded rows do not tell it: drop it")
        if fp32 and not isinstance(source, DeepSpeedHFSource):
            raise ToolkitError(f"--fp32 takes a DeepSpeed checkpoint's fp32 master weights; {src} is a "
                               f"{source.kind} checkpoint: drop --fp32 (--dtype fp32 casts the weights)")
        if not dtype:
            require_one_dtype(source)
        cast = DTYPES[dtype] if dtype else None
        _check_cast(source, cast, to == "hf" or weights_only, src, dtype)
        with output.scratch_folder(dst, "partial") as tmp, check:
            target = (HFTarget(tmp, source, cast, tokenizer=tokenizer) if to == "hf"
                      else TorchDistTarget(tmp, source, tp, pp, vpp, cast, weights_only, ep, optimizer_plan)
                      if to == "torch_dist"
                      else MegatronLMTarget(tmp, source, tp, pp, vpp, cast, ep, weights_only, optimizer_writer)
                      if to == "megatron_lm"
                      else MegatronTarget(tmp, source, tp, pp, vpp, cast, weights_only, ep, _rank_state))
            manifest.require_space(dst.parent, target.total, manifest.free_bytes(tmp), str(dst),
                                   "the tensors to write")
            if not announced:
                log(f"converting {source.describe()} at {src} -> {to}"
                    + (f" tp={tp} pp={pp} vpp={vpp}" if to != "hf" else "") + (f" ep={ep}" if ep > 1 else "")
                    + f" ({', '.join(target.fields)}; {output.size_text(target.total)} to write)")
                for note in layout_notes(source, to, tp) + [getattr(target, "tokenizer_note", None)]:
                    if note:
                        log(note)
            # the copy path that began this printed the source's note (copy_only.convert_by_copy): not twice
            if to != "hf" and not (announced and getattr(source, "optimizer_note", None)) and (
                    getattr(source, "optimizer_note", None) or getattr(target, "note", None)):
                log(f"optimizer state: {optimizer_note(source.optimizer_note, src) or target.note}")
            digests = Digests() if verify else None
            if verify:
                verification.import_early(family_of_config(source.config).hf_architecture, source.config)
            _write(source, target, cast, pp, vpp, progress, log, verbose, digests, check)
            if verify:
                t0 = time.monotonic()
                verification.verify_output(source, tmp if to == "hf" else target.tag_dir, target.fields, cast, log,
                                           digests, tmp if to == "hf" else None)
                if verbose:
                    log(f"phases: verify {time.monotonic() - t0:.1f} s")
            output.replace(tmp, dst, overwrite)
            if hasattr(target, "megatron_lm_flags"):  # docs/convert.md, "Continuing in Megatron-LM or Megatron-Bridge"
                log(f"to continue in Megatron-LM: --load {dst} {target.megatron_lm_flags()}")
    finally:
        source.close()
    return dst


def _open_checking(src: Path, vocab_size, fp32: bool, weights_only: bool, to: str, tp: int,
                   divisible_by: int | None) -> tuple[Source, SourceCheck]:
    """The source, its checksums hashed in the background (SourceCheck); a source that does not open is opened
    again with its checksums checked first, so a damaged file is reported as that. A Megatron source whose padding
    rows the target keeps is opened again to read them (source_base.read_for)."""
    try:
        source = open_source(src, vocab_size, fp32, weights_only, checksums=False)
    except ToolkitError:
        source = open_source(src, vocab_size, fp32, weights_only)
    checksums = source.unchecked is None
    source = read_for(source, to, tp, divisible_by, lambda rows: open_source(src, vocab_size, fp32, weights_only,
                                                                               checksums=checksums, rows=rows))
    return source, SourceCheck(source.unchecked)


def _write(source: Source, target, cast, pp: int, vpp: int, progress: bool, log, verbose: bool = False,
           digests: Digests | None = None, check: SourceCheck | None = None) -> None:
    t0 = time.monotonic()
    bar = Progress(target.total, progress)
    read_s = split_s = 0.0
    # pieces are written out at once: no compact copies needed
    with views(), WriteBehind(bar, workers=writers(target)) as behind:
        for entry in iter_entries(target.dims, pp, vpp, getattr(target, "ep", 1)):
            for field in target.fields:
                t1 = time.monotonic()
                copies = byte_ranges.plan(source, target, entry, field, cast, WEIGHT)
                if copies is not None:  # file to file in the kernel; the weights are hashed when verified
                    if digests is not None and entry.reads_back and field != WEIGHT:
                        digests.add(entry.hf_names, field, [_cast(x, cast, field, n) for n, x in
                                                            zip(entry.hf_names, source.read(entry.hf_names, field))])
                    read_s += time.monotonic() - t1
                    behind.submit(copies)
                    del copies
                    continue
                hf = [_cast(x, cast, field, n) for n, x in zip(entry.hf_names, source.read(entry.hf_names, field))]
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
    report(target, behind, t0, read_s, split_s, digests.seconds if digests else 0.0, log, verbose)


class CopyCheck:
    """The verification of a conversion that toolkit/checkpoint/copy_only.py copied: made on its background thread
    while the bytes are copied (transformers' import started, the source opened as this path opens it), then run()
    on the output, as convert() checks its own."""

    def __init__(self, src: Path, config: dict, vocab_size: int | None, weights_only: bool, rows: int | None = None):
        verification.import_early(family_of_config(config).hf_architecture, config)
        # its checksums are the copy's check (SourceCheck); an error opening it is raised on the conversion's thread
        self.source = open_source(src, vocab_size, False, weights_only, checksums=False, rows=rows)
        # on this thread, so that transformers' objects too are made with the collector off and then frozen
        # (copy_only._Verification), not collected during the copy and the check (docs/performance.md)
        verification.join_import()

    def run(self, written: Path, fields: tuple[str, ...], hf_folder: Path | None, log) -> None:
        verification.verify_output(self.source, written, fields, None, log, Digests(), hf_folder)

    def close(self) -> None:
        self.source.close()


def _rank_state(src: Path, dsts: list[Path]) -> None:
    """A training checkpoint's per-rank toolkit state for a new layout: rank 0's, through the allow-list, for each."""
    state = safe_load.load(src)
    for dst in dsts:
        torch.save(state, dst)


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

    return reshard_deepspeed(tag, dst, dp, overwrite=overwrite, log=log)


def convert_to_hf(src: str | Path, dst: str | Path, vocab_size: int | None = None, dtype: str | None = None,
                  overwrite: bool = False, verify: bool = True, tokenizer: str | Path | None = None) -> Path:
    """Shorthand for convert(..., to="hf")."""
    return convert(src, dst, "hf", dtype=dtype, vocab_size=vocab_size, overwrite=overwrite, verify=verify,
                   progress=False, log=lambda *_: None, tokenizer=tokenizer)

