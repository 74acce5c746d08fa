"""Bytes one GPU sends to other nodes in one training step (forward + backward), per sharding type, for a job of
``nodes`` × ``local_size`` GPUs: what decides row-wise against table-row-wise beyond one node.

    python -m torchrec_pgas.planner.inter_node      # the s000 and DLRM shapes at 2 x 8 and 4 x 8

Balanced load, every table's bags on every rank, from the data movement of TorchRec 1.6.1's shardings
(``docs/plan-table-row-wise.md`` §1) and of ``pgas_table_row_wise``:

- ``row_wise`` over the whole job: the bucketized ids go to every rank ((N-1)/N of them off-node, lengths to
  each of the W ranks), the partial pools come back by reduce-scatter and the gradients go out by all-gather
  ((N-1)·L of the W-1 blocks of ``B × dim_sum`` off-node each way);
- ``table_row_wise``: each node's tables' ids go to the rank of the same local rank there, lengths L times (the
  bucketized staggered all-to-all), and one ``B × dim_sum_node`` block of pooled rows a node comes back (the rail
  all-to-all), the gradient the same way;
- ``pgas_table_row_wise``: as ``table_row_wise`` but each length once (no bucketizing across the node), and the
  input check's all-reduce (three int64 words).

Not counted: the splits exchanges (a few words), what moves inside a node.

``TableRowWiseCost`` prices a table under ``table_row_wise`` and ``pgas_table_row_wise`` with these bytes over the
link between nodes (``InterNodeLink``) plus the node's row-wise step (the single-node model at the node's size).
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

from torchrec_pgas.planner.cost_model import NCCL_RW, PGAS_RW, CostModel, HardwareProfile, TableLoad, TablePrice

ROW_WISE, TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE = "row_wise", "table_row_wise", "pgas_table_row_wise"
# The fixed cost of one all-to-all across hosts where a profile measured none: an assumption (NCCL's small-message
# latency over InfiniBand is tens of microseconds), not a measurement of this project.
ALLTOALL_ALPHA_MS = 0.05


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One GPU's step: ``batch`` bags of each of ``features`` pooled features of ``dim_sum`` columns in all, with
    ``pooling`` ids a bag on average."""

    name: str
    batch: int
    features: int
    dim_sum: int
    pooling: float
    elem_bytes: int = 4  # pooled rows and their gradients (fp32)
    id_bytes: int = 8  # KJT values (int64)
    length_bytes: int = 4  # KJT lengths (int32)


def inter_node_bytes(shape: StepShape, sharding: str, nodes: int, local_size: int) -> Dict[str, float]:
    """Bytes one GPU sends off its node in a step, per stage (``ids``, ``lengths``, ``pooled``, ``gradients``,
    ``check``), ``sharding`` one of ``row_wise``, ``table_row_wise``, ``pgas_table_row_wise``."""
    n, l, s = nodes, local_size, shape
    off = (n - 1) / n  # the share of the features (TWRW) or ids (RW) whose destination is another node
    ids = off * s.features * s.batch * s.pooling * s.id_bytes
    if sharding == ROW_WISE:
        rows = (n - 1) * l * s.batch * s.dim_sum * s.elem_bytes  # partial pools of W·B bags, (N-1)·L blocks off-node
        return {"ids": ids, "lengths": (n - 1) * l * s.features * s.batch * s.length_bytes,
                "pooled": rows, "gradients": rows, "check": 0.0}
    rail = off * s.batch * s.dim_sum * s.elem_bytes  # this GPU's rows of the other nodes' tables
    if sharding == TABLE_ROW_WISE:
        return {"ids": ids, "lengths": off * l * s.features * s.batch * s.length_bytes, "pooled": rail,
                "gradients": rail, "check": 0.0}
    if sharding == PGAS_TABLE_ROW_WISE:
        return {"ids": ids, "lengths": off * s.features * s.batch * s.length_bytes, "pooled": rail,
                "gradients": rail, "check": 3 * 8.0}
    raise ValueError(f"inter_node_bytes: unknown sharding type {sharding!r}")


@dataclasses.dataclass(frozen=True)
class InterNodeLink:
    """The link between nodes as one GPU sees it: its share of the inter-host bandwidth (bytes per ms) and the
    fixed cost of one all-to-all across nodes (ms)."""

    bytes_per_ms: float
    alpha_ms: float = ALLTOALL_ALPHA_MS

    @staticmethod
    def of(profile: HardwareProfile, inter_host_bw: float) -> "InterNodeLink":
        """The profile's measured link (its ``inter_host``), else ``inter_host_bw`` (TorchRec's
        ``Topology.inter_host_bw``, bytes per ms) with the assumed all-to-all latency."""
        if profile.inter_host is not None:
            return InterNodeLink(**profile.inter_host)
        return InterNodeLink(inter_host_bw)


