"""Fit a hardware profile from ``benchmarks.embedding`` runs, and show how well it predicts them.

    # on the device, one command from a repo checkout: measure both pairs (row_wise vs pgas_row_wise,
    # table_wise vs pgas_table_wise; s004 + s000 cover latency- and bandwidth-bound steps, about
    # 2 minutes each on 2 GPUs), fit the four backends, check out of sample
    python -m torchrec_pgas.planner.calibrate --measure 2 -o profile.json --validate s004
    # or in two steps: the measurements (any presets), then the fit anywhere
    torchrun --nproc_per_node=2 -m benchmarks.embedding --pair rw --preset s004 --preset s000-weak
    torchrun --nproc_per_node=2 -m benchmarks.embedding --pair tw --preset s004 --preset s000-weak
    python -m torchrec_pgas.planner.calibrate <rw results.json> <tw results.json> -o profile.json
    # out of sample: each s004 config predicted by a fit on all the others, and the planner's regret
    python -m torchrec_pgas.planner.calibrate <results.json>... -o profile.json --validate s004 --csv planner.csv
    # training terms: a training run's rows also measure the whole step (forward + backward + optimizer)
    torchrun --nproc_per_node=1 -m benchmarks.embedding --mode train --pair rw --preset s004
    python -m torchrec_pgas.planner.calibrate <train results.json> [<forward results.json>...] -o profile.json
    # a one-GPU training run on top of a multi-GPU forward profile (the wire's price comes from the latter)
    python -m torchrec_pgas.planner.calibrate <train results.json> --base planner/profiles/h200x2_nvlink.json -o p.json

A results file of one pair fits that pair's two backends. Uniform-id rows only (the model has no skew
term). NCCL has no graph mode (stock TorchRec cannot be captured), so its graph coefficients are its eager
ones; so are PGAS's when the run captured no graphs (CPU).

Rows of a training run fit each backend's backward (``<backend>_bwd``) on the step less the backend's
fitted eager forward, in relative error of the step: the planner decides on the step, priced as forward +
backward. The step less the forward measured in the same row would carry that forward's noise as well (the
stock s004 forwards of the 2x H100 training runs span 2.3-5.3 ms, host-bound; the step less them -0.7 to
2.9 ms), and in its own relative error a difference near zero would outweigh all other rows. Their forward
columns also serve the forward fit. The backward's k_wire is the forward's: at one world size its wire bytes
are W - 1 times its local ones for every backend (none at W = 1), so no fit could split the two. FBGEMM's
backward cannot be captured, so graph mode's backward is the eager one. The table printed compares the model with every row
it was fitted on (in sample): the forward per mode, and for training rows the backward (the step less the
row's forward; its error a share of the step) and the whole step.
"""

import argparse
import csv
import dataclasses
import gzip
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

from torchrec_pgas.planner.cost_model import (
    BWD,
    NCCL_RW,
    NCCL_TW,
    PGAS_RW,
    PGAS_TW,
    STOCK,
    TABLE_WISE,
    TERMS,
    Coefficients,
    CostModel,
    HardwareProfile,
    TableLoad,
    backward_bytes,
    fit_coefficients,
    load_profile,
    table_bytes,
)

# A benchmark pair's (stock, PGAS) backends, by the row's stock sharding type.
PAIR_BACKENDS = {"row_wise": (NCCL_RW, PGAS_RW), "table_wise": (NCCL_TW, PGAS_TW)}
# mode -> the result columns of the pair's (stock, PGAS) side
COLUMNS = {"eager": ("stock_p50_ms", "pgas_p50_ms"), "graph": (None, "pgas_graph_p50_ms")}
# A training run's whole step (forward + backward + fused optimizer) of the pair's (stock, PGAS) side, eager.
TRAIN_COLUMNS = ("stock_train_p50_ms", "pgas_train_p50_ms")
# What ``validate`` checks: the forward per timing mode, and the eager training step.
VALIDATED_MODES = ("eager", "graph", "train")
# A training run's --owner-backward (PgasTrainingConfig.owner_backward), as the profile's source names it.
OWNER_BACKWARD = {"fbgemm": "FBGEMM", "pgas": "PGAS"}


