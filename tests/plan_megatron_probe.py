"""What Megatron-Core really allocates on each rank, for tests/test_plan_megatron_states.py.

    torchrun --nproc_per_node N tests/plan_megatron_probe.py measure CASES.json OUT_DIR
        For each case ({"name", "recipe", "overrides"}) in turn: build the chunks, DDP and optimizer with the
        toolkit's runtime, train one step, and write OUT_DIR/<name>.rank<R>.json with the bytes of live tensors by
        kind (storage shared between tensors counted once).
    python tests/plan_megatron_probe.py meta RECIPE TP_RANK PP_RANK OUT.json
        Build one rank's GPTModel chunks of a big recipe on the meta device in this single process (Megatron's
        groups replaced by objects that only answer size() and rank()), and write their parameter counts.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.recipe import load_recipe, resolve


def storages(tensors) -> dict[int, int]:
    """data_ptr -> bytes of each distinct storage behind `tensors` (views of one buffer count once)."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def inner_optimizers(optimizer) -> list:
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chain if getattr(o, "optimizer", None) is not None]


def measure(wrapped, optimizer) -> dict:
    params = [p for w in wrapped for p in w.module.parameters()]
    weights = storages(params)
    grads = storages(b.grad_data for w in wrapped for b in [*w.buffers, *w.expert_parallel_buffers])
    inner = inner_optimizers(optimizer)
    opt_params = [p for o in inner for g in o.param_groups for p in g["params"]]
    master = {k: v for k, v in storages(opt_params).items() if k not in weights}
    states = [s for o in inner for s in o.state.values()]
    moments = storages(s[k] for s in states for k in ("exp_avg", "exp_avg_sq") if k in s)
    other_state = storages(v for s in states for k, v in s.items()
                           if torch.is_tensor(v) and k not in ("exp_avg", "exp_avg_sq", "step"))
    # gradients anywhere else (param.grad, main_grad, the optimizer params' .grad) must alias the DDP buffers
    grad_views = [g for p in [*params, *opt_params] for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    stray_grads = {k: v for k, v in storages(grad_views).items() if k not in grads}
    return {"params": sum(p.numel() for p in params), "weights": sum(weights.values()), "grads": sum(grads.values()),
            "master": sum(master.values()), "moments": sum(moments.values()),
            "step": sum(s["step"].nbytes for s in states if torch.is_tensor(s.get("step"))),
            "other_state": sum(other_state.values()), "stray_grads": sum(stray_grads.values()),
            "weight_dtypes": sorted({str(p.dtype) for p in params}),
            "buffers": [[b.grad_data.numel(), [[bk.offset, bk.grad_data.numel()] for bk in b.buckets]]
                        for w in wrapped for b in w.buffers]}


def run_case(case: dict, out_dir: Path) -> None:
    from megatron.core import parallel_state as ps

    from toolkit.megatron import runtime

    r = load_recipe(case["recipe"], case["overrides"])
    plan = resolve(r, dist.get_world_size())
    layout = plan.layout
    runtime.init_parallel(r, layout, on_gpu=False)
    wrapped, optimizer = runtime.wrap_and_optimize(runtime.build_chunks(r, layout, on_gpu=False), r, layout)
    g = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    batches = [{"input_ids": (ids := torch.randint(0, r.model.vocab_size, (plan.batch.micro_batch, r.data.seq_len),
                                                   generator=g)), "labels": ids.clone()}
               for _ in range(plan.batch.grad_accum)]
    runtime.train_step(wrapped, optimizer, batches, r, r.training.optimizer.lr, torch.device("cpu"))
    got = measure(wrapped, optimizer)
    got.update(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
               dp_rank=ps.get_data_parallel_rank(with_context_parallel=True))
    (out_dir / f"{case['name']}.rank{dist.get_rank()}.json").write_text(json.dumps(got))
    del wrapped, optimizer
    ps.destroy_model_parallel()


class _Group:
    """Stands in for a process group of `size` ranks, seen from `rank`: all that building a model asks of one."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def meta_chunks(name: str, tp_rank: int, pp_rank: int) -> list[dict]:
    """One rank's chunks of a big recipe, built by Megatron on the meta device without its other 31 processes.

    Modules take their TP/PP groups from the pg_collection (only size() and rank() are asked while building);
    the layer count per chunk and the layer offsets come from parallel_state's rank/size overrides. torch.distributed
    must be initialised (a world of one), or Megatron treats every group as size 1."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.adapters import megatron as mcfg
    from toolkit.megatron.runtime import layer_spec

    r = load_recipe(name, [])
    layout = resolve(r, r.parallel.world_size).layout
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.set_tensor_model_parallel_world_size(layout.tp)
    ps.set_tensor_model_parallel_rank(tp_rank)
    ps.set_pipeline_model_parallel_world_size(layout.pp)
    ps.set_pipeline_model_parallel_rank(pp_rank)
    ps.set_virtual_pipeline_model_parallel_world_size(layout.vpp if layout.vpp > 1 else None)
    tp, pp = _Group(layout.tp, tp_rank), _Group(layout.pp, pp_rank)
    pgs = ProcessGroupCollection(tp=tp, pp=pp, cp=_Group(1, 0), tp_cp=tp, mp=_Group(layout.tp * layout.pp, 0),
                                 embd=None, pos_embd=None)
    # perform_initialization=False: no init kernels; use_cpu_initialization (as on CPU) makes every parameter a
    # plain torch.empty, which the meta device turns into shapes without storage
    config = TransformerConfig(**{**mcfg.to_transformer_config_kwargs(r, layout, on_gpu=False),
                                  "perform_initialization": False})
    out = []
    with torch.device("meta"):
        for vp in range(layout.vpp):
            vp_stage = vp if layout.vpp > 1 else None
            chunk = GPTModel(config, layer_spec(r, False, config, vp_stage), vp_stage=vp_stage, pg_collection=pgs,
                             pre_process=pp_rank == 0 and vp == 0,
                             post_process=pp_rank == layout.pp - 1 and vp == layout.vpp - 1,
                             **mcfg.to_gpt_model_kwargs(r, layout))
            out.append({"params": sum(p.numel() for p in chunk.parameters()),
                        "devices": sorted({p.device.type for p in chunk.parameters()}),
                        "layers": [layer.layer_number - 1 for layer in chunk.decoder.layers],
                        "names": [k for k, _ in chunk.named_parameters()]})
    dist.destroy_process_group()
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "measure":
        dist.init_process_group("gloo")
        out_dir = Path(argv[2])
        for case in json.loads(Path(argv[1]).read_text()):
            run_case(case, out_dir)
        dist.barrier()
        dist.destroy_process_group()
    elif argv[0] == "meta":
        Path(argv[4]).write_text(json.dumps(meta_chunks(argv[1], int(argv[2]), int(argv[3]))))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
