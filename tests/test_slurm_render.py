"""Slurm job scripts: slurm/*.sbatch match toolkit.slurm.SHIPPED, and their headers agree with arithmetic done here
from the recipe files; bash and shellcheck accept every script and the job body slurm/job.sh; layouts that do not
fit nodes x GPUs are refused before anything is written; the job body's shell logic (rendezvous address and port,
requeue on the trainer's marker) runs with fake scontrol/getent/srun; the preflight under torchrun, and a whole
script stopping at the preflight when a node never joins (a fake srun). No Slurm is needed; training and requeue
through the scripts run against a real Slurm in test_slurm_cluster.py."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, free_port, signal_process_tree

from toolkit.errors import RecipeError
from toolkit.slurm import (
    CPUS_PER_GPU,
    JOB_SH,
    PREEMPTED_MARKER,
    REQUEUE_EXIT,
    SHIPPED,
    SLURM_DIR,
    render_job,
    render_shipped,
)

BIN = Path(sys.executable).parent
OFFLINE = {"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **{"cwd": REPO, "timeout": 120, **kw})


def toolkit(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "toolkit", *args])


# ---- the shipped scripts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_script_matches_its_entry(name):
    path = SLURM_DIR / f"{name}.sbatch"
    assert path.is_file(), f"run `toolkit slurm render --all` to write {path}"
    assert path.read_text() == render_shipped(name), (
        f"{path} drifted from toolkit.slurm.SHIPPED or its recipe; run `toolkit slurm render --all` and commit it")


def test_no_stray_scripts():
    assert sorted(p.stem for p in SLURM_DIR.glob("*.sbatch")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", [*(f"{n}.sbatch" for n in SHIPPED), JOB_SH.name])
def test_bash_accepts_the_script(name):
    proc = run(["bash", "-n", str(SLURM_DIR / name)])
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_passes_on_the_job_body_and_every_script(tmp_path):
    assert shutil.which("shellcheck"), ("shellcheck not found: install it (apt-get install shellcheck); "
                                        "the job scripts are checked with it")
    shipped = [str(SLURM_DIR / f"{name}.sbatch") for name in SHIPPED]
    proc = run(["shellcheck", str(JOB_SH), *shipped])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a script rendered with every option, quoted overrides included; -x follows its `source` of the job body
    script = tmp_path / "job.sbatch"
    script.write_text(render_job("tiny_zero3", 1, 2, ["output_dir=/tmp/a b", "logging.sample_prompt=it's"], cpu=True,
                                 partition="cpu", time="1:00:00", account="proj", job_name="x", cpus_per_task=4))
    proc = run(["shellcheck", "-x", str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_script_has_every_piece():
    text = render_job("llama13b_tp4_pp2", 2, 8, ["training.steps=5000"], partition="gpu", time="2-00:00:00",
                      account="proj", signal_seconds=300)
    for line in ["#SBATCH --job-name=llama13b_tp4_pp2", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=64", "#SBATCH --time=2-00:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --output=logs/%x-%j.out",
                 "#SBATCH --signal=USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "RECIPE=llama13b_tp4_pp2", "OVERRIDES=(--set training.steps=5000)", "RANKS_PER_NODE=8",
                 "DEVICE=cuda", "JOB_BODY=${SLURM_SUBMIT_DIR:-$PWD}/slurm/job.sh", 'source "$JOB_BODY"']:
        assert f"\n{line}" in text, line
    assert "megatron on 16 ranks: dp=2 tp=4 pp=2" in text.splitlines()[1]
    assert text.endswith('\nmain "$@"\n') and len(text.splitlines()) < 35  # a header; the job is slurm/job.sh
    body = JOB_SH.read_text()
    for piece in ['"${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 12000))}"', 'scontrol requeue "$SLURM_JOB_ID"',
                  "--kill-on-bad-exit=1", 'trap "" USR1; exec torchrun', '--node_rank "$SLURM_NODEID"',
                  "-m toolkit.preflight", "recipes/train.py", "python -m toolkit validate", "getent hosts",
                  "NCCL_DEBUG=${NCCL_DEBUG:-WARN}", "TOOLKIT_NCCL_IFNAME", "OMP_NUM_THREADS", "main() {"]:
        assert piece in body, piece
    # all of each node's memory unless told (a cluster's per-CPU default applied until 2026-12-07); a CPU rehearsal
    # shares its node and asks for none; a size is checked
    assert "\n#SBATCH --mem=0\n" in text and "--mem" not in render_job("tiny_zero3", 1, 2, [], cpu=True)
    assert "\n#SBATCH --mem=500G\n" in render_job("llama13b_tp4_pp2", 2, 8, [], mem="500G")
    with pytest.raises(RecipeError, match="'5x' is not a Slurm memory size"):
        render_job("llama13b_tp4_pp2", 2, 8, [], mem="5x")
    # #SBATCH lines are read only up to the first command: all of them come before it
    header = text.split("\nRECIPE=")[0]
    assert header.count("#SBATCH") == text.count("#SBATCH") and "#SBATCH" not in body


def test_cpu_script_asks_for_no_gpus_and_optional_lines_stay_out():
    text = render_job("tiny_zero3", 1, 2, [], cpu=True)
    assert "#SBATCH --gpus-per-node" not in text and "DEVICE=cpu" in text
    assert "#SBATCH --cpus-per-task=2" in text
    assert not any(f"#SBATCH --{k}" in text for k in ("time", "partition", "account"))


# ---- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needles", [
    (["--recipe", "llama70b_tp8_pp4", "--nodes", "1", "--gpus-per-node", "8"],
     ["parallel.world_size: the recipe is written for 64 ranks, but --nodes 1 x --gpus-per-node 8",
      "render with --nodes 8 --gpus-per-node 8", "world size 8 is not divisible by tp x pp x cp = 8 x 4 x 1 = 32"]),
    (["--recipe", "tiny_tp2", "--nodes", "1", "--gpus-per-node", "3", "--cpu", "--set", "parallel.world_size=3"],
     ["world size 3 is not divisible by tp x pp x cp = 2 x 1 x 1 = 2"]),
    (["--recipe", "no_such_recipe", "--nodes", "1", "--gpus-per-node", "8"],
     ["no recipe file or shipped recipe named 'no_such_recipe'"]),
    (["--recipe", "tiny_zero3", "--nodes", "1", "--gpus-per-node", "2", "--time", "5", "--signal-seconds", "600"],
     ["--signal-seconds: 600 s before the end is not within the time limit 5 (300 s)"]),
    (["--recipe", "tiny_zero3", "--nodes", "1"], ["needs --recipe NAME --nodes N --gpus-per-node G"]),
    (["--recipe", "llama70b_tp8_pp4", "--nodes", "16", "--gpus-per-node", "4"],  # rendered until 2026-12-07
     ["parallel.tp: tp=8 does not divide the 4 ranks per node, so tensor-parallel groups would span nodes"]),
])
def test_render_refuses_with_a_clear_message_and_writes_nothing(tmp_path, args, needles):
    out = tmp_path / "job.sbatch"
    proc = toolkit("slurm", "render", *args, "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for needle in needles:
        assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists() and not proc.stdout


def test_render_prints_or_writes_and_keeps_an_existing_file(tmp_path):
    args = ["slurm", "render", "--recipe", "tiny_zero3", "--nodes", "1", "--gpus-per-node", "2", "--cpu"]
    printed = toolkit(*args)
    assert printed.returncode == 0 and printed.stdout == render_job("tiny_zero3", 1, 2, [], cpu=True)
    out = tmp_path / "job.sbatch"
    assert toolkit(*args, "--out", str(out)).returncode == 0 and out.read_text() == printed.stdout
    out.write_text("mine")
    again = toolkit(*args, "--out", str(out))
    assert again.returncode == 2 and "pass --overwrite" in again.stderr and out.read_text() == "mine"
    assert toolkit(*args, "--out", str(out), "--overwrite").returncode == 0 and out.read_text() == printed.stdout


def test_render_out_never_writes_through_a_link_nor_makes_folders(tmp_path):
    """--out wrote through a symbolic link (into the file it pointed at, elsewhere), made missing folders, and gave
    a traceback for a folder with --overwrite; --all ignored --recipe and --out and rewrote the shipped scripts in
    the toolkit's own folder (a trial of 2026-12-07)."""
    args = ["slurm", "render", "--recipe", "tiny_zero3", "--nodes", "1", "--gpus-per-node", "2", "--cpu"]
    target, link = tmp_path / "elsewhere.txt", tmp_path / "job.sbatch"
    target.write_text("not a job script")
    link.symlink_to(target)
    assert toolkit(*args, "--out", str(link), "--overwrite").returncode == 0
    assert target.read_text() == "not a job script" and not link.is_symlink() and "#SBATCH" in link.read_text()
    for out, says in ((tmp_path / "new" / "job.sbatch", "does not exist; create it first"),
                      (tmp_path, "that is a folder")):
        proc = toolkit(*args, "--out", str(out), "--overwrite")
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()
    shipped = {p: p.stat().st_mtime_ns for p in (REPO / "slurm").glob("*.sbatch")}
    for extra in (["--recipe", "tiny_zero3"], ["--out", str(tmp_path / "x.sbatch")]):
        proc = toolkit("slurm", "render", "--all", *extra)
        assert proc.returncode == 2 and "--all rewrites the shipped scripts" in proc.stderr, proc.stderr
    assert {p: p.stat().st_mtime_ns for p in (REPO / "slurm").glob("*.sbatch")} == shipped


