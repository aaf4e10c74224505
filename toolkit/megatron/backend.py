"""The Megatron-Core backend behind the training loop: model chunks, DDP, optimizer and per-rank checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.format.names import rank_tag
from toolkit.megatron import runtime, torch_dist_ckpt
from toolkit.megatron.checkpoint import checkpoint_bytes, load_rank_state, save_rank_state, written_files
from toolkit.megatron.runtime import eval_step, train_step
from toolkit.model import to_hf_config
from toolkit.recipe import Plan
from toolkit.train.dist import DistInfo
from toolkit.train.schedule import lr_multiplier


class MegatronBackend:
    name = "megatron"

    def __init__(self, plan: Plan, info: DistInfo):
        from megatron.core import parallel_state as ps  # lazy: Megatron runs only


        r, layout = plan.recipe, plan.layout
        self.recipe, self.on_gpu = r, info.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        runtime.init_parallel(r, layout, self.on_gpu)
        chunks = runtime.build_chunks(r, layout, self.on_gpu)
        if r.model.pretrained:
            runtime.load_hf_weights(chunks, r.model.hf_path, r, layout)
        self.chunks, self.optimizer = runtime.wrap_and_optimize(chunks, r, layout)
        self.dp_rank, self.rank = ps.get_data_parallel_rank(), info.rank
        # with expert parallelism each expert-parallel rank has files of its own (its experts differ)
        self.ep_rank = ps.get_expert_model_parallel_rank() if layout.ep > 1 else None
        self.rank_tag = rank_tag(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                 self.ep_rank)
        self.layout_meta = {"world_size": layout.world_size, "zero_stage": layout.zero_stage, "dp": layout.dp,
                            "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp,
                            **({"ep": layout.ep} if layout.ep > 1 else {})}

    def current_lr(self, step: int) -> float:
        """The toolkit's schedule, the same on both backends (Megatron's OptimizerParamScheduler would train its
        first warm-up step at lr 0)."""
        t = self.recipe.training
        s = t.schedule
        return t.optimizer.lr * lr_multiplier(step, s.warmup_steps, t.steps, s.decay, s.min_lr / t.optimizer.lr)

    def step(self, batches: list[dict], lr: float, want_grad_norm: bool):

        return train_step(self.chunks, self.optimizer, batches, self.recipe, lr, self.device)

    def evaluate(self, batches: list[dict]) -> torch.Tensor:
        """(sum of token losses, token count) this rank contributes to the validation loss (runtime.eval_step)."""
        return eval_step(self.chunks, batches, self.recipe, self.device)

    def save_state(self, root: Path, tag: str) -> None:

        with runtime.params_synced(self.chunks):  # the weights of this step on every rank, not half the last one's
            if self.recipe.checkpoint.format == torch_dist_ckpt.FORMAT:  # Megatron-Core's dist_checkpointing
                torch_dist_ckpt.save(self, root / tag, int(tag.split("_")[-1]))
            else:
                save_rank_state(self, root / tag)

    def load_state(self, tag_dir: Path) -> None:
        """By what the checkpoint holds (not by checkpoint.format): a run may resume in the other format."""
        if torch_dist_ckpt.is_torch_dist(tag_dir):
            torch_dist_ckpt.load(self, tag_dir)
        else:
            load_rank_state(self, tag_dir)

    @property
    def hf_config(self) -> dict:
        """The Hugging Face config of the recipe's model (a resumed checkpoint must hold the same architecture)."""

        return to_hf_config(self.recipe.model).to_dict()

    def rank_files(self, tag_dir: Path) -> list[str]:
        """The checkpoint files this rank wrote (it hashes them for the manifest)."""

        if self.recipe.checkpoint.format == torch_dist_ckpt.FORMAT:
            return torch_dist_ckpt.written_files(self.rank, tag_dir)
        return written_files(self, tag_dir)

    def checkpoint_bytes(self) -> int:
        """This rank's share of a checkpoint's size (to check the disk before the first save)."""

        return checkpoint_bytes(self)
