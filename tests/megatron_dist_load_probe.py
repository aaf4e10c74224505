"""Run under torchrun with 2 ranks: Megatron-Core's own `dist_checkpointing.load` reads a torch_dist checkpoint
into real GPTModels at each layout given, and every rank's weights must equal those the toolkit's HF mapping gives.
`check_legacy` does the same for a Megatron-LM legacy checkpoint: each rank's model_optim_rng.pt must hold exactly
the keys of its GPTModel chunks' state_dict_for_save_checkpoint() and load into them with strict=True.

    torchrun --nproc_per_node 2 tests/megatron_dist_load_probe.py HF_DIR CKPT_ITER_DIR TPxPPxVPP[xEP] [...]
    torchrun --nproc_per_node 2 tests/megatron_dist_load_probe.py HF_DIR LEGACY_ROOT legacy:TPxPPxVPP[xEP] [...]

Prints "loaded TPxPPxVPP" (a mixture of experts at EP > 1: "loaded TPxPPxVPPxEP") per layout that matched on every
rank; exits non-zero otherwise.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.recipe import load_recipe, resolve  # noqa: E402
from toolkit.train.dist import init_distributed  # noqa: E402


def _build(hf: str, tp: int, pp: int, vpp: int, ep: int = 1):
    """Chunks at the layout, zeroed, and the weights the HF mapping gives each chunk."""
    from toolkit.megatron import runtime

    r = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={hf}", "model.pretrained=true",
                                   "parallel.backend=megatron", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                   f"parallel.vpp={vpp}", f"parallel.ep={ep}", f"parallel.sp={tp > 1 and ep > 1}",
                                   "training.global_batch_size=2", "training.micro_batch_size=1"])
    layout = resolve(r, dist.get_world_size()).layout
    runtime.init_parallel(r, layout, on_gpu=False)
    chunks = runtime.build_chunks(r, layout, on_gpu=False)
    runtime.load_hf_weights(chunks, hf, r, layout)
    want = [{k: v.clone() for k, v in runtime.chunk_state(c).items()} for c in chunks]
    with torch.no_grad():
        for c in chunks:
            for v in runtime.chunk_state(c).values():
                v.zero_()
    return chunks, want


def _compare(chunks, want, what: str) -> None:
    from megatron.core import parallel_state as ps

    from toolkit.megatron import runtime

    for c, w in zip(chunks, want):
        got = runtime.chunk_state(c)
        bad = [n for n in w if not torch.equal(got[n], w[n])]
        assert not bad and set(got) == set(w), (what, bad[:4])
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"loaded {what}", flush=True)
    ps.destroy_model_parallel()


def check(hf: str, ckpt: str, tp: int, pp: int, vpp: int, ep: int = 1) -> None:
    from megatron.core import dist_checkpointing

    chunks, want = _build(hf, tp, pp, vpp, ep)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    sharded = {k: c.sharded_state_dict() for k, c in zip(keys, chunks)}
    state = dist_checkpointing.load(sharded, ckpt)
    for k, c in zip(keys, chunks):
        c.load_state_dict(state[k], strict=False)  # the comparison below checks every weight arrived
    _compare(chunks, want, f"{tp}x{pp}x{vpp}" + (f"x{ep}" if ep > 1 else ""))


def check_legacy(hf: str, root: str, tp: int, pp: int, vpp: int, ep: int = 1) -> None:
    from megatron.core import parallel_state as ps

    from toolkit.format.safe_load import load

    chunks, want = _build(hf, tp, pp, vpp, ep)
    t, p, e = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
               ps.get_expert_model_parallel_rank())
    folder = f"mp_rank_{t:02d}{'' if pp == 1 else f'_{p:03d}'}{'' if ep == 1 else f'_{e:03d}'}"
    files = list(Path(root).glob(f"iter_*/{folder}/model_optim_rng.pt"))
    assert len(files) == 1, files
    state = load(files[0])
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for k, c in zip(keys, chunks):
        # the same keys, in the order a GPTModel lists them (the plain optimizer's state is keyed by that position)
        assert list(state[k]) == list(c.state_dict_for_save_checkpoint()), (k, sorted(set(state[k]) ^ set(c.state_dict())))
        c.load_state_dict(state[k], strict=True)
    _compare(chunks, want, f"legacy {tp}x{pp}x{vpp}" + (f"x{ep}" if ep > 1 else ""))


def main(hf: str, ckpt: str, *layouts: str) -> None:
    """A layout written "legacy:TPxPPxVPP[xEP]" checks CKPT as a Megatron-LM legacy root instead."""
    init_distributed(with_deepspeed=False)
    for lay in layouts:
        legacy = lay.startswith("legacy:")
        (check_legacy if legacy else check)(hf, ckpt, *(int(x) for x in lay.removeprefix("legacy:").split("x")))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