# ---- the shipped headers against arithmetic done here, from the recipe files -------------------------------------

def _recipe_yaml(name: str) -> dict:
    """recipes/<name>.yaml merged over its `base:` chain, by hand (the recipe loader is what is being checked)."""
    def merge(low: dict, high: dict) -> dict:
        return {**low, **{k: merge(low[k], v) if isinstance(v, dict) and isinstance(low.get(k), dict) else v
                          for k, v in high.items()}}
    doc = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    base = doc.pop("base", None)
    return merge(_recipe_yaml(base), doc) if base else doc


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_header_agrees_with_independent_arithmetic(name):
    entry, text = SHIPPED[name], (SLURM_DIR / f"{name}.sbatch").read_text()
    recipe = _recipe_yaml(entry["recipe"])
    nodes, per_node, cpu = entry["nodes"], entry["gpus_per_node"], entry.get("cpu", False)
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", text, re.M))
    var = dict(re.findall(r"^([A-Z_]+)=(\S*)", text, re.M))
    world = nodes * per_node
    par = recipe["parallel"]
    assert par.get("world_size", world) == world, f"{name}: {nodes} x {per_node} != recipe world_size"
    model_parallel = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)
    dp = world // model_parallel
    assert dp * model_parallel == world
    micro, glob = recipe["training"]["micro_batch_size"], recipe["training"]["global_batch_size"]
    accum = glob // (micro * dp)
    assert accum * micro * dp == glob
    what = "CPU ranks" if cpu else "GPUs"
    assert text.splitlines()[1].startswith(
        f"# Slurm job for recipe {entry['recipe']}: {nodes} node{'s' * (nodes > 1)} x {per_node} {what}; "
        f"{par['backend']} on {world} ranks: dp={dp} tp={par.get('tp', 1)} pp={par.get('pp', 1)}")
    assert text.splitlines()[2] == (f"# global batch {glob} = micro {micro} x accumulation {accum} x dp {dp} "
                                    f"sequences of {recipe['data']['seq_len']} tokens")
    # one task (one torchrun) per node; its CPUs: CPUS_PER_GPU per GPU, or one core per CPU rank
    assert sbatch["job-name"] == recipe["name"] and sbatch["nodes"] == str(nodes)
    assert sbatch["ntasks-per-node"] == "1"
    assert sbatch.get("gpus-per-node") == (None if cpu else str(per_node))
    assert sbatch["cpus-per-task"] == str(per_node * (1 if cpu else CPUS_PER_GPU))
    signal_s = entry.get("signal_seconds", 120)
    assert sbatch["signal"] == f"USR1@{signal_s}" and "requeue" in sbatch and sbatch["open-mode"] == "append"
    assert sbatch.get("time") == entry.get("time")
    if "time" in entry:  # the signal comes within the time limit, with room for the run before it
        h, m, sec = (int(x) for x in entry["time"].split(":"))
        assert signal_s < (h * 60 + m) * 60 + sec
    assert var["RECIPE"] == entry["recipe"] and var["RANKS_PER_NODE"] == str(per_node)
    assert var["DEVICE"] == ("cpu" if cpu else "cuda") and var["OVERRIDES"] == "()"


