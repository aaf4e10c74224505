"""The checkpoint sources whose files are safetensors, opened without torch: a Hugging Face folder, and the weights
(and plain optimizer state) of a toolkit Megatron checkpoint. `toolkit convert` reads them on both of its paths: the
full one (toolkit/checkpoint/sources.py, whose ToolkitMegatronSource adds the distributed optimizer and Megatron's
param groups) and the copy-only one (toolkit/checkpoint/copy_only.py), which never loads torch. Tensors are made
(and torch loaded) only when read() is called."""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.checkpoint.source_base import WEIGHT, Source, _ShardedSource
from toolkit.errors import Problem, ToolkitError, quantized
from toolkit.families.entries import holders, iter_entries, raise_problems, rank_key
from toolkit.families.mapping import Dims, check_dims
from toolkit.format import paths
from toolkit.format import safetensors_stream as st
from toolkit.format.names import META, POINTER, chunk_key, model_file, optim_file

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
"""Files carried along into a Hugging Face output (each checked to lie inside its folder, links followed); any of
them makes a folder one that holds a tokenizer."""
TOKENIZER_EXTRA = ("added_tokens.json", "chat_template.json")
CHAT_TEMPLATES = "additional_chat_templates"
"""transformers 5 saves a tokenizer's named chat templates as <CHAT_TEMPLATES>/<name>.jinja."""
MODEL_FILES = ("generation_config.json", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "NOTICE.txt",
               "USE_POLICY.md", "README.md")
"""Files of the model, not of its tokenizer: carried from SRC even when --tokenizer names another tokenizer folder.
Until 2026-12-07 the license, the model card, added_tokens.json and named chat templates were left out, and
--tokenizer replaced the source's generation_config.json."""


def carried_files(folder: Path, model: bool = True, tokenizer: bool = True) -> list[str]:
    """The names (relative to `folder`) of what a conversion carries from it into a Hugging Face output: the model's
    own files (MODEL_FILES, and its *.py code) and the tokenizer's (TOKENIZER_FILES, TOKENIZER_EXTRA, named chat
    templates)."""
    names = [*(n for n in TOKENIZER_FILES + TOKENIZER_EXTRA if tokenizer and n not in MODEL_FILES),
             *(MODEL_FILES if model else ())]
    out = [n for n in names if (folder / n).is_file() or (folder / n).is_symlink()]
    if model:  # the code config.json's auto_map names for trust_remote_code (dropped until 2026-12-07)
        out += sorted(p.name for p in folder.glob("*.py") if p.is_file() or p.is_symlink())
    templates = folder / CHAT_TEMPLATES
    if tokenizer and templates.is_dir() and not templates.is_symlink():
        out += [f"{CHAT_TEMPLATES}/{p.name}" for p in sorted(templates.glob("*.jinja"))]
    return out


def copy_carried(src: Path, dst: Path, names: list[str], what: str) -> None:
    """Copy `names` from `src` into `dst`, each checked to lie inside `src` (links followed)."""
    for name in names:
        target = dst / name
        target.parent.mkdir(exist_ok=True)
        shutil.copy2(paths.inside(src, name, f"{src} ({what})"), target)


def meta_shards(dims: Dims, tp: int, pp: int, vpp: int, ep: int = 1) -> dict[tuple[int, ...], dict[str, tuple]]:
    """{(pp_rank, tp_rank[, ep_rank when ep > 1]): {"chunk{c}.{name}": shard shape}} of a Megatron layout, from the
    rules' shard_shape (tests pin it to what split really gives): the one place shapes come from, for checking
    sources and laying out files."""

    raise_problems(f"the model cannot be laid out at tp={tp} pp={pp} vpp={vpp}" + (f" ep={ep}" if ep > 1 else ""),
                   check_dims(dims, tp, pp, vpp, ep))
    out: dict[tuple[int, ...], dict[str, tuple]] = {rank_key(p, t, e, ep): {} for p in range(pp) for t in range(tp)
                                                    for e in range(ep)}
    for e in iter_entries(dims, pp, vpp, ep):
        shape = e.rule.shard_shape(e.hf_shapes, tp)
        for t in range(tp):
            for r in holders(e, ep):
                out[rank_key(e.pp_rank, t, r, ep)][chunk_key(e.chunk, e.megatron_name)] = shape
    return out


FLOATS = ("F64", "F32", "F16", "BF16")


