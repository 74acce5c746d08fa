"""The three stages of one ``pgas_row_wise`` step, on each backend.

Two paths implement the stages over the shared ``PgasPipeline`` state
(``common.py``):

* ``HostRwPipeline`` writes the algorithm against the runtime API (put,
  signal, wait) with torch ops and the stock TBE lookup; it is what the
  ``shm`` CPU backend runs.
* ``DevicePipeline`` (``device_pipeline.py``) launches the fused kernels of
  ``csrc/rw_*.cu`` (three launches per step whatever the number of tables, no
  host sync, graph capturable); it is what the ``nvshmem`` backend runs.
"""

from typing import Any, List, Optional, Sequence

import torch
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.sharding.common import PgasPipeline, PoolFn, no_backward
from torchrec_pgas.sharding.device_pipeline import DevicePipeline, FeatureOwners
from torchrec_pgas.types import PGAS_ROW_WISE, PgasInputError

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


def make_rw_pipeline(device: torch.device, env: ShardingEnv, feature_hash_sizes: List[int],
                     feature_dims: List[int], feature_is_mean: List[bool], out_dtype: torch.dtype,
                     **kwargs: Any) -> PgasPipeline:
    """Fused kernels on CUDA (nvshmem backend), the runtime-API path on CPU (shm)."""
    blocks = [(n + env.world_size - 1) // env.world_size for n in feature_hash_sizes]
    common = dict(device=device, env=env, feature_hash_sizes=feature_hash_sizes, feature_dims=feature_dims,
                  feature_is_mean=feature_is_mean, kind=PGAS_ROW_WISE, shard_rows=blocks,
                  block_dim_sum=sum(feature_dims), **kwargs)
    if device.type != "cuda":
        return HostRwPipeline(**common)
    owners = FeatureOwners.row_wise(env.world_size, feature_is_mean)
    return DevicePipeline(owners=owners, out_dtype=out_dtype, **common)