def owners_of(rows: List[Dict[str, Any]]) -> Set[str]:
    """The owner backwards of the training rows among ``rows`` (``merge`` tags them)."""
    return {r["owner_backward"] for r in rows if "owner_backward" in r and any(
        p == "bwd" for _, _, p in measurements(r))}


def measurements(row: Dict[str, Any]) -> Dict[Tuple[str, str, str], float]:
    """(backend, mode, pass) -> the ms that ``row`` measured; nothing for skewed ids (the model has no skew
    term). Passes: "fwd", the forward, per mode; of a training row also "train", the step, and "bwd", the
    step less the same side's eager forward (so the backward also carries the optimizer and what a training
    forward costs over a no-grad one; noise can make it zero or negative)."""
    if row["ids"] != "uniform":
        return {}
    backends = PAIR_BACKENDS[row.get("stock", "row_wise")]
    out = {(b, mode, "fwd"): row[col] for mode, cols in COLUMNS.items() for b, col in zip(backends, cols)
           if col and row.get(col) is not None}
    for b, col in zip(backends, TRAIN_COLUMNS):
        forward = out.get((b, "eager", "fwd"))
        if row.get(col) is not None and forward is not None:
            out[(b, "eager", "bwd")] = row[col] - forward
            out[(b, "eager", "train")] = row[col]
    return out


def workload_tables(row: Dict[str, Any]) -> List[TableLoad]:
    """The benchmark's tables: one feature each, fixed pooling or uniform in [1, pooling]."""
    mean = row["pooling"] if row["pooling_dist"] == "fixed" else (1 + row["pooling"]) / 2
    return [TableLoad(f"t{i}", row["rows"], row["dim"], [mean]) for i in range(row["tables"])]


def step_tables(row: Dict[str, Any], backend: str) -> List[TableLoad]:
    """The tables one rank pays for: all of them (RW), or the busiest owner's under the benchmark's
    round-robin placement (TW, rank 0: tables 0, W, 2W, ...)."""
    tables = workload_tables(row)
    return tables[:: row["world_size"]] if backend in TABLE_WISE else tables


def step_bytes(row: Dict[str, Any], backend: str, backward: bool = False) -> Dict[str, float]:
    """The bytes per term (``TERMS``) of the tables one rank pays for in ``row``'s forward or backward."""
    byts = [(backward_bytes if backward else table_bytes)(t, row["batch_per_gpu"], row["world_size"], backend)
            for t in step_tables(row, backend)]
    return {term: sum(getattr(b, term) for b in byts) for term in TERMS}


def samples(rows: List[Dict[str, Any]], backend: str, mode: str,
            forward: Optional[Coefficients] = None) -> List[Dict[str, float]]:
    """What ``fit_coefficients`` fits one (backend, mode) on, per row that measured it: the bytes and the ms
    of the forward; or, given the backend's fitted ``forward``, of the backward: the step less ``forward``'s
    price of the row's forward, its error relative to the step (the module docstring says why)."""
    out = []
    for r in rows:
        ms = measurements(r).get((backend, mode, "fwd" if forward is None else "train"))
        if ms is None:
            continue
        if forward is None:
            out.append({**step_bytes(r, backend), "ms": ms})
            continue
        fwd = step_bytes(r, backend)
        priced = forward.alpha_ms + sum(fwd[term] * getattr(forward, "k_" + term) for term in TERMS)
        out.append({**step_bytes(r, backend, backward=True), "ms": ms - priced, "scale": ms})
    return out


