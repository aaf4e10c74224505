"""No code runs from a checkpoint: a pickle whose payload would create a file is planted in every kind of .pt file the
toolkit (or DeepSpeed and Megatron on its behalf) reads, and each load is refused with an error naming the file,
and the file the payload would create never appears.

Places: a DeepSpeed checkpoint's model-states and optim-states files (read by `toolkit convert` and, on resume, by
DeepSpeed's own engine), the toolkit's per-rank toolkit_rank*.pt, Megatron-LM's model_optim_rng.pt, and the Megatron
backend's distributed-optimizer files (optim_*.pt, and distopt_*.pt read by Megatron's load_parameter_state)."""
from __future__ import annotations

import ast
import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, run_ranks

from toolkit.format import manifest, safe_load
from toolkit.errors import ToolkitError


class RunsShell:
    """Unpickling calls os.system("touch MARKER")."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class OpensFile:
    """Unpickling calls open(MARKER, "w"), which creates the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


PAYLOADS = {"os.system": RunsShell, "open": OpensFile}
GLOBAL = {"os.system": "posix.system", "open": "io.open"}  # what the pickle names


def refused(path: Path, payload: str) -> str:
    return (f"{path} holds a pickled {GLOBAL[payload]}, which is neither a tensor nor a known checkpoint record: "
            "refused rather than unpickled (loading it could run code). Use checkpoints from sources you trust, or "
            "re-save this one from its original training run")


def plant(path: Path, payload: str, marker: Path, content: dict | None = None) -> None:
    """Write `content` (default: a few tensors) with the payload inside, as a stranger's file would hold it."""
    state = dict(content or {"module": {"w": torch.zeros(3)}, "ds_version": "0.19.8"})
    state["extra"] = {"note": PAYLOADS[payload](marker)}
    torch.save(state, path)


def rehash(tag_dir: Path) -> None:
    """Make the manifest match the planted files: a downloaded checkpoint comes with a manifest of its own."""
    meta = json.loads((tag_dir / "toolkit_meta.json").read_text())
    meta["files"] = manifest.complete(tag_dir, {})
    (tag_dir / "toolkit_meta.json").write_text(json.dumps(meta))


@pytest.fixture(params=sorted(PAYLOADS))
def payload(request):
    return request.param


def test_every_torch_load_in_the_toolkit_is_weights_only():
    """The grep, as a test: every torch.load call in toolkit/ passes weights_only=True literally."""
    calls = []
    for path in sorted((REPO / "toolkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}",
                              isinstance(flag, ast.Constant) and flag.value is True))
    assert calls and all(ok for _, ok in calls), calls


def test_deepspeed_files_are_refused_by_convert_and_by_deepspeeds_own_loader(payload, tmp_path):
    """DeepSpeed's engine.load_checkpoint reads these with torch.load(weights_only=False); while the toolkit loads a
    checkpoint it forces weights-only loading."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from toolkit.checkpoint.deepspeed_io import load_rank_file

    marker = tmp_path / "pwned"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        path = tmp_path / name
        plant(path, payload, marker)
        with pytest.raises(ToolkitError) as err:
            load_rank_file(path)  # toolkit convert / inspect
        assert str(err.value) == refused(path, payload)
        with pytest.raises(ToolkitError) as err, safe_load.weights_only_everywhere(tmp_path, [name]):
            TorchCheckpointEngine().load(str(path), map_location="cpu")  # what engine.load_checkpoint calls
        assert str(err.value) == refused(path, payload)
        assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored after the block
    assert not marker.exists()


def test_megatron_distributed_optimizer_files_are_refused(payload, tmp_path):
    """optim_*.pt is read by the toolkit; distopt_*.pt by Megatron's own load_parameter_state (torch.load(filename)),
    run here for real on a stand-in optimizer object."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    marker = tmp_path / "pwned"
    native = tmp_path / "optim_tp00_pp000.pt"
    plant(native, payload, marker, {"optimizer": {"state": {}}})
    with pytest.raises(ToolkitError) as err:
        safe_load.load(native)
    assert str(err.value) == refused(native, payload)

    distopt = tmp_path / "distopt_tp00_pp000.pt"
    plant(distopt, payload, marker, {"buckets_coalesced": True})

    class StandIn:
        is_stub_optimizer = False
        data_parallel_group = type("G", (), {"rank": staticmethod(lambda: 0)})()

        def load_parameter_state_from_dp_zero(self, state_dict, update_legacy_format=False):
            raise AssertionError("the planted state must never get this far")

    with pytest.raises(ToolkitError) as err, safe_load.weights_only_everywhere(tmp_path, [distopt.name]):
        DistributedOptimizer.load_parameter_state(StandIn(), str(distopt))
    assert str(err.value) == refused(distopt, payload)
    assert not marker.exists()


