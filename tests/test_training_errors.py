"""A bad batch does not end a training job; misuse gives a clear error, never a hang or a silent update.

Each test trains PGAS next to stock on the same batches; stock skips the step PGAS could not take, and
afterwards every weight and optimizer state must be bit-equal: the failed step changed nothing anywhere and
the next steps ran. CPU (shm backend) here; the GPU twins are in test_gpu_training.py.
"""

import contextlib
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.embeddingbag import pgas_steps
from torchrec_pgas.testing import (
    LossModel,
    TrainBatch,
    all_tables,
    default_model,
    default_tables,
    failing_puts,
    iteration_counts,
    local_state,
    random_kjt,
    rank_device,
    recorded_failure,
    run_distributed,
    seeded,
    shard,
    spread_tables,
    state_difference,
    stock_twin,
)
from torchrec_pgas.types import (
    PGAS_ROW_WISE,
    PGAS_TABLE_WISE,
    PgasConfig,
    PgasError,
    PgasInputError,
    PgasTrainingConfig,
)

FUSED: Dict[str, Any] = {"learning_rate": 0.05, "stochastic_rounding": False}


def _sides(rank: int, world: int, kind: str, device_type: str, wait_s: float = 60,
           owner_backward: str = "fbgemm", graphs: bool = True,
           padded: Optional[int] = None) -> Tuple[Any, Any, List[TrainBatch]]:
    """PGAS and stock over the same SUM tables (bit-exact training: see test_training.py); with
    ``owner_backward="pgas"``, whose sums differ from FBGEMM's in order, a PGAS twin of the same config in
    place of stock (``padded``: its ``max_padded_eager_ids``; 0: the owner update at the count)."""
    model = default_model(all_sum=True)
    types = all_tables(model, kind) if kind == PGAS_ROW_WISE else spread_tables(model, world)
    dev = rank_device(rank, device_type)
    config = PgasConfig(max_local_batch_size=16, wait_timeout_s=wait_s,
                        training=PgasTrainingConfig(owner_backward=owner_backward, eager_backward_graphs=graphs,
                                                    max_padded_eager_ids=padded))
    wrapped = LossModel(model)
    pgas = shard(wrapped, types, dist.group.WORLD, dev, config, FUSED, path="model.")
    if owner_backward == "pgas":
        stock = shard(wrapped, types, dist.group.WORLD, dev, config, FUSED, path="model.")
    else:
        stock = shard(wrapped, {k: stock_twin(v) for k, v in types.items()}, dist.group.WORLD, dev,
                      fused_params=FUSED, stock=True, path="model.")
    gen = seeded(5 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    batches = [TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True)).to(dev)
               for _ in range(6)]
    return pgas, stock, batches


def _train(dmp: Any, batch: TrainBatch) -> None:
    loss, _ = dmp(batch)
    loss.backward()
    dmp.fused_optimizer.step()


def _bad(batch: TrainBatch, what: str) -> TrainBatch:
    """An id past table t1's 37 rows (``id``; ``wid``: past w1's, in the weighted EBC, whose backward runs
    first), or a local batch above max_local_batch_size (``capacity``)."""
    kjt = batch.kjt
    if what == "capacity":
        return TrainBatch(random_kjt(default_model().ebc.embedding_bag_configs(), 17, seeded(99)).to(
            kjt.values().device), batch.wkjt)
    bad = batch.wkjt if what == "wid" else kjt
    values = bad.values().clone()
    values[int(bad.length_per_key()[0])] = 37  # the first id of feature 1 (table t1 or w1, 37 rows)
    bad = KeyedJaggedTensor(bad.keys(), values, bad.weights_or_none(), bad.lengths(), stride=bad.stride())
    return TrainBatch(kjt, bad) if what == "wid" else TrainBatch(bad, batch.wkjt)


def _outcome(pgas: Any, stock: Any, initial: Dict[str, torch.Tensor], errors: List[Any]) -> Dict[str, Any]:
    """What a rank raised, whether every weight and optimizer state equals the reference's (``equal``), and
    whether training moved any from ``initial`` (``trained``: an update applied on neither side is equal too)."""
    got, ref = local_state(pgas), local_state(stock)
    return {"errors": errors, "equal": all(torch.equal(got[k], ref[k]) for k in ref) and got.keys() == ref.keys(),
            "trained": any(not torch.equal(got[k], initial[k]) for k in got)}


