"""The per-table decision table, one format for the ``explain`` CLI and the planner's stats."""

from typing import Optional

from torchrec_pgas.planner.cost_model import NCCL_RW, PGAS_RW, CostModel, TableLoad, table_bytes

HEADER = (f"{'table':<16} {'rows':>10} {'dim':>4} {'pool':>6} {'HBM MB':>8} {'wire MB nccl/pgas':>18} "
          f"{'nccl ms':>8} {'pgas ms':>8}  {'reason':<22} choice")


def decision_row(model: CostModel, t: TableLoad, num_tables: int, pick: str, reason: Optional[str] = None) -> str:
    """One line of the decision table: the table, its bytes per stage (HBM: the lookup's gather; wire: the
    ids and partial pools crossing to other ranks), both prices, why, and the choice (``pick``, last).
    ``reason`` overrides the cost-model reason when the choice was not the model's (constraints, backends)."""
    nb, pb = (table_bytes(t, model.batch_per_rank, model.world_size, b) for b in (NCCL_RW, PGAS_RW))
    nccl, pgas = model.table_ms(t, NCCL_RW, num_tables), model.table_ms(t, PGAS_RW, num_tables)
    if reason is None:
        fixed = (model.profile.get(NCCL_RW, model.mode).alpha_ms
                 - model.profile.get(PGAS_RW, model.mode).alpha_ms) / num_tables
        reason = "fixed cost (latency)" if abs(fixed) >= abs(nccl - pgas) / 2 else "bytes (bandwidth)"
    return (f"{t.name:<16} {t.rows:>10} {t.dim:>4} {sum(t.pooling):>6.1f} {nb.hbm / 1e6:>8.2f} "
            f"{nb.wire / 1e6:>8.2f}/{pb.wire / 1e6:<9.2f} {nccl:>8.3f} {pgas:>8.3f}  {reason:<22} {pick}")