def test_toolkit_rank_file_is_refused_on_resume(payload, tmp_path):
    from test_checkpoint_integrity import StandIn

    from toolkit.train import checkpoint as ckpt

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / '.store'}", rank=0, world_size=1)
    try:
        tag_dir = ckpt.save(StandIn(), tmp_path / "ckpt", 1, {}, {"layout": {"dp": 1}})
        marker = tmp_path / "pwned"
        rank_file = tag_dir / "toolkit_rank00000.pt"
        state = torch.load(rank_file, weights_only=False)  # our own file: trusted
        plant(rank_file, payload, marker, state)
        rehash(tag_dir)
        assert ckpt.find_resume(tmp_path / "ckpt", "auto") == tag_dir  # the manifest matches: only the load can tell
        backend = StandIn()
        with pytest.raises(ToolkitError) as err:
            ckpt.load(backend, tag_dir, {"dp": 1})
        assert str(err.value) == f"checkpoint {tag_dir}: {refused(rank_file, payload)}"
        assert backend.loaded is None and not marker.exists()
        from toolkit.checkpoint.inspect import inspect  # called it complete: its manifest matches (2026-12-07)

        report = inspect(tag_dir)
        assert not report["complete"] and report["problems"] == [refused(rank_file, payload)]
        assert not marker.exists()
    finally:
        dist.destroy_process_group()


def test_megatron_lm_file_is_refused_by_convert_and_inspect(payload, tmp_path):
    from test_convert import VOCAB, hf_model_for, write_megatron_lm

    root = tmp_path / "mlm"
    write_megatron_lm(root, hf_model_for())
    rank_file = root / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    marker = tmp_path / "pwned"
    plant(rank_file, payload, marker, torch.load(rank_file, weights_only=False))
    for args in (["convert", str(root), str(tmp_path / "hf"), "--to", "hf", "--vocab-size", str(VOCAB)],
                 ["inspect", str(root)]):
        proc = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 2 and proc.stderr == f"error: {refused(rank_file, payload)}\n"
    assert not marker.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mlm"]


# ------------------------------------------------------------------ real checkpoints, resumed by recipes/train.py
RUN = ["parallel.world_size=1", "model.preset=tiny", "training.steps=2", "checkpoint.interval=1",
       "training.schedule.warmup_steps=1", "logging.sample_prompt="]


def _train(recipe: str, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    sets = [f"output_dir={out}", *RUN, *extra]
    args = [a for s in sets for a in ("--set", s)]
    return run_ranks(["recipes/train.py", "--recipe", recipe, *args], 1, dict(os.environ), "python")


@pytest.mark.slow
@pytest.mark.parametrize("recipe, victim", [
    ("tiny_zero1", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("tiny_zero3", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("tiny_dp2_distopt", "distopt_tp00_pp000.pt"),
])
def test_resume_from_a_planted_real_checkpoint_is_refused(recipe, victim, tmp_path):
    out = tmp_path / "run"
    first = _train(recipe, out, ["training.stop_at_step=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    tag_dir = out / "checkpoints" / "step_00000001"
    marker = tmp_path / "pwned"
    path = tag_dir / victim
    plant(path, "os.system", marker, torch.load(path, weights_only=False))  # our own file: trusted
    rehash(tag_dir)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    proc = _train(recipe, out, [])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: checkpoint {tag_dir}: {refused(path, 'os.system')}\n" in proc.stderr
    assert not marker.exists() and sorted(p.name for p in (out / "checkpoints").iterdir()) == before
