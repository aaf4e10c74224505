"""`toolkit convert SRC DST --to hf`: Megatron checkpoints of any TP x PP x VPP layout to a Hugging Face folder.

Sources: the toolkit's Megatron checkpoints (a step_* folder or a checkpoint directory) and Megatron-LM's legacy
layout (iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt). The layout is read from the source's own files.
The output appears whole or not at all (written beside DST, verified, then renamed into place); an existing DST
is replaced only with overwrite=True. Not streaming yet: the model is held in memory once.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from toolkit.checkpoint import LlamaDims, hf_to_megatron, megatron_to_hf
from toolkit.errors import ToolkitError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def read_toolkit_megatron(tag_dir: Path) -> tuple[dict, dict, LlamaDims, tuple[int, int, int]]:
    """(HF config dict, shards, dims, (tp, pp, vpp)) of a toolkit Megatron checkpoint."""
    from toolkit.megatron.checkpoint import rank_tag
    from toolkit.model import to_hf_config
    from toolkit.recipe.schema import Recipe
    from toolkit.train.checkpoint import META, verify_manifest

    problems = verify_manifest(tag_dir)
    if problems:
        raise ToolkitError(f"{tag_dir} is not a complete checkpoint: {'; '.join(problems)}")
    meta = json.loads((tag_dir / META).read_text())
    if meta.get("backend") != "megatron":
        raise ToolkitError(f"{tag_dir} was written by the {meta.get('backend')} backend; only Megatron checkpoints "
                           "convert to Hugging Face so far")
    recipe, lay = Recipe.model_validate(meta["recipe"]), meta["layout"]
    config = to_hf_config(recipe.model)
    dims = LlamaDims.from_hf(config, lay["tp"], recipe.parallel.megatron.make_vocab_size_divisible_by)
    shards = {(p, t): torch.load(tag_dir / f"model_{rank_tag(t, p)}.pt", weights_only=True,
                                 map_location="cpu")["chunks"] for p in range(lay["pp"]) for t in range(lay["tp"])}
    return config.to_dict(), shards, dims, (lay["tp"], lay["pp"], lay["vpp"])


def read_megatron_lm(path: Path, vocab_size: int | None):
    from toolkit.checkpoint import megatron_lm

    args, shards, _ = megatron_lm.read(path)
    if vocab_size is None:
        raise ToolkitError(f"{path} stores the vocabulary padded to {args.padded_vocab_size} rows; pass the true "
                           "vocabulary size with --vocab-size (the tokenizer's, e.g. 32000 for Llama 2) so the "
                           "padding rows are dropped")
    config = megatron_lm.hf_config(args, vocab_size)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    dims = LlamaDims.from_hf(config, tp, getattr(args, "make_vocab_size_divisible_by", 128))
    if dims.padded_vocab != args.padded_vocab_size:
        raise ToolkitError(f"--vocab-size {vocab_size} pads to {dims.padded_vocab} rows at tp={tp}, but the "
                           f"checkpoint has {args.padded_vocab_size}; check the vocabulary size")
    return config, shards, dims, (tp, pp, vpp)


def read_source(src: Path, vocab_size: int | None):
    from toolkit.train.checkpoint import META, find_resume

    if (src / META).is_file():
        return read_toolkit_megatron(src)
    if (src / "latest_complete").is_file():
        return read_toolkit_megatron(find_resume(src, "auto") or src)
    if (src / "latest_checkpointed_iteration.txt").is_file() or src.name.startswith("iter_"):
        return read_megatron_lm(src, vocab_size)
    raise ToolkitError(f"{src} is neither a toolkit Megatron checkpoint nor a Megatron-LM checkpoint "
                       "(iter_*/mp_rank_*/model_optim_rng.pt with latest_checkpointed_iteration.txt)")


def _verify(hf_state: dict, shards: dict, dims: LlamaDims, layout: tuple[int, int, int]) -> None:
    """Split the result back into the source layout: every tensor must equal the source bit for bit, except the
    vocabulary padding rows, which the Hugging Face model does not have."""
    again = hf_to_megatron(hf_state, dims, *layout)
    for key, chunks in shards.items():
        for c, state in enumerate(chunks):
            for name, source in state.items():
                got = again[key][c][name]
                if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                    rows = max(0, min(got.shape[0], dims.vocab - key[1] * got.shape[0]))
                    got, source = got[:rows], source[:rows]
                if not torch.equal(got, source):
                    raise ToolkitError(f"verification failed: {name} of (pp, tp) = {key}, chunk {c} does not "
                                       "round-trip; nothing was written")


def convert_to_hf(src: str | Path, dst: str | Path, vocab_size: int | None = None, dtype: str | None = None,
                  overwrite: bool = False, verify: bool = True) -> Path:
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise ToolkitError(f"{dst} already exists; pass --overwrite to replace it (it is replaced only after the "
                           "new model is complete)")
    config, shards, dims, layout = read_source(src, vocab_size)
    hf_state = megatron_to_hf(shards, dims, *layout)
    if verify:
        _verify(hf_state, shards, dims, layout)
    if dtype:
        hf_state = {k: v.to(DTYPES[dtype]) for k, v in hf_state.items()}
        config["torch_dtype"] = str(DTYPES[dtype]).replace("torch.", "")
    tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
    _replace(tmp, dst)
    return dst


def _replace(tmp: Path, dst: Path) -> None:
    """Move the finished folder into place; an old DST is kept until the new one is there."""
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