def test_constants_agree_with_the_trainer_and_the_job_body(fake_slurm):
    from toolkit.train import preempt

    assert (preempt.REQUEUE_EXIT, preempt.MARKER) == (REQUEUE_EXIT, PREEMPTED_MARKER)
    # sourcing the job body sets its constants and runs nothing: no output, no Slurm command
    proc = source_and_run('echo "$REQUEUE_EXIT $MARKER_NAME"', fake_slurm)
    assert proc.returncode == 0 and proc.stdout.split() == [str(REQUEUE_EXIT), PREEMPTED_MARKER], proc.stderr
    assert Path(fake_slurm["FAKE_LOG"]).read_text() == "" and proc.stderr == ""


# ---- the script's shell functions, with fake Slurm commands ---------------------------------------------------

FAKES = {
    "scontrol": r'''
case "$1 $2" in
  "show hostnames") printf '%s\n' $FAKE_NODES ;;
  "show node") printf 'NodeName=%s Arch=x86_64 CoresPerSocket=1\n   NodeAddr=%s NodeHostName=%s\n' \
                      "$3" "${FAKE_NODEADDR:-$3}" "$3" ;;
  "requeue "*) echo "requeue $2" >> "$FAKE_LOG" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac''',
    "getent": r'''[[ " $FAKE_RESOLVES " == *" $2 "* ]] && echo "10.9.9.9 $2" && exit 0; exit 2''',
    # drops srun's options (the script writes them as --opt=value), then runs the task once, as node 0
    "srun": r'''
echo "srun $*" >> "$FAKE_LOG"
while [[ $1 == -* ]]; do shift; done
if [[ $1 == hostname ]]; then echo "$FAKE_HOST_IPS"; exit 0; fi
export SLURM_NODEID=0 SLURM_NNODES=${FAKE_SRUN_NODES:-1}
exec "$@"''',
}


