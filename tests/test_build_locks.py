"""A build lock left by a killed DeepSpeed op build: torch would wait for it forever on the next load of that op.
The toolkit names the file and refuses to start instead; a lock a live build holds is left alone."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import REPO

from toolkit.proc import abandoned_build_locks


def _lock(ext, op: str, age_s: float):
    lock = ext / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - age_s
    os.utime(lock, (old, old))
    return lock


def test_only_locks_nobody_holds_are_abandoned(tmp_path):
    dead = _lock(tmp_path, "cpu_adam", 60)
    live = _lock(tmp_path, "async_io", 60)
    fresh = _lock(tmp_path, "shm_comm", 0)  # a build may have just taken it: not judged yet
    fd = os.open(live, os.O_RDONLY)  # what torch's FileBaton does while it builds
    try:
        assert abandoned_build_locks(tmp_path) == [dead]
    finally:
        os.close(fd)
    assert abandoned_build_locks(tmp_path) == [live, dead]
    assert fresh.exists()


def test_a_deepspeed_run_refuses_to_wait_on_an_abandoned_lock(tmp_path):
    ext = tmp_path / "ext"
    lock = _lock(ext, "deepspeed_shm_comm", 60)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "recipes/train.py", "--recipe", "tiny_zero0", "--set", f"output_dir={out}"],
                          cwd=REPO, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {lock} was left by a DeepSpeed op build that was killed (no process holds it), and "
                      f"DeepSpeed would wait for it forever: delete it (rm {lock}) and start again"], proc.stderr[-2000:]
    assert not out.exists() and lock.exists()  # nothing created, the lock left for the user



def test_doctor_names_an_abandoned_lock(tmp_path, monkeypatch):
    from toolkit import doctor

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    found = {f.check: f for f in doctor.check_deepspeed_ops()}["op build locks"]
    assert found.status == doctor.OK and str(tmp_path) in found.detail
    lock = _lock(tmp_path, "cpu_adam", 60)
    found = {f.check: f for f in doctor.check_deepspeed_ops()}["op build locks"]
    assert found.status == doctor.FAIL and found.fix == f"delete {lock}"
