"""Side by side: the PGAS step and stage times of two builds, from gpu_check's ``compare`` step.

    python scripts/compare_runs.py pack RUN_DIR BUILD.json    # one file of a build's results
    python scripts/compare_runs.py diff NEW.json OLD.json [--tolerance 0.03]
    python scripts/compare_runs.py rounds DIR                 # every round of DIR's tree*.json, old*.json

A run folder holds ``bench-*/`` (``benchmarks.embedding``, one folder per pair and world size) and ``virtual/``
(``benchmarks.virtual_ranks``) results; ``pack`` keeps them in one file (a GPU run brings back few files).
``diff`` prints, per workload, the p50 of the PGAS step and of each stage in both builds and NEW / OLD,
and marks what lies outside the tolerance; training rows add the eager training step, the replayed one and
the host time per step (stock's eager training step beside them: unchanged code, so it shows the machine's
drift). ``rounds`` is the A/B's verdict: per world size and measure, the geometric mean over the workloads of
each tree round against the old round of its number, next to the run-to-run spread of each build against itself,
and each inner round against its two neighbours of the other build ("bracketed": a machine that drifts the same
way through the run, as GPUs warming up do, favours whichever build ran later in a pair, but not a bracket).
Stage names of older builds are mapped to today's (``finalize`` is now ``combine``).
"""

import argparse
import glob
import json
import math
import os
from typing import Any, Dict, Iterator, List, Tuple

RENAMED = {"finalize": "combine"}
# training measures of a row: (name printed, the row's key)
TRAIN_MEASURES = (("train", "pgas_train_p50_ms"), ("train-graph", "pgas_train_graph_p50_ms"),
                  ("train-host", "pgas_train_host_p50_ms"), ("stock-train", "stock_train_p50_ms"),
                  ("stock-host", "stock_train_host_p50_ms"))
Key = Tuple[str, str, str, str]  # (run: "W=2" or "virtual W=2", pair, workload, measure)


def pack(run_dir: str, out: str) -> None:
    packed = {os.path.basename(os.path.dirname(path)): json.load(open(path))
              for path in sorted(glob.glob(os.path.join(run_dir, "*", "results.json")))}
    with open(out, "w") as f:
        json.dump(packed, f)


def _bench_times(run: str, rows: List[Dict[str, Any]]) -> Dict[Key, float]:
    out: Dict[Key, float] = {}
    pair = run.split("-")[1]  # bench-rw, bench-rw-w2
    for r in rows:
        key = (f"W={r['world_size']}", pair, f"{r['preset']}/{r['name']}")
        out[key + ("step",)] = r["pgas_p50_ms"]
        for stage, ms in r["pgas_stages_ms"].items():
            out[key + (RENAMED.get(stage, stage),)] = ms
        for name, field in TRAIN_MEASURES:
            if r.get(field) is not None:
                out[key + (name,)] = r[field]
    return out


def _times(packed: Dict[str, Any]) -> Dict[Key, float]:
    """(run, pair, workload, what) -> ms: the PGAS p50 step and stages (virtual ranks: the slowest rank's),
    and a training row's measures."""
    out: Dict[Key, float] = {}
    for run, results in packed.items():
        if run.startswith("bench"):
            out.update(_bench_times(run, results.get("rows", [])))
    for r in packed.get("virtual", {}).get("rows", []):
        key = (f"virtual W={r['world']}", r["pair"], f"{r['preset']}/{r['name']}")
        out[key + ("step",)] = max(r["rank_step_ms"])
        for stage, per_rank in r["p50_ms"].items():
            out[key + (RENAMED.get(stage, stage),)] = max(per_rank)
    return out


