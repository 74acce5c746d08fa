"""torchrec-pgas: TorchRec embedding-bag sharding over one-sided PGAS communication.

Add ``PgasEmbeddingBagCollectionSharder`` to ``DistributedModelParallel`` and plan
tables as ``pgas_row_wise`` or ``pgas_table_wise`` (see ``torchrec_pgas.planner``).
"""

from torchrec_pgas.stack import check_stack; check_stack()  # noqa: E702  first: before torchrec loads FBGEMM
from torchrec_pgas.bootstrap import finalize_all, shutdown
from torchrec_pgas.bootstrap import init_runtime as init
from torchrec_pgas.embeddingbag import (
    PgasEmbeddingBagCollectionSharder,
    PgasShardedEmbeddingBagCollection,
    check_errors,
    owner_backward_trials,
    pgas_steps,
    trace_comm,
)
from torchrec_pgas.runtime import PgasRuntime
from torchrec_pgas.sharding.owner_choice import AUTO_TRIAL_BACKWARDS
from torchrec_pgas.sharding.step import PgasStep, StepSpec
from torchrec_pgas.static_kjt import StaticKJT
from torchrec_pgas.train_graph import CapturedTrainStep, copy_kjt_
from torchrec_pgas.train_pipeline import ReplayDataParallelWrapper, ReplayTrainPipeline
from torchrec_pgas.types import (
    PGAS_ROW_WISE,
    PGAS_TABLE_ROW_WISE,
    PGAS_TABLE_WISE,
    OwnerBackward,
    PgasBackendType,
    PgasCapacityError,
    PgasConfig,
    PgasError,
    PgasInputError,
    PgasPeerAbortError,
    PgasTimeoutError,
    PgasTrainingConfig,
    pooling_capacity_from_constraints,
)

__all__ = [
    "AUTO_TRIAL_BACKWARDS",
    "CapturedTrainStep",
    "OwnerBackward",
    "PGAS_ROW_WISE",
    "PGAS_TABLE_ROW_WISE",
    "PGAS_TABLE_WISE",
    "PgasBackendType",
    "PgasCapacityError",
    "PgasConfig",
    "PgasEmbeddingBagCollectionSharder",
    "PgasError",
    "PgasInputError",
    "PgasPeerAbortError",
    "PgasRuntime",
    "PgasShardedEmbeddingBagCollection",
    "PgasStep",
    "PgasTimeoutError",
    "PgasTrainingConfig",
    "ReplayDataParallelWrapper",
    "ReplayTrainPipeline",
    "StaticKJT",
    "StepSpec",
    "check_errors",
    "owner_backward_trials",
    "copy_kjt_",
    "finalize_all",
    "pooling_capacity_from_constraints",
    "init",
    "pgas_steps",
    "shutdown",
    "trace_comm",
]
