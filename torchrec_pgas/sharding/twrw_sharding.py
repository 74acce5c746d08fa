"""``pgas_table_row_wise``: table-row-wise sharding for jobs beyond one node, one-sided inside each node.

Same placement as TorchRec ``table_row_wise`` (each table on one node, its rows in ``ceil(N/L)`` blocks over the
node's L ranks; TBE-backed weights, identical ``state_dict``), different data movement. One step, for N nodes
of L ranks, local batch B:

1. rail exchange of ids: each rank sends each node's features of its batch to the rank of the same local rank
   on that node (stock ``KJTAllToAll`` over TorchRec's cross-node group; no bucketizing), so each rank holds
   its node's features for the N·B bags of its rail;
2. the node's row-wise step over those N·B bags (``row_wise_step`` over TorchRec's intra-node group: index dist,
   lookup + output, combine), as ``pgas_row_wise`` runs inside one NVLink domain;
3. rail exchange of pooled rows: each rank's ``[N·B, D_node]`` rows go back to their requesters (stock
   ``PooledEmbeddingsAllToAll`` over the cross-node group), which concatenate the nodes' columns.

The inter-node bytes are stock TWRW's; the intra-node reduce-scatter and the bucketized all-to-all are gone. The
backward runs the rail exchange in reverse (its gradient divided by N, as stock's) and the node step's
backward (divided by L). Every rank's input is checked before any of the step's collectives run, and the
verdict is shared in one all-reduce over the sharding's group: a bad batch on any rank raises on every rank of
every node, before anything moved, so no rank waits in a rail exchange its peers left. On GPUs the node step
is ``pgas_row_wise``'s fused kernels among the node's PEs of the process's one NVSHMEM world
(``node_runtime.NodeRuntime``: a peer table of the node's PEs, world-collective allocations); on CPUs, the host
path over one ``shm`` world a node.
"""

import dataclasses
import functools
from typing import List, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.distributed.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.rw_sharding import row_wise_step
from torchrec_pgas.sharding.stages import PgasShardingMixin, pooled_output_dtype, require_step, run_index_dist
from torchrec_pgas.sharding.step import PgasStep, StepSpec
from torchrec_pgas.types import (
    PGAS_TABLE_ROW_WISE,
    PgasCapacityError,
    PgasConfig,
    PgasError,
    PgasInputError,
    PgasPeerAbortError,
    bounds_check_mode_from_fused_params,
)


class RailInputCheck:
    """Every rank's input for a step, checked before the step's first collective, with one verdict on every rank
    (an all-reduce over ``pg``): the rank's own error where its input is bad, the abort naming the first bad
    rank on the others, a batch-size mismatch on all. ``spec`` covers the sharding's features of every node
    (the requester's view: its batch, its ids); ``node_capacity[n]``: the ids a rank may send node n a step."""

    def __init__(self, spec: StepSpec, features_per_node: List[int], node_capacity: List[int],
                 pg: dist.ProcessGroup, device: torch.device) -> None:
        self._spec = spec
        self._device = device  # of the verdict: NCCL reduces device tensors
        self._features_per_node = features_per_node
        self._node_capacity = node_capacity
        self._pg = pg
        self._rank = dist.get_rank(pg)

    def __call__(self, kjt: KeyedJaggedTensor) -> Optional[PgasError]:
        own = self._own_error(kjt)
        verdict = torch.tensor([self._rank + 1 if own is not None else 0, kjt.stride(), -kjt.stride()],
                               device=self._device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self._pg)
        bad, largest, negated_smallest = verdict.tolist()
        bad_rank, smallest = bad - 1, -negated_smallest
        if own is not None:
            return own
        if bad_rank >= 0:
            return PgasPeerAbortError(f"rank {bad_rank} aborted the {self._spec.kind} step (see its error)")
        if largest != smallest:
            return PgasInputError(f"{self._spec.kind} requires equal local batch sizes on all ranks: they range "
                                  f"from {smallest} to {largest} (rank {self._rank} has {kjt.stride()})")
        return None

    def _own_error(self, kjt: KeyedJaggedTensor) -> Optional[PgasError]:
        spec = self._spec
        err = spec.input_error(kjt, self._rank)
        if err is not None:
            return err
        lengths = kjt.length_per_key()
        first = 0
        for node, (count, capacity) in enumerate(zip(self._features_per_node, self._node_capacity)):
            ids = sum(lengths[first:first + count])
            first += count
            if ids > capacity:
                return PgasCapacityError(
                    f"{spec.kind}: rank {self._rank} has {ids} ids for node {node}'s tables in one step, above "
                    f"their capacity of {capacity} (PgasConfig.max_ids_per_rank / pooling_capacity / "
                    "avg_pooling_capacity)")
        if spec.bounds_check_mode == BoundsCheckMode.FATAL:
            _, _, bad = spec.bad_ids(kjt)
            if bad is not None:
                return PgasInputError(spec.bad_id_message(*bad))
        return None


