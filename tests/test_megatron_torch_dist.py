"""The Megatron backend saving and resuming in Megatron-Core's torch_dist format (`checkpoint.format: torch_dist`).

One 4-rank launch (shared fixture `stopped`) trains tiny_tp2_pp2 at TP2 x PP2 for 3 of 6 steps and saves step 3
through Megatron-Core's own `dist_checkpointing.save`. That checkpoint then
- resumes at TP1 x PP2 x DP2 through Megatron-Core's resharding load, with no convert step, and continues the
  uninterrupted TP2 x PP2 run's losses (the uninterrupted run is shared with test_megatron_resume and
  test_convert_layouts);
- loads with Megatron-Core's own `dist_checkpointing.load` into a fresh GPTModel's sharded_state_dict on one rank
  (tests/megatron_dist_load_probe.py), giving the weights that `toolkit convert --to hf` reads from it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, UNINTERRUPTED, free_port, launch, read_metrics
from test_convert_verify import mapped_reads_equal_loads
from test_verify_pieces import pieces_hash_as_merges

from toolkit.checkpoint.convert import convert
from toolkit.checkpoint.inspect import inspect
from toolkit.checkpoint.sources import open_source
from toolkit.errors import ToolkitError
from toolkit.layout import keeping_divisor
from toolkit.train.checkpoint import _check_reshard, check_vocab_padding, moved_data_position

STEPS, STOP = 6, 3
TORCH_DIST = ("checkpoint.format=torch_dist",)


@pytest.fixture(scope="module")
def saved(stopped) -> Path:
    return stopped("tiny_tp2_pp2", STEPS, STOP, 4, TORCH_DIST)


@pytest.mark.slow
def test_tp2_pp2_torch_dist_run_resumes_at_tp1_pp2_dp2(uninterrupted, saved, tmp_path):
    straight = [m["loss"] for m in uninterrupted("tiny_tp2_pp2", STEPS, 4)]
    shutil.copytree(saved, tmp_path / "run")
    tag = tmp_path / "run" / "checkpoints" / "step_00000003"
    names = sorted(p.name for p in tag.iterdir())
    # Megatron-Core's files, not the toolkit's per-rank safetensors; the toolkit's own state and manifest beside them
    assert {".metadata", "common.pt", "metadata.json", "toolkit_meta.json"} <= set(names)
    assert not [n for n in names if n.endswith(".safetensors")]
    assert [n for n in names if n.endswith(".distcp")] == [f"__{r}_{i}.distcp" for r in range(4) for i in range(2)]
    meta = json.loads((tag / "toolkit_meta.json").read_text())
    assert meta["checkpoint_format"] == "torch_dist" and (meta["layout"]["tp"], meta["layout"]["pp"]) == (2, 2)
    assert set(meta["files"]) == set(names) - {"toolkit_meta.json", "toolkit_started.json"}  # the manifest hashes all
    proc = launch("tiny_tp2_pp2", [f"training.steps={STEPS}", *UNINTERRUPTED, "parallel.tp=1", *TORCH_DIST],
                  nproc=4, out_dir=tmp_path / "run")
    assert "dp=2 tp=1 pp=2" in proc.stdout and "resumed from" in proc.stdout
    # Megatron-Core's warning about saving into a folder that is not empty: the toolkit's own started marker
    assert "Overwriting old incomplete" not in proc.stdout + proc.stderr
    split = read_metrics(tmp_path / "run")
    assert [m["step"] for m in split] == [1, 2, 3, 4, 5, 6]
    got = [m["loss"] for m in split[STOP:]]
    print("uninterrupted TP2xPP2:", straight[STOP:], "resumed from torch_dist at TP1xPP2xDP2:", got)
    # only fp32 reduction order differs; fresh Adam moments at step 4 move the loss by ~1e-2, a wrong shard far more
    assert got == pytest.approx(straight[STOP:], rel=1e-5)
    last = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert json.loads((last / "toolkit_meta.json").read_text())["layout"]["dp"] == 2 and list(last.glob("*.distcp"))


@pytest.mark.slow
def test_verification_reads_megatron_cores_own_files_as_maps(saved, monkeypatch):
    """The verification's reads of a torch_dist checkpoint (maps of the bytes torch.load reads, assembled in reused
    buffers) give what torch.load of each chunk gives, on the files Megatron-Core's own save wrote; and each weight
    hashed where its chunks lie (test_verify_pieces) has the record of the weight so read."""
    mapped_reads_equal_loads(saved / "checkpoints" / "step_00000003", monkeypatch).close()
    source = open_source(saved / "checkpoints")  # as `toolkit convert` opens it
    try:
        assert pieces_hash_as_merges(source)  # hashed in place: those whose chunks tile them
    finally:
        source.close()


@pytest.mark.slow
def test_megatron_core_loads_the_training_checkpoint_and_convert_reads_it(saved, tmp_path):
    checkpoints = saved / "checkpoints"
    report = inspect(checkpoints / "step_00000003")
    assert report["format"] == "megatron torch_dist" and report["complete"], report["problems"]
    # the model's weights, counted as every format's report counts them (Adam's moments were counted in too)
    assert report["dtypes"] == {"F32": report["parameters"]}
    assert report["optimizer_state"] == "exp_avg, exp_avg_sq per parameter"
    assert report["architecture"]["num_hidden_layers"] == 4 and "num_layers" not in report["architecture"]
    hf = convert(checkpoints, tmp_path / "hf", "hf", progress=False, log=lambda *_: None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           str(REPO / "tests" / "megatron_dist_load_probe.py"), str(hf), str(checkpoints / "step_00000003"), "1x1x1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "loaded 1x1x1" in proc.stdout  # every weight Megatron loaded equals the HF mapping of the converted one


def test_data_position_moves_with_data_parallelism(tmp_path):
    data = {"epoch": 1, "consumed_micro_batches": 6}
    # 6 micro-batches of 8 at dp 1 = 48 sequences = 3 of 8 x dp 2
    assert moved_data_position(data, 8, 1, 8, 2, tmp_path) == {"epoch": 1, "consumed_micro_batches": 3}
    assert moved_data_position(data, 8, 1, 4, 1, tmp_path)["consumed_micro_batches"] == 12
    with pytest.raises(ToolkitError, match="not a whole number"):
        moved_data_position(data, 8, 1, 8, 5, tmp_path)
    with pytest.raises(ToolkitError, match="does not record the micro-batch size"):
        moved_data_position(data, None, 1, 8, 2, tmp_path)


def test_switching_between_plain_and_distributed_optimizer_is_refused(tmp_path):
    saved = {"tp": 2, "pp": 2, "dp": 1, "zero_stage": 0}
    _check_reshard(tmp_path, saved, {**saved, "tp": 1, "dp": 2})  # TP/PP/DP may change
    with pytest.raises(ToolkitError, match="saved with the plain optimizer, this run uses the distributed optimizer"):
        _check_reshard(tmp_path, saved, {**saved, "zero_stage": 1})


def test_a_resume_at_another_vocabulary_padding_names_the_divisor_that_keeps_it(tmp_path):
    """Llama 2's 32000 pads to 32256 rows at TP4 (by 128) and to 32768 at TP8: 64 keeps 32256 at TP8. The same TP
    with another divisor changes the padding too; where no divisor keeps it, the saved layout is named."""
    from toolkit.recipe import load_recipe

    def recipe(by: int):
        return load_recipe("tiny_tp2_pp2", ["model.vocab_size=32000",
                                            f"parallel.megatron.make_vocab_size_divisible_by={by}"])

    saved = {"recipe": recipe(128).model_dump(mode="json"), "layout": {"tp": 4}}
    check_vocab_padding(tmp_path, saved, recipe(128), {"tp": 4})  # the same padding
    check_vocab_padding(tmp_path, saved, recipe(64), {"tp": 8})  # the divisor named below: 32256 rows at TP8 too
    with pytest.raises(ToolkitError, match=r"pads the vocabulary \(32000\) to 32256 rows \(128 x tp=4\); this run "
                       r"pads it to 32768 \(128 x tp=8\).*set parallel.megatron.make_vocab_size_divisible_by: 64 "
                       r"\(which pads it to 32256 rows at tp=8\)"):
        check_vocab_padding(tmp_path, saved, recipe(128), {"tp": 8})
    with pytest.raises(ToolkitError, match=r"this run pads it to 32000 \(64 x tp=4\)"):
        check_vocab_padding(tmp_path, saved, recipe(64), {"tp": 4})
    assert keeping_divisor(32000, 32256, 8) == 64 and keeping_divisor(600, 640, 4) == 32
    assert keeping_divisor(500, 512, 3) is None  # 512 rows are not a multiple of 3
    with pytest.raises(ToolkitError, match="resume at parallel.tp: 4 with parallel.megatron."
                       "make_vocab_size_divisible_by: 128; or take the new padding knowingly with `toolkit convert .* "
                       "NEW_DIR --to megatron --tp 5 --pp 1 --vpp 1 --make-vocab-size-divisible-by 128`"):
        check_vocab_padding(tmp_path, saved, recipe(128), {"tp": 5})  # 32000 rows at TP5; no divisor gives 32256


def test_torch_dist_with_deepspeed_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "toolkit", "validate", "--recipe", "tiny_zero1", "--set",
                           "checkpoint.format=torch_dist"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1 problem" in proc.stderr and "checkpoint.format: torch_dist is Megatron-Core's checkpoint format" in \
        proc.stderr


def test_default_format_is_unchanged():
    from toolkit.recipe import load_recipe

    assert load_recipe("tiny_tp2_pp2").checkpoint.format == "toolkit"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (__import__("os").system, (f"touch {self.marker}",))


def test_resume_refuses_a_planted_dcp_metadata_before_megatron_reads_it(tmp_path):
    """Megatron-Core's load unpickles `.metadata` without restrictions: the resume path reads it first with only
    DCP's records allowed, so a planted one is refused (no backend is touched) and its payload never runs."""
    import pickle

    from toolkit.megatron import torch_dist_ckpt

    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"evil": _Payload(tmp_path / "pwned")}))
    with pytest.raises(ToolkitError, match="refused rather than unpickled|not allowed"):
        torch_dist_ckpt.load(None, tmp_path)
    assert not (tmp_path / "pwned").exists()
    (tmp_path / ".metadata").unlink()
    with pytest.raises(ToolkitError, match="holds no torch_dist checkpoint"):
        torch_dist_ckpt.load(None, tmp_path)


