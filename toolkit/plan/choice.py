"""One candidate layout the planner weighs (backend, DP x TP x PP x CP, ZeRO, offload, recomputation, micro-batch),
and how it becomes recipe keys."""
from __future__ import annotations

from dataclasses import dataclass, replace

from toolkit.recipe.checks import resolve
from toolkit.recipe.schema import Recipe


@dataclass(frozen=True)
class Choice:
    backend: str
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    recompute: str = "none"
    micro: int = 1
    accum: int = 1
    ep: int = 1
    """Expert-parallel size (Megatron, mixture of experts): taken from the dp x cp ranks, so world is unchanged."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        if self.backend == "deepspeed":
            parts = [f"DeepSpeed ZeRO-{self.zero}", f"dp{self.dp}"]
            if self.offload_optimizer != "none":
                parts.append(f"optimizer->{self.offload_optimizer}")
            if self.offload_params != "none":
                parts.append(f"params->{self.offload_params}")
        else:
            parts = ["Megatron", f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
            parts += [f"vpp{self.vpp}"] * (self.vpp > 1) + [f"cp{self.cp}"] * (self.cp > 1) + [f"dp{self.dp}"]
            parts += [f"ep{self.ep}"] * (self.ep > 1)
            parts.append("distopt" if self.zero == 1 else "ddp")
        parts.append(f"mb{self.micro}x{self.accum}")
        parts.append({"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}
                     [self.recompute])
        return " ".join(parts)

    def recipe_keys(self) -> dict[str, object]:
        """The recipe keys (dotted) that select this layout."""
        return {"parallel.backend": self.backend, "parallel.world_size": self.world, "parallel.dp": None,
                "parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.vpp": self.vpp, "parallel.cp": self.cp,
                "parallel.sp": self.sp, "parallel.zero_stage": self.zero, "parallel.ep": self.ep,
                "parallel.offload_optimizer": self.offload_optimizer, "parallel.offload_params": self.offload_params,
                "training.micro_batch_size": self.micro, "training.grad_accum_steps": self.accum,
                "training.activation_checkpointing": self.recompute}

    def with_(self, **kw) -> Choice:
        return replace(self, **kw)


def apply(r: Recipe, c: Choice) -> Recipe:
    """The recipe with this layout: what the frameworks would run (nvme offload gets a placeholder path)."""
    nvme = "nvme" in (c.offload_optimizer, c.offload_params)
    parallel = r.parallel.model_copy(update=dict(
        backend=c.backend, world_size=c.world, dp=None, tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, sp=c.sp, ep=c.ep,
        zero_stage=c.zero, offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
        nvme_path=r.parallel.nvme_path or ("/local_nvme" if nvme else None)))
    training = r.training.model_copy(update=dict(micro_batch_size=c.micro, grad_accum_steps=c.accum,
                                                 activation_checkpointing=c.recompute))
    return r.model_copy(update=dict(parallel=parallel, training=training))


def from_recipe(r: Recipe, world: int) -> Choice:
    """The recipe's own layout on `world` ranks (batch arithmetic as `toolkit validate` derives it)."""

    plan = resolve(r, world)
    lay, b, p = plan.layout, plan.batch, r.parallel
    return Choice(lay.backend, lay.dp, lay.tp, lay.pp, lay.vpp, lay.cp, lay.sp, lay.zero_stage,
                  p.offload_optimizer, p.offload_params, r.training.activation_checkpointing, b.micro_batch,
                  b.grad_accum, lay.ep)
