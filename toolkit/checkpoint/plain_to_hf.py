"""`toolkit convert SRC DST --to hf` for a plain DeepSpeed checkpoint (deepspeed_plain.py): a Hugging Face folder
with the model's own tensor names, so any architecture converts, not only the families toolkit/families maps.

The config comes from `--config` (a Hugging Face folder or its config.json), else from a config.json in the
checkpoint folder or its tag folder. Before anything is written, the checkpoint's names and shapes are checked
against the model that config builds (on the meta device: no memory). Then one tensor at a time is read (memory-
mapped rank files, only its slices), written at its offset into sharded safetensors (5 GiB, index), read back and
compared bit for bit (ZeRO-3 fp32 masters, which need no cast, are copied file to file: pt_ranges.py), and the folder is loaded with `from_pretrained` and every tensor compared again. The output
is built in a hidden folder beside DST and moved into place only when all of that passed (output.py).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from toolkit.checkpoint import output
from toolkit.checkpoint.deepspeed_plain import PlainDeepSpeedSource, resolve_tag
from toolkit.checkpoint.hf_io import shard_layout, write_index
from toolkit.checkpoint.safetensors_sources import carried_files, copy_carried
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries
from toolkit.families.registry import FAMILIES, dims_from_hf
from toolkit.format import manifest, paths
from toolkit.format import safetensors_stream as st

LOAD_CHECK_MAX_BYTES = 8 * 2**30  # from_pretrained re-loads outputs this small to check them


def find_config(src: Path, tag: Path, config: str | Path | None) -> Path:
    """The config.json to use: --config (a folder holding one, or the file), else one beside the checkpoint."""
    if config is not None:
        config = Path(config)
        file = config / "config.json" if config.is_dir() else config
        if not file.is_file():
            raise ToolkitError(f"--config {config}: no config.json there; pass a Hugging Face model folder or its "
                               "config.json")
        return file
    for folder in (tag, Path(src)):
        if (folder / "config.json").is_file():
            return paths.inside(folder, "config.json", str(folder))
    raise ToolkitError(f"{src} is a DeepSpeed checkpoint without a config.json: pass the model's config with "
                       "--config HF_FOLDER_OR_config.json (the folder the training script loaded the model from)")


def _model_on_meta(config_file: Path):
    """(model class, config, {name: (shape, tied-to or None)}) of the model the config describes."""
    import transformers  # lazy: heavy; model paths only

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(config_file))
    except (ValueError, OSError, KeyError) as e:
        raise ToolkitError(f"{config_file} is not a Hugging Face config transformers reads ({str(e).splitlines()[0]})"
                           "; pass the model's own config.json with --config") from None
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls or transformers.AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    if cls is None:
        raise ToolkitError(f"{config_file} names no model class transformers knows (architectures: {arch!r}); add "
                           "\"architectures\" to it")
    with torch.device("meta"):
        model = cls(cfg)
    first: dict[int, str] = {}
    tensors = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)  # a tied weight: every later name points at the first
        tensors[name] = (tuple(p.shape), owner if owner != name else None)
    for name, b in model.named_buffers():
        if name in model.state_dict():
            tensors[name] = (tuple(b.shape), None)
    return cls, cfg, tensors


def _family_tensors(config_file: Path) -> dict | None:
    """{name: (shape, tied-to or None)} of the model, from the toolkit's own map of its family (toolkit/families)
    when the config's model_type is one it knows, so transformers need not be imported; None otherwise."""
    try:
        config = json.loads(config_file.read_text())
        if not isinstance(config, dict) or config.get("model_type") not in FAMILIES:
            return None
        dims = dims_from_hf(config)
    except (ValueError, OSError, KeyError, TypeError, ToolkitError):
        return None  # transformers' reading of it decides (and names the problem)
    tensors = {n: (tuple(s), None) for e in iter_entries(dims, 1, 1) if e.reads_back
               for n, s in zip(e.hf_names, e.hf_shapes)}
    if dims.tied:  # as transformers' model lists it: the output layer, tied to the embeddings
        tensors["lm_head.weight"] = (tensors["model.embed_tokens.weight"][0], "model.embed_tokens.weight")
    return tensors


