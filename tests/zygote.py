"""A warm launcher for the suite's training runs: ranks forked from a process that has already imported the libraries.

A two-rank tiny run spends most of its CPU importing torch, DeepSpeed, Megatron-Core, transformers and datasets, once
in the launcher and once per rank (about 7 of the 12 CPU-seconds of each rank on the 2-core machine). This process
imports them once per pytest worker; `conftest.launch` then asks it for each `torchrun`-style run, and it forks one
child per rank. A child becomes what torchrun would have started: the run's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; rank 0 hosts the store), `sys.argv`, working directory and output
files, then runs `recipes/train.py` as `__main__` and exits through this module's top level, so the interpreter shuts
down as after `python recipes/train.py` (atexit handlers, finalizers, flushed streams). Every rank is still its own
process, talking gloo to the others.

Only third-party libraries are imported here, never `toolkit` (a few of its modules read the environment at import,
and the code under test must be the code each run imports). The real launchers keep their own tests: torchrun in the
preemption and fault-injection tests, DeepSpeed's launcher in test_train_e2e and the DeepSpeed-launched cases,
srun in the Slurm tests, and bench/gpu.py's launches.

Protocol, one JSON object per line: a request on stdin ({argv, env, cwd, nproc, stdout, stderr}); on stdout, first
{"pgid": ...} (the run's process group, which the caller kills on a timeout), then {"rc": ..., "ranks": [...], "cpu": seconds}.
Like torchrun, when a rank fails the others are stopped (SIGTERM, then SIGKILL after 30 s) and the run returns 1.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.utils.tensorboard", "safetensors.torch", "deepspeed",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
           "megatron.core.dist_checkpointing", "transformers", "transformers.models.llama.modeling_llama", "datasets")
GRACE_S = 30


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library missing: the runs that need it import (and report) it themselves
            pass


def _setpgid(pid: int, pgid: int) -> None:
    try:
        os.setpgid(pid, pgid)
    except OSError:  # the other side set it already, or the rank is gone
        pass


def _become_rank(req: dict, rank: int, pgid: int) -> int:
    """In the forked child: take on the run's identity, run the script, return its exit code."""
    _setpgid(0, pgid)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, req["stderr"], os.O_WRONLY | os.O_APPEND)):
        new = os.open(path, flags)
        os.dup2(new, fd)
        os.close(new)
    sys.stdin = open(0, closefd=False)
    os.environ.clear()
    os.environ.update(req["env"])
    if not req["plain"]:  # what torchrun sets; a plain `python script.py` run (plain) gets none of it
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=str(req["nproc"]), LOCAL_WORLD_SIZE=str(req["nproc"]),
                          ROLE_WORLD_SIZE=str(req["nproc"]), MASTER_ADDR="127.0.0.1")
    os.chdir(req["cwd"])
    script = os.path.abspath(req["argv"][0])
    sys.argv = [script, *req["argv"][1:]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else _report(e.code))
    return 0


def _report(message) -> int:
    print(message, file=sys.stderr)
    return 1


def _wait(pids: list[int]) -> tuple[list[int], float]:
    """The ranks' exit codes, and the CPU seconds they used."""
    codes: dict[int, int] = {}
    cpu = 0.0
    stop_at = None
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            cpu += usage.ru_utime + usage.ru_stime
            if codes[pid] != 0 and stop_at is None:  # as torchrun does: a failed rank stops the run
                stop_at = time.monotonic() + GRACE_S
                for p in pids:
                    if p not in codes:
                        _kill(p, signal.SIGTERM)
            continue
        if stop_at is not None and time.monotonic() > stop_at:
            for p in pids:
                if p not in codes:
                    _kill(p, signal.SIGKILL)
        time.sleep(0.05)
    return [codes[p] for p in pids], cpu


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(replies) -> int | None:
    """The request loop. Returns None in this process at end of input; in a forked rank, the rank's exit code."""
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids: list[int] = []
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                replies.close()
                return _become_rank(req, rank, pids[0] if pids else 0)
            _setpgid(pid, pids[0] if pids else pid)  # both sides set it, so neither races the other
            pids.append(pid)
        replies.write(json.dumps({"pgid": pids[0]}) + "\n")
        codes, cpu = _wait(pids)
        rc = codes[0] if req["plain"] else int(any(codes))  # torchrun returns 1 for any failed rank
        replies.write(json.dumps({"rc": rc, "ranks": codes, "cpu": cpu}) + "\n")
    return None


class Client:
    """The pytest side: one warm process per pytest worker, started on its first run, restarted when the environment
    its imports read changes."""

    IMPORT_ENV = ("PYTHONPATH", "HF_", "TRANSFORMERS_", "TORCH", "DS_", "OMP_", "MKL_", "CUDA_", "TOKENIZERS_")

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.key: tuple | None = None
        self.cpu = 0.0  # CPU seconds of every rank it ran

    def _key(self, env: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in env.items() if k.startswith(self.IMPORT_ENV)))

    def _start(self, env: dict, cwd: str) -> subprocess.Popen:
        key = self._key(env)
        if self.proc is not None and (self.key != key or self.proc.poll() is not None):
            self.close()
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=cwd, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, start_new_session=True)
            self.key = key
        return self.proc

    def _reply(self, proc: subprocess.Popen, deadline: float) -> dict | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                return None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the warm launcher (tests/zygote.py) died")
            return json.loads(line)

    def run(self, argv: list[str], env: dict, cwd: str, nproc: int, timeout: float, workdir: str,
            plain: bool = False) -> subprocess.CompletedProcess:
        out, err = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        for path in (out, err):
            open(path, "w").close()
        proc = self._start(env, cwd)
        proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd, "nproc": nproc, "plain": plain,
                                     "stdout": out, "stderr": err}) + "\n")
        proc.stdin.flush()
        started = self._reply(proc, time.monotonic() + 300)  # the preload (first run only) is not the run's time
        if started is None:
            self.close()
            raise RuntimeError("the warm launcher (tests/zygote.py) did not start the run within 300 s")
        pgid, deadline = started["pgid"], time.monotonic() + timeout
        done = self._reply(proc, deadline)
        if done is None:
            _killpg(pgid)
            done_late = self._reply(proc, time.monotonic() + 60)
            self.cpu += done_late["cpu"] if done_late else 0.0
        else:
            self.cpu += done["cpu"]
        text = [open(p, errors="replace").read() for p in (out, err)]
        if done is None:
            raise subprocess.TimeoutExpired(argv, timeout, output=text[0], stderr=text[1])
        return subprocess.CompletedProcess(argv, done["rc"], text[0], text[1])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the replies' own pipe: what the libraries print goes to fd 1
    os.dup2(2, 1)
    _preload()
    sys.exit(serve(replies))
