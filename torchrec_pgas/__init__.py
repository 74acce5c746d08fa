"""torchrec-pgas: TorchRec embedding-bag sharding over one-sided PGAS communication.

Add ``PgasEmbeddingBagCollectionSharder`` to ``DistributedModelParallel`` and plan
tables as ``pgas_row_wise`` (see ``torchrec_pgas.planner``).
"""

from torchrec_pgas.stack import check_stack; check_stack()  # noqa: E702  first: before torchrec loads FBGEMM
from torchrec_pgas.embeddingbag import (
    PgasEmbeddingBagCollectionSharder,
    PgasShardedEmbeddingBagCollection,
    check_errors,
)
from torchrec_pgas.runtime import PgasRuntime, finalize_all, init
from torchrec_pgas.types import (
    PGAS_ROW_WISE,
    PgasBackendType,
    PgasCapacityError,
    PgasConfig,
    PgasError,
    PgasInputError,
    PgasPeerAbortError,
    PgasTimeoutError,
)

__all__ = [
    "PGAS_ROW_WISE",
    "PgasBackendType",
    "PgasCapacityError",
    "PgasConfig",
    "PgasEmbeddingBagCollectionSharder",
    "PgasError",
    "PgasInputError",
    "PgasPeerAbortError",
    "PgasRuntime",
    "PgasShardedEmbeddingBagCollection",
    "PgasTimeoutError",
    "check_errors",
    "finalize_all",
    "init",
]
