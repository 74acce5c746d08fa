"""``PgasEnumerator``: TorchRec's enumerator, with ``pgas_row_wise`` and ``pgas_table_wise`` priced next to
``row_wise`` and ``table_wise``: four options per table.

Use it in place of ``EmbeddingEnumerator``::

    enumerator = PgasEnumerator(topology, batch_per_rank, constraints=constraints)
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_per_rank, enumerator=enumerator,
        constraints=constraints, stats=[PgasDecisionStats()],
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15))  # TorchRec 1.9 warns without
    plan = planner.collective_plan(model, [PgasEmbeddingBagCollectionSharder()], pg)

TorchRec cannot compute shard sizes for a sharding type it does not know, so each PGAS type is enumerated
as its stock twin (same shards, same storage) and cloned. All four are then priced by the cost model
(``cost_model.py``): a row-wise shard costs every rank the table's per-rank step time, a table-wise shard
costs its owner the owner's time; the proposers and partitioner pick per table and place the table-wise
ones as usual. A profile without table-wise coefficients (older calibrations) leaves table-wise to
TorchRec's estimate and offers no ``pgas_table_wise``. Other collective sharding types (CW, TWRW) keep
TorchRec's bandwidth estimates plus NCCL's fixed-cost share, which those estimates leave out; data
parallel (no forward communication) is unchanged.
``ParameterConstraints.sharding_types`` still restricts choices, and
``backends="pgas"`` / ``"nccl"`` takes one side within each family (row-wise, table-wise) whose two types
a table's constraints allow; a family the constraints allow only one type of keeps it.

``training=True`` offers the same options and prices each of the four as forward + backward with one
model (``CostModel(training=True)``): ``Perf.bwd_compute`` is the owner's fused TBE backward (PGAS: plus
the replayed lookup), ``Perf.bwd_comms`` the pooled gradient's way back (stock: all-gather / all-to-all;
PGAS: one-sided, row-wise only to the owners that served each bag). The other types keep TorchRec's
forward + backward estimates, plus shares of stock's fixed costs (forward and backward) as the priced options carry.

``pgas_row_wise`` and ``pgas_table_wise`` need every rank in one NVLink domain: a job larger than
``nvlink_domain_size`` (default TorchRec's ``Topology.intra_group_size``: a node, or a multi-node NVLink pod) is
offered neither. Give it where the topology's ``local_world_size`` is not the host's, as when ranks share one GPU
(``local_size=1`` plans). A job of several nodes (TorchRec's hosts, ``intra_group_size`` ranks each) is offered
``pgas_table_row_wise`` next to ``table_row_wise`` instead, both priced by ``inter_node.TableRowWiseCost``; its
options stay typed ``table_row_wise`` through TorchRec's partitioner, and the planner callback
``name_pgas_table_row_wise`` names them (pass ``callbacks=[enumerator.name_pgas_table_row_wise]``).
"""

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
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
from torchrec_pgas.planner.cost_model import (
    NCCL_RW,
    NCCL_TW,
    PGAS_TW,
    CostModel,
    HardwareProfile,
    TableLoad,
    TablePrice,
    load_profile,
)
from torchrec_pgas.planner.inter_node import InterNodeLink, TableRowWiseCost
from torchrec_pgas.planner.report import SHARDING_TYPE, decision_row, header
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_ROW_WISE, PGAS_TABLE_WISE

logger = logging.getLogger(__name__)
ROW_WISE = ShardingType.ROW_WISE.value
TABLE_WISE = ShardingType.TABLE_WISE.value
TABLE_ROW_WISE = ShardingType.TABLE_ROW_WISE.value
# stock type -> its PGAS twin
PGAS_TWIN = {ROW_WISE: PGAS_ROW_WISE, TABLE_WISE: PGAS_TABLE_WISE, TABLE_ROW_WISE: PGAS_TABLE_ROW_WISE}
BACKEND = {t: b for b, t in SHARDING_TYPE.items()}  # sharding type -> cost-model backend


@dataclasses.dataclass(frozen=True)
class Decision:
    """One table as the enumerator saw it: its load, the types it priced, and why it may not get them all."""

    load: TableLoad
    offered: List[str]  # the sharding types priced by the cost model
    reason: Optional[str]  # None: every priced type allowed, and the cost model decides


