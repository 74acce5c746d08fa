"""Embedding-layer benchmark: stock TorchRec (NCCL) vs torchrec-pgas, side by side.

    torchrun --nproc_per_node=2 -m benchmarks.embedding --preset quick
    torchrun --nproc_per_node=2 -m benchmarks.embedding --preset s004 --preset s000-weak --preset s000-strong

For each workload: one EBC (meta device, fp32), sharded twice with DMP (stock
``row_wise`` and ``pgas_row_wise``, or with ``--pair tw`` stock ``table_wise``
and ``pgas_table_wise``, tables round-robin over the ranks; ``--pair twrw --node-size L``
stock ``table_row_wise`` and ``pgas_table_row_wise``, table i on node i % N) from the same
weights; both get the same
per-rank inputs and must agree before anything is timed. Then:

* eager: >= 100 steps after a warm-up, rotating among >= 4 input sets, each step
  started together on all ranks (barrier + sync) and timed with CUDA events; a
  step's time is the slowest rank's; P50/P90 as TorchRec's benchmarks report;
* graph: the PGAS forward captured as one CUDA graph per input set and replayed
  (the ids are copied into the captured buffers each step, as a deployment
  would). Stock TorchRec cannot be captured: its input dist reads the splits
  all-to-all's result on the host (a sync), so only its eager time exists;
* stages: a separate pass with events at the ShardedModule stage boundaries
  (input dist awaitables, compute, output dist) and inside the PGAS step
  (between the pooled lookup and the combine), see ``torchrec_pgas.profiling``;
* roofline: floor = max over ranks of max(HBM bytes gathered / HBM bandwidth,
  bytes this rank sends over NVLink / P2P bandwidth), both bandwidths measured
  in the same run (device copy; concurrent peer copies to the next rank);
* ``--comm-timeline`` (GPU): one PGAS step with the kernels' remote-store
  counter on (``torchrec_pgas.trace_comm``): cumulative bytes this rank stored
  into peers against time, next to the stock side's shape from its stage times
  (no bytes until the values all-to-all, none during the lookup, the pooled
  rows in the output all-to-all at the end).

``--mode train`` adds the training step (forward, backward, fused optimizer, ``--optimizer``, default row-wise
Adagrad; PGAS's owners apply it with ``--owner-backward``, default PgasConfig's) after the forward measurements of
each workload:

* both sides take the same inputs and upstream gradients; after the warm-up every local weight shard and
  optimizer state tensor must agree before the steps are timed (and again after them);
* stages: the forward's, then the backward's: stock's output-dist backward (all-gather / all-to-all of the
  pooled gradient) and its TBE's fused backward + optimizer; PGAS's gradient exchange, the owner's
  rebuild of its ids, then the owner update (the keys' sort, the update) or, with ``--owner-backward
  fbgemm``, the replayed lookup and FBGEMM's backward + optimizer;
* roofline: the forward's floor plus the backward's HBM bytes (a gradient row read per id, a key sort as
  one read and write of an (id, position) pair per id, one read and write of each distinct touched row and
  its optimizer state) and its gradient bytes over NVLink (the forward's output bytes, reversed).

Runs on CPU too (gloo + the ``shm`` backend; no graph, no roofline): the
``smoke`` preset is what CI runs. Results: ``results.json`` + ``results.csv``
under ``--out`` (default ``benchmarks/results/<date>-<device>-<commit>/``);
``python -m benchmarks.plots <dir>`` draws the plots.
"""

import argparse
import csv
import dataclasses
import datetime
import gc
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from torchrec_pgas import (AUTO_TRIAL_BACKWARDS, CapturedTrainStep, PgasConfig, PgasEmbeddingBagCollectionSharder,
                           check_errors, owner_backward_trials, profiling, shutdown)
from torchrec_pgas.embeddingbag import pgas_steps, trace_comm
from torchrec_pgas.layout import StepLayout
from torchrec_pgas.placement import rank_placement
from torchrec_pgas.planner import pgas_row_wise, pgas_table_row_wise, pgas_table_wise, with_compute_kernel
from torchrec_pgas.testing import fill_embeddings_, local_state
from torchrec_pgas.types import OwnerBackward, PgasTrainingConfig

@dataclasses.dataclass(frozen=True)
class Pair:
    """A stock sharding type and its PGAS twin, their plan generators per (table index, world size),
    and the names of the five ShardedModule stage boundaries on each side."""

    stock: str
    pgas: str
    stock_plan: Callable[[int, int], Any]
    pgas_plan: Callable[[int, int], Any]
    stock_stages: Tuple[str, ...]
    pgas_stages: Tuple[str, ...] = ("index_dist", "index_dist", "index_dist", "combine", "output_dist")


# Stock boundaries: input_dist() (RW: bucketize + splits a2a launch; TW: splits a2a launch), the first
# wait (splits a2a, a host sync, + values a2a launch), the second wait, compute (TBE), the output dist
# (RW: reduce-scatter; TW: all-to-all). PGAS: host checks + index-dist kernel, nothing, nothing, the
# lookup (its "lookup" mark) + combine, nothing. Table-wise tables go round-robin over the ranks.
PAIRS: Dict[str, Pair] = {
    "rw": Pair("row_wise", "pgas_row_wise", lambda i, w: row_wise(compute_kernel="fused"),
               lambda i, w: pgas_row_wise(), ("bucketize", "splits_a2a", "values_a2a", "lookup", "output_dist")),
    "tw": Pair("table_wise", "pgas_table_wise", lambda i, w: table_wise(rank=i % w, compute_kernel="fused"),
               lambda i, w: pgas_table_wise(i % w), ("splits_launch", "splits_a2a", "values_a2a", "lookup",
                                                     "output_dist")),
    # Beyond one node (--node-size: the ranks of a node), table i on node i % N.
    "twrw": Pair("table_row_wise", "pgas_table_row_wise",
                 lambda i, w: with_compute_kernel(table_row_wise(host_index=i % nodes(w)), "fused"),
                 lambda i, w: pgas_table_row_wise(i % nodes(w)),
                 ("bucketize", "splits_a2a", "values_a2a", "lookup", "output_dist")),
}


