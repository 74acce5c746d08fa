"""The three stages of one ``pgas_row_wise`` step, on each backend.

Two paths implement the stages over the shared ``PgasPipeline`` state
(``common.py``):

* ``HostRwPipeline`` writes the algorithm against the runtime API (put,
  signal, wait) with torch ops and the stock TBE lookup; it is what the
  ``shm`` CPU backend runs.
* ``DeviceRwPipeline`` launches the fused kernels of ``csrc/rw_*.cu`` (three
  launches per step whatever the number of tables, no host sync, graph
  capturable); it is what the ``nvshmem`` backend runs.
"""

import itertools
import warnings
from typing import Any, List, Optional, Sequence

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.layout import divisor_magic
from torchrec_pgas.sharding.common import PgasPipeline, PoolFn, no_backward
from torchrec_pgas.types import (
    PGAS_ROW_WISE,
    PgasError,
    PgasInputError,
    PgasPeerAbortError,
    PgasTimeoutError,
)

MEAN_EPS: float = 1e-6  # TorchRec's RW mean divisor guard (embeddingbag.py)

class HostRwPipeline(PgasPipeline):
    """The algorithm over the runtime API, with torch ops and the stock TBE lookup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = self.device
        self._block_sizes = torch.tensor(self.shard_rows, dtype=torch.int64, device=device)
        # This rank's rows of each table (the last block is short, or empty for tiny tables).
        self._local_rows = [max(0, min(b, n - self.rank * b)) for b, n in zip(self.shard_rows, self.feature_hash_sizes)]
        # Mean pooling: divisor columns, 1 for sum features (applied after the sum).
        self._mean_features: Optional[torch.Tensor] = None
        if any(self.feature_is_mean):
            self._mean_features = torch.tensor(self.feature_is_mean, device=device)
            self._dims = torch.tensor(self.feature_dims, device=device)

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        values = self._checked_ids(kjt)
        lay = self.layout
        batch = kjt.stride()
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
        self.issued += 1
        epoch = self.issued
        slot = epoch % lay.num_slots
        starts = [0] + torch.tensor(counts).cumsum(0).tolist()
        block = lay.index_block(slot, self.rank)
        for dest in self._order():
            n, start = counts[dest], starts[dest]
            dest_lengths = per_dest[dest]
            header = torch.tensor([epoch, batch, n, 0], dtype=torch.int64)
            self.rt.put(self.buf, dest, block + lay.header_off, header)
            self.rt.put(
                self.buf, dest, block + lay.offsets_off,
                torch.ops.fbgemm.asynchronous_complete_cumsum(dest_lengths),
            )
            self.rt.put(self.buf, dest, block + lay.lengths_off, dest_lengths.to(torch.int32))
            self.rt.put(self.buf, dest, block + lay.ids_off, ids[start : start + n].to(lay.id_dtype))
            if lay.weighted:
                self.rt.put(self.buf, dest, block + lay.weights_off, bucket_weights[start : start + n])
            self.rt.signal(self.pad, dest, lay.index_signal(self.rank), epoch)

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        lay = self.layout
        epoch = self._next_lookup_epoch()
        slot = epoch % lay.num_slots
        batch = kjt.stride()
        out_dtype: Optional[torch.dtype] = None
        for src in self._order():
            block, h_batch, nnz = self._source_index(src, epoch)
            if h_batch != batch:
                raise self._fail(
                    PgasInputError(
                        "pgas_row_wise requires equal local batch sizes on all ranks: rank "
                        f"{src} has {h_batch}, rank {self.rank} has {batch}"
                    )
                )
            lengths = self.buf.view(torch.int32, block + lay.lengths_off, lay.num_features * batch)
            with torch.no_grad():
                partial = pool(self.received(src, block, self.feature_names, self._local_rows, lengths, nnz, batch))
            out_dtype = partial.dtype
            self.rt.put(self.buf, src, lay.output_block(slot, self.rank), partial)
            self.rt.signal(self.pad, src, lay.output_signal(self.rank), epoch)
        profiling.mark("lookup")
        self._await_outputs(epoch, "partial pooled outputs")
        assert out_dtype is not None
        out = torch.zeros(batch, lay.dim_sum, dtype=torch.float32, device=self.device)
        for s in range(self.world_size):  # rank order: deterministic sums
            out += self.buf.view(out_dtype, lay.output_block(slot, s), batch * lay.dim_sum).view(
                batch, lay.dim_sum
            )
        if self._mean_features is not None:
            out = out / self._mean_divisor(kjt)
        return no_backward(out.to(out_dtype), self.kind)

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


# Error codes of the device record (csrc/rw_pipeline.cuh, ErrorCode).
_ERR_BAD_ID, _ERR_BATCH, _ERR_TIMEOUT, _ERR_ABORT, _ERR_CORRUPT, _ERR_BAD_ID_WARN = 1, 2, 3, 4, 5, 6
_STATE_WORDS = 16 + 64  # kStateWords
# FBGEMM 1.6's training TBE cannot hold bf16 weights (its cache_precision check).
_WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1}
_BOUNDS_MODES = {BoundsCheckMode.FATAL: 0, BoundsCheckMode.WARNING: 1, BoundsCheckMode.IGNORE: 2}


class DeviceRwPipeline(PgasPipeline):
    """Three fused kernel launches per step on the current stream; no host sync.

    Device-side errors (bad ids, batch mismatch, timeouts, a peer's abort) land
    in a pinned record that the next step reads without syncing; ``check()``
    synchronizes first.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
                "(pgas_row_wise on GPUs needs one NVLink domain for now)"
            )
        self._peers = torch.tensor(peers, dtype=torch.int64, device=dev)
        out_cols = list(itertools.accumulate([0] + self.feature_dims[:-1]))
        self._feature_rows = [
            # RwFeature (csrc/rw_pipeline.cuh); weights, local_rows, dtype are filled
            # from the TBEs at the first lookup
            [0, 0, blk, n, d, c, 0, int(m), *divisor_magic(blk, n)]
            for blk, n, d, c, m in zip(self.shard_rows, self.feature_hash_sizes, self.feature_dims, out_cols,
                                       self.feature_is_mean)
        ]
        self._features = torch.tensor(self._feature_rows, dtype=torch.int64, device=dev)
        self._col_feature = torch.tensor(
            [f for f, d in enumerate(self.feature_dims) for _ in range(d // 4)], dtype=torch.int32, device=dev
        )
        self._state = torch.zeros(_STATE_WORDS, dtype=torch.int64, device=dev)
        self._bag_div = torch.zeros(lay.num_slots, lay.num_features * lay.max_batch, device=dev)
        self._status = torch.zeros(4, dtype=torch.int64).pin_memory()
        self._cfg = lay.kernel_config(
            int(self.config.wait_timeout_s * 1e9), self.rank, _BOUNDS_MODES[self.bounds_check_mode]
        )
        self._max_dim = max(self.feature_dims)
        self._out_dtype = torch.float32
        self._tbe_key: List[int] = []
        # Recorded after each finalize, per slot (see index_dist).
        self._slot_free = [torch.cuda.Event() for _ in range(lay.num_slots)]

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
            raise self._fail(PgasError(f"pgas_row_wise index dist failed to launch: {e}")) from e
        self.issued += 1

    def _bind_weights(self, tbes: Sequence[nn.Module]) -> None:
        """Point the feature table at the TBEs' weight storage (again only if it moved).

        Per step this costs one pointer read per TBE group, not per table.
        """
        key = [t.weights_dev.data_ptr() for t in tbes]
        if key == self._tbe_key:
            return
        weights = [w for t in tbes for w in _per_feature(t)]
        out_dtypes = {SparseType.from_int(t.output_dtype).as_dtype() for t in tbes}
        if len(weights) != len(self.feature_names) or len(out_dtypes) != 1:
            raise PgasError(
                f"pgas_row_wise: {len(weights)} TBE features with output dtypes {out_dtypes} "
                f"for the {len(self.feature_names)} features of the sharding"
            )
        for f, w in enumerate(weights):
            if w.dtype not in _WEIGHT_DTYPES or not w.is_cuda or w.dim() != 2 or w.stride(0) != w.size(1):
                raise PgasError(
                    f"pgas_row_wise: feature '{self.feature_names[f]}' has weights of dtype "
                    f"{w.dtype} on {w.device}; the GPU lookup reads row-major fp32/fp16 HBM"
                )
            row = self._feature_rows[f]
            row[0], row[1], row[6] = w.data_ptr(), w.size(0), _WEIGHT_DTYPES[w.dtype]
        self._features.copy_(torch.tensor(self._feature_rows, dtype=torch.int64))
        self._out_dtype = out_dtypes.pop()
        self._tbe_key = key

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        epoch = self._next_lookup_epoch()
        ops = torch.ops.torchrec_pgas
        args = (self.buf.local, self.pad.words, self._peers, self._features)
        try:
            self._bind_weights(tbes)
            ops.rw_lookup(*args, self._state, self._bag_div, self._status, self._cfg,
                          kjt.stride(), self._max_dim, self._out_dtype)
            profiling.mark("lookup")
            out = ops.rw_finalize(*args, self._col_feature, self._state, self._bag_div, self._status,
                                  self._cfg, kjt.stride(), self._out_dtype)
        except PgasError as e:  # peers wait for this rank's partials: abort them
            raise self._fail(e)
        except RuntimeError as e:
            raise self._fail(PgasError(f"pgas_row_wise lookup failed to launch: {e}")) from e
        if not torch.cuda.is_current_stream_capturing():
            self._slot_free[epoch % self.layout.num_slots].record()
        return no_backward(out, self.kind)

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
                "pgas_row_wise requires equal local batch sizes on all ranks: rank "
                f"{a} has {b}, rank {self.rank} has {c}"
            )
        if code == _ERR_TIMEOUT:
            stage = ("index data", "index data", "partial pooled outputs")[a]
            raise PgasTimeoutError(
                f"rank {self.rank} waited {self.config.wait_timeout_s:.0f}s for {stage} from rank {b}: "
                "a peer crashed, diverged, or is not running this step"
            )
        if code == _ERR_ABORT:
            raise PgasPeerAbortError(f"rank {a} aborted the pgas_row_wise step (see its error)")
        raise PgasError(f"pgas_row_wise: corrupt data from rank {a} (kind {b})")


def _per_feature(tbe: nn.Module) -> List[torch.Tensor]:
    """A TBE's weight views ``[local_rows, dim]``, one per feature it serves."""
    tables = tbe.split_embedding_weights()
    return [tables[t] for t in tbe.feature_table_map]


def make_rw_pipeline(device: torch.device, env: ShardingEnv, feature_hash_sizes: List[int],
                     feature_dims: List[int], **kwargs: Any) -> PgasPipeline:
    """Fused kernels on CUDA (nvshmem backend), the runtime-API path on CPU (shm)."""
    cls = DeviceRwPipeline if device.type == "cuda" else HostRwPipeline
    blocks = [(n + env.world_size - 1) // env.world_size for n in feature_hash_sizes]
    return cls(device=device, env=env, feature_hash_sizes=feature_hash_sizes, feature_dims=feature_dims,
               kind=PGAS_ROW_WISE, shard_rows=blocks, block_dim_sum=sum(feature_dims), **kwargs)
