"""What the planner assumes about a cluster: GPU memory, link bandwidths, peak FLOP/s and offload speeds.

Every assumption is a named field with its default for an H100 80GB SXM node (8 GPUs on NVLink, one 400 Gb/s
InfiniBand NIC per GPU), overridable from the command line, and printed with every plan: an estimate is only as
good as these numbers, so they are never hidden.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    """Memory of one GPU as the vendor states it (80 for H100/A100 80GB)."""
    cpu_memory_gib: float = 1024.0
    """Host RAM per node, for ZeRO-Offload."""
    nvme_gib: float = 3500.0
    """Local NVMe per node, for ZeRO-Infinity."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU (H100 SXM)."""
    matmul_efficiency: float = 0.5
    """Fraction of peak the model's matmuls reach; 0.4-0.6 is what well-tuned Llama training reports."""
    hbm_gbps: float = 3350.0
    """GPU memory bandwidth (bounds the optimizer step)."""
    intra_gbps: float = 360.0
    """NCCL bus bandwidth per GPU inside a node (NVLink 4: 450 GB/s per direction, about 80% reached)."""
    inter_gbps: float = 40.0
    """NCCL bus bandwidth per GPU across nodes (one 400 Gb/s NIC per GPU at about 80%)."""
    pcie_gbps: float = 25.0
    """Host-device copies per GPU (offload)."""
    cpu_adam_params_per_s: float = 2.0e9
    """Parameters per second DeepSpeed's CPU Adam updates on one node (all its cores)."""
    nvme_gbps: float = 6.0
    """NVMe read or write bandwidth of one node."""
    reserve_gib: float = 2.5
    """GPU memory torch never sees: CUDA context, NCCL and cuBLAS workspaces."""
    headroom: float = 0.92
    """Plan within this fraction of the rest: the caching allocator fragments."""

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def usable_gpu_bytes(self) -> int:
        """Bytes a rank's tensors may take: (memory - reserve) x headroom."""
        return int((self.gpu_memory_gib - self.reserve_gib) * self.headroom * GiB)

    @property
    def usable_cpu_bytes(self) -> int:
        return int(self.cpu_memory_gib * 0.9 * GiB)  # leave the OS, the dataloader and pinned staging some room

    def link(self, span: int) -> str:
        """"nvlink" when a group of `span` consecutive ranks stays inside one node, else "network"."""
        return "nvlink" if span <= self.gpus_per_node else "network"

    def bandwidth(self, link: str) -> float:
        return (self.intra_gbps if link == "nvlink" else self.inter_gbps) * 1e9

    def describe(self) -> list[str]:
        d = asdict(self)
        return [f"{k} = {v}" for k, v in d.items()]
