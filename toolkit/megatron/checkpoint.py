"""Per-rank checkpoint files of the Megatron backend, inside the toolkit's step_* folders.

  model_tpTT_ppPPP.safetensors   the (tp, pp) rank's weights, keys "chunk{c}.{local-spec name}"
  optim_tpTT_ppPPP.safetensors   its optimizer state by parameter name: "chunk{c}.{name}:exp_avg", ":exp_avg_sq"
                                 and, when the model trains in 16-bit, ":master" (the fp32 main weights); the step
                                 and grad-scaler state in the header's metadata
  optim_tpTT_ppPPP.pt            instead, with the distributed optimizer: Megatron's own optimizer state_dict, and
  distopt_tpTT_ppPPP.pt          its fp32 main weights and Adam moments, gathered from the data-parallel ranks by
                                 Megatron's save_parameter_state

Keying the optimizer state by parameter name (not by Megatron's position in its param groups) is what lets
`toolkit convert` move it to another TP x PP layout with the same split/merge rules as the weights. Every file
written by data-parallel rank 0 is safetensors or read as weights only (toolkit/format/safe_load.py). The
layout (tp, pp, vpp, dp, ...) is recorded in the step folder's toolkit_meta.json by toolkit/train/checkpoint.py,
which also decides when a checkpoint is complete, and which hashes the files this rank wrote (written_files).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.errors import ToolkitError
from toolkit.families.mapping import local_spec_name
from toolkit.format import safe_load
from toolkit.format import safetensors_stream as st
from toolkit.format.names import (MASTER, OPTIM_FIELDS, OPTIM_GROUPS, chunk_key, model_file, optim_file, plain_group,
                                  split_key)
from toolkit.megatron.runtime import chunk_state, load_chunk_state


def _distributed(backend) -> bool:
    return backend.layout_meta["zero_stage"] == 1


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def named_optimizer_params(backend) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter, object]]:
    """(key, model parameter, parameter the optimizer updates, inner torch optimizer) for every trained parameter.
    The two parameters differ when the model is 16-bit: the optimizer then steps an fp32 main copy."""
    names = {}
    for c, w in enumerate(backend.chunks):
        for n, p in w.module.named_parameters():
            names[p] = chunk_key(c, local_spec_name(n))
    out = []
    for o in _inner_optimizers(backend.optimizer):
        if hasattr(o, "float16_groups"):
            for model_group, main_group in zip(o.float16_groups, o.fp32_from_float16_groups):
                out += [(names[p], p, m, o.optimizer) for p, m in zip(model_group, main_group)]
            for group in o.fp32_from_fp32_groups:
                out += [(names[p], p, p, o.optimizer) for p in group]
        else:
            out += [(names[p], p, p, o.optimizer) for g in o.optimizer.param_groups for p in g["params"]]
    return out


def _step_of(opt, main) -> int:
    state = opt.state.get(main, {})
    if "step" in state:
        return int(state["step"])
    group = next(g for g in opt.param_groups if any(p is main for p in g["params"]))
    return int(group.get("step", 0))


def _scaler_states(optimizer) -> list[dict]:
    out = []
    for o in _inner_optimizers(optimizer):
        scaler = getattr(o, "grad_scaler", None)
        sd = scaler.state_dict() if scaler is not None else {}
        out.append({k: (v.item() if torch.is_tensor(v) else v) for k, v in sd.items()})
    return out


def optimizer_tensors(backend) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The non-distributed optimizer's state by name, and metadata (step, grad scalers, param groups)."""
    tensors, steps = {}, set()
    for key, model_p, main, opt in named_optimizer_params(backend):
        state = opt.state.get(main, {})
        if not state:  # no step taken yet
            continue
        for field in OPTIM_FIELDS:
            tensors[f"{key}:{field}"] = state[field]
        if main is not model_p:
            tensors[f"{key}:{MASTER}"] = main.detach()
        steps.add(_step_of(opt, main))
    if len(steps) > 1:
        raise ToolkitError(f"optimizer parameters are at different steps {sorted(steps)}; cannot save one step")
    meta = {"step": str(steps.pop() if steps else 0), "grad_scalers": json.dumps(_scaler_states(backend.optimizer)),
            OPTIM_GROUPS: json.dumps([[plain_group(g) for g in o.optimizer.param_groups]
                                      for o in _inner_optimizers(backend.optimizer)])}
    return tensors, meta


