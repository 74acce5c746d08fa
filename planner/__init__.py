"""Plan-time code of torchrec-pgas (installed as ``torchrec_pgas.planner``): plan generators, the
latency-aware cost model, its calibration, and the enumerator that prices NCCL and PGAS per table."""

from torchrec_pgas.planner.cost_model import CostModel, HardwareProfile, TableLoad, load_profile
from torchrec_pgas.planner.enumerator import PgasDecisionStats, PgasEnumerator
from torchrec_pgas.planner.sharding_plan import pgas_row_wise, pgas_table_row_wise, pgas_table_wise, with_compute_kernel

__all__ = [
    "CostModel",
    "HardwareProfile",
    "PgasDecisionStats",
    "PgasEnumerator",
    "TableLoad",
    "load_profile",
    "pgas_row_wise",
    "pgas_table_row_wise",
    "pgas_table_wise",
    "with_compute_kernel",
]