@pytest.mark.slow
def test_torch_dist_optimizer_state_converts_and_resumes_at_tp1_pp2(uninterrupted, saved, tmp_path):
    """The optimizer state Megatron-Core's dist_checkpointing.save wrote at TP2 x PP2 (Adam moments by sharded key,
    common_step) converts with the weights to the toolkit layout at TP1 x PP2, and training resumes from it there
    (checkpoint.format: toolkit) continuing the uninterrupted TP2 x PP2 run's losses."""
    from safetensors.torch import load_file

    straight = [m["loss"] for m in uninterrupted("tiny_tp2_pp2", STEPS, 4)]
    moved = convert(saved / "checkpoints", tmp_path / "tp1pp2", "megatron", tp=1, pp=2, progress=False,
                    log=lambda *_: None)
    meta = json.loads((moved / "step_00000003" / "toolkit_meta.json").read_text())
    assert meta["weights_only"] is False and meta["layout"]["tp"] == 1
    optim = load_file(str(moved / "step_00000003" / "optim_tp00_pp001.safetensors"))
    assert {k.partition(":")[2] for k in optim} == {"exp_avg", "exp_avg_sq"}  # fp32: the mains are the weights
    proc = launch("tiny_tp2_pp2", [f"training.steps={STEPS}", *UNINTERRUPTED, "parallel.tp=1", "parallel.world_size=2",
                                   f"checkpoint.resume={moved}"], nproc=2, out_dir=tmp_path / "second")
    assert "resumed from" in proc.stdout
    second = read_metrics(tmp_path / "second")
    assert [m["step"] for m in second] == [4, 5, 6]
    got = [m["loss"] for m in second]
    print("uninterrupted TP2xPP2:", straight[STOP:], "resumed from converted torch_dist at TP1xPP2:", got)
    # fp32 reduction order differs only; fresh Adam moments at step 4 move the loss by ~1e-2, a wrong shard far more
    assert got == pytest.approx(straight[STOP:], rel=1e-5)


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_holds_the_weights_of_its_step(tmp_path):
    """With the distributed optimizer's overlapped parameter gather (the default), each rank updates only the range
    of the parameters it owns after a step and gathers the rest in the next forward. A checkpoint must not be saved
    in between: every saved weight equals its fp32 main weight rounded to bf16, on every element. Before the backend
    gathered the parameters first (as Megatron-LM's save_checkpoint does), 44-48% of the elements of most weights
    were the previous step's, and a conversion to Hugging Face gave a model of two steps at once."""
    import torch

    from toolkit.checkpoint import torch_dist

    launch("tiny_dp2_distopt", ["training.steps=2", "training.schedule.warmup_steps=1", "checkpoint.interval=2",
                                "training.precision=bf16", "logging.sample_prompt=null", *TORCH_DIST],
           nproc=2, out_dir=tmp_path)
    r = torch_dist.Reader(tmp_path / "checkpoints" / "step_00000002")
    mains = {n.removeprefix("optimizer.state.param."): n for n in r.tensor_names()
             if n.startswith("optimizer.state.param.") and n.removeprefix("optimizer.state.param.") in r.names.values()}
    assert len(mains) == 9
    # saved as Megatron-LM 0.16 saves by default (FullyParallelSaveStrategyWrapper): both data-parallel ranks write
    # part of the weights they hold alike (rank 0 wrote them all until 2026-12-08)
    writers = {info.relative_path.split("_")[2] for index, info in r.metadata.storage_data.items()
               if index.fqn in r.names.values()}
    assert writers == {"0", "1"}, writers
    stale = {w: (r.get(m).to(torch.bfloat16) != r.get(w)).float().mean().item() for w, m in mains.items()}
    assert not any(stale.values()), stale