def load_optimizer_tensors(backend, tensors: dict[str, torch.Tensor], meta: dict[str, str], where: Path) -> None:
    """Put name-keyed optimizer state (from optimizer_tensors, or a conversion) into the live optimizer."""
    params = named_optimizer_params(backend)
    want = {f"{key}:{f}" for key, model_p, main, _ in params
            for f in OPTIM_FIELDS + ((MASTER,) if main is not model_p else ())}
    step = int(meta.get("step", "0"))
    if step == 0 and not tensors:
        return
    missing, unexpected = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing or unexpected:
        raise ToolkitError(f"{where}: optimizer state does not fit this model (missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}); it was written for another model or precision")
    with torch.no_grad():
        for key, model_p, main, opt in params:
            state = opt.state[main]
            for field in OPTIM_FIELDS:
                state[field] = tensors[f"{key}:{field}"].to(device=main.device, dtype=main.dtype).clone()
            if main is not model_p:
                main.copy_(tensors[f"{key}:{MASTER}"])
            if any("step" in g for g in opt.param_groups):
                for g in opt.param_groups:
                    g["step"] = step
            else:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
    for o, saved in zip(_inner_optimizers(backend.optimizer), json.loads(meta.get("grad_scalers", "[]"))):
        scaler = getattr(o, "grad_scaler", None)
        if scaler is not None and saved:
            scaler.load_state_dict({k: torch.tensor(v, dtype=torch.float32, device=backend.device)
                                    if k == "scale" else v for k, v in saved.items()})


def _chunk_tensors(backend) -> dict[str, torch.Tensor]:

    return {chunk_key(c, n): v for c, w in enumerate(backend.chunks) for n, v in chunk_state(w.module).items()}


def _writes(backend) -> bool:
    """Whether this rank writes its (tp, pp) files: data-parallel rank 0 of each; with expert parallelism the first
    rank of each expert-parallel rank's expert-data-parallel group, as each ep rank holds other experts."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only

    if getattr(backend, "ep_rank", None) is not None:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def save_rank_state(backend, tag_dir: Path) -> None:
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only

    tag_dir.mkdir(parents=True, exist_ok=True)
    tp, pp, ep = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), backend.ep_rank
    if _distributed(backend):  # collective over the data-parallel group: every DP rank takes part
        backend.optimizer.save_parameter_state(str(tag_dir / f"distopt_{backend.rank_tag}.pt"))
    if _writes(backend):
        st.save(_chunk_tensors(backend), model_file(tag_dir, tp, pp, ep), {"format": "toolkit-megatron"})
        if _distributed(backend):
            torch.save(backend.optimizer.state_dict(), tag_dir / f"optim_{backend.rank_tag}.pt")
        else:
            tensors, meta = optimizer_tensors(backend)
            st.save(tensors, optim_file(tag_dir, tp, pp, ep), meta)


def written_files(backend, tag_dir: Path) -> list[str]:
    """The files save_rank_state wrote on this rank (data-parallel rank 0 of each (tp, pp) writes them all)."""
    if not _writes(backend):
        return []
    t = backend.rank_tag
    names = [f"model_{t}.safetensors", f"optim_{t}.safetensors", f"optim_{t}.pt", f"distopt_{t}.pt"]
    return [n for n in names if (tag_dir / n).is_file()]


def checkpoint_bytes(backend) -> int:
    """Bytes this rank adds to a checkpoint: on the writing rank its weights, its optimizer's fp32 main weights
    (when they are not the weights themselves) and their Adam state; with the distributed optimizer, every rank's
    shard of those (gathered into one file by save_parameter_state)."""
    writer = _writes(backend)
    model = [p for c in backend.chunks for p in c.module.parameters()]
    total = sum(p.numel() * p.element_size() for p in model) if writer else 0
    if not (writer or _distributed(backend)):
        return total
    seen = {id(p) for p in model}
    for o in _inner_optimizers(backend.optimizer):
        base = o.optimizer
        tensors = [p for g in base.param_groups for p in g["params"] if id(p) not in seen]
        tensors += [v for s in base.state.values() for v in s.values() if torch.is_tensor(v)]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def load_weights(chunks: list, tag_dir: Path, ep_rank: int | None = None) -> None:
    """Fill this rank's model chunks (GPTModels) from a toolkit Megatron checkpoint of the same layout."""
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only


    path = model_file(tag_dir, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ep_rank)
    if not path.is_file():
        raise ToolkitError(f"{path} is missing: the checkpoint was not written by this layout or is incomplete")
    tensors, _ = st.load(path)
    per_chunk: list[dict] = [{} for _ in chunks]
    for key, value in tensors.items():
        c, name, _ = split_key(key)
        if c >= len(per_chunk):
            raise ToolkitError(f"{path} has chunk {c}, this layout has {len(per_chunk)} chunks per rank")
        per_chunk[c][name] = value
    for chunk, chunk_state in zip(chunks, per_chunk):
        load_chunk_state(chunk, chunk_state)


