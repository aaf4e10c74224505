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
The distributed optimizer's flat state after two bf16 Adam steps of Megatron-Core's own optimizer, each folder with
live.safetensors (the live optimizer's state by name, experts under their global indices; megatron_native_writer):
OUT/legacy_distopt_ep2, Megatron-LM's legacy layout at EP2 (the dense optimizer over DP2, the experts' over their own
expert-data-parallel group) with each rank's distrib_optim.pt from save_parameter_state; OUT/dp_reshardable_ep1,
torch_dist at EP1 x DP2 in Megatron-LM's default dp_reshardable buffers (one optimizer: at ep 1 the experts share the
dense buffers); OUT/dp_reshardable_ep2, the same at EP2 (two chained optimizers' buffers). OUT/legacy_plain_ep2: the
plain optimizer's state at EP2 in each rank's model_optim_rng.pt (the two chained optimizers' state dicts).
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dist_load_probe import check, check_legacy  # noqa: E402
from megatron_native_writer import build, legacy_optim, megatron_lm_args, torch_dist_optim  # noqa: E402

from toolkit.train.dist import init_distributed  # noqa: E402


def legacy_moe(hf: str, out: Path) -> None:
    from megatron.core import parallel_state as ps

    r, layout, chunks = build(hf, 1, 1, 1, ("parallel.ep=2",))
    args = moe_args(r, layout)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 3, "num_floating_point_operations_so_far": 0,
             "model": chunks[0].state_dict_for_save_checkpoint()}
    folder = out / "iter_0000003" / f"mp_rank_00_{ps.get_expert_model_parallel_rank():03d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "model_optim_rng.pt")
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("3")
    dist.barrier()
    ps.destroy_model_parallel()


def moe_args(r, layout):
    """Megatron-LM's args of a Qwen3-MoE run: the model's, plus what --num-experts, --moe-router-topk,
    --moe-ffn-hidden-size, --qk-layernorm and --expert-model-parallel-size set."""
    args = megatron_lm_args(r, layout)
    m = r.model
    args.qk_layernorm, args.num_experts, args.moe_router_topk = True, m.num_experts, m.num_experts_per_tok
    args.moe_ffn_hidden_size, args.moe_router_pre_softmax = m.moe_intermediate_size, not m.norm_topk_prob
    args.moe_router_score_function, args.moe_router_load_balancing_type = "softmax", "aux_loss"
    args.moe_aux_loss_coeff, args.moe_layer_freq, args.moe_shared_expert_intermediate_size = 1e-3, 1, None
    args.moe_token_dispatcher_type, args.expert_model_parallel_size = "alltoall", layout.ep
    return args


def main(hf: str, out: str, torch_dist_iter: str, legacy_root: str) -> None:
    init_distributed(with_deepspeed=False)
    legacy_optim(hf, Path(out) / "legacy_distopt_ep2", 1, "bf16", extra=("parallel.ep=2",), args_for=moe_args)
    legacy_optim(hf, Path(out) / "legacy_plain_ep2", 1, "bf16", extra=("parallel.ep=2",), args_for=moe_args,
                 distributed=False)
    for ep in (1, 2):
        torch_dist_optim(hf, {Path(out) / f"dp_reshardable_ep{ep}": "dp_reshardable"}, 1, 1, "bf16",
                         extra=(f"parallel.ep={ep}",), args_for=moe_args)
    legacy_moe(hf, Path(out) / "legacy")
    check(hf, torch_dist_iter, 1, 1, 1, 2)
    check(hf, torch_dist_iter, 1, 1, 1, 1)
    check_legacy(hf, legacy_root, 1, 1, 1, 2)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    from toolkit.train.dist import shutdown

    shutdown()  # leave the process group together: exiting with it alive intermittently aborts a rank