@pytest.mark.slow
def test_a_save_spread_over_the_data_parallel_ranks_resumes_exactly(uninterrupted, stopped, tmp_path):
    """A DP2 save (each rank writes part of the weights, as Megatron-LM saves by default: the toolkit's since
    2026-12-08) resumes on the uninterrupted run's losses: Megatron-Core's load reads the shards from every file."""
    straight = [m["loss"] for m in uninterrupted("tiny_dp2_distopt", 4, 2)]
    shutil.copytree(stopped("tiny_dp2_distopt", 4, 2, 2, TORCH_DIST), tmp_path / "run")
    proc = launch("tiny_dp2_distopt", ["training.steps=4", *UNINTERRUPTED, *TORCH_DIST], nproc=2,
                  out_dir=tmp_path / "run")
    assert "resumed from" in proc.stdout
    got = read_metrics(tmp_path / "run")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert [m["loss"] for m in got[2:]] == pytest.approx(straight[2:], rel=1e-5)


@pytest.mark.slow
def test_distributed_optimizer_state_in_the_default_format_converts_by_name(tmp_path):
    """The Megatron backend's default checkpoint format keeps the distributed optimizer's state as Megatron's own
    save_parameter_state files (distopt_*.pt: flat buffers, where each parameter lies not saved) beside its
    state_dict (optim_*.pt). `toolkit convert --to megatron` reads it by parameter name, as Megatron-LM's
    distrib_optim.pt is read (the layout recomputed from the recipe's DDP settings and proved against the weights).
    The same run saved in the torch_dist format (fully_reshardable: per parameter, by name, tested against the live
    optimizer in test_megatron_native) gives the same state, bit for bit: every exp_avg, exp_avg_sq and fp32 main
    weight, and the step. --weights-only leaves it out; a missing optim_*.pt is one line, and nothing is written."""
    import torch

    from toolkit.format import safetensors_stream as st

    quiet = dict(progress=False, log=lambda *_: None)
    got = {}
    for fmt, extra in (("default", ()), ("torch_dist", TORCH_DIST)):
        launch("tiny_dp2_distopt", ["training.steps=2", "training.schedule.warmup_steps=1", "checkpoint.interval=2",
                                    "training.precision=bf16", "logging.sample_prompt=null", *extra],
               nproc=2, out_dir=tmp_path / fmt)
        tag = tmp_path / fmt / "checkpoints" / "step_00000002"
        if fmt == "default":
            assert {"distopt_tp00_pp000.pt", "optim_tp00_pp000.pt"} <= {p.name for p in tag.glob("*.pt")}
            # it said "by parameter name, in optim_* files" until 2026-12-07
            assert inspect(tag)["optimizer_state"].startswith("distributed optimizer: Megatron's flat buffers in "
                                                              "distopt_* files")
        out = convert(tag, tmp_path / f"{fmt}_out", "megatron", **quiet) / "step_00000002"
        got[fmt] = st.load(out / "optim_tp00_pp000.safetensors")
    (flat, flat_meta), (by_name, by_name_meta) = got["default"], got["torch_dist"]
    assert set(flat) == set(by_name) and len(flat) >= 3 * 9 and flat_meta["step"] == by_name_meta["step"] == "2"
    for k in by_name:
        assert torch.equal(flat[k], by_name[k]), k
    src = tmp_path / "default" / "checkpoints" / "step_00000002"
    weights = convert(src, tmp_path / "weights", "megatron", weights_only=True, **quiet) / "step_00000002"
    assert not list(weights.glob("optim_*"))
    (src / "optim_tp00_pp000.pt").unlink()  # the checkpoint's manifest says so first
    with pytest.raises(ToolkitError, match=r"is not a complete checkpoint: optim_tp00_pp000\.pt is missing"):
        convert(src, tmp_path / "broken", "megatron", **quiet)
    assert not (tmp_path / "broken").exists()


