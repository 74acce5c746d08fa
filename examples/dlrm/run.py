"""DLRM on synthetic Criteo-like data, sharded by DistributedModelParallel with the PGAS sharder.

    torchrun --nproc_per_node=2 -m examples.dlrm.run --sharding pgas --batch-size 512 --steps 50 --validate

--sharding pgas   every table pgas_row_wise; beyond one node pgas_table_row_wise (table i on node i % nodes).
--sharding nccl   every table stock row_wise (NCCL, or gloo on CPU); beyond one node table_row_wise.
--sharding auto   per table, whichever of the two the planner (PgasEnumerator and
                  its calibrated cost model, run by collective_plan) prices lower
                  (forward, or forward + backward with --train).

Inference by default; --train trains (fused SGD for the tables, SGD for the dense
layers), in a plain loop or, with --pipeline sparse_dist, through TorchRec's
TrainPipelineSparseDist (the next batch's input dist overlaps this one's step), or,
with --pipeline replay and every table PGAS, through ReplayTrainPipeline (each step
replayed as one CUDA graph; its stock twin under --validate runs sparse_dist);
--owner-backward picks who applies an owner's gradients (pgas, fbgemm, or auto:
the faster of the two, timed on the first 14 steps).
--max-ids-per-bag N makes the features multi-hot (1 to N ids a bag).
Prints samples/s (global) and AUC / log loss over the run. --validate shards the
same model the other way: for inference it compares the first steps' predictions;
with --train it trains that twin on the same batches (and the same loop) and
compares the loss after every step (within 1e-4 relative) and the final AUC
(within 1e-3), and prints both samples/s and both median step times (--report
keeps every timed step's host time of each side: a host-bound step moves between
runs, and a median is not moved by a few slow steps). --profile writes torch.profiler's
op table and trace of a few timed steps; --host-profile rank 0's Python functions
over every timed step, in us a step (where a host-bound step's time goes).
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.optim  # noqa: F401  before init_process_group: see torchrec_pgas.shutdown
from torch import nn
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from examples.dlrm.data import SyntheticCriteo, table_rows
from torchrec_pgas import (
    AUTO_TRIAL_BACKWARDS,
    OwnerBackward,
    PgasConfig,
    PgasEmbeddingBagCollectionSharder,
    PgasTrainingConfig,
    ReplayTrainPipeline,
    check_errors,
    owner_backward_trials,
    pooling_capacity_from_constraints,
    profiling,
    shutdown,
)
from torchrec_pgas.placement import RankPlacement, best_placement, rank_placement
from torchrec_pgas.planner import (
    PgasDecisionStats,
    PgasEnumerator,
    pgas_row_wise,
    pgas_table_row_wise,
    pgas_table_wise,
    with_compute_kernel,
)
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_ROW_WISE, PGAS_TABLE_WISE
from torchrec_pgas.testing import fill_embeddings_

EBC_PATH = "model.sparse_arch.embedding_bag_collection"
StepOutput = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # DLRMTrain's detached (loss, logits, labels)
PROFILED_STEPS = 5  # --profile


def build_model(dim: int, max_rows: int, device: torch.device, seed: int) -> DLRMTrain:
    """``DLRM`` in ``DLRMTrain``: forward(batch) -> (loss, output), what TorchRec's train pipelines call."""
    torch.manual_seed(seed)  # same dense weights on every rank and for both shardings
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{name}", num_embeddings=rows, embedding_dim=dim, feature_names=[name])
            for name, rows in zip(DEFAULT_CAT_NAMES, table_rows(max_rows))
        ],
        device=torch.device("meta"),
    )
    return DLRMTrain(DLRM(ebc, dense_in_features=INT_FEATURE_COUNT, dense_arch_layer_sizes=[128, dim],
                          over_arch_layer_sizes=[128, 64, 1], dense_device=device))


def table_constraints(model: DLRMTrain, nodes: int = 1, ids_per_bag: int = 1) -> Dict[str, ParameterConstraints]:
    """What the plan knows of each table: row-wise (stock or PGAS; beyond one node table-row-wise too), fused,
    and its pooling factor, the mean ids a bag: 1 for one-hot features, (1 + N) / 2 for 1 to N ids a bag, which
    both the planner's estimates and the PGAS buffers' capacity use."""
    types = [ShardingType.ROW_WISE.value, PGAS_ROW_WISE]
    if nodes > 1:
        types += [ShardingType.TABLE_ROW_WISE.value, PGAS_TABLE_ROW_WISE]
    mean = (1 + ids_per_bag) / 2
    return {c.name: ParameterConstraints(sharding_types=types, compute_kernels=["fused"], pooling_factors=[mean])
            for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()}