def local_gpu(topology: Topology) -> Optional[str]:
    """This host's CUDA device name when it plans for CUDA and has a GPU, so that the shipped profile of
    that GPU prices the plan; None in a dry run without one (the default profile)."""
    return torch.cuda.get_device_name() if topology.compute_device == "cuda" and torch.cuda.is_available() else None


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
        nvlink_domain_size: Optional[int] = None,
        storage_reservation: float = 0.15,
    ) -> None:
        if backends not in ("auto", "pgas", "nccl"):
            raise ValueError(f"PgasEnumerator: backends must be 'auto', 'pgas' or 'nccl', got {backends!r}")
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimator)
        profile_given = profile is not None
        profile = profile or load_profile(device_name=local_gpu(topology), world_size=topology.world_size)
        self.model = CostModel(profile, topology.world_size, batch_size, mode, training)
        self.backends = backends
        self.decisions: List[Decision] = []
        self._offer: Dict[str, List[str]] = {}  # table -> the RW/TW-family types it may get
        self._why: Dict[str, str] = {}  # table -> why it may not get them all
        self.num_tables = 0  # tables in the last enumeration (each pays 1/num_tables of a fixed cost)
        self._pgas_modules: Set[str] = set()  # sharder keys of the module types the PGAS sharder shards
        # pgas_row_wise and pgas_table_wise need every rank in one NVLink domain: TorchRec's intra_group_size (a
        # node, or a multi-node NVLink pod). A job of several whole domains is offered pgas_table_row_wise beside
        # table_row_wise instead (one-sided inside each domain), priced by ``TableRowWiseCost``.
        domain = nvlink_domain_size or getattr(topology, "intra_group_size", topology.local_world_size)
        self._beyond_domain = (f"{topology.world_size} ranks span more than one NVLink domain ({domain} ranks)"
                               if topology.world_size > domain else None)
        # Table-row-wise nodes are TorchRec's hosts (intra_group_size), as its partitioner places them and the
        # sharding's node groups run them.
        node = topology.intra_group_size
        self.twrw: Optional[TableRowWiseCost] = None
        # what the partitioner could use of each rank's HBM (the planner's FixedPercentageStorageReservation)
        self._hbm_per_rank = [int(d.storage.hbm * (1 - storage_reservation)) for d in topology.devices]
        if self._beyond_domain is not None and node > 1 and topology.world_size % node == 0:
            node_profile = profile if profile_given else load_profile(device_name=local_gpu(topology), world_size=node)
            self.twrw = TableRowWiseCost(node_profile, topology.world_size // node, node, batch_size,
                                         InterNodeLink.of(node_profile, topology.inter_host_bw), mode, training)

    def _families(self) -> List[str]:
        """The stock types whose PGAS twin this job may get and the profile can price: row-wise and table-wise
        inside one NVLink domain, table-row-wise beyond it (none where the job is not whole domains)."""
        if self._beyond_domain is not None:
            return [TABLE_ROW_WISE] if self.twrw is not None else []
        return [ROW_WISE] + ([TABLE_WISE] if self.model.profile.has(NCCL_TW, self.model.mode)
                             and self.model.profile.has(PGAS_TW, self.model.mode) else [])

    def _filter_sharding_types(self, name: str, allowed_sharding_types: List[str], sharder_key: str = "") -> List[str]:
        allowed = list(allowed_sharding_types)
        families = self._families()
        if sharder_key in self._pgas_modules:  # it lists stock types only (its doc)
            allowed += [PGAS_TWIN[f] for f in families if f in allowed]
        kept = super()._filter_sharding_types(name, allowed, sharder_key)
        if self._beyond_domain is not None:
            self._refuse_pgas_only(name)
        # Constraints win over the backend preference.
        offer: List[str] = []
        for family in families:
            twin = PGAS_TWIN[family]
            pgas = twin in kept and (self.backends != "nccl" or family not in kept)
            stock = family in kept and (self.backends != "pgas" or not pgas)
            offer += [t for t, ok in ((family, stock), (twin, pgas)) if ok]
            if twin in kept and family in kept and self.backends != "auto":
                self._why[name] = f"backends={self.backends}"
        if name not in self._why and 0 < len(offer) < 2 * len(families):
            self._why[name] = self._beyond_domain or "constraints"
        self._offer[name] = offer
        managed = set(families) | {PGAS_TWIN[f] for f in families}
        # TorchRec enumerates the stock type of each family still offered; its options are cloned.
        return [t for t in kept if t not in managed] + [f for f in families if {f, PGAS_TWIN[f]} & set(offer)]

    def _refuse_pgas_only(self, name: str) -> None:
        """A table whose constraints allow PGAS types only cannot be planned beyond one NVLink domain."""
        wanted = (self._constraints or {}).get(name)
        types = list(wanted.sharding_types or []) if wanted is not None else []
        if types and all(t in (PGAS_ROW_WISE, PGAS_TABLE_WISE) for t in types):
            raise ValueError(f"table {name}: its constraints allow only {types}, but {self._beyond_domain}, and "
                             "those need every rank in one: allow pgas_table_row_wise or a stock type too")

    def enumerate(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> List[ShardingOption]:
        # Only the modules the PGAS sharder shards can get PGAS types; reasons are per enumeration.
        self._pgas_modules = {sharder_name(s.module_type) for s in sharders
                              if isinstance(s, PgasEmbeddingBagCollectionSharder)}
        self._offer, self._why = {}, {}
        options = super().enumerate(module, sharders)
        num_tables = self.num_tables = len({o.name for o in options})
        out: List[ShardingOption] = []
        loads: Dict[str, TableLoad] = {}
        families = self._families()
        for o in options:
            offer = self._offer.get(o.name, [])
            if o.sharding_type in families and o.compute_kernel == EmbeddingComputeKernel.FUSED.value:
                # The model prices the HBM-resident fused TBE, which the PGAS kernels read too.
                load = loads[o.name] = _load(o)
                for st in (t for t in offer if t in (o.sharding_type, PGAS_TWIN[o.sharding_type])):
                    opt = o if st == o.sharding_type else _clone(o, st)
                    _price(opt, self.table_price(load, st, num_tables))
                    out.append(opt)
                continue
            if o.sharding_type in families and o.sharding_type not in offer:
                continue  # a non-fused option of a family the table may only get as PGAS
            if o.sharding_type != ShardingType.DATA_PARALLEL.value:
                _add_fixed_cost(o, *self._fixed_share(o, num_tables))
            out.append(o)
        self.decisions = [Decision(load, self._offer[name], self._why.get(name)) for name, load in loads.items()]
        return out

    def table_price(self, load: TableLoad, sharding_type: str, num_tables: int) -> TablePrice:
        """One table's price under one of the types this enumerator prices itself."""
        if sharding_type in (TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE):
            assert self.twrw is not None  # the family is offered only with it
            return self.twrw.table_price(load, sharding_type, num_tables)
        return self.model.table_price(load, BACKEND[sharding_type], num_tables)

    def name_pgas_table_row_wise(self, best_plan: List[ShardingOption]) -> List[ShardingOption]:
        """A planner callback (``EmbeddingShardingPlanner(callbacks=[enumerator.name_pgas_table_row_wise])``): the
        chosen ``PgasTableRowWiseOption``s under their own type before TorchRec writes the plan. A module's node
        steps need a table on every node, and TorchRec's partitioner places a module's table-row-wise tables host by
        host: where it left a node without one, the module's tables are dealt round-robin over the nodes (option i
        to node i mod N, each shard to the same local rank there) if every rank's HBM still fits (less the storage
        reservation, ``storage_reservation``: the planner's ``FixedPercentageStorageReservation`` percentage); the
        modules' deals are tried together, then one by one. A module that cannot cover every node keeps them
        ``table_row_wise``."""
        if self.twrw is None:
            return best_plan
        used = [0] * self._world_size
        for o in best_plan:
            for shard in o.shards:
                if shard.rank is not None and shard.storage is not None:
                    used[shard.rank] += shard.storage.hbm
        by_module: Dict[str, List[ShardingOption]] = {}
        for option in sorted(best_plan, key=lambda o: o.name):
            if isinstance(option, PgasTableRowWiseOption):
                by_module.setdefault(option.path, []).append(option)
        deals = {path: self._deal(options) for path, options in by_module.items()}
        together = [m for moves in deals.values() if moves for m in moves]
        if not self._move(together, used):
            for moves in deals.values():
                if moves and not self._move(moves, used):
                    moves.clear()
        for path, options in by_module.items():
            if deals[path] or self._covers(options):
                for option in options:
                    option.sharding_type = PGAS_TABLE_ROW_WISE
            else:
                logger.info("torchrec_pgas planner: %s keeps table_row_wise for %s: its tables cannot give each of "
                            "the %d nodes one", path, [o.name for o in options], self.twrw.nodes)
        return best_plan

    def _covers(self, options: List[ShardingOption]) -> bool:
        """Whether ``options`` (one module's) hold a table on every node."""
        assert self.twrw is not None
        size = self.twrw.local_size
        return {s.rank // size for o in options for s in o.shards if s.rank is not None} == set(range(self.twrw.nodes))

    def _deal(self, options: List[ShardingOption]) -> List[Tuple[Any, int]]:
        """(shard, new rank) that deal a module's options round-robin over the nodes; none where they cover every
        node already, or are too few to."""
        assert self.twrw is not None
        nodes, size = self.twrw.nodes, self.twrw.local_size
        if self._covers(options) or len(options) < nodes:
            return []
        return [(shard, (i % nodes) * size + shard.rank % size) for i, o in enumerate(options) for shard in o.shards
                if shard.rank is not None]

    def _move(self, moves: List[Tuple[Any, int]], used: List[int]) -> bool:
        """Apply ``moves`` (updating ``used``) if every rank's HBM still fits."""
        after = list(used)
        for shard, rank in moves:
            hbm = shard.storage.hbm if shard.storage is not None else 0
            after[shard.rank] -= hbm
            after[rank] += hbm
        if any(a > cap for a, cap in zip(after, self._hbm_per_rank)):
            return False
        for shard, rank in moves:
            shard.rank = rank
        used[:] = after
        return True

    def _fixed_share(self, o: ShardingOption, num_tables: int) -> Tuple[float, float]:
        """Per shard (forward, backward) fixed cost of an option TorchRec prices itself: non-fused RW, TW, CW and
        TWRW run TorchRec's input and output dists (and in training their backward), whose fixed costs (host
        syncs, collective latency) its bandwidth-only estimate leaves out. Shared as ``table_price`` shares
        the fused options': row-wise 1 / n on every rank; the others stock table-wise's, W / n for the table,
        split over its shards (n tables)."""
        row_wise = o.sharding_type == ROW_WISE
        backend = NCCL_RW if row_wise or NCCL_TW not in self.model.backends else NCCL_TW
        share = (1 if row_wise else self.model.world_size / max(1, len(o.shards))) / max(1, num_tables)
        fwd, bwd = self.model.fixed_ms(backend)
        return fwd * share, bwd * share


def _add_fixed_cost(o: ShardingOption, fwd_ms: float, bwd_ms: float) -> None:
    for shard in o.shards:
        if shard.perf is not None:
            shard.perf = dataclasses.replace(shard.perf, fwd_comms=shard.perf.fwd_comms + fwd_ms,
                                             bwd_comms=shard.perf.bwd_comms + bwd_ms)


def _load(o: ShardingOption) -> TableLoad:
    rows, dim = o.tensor.shape
    return TableLoad(o.name, rows, dim, list(o.input_lengths), o.tensor.element_size())


class PgasTableRowWiseOption(ShardingOption):
    """A ``pgas_table_row_wise`` option, typed ``table_row_wise`` until the plan is made: TorchRec's partitioner
    places a host-partitioned option only under its own types (``PgasEnumerator.name_pgas_table_row_wise``)."""

    def __hash__(self) -> int:
        return hash((super().__hash__(), PGAS_TABLE_ROW_WISE))


def _clone(o: ShardingOption, sharding_type: str) -> ShardingOption:
    """Same shards and storage, another type (no deep copy of the table tensor)."""
    c = copy.copy(o)
    c.shards = [dataclasses.replace(s) for s in o.shards]
    if sharding_type == PGAS_TABLE_ROW_WISE:
        c.__class__ = PgasTableRowWiseOption
    else:
        c.sharding_type = sharding_type
    return c


def _price(o: ShardingOption, price: TablePrice) -> None:
    """Every shard costs its rank the table's time on that rank (RW: each rank; TW: the owner's;
    inference: no backward)."""
    for s in o.shards:
        s.perf = Perf(**price._asdict())


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
        n, model, twrw = enumerator.num_tables, enumerator.model, enumerator.twrw
        if twrw is not None:
            self.lines = [twrw.header()] + [twrw.decision_row(d.load, n, chosen.get(d.load.name, "?"), d.reason)
                                            for d in enumerator.decisions]
        else:
            self.lines = [header(model.training)] + [decision_row(model, d.load, n, chosen.get(d.load.name, "?"),
                                                                  d.reason, [BACKEND[t] for t in d.offered])
                                                     for d in enumerator.decisions]
        logger.info("torchrec_pgas planner (%d plans, %.2fs):\n%s", num_plans, run_time, "\n".join(self.lines))
