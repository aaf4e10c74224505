"""`toolkit doctor`: what this machine and launch environment can do, each finding with a status and a fix.

Checks: package versions against the toolkit's pins; torch's CUDA build, GPUs and NCCL; DeepSpeed's JIT ops the
recipes use (CPU Adam for offload, async I/O for NVMe, fused Adam on GPUs) and what they need (a C++ compiler,
ninja, libaio); Megatron-Core and Transformer Engine; the launch environment (MASTER_ADDR/PORT, RANK/WORLD_SIZE,
Slurm's variables, a port already in use); NCCL's network settings (an interface that exists, not loopback on
multi-node jobs); and, given a recipe, free disk at its checkpoint directory against what it will write.
Exit status 1 when any finding fails, else 0.
"""
from __future__ import annotations

import ctypes.util
import importlib.metadata as md
import io
import os
import shutil
import socket
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path

from toolkit import metrics
from toolkit.proc import abandoned_build_locks, cannot_write, extensions_in_use, nearest_existing
from toolkit.recipe.checks import check_nvme_path

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"


@dataclass
class Finding:
    check: str
    status: str
    detail: str
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_packages() -> list[Finding]:
    """Installed versions against the pins in the toolkit's own metadata."""
    try:
        pins = [r.split(";")[0].strip() for r in md.requires("llm-recipe-toolkit") or []
                if "==" in r and "extra ==" not in r]  # the run-time pins, not the dev extras
    except md.PackageNotFoundError:
        return [Finding("packages", WARN, "the toolkit is not installed as a package",
                        "pip install -e . from the repository root")]
    out = []
    for pin in pins:
        name, want = pin.split("==")
        have = _version(name.split("[")[0])
        if have is None:
            out.append(Finding(name, FAIL, f"not installed (pinned {want})", f"pip install '{pin}'"))
        elif have.split("+")[0] != want:
            out.append(Finding(name, WARN, f"{have} installed, {want} is the tested pin",
                               f"pip install '{pin}' (or keep yours at your own risk)"))
        else:
            out.append(Finding(name, OK, have))
    return out


def check_torch() -> list[Finding]:
    import torch  # lazy: doctor reports a broken torch instead of failing to start

    out = [Finding("torch build", INFO, f"{torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}")]
    if not torch.cuda.is_available():
        out.append(Finding("GPUs", INFO, "none visible: CPU runs use gloo (fine for the tiny recipes)",
                           "on a GPU node: install a CUDA build of torch and check nvidia-smi and "
                           "CUDA_VISIBLE_DEVICES" if torch.version.cuda is None else
                           "check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES"))
        return out
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out.append(Finding("GPUs", OK, f"{len(names)}: {', '.join(sorted(set(names)))}"))
    try:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        out.append(Finding("NCCL", OK, nccl))
    except Exception as e:  # noqa: BLE001 - any failure means NCCL is unusable
        out.append(Finding("NCCL", FAIL, f"not usable: {e}", "install a torch build with NCCL"))
    return out


DEFAULT_GPUS_PER_NODE = 8
"""The GPUs per node a recipe's host-memory need is estimated for where this machine shows none (a login node)."""


def gpus_here() -> int:
    import torch  # lazy: as check_torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_build_tools() -> list[Finding]:
    out = []
    cxx = shutil.which("c++") or shutil.which("g++")
    out.append(Finding("C++ compiler", OK if cxx else FAIL, cxx or "none on PATH",
                       "" if cxx else "apt-get install build-essential (DeepSpeed JIT-compiles cpu_adam/async_io)"))
    ninja = shutil.which("ninja")
    out.append(Finding("ninja binary", OK if ninja else FAIL, ninja or "none on PATH",
                       "" if ninja else "pip install ninja (DeepSpeed's JIT builds need it)"))
    aio = ctypes.util.find_library("aio")
    header = Path("/usr/include/libaio.h").is_file()
    out.append(Finding("libaio", OK if aio and header else WARN,
                       f"library {aio or 'missing'}, header {'present' if header else 'missing'}",
                       "" if aio and header else "apt-get install libaio-dev (needed for ZeRO-Infinity, "
                       "offload to NVMe)"))
    return out


