"""A synthetic Criteo-like click dataset, generated locally with a fixed seed.

13 dense features (log-normal counts, log1p-transformed as in TorchRec's Criteo
pipeline) and 26 categorical features, one id per feature per sample (or, with
``max_ids_per_bag`` N > 1, multi-hot: 1 to N ids, uniformly), with the
Criteo Kaggle cardinalities capped at ``max_rows``. Ids follow a bounded
Zipf(alpha) law, scattered over the table by a multiplicative hash (hashed
Criteo ids are not sorted by frequency). Labels come from a fixed logistic
model of the dense features and of the features whose bag holds a hot id, so AUC
means something after training. Batches follow TorchRec's ``Batch`` convention.
"""

from typing import Iterator, List

import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# Criteo Display Advertising Challenge (Kaggle) categorical cardinalities, as in
# TorchRec's DLRM example.
CRITEO_KAGGLE_ROWS: List[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
_HASH = 2654435761  # Knuth's multiplicative hash


def table_rows(max_rows: int) -> List[int]:
    return [min(n, max_rows) for n in CRITEO_KAGGLE_ROWS]


def zipf_ids(rows: int, n: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """n ids in [0, rows), rank r drawn with probability ~ r^-alpha (inverse CDF of the power law)."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        rank = torch.exp(u * torch.log(torch.tensor(rows + 1.0, dtype=torch.float64)))
    else:
        a = 1.0 - alpha
        rank = (u * ((rows + 1.0) ** a - 1.0) + 1.0) ** (1.0 / a)
    rank = rank.long().clamp(1, rows) - 1
    return (rank * _HASH) % rows


class SyntheticCriteo(IterableDataset):
    """``num_batches`` batches of ``batch_size`` samples; ``seed`` makes them reproducible."""

    def __init__(self, batch_size: int, num_batches: int, max_rows: int, seed: int, alpha: float = 1.05,
                 max_ids_per_bag: int = 1) -> None:
        super().__init__()
        if max_ids_per_bag < 1:
            raise ValueError(f"max_ids_per_bag must be at least 1, got {max_ids_per_bag}")
        self.batch_size = batch_size
        self.max_ids_per_bag = max_ids_per_bag
        self.num_batches = num_batches
        self.rows = table_rows(max_rows)
        self.seed = seed
        self.alpha = alpha
        gen = torch.Generator().manual_seed(12345)  # the label model is the same for every rank
        self._dense_w = torch.randn(INT_FEATURE_COUNT, generator=gen) / INT_FEATURE_COUNT**0.5

    def __iter__(self) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(self.seed)
        b = self.batch_size
        for _ in range(self.num_batches):
            counts = torch.exp(1.5 * torch.randn(b, INT_FEATURE_COUNT, generator=gen)).floor()
            dense = torch.log1p(counts)
            lengths = self._lengths(gen)
            ids = [zipf_ids(rows, int(n.sum()), self.alpha, gen) for rows, n in zip(self.rows, lengths)]
            hot = torch.stack([_bags_holding(x < max(1, rows // 100), n)  # features holding a hot id, per sample
                               for x, rows, n in zip(ids, self.rows, lengths)]).sum(0)
            logit = (dense - dense.mean()) @ self._dense_w + 0.3 * (hot - hot.mean())
            labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
            sparse = KeyedJaggedTensor.from_lengths_sync(
                keys=list(DEFAULT_CAT_NAMES),
                values=torch.cat(ids),
                lengths=lengths.view(-1),
            )
            yield Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def __len__(self) -> int:
        return self.num_batches

    def _lengths(self, gen: torch.Generator) -> torch.Tensor:
        """[features, batch] ids per bag: ones (no draw: one-hot batches stay as they were), or 1 to N."""
        shape = (len(self.rows), self.batch_size)
        if self.max_ids_per_bag == 1:
            return torch.ones(shape, dtype=torch.int64)
        return torch.randint(1, self.max_ids_per_bag + 1, shape, generator=gen)


def _bags_holding(hit: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per bag (one per sample), 1.0 where any of its ids is a hit."""
    bag = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return torch.zeros(len(lengths)).index_add_(0, bag, hit.float()).clamp(max=1.0)
