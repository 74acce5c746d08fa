"""Public types of torchrec-pgas: sharding-type names, the per-sharder config, errors."""

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

PGAS_ROW_WISE: str = "pgas_row_wise"
"""Row-wise sharding whose index dist and output dist are one-sided PGAS puts."""

PGAS_TABLE_WISE: str = "pgas_table_wise"
"""Table-wise sharding: ids go one-sided to the table's owner, which writes pooled rows into the requester."""

PGAS_TABLE_ROW_WISE: str = "pgas_table_row_wise"
"""Table-row-wise sharding for jobs beyond one node: each table on one node, its rows split over that node's
ranks as stock ``table_row_wise`` splits them; ids and pooled rows cross nodes in NCCL/gloo all-to-alls among
the ranks of one local rank, and move one-sided inside the node (the ``shm`` backend for now)."""

PGAS_SHARDING_TYPES = (PGAS_ROW_WISE, PGAS_TABLE_WISE, PGAS_TABLE_ROW_WISE)

# Key under which the sharder passes its PgasConfig through TorchRec's per-table
# fused_params (the same channel TorchRec uses for its own "__register_*" keys);
# it is stripped again before the params reach FBGEMM's TBE.
FUSED_PARAM_PGAS_CONFIG: str = "__pgas_config"


class PgasBackendType(Enum):
    """Where the symmetric heap lives and who moves the bytes."""

    SHM = "shm"  # CPU: POSIX shared memory mapped by every local rank
    NVSHMEM = "nvshmem"  # CUDA: NVSHMEM symmetric heap, GPU-initiated puts


GPU_PADDED_EAGER_IDS = 1 << 24  # PgasTrainingConfig.max_padded_eager_ids' default on GPUs


class OwnerBackward(str, Enum):
    """Who applies the gradients an owner receives to its rows (``PgasTrainingConfig.owner_backward``)."""

    PGAS = "pgas"
    """Our owner update: SGD, row-wise Adagrad and Adam, deterministic, the only one a training step captured
    in a CUDA graph can run; FBGEMM's backward serves a sharding whose optimizer or options it does not cover
    (a warning names why, once)."""
    FBGEMM = "fbgemm"
    """FBGEMM's fused backward and optimizer, as in stock TorchRec: every optimizer and option; slower (a host
    sync and a second lookup a step)."""
    AUTO = "auto"
    """Each sharding's owners time both of the above on their first eager steps (alternating, after the
    gradient exchange, without a host sync on GPUs) and keep the faster, each rank for its own rows; the owner
    update where FBGEMM's backward fails. A captured step runs the owner update (capture after an eager step ran
    it since the TBEs' storage last moved). A choice made from timings may differ between runs: pin one for
    bitwise reproducibility."""
    REFERENCE = "reference"
    """The owner update's algorithm in torch ops with float64 sums (FBGEMM's GPU semantics on any device):
    slow, eager only; a reference for tests."""


@dataclass(frozen=True)
class PgasTrainingConfig:
    """How a PGAS sharding trains.

    Args:
        owner_backward: who applies an owner's gradients (``OwnerBackward``, or its value as a string).
        max_padded_eager_ids: with the owner update, an eager step lays an owner's kept ids out at their
            fixed capacity (world size × ids capacity a TBE), as a captured step does, without reading their
            count on the host, while those positions number at most this; past it, it reads each TBE's count (a
            host sync) and lays out exactly those ids. Either way only the ids are sorted and walked (at capacity
            their count is a device word); what grows with the bound is scratch memory (~40-50 bytes a
            position). None: 2^24 on GPUs, 0 on CPUs (where the count costs no sync).
        eager_backward_graphs: on GPUs, replay an eager backward's kernels as one CUDA graph, kept per batch
            size and buffer slot (up to 12 a sharding, in a memory pool shared by every sharding on the GPU).
            False: launch them one by one.
    """

    owner_backward: OwnerBackward = OwnerBackward.PGAS
    max_padded_eager_ids: Optional[int] = None
    eager_backward_graphs: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "owner_backward", OwnerBackward(self.owner_backward))
        except ValueError:
            raise ValueError(f"PgasTrainingConfig.owner_backward must be one of "
                             f"{[o.value for o in OwnerBackward]}, got {self.owner_backward!r}") from None
        if self.max_padded_eager_ids is not None and self.max_padded_eager_ids < 0:
            raise ValueError(f"PgasTrainingConfig.max_padded_eager_ids must be >= 0, got {self.max_padded_eager_ids}")

    def padded_eager_ids(self, device_type: str) -> int:
        """``max_padded_eager_ids`` for a sharding on ``device_type`` ("cuda" or "cpu"), its default resolved."""
        if self.max_padded_eager_ids is not None:
            return self.max_padded_eager_ids
        return GPU_PADDED_EAGER_IDS if device_type == "cuda" else 0


