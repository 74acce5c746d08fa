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
"""

import dataclasses
from typing import Dict, List, Tuple

ROW_WISE, TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE = "row_wise", "table_row_wise", "pgas_table_row_wise"


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
