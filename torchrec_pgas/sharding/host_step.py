"""The host path of a PGAS step: the algorithm over the runtime API (put, signal, wait) with torch ops and
the stock TBE lookup. It is what the ``shm`` CPU backend runs, a real implementation of the same three
stages the fused kernels run on GPUs (``device_step.py``).

``HostRwStep`` (``pgas_row_wise``), for W ranks with local batch B and the F features of the sharding:

1. index dist (requester): bucketize each local bag's ids by owning rank
   (local row = id - owner * block) and put ids, lengths and weights into the
   owner's index block for this source; then signal the owner.
2. lookup (owner): for every source, remote ones first, wait for its signal,
   pool the received bags with the stock TBE lookup and put the partial pooled
   ``[B, D]`` block straight into the requester's output block for this owner;
   then signal the requester.
3. combine (requester): wait for the W owners, sum the partials in rank order,
   apply mean pooling.

``HostTwStep`` (``pgas_table_wise``): table t lives whole on its owner, and TorchRec's TW orders the
features rank by rank, so owner d's features are one contiguous range. The requester puts that range's
lengths, ids and weights into d's index block (no bucketize, no splits exchange); the owner pools each
source's bags at that source's batch (from its header: ranks may feed different local batch sizes, as stock
TW allows) with the stock TW lookup (MEAN included) and puts the ``[B_src, D_owner]`` block into the
source's output block; the owners' blocks side by side, in rank order, are the stock TW output.
"""

import bisect
import itertools
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.sharding.stages import no_backward
from torchrec_pgas.sharding.step import PgasStep, PoolFn, StepSpec
from torchrec_pgas.types import PgasError, PgasInputError

MEAN_EPS: float = 1e-6  # TorchRec's RW mean divisor guard (embeddingbag.py)


