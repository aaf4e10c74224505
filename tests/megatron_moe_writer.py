"""Run under torchrun with 2 ranks: Megatron-LM checkpoints of a mixture of experts (Qwen3-MoE) written by Megatron-Core's
own code from real GPTModels at expert parallelism 2, and Megatron-Core's own loads of what `toolkit convert` wrote.

    torchrun --nproc_per_node 2 tests/megatron_moe_writer.py HF_MOE OUT TORCH_DIST_ITER LEGACY_ROOT

OUT/legacy: the legacy layout (`--ckpt-format torch`, `--no-save-optim`) at EP2, as Megatron-LM's save_checkpoint
names it: iter_0000003/mp_rank_00_00{0,1}/model_optim_rng.pt (the last part the expert-parallel rank), each holding
args (pretrain_gpt.py's model arguments with the objects a real run's args hold, plus what --num-experts,
--moe-router-topk, --moe-ffn-hidden-size, --qk-layernorm and --expert-model-parallel-size set), checkpoint_version,
iteration and `model` = the GPTModel's state_dict_for_save_checkpoint() (its own routed experts, local indices).
Then Megatron-Core's dist_checkpointing.load reads TORCH_DIST_ITER (a `toolkit convert --to torch_dist` output of
HF_MOE) into GPTModels at EP2 and EP1 x DP2, and LEGACY_ROOT (`--to megatron_lm --ep 2`) loads into EP2 GPTModels with
strict=True (tests/megatron_dist_load_probe.py): "loaded 1x1x1x2", "loaded 1x1x1", "loaded legacy 1x1x1x2".
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dist_load_probe import check, check_legacy  # noqa: E402
from megatron_native_writer import build, megatron_lm_args  # noqa: E402

from toolkit.train.dist import init_distributed  # noqa: E402


def legacy_moe(hf: str, out: Path) -> None:
    from megatron.core import parallel_state as ps

    r, layout, chunks = build(hf, 1, 1, 1, ("parallel.ep=2",))
    args = megatron_lm_args(r, layout)
    m = r.model
    args.qk_layernorm, args.num_experts, args.moe_router_topk = True, m.num_experts, m.num_experts_per_tok
    args.moe_ffn_hidden_size, args.moe_router_pre_softmax = m.moe_intermediate_size, not m.norm_topk_prob
    args.moe_router_score_function, args.moe_router_load_balancing_type = "softmax", "aux_loss"
    args.moe_aux_loss_coeff, args.moe_layer_freq, args.moe_shared_expert_intermediate_size = 1e-3, 1, None
    args.moe_token_dispatcher_type, args.expert_model_parallel_size = "alltoall", layout.ep
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 3, "num_floating_point_operations_so_far": 0,
             "model": chunks[0].state_dict_for_save_checkpoint()}
    folder = out / "iter_0000003" / f"mp_rank_00_{ps.get_expert_model_parallel_rank():03d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "model_optim_rng.pt")
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("3")
    dist.barrier()
    ps.destroy_model_parallel()


def main(hf: str, out: str, torch_dist_iter: str, legacy_root: str) -> None:
    init_distributed(with_deepspeed=False)
    legacy_moe(hf, Path(out) / "legacy")
    check(hf, torch_dist_iter, 1, 1, 1, 2)
    check(hf, torch_dist_iter, 1, 1, 1, 1)
    check_legacy(hf, legacy_root, 1, 1, 1, 2)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:5])
