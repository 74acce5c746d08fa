"""``pgas_table_wise``: table-wise sharding whose two all-to-alls are one-sided puts.

Same placement as TorchRec ``table_wise`` (each table whole on one rank,
TBE-backed weights, identical ``state_dict``), different data movement: the
requester puts each owner's features straight into the owner, and the owner
writes every requester's pooled rows straight into that requester's output
block in the stock TW column order (``tw_pipeline.py``). No splits exchange, no
output all-to-all.
"""

from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingInfo,
)
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType

from torchrec_pgas.sharding.common import PgasPipeline, PgasShardingMixin, pooled_output_dtype
from torchrec_pgas.sharding.tw_pipeline import make_tw_pipeline
from torchrec_pgas.types import PGAS_TABLE_WISE, PgasConfig, bounds_check_mode_from_fused_params


class PgasTwPooledEmbeddingSharding(PgasShardingMixin, TwPooledEmbeddingSharding):
    """TorchRec TW shards and grouping; PGAS input dist, lookup and output dist."""

    _instances: int = 0
    _kind = PGAS_TABLE_WISE

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        pgas_config: Optional[PgasConfig] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        tables = self.embedding_tables()  # in feature_names() order: rank by rank
        if any(t.has_feature_processor for t in tables):
            raise NotImplementedError(
                "pgas_table_wise does not support feature processors (tables "
                f"{[t.name for t in tables if t.has_feature_processor]})"
            )
        self._pipeline: Optional[PgasPipeline] = None
        if self._device is None or self._device.type == "meta":
            return
        fused = sharding_infos[0].fused_params or {}
        # Allocation is collective and DMP shards in the same order on every rank.
        PgasTwPooledEmbeddingSharding._instances += 1
        self._pipeline = make_tw_pipeline(
            name=f"pgas_tw.{PgasTwPooledEmbeddingSharding._instances}",
            env=env,
            device=self._device,
            feature_names=self.feature_names(),
            feature_tables=[t.name for t in tables for _ in t.feature_names],
            feature_hash_sizes=[t.num_embeddings for t in tables for _ in t.feature_names],
            feature_dims=[t.embedding_dim for t in tables for _ in t.feature_names],
            feature_is_mean=[t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names],
            is_weighted=any(t.is_weighted for t in tables),
            config=pgas_config or PgasConfig(),
            bounds_check_mode=bounds_check_mode_from_fused_params(fused),
            features_per_rank=self.features_per_rank(),
            dim_sum_per_rank=self._dim_sum_per_rank(),
            out_dtype=pooled_output_dtype(sharding_infos, self._kind),
        )
