"""The targets of `toolkit convert` whose files are safetensors: a Hugging Face folder and a toolkit Megatron
checkpoint. They lay their files out without torch, so the copy-only path (toolkit/checkpoint/copy_only.py) writes
them as the full one does (toolkit/checkpoint/convert.py); torch_dist and Megatron-LM targets are in
torch_dist_write.py and megatron_lm_write.py."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.checkpoint.hf_io import SHARD_BYTES, shard_layout, write_index
from toolkit.checkpoint.safetensors_sources import carried_files, copy_carried, meta_shards
from toolkit.checkpoint.source_base import WEIGHT, Source
from toolkit.errors import ToolkitError
from toolkit.families.entries import holders, iter_entries, rank_key
from toolkit.families.registry import family_of_config
from toolkit.format import manifest, paths
from toolkit.format import safetensors_stream as st
from toolkit.format.names import (META, OPTIM_GROUPS, OPTIM_SCHEDULER, POINTER, SCHEMA_VERSION, chunk_key, model_file,
                                  optim_file, plain_group, tag_for)

if TYPE_CHECKING:
    import torch


class HFTarget:
    """A Hugging Face folder: config.json, model.safetensors or model-0000i-of-0000n.safetensors + index."""

    raw_bytes = True  # safetensors files: byte ranges can be copied in (toolkit/checkpoint/byte_ranges.py)
    concurrent_writes = True  # its files (safetensors_stream.Writer) take writes from several threads at once

    def __init__(self, folder: Path, source: Source, dtype: torch.dtype | str | None, shard_bytes: int = SHARD_BYTES,
                 tokenizer: Path | None = None):
        """`tokenizer`: a folder whose tokenizer files to add (a training run's own, or --tokenizer)."""
        self.folder, self.dims = folder, source.dims()
        self.fields = (WEIGHT,)
        out_dtype = st.dtype_name(dtype) if dtype is not None else source.dtype_name()
        files, shards, self.total = shard_layout([(n, s, out_dtype) for e in iter_entries(self.dims, 1, 1)
                                                  if e.reads_back for n, s in zip(e.hf_names, e.hf_shapes)],
                                                 shard_bytes)
        self.writers = [st.Writer(folder / f, spec, {"format": "pt"}) for f, spec in zip(files, shards)]
        self._where = {name: w for w, spec in zip(self.writers, shards) for name in spec}
        write_index(folder, files, shards, self.total)
        config = dict(source.config)
        # transformers 5 writes and reads "dtype", older ones "torch_dtype" (5 still takes it): every key there is
        # rewritten, so that from_pretrained(dtype="auto") loads what was written
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
            config[key] = st.TORCH_NAMES[out_dtype]
        family = family_of_config(config)
        if not config.get("architectures"):  # absent, or None in a config made from a config class (no model saved it)
            config["architectures"] = [family.hf_architecture]  # vLLM and others pick the model class from it
        (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.tokenizer_note = _copy_tokenizer(source, folder, tokenizer)

    def writes(self, entry, field: str, hf_tensors: list[torch.Tensor]) -> list[tuple[st.Writer, str, torch.Tensor]]:
        """(file, key, tensor) for each tensor this parameter puts in the folder."""
        if not entry.reads_back:
            return []
        return [(self._where[n], n, t) for n, t in zip(entry.hf_names, hf_tensors)]

    def close(self) -> None:
        for w in self.writers:
            w.close()


def _copy_tokenizer(source: Source, folder: Path, given: Path | None = None) -> str | None:
    """Carry the tokenizer (its files, named chat templates) and the model's own files (generation_config.json, the
    license, the model card: safetensors_sources.carried_files) along: the tokenizer from `given` (a
    folder the user named, or a training run's own data.tokenizer), else from a Hugging Face source folder or a
    toolkit checkpoint's step folder that a conversion put them in. Nothing outside SRC is read unless named: a
    training checkpoint's recipe names its tokenizer, but as a path of the run's machine and working folder (it was
    read until 2026-12-07, relative paths from the toolkit's install). Returns a note when that tokenizer is left
    out."""
    own = getattr(source, "folder", None)
    tag = getattr(source, "tag_dir", None)
    if own is None and tag is not None and carried_files(Path(tag)):
        own = tag
    own = Path(own) if own is not None and Path(own).is_dir() else None
    if given is not None and Path(given).is_dir():  # the tokenizer named; the model's own files still from SRC
        top, rows = largest_token_id(Path(given)), source.config.get("vocab_size")
        if top is not None and isinstance(rows, int) and top >= rows:  # accepted without a word until 2026-12-07
            raise ToolkitError(f"--tokenizer {given}: its token ids go up to {top:,}, but the model has {rows:,} "
                               f"vocabulary rows: any id from {rows:,} on would index past the embeddings; give the "
                               "tokenizer this model was trained with. Nothing was written")
        copy_carried(Path(given), folder, carried_files(Path(given), model=own is None), "its tokenizer file")
        if own is not None:
            copy_carried(own, folder, carried_files(own, tokenizer=False), "its file")
        return None
    if own is not None:
        copy_carried(own, folder, carried_files(own), "its tokenizer file")
        return None
    named = ((source.meta or {}).get("recipe") or {}).get("data", {}).get("tokenizer")
    if named:
        return (f"tokenizer: not copied: the checkpoint holds none, and its run's data.tokenizer ({named}) is outside "
                f"SRC; add --tokenizer {named} (from the folder the run started in) to copy its files")
    return None


def largest_token_id(folder: Path) -> int | None:
    """The largest id a tokenizer folder's tokenizer.json (its vocabulary and added tokens) or added_tokens.json
    gives, or None where neither says (a SentencePiece model alone)."""
    ids: list[int] = []
    for name, pick in (("tokenizer.json", _tokenizer_json_ids), ("added_tokens.json", lambda d: list(d.values()))):
        file = folder / name
        if file.is_file():
            try:
                ids += [i for i in pick(json.loads(paths.inside(folder, name, str(folder)).read_text()))
                        if isinstance(i, int)]
            except (ValueError, AttributeError, TypeError):
                continue  # not the JSON transformers writes: its own loader would say so
    return max(ids) if ids else None


def _tokenizer_json_ids(data: dict) -> list[int]:
    vocab = (data.get("model") or {}).get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1] if isinstance(vocab, list) else []
    return ids + [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]


class MegatronTarget:
    """A toolkit Megatron checkpoint directory: <dst>/step_XXXXXXXX/{model,optim}_tpTT_ppPPP.safetensors,
    toolkit_meta.json (layout, model config, recipe when known, manifest) and the latest_complete pointer."""

    raw_bytes = True  # safetensors files: byte ranges can be copied in (toolkit/checkpoint/byte_ranges.py)
    concurrent_writes = True  # its files (safetensors_stream.Writer) take writes from several threads at once

    def __init__(self, root: Path, source: Source, tp: int, pp: int, vpp: int, dtype: torch.dtype | str | None,
                 weights_only: bool, ep: int = 1, rank_state=None):
        """`rank_state(src file, dst files)`: writes a training source's per-rank toolkit state (rank 0's, loaded
        by the allow-list and saved again) into each new rank's file; needed when the output is resumable."""
        self.rank_state = rank_state

        self.root, self.source, self.layout, self.ep = root, source, (tp, pp, vpp), ep
        self.dims = source.out_dims(tp)
        self.fields = (WEIGHT,) if weights_only else source.fields
        self.step = int(source.step or 0)
        self.tag_dir = root / tag_for(self.step)
        self.tag_dir.mkdir(parents=True)
        out_dtype = st.dtype_name(dtype) if dtype is not None else source.dtype_name()
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
                spec = {f"{k}:{f}": (shape, "F32") for k, shape in shapes.items() for f in extra}
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
                "make_vocab_size_divisible_by": self.source.out_divisor,
                "converted_from": self.source.describe(), "weights_only": not resumable}
        if src_meta.get("micro_batch") is not None:  # with dp, what moves the data position to another dp on resume
            meta["micro_batch"] = src_meta["micro_batch"]
        if src_meta.get("recipe") and src_meta.get("backend") == "megatron":
            recipe = json.loads(json.dumps(src_meta["recipe"]))
            par = recipe.setdefault("parallel", {})
            par.update(tp=tp, pp=pp, vpp=vpp, world_size=layout["world_size"], dp=dp, ep=self.ep, zero_stage=0)
            if self.source.out_divisor != self.source.divisible_by:  # --make-vocab-size-divisible-by: resumed so
                par.setdefault("megatron", {})["make_vocab_size_divisible_by"] = self.source.out_divisor
            meta["recipe"] = recipe
        if resumable:
            # The data position is per data-parallel rank and dp is unchanged; RNG streams cannot map onto a new set
            # of ranks, so every rank starts from rank 0's (the families have no dropout; sampling is seeded).
            if self.rank_state is None:
                raise ToolkitError("internal: a resumable Megatron target was made without its rank-state writer")
            self.rank_state(self.source.tag_dir / "toolkit_rank00000.pt",
                            [self.tag_dir / f"toolkit_rank{rank:05d}.pt" for rank in range(layout["world_size"])])
        # the tokenizer files travel in the step folder, so that a conversion back to Hugging Face has them again
        # (generation_config.json's eos_token_id list, the chat template); the manifest lists and hashes them
        _copy_tokenizer(self.source, self.tag_dir)
        meta["files"] = manifest.complete(self.tag_dir, known)
        (self.tag_dir / META).write_text(json.dumps(meta, indent=2, default=str))
        (self.root / POINTER).write_text(self.tag_dir.name)
