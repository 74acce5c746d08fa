"""The stages of one ``pgas_table_wise`` step: ``HostTwPipeline`` on the ``shm`` CPU backend.

On CUDA the fused kernels of ``DevicePipeline`` run it as the one-owner case
of row-wise (``device_pipeline.py``): the same three stages, the owner's lookup
writing each pooled vector at its final column of the requester's output.


Table t lives whole on its owner. One step, for W ranks with the F features of
this sharding (TorchRec's TW orders them rank by rank, so the features of owner
d are one contiguous range):

1. index dist (requester): put the lengths, ids and weights of owner d's
   feature range into d's index block for this source, then signal d. No
   bucketize and no splits exchange: an id's owner is its table's.
2. lookup (owner): for every source, remote ones first, wait for its signal,
   pool its bags of the local tables with the stock TW lookup (the TBE, MEAN
   included), put the ``[B_src, D_owner]`` block straight into the source's
   output block for this owner, then signal it.
3. gather (requester): wait for the W owners. Their blocks side by side, in
   rank order, are the stock TW output (``TwPooledEmbeddingDist``'s layout).

Each requester's batch travels in its header and its owners pool at that
batch, so ranks may feed different local batch sizes, as stock TW allows.
"""

import itertools
from typing import Any, List, Sequence

import torch
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.sharding.common import PgasPipeline, PoolFn, no_backward
from torchrec_pgas.sharding.device_pipeline import DevicePipeline, FeatureOwners
from torchrec_pgas.types import PGAS_TABLE_WISE


class HostTwPipeline(PgasPipeline):
    """The algorithm over the runtime API, with torch ops and the stock TW lookup."""

    def __init__(self, *args: Any, features_per_rank: List[int], dim_sum_per_rank: List[int],
                 out_dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dim_sum_per_rank = dim_sum_per_rank
        self.out_dtype = out_dtype
        self._first = list(itertools.accumulate([0] + features_per_rank))  # owner d: [first[d], first[d+1])
        mine = slice(self._first[self.rank], self._first[self.rank + 1])
        self.local_features = self.feature_names[mine]
        self._local_rows = self.shard_rows[mine]  # whole tables

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        values = self._checked_ids(kjt)
        lay = self.layout
        batch = kjt.stride()
        weights = kjt.weights_or_none()
        lengths, offsets = kjt.lengths().to(torch.int64), kjt.offsets()
        self.issued += 1
        epoch = self.issued
        block = lay.index_block(epoch % lay.num_slots, self.rank)
        for dest in self._order():
            f0, f1 = self._first[dest] * batch, self._first[dest + 1] * batch
            lo, hi = int(offsets[f0]), int(offsets[f1])
            dest_lengths = lengths[f0:f1]
            self.rt.put(self.buf, dest, block + lay.header_off, torch.tensor([epoch, batch, hi - lo, 0]))
            self.rt.put(self.buf, dest, block + lay.offsets_off,
                        torch.ops.fbgemm.asynchronous_complete_cumsum(dest_lengths))
            self.rt.put(self.buf, dest, block + lay.lengths_off, dest_lengths.to(torch.int32))
            self.rt.put(self.buf, dest, block + lay.ids_off, values[lo:hi].to(lay.id_dtype))
            if lay.weighted:
                assert weights is not None
                self.rt.put(self.buf, dest, block + lay.weights_off, weights[lo:hi].float())
            self.rt.signal(self.pad, dest, lay.index_signal(self.rank), epoch)

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        lay = self.layout
        epoch = self._next_lookup_epoch()
        slot = epoch % lay.num_slots
        for src in self._order():
            block, h_batch, nnz = self._source_index(src, epoch)
            lengths = self.buf.view(torch.int32, block + lay.lengths_off, len(self.local_features) * h_batch)
            received = self.received(src, block, self.local_features, self._local_rows, lengths, nnz, h_batch)
            if self.local_features:
                with torch.no_grad():
                    pooled = pool(received).to(self.out_dtype)
                self.rt.put(self.buf, src, lay.output_block(slot, self.rank), pooled)
            self.rt.signal(self.pad, src, lay.output_signal(self.rank), epoch)
        profiling.mark("lookup")
        self._await_outputs(epoch, "pooled outputs")
        batch = kjt.stride()
        blocks = [self.buf.view(self.out_dtype, lay.output_block(slot, owner), batch * d).view(batch, d)
                  for owner, d in enumerate(self.dim_sum_per_rank) if d > 0]
        out = torch.cat(blocks, dim=1) if blocks else torch.empty(batch, 0, dtype=self.out_dtype)
        return no_backward(out, self.kind)


def make_tw_pipeline(device: torch.device, env: ShardingEnv, feature_hash_sizes: List[int],
                     feature_dims: List[int], feature_is_mean: List[bool], features_per_rank: List[int],
                     dim_sum_per_rank: List[int], out_dtype: torch.dtype, **kwargs: Any) -> PgasPipeline:
    """Fused kernels on CUDA (nvshmem backend), the runtime-API path on CPU (shm).

    Both keep whole tables (``shard_rows`` = hash sizes). The host path's output
    blocks hold the owner's columns only, the kernels' the full ``[B, D]`` row
    (each owner writes its columns in place, the finalize copies them out).
    """
    common = dict(device=device, env=env, feature_hash_sizes=feature_hash_sizes, feature_dims=feature_dims,
                  feature_is_mean=feature_is_mean, kind=PGAS_TABLE_WISE, shard_rows=feature_hash_sizes,
                  out_dtype=out_dtype, **kwargs)
    if device.type != "cuda":
        return HostTwPipeline(features_per_rank=features_per_rank, dim_sum_per_rank=dim_sum_per_rank,
                              block_dim_sum=max(dim_sum_per_rank, default=0), **common)
    owners = FeatureOwners.table_wise(features_per_rank, env.rank, feature_is_mean)
    return DevicePipeline(owners=owners, block_dim_sum=sum(feature_dims), **common)
