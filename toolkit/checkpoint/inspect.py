"""`toolkit inspect`: what a checkpoint is (format, layout, architecture, size, step) and whether it is complete.

Reads headers and metadata only (safetensors headers, the toolkit's manifest), never the tensors themselves.
Formats: a Hugging Face model folder, the toolkit's own DeepSpeed and Megatron checkpoints (a step_* folder, or a
checkpoint directory, which is read at its latest complete step), and Megatron-LM's legacy layout.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.checkpoint import megatron_lm, output, torch_dist
from toolkit.checkpoint.deepspeed_plain import PlainDeepSpeedSource, inspect_plain, is_plain, zero_dtypes
from toolkit.checkpoint.safetensors_sources import read_json
from toolkit.checkpoint.source_base import converted
from toolkit.checkpoint.universal import inspect_universal, is_universal
from toolkit.checkpoint.sources import model_config, not_a_checkpoint, refusal
from toolkit.errors import ToolkitError
from toolkit.families import dims_from_hf, iter_entries
from toolkit.format import manifest, paths
from toolkit.format import safetensors_stream as st
from toolkit.format.names import POINTER, STARTED, TAG_GLOB
from toolkit.format.safe_load import check_file, load
from toolkit.layout import padded_vocab_size
from toolkit.metrics import count_params
from toolkit.recipe.presets import hf_rope, normal_rope
from toolkit.recipe.schema import Recipe


def inspect(path: str | Path) -> dict:
    """A report as plain data (printed by the CLI, or as JSON with --json)."""
    path = Path(path)
    paths.resolve(path)  # a link that loops: one line, not a traceback
    left = output.left_behind(path)
    if not path.exists():
        raise ToolkitError("; ".join([f"{path} does not exist", *left]))
    report = _inspect(path)
    if left:
        report["left_behind"] = left
    return report


def _inspect(path: Path) -> dict:
    if (path / "config.json").is_file() and (list(path.glob("*.safetensors"))
                                             or (path / "model.safetensors.index.json").is_file()):
        return _agree(inspect_hf(path), path)
    if is_universal(path):  # DeepSpeed's universal format (universal.py); `convert --to universal` names tags step_*
        report = inspect_universal(path)
        tag = path / report["tag"] if report.get("tag") and path.name != report["tag"] else path
        if report["complete"] and (tag / "config.json").is_file():  # --to universal of a toolkit run writes it
            report["architecture"] = _hf_architecture(read_json(paths.inside(tag, "config.json", str(tag)),
                                                                "a JSON object", dict))
        return report
    if (path / "toolkit_meta.json").is_file() or path.name.startswith("step_"):
        return _agree(inspect_toolkit(path), path)
    if (path / POINTER).is_file() or list(path.glob(TAG_GLOB)):
        return inspect_root(path)
    if (path / "latest_checkpointed_iteration.txt").is_file() or path.name.startswith("iter_"):
        report = inspect_megatron_lm(path)
        return _agree(report, path, report.pop("padded_vocab"))
    if is_plain(path):  # engine.save_checkpoint in a user's own script: DeepSpeed's records only
        return inspect_plain(path)
    raise not_a_checkpoint(path)


def _agree(report: dict, path: Path, vocab_size: int | None = None) -> dict:
    """`complete` only when `toolkit convert` also reads `path` (sources.refusal: the one check both use);
    otherwise its reason is listed with the other problems."""
    if report["complete"]:
        why = refusal(path, vocab_size)
        if why is not None:
            report["complete"] = False
            report["problems"].append(why)
    return report


def inspect_hf(folder: Path) -> dict:

    config = read_json(paths.inside(folder, "config.json", str(folder)), "a Hugging Face config.json", dict)
    params, dtypes, problems = 0, {}, []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(paths.inside(folder, index.name, str(folder)), "a safetensors index", dict).get("weight_map")
        wanted = {os.path.normpath(f) for f in weight_map.values() if isinstance(f, str)} \
            if isinstance(weight_map, dict) else set()
        problems += [f"{name} is listed in the index but missing" for name in sorted(wanted)
                     if not (folder / name).is_file()]
        names = sorted(name for name in wanted if (folder / name).is_file())  # shards in a subfolder too
    else:
        names = sorted(file.name for file in folder.glob("*.safetensors"))
    for name in names:
        try:
            reader = st.Reader(paths.inside(folder, name, str(folder)))  # checks the header against the size
        except ToolkitError as e:
            problems.append(str(e))
            continue
        with reader:
            for key in reader.keys():
                n, name = _numel(reader.shape(key)), st.dtype_name(reader.dtype(key))
                params += n
                dtypes[name] = dtypes.get(name, 0) + n
    report = {"path": str(folder), "format": "hf", "complete": not problems, "problems": problems, "step": None,
              "layout": None, "architecture": _hf_architecture(config), "parameters": params, "dtypes": dtypes,
              "bytes": paths.regular_bytes(folder)}
    if len(dtypes) > 1:  # complete, but convert writes one dtype per file (said nowhere here until 2026-12-07)
        report["note"] = "weights of more than one dtype: toolkit convert writes them in one, with --dtype"
    return report


def _hf_architecture(config: dict) -> dict:
    """The model's shape as every format's report names it: the Hugging Face config's keys, a mixture of experts'
    count as num_experts whichever key the config uses (Mixtral's num_local_experts), head_dim where it is not
    hidden_size / num_attention_heads (Qwen3)."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "rope_theta", "rope_scaling",
            "rms_norm_eps", "sliding_window")
    config = {"num_experts": config.get("num_local_experts"), **{k: v for k, v in config.items() if v is not None},
              **_rope(config)}
    if config.get("use_sliding_window") is False:  # Qwen keeps a window size that is off
        config.pop("sliding_window", None)
    if config.get("head_dim") and config.get("num_attention_heads") and (
            config["head_dim"] * config["num_attention_heads"] == config.get("hidden_size")):
        del config["head_dim"]  # the default: not worth a field
    return {k: config[k] for k in keys if config.get(k) is not None}


