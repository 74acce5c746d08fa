"""The fused GPU kernels of a PGAS step (the ``nvshmem`` backend), for both shardings.

Table-wise is the one-owner case of row-wise (``csrc/rw_pipeline.cuh``): a
row-wise table is W row blocks of ``ceil(N/W)`` rows on ranks ``0..W-1``, a
table-wise table one block of N rows on its owner. ``DevicePipeline`` describes
each feature that way (``FeatureOwners``) and launches the same three kernels
per step (index dist, fused lookup, finalize) on the current stream, whatever
the number of tables: no host sync, graph capturable.
"""

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.layout import divisor_magic
from torchrec_pgas.sharding.common import PgasPipeline, PoolFn, no_backward
from torchrec_pgas.types import (
    PgasError,
    PgasInputError,
    PgasPeerAbortError,
    PgasTimeoutError,
)

# Error codes of the device record (csrc/rw_pipeline.cuh, ErrorCode).
_ERR_BAD_ID, _ERR_BATCH, _ERR_TIMEOUT, _ERR_ABORT, _ERR_CORRUPT, _ERR_BAD_ID_WARN = 1, 2, 3, 4, 5, 6
STATE_WORDS = 16 + 2 * 64  # kStateWords
TRACE_WORDS = (12, 13, 14, 15)  # kTraceBuf, kTraceStep, kTraceCap, kTraceBytes
# FBGEMM 1.6's training TBE cannot hold bf16 weights (its cache_precision check).
_WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1}
BOUNDS_MODES = {BoundsCheckMode.FATAL: 0, BoundsCheckMode.WARNING: 1, BoundsCheckMode.IGNORE: 2}
MEAN_NONE, MEAN_REQUESTER, MEAN_OWNER = 0, 1, 2  # MeanMode


@dataclass(frozen=True)
class FeatureOwners:
    """Where the rows of each feature's table live, as the kernels see them.

    Row block k (of ``shard_rows[f]`` rows) of feature f's table is on rank
    ``base[f] + k``, for ``count`` blocks; this rank's lookup serves features
    ``lookup[0]..lookup[1]-1``. ``mean`` is a MeanMode per feature.
    """

    base: List[int]
    count: int
    mean: List[int]
    lookup: Tuple[int, int]
    variable_batch: bool

    @classmethod
    def row_wise(cls, world: int, feature_is_mean: Sequence[bool]) -> "FeatureOwners":
        """Block k of every table on rank k; every rank serves every feature; MEAN on the requester."""
        return cls(base=[0] * len(feature_is_mean), count=world,
                   mean=[MEAN_REQUESTER if m else MEAN_NONE for m in feature_is_mean],
                   lookup=(0, len(feature_is_mean)), variable_batch=False)

    @classmethod
    def table_wise(cls, features_per_rank: Sequence[int], rank: int,
                   feature_is_mean: Sequence[bool]) -> "FeatureOwners":
        """Rank d owns the next ``features_per_rank[d]`` features' whole tables; MEAN on the owner (the TBE's
        arithmetic); each source's batch from its header."""
        first = list(itertools.accumulate([0, *features_per_rank]))
        return cls(base=[d for d, n in enumerate(features_per_rank) for _ in range(n)], count=1,
                   mean=[MEAN_OWNER if m else MEAN_NONE for m in feature_is_mean],
                   lookup=(first[rank], first[rank + 1]), variable_batch=True)

    def check(self, world: int, rank: int) -> None:
        """The kernels index peer buffers by owner: every block must land on a rank, and this rank's
        lookup must serve exactly the features whose rows it holds."""
        num = len(self.base)
        bad = [f for f, b in enumerate(self.base) if not (0 <= b and b + self.count <= world)]
        held = [f for f, b in enumerate(self.base) if b <= rank < b + self.count]
        if bad or len(self.mean) != num or held != list(range(*self.lookup)):
            raise PgasError(
                f"inconsistent feature owners for rank {rank} of {world}: blocks of features {bad} outside "
                f"the ranks, rows of features {held} held here, lookup range {self.lookup}"
            )


def feature_rows(shard_rows: Sequence[int], hash_sizes: Sequence[int], dims: Sequence[int],
                 owners: FeatureOwners) -> List[List[int]]:
    """The kernels' feature table: one ``RwFeature`` row (csrc/rw_pipeline.cuh) per feature, each
    reading its own KJT feature, with no weights bound yet (``bind_weights``)."""
    out_cols = itertools.accumulate([0] + list(dims[:-1]))
    return [
        [0, 0, blk, n, d, c, 0, m, *divisor_magic(blk, n), base, owners.count, f]
        for f, (blk, n, d, c, m, base) in enumerate(zip(shard_rows, hash_sizes, dims, out_cols, owners.mean,
                                                        owners.base))
    ]


def bind_weights(row: List[int], weights: torch.Tensor) -> None:
    """Point a feature row at this rank's ``[local_rows, dim]`` row-major shard (kept alive by the caller)."""
    row[0], row[1], row[6] = weights.data_ptr(), weights.size(0), _WEIGHT_DTYPES[weights.dtype]