def check_deepspeed_ops() -> list[Finding]:
    """The JIT ops the recipes use, as DeepSpeed itself judges them here."""
    try:

        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            from deepspeed.env_report import ALL_OPS  # lazy: DeepSpeed paths only
    except Exception as e:  # noqa: BLE001
        return [Finding("deepspeed ops", FAIL, f"cannot import DeepSpeed: {e}", "pip install deepspeed==0.19.8")]
    import torch  # lazy: doctor reports a broken torch instead of failing to start

    wanted = {"cpu_adam": "ZeRO-Offload (offload_optimizer: cpu)", "async_io": "ZeRO-Infinity (offload to nvme)"}
    if torch.cuda.is_available():
        wanted["fused_adam"] = "fused Adam on GPUs"
    out = []
    for op, used_for in wanted.items():
        builder = ALL_OPS.get(op)
        ok = builder is not None and builder.is_compatible(verbose=False)
        fix = {"async_io": "apt-get install libaio-dev, then rerun", "cpu_adam": "install a C++ compiler and ninja",
               "fused_adam": "install the CUDA toolkit matching torch's CUDA build"}[op]
        out.append(Finding(f"deepspeed op {op}", OK if ok else WARN,
                           f"{'compatible' if ok else 'not compatible'} ({used_for})", "" if ok else fix))
    cache = extensions_in_use()
    why = cannot_write(cache)  # DeepSpeed builds its ops there as a run starts (doctor said ready until 2026-12-07)
    out.append(Finding("extensions cache", FAIL, f"{cache} cannot be written: {why}",
                       "set TORCH_EXTENSIONS_DIR to a folder you can write") if why else
               Finding("extensions cache", OK, f"{cache} is writable"))
    locks = abandoned_build_locks(cache)
    out.append(Finding("op build locks", FAIL, f"{', '.join(map(str, locks))} left by a killed build: DeepSpeed would "
                       "wait for it forever", "delete " + " ".join(map(str, locks))) if locks else
               Finding("op build locks", OK, f"none abandoned in {cache}"))
    return out


