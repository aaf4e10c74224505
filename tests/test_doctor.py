"""`toolkit doctor`: every finding has a status and, when not ok, a fix; the network, port and disk checks
catch the failures users hit (an interface that does not exist, loopback on a multi-node job, a port in use, a
disk too small for the recipe's checkpoints), and the exit status says whether anything failed."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import namedtuple

from conftest import REPO
from toolkit import doctor
from toolkit.recipe import load_recipe


def _by_check(findings, name):
    return [f for f in findings if f.check == name]


def test_every_finding_has_a_status_and_a_fix_when_not_ok():
    findings = doctor.run(load_recipe("tiny_zero3"))
    assert findings and all(f.status in (doctor.OK, doctor.INFO, doctor.WARN, doctor.FAIL) for f in findings)
    assert all(f.fix for f in findings if f.status in (doctor.WARN, doctor.FAIL))
    assert _by_check(findings, "torch")[0].status == doctor.OK  # the pinned version is what the suite runs on
    assert _by_check(findings, "checkpoint disk")[0].status == doctor.OK  # a tiny recipe's checkpoints fit


def test_nccl_interface_that_does_not_exist_fails_with_a_fix():
    (f,) = [x for x in doctor.check_network({"NCCL_SOCKET_IFNAME": "nosuchif0"}) if x.check == "NCCL_SOCKET_IFNAME"]
    assert f.status == doctor.FAIL and "matches none of this host's interfaces" in f.detail and "ip -br addr" in f.fix


def test_loopback_or_unset_interface_on_a_multi_node_job():
    (lo,) = _by_check(doctor.check_network({"NCCL_SOCKET_IFNAME": "lo"}, nodes=2), "NCCL_SOCKET_IFNAME")
    assert lo.status == doctor.FAIL and "loopback on a 2-node job" in lo.detail
    (unset,) = _by_check(doctor.check_network({}, nodes=4), "NCCL_SOCKET_IFNAME")
    assert unset.status == doctor.WARN and "TOOLKIT_NCCL_IFNAME" in unset.fix
    assert _by_check(doctor.check_network({}, nodes=1), "NCCL_SOCKET_IFNAME") == []  # one node: nothing to say
    (ok,) = _by_check(doctor.check_network({"NCCL_SOCKET_IFNAME": "lo"}, nodes=1), "NCCL_SOCKET_IFNAME")
    assert ok.status == doctor.OK


def test_master_port_in_use_is_reported():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        (f,) = _by_check(doctor.check_launch_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                                   "RANK": "0"}), "MASTER_PORT")
    assert f.status == doctor.FAIL and f"{port} is already in use" in f.detail


def test_launch_variables_that_no_rank_could_use_fail():
    """MASTER_PORT=99999 took doctor down with an OverflowError; garbage RANK/WORLD_SIZE were listed as [info]
    (a trial of 2026-12-07)."""
    found = doctor.check_launch_env({"MASTER_PORT": "99999", "RANK": "x", "WORLD_SIZE": "-3", "LOCAL_RANK": "0"})
    bad = {f.check: f.detail for f in found if f.status == doctor.FAIL}
    assert bad == {"MASTER_PORT": "'99999' is not a port, 1-65535", "RANK": "'x' is not a whole number from 0",
                   "WORLD_SIZE": "'-3' is not a whole number from 1"}
    (f,) = [f for f in doctor.check_launch_env({"RANK": "4", "WORLD_SIZE": "4"}) if f.status == doctor.FAIL]
    assert f.check == "RANK" and "is not below WORLD_SIZE 4" in f.detail
    assert [f for f in doctor.check_launch_env({"MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"})
            if f.status == doctor.FAIL] == []
    (f,) = [f for f in doctor.check_launch_env({"MASTER_ADDR": "nohost.invalid"}) if f.status == doctor.FAIL]
    assert f.check == "MASTER_ADDR" and f.detail.startswith("'nohost.invalid' does not resolve on this host")
    assert [f for f in doctor.check_launch_env({"MASTER_ADDR": "127.0.0.1", "RANK": "1", "WORLD_SIZE": "2"})
            if f.status == doctor.FAIL] == []


def test_disk_too_small_for_the_recipes_checkpoints(monkeypatch):
    recipe = load_recipe("llama7b_zero3")
    one = doctor.metrics.checkpoint_bytes(recipe)
    assert one == 6_738_415_616 * 14  # bf16 weights + fp32 master + two fp32 moments, per parameter
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda _: usage(0, 0, one // 2))
    (f,) = doctor.check_disk(recipe)
    assert f.status == doctor.FAIL and "one checkpoint is 87.9 GiB" in f.detail
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda _: usage(0, 0, one * 2))
    (f,) = doctor.check_disk(recipe)
    # keep=3 holds 4 checkpoints while saving: the run stops at its third save (a WARN until 2026-12-07)
    assert f.status == doctor.FAIL and "checkpoint.keep" in f.fix and "holds up to 4 at once" in f.detail
    assert doctor.check_disk(load_recipe("llama7b_zero3", ["training.steps=1000", "checkpoint.interval=1000"])
                             )[0].status == doctor.OK  # one save: one checkpoint is all it ever holds
    small = load_recipe("tiny_zero0")  # sizes below a GiB in MiB (they printed as 0.0 GiB)
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda _: usage(0, 0, 5 * 2**20))
    (f,) = doctor.check_disk(small)
    assert f.status == doctor.FAIL and "5.0 MiB free; one checkpoint is 10.0 MiB" in f.detail, f.detail
    ready = {x.check: x for x in doctor.readiness([f], small)}
    assert ready["ready: deepspeed backend, CPU rehearsal (gloo)"].detail.startswith("no, missing:")
    assert "checkpoint disk" in ready["ready: deepspeed backend, CPU rehearsal (gloo)"].detail


def test_what_deepspeed_builds_its_ops_in_and_the_nvme_folder_count_for_readiness(tmp_path, monkeypatch):
    """doctor said ready while the torch extensions cache was read-only (training then failed with a traceback) and
    while its own nvme_path check had failed (a trial of 2026-12-07)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ro / "ext"))
    monkeypatch.setattr("toolkit.proc.os.access", lambda p, mode: not str(p).startswith(str(ro)))  # root writes anyway
    (cache,) = [f for f in doctor.check_deepspeed_ops() if f.check == "extensions cache"]
    assert cache.status == doctor.FAIL and "TORCH_EXTENSIONS_DIR" in cache.fix
    nvme = doctor.Finding("nvme_path", doctor.FAIL, "cannot be created", "fix")
    ready = {x.check: x for x in doctor.readiness([cache, nvme], load_recipe("tiny_zero3_nvme"))}
    assert "extensions cache" in ready["ready: deepspeed backend, CPU rehearsal (gloo)"].detail
    assert "nvme_path" in ready["ready: deepspeed ZeRO-Infinity (nvme)"].detail


