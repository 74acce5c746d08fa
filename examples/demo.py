"""The main job: a 2-process sharded model trained and run with the PGAS sharder, against stock TorchRec.

Runs on the best backend available: ``nvshmem`` on two GPUs (NCCL process group), otherwise ``shm`` on CPU
(gloo). ``--backend nvshmem`` on a machine with one GPU runs both ranks on it over gloo
(``torchrec_pgas.placement``): a test of the multi-rank path, not a performance setup.

1. Training: the same model (two EBCs, one weighted; SUM and MEAN tables) planned ``pgas_row_wise``, then
   ``pgas_table_wise``, and trained with row-wise Adagrad next to its stock twin on the same batches and
   upstream gradients; after every step, every weight shard and optimizer state of both ranks is compared.
2. Inference: one row per table, the largest |pgas - stock| of its pooled outputs, and the forward time per
   step of both.
"""

import argparse
import logging
import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_pgas.placement import rank_placement
from torchrec_pgas.testing import (
    ATOL,
    TrainBatch,
    all_tables,
    compare_with_stock,
    default_model,
    random_kjt,
    rank_device,
    run_distributed,
    seeded,
    spread_tables,
    train_against_stock,
)
from torchrec_pgas.types import PGAS_ROW_WISE, PgasConfig

# TorchRec 1.6, torch 2.11 and FBGEMM 1.6 warn about their own internals on every sharding or step (a deprecated
# torch helper TorchRec calls, FX tracing's naming, a kernel variant): nothing a user of this demo can act on.
# Other warnings still print.
warnings.filterwarnings("ignore", message=r".*_get_pg_default_device.*")
warnings.filterwarnings("ignore", message=r"Multiple backends are registered with this ProcessGroup.*")
warnings.filterwarnings("ignore", message=r"TBE B200 optimization.*")  # FBGEMM's GPU backward, every step
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

# The owner update sums each row's gradient terms in its own order: fp32 rounding against stock (README).
TRAIN_TOLERANCE = 1e-5
PLANS = ("pgas_row_wise", "pgas_table_wise")


def _train(rank: int, world: int, device: torch.device, steps: int, batch: int) -> Dict[str, List[float]]:
    """Each plan's per-step difference from stock (``train_against_stock``: the largest
    |pgas - stock| / max(1, |stock|) over this rank's weight shards and optimizer states)."""
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-3}
    out = {}
    for plan in PLANS:
        model = default_model(min_rows=world)  # FBGEMM's CPU TBE trains no shard of zero rows
        types = all_tables(model, PGAS_ROW_WISE) if plan == "pgas_row_wise" else spread_tables(model, world)
        gen = seeded(77 + rank)
        t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
        batches = [TrainBatch(random_kjt(t, batch, gen), random_kjt(w, batch, gen, weighted=True))
                   for _ in range(steps)]
        out[plan] = train_against_stock(model, types, batches, dist.group.WORLD, device, fused,
                                        PgasConfig(max_local_batch_size=batch))
    return out


def _forward(rank: int, device: torch.device, steps: int, batch: int) -> Dict[str, object]:
    model = default_model()
    gen = seeded(rank)
    batches = [
        (random_kjt(model.ebc.embedding_bag_configs(), batch, gen),
         random_kjt(model.webc.embedding_bag_configs(), batch, gen, weighted=True))
        for _ in range(steps)
    ]
    cmp = compare_with_stock(model, all_tables(model, PGAS_ROW_WISE), batches, dist.group.WORLD, device,
                             PgasConfig(max_local_batch_size=batch))
    rows = []
    for prefix, ebc in (("", model.ebc), ("w:", model.webc)):
        for c in ebc.embedding_bag_configs():
            diff = max(cmp.max_abs_diff[prefix + f] for f in c.feature_names)
            weighted = "weighted" if prefix else ""
            rows.append((c.name, c.num_embeddings, c.embedding_dim, f"{c.pooling.value} {weighted}".strip(), diff))
    return {"rows": rows, "pgas_ms": cmp.pgas_ms, "stock_ms": cmp.stock_ms}


def _run(rank: int, world: int, device_type: str, train_steps: int, steps: int, batch: int) -> Dict[str, object]:
    device = rank_device(rank, device_type)
    return {"train": _train(rank, world, device, train_steps, batch), **_forward(rank, device, steps, batch)}


def _print_training(results: List[Dict[str, object]], steps: int) -> bool:
    header = f"{'step':>4}  " + "  ".join(f"{p:>15}" for p in PLANS) + "  ok"
    print(header)
    print("-" * len(header))
    ok = True
    for i in range(steps):
        worst = [max(r["train"][p][i] for r in results) for p in PLANS]  # type: ignore[index]
        good = max(worst) <= TRAIN_TOLERANCE
        ok &= good
        print(f"{i + 1:>4}  " + "  ".join(f"{d:>15.2e}" for d in worst) + f"  {'yes' if good else 'NO'}")
    return ok


def _print_forward(results: List[Dict[str, object]], backend: str, stock_backend: str) -> bool:
    header = f"{'table':<6} {'rows':>5} {'dim':>4} {'pooling':<13} {'max|diff| r0':>12} {'r1':>10}  ok"
    print(header)
    print("-" * len(header))
    ok = True
    pairs: List[Tuple[tuple, tuple]] = list(zip(results[0]["rows"], results[1]["rows"]))  # type: ignore[arg-type]
    for r0, r1 in pairs:
        name, rows, dim, pooling, d0 = r0
        good = max(d0, r1[4]) <= ATOL
        ok &= good
        print(f"{name:<6} {rows:>5} {dim:>4} {pooling:<13} {d0:>12.2e} {r1[4]:>10.2e}  {'yes' if good else 'NO'}")
    for r, res in enumerate(results):
        print(f"rank {r}: forward {res['pgas_ms']:.2f} ms/step (pgas, {backend}) vs "
              f"{res['stock_ms']:.2f} ms/step (stock, {stock_backend})")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="forward steps")
    parser.add_argument("--batch", type=int, default=64, help="local batch size per rank")
    parser.add_argument("--backend", choices=["auto", "shm", "nvshmem"], default="auto")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    use_gpu = args.backend == "nvshmem" or (args.backend == "auto" and gpus >= 2)
    backend, device_type = ("nvshmem", "cuda") if use_gpu else ("shm", "cpu")
    placement = rank_placement(2, device_type)
    results = run_distributed(_run, 2, device_type, args.train_steps, args.steps, args.batch,
                              device_type=device_type)
    shared = ", both ranks on one GPU (correctness only)" if placement.shared_gpu else ""
    print(f"Training against stock row_wise / table_wise: 2 ranks, backend={backend}{shared}, batch {args.batch}/rank, "
          f"row-wise Adagrad.\nAfter each step, the largest |pgas - stock| / max(1, |stock|) over every weight and "
          f"optimizer state of both ranks, tolerance {TRAIN_TOLERANCE:g}:")
    trained = _print_training(results, args.train_steps)
    print(f"\nForward, pgas_row_wise vs stock row_wise: {args.steps} steps, tolerance {ATOL:g}")
    forward = _print_forward(results, backend, placement.backend)
    ok = trained and forward
    print("PASS: training and outputs match stock TorchRec" if ok else "FAIL: pgas differs from stock")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
