"""Recipe + layout -> DeepSpeed config JSON, and the merge of a user's own DeepSpeed JSON ("auto" values)."""
from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import Problem, RecipeError
from toolkit.recipe import list_recipes, load_recipe, resolve
from toolkit.recipe.checks import Plan

# DeepSpeed keys whose value the recipe decides: an explicit, different value in a user's JSON is a conflict.
RECIPE_OWNED = {
    "train_batch_size": "training.global_batch_size",
    "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.grad_accum_steps",
    "gradient_clipping": "training.grad_clip",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_param.device": "parallel.offload_params",
    "zero_optimization.offload_optimizer.nvme_path": "parallel.nvme_path",
    "zero_optimization.offload_param.nvme_path": "parallel.nvme_path",
    "bf16.enabled": "training.precision",
    "fp16.enabled": "training.precision",
    "optimizer.params.lr": "training.optimizer.lr",
    "optimizer.params.betas": "training.optimizer.betas",
    "optimizer.params.eps": "training.optimizer.eps",
    "optimizer.params.weight_decay": "training.optimizer.weight_decay",
}


def _zero_section(plan: Plan, device: str) -> dict:
    p, ds = plan.recipe.parallel, plan.recipe.parallel.deepspeed
    stage = p.zero_stage
    z: dict = {"stage": stage}
    if stage == 0:
        return z
    z.update(overlap_comm=ds.overlap_comm, contiguous_gradients=ds.contiguous_gradients,
             reduce_bucket_size=ds.reduce_bucket_size)
    if stage < 3:
        z.update(allgather_bucket_size=ds.allgather_bucket_size, reduce_scatter=True)
    else:
        z.update(stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
                 stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
                 stage3_max_live_parameters=ds.stage3_max_live_parameters,
                 stage3_max_reuse_distance=ds.stage3_max_reuse_distance,
                 stage3_gather_16bit_weights_on_model_save=ds.gather_16bit_weights_on_save)
    pin = ds.pin_memory and device == "cuda"  # page-locking means nothing without a GPU
    if p.offload_optimizer != "none":
        z["offload_optimizer"] = {"device": p.offload_optimizer, "pin_memory": pin}
        if p.offload_optimizer == "nvme":
            z["offload_optimizer"].update(nvme_path=p.nvme_path, buffer_count=ds.buffer_count)
    if p.offload_params != "none":
        z["offload_param"] = {"device": p.offload_params, "pin_memory": pin}
        if p.offload_params == "nvme":
            z["offload_param"].update(nvme_path=p.nvme_path, buffer_count=ds.param_buffer_count,
                                      buffer_size=ds.param_buffer_size)
    return z


def _precision_sections(plan: Plan) -> dict:
    t = plan.recipe.training
    fp16 = {"enabled": t.precision == "fp16"}
    if t.precision == "fp16":
        # loss_scale 0 = dynamic loss scaling, starting at 2**initial_scale_power.
        fp16.update(loss_scale=0, initial_scale_power=t.fp16_initial_scale_power, loss_scale_window=1000,
                    hysteresis=2, min_loss_scale=1)
    return {"bf16": {"enabled": t.precision == "bf16"}, "fp16": fp16}


