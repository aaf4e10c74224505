"""bench/gpu.py: its tiny configuration runs every case end to end (on CPU here), and on a GPU machine the real
1.1B benchmark reaches a positive MFU with a peak memory close to what `toolkit plan` predicts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

CASES = ["deepspeed-zero1", "deepspeed-zero3", "megatron-tp1"]

# Measured peak / planned bytes. The planner counts model states exactly and activations per op; what it leaves
# out is transient: the fp32 upcast of the logits for the loss and its gradient (2 x 1.95 GiB at micro-batch 4 x
# 4096 tokens x 32000 ids, against a ~55 GiB plan), cuBLAS workspaces, allocator rounding. 20% either way holds
# those and still fails an accounting that misses a whole term (the optimizer moments alone are 15% of the plan).
MEMORY_TOLERANCE = 0.20


def _bench(tmp_path, *extra, timeout):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--workdir", str(tmp_path / "work"), "--out", str(out),
                           *extra], check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    result = json.loads(out.read_text()) if out.exists() else {"cases": []}
    failed = [f"{c['case']}: {c['error']}\n{c.get('log_tail', '')}" for c in result["cases"] if not c["ok"]]
    assert proc.returncode == 0, "\n".join(failed) or proc.stdout[-4000:] + proc.stderr[-4000:]
    return result, proc.stdout


@pytest.mark.slow
def test_bench_gpu_tiny_runs_every_case(tmp_path):
    result, stdout = _bench(tmp_path, "--tiny", timeout=300)
    assert [c["case"] for c in result["cases"]] == CASES
    assert result["warmup_steps"] == 1 and result["measured_steps"] == 1
    on_gpu = result["device"]["cuda"]
    for c in result["cases"]:
        assert c["ok"], c
        assert c["measured_steps"] == 1 and c["tokens_per_s"] > 0 and c["tflops_per_gpu"] > 0
        assert c["plan"]["gpu_gib"] > 0 and c["plan"]["step_s"] > 0, c.get("plan_error")
        assert (c["mfu"] is not None) == on_gpu and (c["peak_mem_gib"] is not None) == on_gpu
        assert c["peak_mem_phase"] == "training steps"  # read before the final checkpoint save
        launcher = "deepspeed --num_gpus 1 " if c["case"].startswith("deepspeed") else "torchrun --nproc_per_node 1 "
        assert c["command"].startswith(launcher + "recipes/train.py --recipe ")
        assert not (tmp_path / "work" / c["case"] / "checkpoints").exists()  # deleted after each case
        assert c["label"] in stdout
    assert "| case | tokens/s |" in stdout


@pytest.mark.gpu
def test_bench_gpu_default_on_one_gpu(tmp_path):
    """The real benchmark (1.1B, seq 4096, bf16; about 5 minutes on an H100/H200)."""
    result, stdout = _bench(tmp_path, timeout=900)
    print(stdout)
    assert [c["case"] for c in result["cases"]] == CASES
    for c in result["cases"]:
        assert c["ok"], c
        assert c["mfu"] > 0 and c["peak_mem_gib"] > 0, c
        if c["plan_models_run"]:  # the plan models Transformer Engine layers for Megatron, not the local spec
            assert abs(c["mem_vs_plan"] - 1) <= MEMORY_TOLERANCE, (c["label"], c["peak_mem_gib"], c["plan"])
    assert result["wall_s"] < 8 * 60