def _rope(config: dict) -> dict:
    """rope_theta and, unless it is plain RoPE, the scaling as the config spells it, read as recipes read them
    (presets.hf_rope). Not shown until 2026-12-07, though they decide the model's positions as much as its shape."""
    theta, scaling = hf_rope(config)
    plain = normal_rope(scaling)["rope_type"] == "default"
    return {"rope_theta": theta} if plain else {"rope_theta": theta, "rope_scaling": scaling}


def inspect_toolkit(tag_dir: Path) -> dict:
    problems = manifest.verify(tag_dir)
    if not problems:  # the pickles a resume loads, checked as it checks them: a planted one makes it incomplete
        # (it passed a manifest rewritten to match; a trial of 2026-12-07)
        problems = [why for f in sorted(tag_dir.glob("*.pt")) if (why := check_file(f))]
    try:
        meta = manifest.read_meta(tag_dir)
    except ToolkitError:
        meta = {}  # the problem is already listed
    unfinished = "toolkit" if (tag_dir / STARTED).is_file() else "unknown"
    report = {"path": str(tag_dir), "format": meta.get("backend", unfinished), "complete": not problems,
              "problems": problems, "step": meta.get("step"), "layout": meta.get("layout"), "architecture": None,
              "parameters": None, "dtypes": None, "bytes": paths.regular_bytes(tag_dir),
              "checked": manifest.describe_check(meta.get("files") or {}) if meta.get("files") else None}
    if meta.get("hf_config"):  # written by `toolkit convert`, which records the model's config itself

        dims = dims_from_hf(meta["hf_config"])
        report["architecture"] = _hf_architecture(meta["hf_config"])
        report["parameters"] = _parameters(dims)
        report["converted_from"] = meta.get("converted_from")
        report["weights_only"] = meta.get("weights_only")
    elif "recipe" in meta:
        model = Recipe.model_validate(meta["recipe"]).model
        # the config a conversion writes from the recipe, under the keys every format's report uses (it printed the
        # recipe's own keys, and a dense model's mixture-of-experts defaults, until 2026-12-07)
        report["architecture"] = _hf_architecture(model_config(meta)[0])
        report["parameters"] = count_params(model)["total"]
    if meta.get("backend") == "megatron":
        report["vocab_padding"] = _vocab_padding(meta)
    if meta.get("backend") == "megatron" and meta.get("checkpoint_format") == "torch_dist":
        report["format"] = "megatron torch_dist"  # checkpoint.format: torch_dist, read as Megatron-LM's iter_* folders
        if not problems:
            inner = _inspect_torch_dist(tag_dir, tag_dir)
            report["dtypes"], report["optimizer_state"] = inner["dtypes"], inner.get("optimizer_state")
            report["complete"], report["problems"] = inner["complete"], inner["problems"]
    elif meta.get("backend") == "deepspeed" and not problems:  # DeepSpeed's own files (none said until 2026-12-07)
        ds = PlainDeepSpeedSource(tag_dir)
        try:
            report["dtypes"] = zero_dtypes(ds.report, report["parameters"])
        finally:
            ds.close()
    elif meta.get("backend") == "megatron" and not problems:
        report["dtypes"] = _megatron_dtypes(tag_dir, report["parameters"])
        report["optimizer_state"] = (  # distopt_*: what Megatron's save_parameter_state writes (said by name before)
            "distributed optimizer: Megatron's flat buffers in distopt_* files (converted by parameter name), its "
            "param groups in optim_* files" if any(tag_dir.glob("distopt_*"))
            else "by parameter name, in optim_* files" if any(tag_dir.glob("optim_*")) else "none (weights only)")
    return report


