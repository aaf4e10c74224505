"""What a forward pass keeps for backward, measured: the bytes of the distinct storages autograd saves (weights
excluded) plus the outputs the training loop holds. Used in-process for Hugging Face models, and run under torchrun
for Megatron-Core (its CPU shim and process groups stay out of the pytest process):

    torchrun --nproc_per_node TP tests/activation_probe.py CASES.json OUT.json

Each case builds the toolkit's Megatron GPTModel (local spec, CPU) with 1 and with 2 layers and records the kept
bytes of one forward with labels on every rank; a layer is the difference, the rest of the model what is left.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kept_bytes(forward, params) -> int:
    """Bytes `forward()` leaves alive for backward: each storage counted once, whatever views of it were saved
    (a view keeps its whole storage), parameters not counted (weights saved by matmuls are not activations), and
    the tensors forward returns included (the loop holds them until backward). Checkpoint wrappers that save
    their inputs show up here too, since they save them through the same hooks."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = forward()
    for t in outputs:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def megatron_recipe(case: dict, layers: int, tp: int):
    from toolkit.recipe import load_recipe

    m = case["model"]
    sets = [f"model.{k}={v}" for k, v in m.items()] + [
        "model.preset=null", f"model.num_layers={layers}", f"training.precision={case['precision']}",
        f"training.activation_checkpointing={case['recompute']}", f"data.seq_len={case['seq']}",
        f"training.micro_batch_size={case['micro']}", f"training.global_batch_size={case['micro']}",
        "parallel.backend=megatron", f"parallel.world_size={tp}", f"parallel.tp={tp}", f"parallel.sp={case['sp']}"]
    return load_recipe("tiny_zero0", sets)


def megatron_kept(case: dict, layers: int, tp: int) -> int:
    from toolkit.megatron import runtime
    from toolkit.recipe import resolve

    r = megatron_recipe(case, layers, tp)
    chunk = runtime.build_chunks(r, resolve(r, tp).layout, on_gpu=False)[0].train()
    torch.manual_seed(0)
    b, s = case["micro"], case["seq"]
    ids = torch.randint(0, r.model.vocab_size, (b, s))
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    return kept_bytes(lambda: [chunk(ids, positions, attention_mask=None, labels=ids)], chunk.parameters())


def main(cases_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from toolkit.megatron import runtime
    from toolkit.recipe import resolve

    cases = json.loads(Path(cases_path).read_text())
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    first = megatron_recipe(cases[0], 1, tp)
    runtime.init_parallel(first, resolve(first, tp).layout, on_gpu=False)  # groups once; sp is per model config
    rows = [{**c, "L1": megatron_kept(c, 1, tp), "L2": megatron_kept(c, 2, tp)} for c in cases]
    every = [None] * tp
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps([{**row, "rank": rank} for rank, rs in enumerate(every) for row in rs]))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