def _bad_batch(rank: int, world: int, kind: str, what: str, device_type: str,
               owner_backward: str = "fbgemm", graphs: bool = True, padded: Optional[int] = None) -> Dict[str, Any]:
    """Rank 1's step 2 is bad; every rank catches what it raises (in forward or backward) and goes on."""
    pgas, stock, batches = _sides(rank, world, kind, device_type, owner_backward=owner_backward, graphs=graphs,
                                  padded=padded)
    initial = local_state(pgas)
    errors = []
    for i, batch in enumerate(batches):
        try:
            _train(pgas, _bad(batch, what) if i == 2 and rank == 1 else batch)
        except PgasError as e:
            errors.append((i, type(e).__name__, str(e)))
        if i != 2:
            _train(stock, batch)
    return _outcome(pgas, stock, initial, errors)


@pytest.mark.stacks
@pytest.mark.parametrize("kind", [PGAS_ROW_WISE, PGAS_TABLE_WISE])
@pytest.mark.parametrize("what", ["id", "wid", "capacity"])
def test_a_bad_batch_changes_nothing_and_the_next_steps_train(kind: str, what: str) -> None:
    r0, r1 = run_distributed(_bad_batch, 2, kind, what, "cpu")
    expected = "exceeds PgasConfig.max_local_batch_size=16" if what == "capacity" else "has id 37 outside [0, 37)"
    assert [e[:2] for e in r1["errors"]] == [(2, "PgasCapacityError" if what == "capacity" else "PgasInputError")]
    assert expected in r1["errors"][0][2]
    assert [e[:2] for e in r0["errors"]] == [(2, "PgasPeerAbortError")] and "rank 1 aborted" in r0["errors"][0][2]
    assert r0["equal"] and r1["equal"] and r0["trained"] and r1["trained"], (r0, r1)


def _failed_backward(rank: int, world: int, kind: str, device_type: str,
                     owner_backward: str = "fbgemm", graphs: bool = True,
                     padded: Optional[int] = None) -> Dict[str, Any]:
    """Rank 1 skips step 2's backward, so rank 0's times out in the sharding whose backward runs first, which
    ends the model's backward before its other sharding's. Rank 0 keeps the failed step's output (a logged
    loss does; so does the exception's traceback until a garbage collection) and trains three more steps, the
    last one in step 2's buffer slot."""
    pgas, stock, batches = _sides(rank, world, kind, device_type, wait_s=5, owner_backward=owner_backward,
                                  graphs=graphs, padded=padded)
    initial = local_state(pgas)
    errors, kept = [], []
    for i, batch in enumerate(batches):
        if i != 2:
            try:
                _train(pgas, batch)
            except PgasError as e:
                errors.append((i, type(e).__name__, str(e)))
            _train(stock, batch)
            continue
        loss = pgas(batch)[0]
        if rank == 0:
            kept.append(loss)
            try:
                loss.backward()
            except PgasError as e:
                errors.append((i, type(e).__name__, str(e)))
        del loss
        dist.barrier()  # rank 1 waits out rank 0's timeout
    return _outcome(pgas, stock, initial, errors)


def check_failed_backward(results: List[Dict[str, Any]]) -> None:
    """Rank 0's backward of step 2 raised (a timeout: rank 1 sent no gradient), nothing applied step 2, and
    every later step trained on both ranks."""
    r0, r1 = results
    assert [e[:2] for e in r0["errors"]] == [(2, "PgasTimeoutError")], r0
    assert r1["errors"] == [], r1
    assert r0["equal"] and r1["equal"] and r0["trained"] and r1["trained"], (r0, r1)


# table-wise: ~6 s; the mixed-plan test below fails backwards of pgas_table_wise shardings in make test
@pytest.mark.parametrize("kind", [PGAS_ROW_WISE, pytest.param(PGAS_TABLE_WISE, marks=pytest.mark.matrix)])
def test_a_failed_backward_holds_no_slot_of_the_other_shardings(kind: str) -> None:
    check_failed_backward(run_distributed(_failed_backward, 2, kind, "cpu"))


STALL_TIMEOUT_S = 10.0  # PgasConfig.wait_timeout_s of the stall test: above what load adds to a step


def _stall(rank: int, world: int, kind: str, device_type: str) -> Dict[str, Any]:
    """The last rank trains two steps, then stops taking part (alive, asleep) while the others run step 3:
    how long each of them took to raise, and what."""
    # the owner update: FBGEMM's CPU backward refuses the empty shard a small table leaves a rank at W = 4
    pgas, _, batches = _sides(rank, world, kind, device_type, wait_s=STALL_TIMEOUT_S, owner_backward="pgas")
    for batch in batches[:2]:
        _train(pgas, batch)
    dist.barrier()
    if rank == world - 1:
        time.sleep(STALL_TIMEOUT_S + 8)  # past every peer's deadline, with room for their teardown
        return {"stalled": True}
    start = time.monotonic()
    try:
        _train(pgas, batches[2])
        if device_type == "cuda":
            torch.cuda.synchronize()
        return {"elapsed": time.monotonic() - start, "error": None}
    except PgasError as e:
        return {"elapsed": time.monotonic() - start, "error": f"{type(e).__name__}: {e}"}