def planned_types(model: DLRMTrain, batch: int, train: bool, ids_per_bag: int = 1) -> Dict[str, str]:
    """--sharding auto: the planner's choice per table between stock row_wise and pgas_row_wise.

    Planned by ``collective_plan`` (rank 0 plans, every rank gets its plan) on a CUDA topology, which is a
    dry run that needs no GPU: TorchRec enumerates no row-wise options for a CPU topology.
    """
    world = dist.get_world_size()
    host_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    constraints = table_constraints(model, world // host_ranks, ids_per_bag)
    topology = Topology(world_size=world, compute_device="cuda",
                        local_world_size=rank_placement(world).local_size(host_ranks))
    stats = PgasDecisionStats()
    enumerator = PgasEnumerator(topology, batch, constraints=constraints, training=train,
                                nvlink_domain_size=host_ranks)  # ranks sharing a GPU: local_size 1
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch, constraints=constraints, stats=[stats], enumerator=enumerator,
        callbacks=[enumerator.name_pgas_table_row_wise],  # beyond one node: its pgas_table_row_wise choices
        # TorchRec's default reservation warns from 1.9 on (FutureWarning); this is its recommended one.
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15))
    plan = planner.collective_plan(model, [PgasEmbeddingBagCollectionSharder()], dist.group.WORLD)
    if dist.get_rank() == 0:
        print("\n".join(["planner (PgasEnumerator, shipped profile):"] + stats.lines), flush=True)
    return {table: ps.sharding_type for table, ps in plan.plan[EBC_PATH].items()}  # type: ignore[union-attr]


def shard(model: DLRMTrain, sharding: str, device: torch.device, batch: int,
          training: Optional[PgasTrainingConfig], lr: float,
          types: Optional[Dict[str, str]] = None, ids_per_bag: int = 1) -> DistributedModelParallel:
    """``sharding`` "pgas" or "nccl" for every table, or "auto" with the planner's per-table ``types``;
    ``training``: how PGAS tables train (None: inference only); ``ids_per_bag``: the data's most ids a bag."""
    world = dist.get_world_size()
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # TorchRec's nodes (--node-size sets it)
    ebc = model.model.sparse_arch.embedding_bag_collection
    if training is not None:
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": lr})
    names = [c.name for c in ebc.embedding_bag_configs()]
    generators = {t: plan_generator(types[t] if types else sharding, i, world, world // node_size)
                  for i, t in enumerate(names)}
    sharder: EmbeddingBagCollectionSharder = EmbeddingBagCollectionSharder()
    if sharding == "pgas" or (types and any(t.startswith("pgas") for t in types.values())):
        # sized for the largest bags: a step's batch may average more ids a bag than the data's mean
        constraints = table_constraints(model, ids_per_bag=ids_per_bag)
        capacity = pooling_capacity_from_constraints(constraints, headroom=2 * ids_per_bag / (1 + ids_per_bag))
        config = PgasConfig(max_local_batch_size=batch, training=training, pooling_capacity=capacity)
        sharder = PgasEmbeddingBagCollectionSharder(pgas_config=config)  # inference: no backward buffers
    plan = construct_module_sharding_plan(ebc, generators, sharder=sharder, local_size=node_size, world_size=world,
                                          device_type=device.type)
    # every shard on its rank's device (ranks may share a GPU), the plan's nodes kept
    placed = rank_placement(world, device.type).place_shards(ShardingPlan({EBC_PATH: plan}))
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                   plan=placed, sharders=[sharder])
    fill_embeddings_(dmp)  # the same tables under either sharding
    return dmp


def plan_generator(choice: str, table: int, world: int, nodes: int) -> ParameterShardingGenerator:
    """Table ``table``'s plan: "pgas" / "nccl" (row-wise in one node; beyond it table-row-wise, the table on node
    ``table % nodes``), or a planned type (row-wise or PGAS row-wise; PGAS table-wise, the table on rank ``table %
    world``; beyond one node the planner's table-row-wise choice, placed on node ``table % nodes`` too)."""
    fused = EmbeddingComputeKernel.FUSED.value
    if choice == PGAS_TABLE_WISE:
        return pgas_table_wise(table % world)
    if nodes > 1 and choice in ("pgas", "nccl", PGAS_TABLE_ROW_WISE, "table_row_wise"):
        return (pgas_table_row_wise(table % nodes) if choice in ("pgas", PGAS_TABLE_ROW_WISE)
                else with_compute_kernel(table_row_wise(host_index=table % nodes), fused))
    return pgas_row_wise() if choice in ("pgas", PGAS_ROW_WISE) else row_wise(compute_kernel=fused)