class HFSource(Source):
    """A Hugging Face folder: config.json and *.safetensors (sharded with model.safetensors.index.json, or one)."""

    kind = "Hugging Face"

    def __init__(self, folder: Path):
        self.folder = folder
        config = paths.inside(folder, "config.json", str(folder))
        if not config.is_file():
            raise ToolkitError(f"{folder} has no config.json; a Hugging Face model folder needs one")
        self.config = read_json(config, "a Hugging Face config.json", dict)
        if (q := quantized(self.config, str(config), "config.json")) is not None:
            raise ToolkitError(f"{q.message}; fix: {q.fix}")
        for name in carried_files(folder):  # copied into the output: never one from outside the folder
            paths.inside(folder, name, f"{folder} (its tokenizer file)")
        index = paths.inside(folder, "model.safetensors.index.json", str(folder))
        if index.is_file():
            weight_map = read_json(index, "a safetensors index", dict).get("weight_map") or {}
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ToolkitError(f"{index} has a weight_map that is not {{tensor name: file name}}; re-save the "
                                   "model with save_pretrained")
            for f in weight_map.values():
                paths.inside(folder, f, f"{index}")  # before normpath: `a/../../x` leaves the folder
            # `./model-00001.safetensors` and `weights/model-00001.safetensors`, which from_pretrained loads too,
            # name the same files as their normal form (they were refused as "not where it says" until 2026-12-07)
            weight_map = {k: os.path.normpath(f) for k, f in weight_map.items()}
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise ToolkitError(f"{folder} is incomplete: {', '.join(missing[:4])} listed in {index.name} "
                                   f"{'is' if len(missing) == 1 else 'are'} missing")
            single = folder / "model.safetensors"
            if (single.exists() or single.is_symlink()) and single.name not in files:
                raise ToolkitError(f"{folder} holds both model.safetensors and {index.name}, which names other files: "
                                   "the weights of two saves (transformers would load model.safetensors, this "
                                   "converter the index's); move the one that is not this model out of the folder")
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise ToolkitError(f"{folder} holds no *.safetensors files (.bin pickles are not read: re-save the "
                                   "model with save_pretrained(safe_serialization=True))")
        self._readers = [st.Reader(paths.inside(folder, f, str(folder))) for f in files]
        self._where = {k: r for r in self._readers for k in r.keys()}
        if index.is_file():
            by_file = dict(zip(files, self._readers))
            wrong = [k for k, f in weight_map.items() if k not in self._where or self._where[k] is not by_file[f]]
            if wrong:
                verb = "is" if len(wrong) == 1 else "are"
                raise ToolkitError(f"{index} does not match the files: {', '.join(wrong[:4])} {verb} not where it "
                                   "says (it names each shard by its file name in this folder)")
        dims = self.dims()
        self.unprefixed = self._read_with_prefix(dims)
        problems = []
        for e in iter_entries(dims, 1, 1):
            for name, shape in zip(e.hf_names, e.hf_shapes):
                if name not in self._where:
                    problems.append(Problem(name, "is missing", f"check the folder is a complete {dims.family} model"))
                elif self._where[name].shape(name) != shape:
                    problems.append(Problem(name, f"has shape {self._where[name].shape(name)}, config.json gives "
                                            f"{shape}", "the weights and config.json are of different models"))
        known = {n for e in iter_entries(dims, 1, 1) for n in e.hf_names} | {"lm_head.weight"}
        extra = sorted(k for k in self._where if k not in known and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            problems.append(Problem("weights", f"{len(extra)} tensors the {dims.family} map does not know: "
                                    f"{', '.join(extra[:6])}", f"convert a {dims.family} model, or add the tensors to toolkit/families/{dims.family}.py"))
        if dims.tied and "lm_head.weight" in self._where and not self._same_bytes("lm_head.weight",
                                                                                 "model.embed_tokens.weight"):
            problems.append(Problem("lm_head.weight", "differs from model.embed_tokens.weight, yet config.json ties "
                                    "them (tie_word_embeddings): transformers loads such a folder untied",
                                    "set tie_word_embeddings to false in config.json, or remove lm_head.weight if "
                                    "the model is tied"))
        raise_problems(f"{folder} does not match its config.json", problems)
        # weight dtype (its safetensors name) -> how many of the tensors converted have it
        self.dtypes = Counter(self._where[name].dtype_name(name) for name in known & set(self._where))
        whole = sorted(n for n in known & set(self._where) if self._where[n].dtype_name(n) not in FLOATS)
        if whole:  # --dtype cast them to floats without a word until 2026-12-07
            name = whole[0]
            raise ToolkitError(f"{folder} stores {name}{f' and {len(whole) - 1} more' if len(whole) > 1 else ''} as "
                               f"{self._where[name].dtype_name(name)}, not a floating-point dtype: model weights are "
                               "floats (integer weights are a quantized model's, with their scales elsewhere); use "
                               "the model's unquantized release")

    def _read_with_prefix(self, dims: Dims) -> bool:
        """transformers loads a folder whose tensors are stored without the `model.` prefix (a base model saved by
        LlamaModel.save_pretrained, some exporters' output): its tensors are read under the map's names then (such
        a folder was refused as missing every tensor until 2026-12-07). Whether it is one."""
        wanted = {n for e in iter_entries(dims, 1, 1) for n in e.hf_names if n.startswith("model.")}
        if not wanted or wanted & self._where.keys() or not all(n[len("model."):] in self._where for n in wanted):
            return False
        for reader in self._readers:
            reader.rename({k: f"model.{k}" for k in reader.keys() if f"model.{k}" in wanted})
        self._where = {k: r for r in self._readers for k in r.keys()}
        return True

    def describe(self) -> str:
        return self.kind + (" (tensors stored without the model. prefix)" if self.unprefixed else "")

    def _same_bytes(self, a: str, b: str) -> bool:
        """Whether two tensors hold the same shape, dtype and bytes (read a bounded piece at a time)."""
        ra, rb = self._where[a], self._where[b]
        if ra.shape(a) != rb.shape(b) or ra.dtype_name(a) != rb.dtype_name(b):
            return False
        (fa, at_a, n), (fb, at_b, _) = ra.span(a), rb.span(b)
        for done in range(0, n, 2**24):
            size = min(2**24, n - done)
            if os.pread(fa, size, at_a + done) != os.pread(fb, size, at_b + done):
                return False
        return True

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        return [self._where[n].get(n) for n in hf_names]  # torch loads here, on the first tensor

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        return [(self._where[n], n) for n in hf_names], list

    def dtype(self) -> torch.dtype:
        return self._where["model.embed_tokens.weight"].dtype("model.embed_tokens.weight")

    def dtype_name(self) -> str:
        return self._where["model.embed_tokens.weight"].dtype_name("model.embed_tokens.weight")

    def close(self) -> None:
        for r in self._readers:
            r.close()


class ToolkitWeights(_ShardedSource):
    """A toolkit Megatron step folder's model files, and its plain optimizer's files (optim_*.safetensors) unless
    weights_only. `config`: its Hugging Face config (stored_config, or made from its recipe)."""

    kind = "toolkit Megatron"

    def __init__(self, tag_dir: Path, meta: dict, config: dict, divisible_by: int, weights_only: bool = False,
                 rows: int | None = None):
        self.tag_dir, self.meta, self.step, self.rows = tag_dir, meta, meta.get("step"), rows
        lay = meta["layout"]
        self.layout, self.ep = (lay["tp"], lay["pp"], lay["vpp"]), lay.get("ep", 1)
        self.config, self.divisible_by = config, divisible_by
        self._index()
        tp, pp, _ = self.layout
        where, ep = f"checkpoint {tag_dir}", self.ep
        self.ranks = [(p, t, e) for p in range(pp) for t in range(tp) for e in range(ep)]
        self._models = {rank_key(p, t, e, ep): st.Reader(paths.inside(
            tag_dir, model_file(tag_dir, t, p, e if ep > 1 else None).name, where)) for p, t, e in self.ranks}
        optims = {rank_key(p, t, e, ep): paths.inside(tag_dir, optim_file(tag_dir, t, p, e if ep > 1 else None).name,
                                                      where) for p, t, e in self.ranks}
        self._optims = {}
        if not weights_only and all(f.is_file() for f in optims.values()):
            self._optims = {k: st.Reader(f) for k, f in optims.items()}
            fields = {split_field(k) for r in self._optims.values() for k in r.keys()}
            self.fields = (WEIGHT, *sorted(f for f in fields if f))
            steps = {r.metadata.get("step") for r in self._optims.values()}
            if len(steps) != 1:
                raise ToolkitError(f"{tag_dir}: the ranks' optimizer files are at different steps {sorted(steps)}")
            self.optimizer_meta = dict(next(iter(self._optims.values())).metadata)
        self._check()

    def _check(self) -> None:
        tp, pp, vpp = self.layout
        problems = []
        for k, shapes in meta_shards(self._dims, tp, pp, vpp, self.ep).items():
            reader = self._models[k]
            got = {k: reader.shape(k) for k in reader.keys()}
            missing, unexpected = sorted(set(shapes) - set(got)), sorted(set(got) - set(shapes))
            bad = [f"{k} {got[k]} (expected {shapes[k]})" for k in shapes if k in got and got[k] != shapes[k]]
            for what, items in (("is missing", missing), ("has unexpected", unexpected), ("has misshapen", bad)):
                if items:
                    problems.append(Problem(reader.path.name, f"{what} {', '.join(items[:4])}",
                                            "the file does not belong to the model and layout in toolkit_meta.json"))
            if self._optims:
                want = {f"{k}:{f}" for k in shapes for f in self.fields if f != WEIGHT}
                have = set(self._optims[k].keys())
                if want != have:
                    problems.append(Problem(self._optims[k].path.name, f"does not hold exactly the optimizer "
                                            f"state of its model file (missing {sorted(want - have)[:2]}, unexpected "
                                            f"{sorted(have - want)[:2]})", "re-save the checkpoint"))
        raise_problems(f"{self.tag_dir} does not match its toolkit_meta.json", problems)

    def _get(self, p: int, t: int, key: str, e: int = 0) -> torch.Tensor:
        return (self._optims if ":" in key else self._models)[rank_key(p, t, e, self.ep)].get(key)

    def shard_input(self, p: int, t: int, key: str, e: int = 0):
        return (self._optims if ":" in key else self._models)[rank_key(p, t, e, self.ep)], key

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        entry = self._entries[tuple(hf_names)]
        key = chunk_key(entry.chunk, entry.megatron_name, None if field == WEIGHT else field)
        readers = self._optims if ":" in key else self._models
        ranks = [rank_key(entry.pp_rank, t, entry.ep_rank or 0, self.ep) for t in range(self.layout[0])]
        return ([(readers[r], key) for r in ranks],
                lambda shards: list(entry.to_hf(shards).values()))

    def dtype(self) -> torch.dtype:
        r = next(iter(self._models.values()))
        return r.dtype(r.keys()[0])

    def dtype_name(self) -> str:
        r = next(iter(self._models.values()))
        return r.dtype_name(r.keys()[0])

    def close(self) -> None:
        for r in [*self._models.values(), *self._optims.values()]:
            r.close()


def stored_config(meta: dict) -> tuple[dict, int] | None:
    """(HF config dict, vocab divisor) that a toolkit checkpoint's meta stores (conversions write them); None when
    it has only its recipe to make them from (sources.model_config)."""
    if meta.get("hf_config"):
        return meta["hf_config"], int(meta.get("make_vocab_size_divisible_by", 128))
    return None


def split_field(key: str) -> str | None:
    return key.partition(":")[2] or None


def require_one_dtype(source: Source) -> None:
    """A Hugging Face folder whose weights are not all of one dtype is written in one only with --dtype (each output
    file declares one); without it, one line saying so."""
    counts = getattr(source, "dtypes", None) or {}
    if len(counts) > 1:
        common = max(counts, key=counts.get)
        odd = ", ".join(f"{n} {d}" for d, n in sorted(counts.items()) if d != common)
        raise ToolkitError(f"{source.folder} holds weights of more than one dtype ({counts[common]} {common}, {odd}); "
                           "pass --dtype bf16, fp16 or fp32 to write them all in one. Nothing was written")


JSON_BYTES = 32 * 2**20


def read_json(path: Path, what: str, kind: type):
    """A JSON file of the source, or one line saying it is not `what`. At most JSON_BYTES: parsed, a JSON file takes
    ten to twenty times its size in memory."""
    try:
        with open(path, "rb") as f:
            raw = f.read(JSON_BYTES + 1)
        if len(raw) > JSON_BYTES:
            raise ToolkitError(f"{path} is over {JSON_BYTES >> 20} MiB, larger than any {what} a library writes (an "
                               "index takes about 100 bytes a tensor); re-copy or re-save it")
        value = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ToolkitError(f"{path} is not {what} ({e}); re-copy or re-save it") from None
    if not isinstance(value, kind):
        raise ToolkitError(f"{path} holds a JSON {type(value).__name__}, not {what}; re-copy or re-save it")
    return value


def follow_pointer(src: Path) -> Path:
    """A checkpoint directory's newest complete checkpoint (its latest_complete pointer), else `src` itself. No
    silent fallback to an older one: a damaged checkpoint is reported, not skipped."""

    if (src / META).is_file() or not (src / POINTER).is_file():
        return src
    pointed = paths.inside(src, paths.pointer(src / POINTER), str(src / POINTER))
    if not pointed.is_dir():
        raise ToolkitError(f"{src / POINTER} points at {pointed.name}, which does not exist; pass the step_* folder "
                           "to convert")
    return pointed