def fit(results: Dict[str, Any], name: str, base: Optional[HardwareProfile] = None) -> HardwareProfile:
    """One coefficient set per (backend, mode) the rows measured, both backends of each pair present; and
    per backend a training run measured, its backward's (``<backend>_bwd``, the same in both modes).

    ``base``: a profile the training rows only add backward terms to (its forward coefficients, device and
    world size stay): how a one-GPU training run, which cannot price the wire, builds on a multi-GPU
    forward fit; the backward's wire price is then the base's forward one."""
    if base is not None:
        return _with_backward(base, fit(results, name), name, results["meta"], results["rows"])
    rows, meta = results["rows"], results["meta"]
    coeffs: Dict[str, Dict[str, Any]] = {"eager": {}, "graph": {}}
    pairs = [PAIR_BACKENDS[s] for s in sorted({r.get("stock", "row_wise") for r in rows})]
    for backend in (b for pair in pairs for b in pair):
        for mode in COLUMNS:
            found = samples(rows, backend, mode)
            if found:
                coeffs[mode][backend] = fit_coefficients(found)
            elif mode == "eager":
                raise ValueError(f"no uniform-id rows to fit {backend} on")
        # Stock TorchRec has no graph mode, and a CPU run captures no graphs: eager stands in.
        coeffs["graph"].setdefault(backend, coeffs["eager"][backend])
        found = samples(rows, backend, "eager", coeffs["eager"][backend])
        if found:  # the wire's price is the forward's (see the module docstring)
            bwd = fit_coefficients(found, {"wire": coeffs["eager"][backend].k_wire})
            coeffs["eager"][backend + BWD] = coeffs["graph"][backend + BWD] = bwd
    owners = owners_of(rows)
    trained = [r for r in rows if any(p == "bwd" for _, _, p in measurements(r))]
    if len(owners) > 1:  # one backward per backend cannot price two implementations
        raise ValueError(f"training runs of different owner backwards: {sorted(owners)}")
    optimizers = ", ".join(sorted({str(r.get("optimizer")) for r in trained}))
    owner = "".join(f", {OWNER_BACKWARD.get(o, o)} owner backward" for o in owners)
    backward = f"; backward: {len(trained)} training rows, {optimizers}{owner}, k_wire the forward's" if trained else ""
    source = (f"python -m torchrec_pgas.planner.calibrate on benchmarks.embedding results "
              f"(presets {', '.join(meta['presets'])}; commit {meta['commit']}; {meta['date']}{backward})")
    return HardwareProfile(name, f"{meta['world_size']}x {meta['device']}", meta["world_size"], source, coeffs)


def _with_backward(base: HardwareProfile, fitted: HardwareProfile, name: str, meta: Dict[str, Any],
                   rows: List[Dict[str, Any]]) -> HardwareProfile:
    """``base`` with ``fitted``'s backward terms, their wire price taken from ``base``'s eager forward; graph
    mode's backward is the eager one, as ``fit`` makes it."""
    coeffs = {mode: dict(per_backend) for mode, per_backend in base.coefficients.items()}
    for mode, per_backend in fitted.coefficients.items():
        for key in per_backend:
            if key.endswith(BWD) and base.has(key[:-len(BWD)], mode):
                coeffs.setdefault(mode, {})[key] = dataclasses.replace(
                    fitted.get(key, "eager"), k_wire=base.get(key[:-len(BWD)], "eager").k_wire)
    if not any(k.endswith(BWD) for per_backend in fitted.coefficients.values() for k in per_backend):
        raise ValueError("--base: the results have no training rows to fit a backward on")
    owners = "".join(f"{OWNER_BACKWARD.get(o, o)} owner backward; " for o in sorted(owners_of(rows)))
    source = (f"{base.source}; backward (replacing any above) from benchmarks.embedding --mode train at "
              f"{meta['world_size']}x {meta['device']} ({owners}commit {meta['commit']}; {meta['date']}), k_wire this "
              f"profile's forward")
    return HardwareProfile(name, base.device, base.world_size, source, coeffs)


def predicted_ms(profile: HardwareProfile, row: Dict[str, Any], backend: str, mode: str, pass_: str) -> float:
    """The model's step of ``row``'s workload: the forward, the training step (forward + backward), or the
    backward (their difference)."""
    forward, train = (CostModel(profile, row["world_size"], row["batch_per_gpu"], mode, training).step_ms(
        workload_tables(row), backend) for training in (False, True))
    return {"fwd": forward, "bwd": train - forward, "train": train}[pass_]


def prediction_table(profile: HardwareProfile,
                     results: Dict[str, Any]) -> Tuple[str, Dict[str, Tuple[float, float]]]:
    """Predicted vs measured per row, mode and pass (``measurements``); the median and the largest absolute
    relative error per "backend/mode/pass", a backward's relative to the row's step."""
    lines = [f"{'workload':<44} {'mode':<5} {'pass':<5} {'backend':<7} {'measured':>9} {'predicted':>9} {'error':>7}"]
    errors: Dict[str, List[float]] = {}
    for r in results["rows"]:
        measured = measurements(r)
        for (backend, mode, pass_), ms in measured.items():
            pred = predicted_ms(profile, r, backend, mode, pass_)
            err = (pred - ms) / measured[(backend, mode, "train" if pass_ == "bwd" else pass_)]
            errors.setdefault(f"{backend}/{mode}/{pass_}", []).append(abs(err))
            lines.append(f"{r['preset'] + '/' + r['name']:<44} {mode:<5} {pass_:<5} {backend:<7} {ms:>9.3f} "
                         f"{pred:>9.3f} {100 * err:>+6.1f}%")
    return "\n".join(lines), {k: (statistics.median(v), max(v)) for k, v in errors.items()}