@dataclasses.dataclass
class RunResult:
    samples_per_s: float  # global, over the steps after the warmup
    # this rank's host time of each step after the warmup, start to start (the last one to the device's end):
    # where a step waits on the device (stock's input dist, PGAS's eager backward) the host's pace is the step's;
    # a median over them is not moved by a few slow steps
    step_ms: List[float]
    preds: List[torch.Tensor]  # this rank's, per step
    labels: List[torch.Tensor]
    losses: List[float]  # the global mean log loss of each step (before its update)
    off_graph: Optional[int] = None  # --pipeline replay: this rank's batches trained off the graph's step
    # --owner-backward auto: each PGAS sharding's choice on this rank (None: still timing), and the medians it compared
    auto_chose: List[Optional[str]] = dataclasses.field(default_factory=list)
    auto_trial_ms: List[Dict[str, float]] = dataclasses.field(default_factory=list)


def stepper(dmp: nn.Module, data: SyntheticCriteo, device: torch.device, dense_opt: Optional[torch.optim.Optimizer],
            pipeline: str) -> Tuple[Callable[[], StepOutput], Optional[ReplayTrainPipeline]]:
    """One step per call (with ``dense_opt``, a training step): the plain loop, ``TrainPipelineSparseDist``
    (it calls the optimizer itself and runs the next batch's input dist inside this step) or
    ``ReplayTrainPipeline`` (returned too: it counts the batches its graph could not take)."""
    # Made before the timed steps: the synthetic generator's host time (26 Zipf draws a batch, 5.7 ms on a
    # 2-core CPU host) would otherwise set the pace of both sides. Host memory: ~2 MB a step at batch 4096, pinned
    # on GPU hosts as a DataLoader(pin_memory=True) pins it, so that the pipelines' copies overlap their steps.
    batches = iter([b.pin_memory() if device.type == "cuda" else b for b in data])
    if pipeline in ("sparse_dist", "replay"):
        assert dense_opt is not None, "the pipeline trains"
        pipe = (TrainPipelineSparseDist(dmp, dense_opt, device) if pipeline == "sparse_dist"
                else ReplayTrainPipeline(dmp, dense_opt, device))
        return (lambda: pipe.progress(batches)), pipe if isinstance(pipe, ReplayTrainPipeline) else None

    def step() -> StepOutput:
        with torch.set_grad_enabled(dense_opt is not None):
            loss, output = dmp(next(batches).to(device))
        if dense_opt is not None:
            loss.backward()  # the tables' fused optimizer runs inside it
            dense_opt.step()
            dense_opt.zero_grad()
        return output

    return step, None


def step_profiler(path: Optional[str], warmup: int, device: torch.device) -> Optional[torch.profiler.profile]:
    """--profile: torch.profiler over the first PROFILED_STEPS timed steps (their samples/s carries its cost);
    rank 0 writes their ops and kernels by self device time (CPU time on CPUs) to ``path`` and their timeline
    (where the device waits on the host) next to it, a gzipped Chrome trace."""
    if path is None:
        return None
    on_gpu = device.type == "cuda"

    def write(prof: torch.profiler.profile) -> None:
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{PROFILED_STEPS} steps\n" + prof.key_averages().table(
                    sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total", row_limit=60,
                    max_name_column_width=100))
            prof.export_chrome_trace(os.path.splitext(path)[0] + ".trace.json.gz")

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    schedule = torch.profiler.schedule(wait=max(warmup - 1, 0), warmup=min(warmup, 1), active=PROFILED_STEPS)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write)


