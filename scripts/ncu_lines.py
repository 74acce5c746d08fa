"""Per-source-line totals from an ncu source export (gpu_check.sh profile writes ncu/ncu_source.csv).

    python scripts/ncu_lines.py ncu_source.csv[.gz] [--top 30]

Prints each line's share of executed warp instructions and of stall samples (the
profiled launches summed), then the kernel's stall reasons, so an optimization
note can say which lines cost what.
"""
import argparse
import collections
import csv
import gzip
from typing import Dict, List, Tuple


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0  # "-" or empty: no counter on this line


def line_totals(path: str) -> Tuple[Dict[Tuple[str, int], List], Dict[str, float]]:
    """{(file, line): [instructions, samples, source]}, {stall reason: samples}."""
    lines: Dict[Tuple[str, int], List] = collections.defaultdict(lambda: [0.0, 0.0, ""])
    stalls: Dict[str, float] = collections.Counter()
    file, header = "", []
    with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                header = row
            elif header and row[0].isdigit():
                entry = lines[(file, int(row[0]))]
                entry[0] += _num(row[header.index("Instructions Executed")])
                entry[1] += _num(row[header.index("Warp Stall Sampling (All Samples)")])
                entry[2] = row[1].strip()
                for i, name in enumerate(header):
                    if name.startswith("stall_") and "Not Issued" not in name:
                        stalls[name[len("stall_"):]] += _num(row[i])
    return lines, stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    lines, stalls = line_totals(args.csv)
    inst = sum(v[0] for v in lines.values()) or 1.0
    samples = sum(v[1] for v in lines.values()) or 1.0
    print(f"{inst:.0f} warp instructions, {samples:.0f} stall samples")
    for (file, no), (i, s, src) in sorted(lines.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{file:>22}:{no:<5} {100 * i / inst:5.1f}% inst {100 * s / samples:5.1f}% samples  {src[:90]}")
    total = sum(stalls.values()) or 1.0
    print("stalls: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])
                                 if v / total >= 0.01))


if __name__ == "__main__":
    main()
