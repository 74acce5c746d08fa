"""``PgasEnumerator``: TorchRec's enumerator, with ``pgas_row_wise`` priced next to ``row_wise``.

Use it in place of ``EmbeddingEnumerator``::

    enumerator = PgasEnumerator(topology, batch_per_rank, constraints=constraints)
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_per_rank, enumerator=enumerator,
        constraints=constraints, stats=[PgasDecisionStats()])
    plan = planner.collective_plan(model, [PgasEmbeddingBagCollectionSharder()], pg)

TorchRec cannot compute shard sizes for a sharding type it does not know, so the PGAS type is enumerated
as its stock twin (same shards, same storage) and cloned. Both are then priced by the cost model
(``cost_model.py``); the proposers and partitioner pick per table as usual. Other collective sharding
types (TW, CW, TWRW) keep TorchRec's bandwidth estimates plus NCCL's fixed-cost share, which those
estimates leave out; data parallel (no forward communication) is unchanged.
``ParameterConstraints.sharding_types`` still restricts choices, and
``backends="pgas"`` / ``"nccl"`` takes one side for every table whose constraints allow both.
PGAS has no backward pass yet, so ``training=True`` offers no PGAS option.
"""

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Set, Union

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.planner.types import (
    Enumerator,
    ParameterConstraints,
    Perf,
    ShardEstimator,
    ShardingOption,
    Stats,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType

from torchrec_pgas.embeddingbag import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.planner.cost_model import NCCL_RW, PGAS_RW, CostModel, HardwareProfile, TableLoad, load_profile
from torchrec_pgas.planner.report import HEADER, decision_row
from torchrec_pgas.types import PGAS_ROW_WISE

logger = logging.getLogger(__name__)
ROW_WISE = ShardingType.ROW_WISE.value
_BACKEND = {ROW_WISE: NCCL_RW, PGAS_ROW_WISE: PGAS_RW}


@dataclasses.dataclass(frozen=True)
class Decision:
    """One row-wise table as the enumerator saw it: its load, and why it may not get both types."""

    load: TableLoad
    reason: Optional[str]  # None: both offered and the cost model decides


class PgasEnumerator(EmbeddingEnumerator):
    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        estimator: Optional[Union[ShardEstimator, List[ShardEstimator]]] = None,
        profile: Optional[HardwareProfile] = None,
        mode: str = "eager",
        backends: str = "auto",
        training: bool = False,
    ) -> None:
        if backends not in ("auto", "pgas", "nccl"):
            raise ValueError(f"PgasEnumerator: backends must be 'auto', 'pgas' or 'nccl', got {backends!r}")
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimator)
        self.model = CostModel(profile or load_profile(), topology.world_size, batch_size, mode)
        self.backends = backends
        self.training = training
        self.decisions: List[Decision] = []
        self._offer: Dict[str, List[str]] = {}  # table -> the RW-family types it may get
        self._why: Dict[str, str] = {}  # table -> why it may not get both
        self.num_tables = 0  # tables in the last enumeration (each pays 1/num_tables of a fixed cost)
        self._pgas_modules: Set[str] = set()  # sharder keys of the module types the PGAS sharder shards

    def _filter_sharding_types(self, name: str, allowed_sharding_types: List[str], sharder_key: str = "") -> List[str]:
        allowed = list(allowed_sharding_types)
        if sharder_key in self._pgas_modules and ROW_WISE in allowed:  # it lists stock types only (see its doc)
            allowed.append(PGAS_ROW_WISE)
        kept = super()._filter_sharding_types(name, allowed, sharder_key)
        # Constraints win over the backend preference; training has no PGAS backward.
        pgas = PGAS_ROW_WISE in kept and not self.training and (self.backends != "nccl" or ROW_WISE not in kept)
        stock = ROW_WISE in kept and (self.backends != "pgas" or not pgas)
        self._offer[name] = [t for t, ok in ((ROW_WISE, stock), (PGAS_ROW_WISE, pgas)) if ok]
        if PGAS_ROW_WISE in kept and self.training:
            self._why[name] = "training (no PGAS bwd)"
        elif PGAS_ROW_WISE in kept and ROW_WISE in kept and self.backends != "auto":
            self._why[name] = f"backends={self.backends}"
        elif len(self._offer[name]) == 1:
            self._why[name] = "constraints"
        out = [t for t in kept if t not in (ROW_WISE, PGAS_ROW_WISE)]
        return out + [ROW_WISE] if self._offer[name] else out

    def enumerate(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> List[ShardingOption]:
        # Only the modules the PGAS sharder shards can get PGAS types; reasons are per enumeration.
        self._pgas_modules = {sharder_name(s.module_type) for s in sharders
                              if isinstance(s, PgasEmbeddingBagCollectionSharder)}
        self._offer, self._why = {}, {}
        options = super().enumerate(module, sharders)
        num_tables = self.num_tables = len({o.name for o in options})
        out: List[ShardingOption] = []
        loads: Dict[str, TableLoad] = {}
        nccl_share = self.model.profile.get(NCCL_RW, self.model.mode).alpha_ms / max(1, num_tables)
        for o in options:
            offer = self._offer.get(o.name, [])
            if o.sharding_type == ROW_WISE and o.compute_kernel == EmbeddingComputeKernel.FUSED.value:
                # The model prices the HBM-resident fused TBE, which the PGAS kernels read too.
                load = loads[o.name] = _load(o)
                for st in offer:
                    opt = o if st == ROW_WISE else _clone(o, PGAS_ROW_WISE)
                    if not self.training:  # training keeps TorchRec's forward + backward estimates
                        ms = self.model.table_ms(load, _BACKEND[st], num_tables)
                        _price(opt, compute_ms=self.model.lookup_ms(load, _BACKEND[st]), total_ms=ms)
                    out.append(opt)
                continue
            if o.sharding_type == ROW_WISE and ROW_WISE not in offer:
                continue  # a non-fused RW option of a table that may only go PGAS
            if not self.training and o.sharding_type != ShardingType.DATA_PARALLEL.value:
                # TW/CW/TWRW and non-fused RW run TorchRec's input and output dists: the same
                # fixed cost (host syncs, collective latency) its bandwidth-only estimate leaves out.
                for shard in o.shards:
                    if shard.perf is not None:
                        shard.perf = dataclasses.replace(shard.perf, fwd_comms=shard.perf.fwd_comms + nccl_share)
            out.append(o)
        self.decisions = [Decision(load, self._why.get(name)) for name, load in loads.items()]
        return out


def _load(o: ShardingOption) -> TableLoad:
    rows, dim = o.tensor.shape
    return TableLoad(o.name, rows, dim, list(o.input_lengths), o.tensor.element_size())


def _clone(o: ShardingOption, sharding_type: str) -> ShardingOption:
    """Same shards and storage, another type (no deep copy of the table tensor)."""
    c = copy.copy(o)
    c.sharding_type = sharding_type
    c.shards = [dataclasses.replace(s) for s in o.shards]
    return c


def _price(o: ShardingOption, compute_ms: float, total_ms: float) -> None:
    """Every RW shard costs its rank the table's per-rank step time (inference: no backward)."""
    for s in o.shards:
        s.perf = Perf(fwd_compute=compute_ms, fwd_comms=total_ms - compute_ms, bwd_compute=0.0, bwd_comms=0.0)


class PgasDecisionStats(Stats):
    """Planner stats that know the PGAS types: the per-table decision table of a ``PgasEnumerator``
    (TorchRec's ``EmbeddingStats`` computes I/O sizes per sharding type and rejects unknown ones)."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def log(self, sharding_plan: ShardingPlan, topology: Topology, batch_size: int,
            storage_reservation: StorageReservation, num_proposals: int, num_plans: int, run_time: float,
            best_plan: List[ShardingOption], constraints: Optional[Dict[str, ParameterConstraints]] = None,
            sharders: Optional[List[ModuleSharder[nn.Module]]] = None, enumerator: Optional[Enumerator] = None,
            debug: bool = False, **kwargs: Any) -> None:
        chosen = {o.name: o.sharding_type for o in best_plan}
        if not isinstance(enumerator, PgasEnumerator):
            return
        self.lines = [HEADER] + [decision_row(enumerator.model, d.load, enumerator.num_tables,
                                              chosen.get(d.load.name, "?"), d.reason) for d in enumerator.decisions]
        logger.info("torchrec_pgas planner (%d plans, %.2fs):\n%s", num_plans, run_time, "\n".join(self.lines))
