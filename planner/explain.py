"""Print the per-table choice among row-wise and table-wise, NCCL and PGAS, for a model config, without GPUs.

    python -m torchrec_pgas.planner.explain model.yaml

The config is YAML or JSON::

    world_size: 2
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

from torchrec_pgas.planner.cost_model import CostModel, TableLoad, load_profile
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