def write_host_profile(host: profiling.HostProfile, path: str, step_ms: List[float]) -> None:
    """--host-profile: rank 0's Python functions over the timed steps, in us a step (a host-bound step's time
    is the host's: this says where it goes)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        median = statistics.median(step_ms) if step_ms else float("nan")  # --warmup >= --steps: none timed
        f.write(host.table(f"{host.calls} timed steps under cProfile, median step {median:.3f} ms (cProfile's cost "
                           "included)"))


def run(dmp: nn.Module, data: SyntheticCriteo, device: torch.device, train: bool, lr: float,
        warmup: int, pipeline: str = "plain", profile: Optional[str] = None,
        host_profile: Optional[str] = None) -> RunResult:
    dense_opt = None
    if train:
        dense = [p for p in dmp.parameters() if not hasattr(p, "_in_backward_optimizers")]
        dense_opt = torch.optim.SGD(dense, lr=lr)
    step_fn, replay = stepper(dmp, data, device, dense_opt, pipeline)
    preds, labels, losses = [], [], []
    marks: List[float] = []  # the host clock at each timed step's start, then at the end
    profiler = step_profiler(profile, warmup, device)
    host = profiling.HostProfile()
    if profiler is not None:
        profiler.start()
    for step in range(len(data)):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
        if step >= warmup:
            marks.append(time.perf_counter())
        with host if host_profile is not None and step >= warmup else contextlib.nullcontext():
            loss, logits, step_labels = step_fn()
        losses.append(loss)
        preds.append(torch.sigmoid(logits))
        labels.append(step_labels)
        if profiler is not None:
            profiler.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    marks.append(time.perf_counter())
    step_ms = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    if profiler is not None:
        profiler.stop()
    if host_profile is not None and dist.get_rank() == 0:
        write_host_profile(host, host_profile, step_ms)
    world = dist.get_world_size()
    global_losses = torch.stack(losses).float()
    dist.all_reduce(global_losses)  # after the timed steps: no sync inside them
    trials = [t.report() for t in owner_backward_trials(dmp)]
    return RunResult(world * data.batch_size * len(step_ms) / max(1e-3 * sum(step_ms), 1e-9), step_ms, preds, labels,
                     (global_losses / world).tolist(), None if replay is None else replay.batches_off_graph,
                     [chosen for chosen, _ in trials], [medians for _, medians in trials])


def metrics(preds: List[torch.Tensor], labels: List[torch.Tensor]) -> Dict[str, float]:
    """AUC and log loss over every rank's predictions."""
    p, y = torch.cat(preds).float(), torch.cat(labels).float()
    world = dist.get_world_size()
    all_p, all_y = [torch.empty_like(p) for _ in range(world)], [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(all_p, p)
    dist.all_gather(all_y, y)
    p, y = torch.cat(all_p).cpu(), torch.cat(all_y).cpu()
    auc = BinaryAUROC()(p, y.long())
    logloss = nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y)
    return {"auc": float(auc), "logloss": float(logloss)}


def profile_path(args: argparse.Namespace, sharding: str) -> Optional[str]:
    """Where --profile writes one side's table."""
    return None if args.profile is None else os.path.join(args.profile, f"{sharding}_b{args.batch_size}.txt")


def host_profile_path(args: argparse.Namespace, sharding: str) -> Optional[str]:
    """Where --host-profile writes one side's table."""
    return (None if args.host_profile is None
            else os.path.join(args.host_profile, f"{sharding}_b{args.batch_size}.host.txt"))


def twin_sharding(sharding: str) -> str:
    """--validate's other side: stock for pgas and auto, PGAS for nccl."""
    return "pgas" if sharding == "nccl" else "nccl"


def twin_pipeline(pipeline: str) -> str:
    """--validate's other side's loop: the same, but stock cannot replay: it runs TorchRec's sparse_dist."""
    return "sparse_dist" if pipeline == "replay" else pipeline


