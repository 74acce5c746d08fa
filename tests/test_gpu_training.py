"""Training on GPUs (the nvshmem backend's kernels and FBGEMM's CUDA TBE) against stock TorchRec.

The CPU twins are test_training.py, test_training_errors.py; here the optimizers FBGEMM trains only on
GPUs (Adam, LAMB), TorchRec's TrainPipelineSemiSync itself, tables smaller than W, and the device-side
error path: a bad id is recorded by the kernels, so the step's backward (not its forward) raises, on every
rank, and changes nothing. World size ``PGAS_TEST_WORLD`` (ranks share a GPU when they outnumber them).
``PGAS_TEST_REPORT=<dir>``: each case's worst |pgas - stock| goes to ``<dir>/training_diffs.json``.
"""

import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from test_training import CONFIG, Case, _model, _train_cases, _types
from test_training_errors import (
    _bad_batch,
    _failed_backward,
    _misuse,
    _refusals,
    _sides,
    _stall,
    check_failed_backward,
    check_misuse,
    check_refusals,
    check_stall,
)
from torchrec_pgas import (CapturedTrainStep, PgasCapacityError, PgasShardedEmbeddingBagCollection, StaticKJT,
                           check_errors, copy_kjt_, pgas_steps)
from torchrec_pgas.types import PgasError
from torchrec_pgas.testing import (
    LossModel,
    TrainBatch,
    local_state,
    random_kjt,
    rank_device,
    run_distributed,
    seeded,
    shard,
    state_difference,
    stock_twin,
    with_training,
)

pytestmark = pytest.mark.gpu
WORLD = int(os.environ.get("PGAS_TEST_WORLD", "2"))
# The owner backwards a refused step must apply nothing through: FBGEMM's; the owner update at capacity, its eager
# backward replayed as a graph or launched; the owner update at the count (launched before the flags are read too)
OWNER_PATHS = [("fbgemm", False, None), ("pgas", True, None), ("pgas", False, None), ("pgas", False, 0)]
PEERS = max(WORLD, 2)
# FBGEMM's CUDA backward sums a row's gradients in the same order for both (the ids arrive in stock's order),
# but its kernels are not promised deterministic: 1e-5, and the report shows the differences measured.
GPU_TOL = 1e-5

CASES = [
    Case("pgas_row_wise"),
    Case("pgas_table_wise", pooling="mixed"),
    Case("mixed", EmbOptimType.EXACT_SGD, pooling="mixed", eval_every=3, eval_grad=True),
    Case("pgas_row_wise", EmbOptimType.ADAM, weight_decay=0.01, eval_every=4),
    Case("pgas_table_wise", EmbOptimType.LAMB),
    Case("pgas_row_wise", EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.01, data_type=DataType.FP16,
         output_dtype=SparseType.FP16),
    Case("pgas_table_wise", output_dtype=SparseType.BF16),
    Case("pgas_row_wise", loop="sparse_dist"),
    Case("pgas_row_wise", EmbOptimType.ADAM, loop="semi_sync"),
    Case("pgas_table_wise", loop="semi_sync"),
    # the owner backward (PgasConfig.owner_backward="pgas") in place of FBGEMM's
    Case("pgas_row_wise", owner_backward="pgas"),
    Case("pgas_table_wise", EmbOptimType.EXACT_SGD, pooling="mixed", owner_backward="pgas"),
    Case("pgas_row_wise", EmbOptimType.ADAM, owner_backward="pgas", loop="sparse_dist"),
    Case("pgas_row_wise", EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.01, data_type=DataType.FP16,
         output_dtype=SparseType.FP16, owner_backward="pgas"),
    # ... with the eager step reading the kept ids' count (the path past PgasConfig.max_padded_eager_ids)
    Case("pgas_row_wise", EmbOptimType.ADAM, owner_backward="pgas", max_padded_eager_ids=0),
    Case("pgas_table_wise", pooling="mixed", owner_backward="pgas", max_padded_eager_ids=0),
    # owner_backward="auto": the two backwards alternate through its trial (no eager backward graph until it chose)
    Case("pgas_row_wise", EmbOptimType.ADAM, owner_backward="auto"),
    Case("pgas_table_wise", pooling="mixed", owner_backward="auto", loop="sparse_dist"),
]


