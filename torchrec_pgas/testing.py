"""Validation harness: the same EBCs sharded by stock TorchRec and by torchrec-pgas.

Builds a model of two EBCs (one weighted) from identical weights, shards it
twice with ``DistributedModelParallel`` (the reference plan maps every PGAS type
to its stock twin, e.g. ``pgas_row_wise`` -> ``row_wise``), feeds both the same
per-rank inputs and compares outputs per key (``compare_with_stock``), or
trains both on the same inputs and upstream gradients and compares every local
weight shard and fused-optimizer state tensor after every step
(``train_against_stock``).

Tolerance: row-wise sums partial pools from several ranks, and stock TorchRec's
reduce-scatter and our rank-ordered sum add them in different orders, so RW is
not bit-exact (stock RW vs unsharded differs by ~1e-8 too). fp32 outputs must
agree within ``atol=1e-5, rtol=1e-5``.
"""

import contextlib
import copy
import dataclasses
import datetime
import itertools
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from torchrec_pgas.bootstrap import shutdown
from torchrec_pgas.embeddingbag import PgasEmbeddingBagCollectionSharder, check_errors
from torchrec_pgas.placement import SHARED_GPU_ENV, RankPlacement, rank_placement
from torchrec_pgas.runtime import PgasRuntime
from torchrec_pgas.sharding.step import PgasStep
from torchrec_pgas.sharding.tbe_counters import counting_tbes
from torchrec_pgas.planner.sharding_plan import pgas_row_wise, pgas_table_wise
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasConfig, PgasError, PgasTrainingConfig

ATOL: float = 1e-5
RTOL: float = 1e-5

STOCK_TWIN: Dict[str, str] = {PGAS_ROW_WISE: "row_wise", PGAS_TABLE_WISE: "table_wise"}
# Table-wise types take the owner as "table_wise@1" (rank 0 when left out).
_GENERATORS: Dict[str, Callable[[int], Any]] = {
    PGAS_ROW_WISE: lambda rank: pgas_row_wise(),
    PGAS_TABLE_WISE: lambda rank: pgas_table_wise(rank),
    "row_wise": lambda rank: row_wise(compute_kernel="fused"),
    "table_wise": lambda rank: table_wise(rank=rank, compute_kernel="fused"),
}


def _generator(sharding: str) -> Any:
    kind, _, rank = sharding.partition("@")
    return _GENERATORS[kind](int(rank or 0))


def stock_twin(sharding: str) -> str:
    """The stock type of a plan entry, keeping its owner: "pgas_table_wise@1" -> "table_wise@1"."""
    kind, at, rank = sharding.partition("@")
    return STOCK_TWIN.get(kind, kind) + at + rank


