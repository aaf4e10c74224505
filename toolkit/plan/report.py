"""How a plan is shown: the table people read, the JSON scripts read (same numbers), and the recipe `--write` saves."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import yaml

from toolkit.metrics import count_params
from toolkit.plan.estimate import Estimate
from toolkit.plan.hardware import Cluster

GiB = 2**30


def _g(n: float) -> str:
    return f"{n / GiB:,.2f}"


def estimate_dict(e: Estimate) -> dict:
    m = e.memory
    return {"layout": e.choice.label(), "choice": asdict(e.choice), "fits": e.fits, "problems": e.problems,
            "memory_bytes": {"stage": m.stage, "weights": m.states.weights, "grads": m.states.grads,
                             "master": m.states.master, "moments": m.states.moments,
                             "placement": m.states.placement, "activations": m.activations,
                             "buffers": m.buffers, "gpu_total": m.gpu, "cuda_reserve": m.reserve,
                             "cpu_per_node": m.cpu_per_node, "nvme_per_node": m.nvme_per_node,
                             "state_notes": list(m.states.notes), "activation_notes": m.activation_notes},
            "flops": {"model": e.model_flops, "hardware": e.hardware_flops},
            "comms": [asdict(c) for c in e.comms], "bubble": e.bubble, "times_s": e.times, "step_s": e.step_s,
            "tokens_per_step": e.tokens, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu}


def breakdown(e: Estimate, cluster: Cluster) -> list[str]:
    m, s = e.memory, e.memory.states
    where = s.placement
    lines = [f"  memory per GPU ({m.stage}):"]
    for kind, label in (("weights", "weights"), ("grads", "gradients"), ("master", "fp32 master weights"),
                        ("moments", "Adam moments")):
        lines.append(f"    {label:<28}{_g(getattr(s, kind)):>10} GiB  on {where.get(kind, 'gpu')}")
    lines.append(f"    {'activations':<28}{_g(m.activations):>10} GiB  on gpu")
    lines += [f"      {n}" for n in m.activation_notes]
    for name, n in m.buffers.items():
        lines.append(f"    {'buffer: ' + name.replace('_', ' '):<28}{_g(n):>10} GiB  on gpu")
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines.append(f"    {'total on GPU':<28}{_g(m.gpu):>10} GiB  of {_g(cluster.usable_gpu_bytes)} usable: {verdict}")
    if m.cpu_per_node:
        lines.append(f"    {'CPU RAM per node':<28}{_g(m.cpu_per_node):>10} GiB  of {_g(cluster.usable_cpu_bytes)} usable")
    if m.nvme_per_node:
        lines.append(f"    {'NVMe per node':<28}{_g(m.nvme_per_node):>10} GiB  of {cluster.nvme_gib:,.0f}")
    lines += [f"      {n}" for n in s.notes]
    lines += [f"      ! {p}" for p in e.problems]
    lines.append(f"  per step: {e.tokens:,} tokens; {e.model_flops:.3g} model FLOPs"
                 + (f" ({e.hardware_flops:.3g} with recomputation)" if e.hardware_flops != e.model_flops else ""))
    if e.comms:
        lines.append(f"    {'communication':<56}{'group':>6}{'GiB/GPU':>10}{'link':>9}{'s':>8}{'exposed':>9}")
        for c in e.comms:
            lines.append(f"    {c.what:<56}{c.dim + str(c.group):>6}{_g(c.bytes):>10}{c.link:>9}{c.seconds:>8.2f}"
                         f"{c.exposed:>9.2f}")
    if e.choice.pp > 1:
        lines.append(f"    pipeline bubble: {e.bubble:.1%} = (pp-1)/(vpp x m + pp-1) with pp={e.choice.pp}, "
                     f"vpp={e.choice.vpp}, m={e.choice.accum} micro-batches")
    parts = ", ".join(f"{k} {_num(v)}" for k, v in e.times.items() if v >= 0.005 * e.step_s)
    mfu = f"MFU {e.mfu:.0%}" if e.mfu is not None else (
        "no MFU (fp32 has no 16-bit peak to compare with; the time assumes that peak, so an fp32 run is slower)")
    lines.append(f"    est. step time {_num(e.step_s)} s ({parts}): {_num(e.tokens_per_s)} tokens/s, {mfu}")
    return lines


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float) -> str:
    """3 significant digits with k/M/G: fits a column whatever the model size."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def ranked_table(ests: list[Estimate], top: int) -> list[str]:
    lines = [f"  {'#':>2}  {'layout':<70} {'GiB/GPU':>8} {'step s':>8} {'tok/s/GPU':>9} {'MFU':>4}"]
    for i, e in enumerate(ests[:top], 1):
        per_gpu = e.tokens_per_s / e.choice.world
        lines.append(f"  {i:>2}  {e.choice.label():<70} {e.memory.gpu / GiB:>8.1f} {_num(e.step_s):>8} "
                     f"{_num(per_gpu):>9} {_percent(e.mfu):>4}")
    return lines


def header(r, cluster: Cluster, global_batch: int) -> str:
    counts = count_params(r.model)

    def size_of(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"

    size = size_of(counts["total"]) + " parameters" + (f" ({size_of(counts['active'])} active per token)"
                                                       if "active" in counts else "")
    return (f"plan: {r.name}: {r.model.family}, {size}, seq {r.data.seq_len}, global batch {global_batch}"
            f" ({global_batch * r.data.seq_len:,} tokens/step), {r.training.precision}; on {cluster.gpus} GPUs "
            f"({cluster.nodes} node(s) x {cluster.gpus_per_node}, {cluster.gpu_memory_gib:g} GiB each)")


def write_recipe(path: Path, base: str, overrides: dict, e: Estimate, cluster: Cluster, reasons: list[str],
                 name: str | None = None) -> None:
    """A recipe that is the planned one: `base:` the original, its own `name` and output folder (runs/<name>, so
    that it never resumes the base recipe's checkpoints: it did until 2026-12-07, and a run of another ZeRO stage
    stopped at the resume), the --set values, then the chosen layout."""
    data: dict = {"base": base}
    if name:
        data.update(name=name, output_dir=f"runs/{name}")
    for section, values in overrides.items():
        data[section] = values
    for dotted, value in e.choice.recipe_keys().items():
        section, key = dotted.split(".")
        data.setdefault(section, {})[key] = value
    head = [f"# Written by `toolkit plan` for {cluster.gpus} GPUs ({cluster.gpus_per_node} per node, "
            f"{cluster.gpu_memory_gib:g} GiB): {e.choice.label()}",
            f"# est. {e.memory.gpu / GiB:,.1f} GiB per GPU, step {e.step_s:.2f} s, MFU {_percent(e.mfu)}. Why:"]
    head += [f"#   {line}" for x in reasons for line in x.splitlines()]
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False))
