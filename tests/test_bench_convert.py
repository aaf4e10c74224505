"""bench/convert.py runs end to end in its tiny configuration, so the benchmark cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_bench_convert_tiny(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "bench/convert.py", "--sizes", "tiny", "--workdir", str(tmp_path),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["cp", "hf->tp2pp2", "tp2pp2->tp4pp1", "tp4pp1->hf", "hf->torch_dist",
                                         "torch_dist->megatron_lm", "megatron_lm->hf", "cp (again)"]
    assert all(r["gib"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    assert all(r["stream_s"] is not None for r in rows[1:-1])
    assert proc.stdout.count(" of cp ") == 8 and "peak RSS" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # the work folder is cleaned up