def check_against_config(source: PlainDeepSpeedSource, config_file: Path, need_class: bool = True):
    """Refuse (one line) a config whose model does not hold exactly the checkpoint's tensors. Returns the model
    class (for the from_pretrained check); without need_class a model of a toolkit family is checked against the
    family's map instead (no transformers import, which costs more than converting a small model) and None is
    returned."""
    want = None if need_class else _family_tensors(config_file)
    cls = None
    if want is None:
        cls, cfg, want = _model_on_meta(config_file)
    have = {n: source.shape(n) for n in source.names()}
    shared = source.shared()
    tied = set(shared) | {n for n, (_, to) in want.items() if to is not None}
    missing = [n for n in want if n not in have and n not in tied]
    extra = [n for n in have if n not in want]
    bad = [f"{n} {have[n]} vs {want[n][0]}" for n in have if n in want and tuple(have[n]) != want[n][0]]
    if missing or extra or bad:
        raise ToolkitError(f"{config_file} does not describe the model in {source.tag_dir}: "
                           + "; ".join(x for x in (missing and f"missing {missing[:3]}", extra and f"unexpected "
                                                   f"{extra[:3]}", bad and f"shapes {bad[:3]}") if x)
                           + ": pass the config the model was trained with (--config)"
                           + ("; a checkpoint saved with exclude_frozen_parameters=True leaves its frozen weights out, "
                              "and cannot give a whole model" if missing and not extra and not bad else ""))
    for n, (_, to) in want.items():  # the config and the checkpoint must tie the same weights (a trial of 2026-12-07:
        # a tied config over an untied checkpoint was written, "verified", and then refused by the toolkit itself)
        if to is not None and n in have and n not in shared:
            raise ToolkitError(f"{config_file} ties {n} to {to} (tie_word_embeddings: true), but {source.tag_dir} "
                               f"holds its own {n}: pass the config the model was trained with (--config), whose "
                               "tie_word_embeddings is false")
        if to is None and n in shared:
            raise ToolkitError(f"{source.tag_dir} ties {n} to {shared[n]}, but {config_file} gives {n} its own "
                               "weights (tie_word_embeddings: false): pass the config the model was trained with "
                               "(--config), whose tie_word_embeddings is true")
    return cls


def convert_plain_to_hf(src: str | Path, dst: str | Path, config: str | Path | None = None, fp32: bool = False,
                        dtype: torch.dtype | None = None, overwrite: bool = False, verify: bool = True,
                        log=print, reader=PlainDeepSpeedSource, resolve=resolve_tag, kind: str = "plain",
                        tokenizer: Path | None = None) -> Path:
    """Convert a plain DeepSpeed checkpoint (folder with `latest`, or a global_stepN folder) to a Hugging Face
    folder; see the module docstring. `reader`/`resolve`: another source of the same interface (universal.py)."""
    src, dst = Path(src), Path(dst)
    output.check_destination(src, dst, overwrite)
    tag = resolve(src)
    config_file = find_config(src, tag, config)
    source = reader(tag, fp32=fp32)
    try:
        cls = check_against_config(source, config_file, need_class=verify)
        names = source.names()
        # --fp32 takes the masters; a frozen parameter has none and stays in the training dtype in DeepSpeed's
        # zero_to_fp32, but is cast here (exactly): one dtype in the folder and in config.json, which the toolkit
        # reads back (a mixed folder labelled float32 was written until 2026-12-07)
        want = dtype if dtype is not None else torch.float32 if fp32 else None
        cast = {n: want if want is not None and source.out_dtype(n).is_floating_point else source.out_dtype(n)
                for n in names}
        files, shards, total = shard_layout([(n, source.shape(n), cast[n]) for n in names])
        with output.scratch_folder(dst, "partial") as tmp:
            manifest.require_space(dst.parent, total, manifest.free_bytes(tmp), str(dst), "the tensors to write")
            # a universal checkpoint holds only fp32 masters (it said "model states" until 2026-12-07)
            what = ("fp32 master" if fp32 else "fp32 masters cast to the training dtype" if kind == "universal"
                    else "model states")
            what_src = f"DeepSpeed ZeRO-{source.stage} dp={source.dp} step {source.step} ({what})"
            log(f"converting {kind} {what_src} at {tag} -> hf ({len(names)} tensors; {output.size_text(total)} to write)")
            t0 = time.monotonic()
            for file, spec in zip(files, shards):
                writer = st.Writer(tmp / file, spec, {"format": "pt"})
                for name in spec:  # the file slices themselves when they need no cast (ZeRO-3 fp32 masters)
                    pieces = source.pieces(name) if hasattr(source, "pieces") else None
                    if pieces is not None and all(p.dtype == cast[name] for p in pieces):
                        ranges = source.file_ranges(pieces)  # file to file, in the kernel, when found
                        if ranges:
                            writer.write_ranges(name, ranges)
                        else:
                            writer.write_pieces(name, pieces)
                    else:
                        writer.write(name, source.get(name).to(cast[name]))
                writer.close()
            write_index(tmp, files, shards, total)
            _write_config(config_file, tmp, cast, tokenizer)
            log(f"wrote {output.size_text(total)} in {time.monotonic() - t0:.1f} s")
            if verify:
                _verify(source, tmp, files, shards, cast, cls, total, log)
            output.replace(tmp, dst, overwrite)
    finally:
        source.close()
    return dst