def _megatron_dtypes(tag_dir: Path, parameters: int | None) -> dict:
    """The model's weights by dtype, as every format's report gives them: all parameters in the one dtype the
    per-rank weight files hold, else element counts over those files (TP-replicated norms once per rank)."""

    dtypes: dict[str, int] = {}
    for f in sorted(tag_dir.glob("model_*.safetensors")):
        with st.Reader(paths.inside(tag_dir, f.name, f"checkpoint {tag_dir}")) as r:
            for k in r.keys():
                name = st.dtype_name(r.dtype(k))
                dtypes[name] = dtypes.get(name, 0) + _numel(r.shape(k))
    return _all_parameters(dtypes, parameters)


def inspect_megatron_lm(path: Path) -> dict:
    """Megatron-LM's legacy layout, from its arguments (read safely, memory-mapped) and file list."""

    it_dir = megatron_lm.iteration_dir(path)
    if megatron_lm.is_torch_dist(it_dir):
        return _inspect_torch_dist(path, it_dir)
    files = sorted(it_dir.glob("mp_rank_*/model_optim_rng.pt"))
    paths.check_tree(path, files, f"Megatron-LM checkpoint {path}")
    if not files:
        raise ToolkitError(f"{it_dir} holds no mp_rank_*/model_optim_rng.pt files")
    state = load(files[0], mmap=True, deepspeed=False)
    args = state["args"]
    tp, pp, vpp = megatron_lm.layout_of_args(args)
    ep = megatron_lm.expert_parallel_size(args)
    ranks = [megatron_lm.rank_file(it_dir, t, p, pp, e, ep) for p in range(pp) for t in range(tp) for e in range(ep)]
    problems = [f"{f.relative_to(it_dir)} is missing" for f in ranks if not f.is_file()]
    problems += [why for f in files[1:] if (why := check_file(f))]  # unreadable or unsafe (pickles only, mmapped)
    config = megatron_lm.hf_config(args, args.padded_vocab_size)
    if getattr(args, "use_distributed_optimizer", False):  # distrib_optim.pt beside each rank's file
        found = sum((f.parent / "distrib_optim.pt").is_file() for f in ranks)
        optimizer = f"distributed optimizer, distrib_optim.pt on {found} of {len(ranks)} model-parallel ranks"
    else:
        optimizer = ("plain optimizer, in model_optim_rng.pt" if state.get("optimizer")
                     else "none (toolkit convert wrote it without any)" if converted(path)
                     else "none (saved with --no-save-optim?)")
    dims = dims_from_hf(config)
    dtypes = None if problems else _legacy_dtypes([state] + [load(f, mmap=True, deepspeed=False) for f in ranks[1:]],
                                                  vpp, ranks, _parameters(dims))
    return {"path": str(path), "format": "megatron-lm", "complete": not problems, "problems": problems,
            "optimizer_state": optimizer,
            "step": state.get("iteration"), "layout": {"tp": tp, "pp": pp, "vpp": vpp, **({"ep": ep} if ep > 1 else {})},
            "architecture": {**_hf_architecture(config), "vocab_size": _padded(args)},
            "parameters": _parameters(dims),
            "dtypes": dtypes, "bytes": paths.regular_bytes(it_dir), "padded_vocab": args.padded_vocab_size}


