"""Run under torchrun with 2 ranks: Megatron-Core's own distributed optimizer loads the optimizer state of a
Megatron-LM legacy checkpoint that `toolkit convert --to megatron_lm` wrote, as Megatron-LM's load_checkpoint loads
it: each rank's model_optim_rng.pt into its GPTModel chunks (strict=True) and `optimizer.load_state_dict`, then
`optimizer.load_parameter_state(distrib_optim.pt)`. Without distrib_optim.pt files, Megatron-Core's plain optimizer
(Float16OptimizerWithFloat16Params or FP32Optimizer) loads the state_dict alone ("loaded legacy plain optim ..."). The loaded moments and fp32 main weights, gathered by name, must
equal the live optimizer state the source checkpoint was saved from (LIVE, megatron_native_writer.py), every
parameter's Adam step must be the source's, and the scheduler state must load into Megatron-Core's scheduler.

    torchrun --nproc_per_node 2 tests/megatron_legacy_optim_probe.py ROOT,HF,LIVE,PRECISION,TPxPPxVPP[xEP][,SCHED] [...]

EP > 1 (a mixture of experts): each rank reads its expert-parallel rank's folder (mp_rank_TT[_PPP]_EEE), and
Megatron-Core's chained optimizers (the dense one and the experts') load the two state dicts and distrib_optim.pt
states in it.

SCHED "checkpoint": the scheduler is built as `--use-checkpoint-opt_param-scheduler` builds it (a checkpoint written
from a toolkit run, whose schedule is the recipe's, not Megatron-LM's arguments here).

A ROOT holding iter_*/metadata.json is a torch_dist checkpoint instead, loaded through Megatron-Core's
dist_checkpointing.load (check_torch_dist).

Prints "loaded legacy optim ROOT_NAME TPxPPxVPP" ("loaded torch_dist optim ...") per checkpoint that matched on every
rank; exits non-zero otherwise.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_native_writer import _live_state, build, scheduler_for  # noqa: E402

from toolkit.train.dist import init_distributed  # noqa: E402

VOCAB = 500  # the models' true vocabulary: rows past it are padding


def _stepped(hf: str, tp: int, pp: int, vpp: int, precision: str, distributed: bool = True, ep: int = 1):
    """DDP chunks and Megatron-Core's distributed optimizer (or its plain one) at the layout, after one step (its
    state exists, as in a run that loads a checkpoint)."""
    from toolkit.megatron import runtime

    r, layout, chunks = build(hf, tp, pp, vpp, (f"parallel.zero_stage={int(distributed)}", f"parallel.ep={ep}",
                                                f"training.precision={precision}", "data.seq_len=16"))
    wrapped, optimizer = runtime.wrap_and_optimize(chunks, r, layout)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    batches = [{"input_ids": ids, "labels": ids.clone()}] * (r.training.global_batch_size // layout.dp)
    runtime.train_step(wrapped, optimizer, batches, r, 1e-2, torch.device("cpu"))
    for w in wrapped:
        if w.use_forward_hook:
            w.disable_forward_pre_hook()
    return wrapped, optimizer, layout


def _compare(wrapped, optimizer, live: str, scheduler_state: dict, distributed: bool = True,
             from_checkpoint: bool = False) -> None:
    """The loaded state by name equals the live one's, with the step; the scheduler state loads."""
    from safetensors.torch import load_file

    got, want = _live_state(wrapped, optimizer, distributed), load_file(live)
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    for k, v in want.items():
        rows = VOCAB if k.startswith(("embedding.", "output_layer.")) else None
        assert torch.equal(got[k][:rows], v[:rows]), k
    steps = {float(s["step"]) for o in optimizer.chained_optimizers for s in o.optimizer.state.values()}
    assert steps == {2.0}, steps
    scheduler = scheduler_for(optimizer, from_checkpoint)
    scheduler.load_state_dict(scheduler_state)  # as Megatron-LM's load_checkpoint does
    assert scheduler.num_steps == 4, scheduler.num_steps  # 2 iterations of 2 samples


