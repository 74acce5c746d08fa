"""Fit a hardware profile from a ``benchmarks.embedding`` run, and show how well it predicts that run.

    # on the device, one command from a repo checkout: measure (s004 + s000 cover latency- and
    # bandwidth-bound steps, about 2 minutes on 2 GPUs), fit, check out of sample
    python -m torchrec_pgas.planner.calibrate --measure 2 -o profile.json --validate s004
    # or in two steps: the measurements (any presets), then the fit anywhere
    torchrun --nproc_per_node=2 -m benchmarks.embedding --preset s004 --preset s000-weak --preset s000-strong
    python -m torchrec_pgas.planner.calibrate benchmarks/results/<folder>/results.json -o profile.json
    # out of sample: each s004 config predicted by a fit on all the others, and the planner's regret
    python -m torchrec_pgas.planner.calibrate <results.json> -o profile.json --validate s004 --csv planner.csv

Uniform-id rows only (the model has no skew term). NCCL has no graph mode (stock TorchRec cannot be
captured), so its graph coefficients are its eager ones; so are PGAS's when the run captured no graphs (CPU).
"""

import argparse
import csv
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Tuple

from torchrec_pgas.planner.cost_model import (
    NCCL_RW,
    PGAS_RW,
    CostModel,
    HardwareProfile,
    TableLoad,
    fit_coefficients,
    table_bytes,
)

# (backend, mode) -> the result column it is fitted to
COLUMNS = {(NCCL_RW, "eager"): "stock_p50_ms", (PGAS_RW, "eager"): "pgas_p50_ms",
           (PGAS_RW, "graph"): "pgas_graph_p50_ms"}


def workload_tables(row: Dict[str, Any]) -> List[TableLoad]:
    """The benchmark's tables: one feature each, fixed pooling or uniform in [1, pooling]."""
    mean = row["pooling"] if row["pooling_dist"] == "fixed" else (1 + row["pooling"]) / 2
    return [TableLoad(f"t{i}", row["rows"], row["dim"], [mean]) for i in range(row["tables"])]


def samples(rows: List[Dict[str, Any]], backend: str, column: str) -> List[Dict[str, float]]:
    out = []
    for r in rows:
        if r["ids"] != "uniform" or r.get(column) is None:
            continue
        byts = [table_bytes(t, r["batch_per_gpu"], r["world_size"], backend) for t in workload_tables(r)]
        out.append({"hbm": sum(b.hbm for b in byts), "wire": sum(b.wire for b in byts),
                    "local": sum(b.local for b in byts), "ms": r[column]})
    return out


def fit(results: Dict[str, Any], name: str) -> HardwareProfile:
    rows, meta = results["rows"], results["meta"]
    coeffs: Dict[str, Dict[str, Any]] = {"eager": {}, "graph": {}}
    for (backend, mode), column in COLUMNS.items():
        found = samples(rows, backend, column)
        if found:
            coeffs[mode][backend] = fit_coefficients(found)
        elif mode == "eager":
            raise ValueError(f"no uniform-id rows with {column} to fit {backend} on")
    # Stock TorchRec has no graph mode, and a CPU run captures no graphs: eager stands in.
    for backend in (NCCL_RW, PGAS_RW):
        coeffs["graph"].setdefault(backend, coeffs["eager"][backend])
    source = (f"python -m torchrec_pgas.planner.calibrate on benchmarks.embedding results "
              f"(presets {', '.join(meta['presets'])}; commit {meta['commit']}; {meta['date']})")
    return HardwareProfile(name, f"{meta['world_size']}x {meta['device']}", meta["world_size"], source, coeffs)


def prediction_table(profile: HardwareProfile, results: Dict[str, Any]) -> Tuple[str, Dict[str, float]]:
    """Predicted vs measured per row and mode; the median absolute relative error per (backend, mode)."""
    lines = [f"{'workload':<44} {'mode':<5} {'backend':<7} {'measured':>9} {'predicted':>9} {'error':>7}"]
    errors: Dict[str, List[float]] = {}
    for r in results["rows"]:
        if r["ids"] != "uniform":
            continue
        for (backend, mode), column in COLUMNS.items():
            if r.get(column) is None:
                continue
            model = CostModel(profile, r["world_size"], r["batch_per_gpu"], mode)
            pred = model.step_ms(workload_tables(r), backend)
            err = (pred - r[column]) / r[column]
            errors.setdefault(f"{backend}/{mode}", []).append(abs(err))
            lines.append(f"{r['preset'] + '/' + r['name']:<44} {mode:<5} {backend:<7} {r[column]:>9.3f} "
                         f"{pred:>9.3f} {100 * err:>+6.1f}%")
    return "\n".join(lines), {k: statistics.median(v) for k, v in errors.items()}