class HostStep(PgasStep):
    """What both host shardings share: checks of the local input, of what peers wrote, and the waits."""

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device, block_dim_sum: int) -> None:
        super().__init__(spec, env, device, block_dim_sum)
        self._hash_sizes = torch.tensor(spec.hash_sizes, dtype=torch.int64, device=device)
        self._warned: set = set()

    def _order(self) -> List[int]:
        """Remote peers first (their bytes travel), this rank last."""
        return [(self.rank + 1 + k) % self.world_size for k in range(self.world_size)]

    def _checked_ids(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The step's checks before anything is written; its ids after the bounds mode (ids decide the
        owner and the remote address)."""
        self.check_step(kjt)
        values = kjt.values().to(torch.int64)
        per_feature = kjt.length_per_key()
        hash_per_id = torch.repeat_interleave(self._hash_sizes, torch.tensor(per_feature, device=values.device))
        bad = (values < 0) | (values >= hash_per_id)
        if not bool(bad.any()):
            return values
        pos = int(torch.nonzero(bad)[0])
        f = bisect.bisect_right(list(itertools.accumulate(per_feature)), pos)
        msg = self.bad_id_message(f, int(values[pos]))
        if self.spec.bounds_check_mode == BoundsCheckMode.FATAL:
            raise self.fail(PgasInputError(msg))
        if self.spec.bounds_check_mode == BoundsCheckMode.WARNING and f not in self._warned:
            self._warned.add(f)
            warnings.warn(msg + "; such ids read row 0 (BoundsCheckMode.WARNING)")
        return torch.where(bad, torch.zeros_like(values), values)

    def _put_index_block(self, dest: int, block: int, epoch: int, batch: int, lengths: torch.Tensor,
                         ids: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        """Put one owner's share of this step (compacted: offsets are the prefix sums of ``lengths``), then
        signal it."""
        lay = self.layout
        header = torch.tensor([epoch, batch, ids.numel(), 0], dtype=torch.int64)
        self.rt.put(self.buf, dest, block + lay.header_off, header)
        self.rt.put(self.buf, dest, block + lay.offsets_off, torch.ops.fbgemm.asynchronous_complete_cumsum(lengths))
        self.rt.put(self.buf, dest, block + lay.lengths_off, lengths.to(torch.int32))
        self.rt.put(self.buf, dest, block + lay.ids_off, ids.to(lay.id_dtype))
        if lay.weighted:
            assert weights is not None
            self.rt.put(self.buf, dest, block + lay.weights_off, weights.float())
        self.rt.signal(self.pad, dest, lay.index_signal(self.rank), epoch)

    def _source_index(self, src: int, epoch: int) -> Tuple[int, int, int]:
        """Wait for ``src``'s index block of ``epoch``; its (offset, batch, nnz) once the header checks out
        (it decides what is read, so it is checked like any address)."""
        lay = self.layout
        self.rt.wait(self.pad, [lay.index_signal(src)], epoch, self.spec.config.wait_timeout_s,
                     f"index data from rank {src}")
        block = lay.index_block(epoch % lay.num_slots, src)
        h_epoch, h_batch, nnz, _ = self.buf.view(torch.int64, block + lay.header_off, 4).tolist()
        self.rt.check()
        if h_epoch != epoch or not 0 <= h_batch <= lay.max_batch or not 0 <= nnz <= lay.ids_capacity:
            raise self.fail(PgasError(
                f"corrupt index header from rank {src}: epoch {h_epoch}, batch {h_batch}, nnz {nnz}"))
        return block, h_batch, nnz

    def _await_outputs(self, epoch: int, what: str) -> None:
        """Wait until every owner has written this rank's output block of ``epoch``."""
        lay = self.layout
        self.rt.wait(self.pad, [lay.output_signal(s) for s in range(self.world_size)], epoch,
                     self.spec.config.wait_timeout_s, what)

    def _received(self, src: int, src_block: int, keys: Sequence[str], key_rows: Sequence[int], nnz: int,
                  batch: int) -> KeyedJaggedTensor:
        """Source ``src``'s index block as a KJT for the stock lookup, after checking what a peer wrote:
        lengths sum to ``nnz`` and are >= 0, and every id is a row this rank holds (``key_rows`` per key).
        The TBE's own bounds check follows the user's mode, which may be off; these decide what is read."""
        lay = self.layout
        lengths = self.buf.view(torch.int32, src_block + lay.lengths_off, len(keys) * batch)
        ids = self.buf.view(lay.id_dtype, src_block + lay.ids_off, nnz).to(torch.int64)
        if bool((lengths < 0).any()) or int(lengths.sum()) != nnz:
            raise self.fail(PgasError(f"corrupt index lengths from rank {src}: negative, or not summing to {nnz}"))
        per_key = lengths.view(len(keys), batch).sum(1)
        limit = torch.repeat_interleave(torch.tensor(list(key_rows), dtype=torch.int64), per_key.to(torch.int64))
        if bool(((ids < 0) | (ids >= limit)).any()):
            raise self.fail(PgasError(f"corrupt index data from rank {src}: a row outside this rank's shard"))
        return KeyedJaggedTensor(
            keys=list(keys),
            values=ids,
            lengths=lengths.to(torch.int64),
            weights=self.buf.view(torch.float32, src_block + lay.weights_off, nnz) if lay.weighted else None,
            stride=batch,
        )