class TableRowWiseCost:
    """Per-table prices of ``table_row_wise`` and ``pgas_table_row_wise`` for ``nodes`` nodes of ``local_size``
    GPUs at ``batch_per_rank`` bags a GPU. A table lives on one node, whose ranks run a row-wise step over their
    rails' N·B bags: the single-node model at the node's size (stock row-wise coefficients for TWRW's
    bucketized all-to-all and reduce-scatter inside the node, PGAS row-wise's for the node step). Each GPU's bags
    of the table cross nodes (N-1)/N of the time (``inter_node_bytes`` of the table alone) over ``link``, and the
    rail all-to-alls (ids and pooled rows; the gradient in training; PGAS: the input check's all-reduce too) add
    their fixed cost, shared over ``num_tables`` as the single-node model shares its own."""

    def __init__(self, profile: HardwareProfile, nodes: int, local_size: int, batch_per_rank: int,
                 link: InterNodeLink, mode: str = "eager", training: bool = False) -> None:
        self.nodes, self.local_size, self.batch_per_rank = nodes, local_size, batch_per_rank
        self.link = link
        self.training = training
        self.node = CostModel(profile, local_size, nodes * batch_per_rank, mode, training)

    def table_price(self, t: TableLoad, sharding: str, num_tables: int) -> TablePrice:
        node = self.node.table_price(t, {TABLE_ROW_WISE: NCCL_RW, PGAS_TABLE_ROW_WISE: PGAS_RW}[sharding], num_tables)
        moved = self._moved(t, sharding)
        share = self.link.alpha_ms / max(1, num_tables)
        exchanges = 3 if sharding == PGAS_TABLE_ROW_WISE else 2  # ids, pooled rows (+ the check's all-reduce)
        fwd = (moved["ids"] + moved["lengths"] + moved["pooled"] + moved["check"]) / self.link.bytes_per_ms
        bwd = moved["gradients"] / self.link.bytes_per_ms + share if self.training else 0.0
        return TablePrice(node.fwd_compute, node.fwd_comms + fwd + exchanges * share, node.bwd_compute,
                          node.bwd_comms + bwd)

    def _moved(self, t: TableLoad, sharding: str) -> Dict[str, float]:
        """The bytes one GPU sends off its node for table ``t``'s features (``inter_node_bytes``)."""
        shape = StepShape(t.name, self.batch_per_rank, len(t.pooling), t.dim * len(t.pooling),
                          sum(t.pooling) / max(1, len(t.pooling)))
        return inter_node_bytes(shape, sharding, self.nodes, self.local_size)

    def table_ms(self, t: TableLoad, sharding: str, num_tables: int) -> float:
        return sum(self.table_price(t, sharding, num_tables))

    def header(self) -> str:
        unit = "ms f+b" if self.training else "ms"
        return (f"{'table':<16} {'rows':>10} {'dim':>4} {'pool':>6} {'inter-node MB/GPU':>18} "
                f"{'table_row_wise ' + unit:>22} {'pgas_table_row_wise ' + unit:>26}  {'reason':<22} choice")

    def decision_row(self, t: TableLoad, num_tables: int, pick: str, reason: Optional[str] = None) -> str:
        """One table beyond one node: the bytes one GPU sends off its node for it (both types move the same
        rows; PGAS each length once), each type's price, and the choice."""
        moved = sum(self._moved(t, TABLE_ROW_WISE).values())
        ms = [self.table_ms(t, s, num_tables) for s in (TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE)]
        return (f"{t.name:<16} {t.rows:>10} {t.dim:>4} {sum(t.pooling):>6.1f} {moved / 1e6:>18.3f} "
                f"{ms[0]:>22.3f} {ms[1]:>26.3f}  {reason or 'cost model':<22} {pick}")

    def choose(self, tables: List[TableLoad], offered: Optional[List[str]] = None) -> Dict[str, str]:
        """Per table, the cheaper of ``offered`` (default both; ties go to stock's)."""
        options = offered or [TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE]
        return {t.name: min(options, key=lambda s: (self.table_ms(t, s, len(tables)), s != TABLE_ROW_WISE))
                for t in tables}


# The benchmarks' shapes per GPU (benchmarks.embedding's s000 presets at 4096 bags a GPU; the DLRM example's
# 26 one-hot features of dim 64 at 4096 a GPU).
SHAPES = (
    StepShape("s000-strong: 96 tables x 64, L 1-32", 4096, 96, 96 * 64, 16.5),
    StepShape("s000-weak at 16 GPUs: 1024 tables x 64, L 1-128", 4096, 1024, 1024 * 64, 64.5),
    StepShape("DLRM example: 26 one-hot features x 64", 4096, 26, 26 * 64, 1.0),
)
JOBS: Tuple[Tuple[int, int], ...] = ((2, 8), (4, 8))


def table() -> List[str]:
    """The shapes' inter-node MiB per GPU per step at each job size, as markdown rows."""
    lines = ["| shape | job | row_wise | table_row_wise | pgas_table_row_wise |", "|---|---|---:|---:|---:|"]
    for shape in SHAPES:
        for nodes, local in JOBS:
            mib = [sum(inter_node_bytes(shape, t, nodes, local).values()) / 2**20
                   for t in (ROW_WISE, TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE)]
            lines.append(f"| {shape.name} | {nodes} x {local} | " + " | ".join(f"{m:,.1f}" for m in mib) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