def test_host_memory_against_what_the_recipe_offloads():
    """doctor printed no host memory figure: a ZeRO-Offload recipe that toolkit plan says needs 114 GiB per node was
    "ready" on a 24 GiB machine (a trial of 2026-12-07). The need is toolkit plan's estimate, one fact in one place."""
    from toolkit.plan import offload_host_bytes
    from toolkit.plan.choice import from_recipe
    from toolkit.plan.estimate import estimate
    from toolkit.plan.hardware import Cluster

    r = load_recipe("llama7b_zero2_offload")
    need, per_node = offload_host_bytes(r, 8)
    assert (need, per_node) == (estimate(r, from_recipe(r, 8), Cluster(gpus=8, gpus_per_node=8)).memory.cpu_per_node, 8)
    (f,) = doctor.check_host_memory(r, need, per_node, (24 * 2**30, 23 * 2**30))
    assert f.status == doctor.FAIL and "23.0 GiB available of 24.0 GiB on this node" in f.detail
    assert "holds about 113.8 GiB per node with 8 ranks per node" in f.detail
    ready = {x.check: x for x in doctor.readiness([f], r)}
    assert "host memory" in ready["ready: deepspeed ZeRO-Offload (cpu)"].detail
    assert doctor.check_host_memory(r, need, 8, (512 * 2**30, 100 * 2**30))[0].status == doctor.WARN  # others hold it
    assert doctor.check_host_memory(r, need, 8, (512 * 2**30, 500 * 2**30))[0].status == doctor.OK
    assert doctor.check_host_memory(r, None, 8, (512 * 2**30, 500 * 2**30))[0].status == doctor.INFO
    assert doctor.check_host_memory(load_recipe("tiny_zero0"), 0, 2, (1, 1)) == []  # no offload: nothing to check
    total, available = doctor.host_memory()  # this machine's, from /proc/meminfo
    assert 0 < available <= total