def validate_training(ours: RunResult, our_metrics: Dict[str, float], twin: nn.Module, data: SyntheticCriteo,
                      device: torch.device, args: argparse.Namespace) -> bool:
    """Train the twin on the same batches through the same loop: the loss of every step within 1e-4 relative,
    the AUC within 1e-3; both samples/s side by side (the report's keys name the stock side as such)."""
    theirs = run(twin, data, device, True, args.lr, args.warmup, twin_pipeline(args.pipeline),
                 profile_path(args, twin_sharding(args.sharding)), host_profile_path(args, twin_sharding(args.sharding)))
    their_metrics = metrics(theirs.preds, theirs.labels)
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours.losses, theirs.losses)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    auc_diff = abs(our_metrics["auc"] - their_metrics["auc"])
    ok = rel[worst] <= 1e-4 and auc_diff <= 1e-3
    other = twin_sharding(args.sharding)
    sides = [(ours, our_metrics), (theirs, their_metrics)]
    (pgas, pgas_m), (stock, stock_m) = sides[::-1] if other == "pgas" else sides
    if dist.get_rank() == 0 and args.report:
        with open(args.report, "w") as f:
            json.dump({"args": vars(args), "world": dist.get_world_size(), "pass": ok, "max_rel_loss_diff": rel[worst],
                       "auc_diff": auc_diff, "pipeline": args.pipeline, "samples_per_s": pgas.samples_per_s,
                       "stock_samples_per_s": stock.samples_per_s, "step_ms": pgas.step_ms,
                       "stock_step_ms": stock.step_ms, "losses": pgas.losses,
                       "stock_losses": stock.losses, "metrics": pgas_m, "stock_metrics": stock_m,
                       "batches_off_graph": pgas.off_graph, "owner_backward_chosen": pgas.auto_chose,
                       "owner_backward_trial_ms": pgas.auto_trial_ms}, f, indent=1)
    if dist.get_rank() == 0:
        ours_ms, theirs_ms = (statistics.median(r.step_ms or [float("nan")]) for r in (ours, theirs))
        print(f"samples/s ({args.pipeline} loop): {args.sharding} {ours.samples_per_s:,.0f}, {other} twin "
              f"{theirs.samples_per_s:,.0f}, ratio {ours.samples_per_s / theirs.samples_per_s:.2f}x; median step "
              f"{ours_ms:.2f} against {theirs_ms:.2f} ms ({theirs_ms / ours_ms:.2f}x)", flush=True)
        if pgas.auto_chose:
            print(f"owner_backward auto, rank 0: chose {pgas.auto_chose} (median applies, ms: {pgas.auto_trial_ms})",
                  flush=True)
        print(f"validate: {len(rel)} training steps, loss per step max rel diff {rel[worst]:.2e} (step {worst}: "
              f"{ours.losses[worst]:.6f} vs {other} {theirs.losses[worst]:.6f}), final loss {ours.losses[-1]:.6f} vs "
              f"{theirs.losses[-1]:.6f}, AUC {our_metrics['auc']:.4f} vs {their_metrics['auc']:.4f} "
              f"-> {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def validate_inference(dmp: nn.Module, twin: nn.Module, device: torch.device, args: argparse.Namespace) -> bool:
    """The first steps' predictions of both shardings within 1e-5."""
    rank = dist.get_rank()
    first = SyntheticCriteo(args.batch_size, args.validate_steps, args.max_rows, seed=1000 * args.seed + rank,
                            max_ids_per_bag=args.max_ids_per_bag)
    ours, theirs = run(dmp, first, device, False, 0.0, 0), run(twin, first, device, False, 0.0, 0)
    diff = torch.tensor(max(float((a - b).abs().max()) for a, b in zip(ours.preds, theirs.preds)), device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    ok = float(diff) <= 1e-5
    if rank == 0:
        print(f"validate: first {args.validate_steps} steps, max |pgas - stock| prediction = "
              f"{float(diff):.2e} -> {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def job(args: argparse.Namespace, rank: int, placement: RankPlacement, device: torch.device) -> bool:
    """Build, shard and run the model, and with --validate its twin; False when validation fails. The models
    live in this frame only, so that the process group can go once it returns."""
    on_gpu = placement.device_type == "cuda"
    model = build_model(args.embedding_dim, args.max_rows, device, args.seed)
    reference = copy.deepcopy(model) if args.validate else None
    types = planned_types(model, args.batch_size, args.train, args.max_ids_per_bag) if args.sharding == "auto" else None
    training = PgasTrainingConfig(owner_backward=args.owner_backward) if args.train else None
    dmp = shard(model, args.sharding, device, args.batch_size, training, args.lr, types, args.max_ids_per_bag)
    data = SyntheticCriteo(args.batch_size, args.steps, args.max_rows, seed=1000 * args.seed + rank,
                           max_ids_per_bag=args.max_ids_per_bag)

    result = run(dmp, data, device, args.train, args.lr, args.warmup, args.pipeline,
                 profile_path(args, args.sharding), host_profile_path(args, args.sharding))
    check_errors(dmp)
    m = metrics(result.preds, result.labels)
    mode = "train" if args.train else "inference"
    backend = ("nvshmem" if on_gpu else "shm") if args.sharding == "pgas" else placement.backend
    if types is not None:
        pgas = sum(t == PGAS_ROW_WISE for t in types.values())
        backend = f"{pgas} tables pgas_row_wise, {len(types) - pgas} row_wise"
    node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    if types is None and dist.get_world_size() > node_size:
        backend += f", table-row-wise over {dist.get_world_size() // node_size} nodes x {node_size}"
    if rank == 0:
        print(f"DLRM {mode}, sharding={args.sharding} ({backend}), world {dist.get_world_size()}, "
              f"batch {args.batch_size}/rank, {args.steps} steps: {result.samples_per_s:,.0f} samples/s, "
              f"AUC {m['auc']:.4f}, log loss {m['logloss']:.4f}"
              + ("" if result.off_graph is None else f", {result.off_graph} batches off the graph (rank 0)"),
              flush=True)
    if reference is not None:
        twin = shard(reference, twin_sharding(args.sharding), device, args.batch_size, training, args.lr,
                     ids_per_bag=args.max_ids_per_bag)
        return (validate_training(result, m, twin, data, device, args) if args.train
                else validate_inference(dmp, twin, device, args))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharding", choices=["pgas", "nccl", "auto"], default="pgas")
    parser.add_argument("--batch-size", type=int, default=512, help="local batch size per rank")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of samples/s")
    parser.add_argument("--embedding-dim", type=int, default=64)
    parser.add_argument("--max-rows", type=int, default=100_000, help="cap on every table's rows")
    parser.add_argument("--max-ids-per-bag", type=int, default=1,
                        help="1: one-hot features (Criteo's); N > 1: multi-hot, 1 to N ids a bag, uniformly")
    parser.add_argument("--train", action="store_true", help="train (embeddings and dense layers)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--owner-backward", choices=[o.value for o in OwnerBackward if o != OwnerBackward.REFERENCE],
                        default=OwnerBackward.PGAS.value,
                        help="with --train: PgasTrainingConfig.owner_backward (auto: its trial takes a sharding's "
                        f"first {AUTO_TRIAL_BACKWARDS} steps; raise --warmup to keep it out of samples/s)")
    parser.add_argument("--pipeline", choices=["plain", "sparse_dist", "replay"], default="plain",
                        help="with --train: the training loop (sparse_dist: TorchRec's TrainPipelineSparseDist; "
                        "replay: torchrec_pgas.ReplayTrainPipeline, --sharding pgas)")
    parser.add_argument("--validate", action="store_true",
                        help="compare with the other sharding of the same model (see above)")
    parser.add_argument("--validate-steps", type=int, default=3, help="inference: steps whose predictions compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--node-size", type=int, help="ranks per node (default LOCAL_WORLD_SIZE); smaller declares one "
                        "host's ranks as several nodes, e.g. 4 processes on CPUs as 2 x 2")
    parser.add_argument("--report", help="with --train --validate: write both loss trajectories and samples/s "
                        "here (JSON)")
    parser.add_argument("--profile", help=f"a directory: torch.profiler's table and trace of the first {PROFILED_STEPS} "
                        "timed steps of each side (their samples/s carries the profiler's cost)")
    parser.add_argument("--host-profile", help="a directory: rank 0's Python functions (cProfile) over each side's "
                        "timed steps, in us a step (their samples/s carries cProfile's cost)")
    args = parser.parse_args()
    if args.pipeline != "plain" and not args.train:
        parser.error(f"--pipeline {args.pipeline} trains: add --train")
    if args.pipeline == "replay" and (args.sharding != "pgas" or args.owner_backward != "pgas"):
        parser.error("--pipeline replay replays PGAS steps: --sharding pgas, --owner-backward pgas")

    rank = int(os.environ["RANK"])
    placement = best_placement(int(os.environ["LOCAL_WORLD_SIZE"]))
    device = placement.device(int(os.environ["LOCAL_RANK"]))
    if args.node_size:  # TorchRec's node groups and plans read it; the placement above keeps the host's
        os.environ["LOCAL_WORLD_SIZE"] = str(args.node_size)
    if placement.device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(placement.backend)
    if placement.shared_gpu and rank == 0:
        print(f"ranks share {device} over gloo: a test of multi-rank behaviour, not a performance setup", flush=True)
    ok = job(args, rank, placement, device)
    shutdown()  # job's models are garbage now: the process group goes here, not in interpreter teardown
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
