"""Shared fixtures: a tiny pretrained Llama checkpoint and a launcher for real multi-process runs."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from toolkit.proc import (
    free_port,  # noqa: F401 - the tests import it from here
    use_own_extensions_cache,
)
from toolkit.proc import signal_tree as signal_process_tree  # noqa: F401

# The tests that import DeepSpeed in this process, the benchmarks' hand-written scripts and every training launch
# then share the environment's one extensions cache: each JIT op is built once per run of the suite, not per kind
# of caller.
use_own_extensions_cache()

REPO = Path(__file__).resolve().parents[1]

# DeepSpeed compiles its JIT ops with -g. The suite builds them through a c++ that leaves it out (tests/cxx_without_g;
# every launch, the op builder and the Slurm jobs inherit CXX): async_io's sources then compiled in 56% of the time
# (docs/testing.md). A CXX the user set is kept.
os.environ.setdefault("CXX", str(REPO / "tests" / "cxx_without_g"))
TINY = dict(preset="tiny")  # 2 layers, hidden 64, GQA 4 heads / 2 kv heads, vocab 512


# (test, recipe, ranks, seconds) of every training launch: the end-of-run summary shows how much of the suite they are
LAUNCHES: list[tuple[str, str, int, float]] = []


# every launch's environment: one thread per rank (two ranks share the 2-core machine), nothing downloaded
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
              "HF_HUB_OFFLINE": "1"}
# TOOLKIT_TEST_LAUNCHER=real: every launch through the real torchrun (or python), as before the warm launcher
WARM = os.environ.get("TOOLKIT_TEST_LAUNCHER", "warm") != "real"
_zygote = None


def _warm():
    global _zygote
    if _zygote is None:
        import zygote  # tests/zygote.py

        _zygote = zygote.Client()
    return _zygote


def launch(recipe: str, overrides: list[str], nproc: int, out_dir: Path, launcher: str = "torchrun",
           timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run recipes/train.py in `nproc` real processes (gloo on CPU)."""
    sets = [f"output_dir={out_dir}", *overrides]
    args = ["recipes/train.py", "--recipe", recipe, *(a for s in sets for a in ("--set", s))]
    start = time.monotonic()
    proc = run_ranks(args, nproc, dict(os.environ), launcher, timeout)
    LAUNCHES.append((os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], recipe, nproc,
                     time.monotonic() - start))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def run_ranks(args: list[str], nproc: int, env: dict, launcher: str = "torchrun", timeout: float = 600,
              preexec_fn=None) -> subprocess.CompletedProcess:
    """`launcher [its options] *args` from the repository root. torchrun and python runs go through the warm launcher
    (tests/zygote.py) unless TOOLKIT_TEST_LAUNCHER=real; its ranks start from default signal dispositions, so
    `preexec_fn` applies to real launches only."""
    env = {**env, **LAUNCH_ENV}
    for attempt in range(2):
        port = str(free_port())
        if launcher in ("torchrun", "python") and WARM:
            with tempfile.TemporaryDirectory(prefix="launch-") as work:
                proc = _warm().run(args, {**env, "MASTER_PORT": port}, str(REPO), nproc, timeout, work,
                                   plain=launcher == "python")
        else:
            bin_dir = Path(sys.executable).parent
            if launcher == "deepspeed":
                cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port]
            elif launcher == "torchrun":
                cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port]
            else:
                cmd = [sys.executable]
            proc = subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                                  preexec_fn=preexec_fn)
        if proc.returncode == 0:  # DeepSpeed's CPU allreduce buffers of this run: unlinked by every rank
            leaked = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
            assert not leaked, f"the run left {[p.name for p in leaked]} in /dev/shm"
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:  # else the free port was taken meanwhile
            return proc
    return proc


# ------------------------------------------------------------------ fixtures shared by the session's workers
# The suite runs in pytest-xdist workers (the README's test command: `-n 2 --dist loadfile`), each a session of its
# own. A session fixture that launches training or converts a model is made ONCE for all of them: the first worker
# that needs it makes it under a file lock in the folder the workers share, the others wait and read it.
def _shared_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()  # under xdist: <session>/popen-gwN, one per worker
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def shared_name(*parts) -> str:
    """A folder name for a fixture's arguments (recipes may be paths): readable, and unique by a hash."""
    readable = "_".join(Path(str(p)).stem if "/" in str(p) else str(p) for p in parts)
    return f"{readable[:80]}_{hashlib.sha1(repr(parts).encode()).hexdigest()[:10]}"


def once(tmp_path_factory, name: str, make) -> Path:
    """The folder `name` with what make(folder) put there, made by the first worker that asks. A failed make leaves
    no marker, so the next asker tries again (and reports the same failure in its own test)."""
    root = _shared_root(tmp_path_factory)
    folder, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


