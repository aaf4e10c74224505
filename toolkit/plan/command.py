"""`toolkit plan`: the recipe's own layout broken down, then every layout that fits N GPUs, fastest first, with the
reasons for the winner; `--json` for scripts, `--write` to save the winner as a recipe."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from toolkit.errors import Problem, RecipeError, ToolkitError
from toolkit.format.paths import check_write_path
from toolkit.metrics import count_params
from toolkit.plan import report
from toolkit.plan.choice import from_recipe
from toolkit.plan.estimate import estimate
from toolkit.plan.hardware import Cluster
from toolkit.plan.search import BACKENDS, nearest_fit, reasons, search
from toolkit.recipe import load_recipe, resolve
from toolkit.recipe.loader import find_recipe, parse_overrides


def cluster_from_args(args) -> Cluster:
    problems = []
    if args.gpus < 1:
        problems.append(Problem("--gpus", f"{args.gpus}", "give the number of GPUs, e.g. --gpus 8"))
    if args.gpus_per_node < 1:
        problems.append(Problem("--gpus-per-node", f"{args.gpus_per_node}", "e.g. --gpus-per-node 8"))
    elif args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        problems.append(Problem("--gpus", f"{args.gpus} GPUs do not fill whole nodes of {args.gpus_per_node}",
                                f"use a multiple of {args.gpus_per_node}, or set --gpus-per-node"))
    if args.gpu_memory <= Cluster.reserve_gib:
        problems.append(Problem("--gpu-memory", f"{args.gpu_memory} GiB leaves nothing after the "
                                f"{Cluster.reserve_gib} GiB CUDA/NCCL reserve", "give the GPU's memory in GiB, e.g. 80"))
    if problems:
        raise RecipeError("options", problems, what="toolkit plan's")
    extra = {k: v for k, v in (("cpu_memory_gib", args.cpu_memory), ("nvme_gib", args.nvme),
                               ("peak_tflops", args.peak_tflops)) if v is not None}
    return Cluster(gpus=args.gpus, gpus_per_node=min(args.gpus_per_node, args.gpus),
                   gpu_memory_gib=args.gpu_memory, **extra)


def _global_batch(r) -> int:
    return r.training.global_batch_size or resolve(r).batch.global_batch


def run(args) -> int:
    r = load_recipe(args.recipe, args.overrides)
    cluster = cluster_from_args(args)
    gb = _global_batch(r)
    backends = BACKENDS if args.backend == "any" else (args.backend,)
    try:
        own, own_error = estimate(r, from_recipe(r, cluster.gpus), cluster), None
    except RecipeError as e:
        own, own_error = None, str(e)
    found = search(r, cluster, gb, backends)
    best = found.best
    why = reasons(r, best, found) if best else []
    missing = [] if best else nearest_fit(found, r, cluster, gb, backends)
    if args.write:
        if not best:
            raise ToolkitError(f"nothing to write: no layout fits {cluster.gpus} GPUs (see the plan above)")
        _write(Path(args.write), args, best, cluster, why)
    if args.json:
        print(json.dumps({"recipe": r.name, "family": r.model.family, "parameters": count_params(r.model),
                          "global_batch": gb, "cluster": asdict(cluster),
                          "recipe_layout": report.estimate_dict(own) if own else None,
                          "recipe_layout_error": own_error,
                          "ranked": [report.estimate_dict(e) for e in found.fitting[:args.top]],
                          "valid_layouts": len(found.estimates), "fitting_layouts": len(found.fitting),
                          "reasons": why, "missing": missing}, indent=1))
        return 0 if best else 1
    print(report.header(r, cluster, gb))
    print()
    if own:
        print(f"The recipe's layout: {own.choice.label()}")
        print("\n".join(report.breakdown(own, cluster)))
    else:
        print(f"The recipe's layout does not run on {cluster.gpus} GPUs:\n{own_error}")
    print()
    if best:
        print(f"{len(found.fitting)} of {len(found.estimates)} valid layouts fit; #1 is the pick (why below), the rest "
              "fastest first (estimates):")
        print("\n".join(report.ranked_table(found.fitting, args.top)))
        print(f"\nWhy #1 ({best.choice.label()}):")
        print("\n".join(f"  - {x}" for x in why))
        if args.write:
            print(f"\nwrote {args.write}")
    else:
        print(f"Nothing fits: none of the {len(found.estimates)} valid layouts fits {cluster.gpus} GPUs of "
              f"{cluster.gpu_memory_gib:g} GiB." if found.estimates else
              f"Nothing fits: no layout of {cluster.gpus} GPUs is valid for this recipe.")
        print("\n".join(f"  - {x}" for x in missing))
    print("\nAssumed (override with --gpu-memory/--cpu-memory/--nvme/--peak-tflops): "
          + ", ".join(cluster.describe()[1:]))
    return 0 if best else 1


def _write(path: Path, args, best, cluster, why) -> None:
    check_write_path(path, args.overwrite, "--write")
    base = str(find_recipe(args.recipe).resolve())
    tmp = path.with_name(path.name + ".tmp")
    report.write_recipe(tmp, base, parse_overrides(args.overrides, args.recipe), best, cluster, why,
                        name=path.name.removesuffix(".yaml").removesuffix(".yml"))
    try:
        resolve(load_recipe(str(tmp)), cluster.gpus)  # what we write must validate for these GPUs
    except Exception:
        tmp.unlink()
        raise
    os.replace(tmp, path)
