"""Side by side: the PGAS step and stage times of two builds, from gpu_check's ``compare`` step.

    python scripts/compare_runs.py pack RUN_DIR BUILD.json    # one file of a build's results
    python scripts/compare_runs.py diff NEW.json OLD.json [--tolerance 0.03]

A run folder holds ``bench-rw/``, ``bench-tw/`` (``benchmarks.embedding``) and ``virtual/``
(``benchmarks.virtual_ranks``) results; ``pack`` keeps them in one file (a GPU run brings back few files).
``diff`` prints, per workload, the p50 of the PGAS step and of each stage in both builds and NEW / OLD,
and marks what lies outside the tolerance. Stage names of older builds are mapped to today's
(``finalize`` is now ``combine``).
"""

import argparse
import json
import os
from typing import Any, Dict, Iterator, List, Tuple

RENAMED = {"finalize": "combine"}
RUNS = ("bench-rw", "bench-tw", "virtual")


def pack(run_dir: str, out: str) -> None:
    packed = {run: json.load(open(os.path.join(run_dir, run, "results.json")))
              for run in RUNS if os.path.exists(os.path.join(run_dir, run, "results.json"))}
    with open(out, "w") as f:
        json.dump(packed, f)


def _times(packed: Dict[str, Any]) -> Dict[Tuple[str, ...], float]:
    """(run, pair, preset, what) -> ms: the PGAS p50 step and stages (virtual ranks: the slowest rank's)."""
    out: Dict[Tuple[str, ...], float] = {}
    for run in ("bench-rw", "bench-tw"):
        for r in packed.get(run, {}).get("rows", []):
            key = (f"W={r['world_size']}", run[-2:], r["preset"])
            out[key + ("step",)] = r["pgas_p50_ms"]
            for stage, ms in r["pgas_stages_ms"].items():
                out[key + (RENAMED.get(stage, stage),)] = ms
    for r in packed.get("virtual", {}).get("rows", []):
        key = (f"virtual W={r['world']}", r["pair"], r["preset"])
        out[key + ("step",)] = max(r["rank_step_ms"])
        for stage, per_rank in r["p50_ms"].items():
            out[key + (RENAMED.get(stage, stage),)] = max(per_rank)
    return out


def diff(new: Dict[str, Any], old: Dict[str, Any], tolerance: float) -> Iterator[str]:
    a, b = _times(new), _times(old)
    outside: List[str] = []
    yield f"{'run':<14} {'pair':<4} {'preset':<12} {'what':<12} {'new ms':>9} {'old ms':>9} {'new/old':>8}"
    for key in sorted(set(a) & set(b)):
        ratio = a[key] / b[key] if b[key] > 0 else float("nan")
        small = max(a[key], b[key]) < 0.05  # below 50 us: event resolution and launch gaps, not the kernels
        flag = "" if small or abs(ratio - 1) <= tolerance else "  <-- outside"
        if flag:
            outside.append(" ".join(key))
        yield f"{key[0]:<14} {key[1]:<4} {key[2]:<12} {key[3]:<12} {a[key]:>9.3f} {b[key]:>9.3f} {ratio:>8.3f}{flag}"
    if set(a) ^ set(b):
        yield f"in one build only: {sorted(set(a) ^ set(b))}"
    if not set(a) & set(b):
        yield "nothing to compare: a build has no results"
    elif outside:
        yield f"outside {tolerance:.0%}: {outside}"
    else:
        yield f"within {tolerance:.0%}: all {len(set(a) & set(b))} times"


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
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.run_dir, args.out)
    else:
        for line in diff(json.load(open(args.new)), json.load(open(args.old)), args.tolerance):
            print(line)


if __name__ == "__main__":
    main()