def _report(name: str, results: List[List[Tuple[str, float, float]]]) -> None:
    folder = os.environ.get("PGAS_TEST_REPORT")
    if not folder:
        return
    path = os.path.join(folder, "training_diffs.json")
    report: Dict[str, Any] = json.load(open(path)) if os.path.exists(path) else {}
    report[name] = [[case, worst] for case, worst, _ in results[0]]
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def test_training_matches_stock_on_gpus() -> None:
    """Every case above: every local weight shard and optimizer state within 1e-5 of stock's after every
    step (the owner backward's fp16 cases: one fp16 ulp), at PGAS_TEST_WORLD ranks (1: the whole path on one rank)."""
    results = run_distributed(_train_cases, WORLD, CASES, "cuda")
    _report(f"world {WORLD}", results)
    for rank_results in results:
        for case, worst, tol in rank_results:
            assert worst <= max(GPU_TOL, tol), f"{case}: |pgas - stock| {worst}"


@pytest.mark.peers
@pytest.mark.parametrize("owner_backward,graphs,padded", OWNER_PATHS)
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
@pytest.mark.parametrize("what", ["id", "wid", "capacity"])
def test_a_bad_batch_changes_nothing_on_gpus(kind: str, what: str, owner_backward: str, graphs: bool,
                                            padded: Optional[int]) -> None:
    """A bad id is recorded by its rank's kernels, which give the training step up on every owner (``id``: in
    the EBC whose backward runs second, so the first one's backward must give the step up too; ``wid``: in the
    one that runs first); a
    batch over the capacity gives the step up on the host (its forward returns zeros and runs the stages
    empty, so every sharding of the model stays in step). Either way the step's backward raises on both ranks
    (the bad rank its error, the peer the abort), no weight moves, and the next steps train on both. With
    ``owner_backward="pgas"`` the eager update is launched before the host reads the sources' flags and must
    apply nothing of the refused step (its reference: a twin of the same config that skips the step), whether
    the backward replays graphs (``graphs``: eager_backward_graphs) or launches its kernels, at capacity or at
    the count (``padded``: max_padded_eager_ids 0)."""
    results = run_distributed(_bad_batch, 2, kind, what, "cuda", owner_backward, graphs, padded)
    r0, r1 = results
    expected = "exceeds PgasConfig.max_local_batch_size=16" if what == "capacity" else "has id 37 outside [0, 37)"
    assert [e[:2] for e in r1["errors"]] == [(2, "PgasCapacityError" if what == "capacity" else "PgasInputError")], r1
    assert expected in r1["errors"][0][2]
    assert [e[:2] for e in r0["errors"]] == [(2, "PgasPeerAbortError")], r0
    assert "rank 1 " in r0["errors"][0][2], r0  # the rank that failed, never the peer itself
    assert r0["equal"] and r1["equal"] and r0["trained"] and r1["trained"], (r0, r1)


@pytest.mark.peers
def test_misuse_raises_clearly_on_gpus() -> None:
    check_misuse(run_distributed(_misuse, 2, "cuda"), "from rank 1")


@pytest.mark.peers
def test_a_refused_step_in_a_mixed_plan_on_gpus() -> None:
    """The CPU twin's refusal matrix at W = 2 (three mixed plans x a bad id in a row-wise or a table-wise
    feature, a batch over capacity; a dropped backward): the device path gives the step up on every rank, and
    the next steps train as stock does without it."""
    check_refusals(run_distributed(_refusals, 2, "cuda"))


@pytest.mark.peers
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
def test_a_stalled_rank_fails_the_step_once_on_gpus(kind: str) -> None:
    """W = 4 (ranks may share a GPU): the step's kernels wait for the stalled rank against one deadline, so
    its backward raises wait_timeout_s after the step's first wait, not once per wait (index data, pooled
    outputs, gradients: 3x before)."""
    check_stall(run_distributed(_stall, 4, kind, "cuda"), "rank 3")


@pytest.mark.peers
@pytest.mark.parametrize("owner_backward,graphs,padded", OWNER_PATHS)
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
def test_a_failed_backward_holds_no_slot_on_gpus(kind: str, owner_backward: str, graphs: bool,
                                                 padded: Optional[int]) -> None:
    """The CPU twin's case. On GPUs a failed backward's exception alone (a reference cycle through the frame
    that raised it) keeps the step's graph to a garbage collection: test_a_bad_batch_changes_nothing_on_gpus
    failed so, three steps after the bad one. Through the owner update, the timed-out exchange's flag must
    stop the update launched before the host read it."""
    check_failed_backward(run_distributed(_failed_backward, 2, kind, "cuda", owner_backward, graphs, padded))