def to_ds_config(plan: Plan, device: str = "cuda") -> dict:
    """The DeepSpeed config for a resolved recipe. `device` is "cuda" for GPU runs, "cpu" for CPU rehearsals.

    No "scheduler" block: the toolkit drives the LR schedule itself (DeepSpeed's schedulers start at lr 0
    for their first step), and passes it to deepspeed.initialize.
    """
    t, p, b = plan.recipe.training, plan.recipe.parallel, plan.batch
    opt = t.optimizer
    params: dict = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
    if device == "cpu" and p.offload_optimizer == "none":
        params["torch_adam"] = True  # DeepSpeed's FusedAdam is a GPU kernel; torch's AdamW is the CPU equivalent
    cfg = {
        "train_batch_size": b.global_batch,
        "train_micro_batch_size_per_gpu": b.micro_batch,
        "gradient_accumulation_steps": b.grad_accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 2**31 - 1,  # the toolkit logs; DeepSpeed's own step print stays quiet
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": _zero_section(plan, device),
        **_precision_sections(plan),
    }
    if "nvme" in (p.offload_optimizer, p.offload_params):
        ds = p.deepspeed
        cfg["aio"] = {"block_size": ds.aio_block_size, "queue_depth": ds.aio_queue_depth,
                      "intra_op_parallelism": ds.aio_intra_op_parallelism, "single_submit": False,
                      "overlap_events": True}
    return cfg


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def merge_user_config(user: dict, ours: dict, source: str = "deepspeed config") -> tuple[dict, list[Problem]]:
    """Fill the user's "auto" values from `ours`, keep their other explicit values, and report every explicit
    value that contradicts the recipe. Returns (merged config, problems)."""
    problems: list[Problem] = []

    def walk(u: dict, o: dict, prefix: str) -> dict:
        out = dict(o)
        for k, v in u.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                out[k] = walk(v, o[k] if isinstance(o.get(k), dict) else {}, key + ".")
            elif v == "auto":
                if k in o:
                    out[k] = o[k]
                else:
                    problems.append(Problem(f"{source}: {key}", '"auto" but the recipe gives no value for it',
                                            "write an explicit value in your JSON"))
            else:
                owner = RECIPE_OWNED.get(key)
                if owner and _norm(v) != _norm(o.get(k)):
                    ours_text = repr(o[k]) if k in o else "nothing (not enabled)"
                    problems.append(Problem(f"{source}: {key}", f"{v!r} contradicts the recipe, which gives "
                                            f"{ours_text} (from {owner})",
                                            f'set {key} to "auto" in the JSON, or change {owner} in the recipe'))
                out[k] = v
        return out

    merged = walk(user, ours, "")
    problems += _check_user_sections(user, merged, source)
    return merged, problems


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def _check_user_sections(user: dict, merged: dict, source: str) -> list[Problem]:
    out = []
    if _get(merged, "bf16.enabled") is True and _get(merged, "fp16.enabled") is True:
        out.append(Problem(f"{source}: bf16/fp16", "both bf16.enabled and fp16.enabled are true",
                           "enable one of them (or set both to \"auto\" and pick training.precision)"))
    if "scheduler" in user:
        out.append(Problem(f"{source}: scheduler", "the toolkit drives the learning-rate schedule from "
                           "training.schedule; a DeepSpeed scheduler block would fight it",
                           "remove the scheduler block and set training.schedule in the recipe"))
    opt_type = _get(user, "optimizer.type")
    if opt_type not in (None, "auto") and str(opt_type).lower() not in ("adamw", "adam"):
        out.append(Problem(f"{source}: optimizer.type", f"{opt_type!r}, but the recipe's optimizer is adamw",
                           'set optimizer.type to "AdamW" or "auto"'))
    return out


def build_ds_config(plan: Plan, device: str = "cuda") -> dict:
    """The config a run uses: ours, or the user's JSON (parallel.deepspeed.config) merged over it."""
    ours = to_ds_config(plan, device)
    path = plan.recipe.parallel.deepspeed.config
    if not path:
        return ours
    try:
        user = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RecipeError(plan.recipe.name, [Problem("parallel.deepspeed.config", f"cannot read {path}: {e}",
                                                     "point it at a readable DeepSpeed JSON file")]) from None
    merged, problems = merge_user_config(user, ours, source=Path(path).name)
    if problems:
        raise RecipeError(plan.recipe.name, problems)
    return merged


def shipped_deepspeed_recipes() -> list[str]:
    """The shipped recipes that run on the DeepSpeed backend."""
    return [n for n in list_recipes() if load_recipe(n).parallel.backend == "deepspeed"]


def render_ds_json(name: str) -> str:
    """The text of ds_configs/<name>.json: the recipe rendered for its own world size, for GPUs."""
    return json.dumps(build_ds_config(resolve(load_recipe(name)), "cuda"), indent=2) + "\n"


def write_shipped_configs(folder: Path) -> list[Path]:
    """Rewrite folder/<name>.json for every shipped DeepSpeed recipe (`toolkit render ds-config --all`)."""
    folder.mkdir(exist_ok=True)
    out = []
    for name in shipped_deepspeed_recipes():
        (folder / f"{name}.json").write_text(render_ds_json(name))
        out.append(folder / f"{name}.json")
    return out
