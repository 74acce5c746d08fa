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
3. finalize (requester): wait for the W owners, sum the partials in rank order,
   apply mean pooling.

No splits exchange, no unpack, no reduce-scatter. Stages 2 and 3 run inside the
lookup module; the output dist has nothing left to move.
"""

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, NoWait, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.rw_pipeline import PgasRwPipeline, make_rw_pipeline
from torchrec_pgas.types import PgasConfig, PgasError, bounds_check_mode_from_fused_params


class PgasRwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Stage 1. Returns the local features: the requester needs them for mean pooling."""

    def __init__(self, pipeline: Optional[PgasRwPipeline]) -> None:
        super().__init__()
        self._pipeline = pipeline

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if self._pipeline is None:
            raise PgasError("pgas_row_wise module was sharded on the meta device")
        self._pipeline.index_dist(sparse_features)
        return NoWait(NoWait(sparse_features))


class PgasRwPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """Stages 2 and 3 around the stock TBE-backed lookup (weights, state_dict, optimizer)."""

    def __init__(self, pipeline: Optional[PgasRwPipeline], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pipeline = pipeline
        self._tbes = [emb.emb_module for emb in self._emb_modules]

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if self._pipeline is None:
            raise PgasError("pgas_row_wise module was sharded on the meta device")
        return self._pipeline.lookup(sparse_features, super().forward, self._tbes)

    def check(self) -> None:
        """Synchronize and raise what the device recorded for finished steps."""
        if self._pipeline is not None:
            self._pipeline.check()


class PgasRwPooledEmbeddingDist(
    BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]
):
    """The owners already wrote the pooled output in place; nothing is left to move."""

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: Optional[EmbeddingShardingContext] = None,
    ) -> Awaitable[torch.Tensor]:
        return NoWait(local_embs)


class PgasRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """TorchRec RW shards and grouping; PGAS input dist, lookup and output dist."""

    _instances: int = 0

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        pgas_config: Optional[PgasConfig] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        if self._has_feature_processor:
            raise NotImplementedError(
                "pgas_row_wise does not support feature processors (tables "
                f"{[t.name for t in self.embedding_tables() if t.has_feature_processor]})"
            )
        self._pipeline: Optional[PgasRwPipeline] = None
        if self._device.type == "meta":
            return
        tables = [t for g in self._grouped_embedding_configs for t in g.embedding_tables]
        feature_tables = [t.name for t in tables for _ in t.feature_names]
        # Allocation is collective and DMP shards in the same order on every rank.
        PgasRwPooledEmbeddingSharding._instances += 1
        self._pipeline = make_rw_pipeline(
            name=f"pgas_rw.{PgasRwPooledEmbeddingSharding._instances}",
            env=env,
            device=self._device,
            feature_names=self.feature_names(),
            feature_tables=feature_tables,
            feature_hash_sizes=self._get_feature_hash_sizes(),
            feature_dims=[t.embedding_dim for t in tables for _ in t.feature_names],
            feature_is_mean=[t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names],
            is_weighted=any(t.is_weighted for t in tables),
            config=pgas_config or PgasConfig(),
            bounds_check_mode=bounds_check_mode_from_fused_params(sharding_infos[0].fused_params),
        )

    def create_input_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasRwSparseFeaturesDist(self._pipeline)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> PgasRwPooledEmbeddingsLookup:
        return PgasRwPooledEmbeddingsLookup(
            self._pipeline,
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            # RW semantics: MEAN runs as SUM in the TBE, divided after the sum.
            sharding_type=ShardingType.ROW_WISE,
            env=self._env,
        )

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        return PgasRwPooledEmbeddingDist()


def strip_pgas_fused_params(info: EmbeddingShardingInfo, key: str) -> EmbeddingShardingInfo:
    if not info.fused_params or key not in info.fused_params:
        return info
    fused = {k: v for k, v in info.fused_params.items() if k != key}
    return dataclasses.replace(info, fused_params=fused)