def _checks_pending_at_the_end(rank: int, world: int, graphs: bool) -> Tuple[List[List[bool]], List[int]]:
    """Four steps of the two-EBC model, row-wise, through the owner update at capacity: per step, whether each
    sharding's check of it still waited, its flags unread, once autograd had run every node of the backward (a
    final callback queued before the first node ran runs before theirs); each sharding's backward replays."""
    pgas, _, batches = _sides(rank, world, "pgas_row_wise", "cuda", owner_backward="pgas", graphs=graphs)
    steps = list(pgas_steps(pgas))
    seen: List[List[bool]] = []

    def unread(s: Any) -> bool:
        deferred = s.group.deferred
        return deferred.pending(s, s.looked_up) and deferred.known(s, s.looked_up) is None

    def probe(grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: seen.append([unread(s) for s in steps]))
        return grad

    for batch in batches[:4]:
        loss, _ = pgas(batch)
        loss.register_hook(probe)
        loss.backward()
        pgas.fused_optimizer.step()
    assert not any(s.group.deferred.pending(s, s.looked_up) for s in steps)  # settled by the end of backward()
    return seen, [s.backward_graph_stats.replays for s in steps]


@pytest.mark.peers
@pytest.mark.parametrize("graphs", [True, False])
def test_the_eager_backward_reads_the_flags_after_the_rest_of_the_backward(graphs: bool) -> None:
    """The sources' flags of an eager backward at capacity (replayed or launched) are read at the end of the
    autograd backward, not in its node, where the host would wait for the GPU before launching the rest."""
    for seen, replays in run_distributed(_checks_pending_at_the_end, 2, graphs):
        assert seen == [[True, True]] * 4, seen
        assert all(r > 0 for r in replays) if graphs else replays == [0, 0], replays


def _eager_backward_graphs(rank: int, world: int, kind: str) -> Tuple[float, List[Tuple[Tuple[int, ...], bool]]]:
    """One model sharded twice with owner_backward="pgas", eager backwards replayed as CUDA graphs and not, 10
    steps with local batches of 6 (steps 0, 3, 6, 9) and 8: (the worst |graphs - none| over every weight and
    optimizer state after every step; per sharding of the graphed side: its ``backward_graph_stats``, whether
    this rank holds features of it)."""
    device = rank_device(rank, "cuda")
    case = Case(kind, EmbOptimType.ADAM, owner_backward="pgas")
    model = _model(case, seed=4, min_rows=1)
    fused = {"optimizer": case.optimizer, "learning_rate": 0.05, "eps": 1e-3, "stochastic_rounding": False}
    wrapped = LossModel(model)
    sides = [shard(wrapped, _types(case, model, world), dist.group.WORLD, device,
                   with_training(CONFIG, owner_backward="pgas", eager_backward_graphs=graphs), fused,
                   path="model.") for graphs in (True, False)]
    gen = seeded(17 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    worst = 0.0
    for i in range(10):
        batch = 6 if i % 3 == 0 else 8
        data = TrainBatch(random_kjt(t, batch, gen, 6), random_kjt(w, batch, gen, 6, weighted=True)).to(device)
        for side in sides:
            loss, _ = side(data)
            loss.backward()
        worst = max(worst, *_worst_diff(*sides).values())
    assert all(step.backward_graph_stats == (0, 0, 0) for step in pgas_steps(sides[1]))
    return worst, [(tuple(step.backward_graph_stats), step.lookup_features[1] > step.lookup_features[0])
                   for step in pgas_steps(sides[0])]


@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
def test_eager_backwards_replayed_as_graphs_train_as_launched_ones(kind: str) -> None:
    """PgasConfig.eager_backward_graphs: bit for bit the launched backward's weights and states after every step.
    Every sharding a rank holds features of replays from its second step on (the first builds what a capture
    reads): 9 replays of 3 graphs, each captured once, one per (batch, buffer slot) its steps met (epochs 1, 4,
    7, 10 at batch 6: slot 1; the others at batch 8: slots 2 and 0), the first step's key never replayed; no
    graph elsewhere."""
    for worst, shardings in run_distributed(_eager_backward_graphs, WORLD, kind, device_type="cuda"):
        assert worst == 0.0
        for stats, holds in shardings:
            assert stats == ((3, 3, 9) if holds else (0, 0, 0)), shardings


# ---- the training step captured in one CUDA graph ------------------------------------------------------


def _new_ids(kjt: KeyedJaggedTensor, rows: Dict[str, int], gen: torch.Generator) -> KeyedJaggedTensor:
    """``kjt``'s bags (keys, lengths) with fresh ids and weights: a captured step reads fixed shapes."""
    values = torch.cat([torch.randint(0, rows[k], (n,), generator=gen)
                        for k, n in zip(kjt.keys(), kjt.length_per_key())])
    weights = torch.rand(values.numel(), generator=gen) if kjt.weights_or_none() is not None else None
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=weights,
                             stride=kjt.stride())