def diff(new: Dict[str, Any], old: Dict[str, Any], tolerance: float) -> Iterator[str]:
    a, b = _times(new), _times(old)
    outside: List[str] = []
    yield f"{'run':<12} {'pair':<4} {'workload':<44} {'what':<12} {'new ms':>9} {'old ms':>9} {'new/old':>8}"
    for key in sorted(set(a) & set(b)):
        ratio = a[key] / b[key] if b[key] > 0 else float("nan")
        small = max(a[key], b[key]) < 0.05  # below 50 us: event resolution and launch gaps, not the kernels
        flag = "" if small or abs(ratio - 1) <= tolerance else "  <-- outside"
        if flag:
            outside.append(" ".join(key))
        yield f"{key[0]:<12} {key[1]:<4} {key[2]:<44} {key[3]:<12} {a[key]:>9.3f} {b[key]:>9.3f} {ratio:>8.3f}{flag}"
    if set(a) ^ set(b):
        yield f"in one build only: {len(set(a) ^ set(b))} times"
    if not set(a) & set(b):
        yield "nothing to compare: a build has no results"
    elif outside:
        yield f"outside {tolerance:.0%}: {len(outside)} of {len(set(a) & set(b))} times"
    else:
        yield f"within {tolerance:.0%}: all {len(set(a) & set(b))} times"


def geomean_ratio(a: Dict[Key, float], b: Dict[Key, float], run: str, measure: str) -> Tuple[float, int]:
    """The geometric mean of a / b over the workloads both have for (run, measure), and their number."""
    logs = [math.log(a[k] / b[k]) for k in set(a) & set(b) if k[0] == run and k[3] == measure and b[k] > 0 < a[k]]
    return (math.exp(sum(logs) / len(logs)) if logs else float("nan")), len(logs)


def bracketed(tree: List[Dict[Key, float]], old: List[Dict[Key, float]], run: str, measure: str) -> List[float]:
    """tree / old for each inner round of the sequence tree, old, tree2, old2, ...: the round against the geometric
    mean of the rounds of the other build just before and just after it."""
    sequence = [r for pair in zip(tree, old) for r in pair]
    out = []
    for i in range(1, len(sequence) - 1):
        before, after = (geomean_ratio(sequence[i], sequence[j], run, measure)[0] for j in (i - 1, i + 1))
        ratio = math.sqrt(before * after)  # this round / its neighbours
        out.append(ratio if i % 2 == 0 else 1 / ratio)  # even positions are tree rounds
    return out


def rounds(folder: str) -> Iterator[str]:
    """Per (world, measure): tree_k / old_k for each round k, the spread of each build across its rounds
    (tree_k / tree_1, old_k / old_1), and tree / old of each inner round of the sequence tree, old, tree2, old2, ...
    against the geometric mean of its two neighbours: the A/B is within noise when the ratios stay inside the
    spread."""
    def load(build: str) -> List[Dict[Key, float]]:  # BUILD.json, BUILD2.json, ... in round order
        paths = sorted(glob.glob(os.path.join(folder, f"{build}*.json")), key=lambda p: (len(p), p))
        return [_times(json.load(open(p))) for p in paths]

    tree, old = load("tree"), load("old")
    if not tree or not old:
        yield "nothing to compare: a build has no rounds"
        return
    runs = sorted({k[0] for k in tree[0] if not k[0].startswith("virtual")})
    measures = [m for m, _ in TRAIN_MEASURES] + ["step"]
    yield (f"{len(tree)} tree and {len(old)} old rounds; geometric means over the workloads "
           "(tree_k/old_k; spread: tree_k/tree, old_k/old)")
    for run in runs:
        for m in measures:
            ab = [geomean_ratio(t, o, run, m) for t, o in zip(tree, old)]
            if not ab or ab[0][1] == 0:
                continue
            spread = [geomean_ratio(t, tree[0], run, m)[0] for t in tree[1:]] + \
                     [geomean_ratio(o, old[0], run, m)[0] for o in old[1:]]
            yield (f"{run:<4} {m:<12} n={ab[0][1]:<3} tree/old " + " ".join(f"{r:.3f}" for r, _ in ab)
                   + "   spread " + (" ".join(f"{s:.3f}" for s in spread) or "-")
                   + "   bracketed " + (" ".join(f"{b:.3f}" for b in bracketed(tree, old, run, m)) or "-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("run_dir")
    p.add_argument("out")
    d = sub.add_parser("diff")
    d.add_argument("new")
    d.add_argument("old")
    d.add_argument("--tolerance", type=float, default=0.03)
    r = sub.add_parser("rounds")
    r.add_argument("folder")
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.run_dir, args.out)
    elif args.command == "diff":
        for line in diff(json.load(open(args.new)), json.load(open(args.old)), args.tolerance):
            print(line)
    else:
        for line in rounds(args.folder):
            print(line)


if __name__ == "__main__":
    main()