def validate(results: Dict[str, Any], preset: str) -> Tuple[List[Dict[str, Any]], Dict[str, float]]:
    """Out-of-sample check of the model and of the choice it makes, on every uniform row of ``preset``.

    Leave-one-out: each row is predicted by a profile fitted on all the other rows, so no row predicts
    itself. Per mode, the choice is the backend with the lower predicted step; its regret is how much
    slower the chosen backend measured than the measured faster one. In graph mode NCCL is priced (and
    measured) eager: stock TorchRec cannot be captured.
    """
    rows = [r for r in results["rows"] if r["ids"] == "uniform"]
    if not any(r["preset"] == preset for r in rows):
        raise ValueError(f"no uniform-id rows of preset '{preset}' to validate on")
    out: List[Dict[str, Any]] = []
    for i, r in enumerate(rows):
        if r["preset"] != preset:
            continue
        profile = fit({**results, "rows": rows[:i] + rows[i + 1:]}, f"loo-{i}")
        for mode in ("eager", "graph"):
            if r[COLUMNS[(PGAS_RW, mode)]] is None:
                continue  # no graph captured (a CPU run, or --no-graph)
            measured = {NCCL_RW: r["stock_p50_ms"], PGAS_RW: r[COLUMNS[(PGAS_RW, mode)]]}
            model = CostModel(profile, r["world_size"], r["batch_per_gpu"], mode)
            predicted = {b: model.step_ms(workload_tables(r), b) for b in measured}
            chosen = min(predicted, key=lambda b: (predicted[b], b != NCCL_RW))
            regret = measured[chosen] / min(measured.values()) - 1
            for b in measured:
                if mode == "graph" and b == NCCL_RW:
                    continue  # the eager row already has it
                out.append({"workload": r["name"], "mode": mode, "backend": b, "measured_ms": measured[b],
                            "predicted_ms": predicted[b], "error": predicted[b] / measured[b] - 1,
                            "chosen": chosen, "regret": regret})
    choices = {(v["workload"], v["mode"]): v["regret"] for v in out}
    summary = {"median_abs_error": statistics.median(abs(v["error"]) for v in out),
               "within_5pct": sum(g <= 0.05 for g in choices.values()) / len(choices),
               "max_regret": max(choices.values())}
    return out, summary


DEFAULT_PRESETS = ["s004", "s000-weak", "s000-strong"]


def measure(nproc: int, out_dir: str, bench_args: List[str]) -> str:
    """Run ``benchmarks.embedding`` on ``nproc`` local processes (one per GPU); returns its results.json."""
    try:
        found = importlib.util.find_spec("benchmarks.embedding") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise SystemExit("--measure runs benchmarks/embedding.py: run it from a torchrec-pgas checkout")
    if "--out" in bench_args:
        raise SystemExit("--measure writes the benchmark results next to -o; leave --out out")
    args = bench_args or [a for p in DEFAULT_PRESETS for a in ("--preset", p)]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "-m", "benchmarks.embedding", "--out", out_dir, *args], check=True)
    return os.path.join(out_dir, "results.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", help="results.json of benchmarks.embedding (not with --measure)")
    parser.add_argument("--measure", type=int, metavar="NPROC",
                        help="first run the benchmark on NPROC local GPUs; its results go next to -o")
    parser.epilog = ("Arguments after -- go to benchmarks.embedding with --measure (default: the presets "
                     + ", ".join(DEFAULT_PRESETS) + ").")
    parser.add_argument("-o", "--out", required=True, help="profile JSON to write")
    parser.add_argument("--name", default="calibrated")
    parser.add_argument("--validate", metavar="PRESET", help="leave-one-out predictions and regret on PRESET")
    parser.add_argument("--csv", help="with --validate: write the per-row predictions and choices here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if (args.results is None) == (args.measure is None):
        parser.error("give a results.json or --measure NPROC")
    if bench_args and args.measure is None:
        parser.error("benchmark arguments after -- need --measure")
    if args.measure is not None:
        args.results = measure(args.measure, os.path.splitext(args.out)[0] + "_results", bench_args)
    with open(args.results) as f:
        results = json.load(f)
    profile = fit(results, args.name)
    with open(args.out, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
    table, mae = prediction_table(profile, results)
    print(table)
    for k, v in mae.items():
        print(f"median |error| {k}: {100 * v:.1f}%")
    print(f"profile: {args.out}")
    if args.validate:
        rows, summary = validate(results, args.validate)
        print(f"\nleave-one-out on {args.validate}: {'workload':<40} {'mode':<5} {'backend':<7} {'measured':>9} "
              f"{'predicted':>9} {'error':>7} {'chosen':<7} {'regret':>7}")
        for v in rows:
            print(f"{'':<{len(args.validate) + 20}}{v['workload']:<40} {v['mode']:<5} {v['backend']:<7} "
                  f"{v['measured_ms']:>9.3f} {v['predicted_ms']:>9.3f} {100 * v['error']:>+6.1f}% "
                  f"{v['chosen']:<7} {100 * v['regret']:>6.1f}%")
        print(f"median |error| {100 * summary['median_abs_error']:.1f}% (target <= 20%); choice within 5% of the "
              f"measured better backend on {100 * summary['within_5pct']:.0f}% of (config, mode) (target >= 90%); "
              f"max regret {100 * summary['max_regret']:.1f}% (target <= 10%)")
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)


if __name__ == "__main__":
    main()
