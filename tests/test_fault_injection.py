"""Fault injection, bounded: a rank SIGKILLed after its backward (DeepSpeed ZeRO-2) and mid-save with a torn file
(DeepSpeed), rank 0 killed between writing the manifest and moving the pointers (Megatron TP2), and a kill
followed by bit rot in the newest checkpoint (Megatron); and with Megatron-Core's torch_dist saves
(`checkpoint.format: torch_dist`), a torn `.distcp` write and bit rot in the newest checkpoint. Each time: nothing
completed is lost, nothing damaged is resumed from, and every step after the resume has the uninterrupted run's
loss, bit for bit.

More trials: TOOLKIT_FAULT_TRIALS=N (drawn at random, seeded) or `python tests/fault_harness.py --trials N`.
Signals (SIGUSR1 twice, the second during the save) are tests/test_preemption.py's, and a harness kind.
"""
from __future__ import annotations

import json
import os
import random

import pytest

import fault_harness as fh
from toolkit.format import manifest
from toolkit.train.faults import parse


@pytest.mark.slow
def test_kills_and_rot_lose_nothing_and_resume_exactly(uninterrupted, tmp_path):
    n = int(os.environ.get("TOOLKIT_FAULT_TRIALS", "0"))
    if n:
        rng = random.Random(int(os.environ.get("TOOLKIT_FAULT_SEED", "0")))
        trials = [fh.draw(rng, b) for b in fh.BACKENDS for _ in range(n)]
    else:
        trials = [fh.Trial("deepspeed", "backward", 3, 1), fh.Trial("deepspeed", "torn", 4, 0),
                  fh.Trial("megatron", "save-meta", 4, 0), fh.Trial("megatron", "corrupt", 5, 1),
                  # checkpoint.format: torch_dist (Megatron-Core's own save, untried here until 2026-12-07)
                  fh.Trial("megatron_td", "torn", 4, 1), fh.Trial("megatron_td", "corrupt", 7, 0)]
    references = {b: [m["loss"] for m in uninterrupted(recipe, fh.STEPS)] for b, recipe in fh.BACKENDS.items()}
    result = fh.campaign(trials, tmp_path, references)
    print(result["summary"])
    for t in result["trials"]:
        assert t["killed"] and not t["note"], t
        assert t["lost"] == [] and not t["corrupt_accepted"] and t["exact"], t
    if not n:  # the manifest-then-pointer kill resumes from the new checkpoint; the rotten one is passed over
        assert [t["resumed_from"] for t in result["trials"]] == [2, 2, 4, 2, 2, 4]


def test_a_rotten_checkpoint_fails_verification(tmp_path):
    """The harness's own instruments: the damage it does is what the manifest catches, and the fault spec parses."""
    tag = tmp_path / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "weights.bin").write_bytes(bytes(range(256)) * 8)
    files = manifest.entries([tag / "weights.bin"], fsync=False)
    (tag / "toolkit_meta.json").write_text(json.dumps({"schema_version": manifest.SCHEMA_VERSION, "step": 2,
                                                       "files": files}))
    assert fh._verifies(tag)
    assert fh._damage_newest(tmp_path) == "step_00000002"
    assert not fh._verifies(tag)
    assert parse("backward@3:1") == ("backward", 3, 1, False)
    assert parse("save-flushed@4:0:torn") == ("save-flushed", 4, 0, True)
    with pytest.raises(ValueError, match="expected PHASE@STEP"):
        parse("nonsense@x")
