"""The main job: a 2-process sharded EBC with the PGAS sharder, validated against stock TorchRec.

Runs on the best backend available: ``nvshmem`` on two GPUs (NCCL process
group), otherwise ``shm`` on CPU (gloo). ``--backend nvshmem`` on a machine with
one GPU runs both ranks on it over gloo (``torchrec_pgas.placement``): a test of
the multi-rank path, not a performance setup. Prints one row per table: the
largest |pgas - stock| over its features and the forward time per step of both.
"""

import argparse
from typing import Dict

import torch
import torch.distributed as dist

from torchrec_pgas.testing import (
    ATOL,
    compare_with_stock,
    default_model,
    random_kjt,
    rank_device,
    run_distributed,
    seeded,
)
from torchrec_pgas.placement import rank_placement
from torchrec_pgas.types import PGAS_ROW_WISE, PgasConfig


def _run(rank: int, world: int, device_type: str, steps: int, batch: int) -> Dict[str, object]:
    device = rank_device(rank, device_type)
    model = default_model()
    gen = seeded(rank)
    batches = [
        (
            random_kjt(model.ebc.embedding_bag_configs(), batch, gen),
            random_kjt(model.webc.embedding_bag_configs(), batch, gen, weighted=True),
        )
        for _ in range(steps)
    ]
    names = [c.name for ebc in (model.ebc, model.webc) for c in ebc.embedding_bag_configs()]
    cmp = compare_with_stock(
        model,
        {n: PGAS_ROW_WISE for n in names},
        batches,
        dist.group.WORLD,
        device,
        PgasConfig(max_local_batch_size=batch),
    )
    rows = []
    for prefix, ebc in (("", model.ebc), ("w:", model.webc)):
        for c in ebc.embedding_bag_configs():
            diff = max(cmp.max_abs_diff[prefix + f] for f in c.feature_names)
            weighted = "weighted" if prefix else ""
            rows.append((c.name, c.num_embeddings, c.embedding_dim, f"{c.pooling.value} {weighted}".strip(), diff))
    return {"rows": rows, "pgas_ms": cmp.pgas_ms, "stock_ms": cmp.stock_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="local batch size per rank")
    parser.add_argument("--backend", choices=["auto", "shm", "nvshmem"], default="auto")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    use_gpu = args.backend == "nvshmem" or (args.backend == "auto" and gpus >= 2)
    backend, device_type = ("nvshmem", "cuda") if use_gpu else ("shm", "cpu")
    placement = rank_placement(2, device_type)
    results = run_distributed(_run, 2, device_type, args.steps, args.batch, device_type=device_type)
    shared = ", both ranks on one GPU (correctness only)" if placement.shared_gpu else ""
    print(f"pgas_row_wise vs stock row_wise: 2 ranks, backend={backend}{shared}, "
          f"batch {args.batch}/rank, {args.steps} steps, tolerance {ATOL:g}")
    header = f"{'table':<6} {'rows':>5} {'dim':>4} {'pooling':<13} {'max|diff| r0':>12} {'r1':>10}  ok"
    print(header)
    print("-" * len(header))
    ok = True
    for r0, r1 in zip(results[0]["rows"], results[1]["rows"]):
        name, rows, dim, pooling, d0 = r0
        good = max(d0, r1[4]) <= ATOL
        ok &= good
        print(f"{name:<6} {rows:>5} {dim:>4} {pooling:<13} {d0:>12.2e} {r1[4]:>10.2e}  {'yes' if good else 'NO'}")
    for r, res in enumerate(results):
        print(f"rank {r}: forward {res['pgas_ms']:.2f} ms/step (pgas, {backend}) vs "
              f"{res['stock_ms']:.2f} ms/step (stock, {placement.backend})")
    print("PASS: outputs match stock TorchRec" if ok else "FAIL: outputs differ")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