@pytest.fixture
def fake_slurm(tmp_path) -> dict:
    """PATH with fake scontrol/getent/srun first, and a log of what they were asked."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body.lstrip("\n") + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "fake.log"
    log.touch()
    return {"PATH": f"{bin_dir}:{BIN}:{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_NODES": "n1 n2",
            "FAKE_RESOLVES": "", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "123456", "RANKS_PER_NODE": "2"}


def source_and_run(snippet: str, env: dict, script: Path = JOB_SH):
    """Source the job body (which defines its functions and runs nothing) and run `snippet` after it; the inputs
    a batch script would set come from `env` (RANKS_PER_NODE)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "MASTER_", "NCCL_", "GLOO_")) and k != "OMP_NUM_THREADS"}
    return run(["bash", "-c", f'source "$1"; {snippet}', "bash", str(script)], env={**clean, **env})


@pytest.mark.parametrize("extra,expected", [
    ({"FAKE_RESOLVES": "n1"}, "n1"),                                   # the usual case: node names resolve
    ({"FAKE_NODEADDR": "10.1.2.3"}, "10.1.2.3"),                      # they don't: Slurm's NodeAddr
    ({"FAKE_HOST_IPS": "10.7.7.7 172.17.0.1"}, "10.7.7.7"),          # no NodeAddr either: what the node reports
])
def test_master_addr(fake_slurm, extra, expected):
    proc = source_and_run("master_addr", {**fake_slurm, **extra})
    assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr


def test_master_addr_fails_clearly_without_any_address(fake_slurm):
    proc = source_and_run("master_addr", fake_slurm)
    assert proc.returncode == 1 and "the first node n1 does not resolve" in proc.stderr


def test_master_port_comes_from_the_job_id_unless_set(fake_slurm):
    # 20000-31999: below Linux's default ephemeral ports (32768-60999), which other connections may hold (it
    # reached 39999 until 2026-12-07)
    assert source_and_run("master_port", fake_slurm).stdout.strip() == str(20000 + 123456 % 12000)
    assert source_and_run("master_port", {**fake_slurm, "MASTER_PORT": "29999"}).stdout.strip() == "29999"


def test_network_env_defaults_and_overrides(fake_slurm):
    show = 'network_env; echo "$NCCL_DEBUG $NCCL_IB_DISABLE ${NCCL_SOCKET_IFNAME-unset} ${GLOO_SOCKET_IFNAME-unset} ' \
           '$OMP_NUM_THREADS"'
    assert source_and_run(show, {**fake_slurm, "SLURM_CPUS_PER_TASK": "8"}).stdout.split() == \
        ["WARN", "0", "unset", "unset", "4"]
    env = {**fake_slurm, "TOOLKIT_NCCL_IFNAME": "ib0", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"}
    assert source_and_run(show, env).stdout.split() == ["INFO", "1", "ib0", "ib0", "1"]
    assert source_and_run(show, {**fake_slurm, "TOOLKIT_NCCL_IFNAME": "^docker,lo"}).stdout.split()[2:4] == \
        ["^docker,lo", "unset"]  # NCCL's exclusion syntax means nothing to gloo


@pytest.mark.parametrize("rc,marker,requeued,exit_code", [
    (1, True, True, 0),            # torchrun turns the trainer's 75 into 1: the marker decides
    (REQUEUE_EXIT, False, True, 0),
    (1, False, False, 1),
    (0, False, False, 0),
])
def test_finish_requeues_after_a_preemption_checkpoint(fake_slurm, tmp_path, rc, marker, requeued, exit_code):
    path = tmp_path / PREEMPTED_MARKER
    if marker:
        path.write_text('{"step": 7}')
    proc = source_and_run(f'MARKER={path}; finish {rc}', fake_slurm)
    assert proc.returncode == exit_code, proc.stderr
    assert ("requeue 123456" in Path(fake_slurm["FAKE_LOG"]).read_text()) == requeued


def test_overrides_given_at_submission_follow_the_rendered_ones(fake_slurm):
    proc = source_and_run('OVERRIDES=(--set a=1); add_overrides --set b=2 --set=c=3; printf "%s\\n" "${OVERRIDES[@]}"',
                          fake_slurm)
    assert proc.stdout.split() == ["--set", "a=1", "--set", "b=2", "--set", "c=3"], proc.stderr
    bad = source_and_run("add_overrides --nodes 2", fake_slurm)
    assert bad.returncode == 2 and "takes only --set KEY=VALUE" in bad.stderr


def test_gpus_per_node_given_at_submission_must_be_the_ranks_per_node(fake_slurm):
    for got, ok in (("2", True), ("h100:2", True), ("4", False), ("a100:4", False), ("", True)):
        proc = source_and_run("DEVICE=cuda; check_gpus_per_node && echo fine", {**fake_slurm,
                                                                                 "SLURM_GPUS_PER_NODE": got})
        assert (proc.returncode == 0 and proc.stdout.strip() == "fine") == ok, (got, proc.stderr)
        assert ok or "starts RANKS_PER_NODE=2 ranks per node, one per GPU, but the job has 4 GPUs" in proc.stderr
    cpu = source_and_run("DEVICE=cpu; check_gpus_per_node && echo fine", {**fake_slurm, "SLURM_GPUS_PER_NODE": "4"})
    assert cpu.stdout.strip() == "fine"


def test_a_bare_run_outside_slurm_refuses(fake_slurm):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env = {k: v for k, v in fake_slurm.items() if k != "SLURM_JOB_ID"}
    proc = run(["bash", str(SLURM_DIR / "tiny_zero3_cpu.sbatch")], env={**clean, **env})
    assert proc.returncode == 2 and "submit it with: sbatch" in proc.stderr
    body = run(["bash", str(JOB_SH)], env={**clean, **fake_slurm})  # the job body alone has no inputs
    assert body.returncode == 2 and "submit one of those: sbatch slurm/NAME.sbatch" in body.stderr


def test_a_script_submitted_elsewhere_names_the_missing_job_body(fake_slurm, tmp_path):
    """sbatch runs a spooled copy of the script: the job body is found from the submission folder or not at all."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    script = tmp_path / "job.sbatch"
    script.write_text(render_job("tiny_zero3", 1, 2, [], cpu=True))
    proc = run(["bash", str(script)], cwd=tmp_path, env={**clean, **fake_slurm, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: no {tmp_path}/slurm/job.sh: submit from the repository root\n"
    assert Path(fake_slurm["FAKE_LOG"]).read_text() == ""


# ---- processes: torchrun and the preflight --------------------------------------------------------------------

_USR1_WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
open(sys.argv[1] + "." + os.environ["RANK"], "w").close()
while not got:
    time.sleep(0.05)
os.write(1, f"rank {os.environ['RANK']} got SIGUSR1\\n".encode())  # one write: lines of two ranks never interleave
# Like the trainer, which agrees on the stop with an all-reduce, no rank leaves before both have the signal:
# torchrun would otherwise SIGTERM the slower rank as soon as the first one exits.
open(sys.argv[1] + ".got." + os.environ["RANK"], "w").close()
end = time.monotonic() + 30
while not all(os.path.exists(sys.argv[1] + ".got." + r) for r in "01") and time.monotonic() < end:
    time.sleep(0.05)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.slow
def test_torchrun_started_by_the_script_survives_usr1_and_its_workers_get_it(tmp_path, fake_slurm):
    """The script's per-node command: torchrun ignores SIGUSR1, the workers handle it. Exit 75 comes back from
    torchrun as 1, which is why the script requeues on the trainer's marker."""
    worker = tmp_path / "worker.py"
    worker.write_text(_USR1_WORKER)
    ready = tmp_path / "ready"
    env = {**fake_slurm, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "OMP_NUM_THREADS": "1"}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    per_node = (f'source "$1"; bash -c "$PER_NODE" torchrun --nproc_per_node 2 --master_addr 127.0.0.1 '
                f'--master_port {free_port()} {worker} {ready} {REQUEUE_EXIT}')
    cmd = ["bash", "-c", per_node, "bash", str(JOB_SH)]
    proc = subprocess.Popen(cmd, env={**clean, **env}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    end = time.monotonic() + 60
    while not all(Path(f"{ready}.{r}").exists() for r in (0, 1)) and time.monotonic() < end:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    signal_process_tree(proc.pid, 10)  # SIGUSR1
    out, _ = proc.communicate(timeout=60)
    assert "rank 0 got SIGUSR1" in out and "rank 1 got SIGUSR1" in out, out
    assert proc.returncode == 1, out  # torchrun survived the signal, and reports exit 75 as a plain failure


@pytest.mark.slow
def test_preflight_under_torchrun_prints_one_line_per_node():
    proc = run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
                "toolkit.preflight", "--device", "cpu"], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("preflight ok")]
    assert len(lines) == 1 and "ranks 0-1 of 2: all-reduce sum 2 over gloo" in lines[0]