def node_size(world: int) -> int:
    """The ranks of a node: TorchRec's ``LOCAL_WORLD_SIZE`` (``--node-size`` sets it), else the whole job."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def nodes(world: int) -> int:
    return world // node_size(world)
AB_BLOCK = 10  # --layout-ab: steps per block, the two layouts' blocks alternating
ATOL, RTOL = 1e-4, 1e-5  # fp32 sums of up to 128 rows from ranks in different orders
# --optimizer: FBGEMM's optimizer and its state bytes per row of dimension d (fp32 state), for the floor.
OPTIMIZERS: Dict[str, Tuple[EmbOptimType, Callable[[int], int]]] = {
    "sgd": (EmbOptimType.EXACT_SGD, lambda d: 0),
    "rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, lambda d: 4),
    "adam": (EmbOptimType.ADAM, lambda d: 8 * d),
}
SORT_BYTES_PER_ID = 24  # the backward's key sort, at its floor: one read and write of an (id, position) pair


@dataclasses.dataclass(frozen=True)
class Workload:
    preset: str
    tables: int
    rows: int
    dim: int
    batch_per_gpu: int
    pooling: int  # fixed bag size, or the maximum of uniform [1, pooling]
    pooling_dist: str = "fixed"  # fixed | uniform
    ids: str = "uniform"  # uniform | zipf<alpha> | hzipf<alpha> (hashed)

    @property
    def name(self) -> str:
        pool = f"p{self.pooling}" if self.pooling_dist == "fixed" else f"p1-{self.pooling}"
        return f"t{self.tables}-r{self.rows}-d{self.dim}-b{self.batch_per_gpu}-{pool}-{self.ids}"

    @property
    def model_key(self) -> Tuple[int, int, int]:
        return (self.tables, self.rows, self.dim)


ZIPF_ALPHAS = (0.9, 1.05, 1.2)  # the zipf presets' exponents: hashed Criteo-like ids are about 1.05
ID_HASH = 2654435761  # Knuth's multiplicative hash, as examples/dlrm/data.py scatters its Zipf ranks


def _s004(world: int) -> List[Workload]:
    return [Workload("s004", t, 1_000_000, 32, b, p)
            for t in (2, 4, 8, 16, 32, 64) for b in (128, 1024, 4096) for p in (4, 8, 16)]


def _s000_weak(world: int) -> List[Workload]:
    return [Workload("s000-weak", 64 * world, 1_000_000, 64, 16384 // world, 128, "uniform")]


def _s000_strong(world: int) -> List[Workload]:
    return [Workload("s000-strong", 96, 1_000_000, 64, 16384 // world, 32, "uniform")]


def _skew(world: int) -> List[Workload]:
    return [Workload("skew", 8, 1_000_000, 64, b, 32, ids=ids)
            for b in (1024, 4096) for ids in ("uniform", "zipf1.05", "zipf1.2")]


def _s000_weak_zipf(world: int) -> List[Workload]:
    """s000-weak's shape with what real training feeds it: hashed Zipf ids, the hot rows scattered over the
    owners as a hash scatters them (examples/dlrm/data.py)."""
    return [dataclasses.replace(w, preset="s000-weak-zipf", ids=f"hzipf{a}")
            for w in _s000_weak(world) for a in ZIPF_ALPHAS]


def _s000_strong_zipf(world: int) -> List[Workload]:
    """s000-strong's shape with hashed Zipf ids (as ``_s000_weak_zipf``)."""
    return [dataclasses.replace(w, preset="s000-strong-zipf", ids=f"hzipf{a}")
            for w in _s000_strong(world) for a in ZIPF_ALPHAS]