def check_megatron() -> list[Finding]:
    import torch  # lazy: doctor reports a broken torch instead of failing to start

    out = [Finding("megatron-core", OK if _version("megatron-core") else FAIL,
                   _version("megatron-core") or "not installed", "" if _version("megatron-core") else
                   "pip install megatron-core==0.16.1")]
    te = _version("transformer-engine") or _version("transformer_engine")
    if te:
        out.append(Finding("transformer-engine", OK, te))
    elif torch.cuda.is_available():
        out.append(Finding("transformer-engine", WARN, "not installed: Megatron runs the local layer spec (no "
                           "context parallelism, slower)", "pip install transformer-engine[pytorch] matching "
                           "your CUDA"))
    else:
        out.append(Finding("transformer-engine", INFO, "not installed (needs CUDA; the local spec runs on CPU)"))
    return out


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_launch_env(env: dict | None = None) -> list[Finding]:
    env = dict(os.environ if env is None else env)
    out = []
    keys = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"]
    seen = {k: env[k] for k in keys if k in env}
    out.append(Finding("launch environment", INFO, ", ".join(f"{k}={v}" for k, v in seen.items()) or
                       "none set (launchers set them: torchrun, deepspeed, the slurm/ scripts)"))
    slurm = {k: env[k] for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST", "SLURM_NODEID")
             if k in env}
    if slurm:
        out.append(Finding("Slurm", INFO, ", ".join(f"{k}={v}" for k, v in slurm.items())))
    for key, low in (("MASTER_PORT", 1), ("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
        value = env.get(key)  # a launcher passes them on: a bad one fails every rank's init (a trial of 2026-12-07)
        if value is not None and not (value.isdigit() and low <= int(value) <= (65535 if key == "MASTER_PORT"
                                                                               else 1 << 30)):
            span = "a port, 1-65535" if key == "MASTER_PORT" else f"a whole number from {low}"
            out.append(Finding(key, FAIL, f"{value!r} is not {span}", f"unset {key} (launchers set it) or fix it"))
    if "RANK" in env and "WORLD_SIZE" in env and env["RANK"].isdigit() and env["WORLD_SIZE"].isdigit() and \
            int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        out.append(Finding("RANK", FAIL, f"{env['RANK']} is not below WORLD_SIZE {env['WORLD_SIZE']}",
                           "unset RANK and WORLD_SIZE (launchers set them) or fix them"))
    addr = env.get("MASTER_ADDR")
    if addr:  # every rank connects to it: a name that does not resolve fails each one's init (info until 2026-12-07)
        try:
            socket.getaddrinfo(addr, None)
        except (OSError, UnicodeError) as e:
            out.append(Finding("MASTER_ADDR", FAIL, f"{addr!r} does not resolve on this host ({e})",
                               "set MASTER_ADDR to the first node's name or address (the slurm/ scripts do)"))
    port = env.get("MASTER_PORT")
    if port and port.isdigit() and 1 <= int(port) <= 65535 and env.get("RANK", "0") == "0" and \
            env.get("MASTER_ADDR", "localhost") in ("localhost", "127.0.0.1", socket.gethostname()):
        if _port_in_use("", int(port)):
            out.append(Finding("MASTER_PORT", FAIL, f"{port} is already in use on this host",
                               "pick another port (the slurm/ scripts derive one from the job id)"))
    return out


def check_network(env: dict | None = None, nodes: int | None = None) -> list[Finding]:
    """NCCL's interface settings against the interfaces this host has."""
    env = dict(os.environ if env is None else env)
    nodes = nodes or int(env.get("SLURM_JOB_NUM_NODES", "1") or 1)
    have = sorted(p.name for p in Path("/sys/class/net").iterdir()) if Path("/sys/class/net").is_dir() else []
    out = []
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname:
        exclude, exact = ifname.startswith("^"), ifname.lstrip("^").startswith("=")
        names = [n.strip() for n in ifname.lstrip("^=").split(",") if n.strip()]
        if not exclude:
            matches = [n for n in names if any(h == n or (not exact and h.startswith(n)) for h in have)]
            if not matches:
                out.append(Finding("NCCL_SOCKET_IFNAME", FAIL, f"{ifname!r} matches none of this host's interfaces "
                                   f"({', '.join(have)})", "set it to the interface the nodes reach each other on "
                                   "(ip -br addr), e.g. ib0 or eth0"))
            elif nodes > 1 and all(m.startswith("lo") for m in matches):
                out.append(Finding("NCCL_SOCKET_IFNAME", FAIL, f"{ifname!r} is loopback on a {nodes}-node job: "
                                   "other nodes cannot connect", "set it to the inter-node interface (ip -br addr)"))
            else:
                out.append(Finding("NCCL_SOCKET_IFNAME", OK, f"{ifname} ({', '.join(matches)})"))
        else:
            out.append(Finding("NCCL_SOCKET_IFNAME", INFO, f"{ifname} (exclusion list)"))
    elif nodes > 1:
        out.append(Finding("NCCL_SOCKET_IFNAME", WARN, f"unset on a {nodes}-node job: NCCL guesses, and a wrong "
                           "guess hangs at the first collective", "export TOOLKIT_NCCL_IFNAME=<interface> before "
                           "sbatch (the slurm/ scripts pass it on) or NCCL_SOCKET_IFNAME"))
    ib = env.get("NCCL_IB_DISABLE")
    ib_present = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    if ib == "1" and ib_present:
        out.append(Finding("NCCL_IB_DISABLE", WARN, "InfiniBand devices exist but NCCL_IB_DISABLE=1",
                           "unset it unless IB is known broken: sockets are much slower across nodes"))
    else:
        out.append(Finding("InfiniBand", INFO, f"{'devices present' if ib_present else 'no devices'}; "
                           f"NCCL_IB_DISABLE={ib or 'unset'}"))
    return out


def check_disk(recipe) -> list[Finding]:
    """The checkpoint folder's disk, resolved as training resolves it: from the working folder (it was resolved
    from the toolkit's install folder until 2026-12-07, another disk when the run starts elsewhere)."""
    folder = Path(recipe.checkpoint_dir).absolute()
    why = cannot_write(folder)
    if why:
        return [Finding("checkpoint disk", FAIL, f"{folder}: {why}",
                        "point checkpoint.dir (or output_dir) at a folder you can write")]
    free = shutil.disk_usage(nearest_existing(folder)).free
    one = metrics.checkpoint_bytes(recipe)
    keep, steps, interval = recipe.checkpoint.keep, recipe.training.steps, recipe.checkpoint.interval
    saves = steps // interval + (steps % interval != 0)  # and one at the last step
    held = min(keep + 1, saves)  # the newest is written before the oldest is pruned
    need = one * held
    detail = (f"{folder}: {_size(free)} free; one checkpoint is {_size(one)}, and the run holds up to {held} at once "
              f"({_size(need)}: keep={keep}, plus the one being saved, of {saves} saves)")
    if free < need:  # the run stops at a save (a WARN until 2026-12-07, with every size printed as 0.0 GiB)
        return [Finding("checkpoint disk", FAIL, detail, f"free {_size(need - free)}, lower checkpoint.keep, or point "
                        "checkpoint.dir at a larger file system")]
    return [Finding("checkpoint disk", OK, detail)]


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps them above 1 (GiB, MiB, KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"


# What each backend needs, by the checks above that must be ok: (backend and use, required checks, optional
# checks whose absence only costs features).
NEEDS = [
    ("deepspeed backend, CPU rehearsal (gloo)", ["torch", "deepspeed", "transformers", "extensions cache"], []),
    ("deepspeed backend, GPU training", ["torch", "deepspeed", "transformers", "GPUs", "NCCL", "extensions cache"],
     ["deepspeed op fused_adam"]),
    ("deepspeed ZeRO-Offload (cpu)", ["deepspeed op cpu_adam", "C++ compiler", "ninja binary", "extensions cache"], []),
    ("deepspeed ZeRO-Infinity (nvme)", ["deepspeed op async_io", "libaio", "C++ compiler", "ninja binary",
                                        "extensions cache", "nvme_path"], []),
    ("megatron backend, CPU rehearsal (local spec)", ["torch", "megatron-core"], []),
    ("megatron backend, GPU training", ["torch", "megatron-core", "GPUs", "NCCL"], ["transformer-engine"]),
]


RECIPE_CHECKS = ("nvme_path", "checkpoint disk", "host memory")
"""Checks made only with --recipe: a use needs them when they were made."""


def uses(recipe) -> set[str]:
    """The NEEDS entries a recipe relies on: its backend on CPU and GPU, and its kind of offload."""
    p = recipe.parallel
    if p.backend == "megatron":
        return {"megatron backend, CPU rehearsal (local spec)", "megatron backend, GPU training"}
    out = {"deepspeed backend, CPU rehearsal (gloo)", "deepspeed backend, GPU training"}
    if "cpu" in (p.offload_optimizer, p.offload_params):
        out.add("deepspeed ZeRO-Offload (cpu)")
    if "nvme" in (p.offload_optimizer, p.offload_params):
        out |= {"deepspeed ZeRO-Offload (cpu)", "deepspeed ZeRO-Infinity (nvme)"}  # NVMe offload runs cpu_adam too
    return out


def readiness(findings: list[Finding], recipe=None) -> list[Finding]:
    """One line per backend and use: ready, or which checks stand in the way (their fixes are above). Given a
    recipe, only what it uses can fail: a machine that cannot offload to NVMe is fine for a recipe that never does."""
    status = {f.check: f.status for f in findings}
    fixes = {f.check: f.fix for f in findings if f.fix}
    wanted = uses(recipe) if recipe is not None else None
    out = []
    for use, required, optional in NEEDS:
        # a recipe's own checks (its NVMe folder, its checkpoint disk) count where they were made (until 2026-12-07
        # ZeRO-Infinity was "ready" under a failed nvme_path, and every use under a disk too small)
        missing = [c for c in required if status.get(c) != OK and not (c in RECIPE_CHECKS and c not in status)]
        missing += [c for c in RECIPE_CHECKS if status.get(c) == FAIL and c not in missing and use in (wanted or ())]
        lacking = [c for c in optional if status.get(c) not in (OK, None)]
        if missing and wanted is not None and use not in wanted:
            out.append(Finding(f"ready: {use}", INFO, f"no, missing: {', '.join(missing)} (recipe {recipe.name} does "
                               "not use it)"))
        elif missing:
            fix = "; ".join(dict.fromkeys(fixes[c] for c in missing if c in fixes)) or "see the checks above"
            out.append(Finding(f"ready: {use}", WARN if "GPU" in use else FAIL,
                               "no, missing: " + ", ".join(missing), fix))
        elif lacking:
            out.append(Finding(f"ready: {use}", OK, "yes, without " + ", ".join(lacking) + " (slower, fewer "
                               "features)", "; ".join(fixes[c] for c in lacking if c in fixes)))
        else:
            out.append(Finding(f"ready: {use}", OK, "yes"))
    return out


def host_memory() -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) of this machine in bytes, from /proc/meminfo; None where it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_host_memory(recipe, need: int | None, per_node: int, memory: tuple[int, int] | None) -> list[Finding]:
    """This node's memory against what the recipe offloads to it per node (`need`: toolkit plan's estimate at
    per_node ranks per node; None: no estimate). Only recipes that offload to CPU or NVMe are checked."""
    p = recipe.parallel
    if not {"cpu", "nvme"} & {p.offload_optimizer, p.offload_params}:
        return []
    if memory is None:
        return [Finding("host memory", INFO, "/proc/meminfo cannot be read here: not checked")]
    total, available = memory
    here = f"{_size(available)} available of {_size(total)} on this node"
    if need is None:
        return [Finding("host memory", INFO, f"{here}; the recipe's layout has no estimate at {per_node} ranks "
                        "per node (toolkit plan)")]
    detail = (f"{here}; the recipe's offload holds about {_size(need)} per node with {per_node} ranks per node "
              "(toolkit plan's estimate)")
    if need > total:
        return [Finding("host memory", FAIL, detail, "spread the offloaded states over more nodes, offload less, or "
                        "use nodes with more memory (toolkit plan --cpu-memory GIB ranks layouts that fit)")]
    if need > available:
        return [Finding("host memory", WARN, detail, "other processes hold the rest: free memory on this node")]
    return [Finding("host memory", OK, detail)]


def check_nvme(recipe) -> list[Finding]:
    """The recipe's NVMe offload folder on this machine (the check a run makes before it starts)."""
    problems = check_nvme_path(recipe)
    if problems:
        return [Finding("nvme_path", FAIL, problems[0].message, problems[0].fix)]
    if recipe.parallel.nvme_path and "nvme" in (recipe.parallel.offload_optimizer, recipe.parallel.offload_params):
        return [Finding("nvme_path", OK, f"{recipe.parallel.nvme_path} is a writable folder")]
    return []


def run(recipe=None, nodes: int | None = None, offload_need=None) -> list[Finding]:
    """Every check; with a recipe, its own. `offload_need(gpus_per_node)`: what the recipe offloads to each node's
    host memory, and for how many ranks per node (toolkit.plan.offload_host_bytes, which this layer does not
    import)."""
    findings = [*check_packages(), *check_torch(), *check_build_tools(), *check_deepspeed_ops(), *check_megatron(),
                *check_launch_env(), *check_network(nodes=nodes)]
    if recipe is not None:
        findings += check_disk(recipe) + check_nvme(recipe)
        if offload_need is not None:
            findings += check_host_memory(recipe, *offload_need(gpus_here() or DEFAULT_GPUS_PER_NODE), host_memory())
    return findings + readiness(findings, recipe)


def render(findings: list[Finding]) -> str:
    mark = {OK: "ok  ", INFO: "info", WARN: "WARN", FAIL: "FAIL"}
    lines = []
    for f in findings:
        lines.append(f"[{mark[f.status]}] {f.check}: {f.detail}")
        if f.fix:
            lines.append(f"       fix: {f.fix}")
    fails, warns = sum(f.status == FAIL for f in findings), sum(f.status == WARN for f in findings)
    lines.append(f"{len(findings)} checks: {fails} failed, {warns} warnings")
    return "\n".join(lines)


def as_json(findings: list[Finding]) -> list[dict]:
    return [asdict(f) for f in findings]