@pytest.mark.slow
def test_a_mistral_run_saved_in_torch_dist_converts_as_mistral(tmp_path):
    """Megatron's args describe Mistral 7B v0.2/v0.3 exactly as Llama (only a tokenizer path would tell), so a toolkit
    torch_dist step takes its family from its recipe. Before, a Mistral run converted --to hf became a
    LlamaForCausalLM (the same logits under another model_type), and --to megatron carried that on."""
    launch("tiny_mistral", ["parallel.backend=megatron", "parallel.world_size=1", "training.steps=1",
                            "training.schedule.warmup_steps=1", "checkpoint.interval=1", "logging.sample_prompt=null",
                            *TORCH_DIST], nproc=1, out_dir=tmp_path)
    tag = tmp_path / "checkpoints" / "step_00000001"
    quiet = dict(progress=False, log=lambda *_: None)
    config = json.loads((convert(tag, tmp_path / "hf", "hf", **quiet) / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["sliding_window"]) == \
        ("mistral", ["MistralForCausalLM"], None)
    meta = json.loads((convert(tag, tmp_path / "tp1", "megatron", **quiet) / "step_00000001" /
                       "toolkit_meta.json").read_text())
    assert meta["hf_config"]["model_type"] == "mistral"


def test_a_torch_dist_step_whose_meta_and_args_disagree_is_refused():
    """A toolkit torch_dist step whose recipe describes another model than the args Megatron saved in common.pt (two
    runs' files in one folder) is one line, not a conversion of either."""
    from toolkit.checkpoint.sources import recorded_model
    from toolkit.model import released_config
    from toolkit.recipe import load_recipe

    recipe = load_recipe("tiny_mistral")
    meta = {"recipe": recipe.model_dump(mode="json")}
    args = {**released_config(recipe.model), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert recorded_model(args, meta, Path("step"))["model_type"] == "mistral"
    with pytest.raises(ToolkitError, match=r"^step: its toolkit_meta\.json describes another model than the Megatron "
                                           r"args in its common\.pt \(hidden_size"):
        recorded_model({**args, "hidden_size": 2 * args["hidden_size"]}, meta, Path("step"))


@pytest.mark.slow
def test_a_cast_that_would_round_an_fp32_runs_master_weights_is_refused(saved, tmp_path):
    """An fp32 run's weights are its master weights: --dtype bf16 with its optimizer state would write bf16 weights
    beside fp32 Adam moments and no master copy, and a resume went on from the rounded weights without a word (its
    recipe still says fp32). Refused in one line, nothing written; --weights-only writes the bf16 model."""
    import torch

    with pytest.raises(ToolkitError, match=r"--dtype bf16 would round .* float32 weights, which are its run's master "
                                           r"weights .* Add --weights-only"):
        convert(saved / "checkpoints", tmp_path / "bf16", "megatron", dtype="bf16", progress=False, log=lambda *_: None)
    assert not list(tmp_path.iterdir())
    out = convert(saved / "checkpoints", tmp_path / "w", "torch_dist", dtype="bf16", weights_only=True, progress=False,
                  log=lambda *_: None)
    assert open_source(out, 512).dtype() == torch.bfloat16  # the run's vocabulary (512) pads to itself


@pytest.mark.slow
def test_a_vocab_size_other_than_the_recipes_is_refused(saved, tmp_path):
    """A toolkit torch_dist step records its vocabulary in its recipe: --vocab-size 500 replaced the recipe's 512 and
    wrote a 500-row model without a word (a trial of 2026-12-07). The recipe's own value is taken as it is."""
    quiet = dict(progress=False, log=lambda *_: None)
    with pytest.raises(ToolkitError, match=r"--vocab-size 500: .* records its vocabulary \(512\) in its recipe"):
        convert(saved / "checkpoints", tmp_path / "hf", "hf", vocab_size=500, **quiet)
    assert not list(tmp_path.iterdir())
    assert convert(saved / "checkpoints", tmp_path / "hf", "hf", vocab_size=512, verify=False, **quiet).is_dir()
