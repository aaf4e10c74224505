"""The command line: validate/show/render output, exit code 2 on bad input, and nothing written on failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, launch


def toolkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, cwd=REPO)


def test_validate_prints_layout_and_batch_arithmetic():
    proc = toolkit("validate", "--recipe", "llama7b_zero3", "--world-size", "64")
    assert proc.returncode == 0, proc.stderr
    assert "deepspeed on 64 ranks: dp=64" in proc.stdout
    assert "global batch 512 = micro 1 x accumulation 8 x dp 64" in proc.stdout
    assert "training.grad_accum_steps = global 512 / (micro 1 x dp 64) = 8 (derived)" in proc.stdout


def test_show_prints_the_resolved_recipe():
    proc = toolkit("show", "--recipe", "tiny_zero3", "--set", "training.steps=70")
    assert proc.returncode == 0, proc.stderr
    d = yaml.safe_load(proc.stdout)
    assert d["training"]["steps"] == 70 and d["training"]["grad_accum_steps"] == 1
    assert d["model"]["hidden_size"] == 128 and d["parallel"]["dp"] == 2
    assert d["checkpoint"]["dir"] == "runs/tiny_zero3/checkpoints"


def test_show_explain_and_list():
    explain = toolkit("show", "--explain").stdout
    assert "  micro_batch_size: null  # Sequences per rank per forward pass; derived when null." in explain
    assert "tiny_zero3" in toolkit("show", "--list").stdout.split()


@pytest.mark.parametrize("args", [["--list", "--explain"], ["--list", "--recipe", "tiny_zero3"],
                                  ["--explain", "--set", "training.steps=3"]])
def test_show_refuses_options_it_would_ignore(args):
    proc = toolkit("show", *args)  # until 2026-12-07 the second one was ignored
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: toolkit show: ") and "do not go together" in proc.stderr


def test_render_ds_config_prints_json():
    proc = toolkit("render", "ds-config", "--recipe", "tiny_zero3", "--device", "cpu")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["zero_optimization"]["stage"] == 3


def test_render_megatron_config_prints_every_argument():
    proc = toolkit("render", "megatron-config", "--recipe", "llama70b_tp8_pp4")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["initialize_model_parallel"]["virtual_pipeline_model_parallel_size"] == 5
    assert d["TransformerConfig"]["activation_func"] == "silu" and d["TransformerConfig"]["params_dtype"] == "bfloat16"
    assert d["OptimizerConfig"]["use_distributed_optimizer"] is True
    assert toolkit("render", "megatron-config", "--recipe", "tiny_zero3").returncode == 2


@pytest.mark.parametrize("args,needle", [
    (["validate", "--recipe", "nope"], "no recipe file or shipped recipe named 'nope'"),
    (["validate", "--recipe", "tiny_zero0", "--world-size", "3"], "16 is not divisible by micro_batch_size x dp"),
    (["validate", "--recipe", "tiny_zero0", "--set", "training"], "expected KEY.PATH=VALUE"),
    (["show"], "needs --recipe"),
    (["validate", "--recipe", "tiny_zero0", "--set", "training.stop_at_step=500"],  # accepted until 2026-12-07
     "training.stop_at_step: 500 is past training.steps 200, so the run would never stop there"),
])
def test_bad_command_lines_exit_2_without_traceback(args, needle):
    proc = toolkit(*args)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_train_with_bad_recipe_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = launch("tiny_zero0", ["training.global_batch_size=3", "logging.interval=1"], nproc=1, out_dir=out,
                  launcher="python", check=False)
    assert proc.returncode == 2
    assert "training.global_batch_size: 3 is not divisible" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_train_with_missing_data_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = launch("tiny_zero0", [f"data.paths=[{tmp_path}/none/*.jsonl]"], nproc=1, out_dir=out, launcher="python",
                  check=False)
    assert proc.returncode == 2 and "matches no file" in proc.stderr and not out.exists()


def test_a_refusal_before_the_ranks_join_is_said_once_per_node(tmp_path):
    """Every rank printed the same refusal (eight copies per node on GPUs) until 2026-12-07; the node's first rank
    says it now, for the others."""
    out = tmp_path / "run"
    proc = launch("tiny_zero0", [f"data.paths=[{tmp_path}/none/*.jsonl]"], nproc=2, out_dir=out, check=False)
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1 and text.count("matches no file") == 1, text
    assert not out.exists()


def test_a_ranks_refusal_reaches_stderr_in_one_write(monkeypatch):
    """Ranks share the launcher's stderr. print() wrote a refusal and its newline in two writes, so a second rank's
    copy began on the first one's last line (trial K, 2026-12-08: "...move those folders out firsterror: ...")."""
    import importlib.util

    from toolkit.train import preempt

    spec = importlib.util.spec_from_file_location("train_entry", REPO / "recipes" / "train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    writes: list[str] = []
    monkeypatch.setattr(preempt, "watch_early", lambda: None)  # no signal handlers in the test process
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": lambda self, t: writes.append(t),
                                                             "flush": lambda self: None})())
    monkeypatch.setattr(sys, "argv", ["train.py", "--recipe", "tiny_zero0", "--set", "training.steps=0",
                                      "--set", "training.lr=1"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert entry.main() == 2
    assert len(writes) == 1 and writes[0].startswith("error: recipe tiny_zero0: 2 problems") and \
        writes[0].endswith("\n") and writes[0].count("\n") > 1, writes


def test_context_parallel_without_transformer_engine_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    proc = launch("tiny_dp2_distopt", ["parallel.cp=2", "parallel.zero_stage=0", "training.global_batch_size=8"],
                  nproc=2, out_dir=out, check=False)
    assert proc.returncode != 0
    assert "parallel.cp: context parallelism needs Transformer Engine's attention on GPUs" in proc.stderr
    # checked after the ranks join, alike on each: rank 0 says it (every rank did until 2026-12-07)
    assert proc.stderr.count("context parallelism needs") == 1, proc.stderr
    # torchrun reports the failed children with its own traceback; the ranks themselves print none
    assert "[rank0]: Traceback" not in proc.stderr and not out.exists()


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    out = tmp_path / "run"
    proc = launch("tiny_zero0", ["data.tokenizer=no-such-org/no-such-tokenizer"], nproc=1, out_dir=out,
                  launcher="python", check=False)
    assert proc.returncode == 2 and "data.tokenizer: cannot load 'no-such-org/no-such-tokenizer'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_validate_warns_when_this_machine_cannot_run_a_megatron_recipe():
    proc = toolkit("validate", "--recipe", "llama3_8b_tp2_cp2")
    assert proc.returncode == 0  # the recipe is valid; the cluster has Transformer Engine
    assert "note: launched on this machine, the run would stop at: parallel.cp: context parallelism needs " \
           "Transformer Engine" in proc.stdout


def test_the_toolkit_command_flushes_everything_before_its_fast_exit(tmp_path):
    """`toolkit` (cli.entry) ends with os._exit after main(), skipping the interpreter's teardown: what it printed
    still arrives whole through a pipe and into a file, and its exit code is main()'s (0, or a refusal's)."""
    import tomllib

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["toolkit"] == "toolkit.cli:entry"
    proc = toolkit("show", "--recipe", "llama7b_zero3")
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout)["name"] == "llama7b_zero3"
    out = tmp_path / "plan.json"
    with out.open("w") as f:
        code = subprocess.run([sys.executable, "-m", "toolkit", "plan", "--recipe", "llama7b_zero3", "--gpus", "64",
                               "--json"], stdout=f, cwd=REPO).returncode
    assert code == 0 and json.loads(out.read_text())["recipe"] == "llama7b_zero3"
    refused = toolkit("convert", str(tmp_path / "missing"), str(tmp_path / "out"), "--to", "hf")
    assert refused.returncode == 2 and "does not exist" in refused.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_convert_has_openmp_threads_wait_passively_unless_the_user_says(tmp_path, preset):
    """`toolkit convert` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (the verification's forward then
    leaves the cores to its hash threads between parallel regions); a policy the user set is kept."""
    code = ("import os, sys; from toolkit import cli; from toolkit.checkpoint import copy_only\n"
            "def stop(*args, **kwargs):\n"  # the conversion itself is not this test's business
            "    raise SystemExit(0)\n"
            "copy_only.convert_by_copy = stop\n"
            "try:\n"
            f"    cli.main(['convert', {str(tmp_path / 'missing')!r}, {str(tmp_path / 'out')!r}, '--to', 'hf'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": preset} if preset
                                                                             else {})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.stdout.split() == [preset or "PASSIVE", "False"], proc.stderr


def test_validate_refuses_what_megatron_core_cannot_express_on_any_machine(tmp_path):
    """Until 2026-12-07 `validate` printed these as "launched on this machine, the run would stop at" notes and
    exited 0; rope_theta 2.9 then trained at 2 (rotary_base is an int)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: tiny_tp2\nmodel: {rope_scaling: {type: yarn, factor: 4.0}, rope_theta: 2.9}\n")
    proc = toolkit("validate", "--recipe", str(recipe))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert "model.rope_scaling: {'type': 'yarn', 'factor': 4.0} cannot be expressed in Megatron-Core" in proc.stderr
    assert "model.rope_theta: 2.9 is not a whole number" in proc.stderr
    ok = toolkit("validate", "--recipe", str(recipe), "--set", "parallel.backend=deepspeed",
                 "--set", "parallel.tp=1")
    assert ok.returncode == 0, ok.stderr