def default_tables(prefix: str = "t") -> List[EmbeddingBagConfig]:
    """Different dims, rows not divisible by W, a shared table, MEAN and SUM,
    and a table smaller than the world (a rank owns no rows of it)."""
    return [
        EmbeddingBagConfig(name=f"{prefix}0", num_embeddings=100, embedding_dim=8,
                           feature_names=[f"{prefix}f0"]),
        EmbeddingBagConfig(name=f"{prefix}1", num_embeddings=37, embedding_dim=16,
                           feature_names=[f"{prefix}f1", f"{prefix}f1b"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name=f"{prefix}2", num_embeddings=10, embedding_dim=4,
                           feature_names=[f"{prefix}f2"]),
        EmbeddingBagConfig(name=f"{prefix}3", num_embeddings=2, embedding_dim=12,
                           feature_names=[f"{prefix}f3"], pooling=PoolingType.MEAN),
    ]


class TwoEbcModel(nn.Module):
    """An unweighted and a weighted EBC side by side, like TorchRec's TestSparseNN."""

    def __init__(
        self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig], seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every rank must build the same global weights
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.webc = EmbeddingBagCollection(
            tables=weighted_tables, is_weighted=True, device=torch.device("cpu")
        )

    def forward(self, kjt: KeyedJaggedTensor, wkjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        out = self.ebc(kjt).to_dict()
        out.update({"w:" + k: v for k, v in self.webc(wkjt).to_dict().items()})
        return out


def default_model(seed: int = 0, all_sum: bool = False, min_rows: int = 1) -> TwoEbcModel:
    """``default_tables`` unweighted (``all_sum``: with SUM pooling), and a weighted copy with SUM pooling
    (the unsharded EBC has no weighted MEAN to compare with); tables of fewer than ``min_rows`` rows grow."""
    def tables(prefix: str, sum_only: bool) -> List[EmbeddingBagConfig]:
        return [dataclasses.replace(t, pooling=PoolingType.SUM if sum_only else t.pooling,
                                    num_embeddings=max(t.num_embeddings, min_rows)) for t in default_tables(prefix)]

    return TwoEbcModel(tables("t", all_sum), tables("w", True), seed=seed)


def random_kjt(
    tables: Sequence[EmbeddingBagConfig],
    batch: int,
    gen: torch.Generator,
    max_len: int = 5,
    weighted: bool = False,
    empty: bool = False,
) -> KeyedJaggedTensor:
    """Features in table order; lengths in [0, max_len] (empty bags included)."""
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
            if empty:
                lens.zero_()
            keys.append(f)
            lengths.append(lens)
            values.append(torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=gen))
    vals = torch.cat(values)
    return KeyedJaggedTensor(
        keys=keys,
        values=vals,
        lengths=torch.cat(lengths),
        weights=torch.rand(vals.numel(), generator=gen) if weighted else None,
        stride=batch,
    )


def sample_batches(model: TwoEbcModel, rank: int, batch: int = 4) -> List[Tuple[KeyedJaggedTensor, KeyedJaggedTensor]]:
    """Four (kjt, weighted kjt) steps for ``rank``: plain, long bags, all bags empty, batch 1."""
    gen = seeded(1000 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    return [
        (random_kjt(t, batch, gen), random_kjt(w, batch, gen, weighted=True)),
        (random_kjt(t, batch, gen, max_len=12), random_kjt(w, batch, gen, weighted=True)),
        (random_kjt(t, batch, gen, empty=True), random_kjt(w, batch, gen, weighted=True, empty=True)),
        (random_kjt(t, 1, gen), random_kjt(w, 1, gen, weighted=True)),
    ]


def all_tables(model: TwoEbcModel, sharding_type: str) -> Dict[str, str]:
    """Every table of both EBCs with one sharding type."""
    return {c.name: sharding_type for ebc in (model.ebc, model.webc) for c in ebc.embedding_bag_configs()}


def spread_tables(model: TwoEbcModel, world: int, kind: str = "pgas_table_wise") -> Dict[str, str]:
    """A table-wise ``kind`` with the tables round-robin over the ranks (with W=3, rank 2 owns fewer)."""
    return {t: f"{kind}@{i % world}" for i, t in enumerate(all_tables(model, kind))}


def shard_metadata(sd: Dict[str, Any]) -> Dict[str, Any]:
    """Per state_dict key: global size and every shard's offsets, sizes and placement."""
    out = {}
    for k, v in sd.items():
        assert isinstance(v, ShardedTensor), k
        out[k] = (tuple(v.size()), [(m.shard_offsets, m.shard_sizes, str(m.placement))
                                    for m in v.metadata().shards_metadata])
    return out


def build_plan(
    model: TwoEbcModel,
    types: Dict[str, str],
    world_size: int,
    device_type: str,
    sharder: EmbeddingBagCollectionSharder,
    path: str = "",
) -> ShardingPlan:
    """The plan of both EBCs; ``path``: where ``model`` sits in the module sharded (e.g. "model.")."""
    plan = {}
    local_size = rank_placement(world_size, device_type).local_size(world_size)
    for name, ebc in (("ebc", model.ebc), ("webc", model.webc)):
        gens = {
            cfg.name: _generator(types[cfg.name]) for cfg in ebc.embedding_bag_configs()
        }
        plan[path + name] = construct_module_sharding_plan(
            ebc, gens, sharder=sharder, local_size=local_size, world_size=world_size,
            device_type=device_type,
        )
    return ShardingPlan(plan)


def shard(
    model: nn.Module,
    types: Dict[str, str],
    pg: dist.ProcessGroup,
    device: torch.device,
    config: Optional[PgasConfig] = None,
    fused_params: Optional[Dict[str, Any]] = None,
    stock: bool = False,
    path: str = "",
) -> DistributedModelParallel:
    """DMP over a deep copy of ``model`` with the given per-table sharding types.

    ``stock=True`` uses TorchRec's own sharder (the reference); the plan must
    then name stock types only. ``path``: where the ``TwoEbcModel`` sits in ``model``.
    """
    sharder = (
        EmbeddingBagCollectionSharder(fused_params=fused_params)
        if stock
        else PgasEmbeddingBagCollectionSharder(fused_params=fused_params, pgas_config=config)
    )
    dmp = DistributedModelParallel(
        copy.deepcopy(model),
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=build_plan(model.get_submodule(path.rstrip(".")) if path else model, types, dist.get_world_size(pg),
                        device.type, sharder, path),
        sharders=[sharder],
    )
    copy_state_dict(dmp.state_dict(), model.state_dict())
    return dmp


def copy_state_dict(local: Dict[str, Any], global_: Dict[str, torch.Tensor]) -> None:
    """Copy full tensors of an unsharded model into the local shards of a sharded one."""
    for name, tensor in local.items():
        src = global_[name].detach()
        if isinstance(tensor, ShardedTensor):
            for shard in tensor.local_shards():
                rows, cols = shard.metadata.shard_offsets
                n, d = shard.tensor.shape
                shard.tensor.copy_(src[rows : rows + n, cols : cols + d])
        else:
            tensor.copy_(src)


def fill_embeddings_(module: nn.Module, scale: float = 0.1) -> None:
    """Give every sharded table the same weights under any sharding: a function of
    (table, global row, column), computed on the local rows only (no global copy)."""
    for name, st in module.state_dict().items():
        if not isinstance(st, ShardedTensor):
            continue
        salt = sum(map(ord, name)) % 997
        for shard in st.local_shards():
            rows, cols = shard.metadata.shard_offsets
            n, d = shard.tensor.shape
            r = torch.arange(rows, rows + n, device=shard.tensor.device, dtype=torch.float64)
            c = torch.arange(cols, cols + d, device=shard.tensor.device, dtype=torch.float64)
            shard.tensor.copy_(torch.sin(r[:, None] * 0.37 + c[None, :] * 1.3 + salt) * scale)


@dataclasses.dataclass
class Comparison:
    """Per output key: max |pgas - stock|, and the two forward times in ms."""

    max_abs_diff: Dict[str, float]
    pgas_ms: float
    stock_ms: float


def compare_with_stock(
    model: TwoEbcModel,
    types: Dict[str, str],
    batches: Sequence[Tuple[KeyedJaggedTensor, KeyedJaggedTensor]],
    pg: dist.ProcessGroup,
    device: torch.device,
    config: Optional[PgasConfig] = None,
    fused_params: Optional[Dict[str, Any]] = None,
    tol: float = ATOL,
) -> Comparison:
    """Shard ``model`` with ``types`` and with their stock twins; run every batch on both.

    ``tol`` (absolute and relative) is for fp32; half-precision weights or
    outputs need ~1e-2.
    """
    stock_types = {t: stock_twin(st) for t, st in types.items()}
    pgas = shard(model, types, pg, device, config, fused_params)
    stock = shard(model, stock_types, pg, device, fused_params=fused_params, stock=True)
    diffs: Dict[str, float] = {}
    times = {"pgas": 0.0, "stock": 0.0}
    with torch.no_grad():
        for kjt, wkjt in batches:
            kjt, wkjt = kjt.to(device), wkjt.to(device)
            outs = {}
            for name, m in (("pgas", pgas), ("stock", stock)):
                t0 = time.perf_counter()
                outs[name] = m(kjt, wkjt)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[name] += time.perf_counter() - t0
            check_errors(pgas)
            assert outs["pgas"].keys() == outs["stock"].keys()
            for k in outs["stock"]:
                a, b = outs["pgas"][k].float(), outs["stock"][k].float()
                torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{k}: {m}")
                diffs[k] = max(diffs.get(k, 0.0), float((a - b).abs().max()) if a.numel() else 0.0)
    n = max(1, len(batches))
    return Comparison(diffs, 1e3 * times["pgas"] / n, 1e3 * times["stock"] / n)


# ---- training against stock ------------------------------------------------------


@dataclasses.dataclass
class TrainBatch(Pipelineable):
    """One step's input of ``LossModel`` (TorchRec's train pipelines move and stream-mark it)."""

    kjt: KeyedJaggedTensor
    wkjt: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "TrainBatch":
        return TrainBatch(self.kjt.to(device, non_blocking=non_blocking), self.wkjt.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        if isinstance(stream, torch.cuda.Stream):  # CPU tensors have no streams to mark
            self.kjt.record_stream(stream)
            self.wkjt.record_stream(stream)


def upstream_gradient(key: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """A fixed, key-dependent gradient for a pooled output: the same on both models, whatever their key order."""
    n = int(torch.tensor(shape).prod())
    salt = sum(map(ord, key)) % 101
    return torch.cos(torch.arange(n, device=device, dtype=torch.float32) * 0.37 + salt).view(*shape)


@torch.fx.wrap  # a leaf for the FX trace of TorchRec's train pipelines
def keyed_loss(pooled: KeyedTensor, weighted: KeyedTensor) -> torch.Tensor:
    """The sum over every pooled output of itself times ``upstream_gradient``, by key (``w:`` prefixed for the
    weighted EBC, as ``TwoEbcModel`` names them)."""
    out = {**pooled.to_dict(), **{"w:" + k: v for k, v in weighted.to_dict().items()}}
    return sum(((v.float() * upstream_gradient(k, v.shape, v.device)).sum() for k, v in sorted(out.items())),
               torch.zeros(()))


class LossModel(nn.Module):
    """``TwoEbcModel`` with a loss whose gradient is ``upstream_gradient`` for every pooled output."""

    def __init__(self, model: TwoEbcModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TrainBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled, weighted = self.model.ebc(batch.kjt), self.model.webc(batch.wkjt)
        return keyed_loss(pooled, weighted), pooled.values()


def local_state(dmp: nn.Module, clone: bool = True) -> Dict[str, torch.Tensor]:
    """Every local weight shard and fused-optimizer state tensor of ``dmp``, by name (flushed first); with
    ``clone=False`` the shards themselves (views of the TBEs' storage: no copy of tables of gigabytes)."""
    out: Dict[str, torch.Tensor] = {}
    for name, st in dmp.state_dict().items():
        for i, shard_ in enumerate(st.local_shards() if isinstance(st, ShardedTensor) else []):
            out[f"{name}#{i}"] = shard_.tensor.detach()
    for param, states in dmp.fused_optimizer.state_dict()["state"].items():
        for key, st in states.items():
            for i, shard_ in enumerate(st.local_shards() if isinstance(st, ShardedTensor) else []):
                out[f"{param}/{key}#{i}"] = shard_.tensor.detach()
    return {k: v.clone() for k, v in out.items()} if clone else out


def with_training(config: PgasConfig, **fields: Any) -> PgasConfig:
    """``config`` with its training config's ``fields`` replaced (the default training config where it has none)."""
    return dataclasses.replace(config, training=dataclasses.replace(config.training or PgasTrainingConfig(), **fields))


@contextlib.contextmanager
def failing_puts(after: int) -> Iterator[None]:
    """The runtime's one-sided put raises (after half a second) once ``after`` more puts have landed: a rank
    whose gradient exchange fails part way, slowly enough that peers would have used whatever it signalled
    before (the shm backend's puts; the fused kernels' are not reachable from Python)."""
    real, calls = PgasRuntime.put, itertools.count()

    def put(rt: PgasRuntime, *args: Any) -> None:
        if next(calls) >= after:
            time.sleep(0.5)
            raise RuntimeError("injected fault: a put of the gradient exchange failed")
        real(rt, *args)

    with mock.patch.object(PgasRuntime, "put", put):
        yield


@contextlib.contextmanager
def recorded_failure(epoch: int, err: PgasError) -> Iterator[None]:
    """Every host-path PGAS step reports ``err`` as its step ``epoch``'s failure (once, consumed), as GPU
    kernels record a bad id in the forward instead of raising it there: what the check before a model's
    backward must find (``StepGroup.refuse_failed_step``)."""
    real, reported = PgasStep.step_failure, set()

    def step_failure(step: PgasStep, e: int) -> Optional[PgasError]:
        if e == epoch and id(step) not in reported:
            reported.add(id(step))
            return err
        return real(step, e)

    with mock.patch.object(PgasStep, "step_failure", step_failure):
        yield


def _three_in_flight(dmp: nn.Module, batches: Sequence[TrainBatch], device: torch.device) -> Iterator[None]:
    """``TrainPipelineSemiSync``'s order through the sharded modules' own stages (TorchRec 1.6's pipeline
    marks CPU tensors' streams, which CPU tensors refuse): step i+2's input dist and step i+1's lookup run
    before step i's backward, so three steps' ids are in flight."""
    ebcs = (dmp.module.model.ebc, dmp.module.model.webc)

    def input_dist(i: int) -> Any:
        batch = batches[i].to(device)
        ctxs = [e.create_context() for e in ebcs]
        return ctxs, [e.input_dist(c, x).wait().wait() for e, c, x in zip(ebcs, ctxs, (batch.kjt, batch.wkjt))]

    def loss(dists: Any) -> torch.Tensor:
        return keyed_loss(*(e.compute_and_output_dist(c, d).wait() for e, c, d in zip(ebcs, *dists)))

    n = len(batches)
    dists = {i: input_dist(i) for i in range(min(2, n))}
    losses = {0: loss(dists.pop(0))}
    for i in range(n):
        if i + 2 < n:
            dists[i + 2] = input_dist(i + 2)
        if i + 1 < n:
            losses[i + 1] = loss(dists.pop(i + 1))
        losses.pop(i).backward()
        dmp.fused_optimizer.step()
        yield


def train_steps(dmp: nn.Module, batches: Sequence[TrainBatch], loop: str, device: torch.device,
                semi_sync_start: int = 2, eval_every: int = 0, eval_grad: bool = False) -> Iterator[None]:
    """Train ``dmp`` on ``batches``, yielding after each step's update (plain loop, three steps in flight,
    or a TorchRec train pipeline)."""
    if loop == "three_in_flight":
        yield from _three_in_flight(dmp, batches, device)
        return
    if loop == "plain":
        for i, batch in enumerate(batches):
            loss, _ = dmp(batch.to(device))
            loss.backward()
            dmp.fused_optimizer.step()
            if eval_every and i % eval_every == 0:  # an eval forward between training steps
                with torch.set_grad_enabled(eval_grad):  # with grad: its output goes without a backward
                    dmp(batch.to(device))
            yield
        return
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync, TrainPipelineSparseDist

    pipe = (TrainPipelineSparseDist(dmp, dmp.fused_optimizer, device) if loop == "sparse_dist" else
            TrainPipelineSemiSync(dmp, dmp.fused_optimizer, device, start_batch=semi_sync_start))
    it = iter(batches)
    for _ in batches:
        pipe.progress(it)
        yield


def train_against_stock(
    model: TwoEbcModel,
    types: Dict[str, str],
    batches: Sequence[TrainBatch],
    pg: dist.ProcessGroup,
    device: torch.device,
    fused_params: Dict[str, Any],
    config: Optional[PgasConfig] = None,
    loop: str = "plain",
    semi_sync_start: int = 2,
    eval_every: int = 0,
    eval_grad: bool = False,
    twin_config: Optional[PgasConfig] = None,
) -> List[float]:
    """Train ``model`` sharded with ``types`` and with their stock twins on the same batches and upstream
    gradients (``LossModel``); after every step, the largest |pgas - stock| / max(1, |stock|) over every
    local weight shard and fused-optimizer state tensor (absolute below 1, relative above: Adagrad's sums of
    squared gradients grow past 1). ``twin_config``: the twin is the same plan sharded with this config
    instead (e.g. ``owner_backward="reference"`` where stock's CPU kernels differ from its GPU ones).
    ``loop``: "plain", "three_in_flight" (stock runs "plain"),
    "sparse_dist" (``TrainPipelineSparseDist``) or "semi_sync" (``TrainPipelineSemiSync`` from batch
    ``semi_sync_start``). ``eval_every``: a forward of the step's batch after every that many steps, under
    ``no_grad`` or, with ``eval_grad``, with grad enabled and its output dropped."""
    stock_types = {t: stock_twin(st) for t, st in types.items()}
    wrapped = LossModel(model)
    sides = {
        "pgas": shard(wrapped, types, pg, device, config, fused_params, path="model."),
        "stock": (shard(wrapped, stock_types, pg, device, fused_params=fused_params, stock=True, path="model.")
                  if twin_config is None else shard(wrapped, types, pg, device, twin_config, fused_params,
                                                    path="model.")),
    }
    loops = {"pgas": loop, "stock": "plain" if loop == "three_in_flight" else loop}
    runs = {name: train_steps(dmp, batches, loops[name], device, semi_sync_start, eval_every, eval_grad)
            for name, dmp in sides.items()}
    diffs = []
    for _ in batches:
        for run in runs.values():
            next(run)
        check_errors(sides["pgas"])
        diffs.append(state_difference(sides["pgas"], sides["stock"]))
    return diffs


def iteration_counts(dmp: nn.Module) -> List[int]:
    """The host iteration counters of every TBE in ``dmp`` whose forward counts them (optimizers past
    EXACT_ADAGRAD), sorted: what Adam's bias correction reads next."""
    lookups = [lookup for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection)
               for lookup in m._lookups]  # a sharded EBC shows no submodules: its TBEs are its lookups'
    return sorted(int(tbe.iter_cpu) for lookup in lookups for tbe in counting_tbes(lookup))


def state_difference(dmp: nn.Module, reference: nn.Module) -> float:
    """The largest |dmp - reference| / max(1, |reference|) over every local weight shard and fused-optimizer
    state (``local_state``); the two must hold the same states."""
    got, ref = local_state(dmp), local_state(reference)
    if got.keys() != ref.keys():
        raise AssertionError(f"state names differ: {sorted(got.keys() ^ ref.keys())}")
    return max((float(((got[k].double() - ref[k].double()).abs() / ref[k].double().abs().clamp(min=1)).max())
                for k in ref if ref[k].numel()), default=0.0)


# ---- multi-process launcher ------------------------------------------------------


def _start_method(device_type: str) -> str:
    """On a machine without GPUs, ranks fork from a server process that imported this module (torch, TorchRec,
    FBGEMM) once: each rank is still a fresh process, started in a fraction of a second instead of a new
    interpreter's ~3 s of imports (most of a short multi-process test). Where there are GPUs, ranks spawn,
    whatever ``device_type`` says (a CPU-placed rank may still use CUDA): FBGEMM's GPU build initializes CUDA
    on import, and a process forked from one that did cannot use CUDA."""
    if device_type != "cpu" or torch.cuda.device_count() > 0:
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload([__name__])  # read when the server first starts
    return "forkserver"


def _worker(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, queue: Any, placement: RankPlacement,
    environ: Dict[str, str], args: Tuple,
) -> None:
    os.environ.update(environ)  # the caller's, as a spawned rank sees it (a forked one has the server's)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[SHARED_GPU_ENV] = "1" if placement.shared_gpu else "0"  # rank_device() agrees in this process
    torch.set_num_threads(1)
    if placement.device_type == "cuda":
        torch.cuda.set_device(placement.device(rank))
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        queue.put((rank, fn(rank, world_size, *args)))
    finally:
        shutdown()  # fn's models are garbage now: the gloo group goes here, not in interpreter teardown


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, device_type: str = "cpu") -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; its results by rank.

    ``device_type="cuda"``: rank r on ``cuda:r`` over NCCL, or, when the ranks outnumber the GPUs (or
    ``TORCHREC_PGAS_SHARED_GPU=1``), every rank on ``cuda:0`` over gloo (``torchrec_pgas.placement``);
    ``fn`` finds its device with ``rank_device``. ``"cpu"``: gloo. A failure in any rank raises here (with
    that rank's traceback).
    """
    placement = rank_placement(world_size, device_type)
    start_method = _start_method(device_type)
    ctx = mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    # The parent serves the rendezvous store on a port the OS picks and holds it until the ranks
    # end: no window in which another process can take the port (a free-port probe has one).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.start_processes(
        _worker,
        args=(fn, world_size, store.port, queue, placement, dict(os.environ), args),
        nprocs=world_size,
        start_method=start_method,
        join=False,
    )
    results: Dict[int, Any] = {}
    done = False
    try:
        while not done:  # drain while joining: a rank's put blocks once its result outgrows the pipe's buffer
            done = context.join(timeout=0.2)
            while not queue.empty():
                rank, value = queue.get()
                results[rank] = value
    finally:
        # Interrupted (a test's time limit, ^C): hung ranks must not outlive the call, or the caller's exit
        # would wait for them forever.
        for proc in context.processes if not done else []:
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world_size)]


def rank_device(rank: int, device_type: str = "cuda") -> torch.device:
    """This rank's device under ``run_distributed``'s placement (call it inside ``fn``)."""
    return rank_placement(dist.get_world_size(), device_type).device(rank)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