def load_rank_state(backend, tag_dir: Path) -> None:
    from megatron.core import parallel_state as ps  # lazy: Megatron runs only

    tp, pp, ep = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), backend.ep_rank
    load_weights([w.module for w in backend.chunks], tag_dir, ep)
    if _distributed(backend):
        # Megatron's optimizer state holds plain Python containers and tensors only, so weights_only loading works
        native = tag_dir / f"optim_{backend.rank_tag}.pt"
        if not native.is_file():
            raise ToolkitError(f"{native} is missing: this checkpoint holds no distributed-optimizer state (a "
                               "converted checkpoint carries its optimizer state by parameter name, the plain "
                               "optimizer's); resume it with the plain optimizer, parallel.zero_stage: 0")
        backend.optimizer.load_state_dict(safe_load.load(native, map_location=backend.device))
        _load_distributed_state(backend.optimizer, tag_dir / f"distopt_{backend.rank_tag}.pt")
        return
    optim = optim_file(tag_dir, tp, pp, ep)
    if not optim.is_file():
        raise ToolkitError(f"{optim} is missing: this checkpoint holds weights only (converted with no optimizer "
                           "state), so training cannot resume from it; to train from its weights, convert it --to hf "
                           "and set model.hf_path to that folder with model.pretrained: true")
    tensors, meta = st.load(optim)
    load_optimizer_tensors(backend, tensors, meta, optim)


def _load_distributed_state(optimizer, path: Path) -> None:
    """Megatron's load_parameter_state, working around its torch-AdamW fallback (no Apex/TE, as on CPU): there
    load_state_dict restores each parameter's Adam "step" from the param groups, but load_parameter_state then
    expects "step" among the saved tensors, which save_parameter_state never writes. Set it aside meanwhile, and
    give each parameter its own step tensor: load_state_dict shares one, which torch's AdamW would then increment
    once per parameter per step, corrupting Adam's bias correction."""
    inner = [o.optimizer for o in _inner_optimizers(optimizer)]
    steps = [{p: st_.pop("step") for p, st_ in opt.state.items() if "step" in st_} for opt in inner]
    with torch.no_grad():  # in fp32 the main params are views of the model's (leaf) params
        optimizer.load_parameter_state(str(path))
    for opt, saved in zip(inner, steps):
        for p, step in saved.items():
            opt.state[p]["step"] = step.detach().clone()
