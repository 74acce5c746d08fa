"""Where the ranks of a job run: one GPU each, or W ranks sharing one GPU to test multi-rank behaviour.

Production runs one rank per GPU (NCCL for ``torch.distributed``, plans with ``local_size`` = ranks per
host). A machine with fewer GPUs than ranks can still run the real multi-process path, for correctness
only: every rank on ``cuda:0``, gloo for ``torch.distributed`` (NCCL refuses two ranks on one GPU), and
plans built with ``local_size=1`` so that TorchRec places every rank's shards on ``cuda:0``. NVSHMEM runs
the ranks as PEs of that GPU and stock TorchRec runs over gloo the same way. The ranks then take turns on
one GPU: times mean nothing.

The mode is on when ``TORCHREC_PGAS_SHARED_GPU=1`` or when the ranks of a host outnumber its GPUs.
"""

import os
from dataclasses import dataclass

import torch
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.types import ShardingPlan

SHARED_GPU_ENV = "TORCHREC_PGAS_SHARED_GPU"


@dataclass(frozen=True)
class RankPlacement:
    """How one job's ranks map onto a host's devices (``device_type``: ``cuda`` or ``cpu``)."""

    device_type: str
    shared_gpu: bool

    def device(self, local_rank: int) -> torch.device:
        if self.device_type != "cuda":
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.shared_gpu else local_rank)

    @property
    def backend(self) -> str:
        """The ``torch.distributed`` backend: NCCL with a GPU per rank, else gloo."""
        return "nccl" if self.device_type == "cuda" and not self.shared_gpu else "gloo"

    def local_size(self, local_world_size: int) -> int:
        """The plan's ``local_size``: ranks per host, or 1 when they share a GPU (every shard on ``cuda:0``)."""
        return 1 if self.shared_gpu else local_world_size

    def place_shards(self, plan: ShardingPlan) -> ShardingPlan:
        """``plan`` with every shard on its rank's device here, whatever the plan's ``local_size``: a plan that
        declares nodes smaller than the host (2 nodes x 2 ranks on a 4-GPU host), or whose ranks share a GPU,
        keeps its node groups (its table-row-wise placement) and runs."""
        for module_plan in plan.plan.values():
            for sharding in module_plan.values():  # type: ignore[attr-defined]
                for shard in sharding.sharding_spec.shards if sharding.sharding_spec is not None else ():
                    rank = shard.placement.rank()
                    shard.placement = _remote_device(f"rank:{rank}/{self.device(rank)}")
        return plan


def rank_placement(local_world_size: int, device_type: str = "cuda") -> RankPlacement:
    """The placement of ``local_world_size`` ranks per host on ``device_type`` (see the module docstring)."""
    if device_type != "cuda":
        return RankPlacement("cpu", shared_gpu=False)
    asked = os.environ.get(SHARED_GPU_ENV, "0") == "1"
    return RankPlacement("cuda", shared_gpu=asked or local_world_size > torch.cuda.device_count())


def best_placement(local_world_size: int) -> RankPlacement:
    """GPUs when there are any (shared by the ranks if fewer than them), else CPU."""
    return rank_placement(local_world_size, "cuda" if torch.cuda.is_available() else "cpu")