# The uninterrupted run that resume, preemption and fault-injection tests compare against: checkpoints, the sample
# prompt and TensorBoard do not change a loss (the resume tests prove it), so one run per recipe serves them all.
UNINTERRUPTED = ["training.schedule.warmup_steps=2", "logging.interval=1", "checkpoint.interval=1000",
                 "logging.sample_prompt=", "logging.tensorboard=false"]


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """uninterrupted(recipe, steps, nproc=2) -> the metrics of `steps` steps in one go, launched once per session."""
    runs: dict[tuple[str, int, int], list[dict]] = {}

    def get(recipe: str, steps: int, nproc: int = 2) -> list[dict]:
        if (recipe, steps, nproc) not in runs:  # the recipe is a name or a path
            out = once(tmp_path_factory, shared_name("uninterrupted", recipe, steps, nproc),
                       lambda out: launch(recipe, [f"training.steps={steps}", *UNINTERRUPTED], nproc=nproc,
                                          out_dir=out))
            runs[recipe, steps, nproc] = read_metrics(out)
        return runs[recipe, steps, nproc]

    return get


@pytest.fixture(scope="session")
def stopped(tmp_path_factory):
    """stopped(recipe, steps, stop, nproc=2, extra=()) -> the output folder of the same run as `uninterrupted`'s, ended by
    training.stop_at_step=`stop` with a checkpoint there; launched once per session. Shared: a test that resumes
    it or writes into it works on a copy (shutil.copytree)."""
    runs: dict[tuple[str, int, int, int], Path] = {}

    def get(recipe: str, steps: int, stop: int, nproc: int = 2, extra: tuple[str, ...] = ()) -> Path:
        key = (recipe, steps, stop, nproc, *extra)  # extra: overrides that do not change a loss (checkpoint.format)
        if key not in runs:
            runs[key] = once(tmp_path_factory, shared_name("stopped", *key),
                             lambda out: launch(recipe, [f"training.steps={steps}", *UNINTERRUPTED,
                                                         f"training.stop_at_step={stop}", *extra],
                                                nproc=nproc, out_dir=out))
        return runs[key]

    return get


PARITY_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)]  # where the tiny4l model is probed


def probe_many(tp: int, pp: int, vpp: int, jobs: dict, folder) -> None:
    """Writes folder/NAME.pt = {"ids", "logits"} of Megatron's model at tp x pp x vpp for each job name ->
    (hf_path, megatron checkpoint or None), all from one launch (megatron_logits calls this once per layout)."""
    spec = [{"hf": str(hf), "ckpt": str(ckpt) if ckpt else None, "out": str(folder / f"{name}.pt")}
            for name, (hf, ckpt) in jobs.items()]
    (folder / "jobs.json").write_text(json.dumps(spec))
    probe = REPO / "tests" / "megatron_logits_probe.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp), "--master_port",
           str(free_port()), str(probe), "--jobs", str(folder / "jobs.json"), str(tp), str(pp), str(vpp)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]


@pytest.fixture(scope="session")
def megatron_logits(tmp_path_factory, tiny4l_hf_checkpoint):
    """megatron_logits(tp, pp, vpp) -> {model: {"ids", "logits"}} of Megatron's model at that layout, for every
    model the suite checks there, from ONE probe launch per layout (tests/megatron_logits_probe.py --jobs):
    "tiny4l" from its Hugging Face checkpoint (test_megatron_parity), and "untied" / "tied" from the converted
    Megatron checkpoints of tests/convert_chains.py where that chain has the layout (test_convert_layouts)."""
    from convert_chains import CHAIN, chain  # lazy: builds models with transformers

    done: dict[tuple[int, int, int], dict] = {}

    def get(tp: int, pp: int, vpp: int) -> dict:
        import torch  # lazy: collection stays light

        layout = (tp, pp, vpp)
        names = (["tiny4l"] if layout in PARITY_LAYOUTS else []) + (["untied", "tied"] if layout in CHAIN else [])
        if layout not in done:
            def make(folder: Path) -> None:
                jobs = {}
                if "tiny4l" in names:
                    jobs["tiny4l"] = (tiny4l_hf_checkpoint, None)
                if layout in CHAIN:
                    for name, tied in (("untied", False), ("tied", True)):
                        c = chain(tied, tmp_path_factory)
                        jobs[name] = (c["hf"], c[layout])
                probe_many(tp, pp, vpp, jobs, folder)

            folder = once(tmp_path_factory, "logits_tp{}_pp{}_vpp{}".format(*layout), make)
            done[layout] = {name: torch.load(folder / f"{name}.pt", weights_only=True) for name in names}
        return done[layout]

    return get


def slurm_available() -> str | None:
    """None when this machine can run a throw-away Slurm cluster, else why not."""
    import shutil

    missing = [t for t in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; .ci/run does)"
    if os.geteuid() != 0:
        return "the throw-away cluster runs its daemons as root"
    return None


