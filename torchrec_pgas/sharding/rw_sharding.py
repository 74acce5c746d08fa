"""``pgas_row_wise``: row-wise sharding whose two collectives are one-sided puts.

Same shards as TorchRec ``row_wise`` (``ceil(N/W)`` row blocks, TBE-backed
weights, identical ``state_dict``), different data movement. One step, for W
ranks with local batch B and the F features of this sharding:

1. index dist (requester): bucketize each local bag's ids by owning rank
   (local row = id - owner * block) and put ids, lengths and weights into the
   owner's receive block for this source; then signal the owner.
2. fused lookup + output (owner): for every source, remote ones first, wait for
   its signal, pool the received bags from the local rows, put the partial
   pooled ``[B, D]`` block straight into the requester's output block for this
   owner, in its final layout; then signal the requester.
3. combine (requester): wait for the W owners, sum the partials in rank order,
   apply mean pooling.

No splits exchange, no unpack, no reduce-scatter. Stages 2 and 3 run inside the
lookup module; the output dist has nothing left to move.
"""

from typing import List

import torch
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingInfo,
)
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType

from torchrec_pgas.sharding.device.features import FeatureOwners
from torchrec_pgas.sharding.device_step import DeviceStep
from torchrec_pgas.sharding.host_step import HostRwStep
from torchrec_pgas.sharding.stages import PgasShardingMixin, pooled_output_dtype
from torchrec_pgas.sharding.step import PgasStep, StepSpec
from torchrec_pgas.types import PGAS_ROW_WISE, PgasConfig, bounds_check_mode_from_fused_params


def row_wise_step(spec: StepSpec, env: ShardingEnv, device: torch.device) -> PgasStep:
    """Fused kernels on CUDA (nvshmem backend), the host path on CPU (shm)."""
    if device.type == "cuda":
        return DeviceStep(spec, env, device, FeatureOwners.row_wise(env.world_size, spec.is_mean))
    return HostRwStep(spec, env, device)


class PgasRwPooledEmbeddingSharding(PgasShardingMixin, RwPooledEmbeddingSharding):
    """TorchRec RW shards and grouping; PGAS input dist, lookup and output dist."""

    _instances: int = 0
    _kind = PGAS_ROW_WISE
    _lookup_sharding_type = ShardingType.ROW_WISE  # RW semantics: MEAN runs as SUM, divided after

    def _build_step(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                    config: PgasConfig) -> PgasStep:
        tables = [t for g in self._grouped_embedding_configs for t in g.embedding_tables]
        # Allocation is collective and DMP shards in the same order on every rank.
        PgasRwPooledEmbeddingSharding._instances += 1
        spec = StepSpec.over_tables(f"pgas_rw.{PgasRwPooledEmbeddingSharding._instances}", PGAS_ROW_WISE, tables,
                                    env.world_size, config,
                                    bounds_check_mode_from_fused_params(sharding_infos[0].fused_params),
                                    pooled_output_dtype(sharding_infos, self._kind))
        assert self._device is not None
        return row_wise_step(spec, env, self._device)
