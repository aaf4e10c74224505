"""bench/overhead.py runs end to end in its smallest configuration, so the benchmark cannot rot. Its numbers are
checked for form only: timing targets are not asserted in tests."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_bench_overhead_smallest(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "bench/overhead.py", "--reps", "1", "--warmup", "1", "--steps", "2",
                           "--workdir", str(tmp_path), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    launches = result["launches"]
    assert sorted((r["backend"], r["kind"]) for r in launches) == [
        ("deepspeed", "raw"), ("deepspeed", "toolkit"), ("megatron", "raw"), ("megatron", "toolkit")]
    for r in launches:
        assert len(r["step_times_s"]) == 2
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("step_s", "step_mean_s", "step_cpu_s", "first_step_s",
                                                              "first_step_cpu_s"))
        assert r["step_min_s"] <= r["step_s"] <= r["step_max_s"]
        assert r["first_step_s"] > r["step_s"]  # start-up and imports count
    for backend, s in result["summary"].items():
        for m in ("step_s", "step_mean_s", "step_cpu_s"):
            assert s[m]["ratio"]["min"] <= s[m]["ratio"]["median"] <= s[m]["ratio"]["max"]
            assert 0 < s[m]["ratio"]["median"] < math.inf
        assert math.isfinite(s["first_step_s"]["diff"]["median"])
        # same seed, data and model: both sides trained the same thing
        assert s["last_loss"]["toolkit"] == pytest.approx(s["last_loss"]["raw"], rel=1e-4), backend
    assert proc.stdout.count("  ratio ") == 6 and proc.stdout.count("first step s") == 2
    assert [p.name for p in tmp_path.iterdir()] == ["overhead.json"]  # the work folder is cleaned up
