"""Print the per-table choice among row-wise and table-wise, NCCL and PGAS, for a model config, without GPUs
(beyond one node: table_row_wise against pgas_table_row_wise).

    python -m torchrec_pgas.planner.explain model.yaml

The config is YAML or JSON::

    world_size: 2          # GPUs of the job
    nodes: 1               # > 1: the job is nodes x (world_size / nodes); tables choose between table_row_wise
                           # and pgas_table_row_wise, priced with inter_host_gbps (per GPU; default TorchRec's)
    batch_per_rank: 4096
    mode: eager            # or graph (PGAS captured in a CUDA graph)
    training: false        # true: price forward + backward (cells "fwd+bwd" ms)
    profile: null          # a calibrated profile JSON; default: the shipped NVLink profile of device
    device: null           # a CUDA device name, e.g. NVIDIA H100 80GB HBM3; default: H200
    tables:
      - {name: user_id, rows: 10000000, dim: 64, pooling: 1}
      - {name: history, rows: 1000000, dim: 64, pooling: [32, 8]}   # one mean per feature
"""

import argparse
import json
from typing import Any, Dict, List

from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH

from torchrec_pgas.planner.cost_model import CostModel, TableLoad, load_profile
from torchrec_pgas.planner.inter_node import (
    PGAS_TABLE_ROW_WISE,
    ROW_WISE,
    TABLE_ROW_WISE,
    InterNodeLink,
    StepShape,
    TableRowWiseCost,
    inter_node_bytes,
)
from torchrec_pgas.planner.report import SHARDING_TYPE, decision_row, header


def tables_from_config(cfg: Dict[str, Any]) -> List[TableLoad]:
    out = []
    for t in cfg["tables"]:
        pooling = t.get("pooling", 1.0)
        out.append(TableLoad(t["name"], int(t["rows"]), int(t["dim"]),
                             [float(p) for p in (pooling if isinstance(pooling, list) else [pooling])],
                             int(t.get("weight_bytes", 4))))
    return out


def explain(cfg: Dict[str, Any]) -> str:
    if int(cfg.get("nodes", 1)) > 1:
        return explain_nodes(cfg)
    profile = load_profile(cfg.get("profile"), cfg.get("device"), int(cfg["world_size"]))
    model = CostModel(profile, int(cfg["world_size"]), int(cfg["batch_per_rank"]), cfg.get("mode", "eager"),
                      bool(cfg.get("training", False)))
    tables = tables_from_config(cfg)
    choice = model.choose(tables)
    lines = [f"profile {model.profile.name} ({model.profile.device}), world {model.world_size}, "
             f"batch/rank {model.batch_per_rank}, mode {model.mode}" + _training_note(model), header(model.training)]
    lines += [decision_row(model, t, len(tables), SHARDING_TYPE[choice[t.name]]) for t in tables]
    mixed = model.plan_ms(tables, choice)
    lines.append("step: " + ", ".join(f"all {SHARDING_TYPE[b]} {model.step_ms(tables, b):.3f} ms"
                                      for b in model.backends) + f", chosen {mixed:.3f} ms")
    return "\n".join(lines)


def explain_nodes(cfg: Dict[str, Any]) -> str:
    """A job of several nodes: per table, table_row_wise against pgas_table_row_wise (``TableRowWiseCost``), and
    what one GPU sends off its node in a step under each table-row-wise type and under row_wise over the job."""
    nodes, world = int(cfg["nodes"]), int(cfg["world_size"])
    if world % nodes:
        raise ValueError(f"explain: world_size {world} is not a multiple of nodes {nodes}")
    local, batch = world // nodes, int(cfg["batch_per_rank"])
    profile = load_profile(cfg.get("profile"), cfg.get("device"), local)
    gbps = float(cfg.get("inter_host_gbps", CROSS_NODE_BANDWIDTH * 1000 * 8 / 1e9))
    link = InterNodeLink.of(profile, gbps * 1e9 / 8 / 1000)
    cost = TableRowWiseCost(profile, nodes, local, batch, link, cfg.get("mode", "eager"), bool(cfg.get("training")))
    tables = tables_from_config(cfg)
    choice = cost.choose(tables)
    lines = [f"profile {profile.name} ({profile.device}) per node, {nodes} nodes x {local} GPUs, batch/rank {batch}, "
             f"inter-node link {link.bytes_per_ms * 8 * 1000 / 1e9:.0f} Gb/s a GPU, {link.alpha_ms} ms an all-to-all",
             cost.header()] + [cost.decision_row(t, len(tables), choice[t.name]) for t in tables]
    shape = StepShape("model", batch, sum(len(t.pooling) for t in tables), sum(t.dim * len(t.pooling) for t in tables),
                      sum(sum(t.pooling) for t in tables) / max(1, sum(len(t.pooling) for t in tables)))
    moved = {s: sum(inter_node_bytes(shape, s, nodes, local).values()) / 2**20
             for s in (ROW_WISE, TABLE_ROW_WISE, PGAS_TABLE_ROW_WISE)}
    lines.append("inter-node MiB a GPU a step: " + ", ".join(f"{s} {m:,.2f}" for s, m in moved.items()))
    return "\n".join(lines)


def _training_note(model: CostModel) -> str:
    """Which coefficients price the backward (fitted or the forward's stand-ins), per backend."""
    if not model.training:
        return ""
    fitted = [b for b in model.backends if model.profile.has_backward(b, model.mode)]
    stand_in = "the forward's per-byte coefficients, no fixed cost"
    if not fitted:
        return f", training: fwd+bwd (bwd: {stand_in} (no training fit))"
    rest = "" if len(fitted) == len(model.backends) else f", else {stand_in}"
    return f", training: fwd+bwd (bwd: fitted for {', '.join(fitted)}{rest})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML or JSON model config")
    args = parser.parse_args()
    import yaml  # only the CLI reads YAML; the planner imports this module for its table format

    with open(args.config) as f:
        cfg = json.load(f) if args.config.endswith(".json") else yaml.safe_load(f)
    print(explain(cfg))


if __name__ == "__main__":
    main()