def _fixed_shape_batches(model: Any, rank: int, steps: int) -> List[TrainBatch]:
    gen = seeded(91 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    rows = {f: c.num_embeddings for c in (*t, *w) for f in c.feature_names}
    first = TrainBatch(random_kjt(t, 8, gen, 6), random_kjt(w, 8, gen, 6, weighted=True))
    return [TrainBatch(_new_ids(first.kjt, rows, gen), _new_ids(first.wkjt, rows, gen)) for _ in range(steps)]


def _set_lr(dmps: Sequence[Any], lr: float) -> None:
    for dmp in dmps:
        for group in dmp.fused_optimizer.param_groups:
            group["lr"] = lr


def _graphed_and_eager(rank: int, world: int, kind: str, optimizer: EmbOptimType, steps: int) -> Tuple[Any, ...]:
    """One model sharded twice (to replay, and to train eagerly), ``steps`` fixed-shape batches, and the static
    batch a captured step reads."""
    device = rank_device(rank, "cuda")
    case = Case(kind, optimizer, owner_backward="pgas")
    model = _model(case, seed=3, min_rows=1)
    fused = {"optimizer": optimizer, "learning_rate": 0.05, "eps": 1e-3, "stochastic_rounding": False}
    wrapped = LossModel(model)
    graphed, eager = (shard(wrapped, _types(case, model, world), dist.group.WORLD, device,
                            with_training(CONFIG, owner_backward="pgas", eager_backward_graphs=graphs), fused,
                            path="model.") for graphs in (True, False))  # the twin launches its eager backwards
    batches = [b.to(device) for b in _fixed_shape_batches(model, rank, steps)]
    static = _fixed_shape_batches(model, rank, 1)[0].to(device)  # the buffers the graph reads
    return model, graphed, eager, batches, static


def _captured_step(graphed: Any, static: TrainBatch, warmup: int) -> CapturedTrainStep:
    def train_step() -> torch.Tensor:
        loss, _ = graphed(static)
        loss.backward()
        return loss.detach()

    return CapturedTrainStep(train_step, warmup_steps=warmup)


def _worst_diff(graphed: Any, eager: Any) -> Dict[str, float]:
    got, ref = local_state(graphed), local_state(eager)
    return {k: float((got[k].double() - ref[k].double()).abs().max()) for k in ref if ref[k].numel()}


def _captured_training(rank: int, world: int, kind: str, optimizer: EmbOptimType,
                       warmup: int = 2) -> Tuple[float, bool, str]:
    """20 steps of one model replayed as one CUDA graph (after 2 eager ones) and of its twin trained eagerly,
    the learning rate changed through ``fused_optimizer`` after step 10: (the worst |graph - eager| over
    every local weight and optimizer state after every step, whether the step was replayed)."""
    _, graphed, eager, batches, static = _graphed_and_eager(rank, world, kind, optimizer, 20)
    step = _captured_step(graphed, static, warmup)
    worst, first = 0.0, ""
    for i, batch in enumerate(batches):
        if i == 10:
            _set_lr((graphed, eager), 0.02)
        copy_kjt_(static.kjt, batch.kjt)
        copy_kjt_(static.wkjt, batch.wkjt)
        step()
        graphed.fused_optimizer.step()
        loss, _ = eager(batch)
        loss.backward()
        eager.fused_optimizer.step()
        check_errors(graphed)
        diffs = _worst_diff(graphed, eager)
        worst = max(worst, *diffs.values())
        if max(diffs.values()) and len(first) < 600:
            first += f"step {i}: " + ", ".join(f"{k} {d:.3g}" for k, d in list(diffs.items())[:3] if d) + "; "
    return worst, step.captured, first


def _captured_bad_batch(rank: int, world: int, kind: str) -> Tuple[List[Tuple[int, str]], float]:
    """12 steps, replayed after 2 eager ones; at step 6 the last rank's batch holds an id past its table. Returns
    the errors this rank raised (step, type) and the worst |graph - eager| at the end, the eager twin having
    skipped step 6 (a refused step applies nothing on any rank)."""
    model, graphed, eager, batches, static = _graphed_and_eager(rank, world, kind,
                                                                EmbOptimType.EXACT_ROWWISE_ADAGRAD, 12)
    step = _captured_step(graphed, static, 2)
    bad = 6
    if rank == world - 1:  # the first id of the first feature that has one: its table's row count
        kjt, rows = batches[bad].kjt, {f: c.num_embeddings for c in model.ebc.embedding_bag_configs()
                                       for f in c.feature_names}
        counts = kjt.length_per_key()
        k = next(i for i, n in enumerate(counts) if n)
        values = kjt.values().clone()
        values[sum(counts[:k])] = rows[kjt.keys()[k]]
        batches[bad] = TrainBatch(KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(),
                                                    stride=kjt.stride()), batches[bad].wkjt)
    raised: List[Tuple[int, str]] = []
    for i, batch in enumerate(batches):
        copy_kjt_(static.kjt, batch.kjt)
        copy_kjt_(static.wkjt, batch.wkjt)
        for call in (step, lambda: check_errors(graphed)):  # a later call raises the refused step's error
            try:
                call()
            except PgasError as e:
                raised.append((i, type(e).__name__))
        if i != bad:
            loss, _ = eager(batch)
            loss.backward()
    return raised, max(_worst_diff(graphed, eager).values())


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM])
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
def test_a_captured_training_step_replays_as_the_eager_one(kind: str, optimizer: EmbOptimType) -> None:
    """Issue 29's replay test: the whole step (forward, gradient exchange, owner update) as one CUDA graph,
    18 replays with a learning rate change midway (through ``fused_optimizer``) and Adam's iteration-dependent
    bias corrections, every weight and optimizer state equal to the eager path's after every step."""
    for worst, captured, first in run_distributed(_captured_training, WORLD, kind, optimizer, device_type="cuda"):
        assert captured
        assert worst == 0.0, f"|graph - eager| {worst}, first at {first}"