def test_preflight_fails_fast_and_readably_when_the_master_port_is_closed():
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TOOLKIT_PREFLIGHT_TIMEOUT": "2"}
    start = time.monotonic()
    proc = run([sys.executable, "-m", "toolkit.preflight", "--device", "cpu"], env=env, timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    for needle in ["error: preflight on", "rank 1 of 2 (gloo)", f"127.0.0.1:{env['MASTER_PORT']}",
                   "NCCL_SOCKET_IFNAME=", "toolkit doctor"]:
        assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "frame #" not in proc.stderr


# ---- the whole script, on CPU, with a fake srun that runs node 0's task here -----------------------------------

def _job(tmp_path: Path, fake_slurm: dict, overrides: list[str], nodes: int = 1, args: tuple[str, ...] = (),
         **env) -> tuple[subprocess.Popen, Path]:
    """Run a rendered tiny_zero3 CPU script as sbatch would (with `args` after it), with fake Slurm commands: from
    another folder than the repository (sbatch's spool), finding the job body through SLURM_SUBMIT_DIR."""
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    script.write_text(render_job("tiny_zero3", nodes, 2, [f"output_dir={out}", "logging.interval=1",
                                                          "logging.sample_prompt=", *overrides], cpu=True))
    slurm = {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": str(nodes),
             "SLURM_CPUS_PER_TASK": "2", "SLURM_JOB_NAME": "tiny", "FAKE_NODES": "localhost",
             "FAKE_RESOLVES": "localhost", "MASTER_PORT": str(free_port()), "TOOLKIT_PREFLIGHT_TIMEOUT": "10"}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "OMP_"))}
    proc = subprocess.Popen(["bash", str(script), *args], env={**clean, **OFFLINE, **fake_slurm, **slurm, **env},
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


# The whole script training, and requeueing after SIGUSR1, run against a real Slurm in test_slurm_cluster.py.


@pytest.mark.slow
def test_job_script_stops_at_the_preflight_when_a_node_never_joins(tmp_path, fake_slurm):
    """A 2-node job whose second node never starts its torchrun: the rendezvous times out in seconds, the script
    says what to check and exits 1 without training."""
    proc, out = _job(tmp_path, {**fake_slurm, "FAKE_SRUN_NODES": "2"},
                     ["parallel.world_size=4", "training.micro_batch_size=4"], nodes=2, TOOLKIT_PREFLIGHT_TIMEOUT="3")
    start = time.monotonic()
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, log[-5000:]
    assert time.monotonic() - start < 60
    assert "error: preflight: the 4 ranks on 2 node(s) did not all join and all-reduce within 3 s" in log
    assert "toolkit doctor" in log
    assert "NCCL_SOCKET_IFNAME=<unset>" in log and not out.exists()
    assert sum(x.startswith("srun") for x in Path(fake_slurm["FAKE_LOG"]).read_text().splitlines()) == 1


def test_render_says_when_the_signal_leaves_too_little_for_two_steps_and_a_save(tmp_path):
    """The shipped 70B, 13B and 8B scripts signalled at 120 s, less than two of the 70B's estimated 75 s steps: the
    job would have reached its time limit without a checkpoint (a trial of 2026-12-07)."""
    short = toolkit("slurm", "render", "--recipe", "llama70b_tp8_pp4", "--nodes", "8", "--gpus-per-node", "8")
    assert short.returncode == 0 and short.stdout.startswith("#!/bin/bash")
    assert "note: --signal-seconds 120 may be too short: two steps of about 75 s" in short.stderr, short.stderr
    assert "render with --signal-seconds 420" in short.stderr
    enough = toolkit("slurm", "render", "--recipe", "llama70b_tp8_pp4", "--nodes", "8", "--gpus-per-node", "8",
                     "--signal-seconds", "420")
    assert enough.returncode == 0 and enough.stderr == "" and "#SBATCH --signal=USR1@420" in enough.stdout
    assert "#SBATCH --signal=USR1@420" in (REPO / "slurm" / "llama70b_tp8_pp4.sbatch").read_text()
    small = toolkit("slurm", "render", "--recipe", "llama7b_zero3", "--nodes", "4", "--gpus-per-node", "8")
    assert small.returncode == 0 and small.stderr == ""