def _legacy_dtypes(states: list[dict], vpp: int, files: list[Path], parameters: int) -> dict[str, int]:
    """The model's weights by dtype in Megatron-LM's rank files (memory-mapped: no tensor is read), as every format's
    report gives them (none until 2026-12-07)."""
    dtypes: dict[str, int] = {}
    for state, file in zip(states, files):
        for chunk in megatron_lm.model_chunks(state, vpp, file):
            for t in chunk.values():
                key = st.dtype_name(t.dtype)
                dtypes[key] = dtypes.get(key, 0) + t.numel()
    return _all_parameters(dtypes, parameters)


def _inspect_torch_dist(path: Path, it_dir: Path) -> dict:
    """A torch_dist iteration, from common.pt's args and the DCP metadata. A damaged folder (a missing .distcp file,
    metadata that disagrees with the files, an unsafe pickle) is an incomplete report whose problem is the reader's
    one line: exit 1, as a legacy checkpoint's missing rank file is (it was an error, exit 2, until 2026-12-07)."""
    try:
        reader = torch_dist.Reader(it_dir)
    except ToolkitError as e:
        return {"path": str(path), "format": "megatron torch_dist", "complete": False, "problems": [str(e)],
                "step": None, "layout": None, "architecture": None, "parameters": None, "dtypes": None,
                "bytes": paths.regular_bytes(it_dir), "padded_vocab": None}
    args = reader.common.get("args")
    if args is None or not hasattr(args, "padded_vocab_size"):
        raise ToolkitError(f"{it_dir / 'common.pt'} holds no Megatron-LM args; the model's shape is unknown")
    config = megatron_lm.hf_config(args, args.padded_vocab_size)
    dtypes: dict[str, int] = {}
    for fqn in reader.names.values():
        if not fqn.startswith("optimizer."):  # the model's weights (padded vocabulary rows included), not Adam's
            key = st.dtype_name(reader.dtype(fqn))
            dtypes[key] = dtypes.get(key, 0) + _numel(reader.shape(fqn))
    parameters = _parameters(dims_from_hf(config))
    dtypes = _all_parameters(dtypes, parameters)
    optim = sorted({fqn.split(".")[2] for fqn in reader.tensor_names() if fqn.startswith("optimizer.state.")})
    return {"path": str(path), "format": "megatron torch_dist", "complete": True, "problems": [],
            "optimizer_state": f"{', '.join(optim)} per parameter" if optim else "none (weights only)",
            "step": reader.common.get("iteration"),
            "layout": {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                       "vpp": getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
                       **({"ep": megatron_lm.expert_parallel_size(args)} if megatron_lm.expert_parallel_size(args) > 1
                          else {})},
            "architecture": {**_hf_architecture(config), "vocab_size": _padded(args)},
            "parameters": parameters, "dtypes": dtypes, "bytes": paths.regular_bytes(it_dir),
            "padded_vocab": args.padded_vocab_size}


def _padded(args) -> str:
    """A Megatron-LM checkpoint's vocabulary: its padded rows, and how they were padded (its args do not hold the
    tokenizer's size)."""
    by, tp = getattr(args, "make_vocab_size_divisible_by", 128), getattr(args, "tensor_model_parallel_size", 1)
    return f"{args.padded_vocab_size} (padded, by {by} x tp={tp})"


def _vocab_padding(meta: dict) -> str | None:
    """A toolkit Megatron checkpoint's padded vocabulary rows (docs/convert.md, "Vocabulary padding")."""
    tp = (meta.get("layout") or {}).get("tp")
    if meta.get("hf_config"):
        vocab, by = meta["hf_config"].get("vocab_size"), meta.get("make_vocab_size_divisible_by", 128)
    elif meta.get("recipe"):
        recipe = Recipe.model_validate(meta["recipe"])
        vocab, by = recipe.model.vocab_size, recipe.parallel.megatron.make_vocab_size_divisible_by
    else:
        return None
    if not tp or not vocab:
        return None
    padded = padded_vocab_size(vocab, tp, by)
    return f"{padded} rows at tp={tp} (by {by}): " + (f"{padded - vocab} padding rows" if padded > vocab
                                                       else "none padded")


def _parameters(dims) -> int:
    """The model's parameter count, from its Hugging Face shapes (a tied output layer once)."""
    return sum(_numel(s) for e in iter_entries(dims, 1, 1) if e.reads_back for s in e.hf_shapes)


