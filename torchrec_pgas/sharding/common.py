"""What every PGAS sharding shares: the pipeline state, and its TorchRec stage modules.

``PgasPipeline`` holds the symmetric buffer and its layout, the signal pad, the
host-side checks that need no device sync, and the FIFO step counters; each
sharding type subclasses it (``rw_pipeline.py``, ``tw_pipeline.py``). The three
modules plug a pipeline into TorchRec's ``EmbeddingSharding`` slots: the input
dist runs the index dist, the lookup runs the owner and requester stages, and
the output dist has nothing left to move.
"""

import bisect
import dataclasses
import itertools
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import BaseGroupedFeatureProcessor
from torchrec.distributed.types import Awaitable, NoWait, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import runtime as pgas_runtime
from torchrec_pgas.layout import RwLayout, id_bytes_for
from torchrec_pgas.types import PgasCapacityError, PgasConfig, PgasError, PgasInputError

PoolFn = Callable[[KeyedJaggedTensor], torch.Tensor]


class _NoBackward(torch.autograd.Function):
    """Makes a training step fail loudly instead of silently skipping embedding grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str) -> torch.Tensor:  # type: ignore[override]
        ctx.kind = kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        stock = ctx.kind[len("pgas_"):]
        raise NotImplementedError(
            f"{ctx.kind} has no backward pass yet: shard the tables you train "
            f"with '{stock}' (the state_dict is the same, so checkpoints move freely)"
        )


def no_backward(out: torch.Tensor, kind: str) -> torch.Tensor:
    """``out`` as the result of a ``kind`` forward that must not be trained through."""
    if torch.is_grad_enabled():  # a backward through here must raise, not skip
        return _NoBackward.apply(out.requires_grad_(), kind)
    return out


class PgasPipeline:
    """State shared by the stage modules of one PGAS sharding (``kind``: its sharding type).

    Each stage keeps its own FIFO step counter, the way a GPU stream would; the
    k-th lookup consumes the k-th index dist. Two buffer slots (epoch parity)
    let one index dist run ahead of the lookup, as TorchRec's train pipelines
    do; deeper run-ahead raises.
    """

    def __init__(
        self,
        name: str,
        env: ShardingEnv,
        device: torch.device,
        feature_names: List[str],
        feature_tables: List[str],
        feature_hash_sizes: List[int],
        feature_dims: List[int],
        feature_is_mean: List[bool],
        is_weighted: bool,
        config: PgasConfig,
        bounds_check_mode: BoundsCheckMode,
        kind: str,
        shard_rows: List[int],
        block_dim_sum: int,
    ) -> None:
        """``shard_rows``: per feature, the rows one owner holds of its table (the widest local row
        decides the id width); ``block_dim_sum``: the columns of one owner's output block."""
        num_features = len(feature_names)
        self.kind = kind
        self.layout = RwLayout(
            world_size=env.world_size,
            num_features=num_features,
            max_batch=config.max_local_batch_size,
            ids_capacity=config.ids_capacity(num_features),
            dim_sum=block_dim_sum,
            weighted=is_weighted,
            id_bytes=id_bytes_for(shard_rows),
        )
        self.rt = pgas_runtime.init(env.process_group, device=device, heap_hint=self.layout.nbytes)
        self.rank = self.rt.rank
        self.world_size = self.rt.world_size
        self.device = device
        self.feature_names = feature_names
        self.feature_tables = feature_tables
        self.feature_hash_sizes = feature_hash_sizes
        self.feature_dims = feature_dims
        self.feature_is_mean = feature_is_mean
        self.shard_rows = shard_rows
        self.config = config
        self.bounds_check_mode = bounds_check_mode
        self.buf = self.rt.alloc(name, self.layout.nbytes)
        self.pad = self.rt.alloc_signals(name, self.layout.num_signal_slots)
        self.issued = 0  # index dists issued (epochs are 1-based)
        self.looked_up = 0  # lookups completed
        self._hash_sizes = torch.tensor(feature_hash_sizes, dtype=torch.int64, device=device)
        self._warned: set = set()
        self._input_order: Optional[List[int]] = None  # read_input_order

    def _fail(self, err: PgasError) -> PgasError:
        """Abort the pad so peers waiting on this rank raise instead of hanging."""
        self.rt.abort(self.pad, str(err))
        return err

    def bad_id_message(self, f: int, value: int) -> str:
        return (
            f"{self.kind}: feature '{self.feature_names[f]}' (table "
            f"'{self.feature_tables[f]}') has id {value} outside [0, {self.feature_hash_sizes[f]})"
        )

    def _check_step(self, kjt: KeyedJaggedTensor) -> None:
        """Checks on host-known sizes only (no device sync), before anything is written."""
        lay = self.layout
        if kjt.variable_stride_per_key():
            raise self._fail(
                PgasInputError(f"{self.kind} does not support variable batch size per feature")
            )
        batch = kjt.stride()
        if batch > lay.max_batch:
            raise self._fail(
                PgasCapacityError(
                    f"{self.kind}: local batch size {batch} exceeds "
                    f"PgasConfig.max_local_batch_size={lay.max_batch}"
                )
            )
        if self.issued - self.looked_up >= lay.num_slots:
            raise self._fail(
                PgasError(
                    f"{self.kind}: {self.issued - self.looked_up} index dists are already "
                    f"in flight; at most {lay.num_slots} may run ahead of the lookup"
                )
            )
        nnz = kjt.values().numel()
        if nnz > lay.ids_capacity:
            raise self._fail(
                PgasCapacityError(
                    f"{self.kind}: rank {self.rank} has {nnz} ids in one step, above "
                    f"the capacity of {lay.ids_capacity} (PgasConfig.max_ids_per_rank / "
                    "avg_pooling_capacity)"
                )
            )

    def _next_lookup_epoch(self) -> int:
        if self.looked_up >= self.issued:
            raise self._fail(PgasError(f"{self.kind}: lookup called without an index dist"))
        self.looked_up += 1
        return self.looked_up

    def _order(self) -> List[int]:
        """Remote peers first (their bytes travel), this rank last."""
        return [(self.rank + 1 + k) % self.world_size for k in range(self.world_size)]

    def _checked_ids(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The host path's checks of a step before anything is written; its ids after the bounds mode."""
        self._check_step(kjt)
        return self._check_ids(kjt, kjt.values().to(torch.int64))

    def _check_ids(self, kjt: KeyedJaggedTensor, values: torch.Tensor) -> torch.Tensor:
        """Apply the bounds-check mode; ids decide the owner and the remote address."""
        per_feature = kjt.length_per_key()
        hash_per_id = torch.repeat_interleave(
            self._hash_sizes, torch.tensor(per_feature, device=values.device)
        )
        bad = (values < 0) | (values >= hash_per_id)
        if not bool(bad.any()):
            return values
        pos = int(torch.nonzero(bad)[0])
        f = bisect.bisect_right(list(itertools.accumulate(per_feature)), pos)
        msg = self.bad_id_message(f, int(values[pos]))
        if self.bounds_check_mode == BoundsCheckMode.FATAL:
            raise self._fail(PgasInputError(msg))
        if self.bounds_check_mode == BoundsCheckMode.WARNING and f not in self._warned:
            self._warned.add(f)
            warnings.warn(msg + "; such ids read row 0 (BoundsCheckMode.WARNING)")
        return torch.where(bad, torch.zeros_like(values), values)

    def _source_index(self, src: int, epoch: int) -> Tuple[int, int, int]:
        """Wait for ``src``'s index block of ``epoch``; its (offset, batch, nnz) once the header checks out
        (it decides what is read, so it is checked like any address)."""
        lay = self.layout
        self.rt.wait(self.pad, [lay.index_signal(src)], epoch, self.config.wait_timeout_s,
                     f"index data from rank {src}")
        block = lay.index_block(epoch % lay.num_slots, src)
        h_epoch, h_batch, nnz, _ = self.buf.view(torch.int64, block + lay.header_off, 4).tolist()
        self.rt.check()
        if h_epoch != epoch or not 0 <= h_batch <= lay.max_batch or not 0 <= nnz <= lay.ids_capacity:
            raise self._fail(PgasError(
                f"corrupt index header from rank {src}: epoch {h_epoch}, batch {h_batch}, nnz {nnz}"))
        return block, h_batch, nnz

    def _await_outputs(self, epoch: int, what: str) -> None:
        """Wait until every owner has written this rank's output block of ``epoch``."""
        lay = self.layout
        self.rt.wait(self.pad, [lay.output_signal(s) for s in range(self.world_size)], epoch,
                     self.config.wait_timeout_s, what)

    def received(self, src: int, src_block: int, keys: List[str], key_rows: List[int], lengths: torch.Tensor,
                 nnz: int, batch: int) -> KeyedJaggedTensor:
        """Source ``src``'s index block as a KJT for the stock lookup (compacted: offsets are the prefix
        sums of ``lengths``), after checking what a peer wrote: lengths sum to ``nnz`` and are >= 0, and
        every id is a row this rank holds (``key_rows`` per key). The TBE's own bounds check follows the
        user's mode, which may be off; these decide what is read here."""
        lay = self.layout
        ids = self.buf.view(lay.id_dtype, src_block + lay.ids_off, nnz).to(torch.int64)
        if bool((lengths < 0).any()) or int(lengths.sum()) != nnz:
            raise self._fail(PgasError(f"corrupt index lengths from rank {src}: negative, or not summing to {nnz}"))
        per_key = lengths.view(len(keys), batch).sum(1)
        limit = torch.repeat_interleave(torch.tensor(key_rows, dtype=torch.int64), per_key.to(torch.int64))
        if bool(((ids < 0) | (ids >= limit)).any()):
            raise self._fail(PgasError(f"corrupt index data from rank {src}: a row outside this rank's shard"))
        return KeyedJaggedTensor(
            keys=keys,
            values=ids,
            lengths=lengths.to(torch.int64),
            weights=self.buf.view(torch.float32, src_block + lay.weights_off, nnz) if lay.weighted else None,
            stride=batch,
        )

    def read_input_order(self, order: Sequence[int]) -> None:
        """Take the module's KJT in its input order: feature f of this sharding is input feature
        ``order[f]`` (``ShardedEmbeddingBagCollection`` would otherwise permute a copy each step).
        The host path permutes here, the kernels read through the order."""
        if sorted(order) != list(range(len(self.feature_names))):
            raise PgasError(f"{self.kind}: input feature order {list(order)} is not a permutation of "
                            f"the sharding's {len(self.feature_names)} features")
        self._input_order = list(order)

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The local KJT in this sharding's feature order (what the index dist and lookup take)."""
        return kjt if self._input_order is None else kjt.permute(self._input_order)

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        raise NotImplementedError

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        """Owner and requester stages; returns the final ``[B, D]`` pooled output.

        ``pool`` is the stock TBE lookup of a received KJT, ``tbes`` the TBE
        modules whose weight storage the fused kernels read directly.
        """
        raise NotImplementedError

    def check(self) -> None:
        """Raise errors the device recorded (after a stream sync); no-op on the host path."""


def _require(pipeline: Optional[PgasPipeline], kind: str) -> PgasPipeline:
    if pipeline is None:
        raise PgasError(f"{kind} module was sharded on the meta device")
    return pipeline


class PgasSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """The index dist. Returns the local features: the requester still needs them (mean pooling)."""

    def __init__(self, pipeline: Optional[PgasPipeline], kind: str) -> None:
        super().__init__()
        self._pipeline = pipeline
        self._kind = kind

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        pipeline = _require(self._pipeline, self._kind)
        features = pipeline.in_sharding_order(sparse_features)
        pipeline.index_dist(features)
        return NoWait(NoWait(features))


class PgasPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """The owner and requester stages around the stock TBE-backed lookup (weights, state_dict,
    optimizer): the stock lookup pools what the host path received, the device path reads its TBEs."""

    def __init__(self, pipeline: Optional[PgasPipeline], kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pipeline = pipeline
        self._kind = kind
        self._tbes = [emb.emb_module for emb in self._emb_modules]

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return _require(self._pipeline, self._kind).lookup(sparse_features, super().forward, self._tbes)

    def check(self) -> None:
        """Synchronize and raise what the device recorded for finished steps."""
        if self._pipeline is not None:
            self._pipeline.check()


class PgasShardingMixin:
    """The ``create_*`` of an ``EmbeddingSharding`` whose dists are PGAS stages; mixed in before the
    stock sharding class, whose shards, grouping and TBE-backed lookup it keeps."""

    _pipeline: Optional[PgasPipeline]
    _kind: str
    _lookup_sharding_type: Optional[ShardingType] = None  # ROW_WISE: MEAN runs as SUM in the TBE
    _grouped_embedding_configs: Any
    _pg: Any
    _device: Optional[torch.device]
    _env: ShardingEnv

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasSparseFeaturesDist(self._pipeline, self._kind)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> "PgasPooledEmbeddingsLookup":
        return PgasPooledEmbeddingsLookup(
            self._pipeline,
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

