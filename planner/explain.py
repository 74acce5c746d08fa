"""Print the per-table NCCL-vs-PGAS decision for a model config, without GPUs.

    python -m torchrec_pgas.planner.explain model.yaml

The config is YAML or JSON::

    world_size: 2
    batch_per_rank: 4096
    mode: eager            # or graph (PGAS captured in a CUDA graph)
    profile: null          # a calibrated profile JSON; default: the shipped H200 NVLink profile
    tables:
      - {name: user_id, rows: 10000000, dim: 64, pooling: 1}
      - {name: history, rows: 1000000, dim: 64, pooling: [32, 8]}   # one mean per feature
"""

import argparse
import json
from typing import Any, Dict, List

import yaml

from torchrec_pgas.planner.cost_model import NCCL_RW, PGAS_RW, CostModel, TableLoad, load_profile, table_bytes


def tables_from_config(cfg: Dict[str, Any]) -> List[TableLoad]:
    out = []
    for t in cfg["tables"]:
        pooling = t.get("pooling", 1.0)
        out.append(TableLoad(t["name"], int(t["rows"]), int(t["dim"]),
                             [float(p) for p in (pooling if isinstance(pooling, list) else [pooling])],
                             int(t.get("weight_bytes", 4))))
    return out


def explain(cfg: Dict[str, Any]) -> str:
    model = CostModel(load_profile(cfg.get("profile")), int(cfg["world_size"]), int(cfg["batch_per_rank"]),
                      cfg.get("mode", "eager"))
    tables = tables_from_config(cfg)
    choice = model.choose(tables)
    n = len(tables)
    lines = [f"profile {model.profile.name} ({model.profile.device}), world {model.world_size}, "
             f"batch/rank {model.batch_per_rank}, mode {model.mode}",
             f"{'table':<16} {'rows':>10} {'dim':>4} {'pool':>6} {'HBM MB':>8} {'wire MB nccl/pgas':>18} "
             f"{'nccl ms':>8} {'pgas ms':>8}  choice          reason"]
    for t in tables:
        nb, pb = (table_bytes(t, model.batch_per_rank, model.world_size, b) for b in (NCCL_RW, PGAS_RW))
        nccl, pgas = model.table_ms(t, NCCL_RW, n), model.table_ms(t, PGAS_RW, n)
        fixed = (model.profile.get(NCCL_RW, model.mode).alpha_ms - model.profile.get(PGAS_RW, model.mode).alpha_ms) / n
        reason = "fixed cost (latency)" if abs(fixed) >= abs(nccl - pgas) / 2 else "bytes (bandwidth)"
        pick = "pgas_row_wise" if choice[t.name] == PGAS_RW else "row_wise"
        lines.append(f"{t.name:<16} {t.rows:>10} {t.dim:>4} {sum(t.pooling):>6.1f} {nb.hbm / 1e6:>8.2f} "
                     f"{nb.wire / 1e6:>8.2f}/{pb.wire / 1e6:<9.2f} {nccl:>8.3f} {pgas:>8.3f}  {pick:<15} {reason}")
    chosen = [t for t in tables if choice[t.name] == PGAS_RW]
    others = [t for t in tables if choice[t.name] == NCCL_RW]
    mixed = model.step_ms(chosen, PGAS_RW) + model.step_ms(others, NCCL_RW)
    lines.append(f"step: all NCCL {model.step_ms(tables, NCCL_RW):.3f} ms, "
                 f"all PGAS {model.step_ms(tables, PGAS_RW):.3f} ms, chosen {mixed:.3f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML or JSON model config")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = json.load(f) if args.config.endswith(".json") else yaml.safe_load(f)
    print(explain(cfg))


if __name__ == "__main__":
    main()