class _IndexDistAfter(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """The rail exchange's splits, then its tensors, then the node step's index dist of what arrived."""

    def __init__(self, splits: Awaitable[Awaitable[KeyedJaggedTensor]], step: PgasStep) -> None:
        super().__init__()
        self._splits = splits
        self._step = step

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        tensors = self._splits.wait()
        tensors.callbacks.append(functools.partial(run_index_dist, self._step))
        return tensors


class PgasTwRwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """The input check, the rail exchange of ids, the node step's index dist. Returns the node's features of
    the rail's N·B bags: the lookup pools them (and MEAN divides by their lengths)."""

    def __init__(self, step: Optional[PgasStep], kind: str, check: Optional[RailInputCheck],
                 cross_pg: Optional[dist.ProcessGroup], features_per_node: List[int]) -> None:
        super().__init__()
        self._step = step
        self._kind = kind
        self._check = check
        self._dist = KJTAllToAll(pg=cross_pg, splits=features_per_node) if cross_pg is not None else None

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        step = require_step(self._step, self._kind)
        assert self._check is not None and self._dist is not None  # with a step
        err = self._check(sparse_features)
        if err is not None:  # the same verdict on every rank of every node: each gives the step up, raising
            epoch = step.issued + 1
            step.consume_failed_step(epoch, err)
            step.forward_failed(err, epoch)
            raise err
        return _IndexDistAfter(self._dist(sparse_features), step)


class PgasTwRwPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]):
    """The node's pooled rows of each rail requester's bags back to it: stock's all-to-all over the cross-node
    group (its backward sends the gradient rows the same way)."""

    def __init__(self, cross_pg: dist.ProcessGroup, dim_sum_per_node: List[int], device: torch.device) -> None:
        super().__init__()
        self._dist = PooledEmbeddingsAllToAll(pg=cross_pg, dim_sum_per_rank=dim_sum_per_node, device=device)

    def forward(self, local_embs: torch.Tensor,
                sharding_ctx: Optional[EmbeddingShardingContext] = None) -> Awaitable[torch.Tensor]:
        return self._dist(local_embs)