def column_features(dims: Sequence[int], device: torch.device) -> torch.Tensor:
    """The feature of every 4-column vector of the ``[B, sum(dims)]`` output (the finalize's map)."""
    return torch.tensor([f for f, d in enumerate(dims) for _ in range(d // 4)], dtype=torch.int32, device=device)


class DevicePipeline(PgasPipeline):
    """Three fused kernel launches per step on the current stream; no host sync.

    Device-side errors (bad ids, batch mismatch, timeouts, a peer's abort) land
    in a pinned record that the next step reads without syncing; ``check()``
    synchronizes first.
    """

    def __init__(self, *args: Any, owners: FeatureOwners, out_dtype: torch.dtype, **kwargs: Any) -> None:
        """``out_dtype``: the pooled output's, which the TBEs confirm (a table-wise rank may have none)."""
        super().__init__(*args, **kwargs)
        owners.check(self.world_size, self.rank)
        lay, dev = self.layout, self.device
        ops = torch.ops.torchrec_pgas
        peers = [
            [ops.peer_ptr(self.buf.local, pe) for pe in range(self.world_size)],
            [ops.peer_ptr(self.pad.words, pe) for pe in range(self.world_size)],
        ]
        unreachable = [pe for pe, ptr in enumerate(peers[0]) if ptr == 0]
        if unreachable:
            raise PgasError(
                f"ranks {unreachable} are not reachable by load/store from rank {self.rank} "
                f"({self.kind} on GPUs needs one NVLink domain for now)"
            )
        self._peers = torch.tensor(peers, dtype=torch.int64, device=dev)
        # weights, local_rows, dtype are filled from the TBEs at the first lookup,
        # input_feature by read_input_order
        self._feature_rows = feature_rows(self.shard_rows, self.feature_hash_sizes, self.feature_dims, owners)
        self._features = torch.tensor(self._feature_rows, dtype=torch.int64, device=dev)
        self._col_feature = column_features(self.feature_dims, dev)
        self._state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=dev)
        self._bag_div = torch.zeros(lay.num_slots, lay.num_features * lay.max_batch, device=dev)
        self._status = torch.zeros(4, dtype=torch.int64).pin_memory()
        self._lookup = owners.lookup
        self._cfg = lay.kernel_config(
            int(self.config.wait_timeout_s * 1e9), self.rank, BOUNDS_MODES[self.bounds_check_mode],
            lookup_features=owners.lookup, variable_batch=owners.variable_batch,
        )
        self._max_dim = max(self.feature_dims[owners.lookup[0]:owners.lookup[1]], default=4)
        self._out_dtype = out_dtype
        self._tbe_key: List[int] = [-1]
        # The stream of this pipeline's last index dist if no lookup was issued since (see lookup).
        self._dist_stream: Optional[torch.cuda.Stream] = None
        # Recorded after each finalize, per slot (see index_dist).
        self._slot_free = [torch.cuda.Event() for _ in range(lay.num_slots)]

    def read_input_order(self, order: Sequence[int]) -> None:
        """The index dist reads feature f's bags at KJT feature ``order[f]`` (no permuted copy)."""
        super().read_input_order(order)
        for row, f in zip(self._feature_rows, order):
            row[12] = f
        self._features.copy_(torch.tensor(self._feature_rows, dtype=torch.int64))

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return kjt  # the kernels read through the order; the lookup only needs the batch

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        try:
            self._raise_recorded()
        except PgasError as e:  # peers wait for this step's data: tell them why it will not come
            raise self._fail(e)
        self._check_step(kjt)
        weights = kjt.weights_or_none()
        stream = torch.cuda.current_stream(self.device)
        if not torch.cuda.is_current_stream_capturing():
            # TorchRec's train pipelines run the input dist on their own stream:
            # reusing a slot must wait for the finalize that last read it.
            stream.wait_event(self._slot_free[(self.issued + 1) % self.layout.num_slots])
        try:
            torch.ops.torchrec_pgas.rw_index_dist(
                kjt.values(),
                kjt.offsets().to(torch.int64),
                weights.float() if weights is not None else None,
                self.buf.local, self.pad.words, self._peers, self._features, self._state,
                self._bag_div, self._status, self._cfg, kjt.stride(),
            )
        except RuntimeError as e:
            raise self._fail(PgasError(f"{self.kind} index dist failed to launch: {e}")) from e
        self.issued += 1
        self._dist_stream = stream

    def _bind_weights(self, tbes: Sequence[nn.Module]) -> None:
        """Point the feature table at the TBEs' weight storage (again only if it moved).

        The TBEs hold the features of this rank's lookup range, in order. Per
        step this costs one pointer read per TBE group, not per table.
        """
        key = [t.weights_dev.data_ptr() for t in tbes]
        if key == self._tbe_key:
            return
        weights = [w for t in tbes for w in _per_feature(t)]
        out_dtypes = {SparseType.from_int(t.output_dtype).as_dtype() for t in tbes}
        f_lo, f_hi = self._lookup
        if len(weights) != f_hi - f_lo or not out_dtypes <= {self._out_dtype}:
            raise PgasError(
                f"{self.kind}: {len(weights)} TBE features with output dtypes {out_dtypes} "
                f"for the {f_hi - f_lo} features this rank holds (output dtype {self._out_dtype})"
            )
        for f, w in enumerate(weights, start=f_lo):
            if w.dtype not in _WEIGHT_DTYPES or not w.is_cuda or w.dim() != 2 or w.stride(0) != w.size(1):
                raise PgasError(
                    f"{self.kind}: feature '{self.feature_names[f]}' has weights of dtype "
                    f"{w.dtype} on {w.device}; the GPU lookup reads row-major fp32/fp16 HBM"
                )
            bind_weights(self._feature_rows[f], w)
        self._features.copy_(torch.tensor(self._feature_rows, dtype=torch.int64))
        self._tbe_key = key

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        epoch = self._next_lookup_epoch()
        ops = torch.ops.torchrec_pgas
        args = (self.buf.local, self.pad.words, self._peers, self._features)
        # The lookup may start before the kernel ahead of it on the stream has
        # completed (csrc/pgas_common.cuh: launch_after_exit) only if an index dist
        # of this pipeline lies between it and the previous finalize on this stream:
        # that plain launch began after the previous step's kernels had completed.
        # Not so when a train pipeline distributes on its own stream.
        after_exit = self._dist_stream == torch.cuda.current_stream(self.device)
        self._dist_stream = None
        try:
            self._bind_weights(tbes)
            ops.rw_lookup(*args, self._state, self._bag_div, self._status, self._cfg,
                          kjt.stride(), self._max_dim, self._out_dtype, after_exit)
            profiling.mark("lookup")
            out = ops.rw_finalize(*args, self._col_feature, self._state, self._bag_div, self._status,
                                  self._cfg, kjt.stride(), self._out_dtype)
        except PgasError as e:  # peers wait for this rank's pooled rows: abort them
            raise self._fail(e)
        except RuntimeError as e:
            raise self._fail(PgasError(f"{self.kind} lookup failed to launch: {e}")) from e
        if not torch.cuda.is_current_stream_capturing():
            self._slot_free[epoch % self.layout.num_slots].record()
        return no_backward(out, self.kind)

    def trace_comm(self, records: int, step_bytes: int) -> torch.Tensor:
        """Start the comm timeline: an int64 ``[records, 2]`` buffer of (ns, cumulative remote bytes)
        that the next steps fill, one record per ``step_bytes`` (record 0: the step's start)."""
        if records < 1 or step_bytes < 1:
            raise ValueError(f"trace_comm: records {records} and step_bytes {step_bytes} must be >= 1")
        trace = torch.zeros(records, 2, dtype=torch.int64, device=self.device)
        # No step in flight (on any stream) while the trace words and the buffer change.
        torch.cuda.synchronize(self.device)
        self._trace = trace  # kept alive while the kernels hold its address
        buf, step, cap, count = TRACE_WORDS
        self._state[buf] = trace.data_ptr()
        self._state[step] = step_bytes
        self._state[cap] = records
        self._state[count] = 0
        self._cfg[-1] = 1  # the kernels' kTrace builds (layout.kernel_config: trace)
        return trace

    def stop_trace(self) -> None:
        torch.cuda.synchronize(self.device)
        self._cfg[-1] = 0

    def check(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        self._raise_recorded()

    def _raise_recorded(self) -> None:
        """Raise (or warn about) the error record of a finished step; no sync."""
        code, a, b, c = self._status.tolist()
        if code == 0:
            return
        self._status.zero_()
        if code == _ERR_BAD_ID_WARN:
            if self.bounds_check_mode == BoundsCheckMode.WARNING:
                warnings.warn(self.bad_id_message(a, b) + "; such ids read row 0 (BoundsCheckMode.WARNING)")
            return
        if code == _ERR_BAD_ID:
            raise PgasInputError(self.bad_id_message(a, b))
        if code == _ERR_BATCH:
            raise PgasInputError(
                f"{self.kind} requires equal local batch sizes on all ranks: rank "
                f"{a} has {b}, rank {self.rank} has {c}"
            )
        if code == _ERR_TIMEOUT:
            stage = ("index data", "index data", "pooled outputs")[a]
            raise PgasTimeoutError(
                f"rank {self.rank} waited {self.config.wait_timeout_s:.0f}s for {stage} from rank {b}: "
                "a peer crashed, diverged, or is not running this step"
            )
        if code == _ERR_ABORT:
            raise PgasPeerAbortError(f"rank {a} aborted the {self.kind} step (see its error)")
        raise PgasError(f"{self.kind}: corrupt data from rank {a} (kind {b})")


def _per_feature(tbe: nn.Module) -> List[torch.Tensor]:
    """A TBE's weight views ``[local_rows, dim]``, one per feature it serves."""
    tables = tbe.split_embedding_weights()
    return [tables[t] for t in tbe.feature_table_map]
