"""Per-source-line totals from an ncu source export (gpu_check.sh profile writes ncu/ncu_source.csv).

    python scripts/ncu_lines.py ncu_source.csv[.gz] [--top 30] [--loops FUNCTION]

Prints each line's share of executed warp instructions and of stall samples (the
profiled launches summed), then the kernel's stall reasons, so an optimization
note can say which lines cost what. With --loops, also each loop of the kernels whose
name contains FUNCTION (the SASS between a branch target and a branch back to it):
an inlined helper's lines sum over its call sites, a loop's SASS tells them apart.
"""
import argparse
import collections
import csv
import gzip
import re
from typing import Dict, Iterator, List, NamedTuple, Tuple


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0  # "-" or empty: no counter on this line


def _rows(path: str) -> Iterator[List[str]]:
    with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as f:
        yield from csv.reader(f)


def line_totals(path: str) -> Tuple[Dict[Tuple[str, int], List], Dict[str, float]]:
    """{(file, line): [instructions, samples, source]}, {stall reason: samples}."""
    lines: Dict[Tuple[str, int], List] = collections.defaultdict(lambda: [0.0, 0.0, ""])
    stalls: Dict[str, float] = collections.Counter()
    file, header = "", []
    for row in _rows(path):
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


class Loop(NamedTuple):
    """SASS offsets [first, last] (from the kernel's first instruction) of a loop, what it holds and costs."""

    first: int
    last: int
    instructions: int  # SASS instructions in the range
    global_loads: int  # LDG among them
    spills: int  # LDL / STL among them
    samples: float  # stall samples of the range
    executed: float  # warp instructions executed in the range


def loop_totals(path: str, function: str) -> Tuple[List[Loop], float, float]:
    """The loops of the kernels whose name contains ``function`` (their SASS rows: an address and the
    instruction; every file section of the export holds some), and the kernels' total samples and executed
    instructions. A loop is a branch back to an earlier address; nested and overlapping ranges are all listed."""
    sass: Dict[int, Tuple[str, float, float]] = {}
    name, header = "", []
    for row in _rows(path):
        if not row:
            continue
        if row[0] == "Function Name":
            name = row[1]
        elif row[0] == "Line No":
            header = row
        elif header and function in name and len(row) > 3 and row[2].startswith("0x"):
            sass[int(row[2], 16)] = (row[3].strip(), _num(row[header.index("Warp Stall Sampling (All Samples)")]),
                                     _num(row[header.index("Instructions Executed")]))
    if not sass:
        return [], 0.0, 0.0
    addresses, base = sorted(sass), min(sass)
    loops = []
    for at in addresses:
        branch = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", sass[at][0])
        target = int(branch.group(1), 16) if branch else at + 1
        if target > at:
            continue
        body = [a for a in addresses if target <= a <= at]
        loops.append(Loop(body[0] - base, at - base, len(body), sum("LDG" in sass[a][0] for a in body),
                          sum(re.search(r"\b(LDL|STL)\b", sass[a][0]) is not None for a in body),
                          sum(sass[a][1] for a in body), sum(sass[a][2] for a in body)))
    return sorted(set(loops)), sum(v[1] for v in sass.values()), sum(v[2] for v in sass.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--loops", metavar="FUNCTION", help="also the loops of the kernels whose name contains this")
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
    if args.loops:
        _print_loops(*loop_totals(args.csv, args.loops))


def _print_loops(loops: List[Loop], samples: float, executed: float) -> None:
    """The loops that hold at least 1% of the kernels' samples or executed instructions."""
    print(f"loops ({samples:.0f} stall samples, {executed:.0f} warp instructions):")
    for loop in loops:
        s, i = loop.samples / (samples or 1.0), loop.executed / (executed or 1.0)
        if s >= 0.01 or i >= 0.01:
            print(f"  {loop.first:#07x}-{loop.last:#07x}: {loop.instructions:5d} SASS, {loop.global_loads:3d} LDG, "
                  f"{loop.spills:2d} LDL/STL, {100 * s:5.1f}% samples, {100 * i:5.1f}% inst "
                  f"({loop.executed / 1e6:.0f}M)")


if __name__ == "__main__":
    main()
