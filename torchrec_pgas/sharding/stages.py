"""The TorchRec modules that run a PGAS step (``step.py``) in an ``EmbeddingSharding``'s slots.

The input dist runs the index dist, the lookup runs the owner and requester
stages around the stock TBE-backed lookup (weights, ``state_dict``, fused
optimizer stay stock), and the output dist has nothing left to move.
"""

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.types import Awaitable, NoWait, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.types import PgasConfig, PgasError

if TYPE_CHECKING:
    from torchrec_pgas.sharding.step import PgasStep


def require_step(step: Optional["PgasStep"], kind: str) -> "PgasStep":
    if step is None:
        raise PgasError(f"{kind} module was sharded on the meta device")
    return step


class PgasSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """The index dist. Returns the local features: the requester still needs them (mean pooling)."""

    def __init__(self, step: Optional["PgasStep"], kind: str) -> None:
        super().__init__()
        self._step = step
        self._kind = kind

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        step = require_step(self._step, self._kind)
        return NoWait(NoWait(run_index_dist(step, step.in_sharding_order(sparse_features))))


def run_index_dist(step: "PgasStep", features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The step's index dist of ``features`` (returned: the lookup needs them); a step it gives up is given up in
    the model's other shardings too (``StepGroup.forward_failed``)."""
    issued = step.issued
    try:
        step.index_dist(features)
    except PgasError as err:
        if step.issued > issued:  # the step was given up; an error before it claimed one consumed none
            step.forward_failed(err, step.issued)
        raise
    return features


class PgasPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """The owner and requester stages around the stock TBE-backed lookup (weights, state_dict,
    optimizer): the stock lookup pools what the host path received, the device path reads its TBEs."""

    def __init__(self, step: Optional["PgasStep"], kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._step = step
        self._kind = kind
        self._tbes = [emb.emb_module for emb in self._emb_modules]

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        step = require_step(self._step, self._kind)
        looked_up = step.looked_up
        try:
            return step.lookup(sparse_features, super().forward, self._tbes)
        except PgasError as err:
            if step.looked_up > looked_up:  # as in the index dist: only a step this lookup consumed
                step.forward_failed(err, step.looked_up)
            raise


class PgasShardingMixin:
    """The ``create_*`` of an ``EmbeddingSharding`` whose dists are PGAS stages; mixed in before the
    stock sharding class, whose shards, grouping and TBE-backed lookup it keeps."""

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        pgas_config: Optional[PgasConfig] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        """The stock sharding's shards and grouping, then the step (``_build_step``; none on the meta device)."""
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)  # type: ignore[call-arg]
        processed = [i.embedding_config.name for i in sharding_infos if i.embedding_config.has_feature_processor]
        if processed:
            raise NotImplementedError(f"{self._kind} does not support feature processors (tables {processed})")
        self._step = None
        if self._device is not None and self._device.type != "meta":
            self._step = self._build_step(sharding_infos, env, pgas_config or PgasConfig())

    def _build_step(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                    config: PgasConfig) -> "PgasStep":
        """The sharding's step over its shards (allocation is collective: every rank shards alike)."""
        raise NotImplementedError

    @property
    def step(self) -> Optional["PgasStep"]:
        """The sharding's PGAS step (None when sharded on the meta device)."""
        return self._step

    _step: Optional["PgasStep"]
    _kind: str
    _lookup_sharding_type: Optional[ShardingType] = None  # ROW_WISE: MEAN runs as SUM in the TBE
    reads_input_order = True  # the step may read the EBC's input KJT in place (``PgasStep.read_input_order``)
    _grouped_embedding_configs: Any
    _pg: Any
    _device: Optional[torch.device]
    _env: ShardingEnv

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasSparseFeaturesDist(self._step, self._kind)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> "PgasPooledEmbeddingsLookup":
        return PgasPooledEmbeddingsLookup(
            self._step,
            self._kind,
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=self._lookup_sharding_type,
            env=self._env,
        )

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        return PgasPooledEmbeddingDist()


class PgasPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]):
    """The owners already wrote the pooled output in place; nothing is left to move."""

    def forward(
        self,
        local_embs: torch.Tensor,
        sharding_ctx: Optional[EmbeddingShardingContext] = None,
    ) -> Awaitable[torch.Tensor]:
        return NoWait(local_embs)


def pooled_output_dtype(infos: Sequence[EmbeddingShardingInfo], kind: str) -> torch.dtype:
    """The one output dtype of a PGAS sharding's tables (``fused_params["output_dtype"]``, FP32 by default):
    the kernels pool every table into one ``[B, D]`` block, and every rank must agree without asking."""
    per_table = {info.embedding_config.name: SparseType((info.fused_params or {}).get("output_dtype", SparseType.FP32))
                 for info in infos}
    if len(set(per_table.values())) > 1:
        raise PgasError(f"{kind}: tables of one sharding need one output dtype, got "
                        f"{ {t: d.value for t, d in per_table.items()} }")
    return next(iter(per_table.values()), SparseType.FP32).as_dtype()


def strip_pgas_fused_params(info: EmbeddingShardingInfo, key: str) -> EmbeddingShardingInfo:
    if not info.fused_params or key not in info.fused_params:
        return info
    fused = {k: v for k, v in info.fused_params.items() if k != key}
    return dataclasses.replace(info, fused_params=fused)