def _write_config(config_file: Path, folder: Path, cast: dict, tokenizer: Path | None = None) -> None:
    config = json.loads(config_file.read_text())
    dtypes = {d for d in cast.values() if d.is_floating_point}
    main = max(dtypes, key=lambda d: sum(1 for v in cast.values() if v == d)) if dtypes else torch.float32
    config["dtype" if "dtype" in config else "torch_dtype"] = str(main).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    own = config_file.parent  # --tokenizer's tokenizer, else the one beside the config; the model's files from there
    if tokenizer is not None:
        copy_carried(tokenizer, folder, carried_files(tokenizer, model=False), "its tokenizer file")
    copy_carried(own, folder, carried_files(own, tokenizer=tokenizer is None), "its file")


def _verify(source, folder: Path, files: list[str], shards: list[dict], cast: dict, cls, total: int, log) -> None:
    """Every tensor read back equals the source's bit for bit; then from_pretrained loads the folder and holds the
    same tensors (models up to LOAD_CHECK_MAX_BYTES)."""
    t0 = time.monotonic()
    for file, spec in zip(files, shards):
        with st.Reader(folder / file) as r:
            for name in spec:
                if not torch.equal(r.get(name), source.get(name).to(cast[name])):
                    raise ToolkitError(f"verification failed: {name} reads back different from the source; nothing "
                                       "was written")
    log(f"verified: {len(cast)} tensors read back bit-exactly ({time.monotonic() - t0:.1f} s)")
    if total > LOAD_CHECK_MAX_BYTES:
        log(f"from_pretrained check skipped: {total / 2**30:.1f} GiB is more than it loads here")
        return
    main = json.loads((folder / "config.json").read_text())
    main = getattr(torch, main.get("dtype") or main.get("torch_dtype") or "float32")
    from transformers.utils import logging as hf_logging  # lazy: with the model class (need_class)

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar reached stderr even with --quiet
    try:
        model, info = cls.from_pretrained(folder, dtype=main, output_loading_info=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    if info.get("missing_keys") or info.get("unexpected_keys") or info.get("mismatched_keys"):
        raise ToolkitError(f"verification failed: from_pretrained reports {info}; nothing was written")
    state = model.state_dict()
    for file, spec in zip(files, shards):
        with st.Reader(folder / file) as r:
            for name in spec:
                t = r.get(name)
                if name not in state or not torch.equal(state[name], t.to(state[name].dtype)):
                    raise ToolkitError(f"verification failed: from_pretrained gives a different {name}; nothing "
                                       "was written")
    log(f"verified: {cls.__name__}.from_pretrained loads the folder with the same tensors")
