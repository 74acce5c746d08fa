"""The stage kernels of W ranks on one GPU (``torchrec_pgas.virtual_ranks``), timed rank by rank.

    python -m benchmarks.virtual_ranks --preset s000-weak --world 2 --pair rw --steps 20

What a W-GPU step's kernels cost without the wire, on a machine with one GPU: each rank's index dist takes
its owner-dependent path (bucketize by owner for row-wise at W >= 2), its lookup serves W sources from its
row blocks, its combine sums W partials. Stores into "peers" land in this GPU's HBM, and ranks run one after
another, so a stage's time here is its work alone; the W-GPU step adds NVLink and its drain. The workloads
are ``benchmarks.embedding``'s presets at world size W (the same tables, batch per rank and ids);
table-wise puts consecutive tables on each rank. Prints the p50 per stage and rank and writes
``results.json`` under ``--out``.
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from benchmarks.embedding import PRESETS, Workload, git_commit, make_inputs, p50, p90
from torchrec_pgas.virtual_ranks import STAGES, RankInput, VirtualRanks


def rank_inputs(w: Workload, world: int, n_sets: int, device: torch.device) -> List[List[RankInput]]:
    """``n_sets`` steps of every rank's ids, rank r drawing from seed r (as ``benchmarks.embedding``)."""
    per_rank = [make_inputs(w, w.tables, w.batch_per_gpu, n_sets, seed=r, device=device) for r in range(world)]
    return [[(k.values(), k.offsets(), None, k.stride()) for k in (kjts[i] for kjts in per_rank)]
            for i in range(n_sets)]


def run(w: Workload, world: int, pair: str, steps: int, sets: int, device: torch.device) -> Dict[str, Any]:
    tables = [torch.randn(w.rows, w.dim, device=device).mul_(0.01) for _ in range(w.tables)]
    owners = None if pair == "rw" else [t * world // w.tables for t in range(w.tables)]
    inputs = rank_inputs(w, world, sets, device)
    nnz = max(int(x[0].numel()) for step in inputs for x in step)
    vr = VirtualRanks(tables, world, max_batch=w.batch_per_gpu, ids_capacity=nnz, owners=owners)
    times = vr.stage_times(inputs, steps)
    mid = {st: [p50(t) for t in per_rank] for st, per_rank in times.items()}
    high = {st: [p90(t) for t in per_rank] for st, per_rank in times.items()}
    return dict(name=w.name, preset=w.preset, pair=pair, world=world, tables=w.tables, rows=w.rows, dim=w.dim,
                batch_per_rank=w.batch_per_gpu, nnz_per_rank=nnz, steps=steps, p50_ms=mid, p90_ms=high,
                rank_step_ms=[sum(mid[st][r] for st in STAGES) for r in range(world)],
                steps_ms={st: [[round(x, 4) for x in t] for t in per_rank] for st, per_rank in times.items()})


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default quick")
    parser.add_argument("--world", type=int, action="append", help="virtual world sizes (repeatable; default 2)")
    parser.add_argument("--pair", choices=("rw", "tw"), action="append", help="repeatable; default rw")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sets", type=int, default=4, help="input sets the steps cycle over")
    parser.add_argument("--out", default=None, help="results.json goes here")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for world in args.world or [2]:
        for preset in args.preset or ["quick"]:
            for w in PRESETS[preset](world):
                for pair in args.pair or ["rw"]:
                    row = run(w, world, pair, args.steps, args.sets, device)
                    rows.append(row)
                    stages = "  ".join(f"{st} {max(row['p50_ms'][st]):.3f} ({max(row['p90_ms'][st]):.3f})"
                                       for st in STAGES)
                    print(f"W={world} {pair} {preset}/{w.name}: {stages}  (p50 (p90), max over ranks, ms); "
                          f"rank steps {' '.join(f'{t:.3f}' for t in row['rank_step_ms'])}", flush=True)
                    torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(device), commit=git_commit(), torch=torch.__version__,
                    argv=argv if argv is not None else sys.argv)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
