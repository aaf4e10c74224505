"""Run under torchrun: build the Megatron model at (tp, pp, vpp) from a Hugging Face checkpoint, run one forward
pass through Megatron's pipeline schedule, gather the full logits and save them (with the input ids) to a file.

    torchrun --nproc_per_node N tests/megatron_logits_probe.py HF_DIR TP PP VPP OUT.pt [MEGATRON_CKPT]
    torchrun --nproc_per_node N tests/megatron_logits_probe.py --jobs JOBS.json TP PP VPP

With MEGATRON_CKPT (a toolkit Megatron checkpoint at TP x PP x VPP, e.g. written by `toolkit convert`), the
weights come from it instead, and HF_DIR only gives the model's config. With --jobs, one launch probes several
models at the same layout: JOBS.json lists {"hf": ..., "out": ..., "ckpt": ... or null}.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.recipe import load_recipe, resolve  # noqa: E402
from toolkit.train.dist import init_distributed  # noqa: E402


def _recipe(hf: str, tp: int, pp: int, vpp: int):
    return load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={hf}", "model.pretrained=true",
                                      "parallel.backend=megatron", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                      f"parallel.vpp={vpp}", "training.global_batch_size=2",
                                      "training.micro_batch_size=1"])


def main(tp: int, pp: int, vpp: int, jobs: list[dict]) -> None:
    from toolkit.megatron import runtime

    info = init_distributed()
    r = _recipe(jobs[0]["hf"], tp, pp, vpp)
    layout = resolve(r, info.world_size).layout
    runtime.init_parallel(r, layout, on_gpu=False)
    for job in jobs:
        probe(_recipe(job["hf"], tp, pp, vpp), layout, job["hf"], job["out"], job.get("ckpt"))


def probe(r, layout, hf: str, out: str, megatron_ckpt: str | None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from toolkit.megatron import runtime

    vpp = layout.vpp
    chunks = runtime.build_chunks(r, layout, on_gpu=False)
    if megatron_ckpt:
        from toolkit.megatron.checkpoint import load_weights
        from toolkit.train.checkpoint import find_resume

        load_weights(chunks, find_resume(Path(megatron_ckpt), "auto"))
    else:
        runtime.load_hf_weights(chunks, hf, r, layout)
    torch.manual_seed(0)
    ids = torch.randint(0, r.model.vocab_size, (2, 32))
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)

    def forward_step(it, model):
        return model(next(it), positions, attention_mask=None), lambda o: (o.sum() * 0, {"logits": o.detach()})

    # two micro-batches of one sequence: the interleaved schedule needs at least pp micro-batches
    iters = [iter([ids[:1], ids[1:]]) for _ in chunks]
    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iters if vpp > 1 else iters[0],
                                      model=chunks if vpp > 1 else chunks[0], num_microbatches=2, seq_length=32,
                                      micro_batch_size=1, forward_only=True)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        logits = torch.cat([x["logits"] for x in res], dim=0)
        full = gather_from_tensor_model_parallel_region(logits)[..., :r.model.vocab_size]
        if ps.get_tensor_model_parallel_rank() == 0:
            torch.save({"ids": ids, "logits": full}, out)
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1] == "--jobs":
        main(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), json.loads(Path(sys.argv[2]).read_text()))
    else:
        main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
             [{"hf": sys.argv[1], "out": sys.argv[5], "ckpt": (sys.argv[6:7] or [None])[0]}])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
