"""The kernels' view of a sharding's features: which rank holds each table's row blocks (``FeatureOwners``), the
``FeatureDesc`` table the kernels read (``feature_descs``, bound to the TBEs' weights by ``bind_weights``), and the
combine's column map. Table-wise is the one-owner case of row-wise (``csrc/step_protocol.cuh``)."""

import itertools
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn

from torchrec_pgas.layout import divisor_magic
from torchrec_pgas.sharding.step import StepSpec
from torchrec_pgas.step_abi import BoundsMode, FeatureDesc, PoolingMode, WeightDtype, build
from torchrec_pgas.types import PgasError

# FBGEMM 1.6's training TBE cannot hold bf16 weights (its cache_precision check).
WEIGHT_DTYPES = {torch.float32: WeightDtype.F32, torch.float16: WeightDtype.F16}
BOUNDS_MODES = {BoundsCheckMode.FATAL: BoundsMode.FATAL, BoundsCheckMode.WARNING: BoundsMode.WARNING,
                BoundsCheckMode.IGNORE: BoundsMode.IGNORE}


@dataclass(frozen=True)
class FeatureOwners:
    """Where the rows of each feature's table live, as the kernels see them.

    Row block k (of ``shard_rows[f]`` rows) of feature f's table is on rank
    ``base[f] + k``, for ``count`` blocks; this rank's lookup serves features
    ``lookup[0]..lookup[1]-1``. ``pooling`` says who applies MEAN, per feature.
    """

    base: List[int]
    count: int
    pooling: List[PoolingMode]
    lookup: Tuple[int, int]
    variable_batch: bool

    @classmethod
    def row_wise(cls, world: int, feature_is_mean: Sequence[bool]) -> "FeatureOwners":
        """Block k of every table on rank k; every rank serves every feature; MEAN on the requester."""
        return cls(base=[0] * len(feature_is_mean), count=world,
                   pooling=[PoolingMode.MEAN_BY_REQUESTER if m else PoolingMode.SUM for m in feature_is_mean],
                   lookup=(0, len(feature_is_mean)), variable_batch=False)

    @classmethod
    def table_wise(cls, features_per_rank: Sequence[int], rank: int,
                   feature_is_mean: Sequence[bool]) -> "FeatureOwners":
        """Rank d owns the next ``features_per_rank[d]`` features' whole tables; MEAN on the owner (the TBE's
        arithmetic); each source's batch from its header."""
        first = list(itertools.accumulate([0, *features_per_rank]))
        return cls(base=[d for d, n in enumerate(features_per_rank) for _ in range(n)], count=1,
                   pooling=[PoolingMode.MEAN_BY_OWNER if m else PoolingMode.SUM for m in feature_is_mean],
                   lookup=(first[rank], first[rank + 1]), variable_batch=True)

    def check(self, world: int, rank: int) -> None:
        """The kernels index peer buffers by owner: every block must land on a rank, and this rank's
        lookup must serve exactly the features whose rows it holds."""
        num = len(self.base)
        bad = [f for f, b in enumerate(self.base) if not (0 <= b and b + self.count <= world)]
        held = [f for f, b in enumerate(self.base) if b <= rank < b + self.count]
        if bad or len(self.pooling) != num or held != list(range(*self.lookup)):
            raise PgasError(
                f"inconsistent feature owners for rank {rank} of {world}: blocks of features {bad} outside "
                f"the ranks, rows of features {held} held here, lookup range {self.lookup}"
            )


def feature_descs(shard_rows: Sequence[int], hash_sizes: Sequence[int], dims: Sequence[int],
                  owners: FeatureOwners) -> List[FeatureDesc]:
    """The kernels' feature table, each feature reading its own KJT feature, with no weights bound yet
    (``bind_weights``)."""
    out_cols = itertools.accumulate([0, *dims[:-1]])
    descs = []
    for f, (block, n, dim, col, pooling, base) in enumerate(
            zip(shard_rows, hash_sizes, dims, out_cols, owners.pooling, owners.base)):
        magic, shift = divisor_magic(block, n)
        descs.append(build(FeatureDesc, weights=0, local_rows=0, block=block, hash_size=n, dim=dim, out_col=col,
                           weight_dtype=WeightDtype.F32, pooling=pooling, block_magic=magic, block_shift=shift,
                           owner_base=base, owner_count=owners.count, input_feature=f))
    return descs


def bind_weights(desc: FeatureDesc, weights: torch.Tensor) -> None:
    """Point a feature at this rank's ``[local_rows, dim]`` row-major shard (kept alive by the caller)."""
    desc.weights, desc.local_rows, desc.weight_dtype = weights.data_ptr(), weights.size(0), WEIGHT_DTYPES[weights.dtype]


def bind_lookup_weights(descs: List[FeatureDesc], tbes: Sequence[nn.Module], lookup: Tuple[int, int],
                        spec: StepSpec) -> None:
    """Point the descriptors of the features this rank's lookup serves (``lookup``: first, end) at the TBEs'
    weight storage, which holds them in order; checks that the TBEs are what the kernels read."""
    weights = [w for t in tbes for w in per_feature(t)]
    out_dtypes = {SparseType.from_int(t.output_dtype).as_dtype() for t in tbes}
    f_lo, f_hi = lookup
    if len(weights) != f_hi - f_lo or not out_dtypes <= {spec.out_dtype}:
        raise PgasError(
            f"{spec.kind}: {len(weights)} TBE features with output dtypes {out_dtypes} "
            f"for the {f_hi - f_lo} features this rank holds (output dtype {spec.out_dtype})"
        )
    for f, w in enumerate(weights, start=f_lo):
        if w.dtype not in WEIGHT_DTYPES or not w.is_cuda or w.dim() != 2 or w.stride(0) != w.size(1):
            raise PgasError(
                f"{spec.kind}: feature '{spec.feature_names[f]}' has weights of dtype "
                f"{w.dtype} on {w.device}; the GPU lookup reads row-major fp32/fp16 HBM"
            )
        bind_weights(descs[f], w)


def column_features(dims: Sequence[int], device: torch.device) -> torch.Tensor:
    """The feature of every 4-column vector of the ``[B, sum(dims)]`` output (the combine's map)."""
    return torch.tensor([f for f, d in enumerate(dims) for _ in range(d // 4)], dtype=torch.int32, device=device)




def per_feature(tbe: nn.Module) -> List[torch.Tensor]:
    """A TBE's weight views ``[local_rows, dim]``, one per feature it serves."""
    tables = tbe.split_embedding_weights()
    return [tables[t] for t in tbe.feature_table_map]