def check(root: str, hf: str, live: str, precision: str, tp: int, pp: int, vpp: int, ep: int = 1,
          sched: bool = False) -> None:
    from megatron.core import parallel_state as ps

    distributed = any(Path(root).glob("iter_*/mp_rank_*/distrib_optim.pt"))
    wrapped, optimizer, layout = _stepped(hf, tp, pp, vpp, precision, distributed, ep)
    t, p, e = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
               ps.get_expert_model_parallel_rank())
    folder = next(Path(root).glob(f"iter_*/mp_rank_{t:02d}{'' if pp == 1 else f'_{p:03d}'}"
                                  f"{'' if ep == 1 else f'_{e:03d}'}"))
    state = torch.load(folder / "model_optim_rng.pt", weights_only=False)  # the toolkit's own output
    assert state["args"].use_distributed_optimizer == distributed
    for i, w in enumerate(wrapped):
        w.module.load_state_dict(state["model" if vpp == 1 else f"model{i}"], strict=True)
    optimizer.load_state_dict(state["optimizer"])  # the step, from the param groups
    if not distributed:  # the plain optimizer's state_dict holds everything, by position
        _compare(wrapped, optimizer, live, state["opt_param_scheduler"], False, sched)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"loaded legacy plain optim {Path(root).name} {tp}x{pp}x{vpp}{'' if ep == 1 else f'x{ep}'}",
                  flush=True)
        ps.destroy_model_parallel()
        return
    # Megatron-Core 0.16's load_parameter_state copies every key of a parameter's optimizer state from the file; torch's
    # own Adam (the CPU fallback, without Apex or Transformer Engine) keeps a per-parameter "step" there too, which the
    # file never holds: set aside while the file loads, as FusedAdam (no per-parameter step) would have it
    inner = [o.optimizer.state for o in optimizer.chained_optimizers]
    steps_aside = [{q: s.pop("step") for q, s in st.items()} for st in inner]
    with torch.no_grad():  # an fp32 model's main weights are views of its parameters: copied into without autograd
        optimizer.load_parameter_state(str(folder / "distrib_optim.pt"))
    for st, aside in zip(inner, steps_aside):
        for q, step in aside.items():
            st[q]["step"] = step
    _compare(wrapped, optimizer, live, state["opt_param_scheduler"], True, sched)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"loaded legacy optim {Path(root).name} {tp}x{pp}x{vpp}{'' if ep == 1 else f'x{ep}'}", flush=True)
    ps.destroy_model_parallel()


def check_torch_dist(root: str, hf: str, live: str, precision: str, tp: int, pp: int, vpp: int, ep: int = 1,
                     sched: bool = False) -> None:
    """The same for a torch_dist checkpoint: Megatron-Core's dist_checkpointing.load of the model's and the
    optimizer's sharded state dicts (the distributed optimizer's fully_reshardable, or the plain one's) at this layout, then the chunks' load_state_dict
    (strict) and the optimizer's (toolkit/megatron/torch_dist_ckpt.load: the toolkit's own resume, which sets
    torch's per-parameter Adam steps aside as above)."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from toolkit.format import safe_load
    from toolkit.megatron import torch_dist_ckpt

    it_dir = next(Path(root).glob("iter_*"))
    with safe_load.weights_only_everywhere(it_dir):
        common = torch.load(it_dir / "common.pt")
        distributed = common["args"].use_distributed_optimizer
        wrapped, optimizer, layout = _stepped(hf, tp, pp, vpp, precision, distributed, ep)
        torch_dist_ckpt.load(SimpleNamespace(chunks=wrapped, optimizer=optimizer,
                                             layout_meta={"zero_stage": int(distributed)}), it_dir)
    _compare(wrapped, optimizer, live, common["opt_param_scheduler"], distributed, sched)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"loaded torch_dist optim {Path(root).name} {tp}x{pp}x{vpp}{'' if ep == 1 else f'x{ep}'}", flush=True)
    ps.destroy_model_parallel()


def main(*specs: str) -> None:
    init_distributed(with_deepspeed=False)
    for spec in specs:
        root, hf, live, precision, lay, *sched = spec.split(",")
        torch_dist = any(Path(root).glob("iter_*/metadata.json"))
        sizes = [int(x) for x in lay.split("x")]
        (check_torch_dist if torch_dist else check)(root, hf, live, precision, *sizes, *[1] * (4 - len(sizes)),
                                                    sched == ["checkpoint"])
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