def validate(results: Dict[str, Any],
             preset: str) -> Tuple[List[Dict[str, Any]], Dict[str, Dict[str, float]]]:
    """Out-of-sample check of the model and of the choice it makes, on every uniform workload of ``preset``.

    Leave-one-out: each workload (its rows of every pair and run) is predicted by a profile fitted on all
    the other workloads, so no row predicts itself. Per mode ("eager" and "graph", the forward; "train", the
    eager training step, where training runs measured it), the choice is the backend (of the two or four
    measured) with the lowest predicted step; its regret is how much slower the chosen backend measured
    than the measured fastest one. In graph mode NCCL is priced (and measured) eager: stock TorchRec
    cannot be captured. A forward is the forward run's: a training run's forward columns (timed between
    training steps) stand in only where no forward run measured the workload. The summary is per kind,
    "inference" (eager, graph) and "training".
    """
    rows = [r for r in results["rows"] if r["ids"] == "uniform"]
    names = list(dict.fromkeys(r["name"] for r in rows if r["preset"] == preset))
    if not names:
        raise ValueError(f"no uniform-id rows of preset '{preset}' to validate on")
    out: List[Dict[str, Any]] = []
    for name in names:
        mine = [r for r in rows if r["preset"] == preset and r["name"] == name]
        profile = fit({**results, "rows": [r for r in rows if r not in mine]}, f"loo-{name}")
        mine.sort(key=lambda r: r.get("mode") != "train")  # forward runs last: their forwards win
        for mode in VALIDATED_MODES:
            measured: Dict[str, float] = {}
            for r in mine:
                for (b, m, p), ms in measurements(r).items():
                    forward = p == "fwd" and m in (mode, "eager") and (m == mode or b in STOCK)
                    if (p == "train") if mode == "train" else forward:
                        measured[b] = ms
            if not any(b not in STOCK for b in measured):
                continue  # no graph captured (a CPU run, or --no-graph), or no training run
            model = CostModel(profile, mine[0]["world_size"], mine[0]["batch_per_gpu"],
                              "eager" if mode == "train" else mode, training=mode == "train")
            predicted = {b: model.step_ms(workload_tables(mine[0]), b) for b in measured}
            chosen = min(predicted, key=lambda b: (predicted[b], b not in STOCK))
            regret = measured[chosen] / min(measured.values()) - 1
            for b in measured:
                if mode == "graph" and b in STOCK:
                    continue  # the eager row already has it
                out.append({"workload": name, "mode": mode, "backend": b, "measured_ms": measured[b],
                            "predicted_ms": predicted[b], "error": predicted[b] / measured[b] - 1,
                            "chosen": chosen, "regret": regret})
    summary: Dict[str, Dict[str, float]] = {}
    for kind, modes in (("inference", ("eager", "graph")), ("training", ("train",))):
        found = [v for v in out if v["mode"] in modes]
        if found:
            choices = {(v["workload"], v["mode"]): v["regret"] for v in found}
            summary[kind] = {"median_abs_error": statistics.median(abs(v["error"]) for v in found),
                             "within_5pct": sum(g <= 0.05 for g in choices.values()) / len(choices),
                             "max_regret": max(choices.values())}
    return out, summary


DEFAULT_PRESETS = ["s004", "s000-weak", "s000-strong"]