class HostRwStep(HostStep):
    """``pgas_row_wise`` on the host path (module docstring)."""

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device) -> None:
        super().__init__(spec, env, device, block_dim_sum=sum(spec.dims))
        self._block_sizes = torch.tensor(spec.shard_rows, dtype=torch.int64, device=device)
        # This rank's rows of each table (the last block is short, or empty for tiny tables).
        self._local_rows = [max(0, min(b, n - self.rank * b)) for b, n in zip(spec.shard_rows, spec.hash_sizes)]
        self._mean = torch.tensor(spec.is_mean, device=device)
        self._dims = torch.tensor(spec.dims, device=device)

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        values = self._checked_ids(kjt)
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
        starts = [0] + per_dest.sum(1).cumsum(0).tolist()
        self.issued += 1
        block = self.layout.index_block(self.issued % self.layout.num_slots, self.rank)
        for dest in self._order():
            span = slice(starts[dest], starts[dest + 1])
            self._put_index_block(dest, block, self.issued, kjt.stride(), per_dest[dest], ids[span],
                                  bucket_weights[span] if bucket_weights is not None else None)

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        lay = self.layout
        epoch = self.next_lookup_epoch()
        slot = epoch % lay.num_slots
        batch = kjt.stride()
        out_dtype = self.spec.out_dtype
        for src in self._order():
            block, h_batch, nnz = self._source_index(src, epoch)
            if h_batch != batch:
                raise self.fail(PgasInputError(
                    "pgas_row_wise requires equal local batch sizes on all ranks: rank "
                    f"{src} has {h_batch}, rank {self.rank} has {batch}"
                ))
            with torch.no_grad():
                partial = pool(self._received(src, block, self.feature_names, self._local_rows, nnz, batch))
            out_dtype = partial.dtype
            self.rt.put(self.buf, src, lay.output_block(slot, self.rank), partial)
            self.rt.signal(self.pad, src, lay.output_signal(self.rank), epoch)
        profiling.mark("lookup")
        self._await_outputs(epoch, "partial pooled outputs")
        out = torch.zeros(batch, lay.dim_sum, dtype=torch.float32, device=self.device)
        for s in range(self.world_size):  # rank order: deterministic sums
            out += self.buf.view(out_dtype, lay.output_block(slot, s), batch * lay.dim_sum).view(batch, lay.dim_sum)
        if any(self.spec.is_mean):
            out = out / self._mean_divisor(kjt)
        return no_backward(out.to(out_dtype), self.kind)

    def _mean_divisor(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """[B, D] divisor, like TorchRec RW: bag length (or weight sum) + eps; 1 for sum."""
        weights = kjt.weights_or_none()
        if weights is not None:
            lengths = torch.ops.fbgemm.segment_sum_csr(1, kjt.offsets().int(), weights.float())
        else:
            lengths = kjt.lengths().float()
        per_bag = lengths.view(self.spec.num_features, -1) + MEAN_EPS  # [F, B]
        per_bag = torch.where(self._mean[:, None], per_bag, torch.ones_like(per_bag))
        return torch.repeat_interleave(per_bag.t(), self._dims, dim=1)


class HostTwStep(HostStep):
    """``pgas_table_wise`` on the host path (module docstring). An output block holds the owner's columns
    only, ``[B, D_owner]`` (the layout's ``dim_sum`` is the widest owner's)."""

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device) -> None:
        super().__init__(spec, env, device, block_dim_sum=max(spec.dim_sum_per_rank, default=0))
        self._first = list(itertools.accumulate([0, *spec.features_per_rank]))  # owner d: [first[d], first[d+1])
        lo, hi = self.lookup_features
        self._local_features = spec.feature_names[lo:hi]
        self._local_rows = spec.shard_rows[lo:hi]  # whole tables

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        values = self._checked_ids(kjt)
        batch = kjt.stride()
        weights = kjt.weights_or_none()
        lengths, offsets = kjt.lengths().to(torch.int64), kjt.offsets()
        self.issued += 1
        block = self.layout.index_block(self.issued % self.layout.num_slots, self.rank)
        for dest in self._order():
            f0, f1 = self._first[dest] * batch, self._first[dest + 1] * batch
            span = slice(int(offsets[f0]), int(offsets[f1]))
            self._put_index_block(dest, block, self.issued, batch, lengths[f0:f1], values[span],
                                  weights[span] if weights is not None else None)

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        lay = self.layout
        epoch = self.next_lookup_epoch()
        slot = epoch % lay.num_slots
        out_dtype = self.spec.out_dtype
        for src in self._order():
            block, h_batch, nnz = self._source_index(src, epoch)
            received = self._received(src, block, self._local_features, self._local_rows, nnz, h_batch)
            if self._local_features:
                with torch.no_grad():
                    pooled = pool(received).to(out_dtype)
                self.rt.put(self.buf, src, lay.output_block(slot, self.rank), pooled)
            self.rt.signal(self.pad, src, lay.output_signal(self.rank), epoch)
        profiling.mark("lookup")
        self._await_outputs(epoch, "pooled outputs")
        batch = kjt.stride()
        blocks = [self.buf.view(out_dtype, lay.output_block(slot, owner), batch * d).view(batch, d)
                  for owner, d in enumerate(self.spec.dim_sum_per_rank) if d > 0]
        out = torch.cat(blocks, dim=1) if blocks else torch.empty(batch, 0, dtype=out_dtype)
        return no_backward(out, self.kind)