def _all_parameters(dtypes: dict[str, int], parameters: int | None) -> dict[str, int]:
    """Element counts by dtype over a checkpoint's stored tensors, as every format's report gives them: all of the
    model's parameters in the one dtype, where there is one (the stored counts include padded vocabulary rows and
    per-rank copies of the norms)."""
    return {name: parameters for name in dtypes} if len(dtypes) == 1 and parameters else dtypes


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def inspect_root(root: Path) -> dict:
    """The newest intact checkpoint of a directory, plus the state of every step_* folder in it; complete only when
    convert reads the directory too (it takes the step its latest_complete pointer names, never an older one)."""

    steps = {p.name: found for p in sorted(root.glob(TAG_GLOB)) if p.is_dir() and (found := _verify(p)) is not None}
    intact = [name for name, problems in steps.items() if not problems]
    if not intact:  # a report (exit 1, as for any incomplete checkpoint), not an error
        return {"path": str(root), "format": "toolkit", "complete": False,
                "problems": [f"holds no complete checkpoint ({len(steps)} step_* folders, none complete)"],
                "step": None, "layout": None, "architecture": None, "parameters": None, "dtypes": None,
                "bytes": paths.regular_bytes(root),
                "checkpoints": {name: "incomplete: " + "; ".join(p) for name, p in steps.items()}}
    report = _agree(_agree(inspect_toolkit(root / intact[-1]), root / intact[-1]), root)
    report["checkpoints"] = {name: "complete" if not p else "incomplete: " + "; ".join(p) for name, p in steps.items()}
    # the directory is the report's subject (until 2026-12-07 its headline named the step shown, with another
    # step's problem under it)
    report["path"], report["shown"] = str(root), intact[-1]
    # `bytes` stays the step's (what convert reads); the directory's own total beside it (the step's was labelled
    # as the folder's until 2026-12-07)
    report["directory_bytes"] = paths.regular_bytes(root)
    try:
        named = paths.pointer(root / POINTER) if (root / POINTER).is_file() else None
    except ToolkitError:
        named = None
    if not report["complete"] and named and named != intact[-1]:
        report["problems"].append(f"convert reads {named}, the step {POINTER} names, and never an older one; the "
                                  f"newest intact step, {intact[-1]}, is shown here: convert it by its path "
                                  f"({root / intact[-1]}); training's checkpoint.resume: auto resumes from it")
    return report


def _verify(tag_dir: Path) -> list[str] | None:
    """manifest.verify, or None for a step folder that a running save pruned while it was being read (a traceback
    in a trial of 2026-12-07: `inspect` of a training run's checkpoint directory)."""
    try:
        return manifest.verify(tag_dir)
    except FileNotFoundError:
        return None


def render(report: dict) -> str:
    """The report as the few lines a person reads."""
    lines = [f"{report['path']}: {report['format']} checkpoint, "
             + ("complete" if report["complete"] else "INCOMPLETE")]
    lines += [f"  problem: {p}" for p in report["problems"]]
    if report["step"] is not None:
        lines.append(f"  step: {report['step']}" + (f" ({report['shown']}, the newest intact step)"
                                                      if report.get("shown") else ""))
    for key in ("tag", "written_by", "optimizer_state", "vocab_padding", "note"):  # DeepSpeed, Megatron-LM, HF...
        if report.get(key):
            lines.append(f"  {key.replace('_', ' ')}: {report[key]}")
    if report["layout"]:
        lines.append("  layout: " + ", ".join(f"{k}={v}" for k, v in report["layout"].items()))
    if report["parameters"] is not None:
        lines.append(f"  parameters: {report['parameters']:,}")
    if report["dtypes"]:
        lines.append("  dtypes: " + ", ".join(f"{k} {v:,}" for k, v in report["dtypes"].items()))
    arch = {k: v for k, v in (report["architecture"] or {}).items() if v is not None}
    if arch:
        lines.append("  architecture: " + ", ".join(f"{k}={v}" for k, v in arch.items()))
    lines.append(f"  bytes on disk: {report['bytes']:,}" + (
        f" ({report['shown']}; the directory holds {report['directory_bytes']:,})" if report.get("shown") else ""))
    if report.get("checked"):
        lines.append(f"  manifest: {report['checked']}" + (" match" if report["complete"] else ""))
    for name, state in (report.get("checkpoints") or {}).items():
        lines.append(f"  {name}: {state}")
    lines += [f"  beside it: {line}" for line in report.get("left_behind", [])]
    return "\n".join(lines)