def test_the_checkpoint_disk_is_the_one_training_uses(tmp_path, monkeypatch):
    """A relative checkpoint folder was resolved from the toolkit's install folder, not from where the run starts
    (another disk); a folder that cannot be written was called too small (a trial of 2026-12-07)."""
    monkeypatch.chdir(tmp_path)
    (f,) = doctor.check_disk(load_recipe("tiny_zero0", ["output_dir=rel/run"]))
    assert f.detail.startswith(f"{tmp_path}/rel/run/checkpoints: "), f.detail
    (tmp_path / "afile").write_text("x")
    (f,) = doctor.check_disk(load_recipe("tiny_zero0", ["output_dir=afile/run"]))
    assert f.status == doctor.FAIL and f"{tmp_path}/afile is a file" in f.detail and "you can write" in f.fix


def test_command_line_json_and_exit_status():
    ok = subprocess.run([sys.executable, "-m", "toolkit", "doctor", "--recipe", "tiny_zero0", "--json"], cwd=REPO,
                        capture_output=True, text=True, check=False)
    findings = json.loads(ok.stdout)
    assert ok.returncode == (1 if any(f["status"] == "fail" for f in findings) else 0)
    assert {"check", "status", "detail", "fix"} <= set(findings[0])
    bad = subprocess.run([sys.executable, "-m", "toolkit", "doctor", "--nodes", "2"], cwd=REPO, capture_output=True,
                         text=True, check=False, env={**__import__("os").environ, "NCCL_SOCKET_IFNAME": "lo"})
    assert bad.returncode == 1 and "[FAIL] NCCL_SOCKET_IFNAME" in bad.stdout and "fix:" in bad.stdout


def test_readiness_names_what_each_backend_is_missing():
    """On this CPU machine both backends rehearse on CPU and neither can train on GPUs, for a named reason; a
    failed required check makes its backend not ready, with that check's fix."""
    ready = {f.check: f for f in doctor.readiness(doctor.run())}
    assert ready["ready: deepspeed backend, CPU rehearsal (gloo)"].detail == "yes"
    assert ready["ready: megatron backend, CPU rehearsal (local spec)"].detail == "yes"
    gpu = ready["ready: megatron backend, GPU training"]
    assert gpu.status == doctor.WARN and gpu.detail.startswith("no, missing: GPUs") and gpu.fix
    broken = [doctor.Finding("torch", doctor.OK, ""), doctor.Finding("megatron-core", doctor.FAIL, "not installed",
                                                                     "pip install megatron-core==0.16.1")]
    (cpu,) = [f for f in doctor.readiness(broken) if f.check == "ready: megatron backend, CPU rehearsal (local spec)"]
    assert (cpu.status, cpu.detail, cpu.fix) == (doctor.FAIL, "no, missing: megatron-core",
                                                 "pip install megatron-core==0.16.1")
