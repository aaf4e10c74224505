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
                           "--no-cache-warmup", "--workdir", str(tmp_path), "--json", str(out)],
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
        assert s["step_s"]["ratio_ci"] is None and "from one pair" in s["verdict"]  # one pair: no interval
    assert proc.stdout.count("  ratio ") == 6 and proc.stdout.count("first step s") == 2
    assert "cache warm-up" not in proc.stdout and proc.stdout.count(" verdict ") == 2
    assert [p.name for p in tmp_path.iterdir()] == ["overhead.json"]  # the work folder is cleaned up


def _overhead_module():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import overhead
    finally:
        sys.path.remove(str(REPO / "bench"))
    return overhead


def test_ratio_interval_is_a_t_interval_on_log_ratios():
    ov = _overhead_module()
    assert ov.ratio_interval([1.1]) is None
    ci = ov.ratio_interval([1.02, 1.02, 1.02])
    assert [ci[k] for k in ("geomean", "low", "high")] == pytest.approx([1.02] * 3)  # no spread, no width
    # a ratio and its inverse cancel; two pairs use t(1) = 12.706
    ci = ov.ratio_interval([1.1, 1 / 1.1])
    sem = math.log(1.1) * math.sqrt(2) / math.sqrt(2)  # stdev of (+l, -l) is l * sqrt(2); over sqrt(2) pairs
    assert ci["geomean"] == pytest.approx(1.0)
    assert ci["high"] == pytest.approx(math.exp(12.706 * sem)) and ci["low"] == pytest.approx(math.exp(-12.706 * sem))


def _summary(ratios, first_diff):
    ov = _overhead_module()
    return ov, {"step_s": {"ratio": {"median": ratios[0]}, "ratio_ci": ov.ratio_interval(ratios)},
                "first_step_s": {"diff": {"median": first_diff}}}


@pytest.mark.parametrize("ratios, first, expect", [
    ([1.00, 1.01, 0.99, 1.00], 0.2, ("target met", "first-step target met")),
    ([0.95, 1.10, 0.97, 1.06], 0.2, ("consistent with the target, not confirmed", "first-step target met")),
    ([1.08, 1.10, 1.09, 1.07], 2.0, ("target missed", "first-step target missed")),
])
def test_verdict_names_what_the_interval_shows(ratios, first, expect):
    ov, s = _summary(ratios, first)
    text = ov.verdict(s)
    assert all(e in text for e in expect), text
