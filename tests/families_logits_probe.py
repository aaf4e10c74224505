"""Run under torchrun: for each layout (TPxPP, each using all N ranks) and each Hugging Face folder given, build the
Megatron model from the folder through its family's map, run one forward pass through Megatron's pipeline schedule,
gather the full logits and save them (with the input ids) as OUT_DIR/<folder name>_tp<TP>_pp<PP>.pt. Several
families and layouts share one launch: the process groups are rebuilt for each layout.

    torchrun --nproc_per_node N tests/families_logits_probe.py 2x1,1x2 OUT_DIR HF_DIR [HF_DIR ...]

A layout TPxPPxEP (e.g. 1x1x2) adds expert parallelism; it runs the mixture-of-experts folders only.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.recipe import load_recipe, resolve  # noqa: E402
from toolkit.train.dist import init_distributed  # noqa: E402


def recipe(hf: str, tp: int, pp: int, ep: int = 1):
    return load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={hf}", "model.pretrained=true",
                                      "parallel.backend=megatron", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                      f"parallel.ep={ep}",
                                      "training.global_batch_size=2", "training.micro_batch_size=1"])


def logits(r, layout, hf: str, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from toolkit.megatron import runtime

    chunk = runtime.build_chunks(r, layout, on_gpu=False)[0]
    runtime.load_hf_weights([chunk], hf, r, layout)
    chunk.eval()  # inference: Megatron's MoE layer refuses TP without SP only in training
    torch.manual_seed(0)
    ids = torch.randint(0, r.model.vocab_size, (2, 32))
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)

    def forward_step(it, model):
        return model(next(it), positions, attention_mask=None), lambda o: (o.sum() * 0, {"logits": o.detach()})

    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids[:1], ids[1:]]),
                                      model=chunk, num_microbatches=2, seq_length=32, micro_batch_size=1,
                                      forward_only=True)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        full = gather_from_tensor_model_parallel_region(torch.cat([x["logits"] for x in res], dim=0))
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            params = [(n, p.numel()) for n, p in chunk.named_parameters()]  # the planner's arithmetic is pinned to it
            torch.save({"ids": ids, "logits": full[..., :r.model.vocab_size], "family": r.model.family,
                        "params": params}, out)
    dist.barrier()


def main(layouts: str, out_dir: str, folders: list[str]) -> None:
    from megatron.core import parallel_state as ps

    from toolkit.megatron import runtime

    info = init_distributed()
    for tp, pp, *ep in (map(int, item.split("x")) for item in layouts.split(",")):
        ep = ep[0] if ep else 1
        used = [hf for hf in folders if ep == 1 or "moe" in Path(hf).name]
        first = recipe(used[0], tp, pp, ep)
        layout = resolve(first, info.world_size).layout
        ps.destroy_model_parallel()
        runtime.init_parallel(first, layout, on_gpu=False)
        for hf in used:
            name = f"{Path(hf).name}_tp{tp}_pp{pp}" + (f"_ep{ep}" if ep > 1 else "")
            logits(recipe(hf, tp, pp, ep), layout, hf, Path(out_dir) / f"{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