def _quick(world: int) -> List[Workload]:
    return ([Workload("quick", t, 1_000_000, 32, b, 16) for t in (2, 64) for b in (128, 4096)]
            + [Workload("quick", 8, 1_000_000, 64, 4096, 32, ids="zipf1.2"),
               Workload("quick", 24, 1_000_000, 64, 16384 // world, 32, "uniform")])


def _l2_reuse(world: int) -> List[Workload]:
    """s000-weak's ids over tables of 150K rows, whose 19 MB row blocks fit in L2 (50 MB): the gather rate
    when repeated rows come from L2, next to s000-weak's (1M rows: a 128 MB block per table, few L2 hits)."""
    return [Workload("l2-reuse", 64 * world, 150_000, 64, 16384 // world, 128, "uniform")]


def _profile(world: int) -> List[Workload]:
    """One mid-size gather for ncu (scripts/gpu_check.sh profile)."""
    return [Workload("profile", 48, 1_000_000, 64, 8192, 32, "uniform")]


def _index(world: int) -> List[Workload]:
    """s000-weak's ids over rows of dim 4: the index dist's work in 1/16 of the table memory (ncu's replays)."""
    return [Workload("index", 64 * world, 1_000_000, 4, 16384 // world, 128, "uniform")]


def _smoke(world: int) -> List[Workload]:
    return [Workload("smoke", 3, 1000, 16, 32, 4), Workload("smoke", 3, 1000, 16, 64, 8, "uniform", "zipf1.2")]


PRESETS: Dict[str, Callable[[int], List[Workload]]] = {
    "s004": _s004, "s000-weak": _s000_weak, "s000-strong": _s000_strong, "skew": _skew, "quick": _quick,
    "s000-weak-zipf": _s000_weak_zipf, "s000-strong-zipf": _s000_strong_zipf,
    "l2-reuse": _l2_reuse, "profile": _profile, "index": _index, "smoke": _smoke,
}
# 1-GPU reference of the scaling presets (unsharded TBE): (tables, batch); weak keeps 64 tables per GPU.
SINGLE_GPU: Dict[str, Tuple[int, int]] = {"s000-weak": (64, 16384), "s000-strong": (96, 16384)}


# ---- inputs -----------------------------------------------------------------------


def _ids(n: int, rows: int, kind: str, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform; Zipf(alpha) with row 0 the hottest (``zipf``: no hashing, so under RW the hot rows all live on
    rank 0, the load imbalance the skew preset shows); or the same Zipf ranks hashed to rows (``hzipf``: the
    hot rows scattered over the table, as hashed ids are in real training data)."""
    if kind == "uniform":
        return torch.randint(0, rows, (n,), generator=gen, device=device)
    hashed = kind.startswith("hzipf")
    alpha = float(kind.removeprefix("hzipf" if hashed else "zipf"))
    cdf = torch.arange(1, rows + 1, dtype=torch.float64, device=device).pow_(-alpha).cumsum_(0)
    cdf /= cdf[-1].clone()
    u = torch.rand(n, generator=gen, dtype=torch.float64, device=device)
    ranks = torch.searchsorted(cdf, u).clamp_(max=rows - 1)
    return ranks * ID_HASH % rows if hashed else ranks


def make_inputs(w: Workload, tables: int, batch: int, n_sets: int, seed: int,
                device: torch.device) -> List[KeyedJaggedTensor]:
    """``n_sets`` KJTs with per-key sizes known on the host (no sync in either forward)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n_sets):
        if w.pooling_dist == "fixed":
            lengths = torch.full((tables * batch,), w.pooling, dtype=torch.int64, device=device)
        else:
            lengths = torch.randint(1, w.pooling + 1, (tables * batch,), generator=gen, device=device)
        per_key = lengths.view(tables, batch).sum(1).tolist()
        values = _ids(sum(per_key), w.rows, w.ids, gen, device)
        out.append(KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths, stride=batch,
            length_per_key=per_key, offset_per_key=list(itertools.accumulate([0] + per_key))))
    return out


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes and ids of one step per rank (index = rank), averaged over the input sets; the same volumes for
    both sides. In: ids (8 bytes) and per-bag lengths/offsets. Out: RW, an fp32 partial pool of every bag to
    each other rank; TW, the owner's pooled rows to each other rank. The backward sends the pooled gradient
    the other way: RW, every bag's to each other rank; TW, each remote bag's to its owner."""

    owned_ids: torch.Tensor  # ids each rank looks up as an owner
    hbm: torch.Tensor  # forward bytes gathered
    nvlink: torch.Tensor  # forward bytes sent
    out: torch.Tensor  # of which pooled output
    grad_sent: torch.Tensor  # backward bytes sent

    def busiest(self) -> Tuple[int, int, int]:
        """(HBM bytes of the busiest owner, NVLink bytes of the busiest sender, of which pooled output)."""
        r = int(self.nvlink.argmax())
        return int(self.hbm.max()), int(self.nvlink[r]), int(self.out[r])


def id_owners(w: Workload, x: KeyedJaggedTensor, world: int, pair: str) -> torch.Tensor:
    """The rank that looks up each id of ``x``: RW, its row block; TW, its table's rank; TWRW, its row block of
    its table's node (table i on node i % N)."""
    if pair == "rw":
        return x.values() // ((w.rows + world - 1) // world)
    table = torch.repeat_interleave(torch.arange(w.tables, device=x.values().device),
                                    torch.tensor(x.length_per_key(), device=x.values().device))
    if pair == "tw":
        return table % world
    size = node_size(world)
    return (table % nodes(world)) * size + x.values() // ((w.rows + size - 1) // size)


def traffic(w: Workload, inputs: Sequence[KeyedJaggedTensor], world: int, pair: str) -> Traffic:
    counts = torch.zeros(world, dtype=torch.float64, device=inputs[0].values().device)
    for x in inputs:
        counts += torch.bincount(id_owners(w, x, world, pair), minlength=world).double()
    counts /= len(inputs)
    matrix = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(matrix, counts)
    per = torch.stack(matrix).cpu()  # [src][owner] ids
    row_bytes = 4 * w.dim
    remote_ids = per.sum(1) - per.diagonal()
    if pair == "rw":
        bags = w.tables * w.batch_per_gpu
        out = torch.full_like(remote_ids, (world - 1) * bags * row_bytes)
        nvlink = remote_ids * 8 + (world - 1) * bags * 12 + out
        grad_sent = out
    elif pair == "twrw":  # a row-wise step over the node's N·B rail bags, then the rail's pooled rows
        n, size = nodes(world), node_size(world)
        node_bags = w.tables / n * w.batch_per_gpu * n
        out = torch.full_like(remote_ids, (size - 1) * node_bags * row_bytes + (n - 1) / n * w.tables
                              * w.batch_per_gpu * row_bytes)
        nvlink = remote_ids * 8 + (size - 1) * node_bags * 12 + out
        grad_sent = out
    else:
        own = torch.tensor([len(range(r, w.tables, world)) for r in range(world)], dtype=torch.float64)
        remote_bags = (w.tables - own) * w.batch_per_gpu
        out = (world - 1) * own * w.batch_per_gpu * row_bytes
        nvlink = remote_ids * 8 + remote_bags * 12 + out
        grad_sent = remote_bags * row_bytes
    return Traffic(per.sum(0), per.sum(0) * row_bytes, nvlink, out, grad_sent)


def distinct_rows(w: Workload, inputs: Sequence[KeyedJaggedTensor], world: int, pair: str) -> torch.Tensor:
    """Distinct (table, row) each owner's backward updates, averaged over the input sets: a bitmap of every
    table's rows set by each rank's ids, OR-ed over the ranks (a MAX all-reduce)."""
    dev = inputs[0].values().device
    block = (w.rows + world - 1) // world
    per_owner = torch.zeros(world, dtype=torch.float64)
    for x in inputs:
        seen = torch.zeros(w.tables * w.rows, dtype=torch.uint8, device=dev)
        table = torch.repeat_interleave(torch.arange(w.tables, device=dev),
                                        torch.tensor(x.length_per_key(), device=dev))
        seen[table * w.rows + x.values()] = 1
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        hits = seen.view(w.tables, w.rows).sum(0 if pair == "rw" else 1, dtype=torch.float64).cpu()
        if pair == "rw":  # hits per row index; the owner of a row is its block
            per_owner += torch.zeros(world, dtype=torch.float64).index_add_(0, torch.arange(w.rows) // block, hits)
        elif pair == "tw":  # hits per table; the owner of a table is its rank
            per_owner += torch.zeros(world, dtype=torch.float64).index_add_(0, torch.arange(w.tables) % world, hits)
        else:  # a table's hits spread over its node's ranks (uniform rows: a sketch, not per row block)
            size, table_node = node_size(world), torch.arange(w.tables) % nodes(world)
            for local in range(size):
                per_owner.index_add_(0, table_node * size + local, hits / size)
    return per_owner / len(inputs)


def backward_hbm_bytes(w: Workload, t: Traffic, distinct: torch.Tensor, optimizer: str,
                       weight_bytes: int = 4) -> torch.Tensor:
    """Each owner's backward at its HBM floor: a gradient row read per id (fp32), the key sort, one read and
    write of each distinct touched row (``weight_bytes`` an element) and its optimizer state."""
    return (t.owned_ids * (4 * w.dim + SORT_BYTES_PER_ID)
            + distinct * 2 * (weight_bytes * w.dim + OPTIMIZERS[optimizer][1](w.dim)))


# ---- models -----------------------------------------------------------------------


def shard_ebc(w: Workload, pgas: bool, pair: str, config: PgasConfig, device: torch.device,
              fused_params: Optional[Dict[str, Any]] = None) -> DistributedModelParallel:
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", num_embeddings=w.rows, embedding_dim=w.dim,
                                   feature_names=[f"f{i}"]) for i in range(w.tables)],
        device=torch.device("meta"),
    )
    gen = PAIRS[pair].pgas_plan if pgas else PAIRS[pair].stock_plan
    sharder = (PgasEmbeddingBagCollectionSharder(pgas_config=config, fused_params=fused_params) if pgas
               else EmbeddingBagCollectionSharder(fused_params=fused_params))
    world = dist.get_world_size()
    plan = construct_module_sharding_plan(
        ebc, {f"t{i}": gen(i, world) for i in range(w.tables)}, sharder=sharder,
        local_size=node_size(world), world_size=world, device_type=device.type)
    placed = rank_placement(world, device.type).place_shards(ShardingPlan({"": plan}))  # a GPU a rank, nodes kept
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                   plan=placed, sharders=[sharder])
    fill_embeddings_(dmp)  # the same weights under either sharding
    return dmp


ModelGroup = Callable[[Workload], Tuple[Hashable, ...]]


def shared_models(w: Workload) -> Tuple[Hashable, ...]:
    """Workloads of one table shape share their models (and buffers sized for the largest of them)."""
    return w.model_key


def owns_models(args: argparse.Namespace) -> bool:
    """Whether each workload gets its own models: replayed steps size their buffers to its ids, and
    ``owner_backward="auto"`` makes its choice once per model (shared models would keep the first workload's)."""
    return bool(args.train_graph or args.own_models or args.owner_backward == OwnerBackward.AUTO.value)


def own_models(w: Workload) -> Tuple[Hashable, ...]:
    """Each workload its own models, buffers sized to its ids (``--train-graph``: a captured step sorts its
    buffers' whole capacity, which a training job sizes to its batch), workloads that differ only in their ids'
    distribution too (``auto``'s choice follows the skew)."""
    return (w.preset, w.name)


def model_group(args: argparse.Namespace) -> Callable[[Workload], Tuple[Hashable, ...]]:
    """The key under which workloads share models: each its own (``owns_models``), else its table shape."""
    return own_models if owns_models(args) else shared_models


def symmetric_heap_bytes(workloads: Sequence[Workload], world: int, capacity: Dict[Tuple[Hashable, ...], int],
                         group: ModelGroup) -> int:
    """NVSHMEM heap for every PGAS sharding of the run (buffers live until exit)."""
    total = 0
    for key, same in itertools.groupby(workloads, key=group):
        ws = list(same)
        total += StepLayout(world_size=world, num_features=ws[0].tables, max_batch=max(w.batch_per_gpu for w in ws),
                            ids_capacity=capacity[key], dim_sum=ws[0].tables * ws[0].dim, weighted=False).nbytes
    return total


# ---- timing -----------------------------------------------------------------------


def timed_ms(fn: Callable[[], Any], cuda: bool) -> float:
    """One call, from an idle GPU: CUDA events around it on the current stream
    (the GPU-side time, host gaps included), or the wall clock on CPU."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_steps(fn: Callable[[int], Any], steps: int, warmup: int, device: torch.device) -> List[float]:
    """Per-step times; steps start together on all ranks, and a step ends when the slowest rank's ends."""
    for i in range(warmup):
        fn(i)
    cuda = device.type == "cuda"
    times = []
    for i in range(steps):
        dist.barrier()
        times.append(timed_ms(lambda: fn(i), cuda))
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def host_profile(fn: Callable[[int], Any], steps: int, device: torch.device, path: Optional[str]) -> float:
    """The host's p50 ms a call of ``fn`` (from an idle GPU, up to its return: the launches, and any wait on
    the GPU the call makes), then cProfile over the same calls, its top functions by own time written to
    ``path`` (None: not written). A step whose host ms is near its GPU-timeline ms is host-bound."""
    cuda = device.type == "cuda"
    ms, prof = [], profiling.HostProfile()
    for i in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with prof:
            fn(i)
        ms.append(1e3 * (time.perf_counter() - t0))
    if cuda:
        torch.cuda.synchronize()
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(prof.table(f"{steps} calls, host p50 {p50(ms):.3f} ms a call (cProfile's own cost included)"))
    return p50(ms)


def p50(x: Sequence[float]) -> float:
    return statistics.median(x)


def p90(x: Sequence[float]) -> float:
    return sorted(x)[min(len(x) - 1, int(0.9 * len(x)))]


def staged_forward(dmp: DistributedModelParallel, kjt: KeyedJaggedTensor, names: Sequence[str],
                   on_compute: Optional[Callable[[Any], None]] = None) -> torch.Tensor:
    """The ShardedModule forward spelled out, with a mark named ``names[k]`` after stage k (``on_compute``
    sees the lookup's output)."""
    module = dmp.module
    ctx = module.create_context()
    profiling.mark("start")
    splits = module.input_dist(ctx, kjt)
    profiling.mark(names[0])
    tensors = splits.wait()
    profiling.mark(names[1])
    dist_input = tensors.wait()
    profiling.mark(names[2])
    out = module.compute(ctx, dist_input)
    if on_compute is not None:
        on_compute(out)
    profiling.mark(names[3])
    values = module.output_dist(ctx, out).wait().values()
    profiling.mark(names[4])
    return values


def stage_breakdown(step: Callable[[int], Any], steps: int, device: torch.device) -> Dict[str, float]:
    """Median ms per stage on this rank over ``steps`` synchronized calls of ``step`` (which marks them)."""
    samples: Dict[str, List[float]] = {}
    for i in range(steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profiling.stage_timer(device) as timer:
            step(i)
            stages = timer.stages()
        for k, v in stages.items():
            samples.setdefault(k, []).append(v)
    return {k: p50(v) for k, v in samples.items()}


def _mark_output_dist_backward(lookup_out: Any) -> None:
    """Stock: mark when the gradient of the lookup's output is in (the output dist's backward has run)."""
    for t in lookup_out if isinstance(lookup_out, (list, tuple)) else [lookup_out]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: profiling.mark("grad_output_dist"))


def staged_train_step(dmp: DistributedModelParallel, kjt: KeyedJaggedTensor, grad: torch.Tensor,
                      names: Sequence[str], stock: bool) -> None:
    """``train_step`` with the forward's marks, then the backward's: stock's ``grad_output_dist`` (its
    output dist's backward) and ``owner_backward`` (its TBE's fused backward + optimizer); PGAS marks its
    backward's stages itself (``grad_exchange``, ``kept_ids``, ``replay_lookup``, ``owner_backward``; a backward
    replayed as a CUDA graph: ``owner_update``, the exchange and the update in one replay)."""
    with torch.enable_grad():
        values = staged_forward(dmp, kjt, names, _mark_output_dist_backward if stock else None)
        values.backward(grad)
    profiling.mark("owner_backward")


def train_step(dmp: DistributedModelParallel, kjt: KeyedJaggedTensor, grad: torch.Tensor) -> None:
    """Forward, then the backward of ``grad`` (the loss's gradient of the pooled output): the fused
    optimizer updates the tables inside it."""
    with torch.enable_grad():
        dmp(kjt).values().backward(grad)


def upstream_gradients(inputs: Sequence[KeyedJaggedTensor], dim_sum: int, seed: int) -> List[torch.Tensor]:
    """One fixed pooled-output gradient per input set, the same for both sides."""
    dev = inputs[0].values().device
    gen = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(x.stride(), dim_sum, generator=gen, device=dev) for x in inputs]


def state_diff(stock: DistributedModelParallel, pgas: DistributedModelParallel, what: str) -> float:
    """Largest |pgas - stock| over every local weight shard and optimizer state tensor; raises past the
    benchmark's tolerance."""
    got, ref = local_state(pgas, clone=False), local_state(stock, clone=False)
    if got.keys() != ref.keys():
        raise AssertionError(f"{what}: state names differ: {sorted(got.keys() ^ ref.keys())}")
    worst = 0.0
    for k, r in ref.items():
        if got[k].shape != r.shape:
            raise AssertionError(f"{what}, {k}: shape {tuple(got[k].shape)} against stock's {tuple(r.shape)}")
        if r.numel() == 0:
            continue
        # in chunks: tables of gigabytes, compared without full-size temporaries
        for g, want in zip(got[k].reshape(-1).split(1 << 24), r.reshape(-1).split(1 << 24)):
            diff = torch.nan_to_num((g.double() - want.double()).abs(), nan=float("inf"))  # a NaN fails
            excess = float((diff - (ATOL + RTOL * want.double().abs())).max())
            if excess > 0:
                raise AssertionError(f"{what}, {k}: |pgas - stock| exceeds atol {ATOL} + rtol {RTOL} by {excess}")
            worst = max(worst, float(diff.max()))
    return worst


def comm_timeline(dmp: DistributedModelParallel, x: KeyedJaggedTensor, expected_bytes: int,
                  records: int = 4096) -> List[Tuple[float, int]]:
    """(ms since the step's index dist started, bytes this rank has stored into peers) of one traced
    PGAS step, a record each ~1/500 of the expected bytes."""
    (trace,) = trace_comm(dmp, records, max(64, expected_bytes // 500)).values()  # the benchmark's EBC: one type
    dmp(x)
    torch.cuda.synchronize()
    for step in pgas_steps(dmp):
        step.comm_trace.stop()
    t = trace.cpu().tolist()
    return [(0.0, 0)] + [((ns - t[0][0]) / 1e6, b) for ns, b in t[1:] if ns > 0]


def stock_comm_shape(stages_ms: Dict[str, float], in_bytes: int, out_bytes: int) -> List[Tuple[float, int]]:
    """The stock side's cumulative bytes from its stage times: the ids move during the values
    all-to-all, nothing during the lookup, the pooled rows during the output dist."""
    names = list(stages_ms)
    t = list(itertools.accumulate(stages_ms[n] for n in names))
    before_values = t[names.index("values_a2a") - 1]
    return [(0.0, 0), (before_values, 0), (t[names.index("values_a2a")], in_bytes),
            (t[names.index("lookup")], in_bytes), (t[names.index("output_dist")], in_bytes + out_bytes)]


def graphed(dmp: DistributedModelParallel, inputs: Sequence[KeyedJaggedTensor]) -> Callable[[int], torch.Tensor]:
    """One CUDA graph of the whole sharded forward per input set; a call copies set
    ``i``'s ids into its captured buffer and replays."""
    captured = []
    for x in inputs:
        static_values = x.values().clone()
        kjt = KeyedJaggedTensor(x.keys(), static_values, lengths=x.lengths(), stride=x.stride(),
                                length_per_key=x.length_per_key(), offset_per_key=x.offset_per_key())
        dmp(kjt).values()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dmp(kjt).values()
        captured.append((graph, static_values, out, kjt))  # kjt: the graph reads its offsets

    def run(i: int) -> torch.Tensor:
        graph, static_values, out, _ = captured[i % len(captured)]
        static_values.copy_(inputs[i % len(inputs)].values())
        graph.replay()
        return out

    return run


# ---- bandwidths and the 1-GPU reference --------------------------------------------


def measure_bandwidths(device: torch.device, nbytes: int = 2 << 30, reps: int = 10) -> Tuple[float, float]:
    """(HBM GB/s as read+write bytes of a device copy, P2P GB/s of a copy into the next
    rank's GPU while every rank does the same); medians over ``reps``."""
    world = dist.get_world_size()

    def gbps(dst: torch.Tensor, src: torch.Tensor, factor: int) -> float:
        times = []
        for _ in range(reps + 2):
            dist.barrier()
            times.append(timed_ms(lambda: dst.copy_(src), True))
        return factor * nbytes / (p50(times[2:]) * 1e6)

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    hbm = gbps(torch.empty_like(src), src, 2)
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count()) if world > 1 else device
    p2p = gbps(torch.empty(nbytes, dtype=torch.uint8, device=peer), src, 1) if world > 1 else float("nan")
    gc.collect()
    torch.cuda.empty_cache()
    both = torch.tensor([hbm, p2p], dtype=torch.float64, device=device)
    dist.all_reduce(both)
    return both[0].item() / world, both[1].item() / world


def single_gpu_reference(preset: str, w: Workload, args: argparse.Namespace,
                         device: torch.device) -> Dict[str, Any]:
    """Unsharded FBGEMM TBE on one GPU (rank 0; the others wait): the scaling baseline."""
    tables, batch = SINGLE_GPU[preset]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(w.rows, w.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * tables, device=device)
    inputs = make_inputs(w, tables, batch, args.sets, seed=7, device=device)
    offsets = [x.offsets() for x in inputs]

    def step(i: int) -> torch.Tensor:
        x = inputs[i % len(inputs)]
        return tbe(x.values(), offsets[i % len(inputs)])

    for i in range(args.warmup):
        step(i)
    times = [timed_ms(lambda: step(i), True) for i in range(args.steps)]
    return {"preset": preset, "tables": tables, "batch": batch, "rows": w.rows, "dim": w.dim,
            "pooling": w.pooling, "pooling_dist": w.pooling_dist, "p50_ms": p50(times), "p90_ms": p90(times)}


# ---- one workload -------------------------------------------------------------------


def layout_ab(pgas: DistributedModelParallel, inference: DistributedModelParallel, stock: DistributedModelParallel,
              inputs: List[KeyedJaggedTensor], args: argparse.Namespace, device: torch.device) -> Dict[str, float]:
    """What a no-grad forward pays for training support: the PGAS forward with the training layout (``pgas``)
    and with ``PgasConfig(training=None)`` (``inference``), timed in alternating blocks of ``AB_BLOCK``
    steps, so that the drift of host-bound steps between two sweeps (±15-50% on s004) falls on both alike."""
    for x in inputs:
        torch.testing.assert_close(inference(x).values(), stock(x).values(), atol=ATOL, rtol=RTOL)
    n, timed = len(inputs), {"training": [], "inference": []}
    for _ in range(max(1, args.steps // AB_BLOCK)):
        for layout, dmp in (("training", pgas), ("inference", inference)):
            timed[layout] += time_steps(lambda i, m=dmp: m(inputs[i % n]).values(), AB_BLOCK, 2, device)
    check_errors(inference)
    return {f"pgas_{layout}_layout_p50_ms": p50(t) for layout, t in timed.items()}


def run_workload(w: Workload, stock: DistributedModelParallel, pgas: DistributedModelParallel,
                 inputs: List[KeyedJaggedTensor], args: argparse.Namespace, device: torch.device,
                 bandwidths: Optional[Tuple[float, float]],
                 inference: Optional[DistributedModelParallel] = None) -> Dict[str, Any]:
    pair = PAIRS[args.pair]
    err = 0.0
    for x in inputs:  # the two sides agree before anything is timed
        ref, got = stock(x).values(), pgas(x).values()
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{w.name}: {m}")
        err = max(err, float((got - ref).abs().max()))
    check_errors(pgas)
    n = len(inputs)
    t_stock = time_steps(lambda i: stock(inputs[i % n]).values(), args.steps, args.warmup, device)
    t_pgas = time_steps(lambda i: pgas(inputs[i % n]).values(), args.steps, args.warmup, device)
    row: Dict[str, Any] = {
        "preset": w.preset, "name": w.name, **dataclasses.asdict(w), "world_size": dist.get_world_size(),
        "stock": pair.stock, "pgas": pair.pgas,
        "nnz_per_rank": p50([x.values().numel() for x in inputs]),
        "stock_p50_ms": p50(t_stock), "stock_p90_ms": p90(t_stock),
        "pgas_p50_ms": p50(t_pgas), "pgas_p90_ms": p90(t_pgas),
        "pgas_graph_p50_ms": None, "pgas_graph_p90_ms": None, "speedup_graph": None,
        "stock_graph": "not capturable: TorchRec's input dist syncs with the host on the splits all-to-all",
        "max_abs_err": err,
    }
    row["speedup_eager"] = row["stock_p50_ms"] / row["pgas_p50_ms"]
    if device.type == "cuda" and not args.no_graph:
        run = graphed(pgas, inputs)
        for i in range(n):
            torch.testing.assert_close(run(i), stock(inputs[i]).values(), atol=ATOL, rtol=RTOL)
        t_graph = time_steps(run, args.steps, args.warmup, device)
        check_errors(pgas)
        row.update(pgas_graph_p50_ms=p50(t_graph), pgas_graph_p90_ms=p90(t_graph))
        row["speedup_graph"] = row["stock_p50_ms"] / row["pgas_graph_p50_ms"]
    for side, dmp, names in (("stock", stock, pair.stock_stages), ("pgas", pgas, pair.pgas_stages)):
        row[f"{side}_stages_ms"] = stage_breakdown(lambda i: staged_forward(dmp, inputs[i % n], names),
                                                   args.stage_steps, device)
    check_errors(pgas)
    flows = traffic(w, inputs, dist.get_world_size(), args.pair)
    hbm, nvlink, nvlink_out = flows.busiest()
    if args.comm_timeline and device.type == "cuda":
        row["comm_timeline"] = {
            "pgas": comm_timeline(pgas, inputs[0], nvlink),
            "stock_model": stock_comm_shape(row["stock_stages_ms"], nvlink - nvlink_out, nvlink_out),
        }
    row.update(hbm_bytes=hbm, nvlink_bytes=nvlink, floor_ms=None,
               roofline_stock=None, roofline_pgas=None, roofline_graph=None)
    if bandwidths is not None:
        floor = 1e3 * max(hbm / (bandwidths[0] * 1e9), nvlink / (bandwidths[1] * 1e9))
        row.update(floor_ms=floor, roofline_stock=floor / row["stock_p50_ms"],
                   roofline_pgas=floor / row["pgas_p50_ms"])
        if row["pgas_graph_p50_ms"]:
            row["roofline_graph"] = floor / row["pgas_graph_p50_ms"]
    if inference is not None:
        row.update(layout_ab(pgas, inference, stock, inputs, args, device))
    if args.mode == "train":
        row.update(train_workload(w, stock, pgas, inputs, flows, args, device, bandwidths))
    return row


def backward_graph_counts(dmp: DistributedModelParallel) -> Tuple[int, int]:
    """The eager backward's CUDA graphs captured and replayed so far, over every PGAS sharding of ``dmp``."""
    stats = [step.backward_graph_stats for step in pgas_steps(dmp)]
    return sum(s.captured for s in stats), sum(s.replays for s in stats)


def owner_backward_choices(dmp: DistributedModelParallel) -> List[Optional[str]]:
    """``owner_backward='auto'``'s choice in each PGAS sharding of ``dmp`` on this rank (None: still timing);
    empty under another owner backward."""
    return [t.report()[0] for t in owner_backward_trials(dmp)]


def owner_backward_trial_ms(dmp: DistributedModelParallel) -> List[Dict[str, float]]:
    """The median apply times (ms) ``owner_backward='auto'``'s choice compared, per PGAS sharding on this rank."""
    return [t.report()[1] for t in owner_backward_trials(dmp)]


def train_workload(w: Workload, stock: DistributedModelParallel, pgas: DistributedModelParallel,
                   inputs: List[KeyedJaggedTensor], flows: Traffic, args: argparse.Namespace, device: torch.device,
                   bandwidths: Optional[Tuple[float, float]]) -> Dict[str, Any]:
    """The training step of both sides, after the forward's measurements (module docstring)."""
    pair, n = PAIRS[args.pair], len(inputs)
    grads = upstream_gradients(inputs, w.tables * w.dim, seed=4242 + dist.get_rank())
    steps = {"stock": lambda i: train_step(stock, inputs[i % n], grads[i % n]),
             "pgas": lambda i: train_step(pgas, inputs[i % n], grads[i % n])}
    graphs_before = backward_graph_counts(pgas)
    for i in range(args.warmup):  # the same steps on both sides, so their states stay equal
        for step in steps.values():
            step(i)
    check_errors(pgas)
    diff = state_diff(stock, pgas, f"{w.name}: after {args.warmup} training steps")
    times = {side: time_steps(step, args.steps, 0, device) for side, step in steps.items()}
    row: Dict[str, Any] = {"mode": "train", "optimizer": args.optimizer}
    for side, dmp, names in (("stock", stock, pair.stock_stages), ("pgas", pgas, pair.pgas_stages)):
        row[f"{side}_train_p50_ms"], row[f"{side}_train_p90_ms"] = p50(times[side]), p90(times[side])
        row[f"{side}_train_stages_ms"] = stage_breakdown(
            lambda i: staged_train_step(dmp, inputs[i % n], grads[i % n], names, side == "stock"),
            args.stage_steps, device)
    check_errors(pgas)
    row["max_state_diff"] = max(diff, state_diff(stock, pgas, f"{w.name}: after the timed training steps"))
    # the eager backwards' CUDA graphs over this workload's steps: captures past the first few mean a key churns
    row["pgas_backward_graphs_captured"], row["pgas_backward_graph_replays"] = (
        after - before for after, before in zip(backward_graph_counts(pgas), graphs_before))
    row["speedup_train"] = row["stock_train_p50_ms"] / row["pgas_train_p50_ms"]
    row["pgas_owner_backward_chosen"] = owner_backward_choices(pgas)
    row["pgas_owner_backward_trial_ms"] = owner_backward_trial_ms(pgas)
    for side, step in steps.items():  # after the timed steps, so that cProfile's cost stays out of them
        row[f"{side}_train_host_p50_ms"] = None
        if args.host_profile:
            path = os.path.join(args.out, "host_profile", f"{w.name}-{side}.txt") if dist.get_rank() == 0 else None
            row[f"{side}_train_host_p50_ms"] = host_profile(step, args.host_profile, device, path)
    row["pgas_train_graph_p50_ms"] = row["speedup_train_graph"] = None
    if device.type == "cuda" and args.train_graph:
        # the whole PGAS step replayed as one CUDA graph on input set 0 alone: the state goes back afterwards
        # (the next workloads compare it with stock's), kept in host memory meanwhile (s000-strong's three
        # copies of 25 GB would not fit an 80 GB GPU)
        saved = {name: t.to("cpu", copy=True) for name, t in local_state(pgas, clone=False).items()}
        replay = CapturedTrainStep(lambda: train_step(pgas, inputs[0], grads[0]), warmup_steps=1)
        t_graph = time_steps(lambda i: replay(), args.steps, 2, device)
        check_errors(pgas)
        for name, live in local_state(pgas, clone=False).items():
            live.copy_(saved[name])
        row["pgas_train_graph_p50_ms"] = p50(t_graph)
        row["speedup_train_graph"] = row["stock_train_p50_ms"] / row["pgas_train_graph_p50_ms"]
    distinct = distinct_rows(w, inputs, dist.get_world_size(), args.pair)
    hbm = flows.hbm + backward_hbm_bytes(w, flows, distinct, args.optimizer)
    nvlink = flows.nvlink + flows.grad_sent
    row.update(distinct_rows=float(distinct.max()), train_hbm_bytes=int(hbm.max()),
               train_nvlink_bytes=int(nvlink.max()), train_floor_ms=None, roofline_train_stock=None,
               roofline_train_pgas=None)
    if bandwidths is not None:
        floor = 1e3 * max(float(hbm.max()) / (bandwidths[0] * 1e9), float(nvlink.max()) / (bandwidths[1] * 1e9))
        row.update(train_floor_ms=floor, roofline_train_stock=floor / row["stock_train_p50_ms"],
                   roofline_train_pgas=floor / row["pgas_train_p50_ms"])
    return row


# ---- driver -------------------------------------------------------------------------


def git_commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def device_tag(device: torch.device, world: int) -> str:
    if device.type != "cuda":
        return f"cpux{world}"
    name = torch.cuda.get_device_name(device).lower().split()
    return f"{name[-1] if name else 'gpu'}x{world}"


def _flat(row: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: v for k, v in row.items() if not isinstance(v, dict)}
    for side, kind in itertools.product(("stock", "pgas"), ("", "train_")):
        for k, v in row.get(f"{side}_{kind}stages_ms", {}).items():
            out[f"{side}_{kind}stage_{k}_ms"] = v
    return out


def write_results(out_dir: str, meta: Dict[str, Any], rows: List[Dict[str, Any]],
                  single: List[Dict[str, Any]]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "single_gpu": single}, f, indent=1)
    flat = [_flat(r) for r in rows]
    fields = list(dict.fromkeys(k for r in flat for k in r))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(flat)


def summary_table(rows: List[Dict[str, Any]], single: List[Dict[str, Any]]) -> str:
    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.3f}"

    def frac(v: Optional[float]) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    lines = [f"{'workload':<42} {'stock p50':>9} {'pgas p50':>9} {'graph p50':>9} {'x eager':>7} "
             f"{'x graph':>7} {'floor':>7} {'roof':>5}"]
    for r in rows:
        lines.append(
            f"{r['preset'] + '/' + r['name']:<42} {ms(r['stock_p50_ms']):>9} {ms(r['pgas_p50_ms']):>9} "
            f"{ms(r['pgas_graph_p50_ms']):>9} {r['speedup_eager']:>6.2f}x "
            f"{'-' if r['speedup_graph'] is None else format(r['speedup_graph'], '.2f') + 'x':>7} "
            f"{ms(r['floor_ms']):>7} {frac(r['roofline_pgas']):>5}")
    trained = [r for r in rows if r.get("mode") == "train"]
    if trained:
        lines.append(f"{'training step':<42} {'stock p50':>9} {'pgas p50':>9} {'x train':>7} {'floor':>7} "
                     f"{'roof':>5} {'state diff':>10} {'graph p50':>9} {'x graph':>7}")
    for r in trained:
        graph = r.get("speedup_train_graph")
        lines.append(f"{r['preset'] + '/' + r['name']:<42} {ms(r['stock_train_p50_ms']):>9} "
                     f"{ms(r['pgas_train_p50_ms']):>9} {r['speedup_train']:>6.2f}x {ms(r['train_floor_ms']):>7} "
                     f"{frac(r['roofline_train_pgas']):>5} {r['max_state_diff']:>10.2e} "
                     f"{ms(r.get('pgas_train_graph_p50_ms')):>9} {'-' if graph is None else f'{graph:.2f}x':>7}")
    for preset in sorted({r["preset"] for r in rows}):
        sel = [r for r in rows if r["preset"] == preset]
        geo = statistics.geometric_mean([r["speedup_eager"] for r in sel])
        graphs = [r["speedup_graph"] for r in sel if r["speedup_graph"]]
        line = f"{preset}: geomean speedup eager {geo:.2f}x"
        if graphs:
            line += f", graph {statistics.geometric_mean(graphs):.2f}x"
        if any(r.get("mode") == "train" for r in sel):
            line += f", training step {statistics.geometric_mean([r['speedup_train'] for r in sel]):.2f}x"
            replayed = [r["speedup_train_graph"] for r in sel if r.get("speedup_train_graph")]
            if replayed:
                line += f", replayed {statistics.geometric_mean(replayed):.2f}x"
        lines.append(line)
    for s in single:
        for r in (r for r in rows if r["preset"] == s["preset"]):
            t1 = s["p50_ms"]
            line = (f"{s['preset']}: 1-GPU TBE {t1:.3f} ms; scaling factor (1-GPU / {r['world_size']}-GPU) "
                    f"stock {t1 / r['stock_p50_ms']:.2f}, pgas {t1 / r['pgas_p50_ms']:.2f}")
            if r["pgas_graph_p50_ms"]:
                line += f", pgas graph {t1 / r['pgas_graph_p50_ms']:.2f}"
            lines.append(line)
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default quick")
    parser.add_argument("--workloads", default="", metavar="REGEX",
                        help="only the presets' workloads whose names match (e.g. '^t(2|64)-.*-b4096-')")
    parser.add_argument("--pair", default="rw", choices=sorted(PAIRS))
    parser.add_argument("--node-size", type=int, default=None,
                        help="--pair twrw: the ranks of a node (LOCAL_WORLD_SIZE), e.g. 2 to run 2 x 2 on 4 GPUs")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sets", type=int, default=4, help="input sets rotated through")
    parser.add_argument("--stage-steps", type=int, default=20)
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument("--train-graph", action="store_true",
                        help="--mode train: also the PGAS step replayed as one CUDA graph (CapturedTrainStep; needs "
                             "--owner-backward pgas and --no-graph: the forward's graphs leave the host's step "
                             "counters behind the device's; each workload gets its own models, their buffers sized "
                             "to its ids)")
    parser.add_argument("--own-models", action="store_true",
                        help="each workload its own models, their buffers sized to its ids (--train-graph implies "
                             "it; without, workloads of one table shape share models sized for the largest)")
    parser.add_argument("--no-single-gpu", action="store_true", help="skip the 1-GPU TBE reference")
    parser.add_argument("--comm-timeline", action="store_true", help="trace one PGAS step's remote bytes (GPU)")
    parser.add_argument("--inference-only", action="store_true",
                        help="PgasConfig(training=None): two slots, no gradient region (the forwards are no-grad)")
    parser.add_argument("--layout-ab", action="store_true",
                        help="also time the PGAS forward with PgasConfig(training=None), in alternating blocks "
                             "with the training layout's (what a no-grad forward pays for training support)")
    parser.add_argument("--mode", default="forward", choices=["forward", "train"],
                        help="train: the training step too, after the forward (module docstring)")
    parser.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(OPTIMIZERS),
                        help="--mode train: the tables' fused optimizer (adam: GPUs only, as FBGEMM's CPU TBE)")
    parser.add_argument("--lr", type=float, default=0.01, help="--mode train: its learning rate")
    parser.add_argument("--owner-backward", default=OwnerBackward.PGAS.value, choices=[o.value for o in OwnerBackward],
                        help="--mode train: PgasTrainingConfig.owner_backward (who applies the owner's gradients; "
                        f"auto: its trial takes the first {AUTO_TRIAL_BACKWARDS} steps of a sharding, so keep --warmup "
                        f"at {AUTO_TRIAL_BACKWARDS} or more; each "
                        "workload gets its own models, so that each makes its own choice)")
    parser.add_argument("--launched-backward", action="store_true",
                        help="--mode train --owner-backward pgas: PgasTrainingConfig(eager_backward_graphs=False), the "
                             "eager backward's kernels launched one by one, not replayed as CUDA graphs (its A/B)")
    parser.add_argument("--max-padded-eager-ids", type=int, default=None, metavar="POSITIONS",
                        help="--mode train: PgasTrainingConfig.max_padded_eager_ids (0: every eager step lays the "
                             "owner's ids out at their count, one host sync; default: the device's bound), the A/B "
                             "of the two layouts")
    parser.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                        help="--mode train: each side's host time a step (p50 over STEPS calls, recorded as "
                             "<side>_train_host_p50_ms) and cProfile's top functions, <out>/host_profile/<workload>-"
                             "<side>.txt (rank 0)")
    parser.add_argument("--out", help="results folder (default benchmarks/results/<date>-<device>-<commit>)")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses the flag combinations that would measure something else than they name."""
    if args.mode == "train" and args.inference_only:
        parser.error("--mode train needs the training layout: drop --inference-only")
    if args.train_graph and (args.mode != "train" or args.owner_backward != "pgas" or not args.no_graph
                             or args.optimizer == "adam"):
        parser.error("--train-graph needs --mode train, --owner-backward pgas and --no-graph, and not Adam (the "
                     "replays' iteration counts would part the model from stock's for the next workloads)")
    if args.launched_backward and (args.mode != "train" or args.owner_backward != "pgas"):
        parser.error("--launched-backward needs --mode train and --owner-backward pgas (the backward it launches)")
    if args.max_padded_eager_ids is not None and args.mode != "train":
        parser.error("--max-padded-eager-ids sets the training layout: add --mode train")
    if args.host_profile and args.mode != "train":
        parser.error("--host-profile profiles the training step: add --mode train")
    if args.layout_ab and (args.inference_only or args.mode == "train"):
        parser.error("--layout-ab compares the two layouts' forwards: drop --inference-only and --mode train")


def _step_inputs(workloads: List[Workload], args: argparse.Namespace, rank: int, device: torch.device
                 ) -> Tuple[Dict[Workload, List[KeyedJaggedTensor]], Dict[Tuple[Hashable, ...], int]]:
    """Every workload's input sets, and the ids capacity of each group of workloads that share models (the
    largest step of the group on any rank): the inputs come first because they size the PGAS buffers (and the
    NVSHMEM heap) exactly."""
    inputs: Dict[Workload, List[KeyedJaggedTensor]] = {}
    group = model_group(args)
    capacity: Dict[Tuple[Hashable, ...], int] = {}
    for k, w in enumerate(workloads):
        inputs[w] = make_inputs(w, w.tables, w.batch_per_gpu, args.sets, seed=1000 * rank + k, device=device)
        nnz = torch.tensor(max(x.values().numel() for x in inputs[w]), device=device)
        dist.all_reduce(nnz, op=dist.ReduceOp.MAX)
        capacity[group(w)] = max(capacity.get(group(w), 1), int(nnz))
    return inputs, capacity


def _run_meta(args: argparse.Namespace, device: torch.device, world: int, today: str,
              bandwidths: Optional[Tuple[float, float]]) -> Dict[str, Any]:
    """What results.json records of the run beside its rows."""
    train = args.mode == "train"
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world_size": world,
        "commit": git_commit(), "torch": torch.__version__, "date": today,
        "presets": args.preset, "workloads": args.workloads, "pair": args.pair, "steps": args.steps,
        "warmup": args.warmup, "input_sets": args.sets, "stage_steps": args.stage_steps,
        "own_models": owns_models(args),
        "pgas_training_layout": not args.inference_only, "mode": args.mode,
        "optimizer": args.optimizer if train else None, "owner_backward": args.owner_backward,
        "eager_backward_graphs": not args.launched_backward, "max_padded_eager_ids": args.max_padded_eager_ids,
        "learning_rate": args.lr if train else None,
        "hbm_gbps": bandwidths[0] if bandwidths else None, "p2p_gbps": bandwidths[1] if bandwidths else None,
        "argv": sys.argv,
    }


def _run_workloads(workloads: List[Workload], inputs: Dict[Workload, List[KeyedJaggedTensor]],
                   capacity: Dict[Tuple[Hashable, ...], int], args: argparse.Namespace, device: torch.device,
                   bandwidths: Optional[Tuple[float, float]], meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each group of workloads on its own stock and PGAS models (sized for the group's largest step); rank 0
    writes the rows after every workload, so a run cut short keeps them."""
    rank = dist.get_rank()
    group = model_group(args)
    rows: List[Dict[str, Any]] = []
    fused_params = ({"optimizer": OPTIMIZERS[args.optimizer][0], "learning_rate": args.lr}
                    if args.mode == "train" else None)
    progress = tqdm(total=len(workloads), disable=rank != 0, file=sys.stderr, desc="workloads")
    with torch.no_grad():
        for key, same in itertools.groupby(workloads, key=group):
            ws = list(same)
            config = PgasConfig(max_local_batch_size=max(w.batch_per_gpu for w in ws), max_ids_per_rank=capacity[key],
                                training=None if args.inference_only else PgasTrainingConfig(
                                    owner_backward=args.owner_backward,
                                    eager_backward_graphs=not args.launched_backward,
                                    max_padded_eager_ids=args.max_padded_eager_ids))
            stock = shard_ebc(ws[0], False, args.pair, config, device, fused_params)
            pgas = shard_ebc(ws[0], True, args.pair, config, device, fused_params)
            inference = (shard_ebc(ws[0], True, args.pair, dataclasses.replace(config, training=None), device,
                                   fused_params) if args.layout_ab else None)
            for w in ws:
                progress.set_postfix_str(f"{w.preset}/{w.name}")
                rows.append(run_workload(w, stock, pgas, inputs.pop(w), args, device, bandwidths, inference))
                progress.update()
                if rank == 0:
                    write_results(args.out, meta, rows, [])
            del stock, pgas, inference
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    progress.close()
    return rows


