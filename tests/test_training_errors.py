"""A bad batch does not end a training job; misuse gives a clear error, never a hang or a silent update.

Each test trains PGAS next to stock on the same batches; stock skips the step PGAS could not take, and
afterwards every weight and optimizer state must be bit-equal: the failed step changed nothing anywhere and
the next steps ran. CPU (shm backend) here; the GPU twins are in test_gpu_training.py.
"""

from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.testing import (
    LossModel,
    TrainBatch,
    all_tables,
    default_model,
    local_state,
    random_kjt,
    rank_device,
    run_distributed,
    seeded,
    shard,
    spread_tables,
    stock_twin,
)
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasConfig, PgasError

FUSED: Dict[str, Any] = {"learning_rate": 0.05, "stochastic_rounding": False}


def _sides(rank: int, world: int, kind: str, device_type: str, wait_s: float = 60,
           owner_backward: str = "fbgemm", graphs: bool = True) -> Tuple[Any, Any, List[TrainBatch]]:
    """PGAS and stock over the same SUM tables (bit-exact training: see test_training.py); with
    ``owner_backward="pgas"``, whose sums differ from FBGEMM's in order, a PGAS twin of the same config in
    place of stock."""
    model = default_model(all_sum=True)
    types = all_tables(model, kind) if kind == PGAS_ROW_WISE else spread_tables(model, world)
    dev = rank_device(rank, device_type)
    config = PgasConfig(max_local_batch_size=16, wait_timeout_s=wait_s, owner_backward=owner_backward,
                        eager_backward_graphs=graphs)
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
               owner_backward: str = "fbgemm", graphs: bool = True) -> Dict[str, Any]:
    """Rank 1's step 2 is bad; every rank catches what it raises (in forward or backward) and goes on."""
    pgas, stock, batches = _sides(rank, world, kind, device_type, owner_backward=owner_backward, graphs=graphs)
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
                     owner_backward: str = "fbgemm", graphs: bool = True) -> Dict[str, Any]:
    """Rank 1 skips step 2's backward, so rank 0's times out in the sharding whose backward runs first, which
    ends the model's backward before its other sharding's. Rank 0 keeps the failed step's output (a logged
    loss does; so does the exception's traceback until a garbage collection) and trains three more steps, the
    last one in step 2's buffer slot."""
    pgas, stock, batches = _sides(rank, world, kind, device_type, wait_s=5, owner_backward=owner_backward,
                                  graphs=graphs)
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


@pytest.mark.parametrize("kind", [PGAS_ROW_WISE, PGAS_TABLE_WISE])
def test_a_failed_backward_holds_no_slot_of_the_other_shardings(kind: str) -> None:
    check_failed_backward(run_distributed(_failed_backward, 2, kind, "cpu"))


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