def check_stall(results: List[Dict[str, Any]], stalled: str) -> None:
    """Every rank but the stalled one raised within the step's one deadline plus 5 s, naming the stalled
    rank (``stalled``: how the message names it; a peer's abort carries the first rank's reason)."""
    *others, last = results
    assert last == {"stalled": True}
    for r in others:
        assert r["error"] is not None and stalled in r["error"], r
        assert r["elapsed"] <= STALL_TIMEOUT_S + 5, r


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("kind", [PGAS_ROW_WISE, PGAS_TABLE_WISE])
def test_a_stalled_rank_fails_the_step_once_its_deadline_passes(kind: str) -> None:
    """W = 4: one deadline for the step's waits (PgasConfig.wait_timeout_s from its first wait)."""
    check_stall(run_distributed(_stall, 4, kind, "cpu"), "[3]")


def _misuse(rank: int, world: int, device_type: str) -> Dict[str, Any]:
    pgas, stock, batches = _sides(rank, world, PGAS_ROW_WISE, device_type, wait_s=5)
    out: Dict[str, Any] = {}
    # Four training steps in flight, with three buffer slots: the fourth forward refuses, on every rank.
    held = []
    try:
        for batch in batches[:4]:
            held.append(pgas(batch)[0])
    except PgasError as e:
        out["in_flight"] = str(e)
    for loss in held:
        loss.backward()
    for batch in batches[:len(held)]:
        _train(stock, batch)
    # A second backward through the same output (retain_graph): refused, nothing applied twice.
    loss = pgas(batches[3])[0]
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except PgasError as e:
        out["twice"] = str(e)
    _train(stock, batches[3])
    # Rank 1 skips step 5's backward: rank 0's backward times out naming it; neither applies step 5.
    loss = pgas(batches[4])[0]
    if rank == 0:
        try:
            loss.backward()
        except PgasError as e:
            out["skipped"] = f"{type(e).__name__}: {e}"
    del loss
    dist.barrier()  # rank 1 waits out rank 0's timeout, or its own next wait would time out first
    _train(pgas, batches[5])  # and the next step trains on both
    _train(stock, batches[5])
    got, ref = local_state(pgas), local_state(stock)
    out["equal"] = all(torch.equal(got[k], ref[k]) for k in ref)
    return out


def check_misuse(results: List[Dict[str, Any]], names_rank_1: str) -> None:
    """Each misuse raised its error on both ranks (the skipped backward: a timeout on rank 0 naming rank 1,
    as ``names_rank_1`` says it), and the next step trained as stock did."""
    r0, r1 = results
    for r in (r0, r1):
        assert "step 1's output still waits for its backward" in r["in_flight"], r["in_flight"]
        assert "a second backward through step 4's output" in r["twice"], r["twice"]
        assert r["equal"], r
    assert r0["skipped"].startswith("PgasTimeoutError") and names_rank_1 in r0["skipped"], r0["skipped"]


def test_misuse_raises_clearly_and_changes_nothing() -> None:
    check_misuse(run_distributed(_misuse, 2, "cpu"), "from rank(s) [1]")


# ---- refusals in mixed plans ------------------------------------------------------------------------------

