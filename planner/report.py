"""The per-table decision table, one format for the ``explain`` CLI and the planner's stats."""

from typing import Optional, Sequence

from torchrec_pgas.planner.cost_model import (
    BACKENDS,
    NCCL_RW,
    NCCL_TW,
    PGAS_RW,
    PGAS_TW,
    STOCK,
    CostModel,
    TableLoad,
    table_bytes,
)

# The sharding type each backend is (the PGAS names are torchrec_pgas.types').
SHARDING_TYPE = {NCCL_RW: "row_wise", PGAS_RW: "pgas_row_wise", NCCL_TW: "table_wise", PGAS_TW: "pgas_table_wise"}

# Training prices a backend as "fwd+bwd" ms, one token per backend, in wider cells.
WIDTH = {False: 10, True: 14}


def header(training: bool = False) -> str:
    unit = " ms f+b" if training else " ms"
    return (f"{'table':<16} {'rows':>10} {'dim':>4} {'pool':>6} {'HBM MB':>8} {'wire MB nccl/pgas':>18} "
            + " ".join(f"{b + unit:>{WIDTH[training]}}" for b in BACKENDS) + f"  {'reason':<22} choice")


def decision_row(model: CostModel, t: TableLoad, num_tables: int, pick: str, reason: Optional[str] = None,
                 offered: Optional[Sequence[str]] = None) -> str:
    """One line of the decision table: the table, its row-wise forward bytes per stage (HBM: the lookup's
    gather; wire: the ids and partial pools crossing to other ranks), its contribution to the step under
    each backend ``offered`` (default: every backend the profile prices; "-" for the others; training:
    "fwd+bwd"), why, and the choice (``pick``, last). ``reason`` overrides the cost-model reason when the
    choice was not the model's alone (constraints, backends)."""
    offered = [b for b in (offered if offered is not None else model.backends) if model.profile.has(b, model.mode)]
    nb, pb = (table_bytes(t, model.batch_per_rank, model.world_size, b) for b in (NCCL_RW, PGAS_RW))
    parts = {b: model.contribution_parts(t, b, num_tables) for b in offered}
    price = {b: sum(p) for b, p in parts.items()}
    if reason is None:
        # What wins the cheapest backend its place: its lower fixed-cost share against the runner-up's
        # (at least half the gap), or its bytes.
        best, second = (sorted(offered, key=lambda b: (price[b], b not in STOCK)) + [None])[:2]
        if second is None:
            reason = "only option"
        else:
            alpha = {b: model.alpha_ms(b) / num_tables for b in (best, second)}
            fixed = alpha[second] - alpha[best]
            reason = "fixed cost (latency)" if fixed >= (price[second] - price[best]) / 2 else "bytes (bandwidth)"
    width = WIDTH[model.training]
    cell = {b: f"{p[0]:.3f}+{p[1]:.3f}" if model.training else f"{price[b]:.3f}" for b, p in parts.items()}
    cells = " ".join(f"{cell.get(b, '-'):>{width}}" for b in BACKENDS)
    return (f"{t.name:<16} {t.rows:>10} {t.dim:>4} {sum(t.pooling):>6.1f} {nb.hbm / 1e6:>8.2f} "
            f"{nb.wire / 1e6:>8.2f}/{pb.wire / 1e6:<9.2f} {cells}  {reason:<22} {pick}")