def _single_gpu_references(args: argparse.Namespace, device: torch.device) -> List[Dict[str, Any]]:
    """The unsharded TBE's step of each scaling preset on rank 0's GPU (the others wait)."""
    single: List[Dict[str, Any]] = []
    for preset in (p for p in args.preset if p in SINGLE_GPU):
        w = PRESETS[preset](dist.get_world_size())[0]
        if dist.get_rank() == 0:
            single.append(single_gpu_reference(preset, w, args, device))
        gc.collect()
        torch.cuda.empty_cache()
        dist.barrier()
    return single


def main(argv: Optional[List[str]] = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    args.preset = args.preset or ["quick"]
    if args.node_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(args.node_size)  # TorchRec's node groups, read at sharding

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    workloads = [w for p in args.preset for w in PRESETS[p](world) if re.search(args.workloads, w.name)]
    bandwidths = measure_bandwidths(device) if cuda else None
    today = datetime.date.today().isoformat()
    args.out = args.out or os.path.join("benchmarks", "results", f"{today}-{device_tag(device, world)}-{git_commit()}")
    inputs, capacity = _step_inputs(workloads, args, rank, device)
    if cuda and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        heap = symmetric_heap_bytes(workloads, world, capacity, model_group(args)) + (1 << 30)
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
    meta = _run_meta(args, device, world, today, bandwidths)
    rows = _run_workloads(workloads, inputs, capacity, args, device, bandwidths, meta)
    single = _single_gpu_references(args, device) if cuda and not args.no_single_gpu else []
    if rank == 0:
        write_results(args.out, meta, rows, single)
        if bandwidths:
            print(f"measured: HBM {bandwidths[0]:.0f} GB/s (copy), P2P {bandwidths[1]:.0f} GB/s per direction")
        print(summary_table(rows, single))
        print(f"results: {args.out}/results.json")
    shutdown()


if __name__ == "__main__":
    main()