# Plans of the two EBCs' four tables each (unweighted, weighted): pgas_table_wise next to pgas_row_wise, and the
# stock types in the weighted EBC, whose forward runs after the unweighted one's, where the bad batches refuse
# ("@-1": the last rank). On shm a stock sharding must not share an EBC with a PGAS sharding that refuses a
# step: the failing rank raises in its input dist, before the stock sharding's collectives, which its peers
# have entered (README, limits); the GPU path gives the step up without raising in the forward.
MIXED_PLANS = {
    "rw-tw-rw-tw": (("pgas_row_wise", "pgas_table_wise@-1", "pgas_row_wise", "pgas_table_wise@0"),
                    ("pgas_row_wise", "pgas_table_wise@-1", "pgas_row_wise", "pgas_table_wise@0")),
    "tw-rw-tw-rw": (("pgas_table_wise@0", "pgas_row_wise", "pgas_table_wise@-1", "pgas_row_wise"),
                    ("row_wise", "pgas_table_wise@-1", "table_wise@0", "pgas_row_wise")),
    "tw-tw-rw-tw": (("pgas_table_wise@-1", "pgas_table_wise@0", "pgas_row_wise", "pgas_table_wise@-1"),
                    ("table_wise@-1", "pgas_row_wise", "pgas_table_wise@0", "row_wise")),
}
# The bad batch: an id past its table in a pgas_row_wise feature, in a pgas_table_wise one, or more ids than
# max_ids_per_rank at the step's batch size (every sharding refuses it; a batch larger than its peers' would break
# the stock shardings' collectives, as it does stock TorchRec's: the bad-batch tests refuse that one in PGAS-only
# models). Or a failed backward: the last rank drops the step's loss
# (every sharding's backward on the other ranks times out), or its gradient exchange fails after its first
# put (an OOM, a lost mapping: it aborts the step, the others raise the abort). Those two not in a plan with
# stock shardings: their backward's collectives would wait for the failed rank (gloo's timeout, not ours).
REFUSALS = ("id-rw", "id-tw", "capacity")
BACKWARD_FAULTS = ("backward", "exchange")
# A failure the forward records rather than raises (GPU kernels: a bad id, on its own rank only), in the plan whose
# second EBC holds stock shardings: the ranks' check before the backward must refuse the step on every rank before
# their fused backward applies it (or a peer waits in its collectives).
RECORDED = "recorded"
CASES = ([(plan, what) for plan in MIXED_PLANS for what in REFUSALS] + [("rw-tw-rw-tw", f) for f in BACKWARD_FAULTS]
         + [("tw-tw-rw-tw", RECORDED)])
REFUSED_STEP, STEPS_AFTER = 3, 5
MATRIX_IDS = 8 * 5 * 8  # max_ids_per_rank: 8 samples of at most 5 ids in each of the model's 8 features
BACKWARD_TIMEOUT_S = 4.0


def _mixed_types(plan: str, world: int) -> Dict[str, str]:
    types = {}
    for prefix, kinds in zip("tw", MIXED_PLANS[plan]):
        for i, kind in enumerate(kinds):
            types[f"{prefix}{i}"] = kind.replace("@-1", f"@{world - 1}")
    return types


def _refused(batch: TrainBatch, types: Dict[str, str], what: str) -> TrainBatch:
    """``batch`` with its refusal: the first id of the first feature of a table of the named kind set past
    every table's rows, or 17 samples."""
    if what == "capacity":
        kjt = random_kjt(default_model().ebc.embedding_bag_configs(), batch.kjt.stride(), seeded(99), MATRIX_IDS)
        return TrainBatch(kjt.to(batch.kjt.values().device), batch.wkjt)
    kind = "pgas_row_wise" if what == "id-rw" else "pgas_table_wise"
    table = next(c for c in default_tables() if types[c.name].startswith(kind))
    kjt = batch.kjt
    values = kjt.values().clone()
    values[sum(kjt.length_per_key()[:kjt.keys().index(table.feature_names[0])])] = 10**9
    return TrainBatch(KeyedJaggedTensor(kjt.keys(), values, None, kjt.lengths(), stride=kjt.stride()), batch.wkjt)


