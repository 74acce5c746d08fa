"""First timing table: stock TorchRec row_wise (NCCL) vs pgas_row_wise forward through DMP.

    torchrun --nproc_per_node=2 -m benchmarks.rw_timing --out results.json

8 tables x 1M rows x dim 64 (fp32), batch/GPU in {128, 1024, 4096, 16384},
pooling exactly L in {8, 32}, uniform ids. Both models hold the same weights;
outputs are compared before timing. Each side: warm-up, then >= 100 steps,
each timed with CUDA events and synchronized (per-step latency), rotating
among 4 input sets. pgas_row_wise is also timed as a CUDA-graph replay of the
whole sharded forward (stock row_wise cannot be captured: its input dist
synchronizes with the host).
"""

import argparse
import json
import os
import statistics
import subprocess
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import PgasConfig, PgasEmbeddingBagCollectionSharder, check_errors
from torchrec_pgas.planner import pgas_row_wise
from torchrec_pgas.testing import fill_embeddings_

TABLES, ROWS, DIM = 8, 1_000_000, 64
BATCHES = [128, 1024, 4096, 16384]
POOLINGS = [8, 32]


def _model() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM,
                                   feature_names=[f"f{i}"]) for i in range(TABLES)],
        device=torch.device("meta"),
    )


def _shard(pgas: bool, device: torch.device) -> DistributedModelParallel:
    world = dist.get_world_size()
    ebc = _model()
    if pgas:
        sharder = PgasEmbeddingBagCollectionSharder(
            pgas_config=PgasConfig(max_local_batch_size=max(BATCHES), avg_pooling_capacity=max(POOLINGS)))
        gen = pgas_row_wise
    else:
        sharder = EmbeddingBagCollectionSharder()
        gen = lambda: row_wise(compute_kernel="fused")  # noqa: E731
    plan = construct_module_sharding_plan(ebc, {f"t{i}": gen() for i in range(TABLES)}, sharder=sharder,
                                          local_size=world, world_size=world, device_type="cuda")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                   plan=ShardingPlan({"": plan}), sharders=[sharder])
    fill_embeddings_(dmp)  # same weights on both sides
    return dmp


def _inputs(batch: int, pooling: int, device: torch.device, n: int, seed: int) -> List[KeyedJaggedTensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.full((TABLES * batch,), pooling, dtype=torch.int64, device=device)
        values = torch.randint(0, ROWS, (TABLES * batch * pooling,), generator=gen, device=device)
        out.append(KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths, stride=batch,
            length_per_key=[batch * pooling] * TABLES,
            offset_per_key=[batch * pooling * i for i in range(TABLES + 1)]))
    return out


def _time(fn: Callable[[KeyedJaggedTensor], torch.Tensor], inputs: List[KeyedJaggedTensor],
          steps: int, warmup: int = 10) -> List[float]:
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _graphed(dmp: DistributedModelParallel, inputs: List[KeyedJaggedTensor]) -> Callable[[KeyedJaggedTensor], torch.Tensor]:
    """Capture the sharded forward once with static inputs; each call copies ids in and replays."""
    static = inputs[0]
    static_values = static.values().clone()
    kjt = KeyedJaggedTensor(static.keys(), static_values, None, static.lengths(), stride=static.stride(),
                            length_per_key=static.length_per_key(), offset_per_key=static.offset_per_key())
    dmp(kjt).values()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dmp(kjt).values()

    def run(x: KeyedJaggedTensor, _static: KeyedJaggedTensor = kjt) -> torch.Tensor:
        # `_static` keeps `kjt` alive: the graph reads its lazily computed offsets.
        static_values.copy_(x.values())
        graph.replay()
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="rw_timing.json")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", rank)
    stock, pgas = _shard(False, device), _shard(True, device)
    rows: List[Dict[str, object]] = []
    with torch.no_grad():
        for pooling in POOLINGS:
            for batch in BATCHES:
                inputs = _inputs(batch, pooling, device, 4, seed=1000 * rank + batch + pooling)
                for x in inputs:  # verify before timing
                    ref, got = stock(x).values(), pgas(x).values()
                    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
                check_errors(pgas)
                t_stock = _time(lambda x: stock(x).values(), inputs, args.steps)
                t_pgas = _time(lambda x: pgas(x).values(), inputs, args.steps)
                graph_fn = _graphed(pgas, inputs)
                graph_out = graph_fn(inputs[1])
                torch.testing.assert_close(graph_out, stock(inputs[1]).values(), atol=1e-4, rtol=1e-4)
                t_graph = _time(graph_fn, inputs, args.steps)
                check_errors(pgas)
                row = {
                    "tables": TABLES, "rows": ROWS, "dim": DIM, "batch_per_gpu": batch, "pooling": pooling,
                    "stock_p50_ms": statistics.median(t_stock),
                    "stock_p90_ms": sorted(t_stock)[int(0.9 * len(t_stock))],
                    "pgas_p50_ms": statistics.median(t_pgas),
                    "pgas_p90_ms": sorted(t_pgas)[int(0.9 * len(t_pgas))],
                    "pgas_graph_p50_ms": statistics.median(t_graph),
                    "steps": args.steps,
                }
                row["speedup_eager"] = row["stock_p50_ms"] / row["pgas_p50_ms"]
                row["speedup_graph"] = row["stock_p50_ms"] / row["pgas_graph_p50_ms"]
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commit = os.environ.get("GIT_COMMIT") or (git.stdout.strip() if git.returncode == 0 else "unknown")
        meta = {"device": torch.cuda.get_device_name(device), "world_size": dist.get_world_size(),
                "torch": torch.__version__, "commit": commit}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"{'pool':>4} {'batch':>6} {'stock p50':>10} {'pgas p50':>9} {'graph p50':>9} {'x eager':>8} {'x graph':>8}")
        for r in rows:
            print(f"{r['pooling']:>4} {r['batch_per_gpu']:>6} {r['stock_p50_ms']:>10.3f} {r['pgas_p50_ms']:>9.3f} "
                  f"{r['pgas_graph_p50_ms']:>9.3f} {r['speedup_eager']:>8.2f} {r['speedup_graph']:>8.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
