"""One PGAS sharding's step: what it is built from (``StepSpec``) and the state every backend shares.

A step is three stages (index dist, lookup, combine; see ``torchrec_pgas/layout.py`` for the buffer they
share). ``PgasStep`` holds the symmetric buffer, the signal pad, the host-side checks that need no device
sync and the FIFO stage counters; ``HostStep`` (``host_step.py``, the ``shm`` CPU backend) and
``DeviceStep`` (``device_step.py``, the fused kernels) run the stages. ``stages.py`` plugs a step into
TorchRec's ``EmbeddingSharding`` slots.
"""

import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.bootstrap import init_runtime
from torchrec_pgas.layout import StepLayout, id_bytes_for
from torchrec_pgas.types import PgasCapacityError, PgasConfig, PgasError, PgasInputError

PoolFn = Callable[[KeyedJaggedTensor], torch.Tensor]


@dataclass(frozen=True)
class StepSpec:
    """Everything a sharding's step is built from, fixed when the module is sharded. Per-feature fields
    are in the sharding's feature order (TorchRec's grouping; table-wise: rank by rank)."""

    name: str  # unique per sharding: names its collective allocations
    kind: str  # PGAS_ROW_WISE or PGAS_TABLE_WISE
    feature_names: Tuple[str, ...]
    feature_tables: Tuple[str, ...]
    hash_sizes: Tuple[int, ...]
    dims: Tuple[int, ...]
    is_mean: Tuple[bool, ...]
    shard_rows: Tuple[int, ...]  # rows one owner holds of the feature's table: ceil(N / W), or N (table-wise)
    weighted: bool
    config: PgasConfig
    bounds_check_mode: BoundsCheckMode
    out_dtype: torch.dtype  # the pooled output's (one per sharding)
    features_per_rank: Tuple[int, ...] = ()  # table-wise: how many features each rank owns, in rank order
    dim_sum_per_rank: Tuple[int, ...] = ()  # table-wise: their output columns per rank

    @property
    def num_features(self) -> int:
        return len(self.feature_names)


class PgasStep(abc.ABC):
    """State shared by the stage modules of one PGAS sharding.

    Each stage keeps its own FIFO step counter, the way a GPU stream would; the
    k-th lookup consumes the k-th index dist. Two buffer slots (epoch parity)
    let one index dist run ahead of the lookup, as TorchRec's train pipelines
    do; deeper run-ahead raises.
    """

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device, block_dim_sum: int) -> None:
        """``block_dim_sum``: the columns of one owner's output block."""
        self.spec = spec
        self.kind = spec.kind
        self.layout = StepLayout(
            world_size=env.world_size,
            num_features=spec.num_features,
            max_batch=spec.config.max_local_batch_size,
            ids_capacity=spec.config.ids_capacity(spec.num_features),
            dim_sum=block_dim_sum,
            weighted=spec.weighted,
            id_bytes=id_bytes_for(spec.shard_rows),
        )
        self.rt = init_runtime(env.process_group, device=device, heap_hint=self.layout.nbytes)
        self.rank = self.rt.rank
        self.world_size = self.rt.world_size
        self.device = device
        self.buf = self.rt.alloc(spec.name, self.layout.nbytes)
        self.pad = self.rt.alloc_signals(spec.name, self.layout.num_signal_slots)
        self.issued = 0  # index dists issued (epochs are 1-based)
        self.looked_up = 0  # lookups completed
        self._input_order: Optional[List[int]] = None

    @property
    def feature_names(self) -> Tuple[str, ...]:
        return self.spec.feature_names

    @property
    def lookup_features(self) -> Tuple[int, int]:
        """``[lo, hi)``: the features whose rows this rank holds (all of them for row-wise)."""
        if not self.spec.features_per_rank:
            return 0, self.spec.num_features
        lo = sum(self.spec.features_per_rank[: self.rank])
        return lo, lo + self.spec.features_per_rank[self.rank]

    @property
    def reads_input_order(self) -> bool:
        """True once the module's KJT is read in its input order (``read_input_order``), not permuted."""
        return self._input_order is not None

    def fail(self, err: PgasError) -> PgasError:
        """Abort the pad so peers waiting on this rank raise instead of hanging; returns ``err``."""
        self.rt.abort(self.pad, str(err))
        return err

    def bad_id_message(self, f: int, value: int) -> str:
        spec = self.spec
        return (
            f"{self.kind}: feature '{spec.feature_names[f]}' (table "
            f"'{spec.feature_tables[f]}') has id {value} outside [0, {spec.hash_sizes[f]})"
        )

    def check_step(self, kjt: KeyedJaggedTensor) -> None:
        """Checks on host-known sizes only (no device sync), before anything is written."""
        lay = self.layout
        if kjt.variable_stride_per_key():
            raise self.fail(PgasInputError(f"{self.kind} does not support variable batch size per feature"))
        batch = kjt.stride()
        if batch > lay.max_batch:
            raise self.fail(PgasCapacityError(
                f"{self.kind}: local batch size {batch} exceeds PgasConfig.max_local_batch_size={lay.max_batch}"
            ))
        if self.issued - self.looked_up >= lay.num_slots:
            raise self.fail(PgasError(
                f"{self.kind}: {self.issued - self.looked_up} index dists are already "
                f"in flight; at most {lay.num_slots} may run ahead of the lookup"
            ))
        nnz = kjt.values().numel()
        if nnz > lay.ids_capacity:
            raise self.fail(PgasCapacityError(
                f"{self.kind}: rank {self.rank} has {nnz} ids in one step, above the capacity of "
                f"{lay.ids_capacity} (PgasConfig.max_ids_per_rank / avg_pooling_capacity)"
            ))

    def next_lookup_epoch(self) -> int:
        if self.looked_up >= self.issued:
            raise self.fail(PgasError(f"{self.kind}: lookup called without an index dist"))
        self.looked_up += 1
        return self.looked_up

    def read_input_order(self, order: Sequence[int]) -> None:
        """Take the module's KJT in its input order: feature f of this sharding is input feature
        ``order[f]`` (``ShardedEmbeddingBagCollection`` would otherwise permute a copy each step)."""
        if sorted(order) != list(range(self.spec.num_features)):
            raise PgasError(f"{self.kind}: input feature order {list(order)} is not a permutation of "
                            f"the sharding's {self.spec.num_features} features")
        self._input_order = list(order)

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The local KJT in this sharding's feature order (what the index dist and lookup take)."""
        return kjt if self._input_order is None else kjt.permute(self._input_order)

    @abc.abstractmethod
    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        """Stage 1 (requester): put this rank's ids into their owners, then signal them."""

    @abc.abstractmethod
    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        """Stages 2 and 3 (owner, then requester); returns the final ``[B, D]`` pooled output.

        ``pool`` is the stock TBE lookup of a received KJT, ``tbes`` the TBE
        modules whose weight storage the fused kernels read directly.
        """

    def check(self) -> None:
        """Raise errors the device recorded (after a stream sync); nothing to do where stages raise."""