def _refusal(rank: int, world: int, plan: str, what: str, device_type: str) -> Dict[str, Any]:
    """The default owner update (row-wise Adagrad) against stock on the same batches; the last rank's step
    REFUSED_STEP is bad, every rank skips it (stock never sees it), STEPS_AFTER steps follow. The largest
    |pgas - stock| / max(1, |stock|) over every weight and optimizer state after each step, and the errors."""
    model = default_model(all_sum=True, min_rows=world)
    types = _mixed_types(plan, world)
    fused = {**FUSED, "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "eps": 1e-3}
    config = PgasConfig(max_local_batch_size=16, max_ids_per_rank=MATRIX_IDS,
                        wait_timeout_s=BACKWARD_TIMEOUT_S if what in BACKWARD_FAULTS else 60)
    wrapped = LossModel(model)
    dev = rank_device(rank, device_type)
    pgas = shard(wrapped, types, dist.group.WORLD, dev, config, fused, path="model.")
    stock = shard(wrapped, {k: stock_twin(v) for k, v in types.items()}, dist.group.WORLD, dev, fused_params=fused,
                  stock=True, path="model.")
    gen = seeded(11 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    errors, diffs, epochs, counters, messages = [], [], [], [], []
    for i in range(REFUSED_STEP + 1 + STEPS_AFTER):
        batch = TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True)).to(dev)
        try:
            if what == "backward" and i == REFUSED_STEP and rank == world - 1:
                pgas(batch)  # the forward ran; its backward never does (the loss is dropped)
            elif what == "exchange" and i == REFUSED_STEP and rank == world - 1:
                loss, _ = pgas(batch)
                with failing_puts(after=1):
                    loss.backward()
            elif what == RECORDED and i == REFUSED_STEP:  # recorded on the bad rank only, as GPUs record a bad id
                with recorded_failure(i + 1, PgasInputError("injected: a bad id")) if rank == world - 1 else (
                        contextlib.nullcontext()):
                    _train(pgas, batch)
            elif i == REFUSED_STEP and rank == world - 1:
                _train(pgas, _refused(batch, types, what))
            else:
                _train(pgas, batch)
        except PgasError as e:
            errors.append((i, type(e).__name__))
            messages.append(str(e)[:300])  # for the report of a failed check
        if what == "backward" and i == REFUSED_STEP:
            dist.barrier()  # the last rank waits out the others' deadline before its next step
        if i != REFUSED_STEP:
            _train(stock, batch)
        diffs.append(state_difference(pgas, stock))
        epochs.append(sorted({step.issued for step in pgas_steps(pgas)}))
        counters.append((iteration_counts(pgas), iteration_counts(stock)))
    return {"errors": errors, "diffs": diffs, "epochs": epochs, "counters": counters, "messages": messages}


def _refusals(rank: int, world: int, device_type: str = "cpu") -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Every case; on GPUs not the failed exchange, whose puts are the fused kernels', nor the injected record
    (their kernels record the bad ids of the other cases)."""
    return {(plan, what): _refusal(rank, world, plan, what, device_type) for plan, what in CASES
            if device_type == "cpu" or what not in ("exchange", RECORDED)}


def check_refusals(results: List[Dict[Tuple[str, str], Dict[str, Any]]]) -> None:
    """Every rank raised at the refused step and only there (the last rank its own error, the others the
    abort), every weight and optimizer state stayed within fp32 rounding of stock's after every step, and
    every PGAS sharding of the model (both EBCs) ran each step at the same epoch, the refused one consumed, and
    every TBE's iteration counter (stock-sharded ones too: FBGEMM's forward counts) equals stock's."""
    world = len(results)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            if case[1] == "backward":  # the others' backward times out; the last rank raised nothing
                want = [] if rank == world - 1 else [(REFUSED_STEP, "PgasTimeoutError")]
            elif case[1] == "exchange":  # the last rank's own failure; the others' the abort it sent
                want = [(REFUSED_STEP, "PgasError" if rank == world - 1 else "PgasPeerAbortError")]
            else:
                own = {"id-rw": "PgasInputError", "id-tw": "PgasInputError", "capacity": "PgasCapacityError",
                       RECORDED: "PgasInputError"}[case[1]]
                want = [(REFUSED_STEP, own if rank == world - 1 else "PgasPeerAbortError")]
            assert r["errors"] == want, (rank, case, r["errors"], r["messages"])
            assert max(r["diffs"]) <= 1e-5, (rank, case, r["diffs"])
            assert r["epochs"] == [[i + 1] for i in range(len(r["epochs"]))], (rank, case, r["epochs"])
            # the rank that dropped the loss ran the step's forward, which FBGEMM counts (an eval forward with grad)
            dropped = case[1] == "backward" and rank == world - 1
            for i, (got, ref) in enumerate(r["counters"]):
                assert set(got) == {c + int(dropped and i >= REFUSED_STEP) for c in ref}, (rank, case, i, got, ref)


def test_a_refused_step_in_a_mixed_plan_leaves_the_next_steps_equal_to_stock() -> None:
    """A pgas_table_wise sharding next to pgas_row_wise and stock ones in one EBC: a step refused by any of
    them (a bad id in a row-wise or a table-wise feature, a batch over capacity) is consumed by every PGAS
    sharding of the EBC on every rank, and the steps after it train as stock does without it; so does a step
    whose backward one rank dropped (every sharding's backward times out elsewhere and applies nothing), or
    whose gradient exchange failed on one rank after its first put (it aborts the step; nothing applied), or whose
    forward recorded a failure instead of raising it (as GPU kernels record a bad id: the check before the
    backward refuses it before the stock shardings' fused backward)."""
    check_refusals(run_distributed(_refusals, 2))


@pytest.mark.slow
@pytest.mark.matrix
def test_a_refused_step_in_a_mixed_plan_at_three_ranks() -> None:
    check_refusals(run_distributed(_refusals, 3))
