"""A synthetic Criteo-like click dataset, generated locally with a fixed seed.

13 dense features (log-normal counts, log1p-transformed as in TorchRec's Criteo
pipeline) and 26 categorical features, one id per feature per sample, with the
Criteo Kaggle cardinalities capped at ``max_rows``. Ids follow a bounded
Zipf(alpha) law, scattered over the table by a multiplicative hash (hashed
Criteo ids are not sorted by frequency). Labels come from a fixed logistic
model of the dense features and of a few hot ids, so AUC means something after
training. Batches follow TorchRec's ``Batch`` convention.
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

    def __init__(self, batch_size: int, num_batches: int, max_rows: int, seed: int, alpha: float = 1.05) -> None:
        super().__init__()
        self.batch_size = batch_size
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
            ids = [zipf_ids(rows, b, self.alpha, gen) for rows in self.rows]
            hot = sum((x < max(1, rows // 100)).float() for x, rows in zip(ids, self.rows))
            logit = (dense - dense.mean()) @ self._dense_w + 0.3 * (hot - hot.mean())
            labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
            sparse = KeyedJaggedTensor.from_lengths_sync(
                keys=list(DEFAULT_CAT_NAMES),
                values=torch.cat(ids),
                lengths=torch.ones(len(self.rows) * b, dtype=torch.int64),
            )
            yield Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def __len__(self) -> int:
        return self.num_batches
