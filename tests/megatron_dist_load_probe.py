"""Run under torchrun with 2 ranks: Megatron-Core's own `dist_checkpointing.load` reads a torch_dist checkpoint
into real GPTModels at each layout given, and every rank's weights must equal those the toolkit's HF mapping gives.

    torchrun --nproc_per_node 2 tests/megatron_dist_load_probe.py HF_DIR CKPT_ITER_DIR TPxPPxVPP [TPxPPxVPP ...]

Prints "loaded TPxPPxVPP" per layout that matched on every rank; exits non-zero otherwise.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.recipe import load_recipe, resolve  # noqa: E402
from toolkit.train.dist import init_distributed  # noqa: E402


def check(hf: str, ckpt: str, tp: int, pp: int, vpp: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from toolkit.megatron import runtime

    r = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={hf}", "model.pretrained=true",
                                   "parallel.backend=megatron", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                   f"parallel.vpp={vpp}", "training.global_batch_size=2", "training.micro_batch_size=1"])
    layout = resolve(r, dist.get_world_size()).layout
    runtime.init_parallel(r, layout, on_gpu=False)
    chunks = runtime.build_chunks(r, layout, on_gpu=False)
    runtime.load_hf_weights(chunks, hf, r, layout)
    want = [{k: v.clone() for k, v in runtime.chunk_state(c).items()} for c in chunks]
    with torch.no_grad():
        for c in chunks:
            for v in runtime.chunk_state(c).values():
                v.zero_()
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    sharded = {k: c.sharded_state_dict() for k, c in zip(keys, chunks)}
    state = dist_checkpointing.load(sharded, ckpt)
    for k, c, w in zip(keys, chunks, want):
        c.load_state_dict(state[k], strict=False)
        got = runtime.chunk_state(c)
        bad = [n for n in w if not torch.equal(got[n], w[n])]
        assert not bad and set(got) == set(w), (tp, pp, vpp, bad[:4])
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"loaded {tp}x{pp}x{vpp}", flush=True)
    ps.destroy_model_parallel()


def main(hf: str, ckpt: str, *layouts: str) -> None:
    init_distributed(with_deepspeed=False)
    for lay in layouts:
        check(hf, ckpt, *(int(x) for x in lay.split("x")))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