def read_results(path: str) -> Dict[str, Any]:
    """A ``benchmarks.embedding`` results file, ``results.json`` or gzipped ``results.json.gz`` (how large
    old runs are kept in the repository)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def merge(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Several results files (e.g. one per pair) of one machine as one: their rows, every preset and
    commit; a training run's rows also carry its owner backward (``fit`` names it). Runs of different world
    sizes or devices cannot share a profile."""
    machines = {(r["meta"]["world_size"], r["meta"]["device"]) for r in runs}
    if len(machines) > 1:
        raise ValueError(f"results of different machines (world size, device): {sorted(machines)}")
    meta = dict(runs[0]["meta"])
    meta["presets"] = list(dict.fromkeys(p for r in runs for p in r["meta"]["presets"]))
    meta["commit"] = "+".join(dict.fromkeys(r["meta"]["commit"] for r in runs))
    return {"meta": meta, "rows": [
        {**row, "owner_backward": r["meta"]["owner_backward"]}
        if r["meta"].get("mode") == "train" and "owner_backward" in r["meta"] else row
        for r in runs for row in r["rows"]]}


def measure(nproc: int, out_dir: str, bench_args: List[str]) -> List[str]:
    """Run ``benchmarks.embedding`` for both pairs on ``nproc`` local processes (one per GPU); returns
    the two results.json."""
    try:
        found = importlib.util.find_spec("benchmarks.embedding") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise SystemExit("--measure runs benchmarks/embedding.py: run it from a torchrec-pgas checkout")
    if "--out" in bench_args:
        raise SystemExit("--measure writes the benchmark results next to -o; leave --out out")
    args = bench_args or [a for p in DEFAULT_PRESETS for a in ("--preset", p)]
    if "--pair" in args:
        raise SystemExit("--measure runs both pairs (rw, tw); leave --pair out")
    paths = []
    for pair in ("rw", "tw"):
        out = os.path.join(out_dir, pair)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                        "-m", "benchmarks.embedding", "--pair", pair, "--out", out, *args], check=True)
        paths.append(os.path.join(out, "results.json"))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*",
                        help="results.json (or .json.gz) files of benchmarks.embedding (not with --measure)")
    parser.add_argument("--measure", type=int, metavar="NPROC",
                        help="first run the benchmark on NPROC local GPUs; its results go next to -o")
    parser.epilog = ("Arguments after -- go to benchmarks.embedding with --measure (default: the presets "
                     + ", ".join(DEFAULT_PRESETS) + ").")
    parser.add_argument("-o", "--out", required=True, help="profile JSON to write")
    parser.add_argument("--name", default="calibrated")
    parser.add_argument("--base", metavar="PROFILE",
                        help="add the results' backward terms to this profile (e.g. a 1-GPU training run to a "
                             "2-GPU forward fit): its forward coefficients and its wire price stay")
    parser.add_argument("--validate", metavar="PRESET", help="leave-one-out predictions and regret on PRESET")
    parser.add_argument("--csv", help="with --validate: write the per-row predictions and choices here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if bool(args.results) == (args.measure is not None):
        parser.error("give results.json files or --measure NPROC")
    if bench_args and args.measure is None:
        parser.error("benchmark arguments after -- need --measure")
    if args.measure is not None:
        args.results = measure(args.measure, os.path.splitext(args.out)[0] + "_results", bench_args)
    results = merge([read_results(path) for path in args.results])
    profile = fit(results, args.name, load_profile(args.base) if args.base else None)
    with open(args.out, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
    table, errors = prediction_table(profile, results)
    print(table)
    for k, (median, largest) in errors.items():
        print(f"in-sample |error| {k}: median {100 * median:.1f}%, max {100 * largest:.1f}%")
    print(f"profile: {args.out}")
    if args.validate:
        rows, summary = validate(results, args.validate)
        print(f"\nleave-one-out on {args.validate}: {'workload':<40} {'mode':<5} {'backend':<7} {'measured':>9} "
              f"{'predicted':>9} {'error':>7} {'chosen':<7} {'regret':>7}")
        for v in rows:
            print(f"{'':<{len(args.validate) + 20}}{v['workload']:<40} {v['mode']:<5} {v['backend']:<7} "
                  f"{v['measured_ms']:>9.3f} {v['predicted_ms']:>9.3f} {100 * v['error']:>+6.1f}% "
                  f"{v['chosen']:<7} {100 * v['regret']:>6.1f}%")
        for kind, s in summary.items():
            print(f"{kind}: median |error| {100 * s['median_abs_error']:.1f}% (target <= 20%); choice within 5% of "
                  f"the measured better backend on {100 * s['within_5pct']:.0f}% of (config, mode) (target >= 90%); "
                  f"max regret {100 * s['max_regret']:.1f}% (target <= 10%)")
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)


if __name__ == "__main__":
    main()