class PgasTwRwPooledEmbeddingSharding(PgasShardingMixin, TwRwPooledEmbeddingSharding):
    """TorchRec TWRW shards and grouping; rail exchanges across nodes, the PGAS row-wise step inside each."""

    _instances: int = 0
    _kind = PGAS_TABLE_ROW_WISE
    _lookup_sharding_type = ShardingType.TABLE_ROW_WISE  # MEAN runs as SUM in the TBE, divided after
    reads_input_order = False  # the rail exchange sends the KJT in the sharding's feature order

    _check: Optional[RailInputCheck] = None  # with the step

    @property
    def _grouped_embedding_configs(self) -> List[GroupedEmbeddingConfig]:
        """This rank's shards of its node's tables: what its lookup holds."""
        return self._grouped_embedding_configs_per_rank[self._rank]

    def _build_step(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                    config: PgasConfig) -> PgasStep:
        assert self._device is not None and self._pg is not None and self._intra_pg is not None
        bounds = bounds_check_mode_from_fused_params(sharding_infos[0].fused_params)
        out_dtype = pooled_output_dtype(sharding_infos, self._kind)
        nodes = self._world_size // self._local_size
        per_node = [[t for g in groups for t in g.embedding_tables] for groups in self._grouped_embedding_configs_per_node]
        empty = [n for n, tables in enumerate(per_node) if not tables]
        if empty:  # every rank sees the plan alike: all raise, before any collective
            raise PgasError(f"pgas_table_row_wise: nodes {empty} hold none of this module's pgas_table_row_wise "
                            "tables; the node step needs one on every node: plan at least one table on each node, "
                            "or plan these table_row_wise")
        requester = StepSpec.over_tables("requester", self._kind, [t for tables in per_node for t in tables], 1, config,
                                         bounds, out_dtype)
        _check_row_blocks([t for tables in per_node for t in tables], self._local_size)
        node_tables = [t for g in self._grouped_embedding_configs for t in g.embedding_tables]  # this rank's shards
        node_config = dataclasses.replace(config, max_local_batch_size=config.max_local_batch_size * nodes,
                                          max_ids_per_rank=config.max_ids_per_rank and config.max_ids_per_rank * nodes)
        PgasTwRwPooledEmbeddingSharding._instances += 1  # allocation is collective: every rank shards alike
        node = StepSpec.over_tables(f"pgas_twrw.{PgasTwRwPooledEmbeddingSharding._instances}", self._kind,
                                    node_tables, self._local_size, node_config, bounds, out_dtype)
        node_env = ShardingEnv.from_local(self._local_size, self._rank % self._local_size)
        node_env.process_group = self._intra_pg
        capacity = [config.ids_capacity(tuple(t.name for t in tables for _ in t.feature_names)) for tables in per_node]
        self._check = RailInputCheck(requester, self._features_per_node(), capacity, self._pg, self._device)
        return row_wise_step(node, node_env, self._device)

    def _features_per_node(self) -> List[int]:
        return [sum(g.num_features() for g in groups) for groups in self._grouped_embedding_configs_per_node]

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return PgasTwRwSparseFeaturesDist(self._step, self._kind, self._check, self._cross_pg,
                                          self._features_per_node())

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        assert self._cross_pg is not None
        return PgasTwRwPooledEmbeddingDist(self._cross_pg, self._dim_sum_per_node(),
                                           device if device is not None else self._device or torch.device("cpu"))


def _check_row_blocks(tables: List, local_size: int) -> None:
    """The node step's owners hold ``ceil(N/L)`` row blocks in local-rank order, as stock TWRW bucketizes
    (from ``num_embeddings``, whatever the plan says): a plan whose shards differ would look rows up in the
    wrong block. Read from every table's global shards, so that every rank raises alike, before any collective."""
    for t in tables:
        block = (t.num_embeddings + local_size - 1) // local_size
        for shard in t.global_metadata.shards_metadata:
            local_rank = shard.placement.rank() % local_size
            offset, rows = shard.shard_offsets[0], shard.shard_sizes[0]
            want_rows = max(0, min(block, t.num_embeddings - local_rank * block))
            if offset != min(local_rank * block, t.num_embeddings) or rows != want_rows:
                raise PgasError(f"pgas_table_row_wise: table '{t.name}' has rows [{offset}, +{rows}) on local rank "
                                f"{local_rank}; the row blocks must be ceil({t.num_embeddings}/{local_size}) = "
                                f"{block} rows in local-rank order (plan it with "
                                "torchrec_pgas.planner.pgas_table_row_wise)")