def _deselect(config, items, marker: str) -> None:
    chosen = [item for item in items if item.get_closest_marker(marker)]
    if chosen:
        config.hook.pytest_deselected(items=chosen)
        items[:] = [item for item in items if not item.get_closest_marker(marker)]


# The files that take longest (measured with --durations=0), longest first. pytest-xdist hands out whole files in
# collection order (`--dist loadfile --no-loadscope-reorder`, pyproject.toml): starting with the long ones leaves
# short files for the end, so no worker runs alone for minutes while the other is done. The Slurm file leads: its
# tests share one cluster and run one after another on one worker. test_zero_parity, the first file whose runs
# offload (DeepSpeed's CPU Adam and async I/O ops), comes after a few others: by then the ops are built.
LONGEST_FIRST = ["test_slurm_cluster", "test_megatron_parity", "test_fault_injection", "test_megatron_resume",
                 "test_deepspeed_convert", "test_convert_layouts", "test_resume", "test_moe", "test_zero_parity",
                 "test_planted_pickles", "test_bench_overhead", "test_deepspeed_plain", "test_preemption",
                 "test_megatron_torch_dist", "test_bench_convert", "test_families", "test_plan_deepspeed_states",
                 "test_plan_megatron_states", "test_claims_convert", "test_megatron_native", "test_train_e2e"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA GPUs: on a machine without them they are deselected (reported as such, never
    counted as passed); `pytest -m gpu` on a GPU machine runs them. Tests marked `slurm` need Slurm installed
    and root: deselected otherwise, unless TOOLKIT_REQUIRE_SLURM=1 (set by .ci/run), which makes a missing Slurm
    an error instead. The long files go first (LONGEST_FIRST); the order within a file is kept."""
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), order[id(item)]))

    if not torch.cuda.is_available():
        _deselect(config, items, "gpu")
    why = slurm_available()
    if why and any(item.get_closest_marker("slurm") for item in items):
        if os.environ.get("TOOLKIT_REQUIRE_SLURM") == "1":
            raise pytest.UsageError(f"TOOLKIT_REQUIRE_SLURM=1 but Slurm cannot run here: {why}")
        _deselect(config, items, "slurm")


_op_builder: subprocess.Popen | None = None


def pytest_collection_finish(session):
    """With slow tests selected, build DeepSpeed's JIT ops in the background as the session starts
    (tests/build_ops.py), one builder per run. At normal priority: with the suite in two workers no core is idle,
    and a build niced to the lowest priority starved while a test that needed its op waited past its timeout."""
    global _op_builder
    first_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    slow = any(i.get_closest_marker("slow") for i in session.items)
    if first_worker and slow and os.environ.get("TOOLKIT_NO_OP_PREBUILD") != "1":
        _op_builder = subprocess.Popen([sys.executable, str(REPO / "tests" / "build_ops.py")], cwd=REPO,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env={**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)})


def pytest_sessionfinish(session):
    if _zygote is not None:
        _zygote.close()
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its launches go to the controller's summary
        session.config.workeroutput["launches"] = json.dumps(LAUNCHES)
    if _op_builder is not None and _op_builder.poll() is None:
        # the builder (its handler raises SystemExit, so torch's finally removes the lock), ninja and the compilers,
        # which ninja starts in process groups of their own
        signal_process_tree(_op_builder.pid, signal.SIGTERM)
        try:
            _op_builder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            signal_process_tree(_op_builder.pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name their data relative to the repository root


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _random_hf_checkpoint(folder: Path, preset: str) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    from toolkit.model import to_hf_config
    from toolkit.recipe import load_recipe

    recipe = load_recipe("tiny_zero0", [f"model.preset={preset}"])
    torch.manual_seed(7)
    LlamaForCausalLM(to_hf_config(recipe.model)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory) -> Path:
    """A randomly initialised tiny Llama (2 layers, GQA 4/2) as a Hugging Face safetensors folder: the shared
    initial weights."""
    return once(tmp_path_factory, "tiny_hf", lambda folder: _random_hf_checkpoint(folder, "tiny"))


@pytest.fixture(scope="session")
def tiny4l_hf_checkpoint(tmp_path_factory) -> Path:
    """The same with 4 layers (hidden 128, GQA 8/4), enough for pipeline 2 x 2 virtual chunks."""
    return once(tmp_path_factory, "tiny4l_hf", lambda folder: _random_hf_checkpoint(folder, "tiny-4l"))


def write_corpus(path: Path, words: list[str], docs: int, seed: int) -> Path:
    """A JSON-lines corpus of `docs` documents made of `words` only (so each source has its own tokens)."""
    import random

    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 80)))}) + "\n"
                            for _ in range(docs)))
    return path


BLEND_BASES = (("deepspeed", "tiny_zero2"), ("megatron", "tiny_dp2_distopt"))


def _make_blend(root: Path) -> None:
    from toolkit.cli import main

    a = write_corpus(root / "a.jsonl", ["cat", "dog", "mat", "sun", "tree", "bird", "happy", "little"], 300, 1)
    b = write_corpus(root / "b.txt", [str(n) for n in range(10, 60)], 200, 2)
    b.write_text("\n".join(json.loads(line)["text"] for line in b.read_text().splitlines()) + "\n")
    tok = str(REPO / "recipes/data/demo_tokenizer")
    assert main(["data", "prepare", "--input", str(a), "--output", str(root / "a"), "--tokenizer", tok,
                 "--workers", "2", "--quiet"]) == 0
    assert main(["data", "prepare", "--input", str(b), "--output", str(root / "b"), "--tokenizer", tok,
                 "--quiet"]) == 0
    held = write_corpus(root / "held.jsonl", ["cat", "dog", "sun", "tree", *map(str, range(10, 30))], 60, 3)
    assert main(["data", "prepare", "--input", str(held), "--output", str(root / "held"), "--tokenizer", tok,
                 "--quiet"]) == 0
    evals = {"deepspeed": "{interval: 4, batches: 1, split: 0.1}",
             "megatron": f"{{interval: 3, batches: 2, blend: [{{path: {root / 'held'}}}]}}"}
    for backend, base in BLEND_BASES:
        (root / f"{base}_blend.yaml").write_text(
            f"base: {base}\nname: {base}_blend\nmodel: {{preset: tiny}}\n"
            f"training: {{steps: 8, schedule: {{warmup_steps: 2}}}}\n"
            f"data:\n  seq_len: 64\n  blend:\n  - {{path: {root / 'a'}, weight: 0.7}}\n"
            f"  - {{path: {root / 'b'}, weight: 0.3}}\neval: {evals[backend]}\n")


@pytest.fixture(scope="session")
def prepared_blend(tmp_path_factory) -> dict:
    """Two sources prepared with `toolkit data prepare` (letters-only words and numbers-only words), a held-out
    third ("held": both kinds of words), and recipe files that blend a and b 0.7/0.3 on the tiny model and
    evaluate: "recipe" (tiny_zero2's layout; eval.split 0.1 of each source's documents, every 4 steps),
    "recipe_megatron" (tiny_dp2_distopt's; eval.blend of "held", every 3 steps); "a", "b": the prefixes."""
    root = once(tmp_path_factory, "blend", _make_blend)
    recipes = {backend: root / f"{base}_blend.yaml" for backend, base in BLEND_BASES}
    return {"a": str(root / "a"), "b": str(root / "b"), "held": str(root / "held"), "corpus_a": root / "a.jsonl",
            "corpus_b": root / "b.txt", "root": root, "recipe": str(recipes["deepspeed"]),
            "recipe_megatron": str(recipes["megatron"])}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: half the cores (a training launch runs 2-4 ranks), at least 2 (one worker's single-process tests
    leave a core idle), at most 8."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: collect each worker's launches for the summary."""
    LAUNCHES.extend(tuple(x) for x in json.loads(getattr(node, "workeroutput", {}).get("launches", "[]")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """TOOLKIT_TEST_CPU_LOG=FILE: append each test's wall and CPU seconds (this process and the children it waited for:
    launches, CLI runs, their ranks) as JSON lines: where the suite's CPU goes, which wall times under load hide."""
    path = os.environ.get("TOOLKIT_TEST_CPU_LOG")
    if not path:
        yield
        return
    warm = _zygote.cpu if _zygote else 0.0  # the warm launcher's ranks are its children, not ours
    before, start = os.times(), time.monotonic()
    yield
    after = os.times()
    cpu = sum(getattr(after, f) - getattr(before, f) for f in ("user", "system", "children_user", "children_system"))
    cpu += (_zygote.cpu if _zygote else 0.0) - warm
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - start, 2), "cpu": round(cpu, 2)})
                + "\n")


def pytest_terminal_summary(terminalreporter):
    """How many training launches the run made and their share of its time (docs/testing.md: where time goes)."""
    if LAUNCHES:
        by_ranks: dict[int, list[float]] = {}
        for _, _, nproc, seconds in LAUNCHES:
            by_ranks.setdefault(nproc, []).append(seconds)
        parts = ", ".join(f"{len(v)} x {n} rank(s) {sum(v):.0f} s" for n, v in sorted(by_ranks.items()))
        terminalreporter.write_line(f"training launches (tests/conftest.py launch): {len(LAUNCHES)}, "
                                    f"{sum(s for *_, s in LAUNCHES):.0f} s in all: {parts}")
