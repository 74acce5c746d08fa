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

import bisect
import dataclasses
import itertools
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
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

from torchrec_pgas import runtime as pgas_runtime
from torchrec_pgas.layout import RwLayout
from torchrec_pgas.types import (
    PgasCapacityError,
    PgasConfig,
    PgasError,
    PgasInputError,
    bounds_check_mode_from_fused_params,
)

MEAN_EPS: float = 1e-6  # TorchRec's RW mean divisor guard (embeddingbag.py)


class _NoBackward(torch.autograd.Function):
    """Makes a training step fail loudly instead of silently skipping embedding grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise NotImplementedError(
            "pgas_row_wise has no backward pass yet: shard the tables you train "
            "with 'row_wise' (the state_dict is the same, so checkpoints move freely)"
        )


class PgasRwPipeline:
    """State shared by the three stage modules of one ``pgas_row_wise`` sharding.

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
    ) -> None:
        self.rt = pgas_runtime.init(env.process_group, device=device)
        self.rank = self.rt.rank
        self.world_size = self.rt.world_size
        self.device = device
        self.feature_names = feature_names
        self.feature_tables = feature_tables
        self.config = config
        self.bounds_check_mode = bounds_check_mode
        num_features = len(feature_names)
        self.layout = RwLayout(
            world_size=self.world_size,
            num_features=num_features,
            max_batch=config.max_local_batch_size,
            ids_capacity=config.ids_capacity(num_features),
            dim_sum=sum(feature_dims),
            weighted=is_weighted,
        )
        self.buf = self.rt.alloc(name, self.layout.nbytes)
        self.pad = self.rt.alloc_signals(name, self.layout.num_signal_slots)
        self._hash_sizes = torch.tensor(feature_hash_sizes, dtype=torch.int64, device=device)
        self._block_sizes = torch.tensor(
            [(n + self.world_size - 1) // self.world_size for n in feature_hash_sizes],
            dtype=torch.int64,
            device=device,
        )
        # Mean pooling: divisor columns, 1 for sum features (applied after the sum).
        self._mean_features: Optional[torch.Tensor] = None
        if any(feature_is_mean):
            self._mean_features = torch.tensor(feature_is_mean, device=device)
            self._dims = torch.tensor(feature_dims, device=device)
        self._warned: set = set()
        self.issued = 0  # index dists issued (epochs are 1-based)
        self.looked_up = 0  # lookups completed

    # ---- helpers --------------------------------------------------------------
    def _fail(self, err: PgasError) -> PgasError:
        """Abort the pad so peers waiting on this rank raise instead of hanging."""
        self.rt.abort(self.pad, str(err))
        return err

    def _order(self) -> List[int]:
        """Remote peers first (their bytes travel), this rank last."""
        return [(self.rank + 1 + k) % self.world_size for k in range(self.world_size)]

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
        msg = (
            f"pgas_row_wise: feature '{self.feature_names[f]}' (table "
            f"'{self.feature_tables[f]}') has id {int(values[pos])} outside "
            f"[0, {int(self._hash_sizes[f])})"
        )
        if self.bounds_check_mode == BoundsCheckMode.FATAL:
            raise self._fail(PgasInputError(msg))
        if self.bounds_check_mode == BoundsCheckMode.WARNING and f not in self._warned:
            self._warned.add(f)
            warnings.warn(msg + "; such ids read row 0 (BoundsCheckMode.WARNING)")
        return torch.where(bad, torch.zeros_like(values), values)

    # ---- stage 1: index dist ------------------------------------------------------
    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        if kjt.variable_stride_per_key():
            raise self._fail(
                PgasInputError("pgas_row_wise does not support variable batch size per feature")
            )
        lay = self.layout
        batch = kjt.stride()
        if batch > lay.max_batch:
            raise self._fail(
                PgasCapacityError(
                    f"pgas_row_wise: local batch size {batch} exceeds "
                    f"PgasConfig.max_local_batch_size={lay.max_batch}"
                )
            )
        if self.issued - self.looked_up >= lay.num_slots:
            raise self._fail(
                PgasError(
                    f"pgas_row_wise: {self.issued - self.looked_up} index dists are already "
                    f"in flight; at most {lay.num_slots} may run ahead of the lookup"
                )
            )
        values = self._check_ids(kjt, kjt.values().to(torch.int64))
        weights = kjt.weights_or_none()
        lengths, ids, bucket_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            kjt.lengths().view(-1).to(torch.int64),
            values,
            bucketize_pos=False,
            sequence=False,
            block_sizes=self._block_sizes,
            my_size=self.world_size,
            weights=weights.float() if weights is not None else None,
        )
        per_dest = lengths.view(self.world_size, -1)  # [dest][f][b]
        counts = per_dest.sum(1).tolist()
        if max(counts) > lay.ids_capacity:
            dest = counts.index(max(counts))
            raise self._fail(
                PgasCapacityError(
                    f"pgas_row_wise: rank {self.rank} would send {counts[dest]} ids to rank "
                    f"{dest} in one step, above the capacity of {lay.ids_capacity} ids per "
                    "source (PgasConfig.ids_per_source_capacity / avg_pooling_capacity)"
                )
            )
        self.issued += 1
        epoch = self.issued
        slot = epoch % lay.num_slots
        starts = [0] + torch.tensor(counts).cumsum(0).tolist()
        for dest in self._order():
            n = counts[dest]
            block = lay.index_block(slot, self.rank)
            header = torch.tensor([epoch, batch, n, 0], dtype=torch.int64)
            self.rt.put(self.buf, dest, block + lay.header_off, header)
            self.rt.put(self.buf, dest, block + lay.lengths_off, per_dest[dest][: lay.num_features * batch])
            self.rt.put(self.buf, dest, block + lay.ids_off, ids[starts[dest] : starts[dest] + n])
            if lay.weighted:
                self.rt.put(
                    self.buf, dest, block + lay.weights_off, bucket_weights[starts[dest] : starts[dest] + n]
                )
            self.rt.signal(self.pad, dest, lay.index_signal(self.rank), epoch)

    # ---- stages 2 + 3: fused lookup/output write, then finalize ----------------------
    def lookup(
        self, kjt: KeyedJaggedTensor, pool: Callable[[KeyedJaggedTensor], torch.Tensor]
    ) -> torch.Tensor:
        lay = self.layout
        if self.looked_up >= self.issued:
            raise self._fail(PgasError("pgas_row_wise: lookup called without an index dist"))
        epoch = self.looked_up + 1
        slot = epoch % lay.num_slots
        batch = kjt.stride()
        timeout = self.config.wait_timeout_s
        out_dtype: Optional[torch.dtype] = None
        for src in self._order():
            self.rt.wait(self.pad, [lay.index_signal(src)], epoch, timeout, f"index data from rank {src}")
            block = lay.index_block(slot, src)
            h_epoch, h_batch, nnz, _ = self.buf.view(torch.int64, block + lay.header_off, 4).tolist()
            self.rt.check()
            if h_batch != batch:
                raise self._fail(
                    PgasInputError(
                        "pgas_row_wise requires equal local batch sizes on all ranks: rank "
                        f"{src} has {h_batch}, rank {self.rank} has {batch}"
                    )
                )
            lengths = self.buf.view(torch.int64, block + lay.lengths_off, lay.num_features * batch)
            # nnz and lengths decide what the TBE reads: check them like any address.
            if h_epoch != epoch or not 0 <= nnz <= lay.ids_capacity or int(lengths.sum()) != nnz:
                raise self._fail(
                    PgasError(f"corrupt index header from rank {src}: epoch {h_epoch}, nnz {nnz}")
                )
            weights = self.buf.view(torch.float32, block + lay.weights_off, nnz) if lay.weighted else None
            received = KeyedJaggedTensor(
                keys=self.feature_names,
                values=self.buf.view(torch.int64, block + lay.ids_off, nnz),
                lengths=lengths,
                weights=weights,
                stride=batch,
            )
            with torch.no_grad():
                partial = pool(received)
            out_dtype = partial.dtype
            self.rt.put(self.buf, src, lay.output_block(slot, self.rank), partial)
            self.rt.signal(self.pad, src, lay.output_signal(self.rank), epoch)
        self.rt.wait(
            self.pad,
            [lay.output_signal(s) for s in range(self.world_size)],
            epoch,
            timeout,
            "partial pooled outputs",
        )
        assert out_dtype is not None
        out = torch.zeros(batch, lay.dim_sum, dtype=torch.float32, device=self.device)
        for s in range(self.world_size):  # rank order: deterministic sums
            out += self.buf.view(out_dtype, lay.output_block(slot, s), batch * lay.dim_sum).view(
                batch, lay.dim_sum
            )
        self.looked_up = epoch
        if self._mean_features is not None:
            out = out / self._mean_divisor(kjt)
        out = out.to(out_dtype)
        if torch.is_grad_enabled():  # a backward through here must raise, not skip
            return _NoBackward.apply(out.requires_grad_())
        return out

    def _mean_divisor(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """[B, D] divisor, like TorchRec RW: bag length (or weight sum) + eps; 1 for sum."""
        assert self._mean_features is not None
        weights = kjt.weights_or_none()
        if weights is not None:
            lengths = torch.ops.fbgemm.segment_sum_csr(1, kjt.offsets().int(), weights.float())
        else:
            lengths = kjt.lengths().float()
        per_bag = lengths.view(len(self.feature_names), -1) + MEAN_EPS  # [F, B]
        per_bag = torch.where(self._mean_features[:, None], per_bag, torch.ones_like(per_bag))
        return torch.repeat_interleave(per_bag.t(), self._dims, dim=1)


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

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if self._pipeline is None:
            raise PgasError("pgas_row_wise module was sharded on the meta device")
        return self._pipeline.lookup(sparse_features, super().forward)


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
        self._pipeline = PgasRwPipeline(
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