@dataclass(frozen=True)
class PgasConfig:
    """What a user decides for the PGAS shardings of one sharder: the buffers' sizes, how long a rank waits
    for its peers, and whether and how they train.

    The buffers are allocated once, collectively, when the module is sharded, so they are sized for a
    maximum step; a larger step raises before anything is written.

    Args:
        max_local_batch_size: largest local batch (KJT stride) a rank may feed.
        max_ids_per_rank: most ids (KJT values) one rank may feed one sharding in one step. None:
            ``max_local_batch_size`` times the sum over the sharding's features of their table's ids per bag
            (``pooling_capacity``, else ``avg_pooling_capacity``).
        avg_pooling_capacity: the mean ids per bag that the default capacity covers, for tables
            ``pooling_capacity`` does not name.
        pooling_capacity: per table name, the mean ids per bag (over a step's batch) its features' capacity
            covers: the plan's pooling factors with headroom (``pooling_capacity_from_constraints``), e.g. 1 for
            a one-hot feature. A mapping or (name, ids) pairs.
        wait_timeout_s: how long a step's waits for its peers may take in all, from its first wait, before
            the step raises (a peer that crashed or diverged must not hang the job).
        training: how the shardings train (``PgasTrainingConfig``); None for inference-only shardings: less
            memory (no gradient blocks, two buffer slots instead of three), and a backward raises.
    """

    max_local_batch_size: int = 4096
    max_ids_per_rank: Optional[int] = None
    avg_pooling_capacity: int = 32
    pooling_capacity: Union[Mapping[str, float], Tuple[Tuple[str, float], ...]] = ()
    wait_timeout_s: float = 120.0
    training: Optional[PgasTrainingConfig] = PgasTrainingConfig()

    def __post_init__(self) -> None:
        if self.max_local_batch_size <= 0:
            raise ValueError(
                f"PgasConfig.max_local_batch_size must be > 0, got {self.max_local_batch_size}"
            )
        if self.max_ids_per_rank is not None and self.max_ids_per_rank <= 0:
            raise ValueError(
                f"PgasConfig.max_ids_per_rank must be > 0 or None, got {self.max_ids_per_rank}"
            )
        if self.avg_pooling_capacity <= 0:
            raise ValueError(
                f"PgasConfig.avg_pooling_capacity must be > 0, got {self.avg_pooling_capacity}"
            )
        pairs = tuple(sorted(dict(self.pooling_capacity).items()))
        bad = [(name, ids) for name, ids in pairs if not ids > 0]
        if bad:
            raise ValueError(f"PgasConfig.pooling_capacity: ids per bag must be > 0, got {bad}")
        object.__setattr__(self, "pooling_capacity", pairs)  # hashable, as a frozen config must be
        if self.wait_timeout_s <= 0:
            raise ValueError(f"PgasConfig.wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        if self.training is not None and not isinstance(self.training, PgasTrainingConfig):
            raise ValueError(f"PgasConfig.training takes a PgasTrainingConfig, or None for inference-only "
                             f"shardings; got {self.training!r}")

    def ids_per_bag(self, table: str) -> float:
        """The mean ids per bag the capacity covers for ``table``'s features."""
        return dict(self.pooling_capacity).get(table, self.avg_pooling_capacity)

    def ids_capacity(self, feature_tables: Sequence[str]) -> int:
        """The most ids one rank may feed a sharding whose features read ``feature_tables`` in one step."""
        if self.max_ids_per_rank is not None:
            return self.max_ids_per_rank
        per_sample = sum(self.ids_per_bag(t) for t in feature_tables)
        return max(1, math.ceil(self.max_local_batch_size * per_sample))


def pooling_capacity_from_constraints(constraints: Mapping[str, Any], headroom: float = 1.0) -> Dict[str, float]:
    """``PgasConfig.pooling_capacity`` from the planner's ``ParameterConstraints`` per table: each table's
    largest ``pooling_factors`` entry (the mean ids per bag of its features) times ``headroom`` (a step's batch
    may average more than the data's mean). Tables without pooling factors are left to ``avg_pooling_capacity``."""
    if not headroom > 0:
        raise ValueError(f"headroom must be > 0, got {headroom}")
    return {name: max(c.pooling_factors) * headroom for name, c in constraints.items()
            if getattr(c, "pooling_factors", None)}


def pgas_config_from_fused_params(fused_params: Optional[Dict[str, Any]]) -> PgasConfig:
    if fused_params and FUSED_PARAM_PGAS_CONFIG in fused_params:
        return fused_params[FUSED_PARAM_PGAS_CONFIG]
    return PgasConfig()


def bounds_check_mode_from_fused_params(fused_params: Optional[Dict[str, Any]]) -> BoundsCheckMode:
    """FATAL unless the user asked otherwise (FBGEMM's own default is WARNING).

    ``NONE`` is promoted to ``IGNORE``: ids decide addresses of one-sided writes
    into other ranks' memory, so they are always checked.
    """
    mode = (fused_params or {}).get("bounds_check_mode", BoundsCheckMode.FATAL)
    if mode == BoundsCheckMode.NONE:
        return BoundsCheckMode.IGNORE
    return mode


class PgasError(RuntimeError):
    """A PGAS step cannot proceed. The step is given up on every rank (no weight changes); the next step
    runs, unless the error says otherwise."""


class PgasInputError(PgasError, ValueError):
    """Bad step input: an out-of-range id, mismatched batch sizes, and the like."""


class PgasCapacityError(PgasError, ValueError):
    """A step needs more symmetric-buffer space than the config allows."""


class PgasPeerAbortError(PgasError):
    """Another rank aborted the step this rank was waiting on."""


class PgasTimeoutError(PgasError, TimeoutError):
    """A peer did not signal within ``PgasConfig.wait_timeout_s``."""
