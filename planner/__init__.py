"""Plan-time code of torchrec-pgas (installed as ``torchrec_pgas.planner``)."""

from torchrec_pgas.planner.sharding_plan import pgas_row_wise

__all__ = ["pgas_row_wise"]
