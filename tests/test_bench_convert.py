"""bench/convert.py runs end to end in its tiny configuration, so the benchmark cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_bench_convert_tiny(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "bench/convert.py", "--sizes", "tiny", "--workdir", str(tmp_path),
                           "--json", str(out), "--reps", "1", "--direct-io"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    steps = ["hf->tp2pp2", "tp2pp2->tp4pp1", "tp4pp1->hf", "hf->torch_dist", "torch_dist->megatron_lm",
             "megatron_lm->hf", "torch_dist->hf"]
    direct = [s for s in steps if not s.endswith(("tp2pp2", "tp4pp1"))]  # targets a toolkit checkpoint is not
    assert [r["step"] for r in rows] == ["cp", *(f"{s} no-verify" for s in steps),
                                         *(f"{s} no-verify O_DIRECT" for s in direct),
                                         *(f"{s} verify" for s in steps), "cp (again)"]
    assert all(r["gib"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    assert all(r["stream_s"] is not None and r["peak_anon_mib"] > 0 and {"read", "split", "write"} <= set(r["phases"])
               for r in rows[1:-1])
    assert all("verify" in r["phases"] for r in rows[13:20]) and not any("verify" in r["phases"] for r in rows[1:13])
    assert proc.stdout.count(" cp wall ") == 21 and "anon" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # the work folder is cleaned up


def test_bench_convert_refuses_a_missing_workdir_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "bench/convert.py", "--sizes", "tiny", "--workdir",
                           str(tmp_path / "absent")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--workdir" in proc.stderr.splitlines()[-1] and "create it first" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "absent").exists() and list(tmp_path.iterdir()) == []
