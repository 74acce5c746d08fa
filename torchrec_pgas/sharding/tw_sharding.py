"""``pgas_table_wise``: table-wise sharding whose two all-to-alls are one-sided puts.

Same placement as TorchRec ``table_wise`` (each table whole on one rank,
TBE-backed weights, identical ``state_dict``), different data movement: the
requester puts each owner's features straight into the owner, and the owner
writes every requester's pooled rows straight into that requester's output
block in the stock TW column order (``host_step.py``, ``device_step.py``). No splits exchange, no
output all-to-all.
"""

from typing import List

import torch
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingInfo,
)
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv

from torchrec_pgas.sharding.device.features import FeatureOwners
from torchrec_pgas.sharding.device_step import DeviceStep
from torchrec_pgas.sharding.host_step import HostTwStep
from torchrec_pgas.sharding.stages import PgasShardingMixin, pooled_output_dtype
from torchrec_pgas.sharding.step import PgasStep, StepSpec
from torchrec_pgas.types import PGAS_TABLE_WISE, PgasConfig, bounds_check_mode_from_fused_params


def table_wise_step(spec: StepSpec, env: ShardingEnv, device: torch.device) -> PgasStep:
    """Fused kernels on CUDA (nvshmem backend), the host path on CPU (shm). Both keep whole tables."""
    if device.type == "cuda":
        owners = FeatureOwners.table_wise(spec.features_per_rank, env.rank, spec.is_mean)
        return DeviceStep(spec, env, device, owners)
    return HostTwStep(spec, env, device)


class PgasTwPooledEmbeddingSharding(PgasShardingMixin, TwPooledEmbeddingSharding):
    """TorchRec TW shards and grouping; PGAS input dist, lookup and output dist."""

    _instances: int = 0
    _kind = PGAS_TABLE_WISE

    def _build_step(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                    config: PgasConfig) -> PgasStep:
        tables = self.embedding_tables()  # in feature_names() order: rank by rank
        # Allocation is collective and DMP shards in the same order on every rank.
        PgasTwPooledEmbeddingSharding._instances += 1
        spec = StepSpec.over_tables(f"pgas_tw.{PgasTwPooledEmbeddingSharding._instances}", PGAS_TABLE_WISE, tables,
                                    1, config, bounds_check_mode_from_fused_params(sharding_infos[0].fused_params),
                                    pooled_output_dtype(sharding_infos, self._kind),
                                    features_per_rank=tuple(self.features_per_rank()),
                                    dim_sum_per_rank=tuple(self._dim_sum_per_rank()))
        assert self._device is not None
        return table_wise_step(spec, env, self._device)