@pytest.mark.skipif(WORLD < 2, reason="a peer's refusal needs two ranks")
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
def test_a_replayed_step_refused_on_one_rank_raises_on_every_rank(kind: str) -> None:
    """A bad id on one rank in a replay: no rank applies the step, the bad rank raises its PgasInputError and
    every other rank a PgasPeerAbortError (its backward saw the refusal), each within the next two calls, and
    the replays that follow train on, equal to an eager twin that skipped the bad batch."""
    results = run_distributed(_captured_bad_batch, WORLD, kind, device_type="cuda")
    for rank, (raised, worst) in enumerate(results):
        assert raised and all(6 <= i <= 7 for i, _ in raised), (rank, raised)
        expected = "PgasInputError" if rank == WORLD - 1 else "PgasPeerAbortError"
        assert expected in {name for _, name in raised}, (rank, raised)
        assert worst == 0.0, (rank, worst)



def _past_capacity(kjt: KeyedJaggedTensor, capacity: int) -> KeyedJaggedTensor:
    """``kjt`` with every bag one id longer than an even share of ``capacity`` (row 0: every table has it)."""
    lengths = torch.full_like(kjt.lengths(), capacity // kjt.lengths().numel() + 1)
    ids = torch.zeros(int(lengths.sum()), dtype=kjt.values().dtype, device=kjt.values().device)
    weights = None if kjt.weights_or_none() is None else torch.ones(ids.numel(), device=ids.device)
    return KeyedJaggedTensor(keys=kjt.keys(), values=ids, lengths=lengths, weights=weights, stride=kjt.stride())


def _captured_variable_counts(rank: int, world: int, kind: str) -> Tuple[float, float, bool, str, float]:
    """Issue 48's variable bag sizes: 16 batches whose id count per feature varies (bags of 0-6 ids; MEAN and SUM,
    weighted features), replayed through ``StaticKJT``s after an eager first step and 2 eager warm-ups, against
    the PGAS twin trained eagerly and stock, on the same batches; after step 8 a batch past the capacity on every
    rank, which ``copy_kjt_`` refuses before the replay, and which, filled in past the capacity, the replay refuses
    on the device. Returns the worst |graph - eager| and the worst |graph - stock| (relative,
    ``state_difference``) over the steps, whether it replayed, the refusals' messages, and |graph - its state
    before the refused batch|."""
    device = rank_device(rank, "cuda")
    case = Case(kind, EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling="mixed", owner_backward="pgas")
    model = _model(case, seed=5, min_rows=1)
    fused = {"optimizer": case.optimizer, "learning_rate": 0.05, "eps": 1e-3, "stochastic_rounding": False}
    types = _types(case, model, world)
    config = with_training(CONFIG, owner_backward="pgas")
    graphed, eager, stock = (shard(LossModel(model), t, dist.group.WORLD, device, config, fused, path="model.")
                             for t in (types, types, {k: stock_twin(v) for k, v in types.items()}))
    gen = seeded(131 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    batches = [TrainBatch(random_kjt(t, 8, gen, 6), random_kjt(w, 8, gen, 6, weighted=True)).to(device)
               for _ in range(16)]
    ebcs = [m for m in graphed.modules() if isinstance(m, PgasShardedEmbeddingBagCollection)]  # ebc, then webc
    step: Any = None
    worst, worst_stock, refusal, untouched = 0.0, 0.0, "", -1.0
    for i, batch in enumerate(batches):
        if i == 1:  # the first step set the input dists up: each EBC now takes its static KJT
            groups = [ebc.static_feature_groups for ebc in ebcs]
            assert None not in groups and all(len(g) == (2 if kind == "pgas_mixed" else 1) for g in groups), groups
            static = TrainBatch(*(StaticKJT.at_capacity(k, g) for k, g in zip((batch.kjt, batch.wkjt), groups)))
            step = _captured_step(graphed, static, 2)
        if i == 8:  # a batch past the capacity: copy_kjt_ refuses it; filled past it, the replay refuses it
            before, over = local_state(graphed), _past_capacity(batch.kjt, static.kjt.capacity)
            try:
                copy_kjt_(static.kjt, over)
            except PgasCapacityError as e:
                refusal = str(e)
            static.kjt.fill_(over, past_capacity=True)
            try:
                step()
                check_errors(graphed)
            except PgasError as e:
                refusal += f"; replayed: {type(e).__name__}"
            got = local_state(graphed)
            untouched = max(float((got[k] - before[k]).abs().max()) for k in got if got[k].numel())
        if i == 0:
            loss, _ = graphed(batch)
            loss.backward()
        else:
            copy_kjt_(static.kjt, batch.kjt)
            copy_kjt_(static.wkjt, batch.wkjt)
            step()
        for twin in (eager, stock):
            loss, _ = twin(batch)
            loss.backward()
        check_errors(graphed)
        worst = max(worst, *_worst_diff(graphed, eager).values())
        worst_stock = max(worst_stock, state_difference(graphed, stock))
    return worst, worst_stock, step is not None and step.captured, refusal, untouched


@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise", "pgas_mixed"])
def test_a_replay_takes_batches_of_any_id_counts_up_to_the_capacity(kind: str) -> None:
    """Issue 48, part 3: one captured step replays batches whose id count per feature varies, through a
    ``StaticKJT`` each of a model's EBCs takes (one PGAS sharding reads it whole; "pgas_mixed": two, each its part
    cut on the device): bit-equal to the eager PGAS step, within fp32 rounding of stock; a batch past the
    capacity raises before the replay, naming its feature and count, and changes nothing."""
    for worst, worst_stock, captured, refusal, untouched in run_distributed(_captured_variable_counts, WORLD, kind,
                                                                             device_type="cuda"):
        assert captured and worst == 0.0, worst
        assert worst_stock <= GPU_TOL, worst_stock
        assert re.search(r"a batch of \d+ ids \(feature 'tf\d': \d+ of them\) exceeds .*; replayed: Pgas", refusal), refusal
        assert untouched == 0.0
