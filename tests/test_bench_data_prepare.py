"""bench/data_prepare.py runs end to end on a tiny generated corpus, so the benchmark cannot rot. Its numbers are
checked for form only (both tokenizations count the same tokens); throughput targets are not asserted in tests."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_bench_data_prepare_smallest(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/data_prepare.py", "--size", "100KB", "--workers", "2",
                           "--workdir", str(tmp_path), "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert 100 << 10 <= result["corpus_bytes"] < 110 << 10
    runs = result["runs"]
    assert set(runs) == {"prepare", "datasets.map"}
    assert runs["prepare"]["tokens"] == runs["datasets.map"]["tokens"] > 10_000
    for r in runs.values():
        assert r["tokens_per_s"] > 0 and r["peak_rss_mib"] > 50 and r["peak_tree_rss_mib"] >= r["peak_rss_mib"] * 0.9
    assert list(tmp_path.iterdir()) == [out]  # the corpus and outputs went with the temporary folder
