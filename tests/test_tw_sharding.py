"""pgas_table_wise through DistributedModelParallel on the shm backend, against stock TorchRec table_wise."""

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.embeddingbag import pgas_lookups
from torchrec_pgas.testing import (
    TwoEbcModel,
    all_tables,
    compare_with_stock,
    default_model,
    run_distributed,
    sample_batches,
    shard,
    shard_metadata,
)
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasConfig, PgasError

CPU = torch.device("cpu")
SMALL = PgasConfig(max_local_batch_size=16, wait_timeout_s=60)


def _spread(model: TwoEbcModel, world: int, kind: str = PGAS_TABLE_WISE) -> Dict[str, str]:
    """Tables round-robin over the ranks (with W=3, rank 2 owns fewer)."""
    return {t: f"{kind}@{i % world}" for i, t in enumerate(all_tables(model, kind))}


def _matches_stock(rank: int, world: int) -> Dict[str, Any]:
    model = default_model()
    types = _spread(model, world)
    cmp = compare_with_stock(model, types, sample_batches(model, rank), dist.group.WORLD, CPU, SMALL, tol=0.0)
    pgas = shard(model, types, dist.group.WORLD, CPU, SMALL)
    stock = shard(model, _spread(model, world, "table_wise"), dist.group.WORLD, CPU, stock=True)
    return {
        "diffs": cmp.max_abs_diff,
        "lookups": len(list(pgas_lookups(pgas))),
        "same_state_dict": shard_metadata(pgas.state_dict()) == shard_metadata(stock.state_dict()),
        "optim_keys": sorted(pgas.fused_optimizer.state_dict()["state"].keys()),
        "stock_optim_keys": sorted(stock.fused_optimizer.state_dict()["state"].keys()),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_matches_stock_table_wise_bit_exact(world: int) -> None:
    """The owner's TBE sums the same rows in the same order as stock TW's: tol=0 (bit-exact)."""
    for res in run_distributed(_matches_stock, world):
        assert len(res["diffs"]) == 10 and max(res["diffs"].values()) == 0.0
        assert res["lookups"] == 2 and res["same_state_dict"]
        assert res["optim_keys"] == res["stock_optim_keys"] and res["optim_keys"]


def _mixed(rank: int, world: int) -> Dict[str, float]:
    """RW, PGAS-RW, TW and PGAS-TW in one EBC, against the unsharded model (stock 1.6.1 divides a TW MEAN
    feature twice next to a RW MEAN table, see test_rw_sharding)."""
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE)
    types.update({"t0": "row_wise", "t1": "pgas_table_wise@1", "t3": "table_wise@0", "w0": "pgas_table_wise@0",
                  "w2": "pgas_table_wise@1"})
    sharded = shard(model, types, dist.group.WORLD, CPU, SMALL)
    diffs: Dict[str, float] = {}
    for kjt, wkjt in sample_batches(model, rank):
        with torch.no_grad():
            out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
        for k in ref:
            diffs[k] = max(diffs.get(k, 0.0), float((out[k] - ref[k]).abs().max()) if ref[k].numel() else 0.0)
    return diffs


def test_mixed_plan_of_four_sharding_types() -> None:
    for diffs in run_distributed(_mixed, 2):
        assert len(diffs) == 10 and max(diffs.values()) < 1e-5, diffs


def _variable_batch(rank: int, world: int) -> float:
    """Ranks feed different local batch sizes; each gets its own rows back."""
    model = default_model()
    sharded = shard(model, _spread(model, world), dist.group.WORLD, CPU, SMALL)
    kjt, wkjt = sample_batches(model, rank, batch=3 + 2 * rank)[0]
    with torch.no_grad():
        out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
    assert out["tf0"].shape[0] == 3 + 2 * rank
    return max(float((out[k] - ref[k]).abs().max()) for k in ref)


def test_variable_local_batch_size() -> None:
    assert max(run_distributed(_variable_batch, 2)) < 1e-5


def _bad_inputs(rank: int, world: int) -> Dict[str, str]:
    model = default_model()
    results: Dict[str, str] = {}
    good, wgood = sample_batches(model, rank)[0]

    def attempt(name: str, kjt: KeyedJaggedTensor, config: PgasConfig = SMALL) -> None:
        sharded = shard(model, _spread(model, world), dist.group.WORLD, CPU, config)
        try:
            with torch.no_grad():
                sharded(kjt, wgood)
            results[name] = "ok"
        except PgasError as e:
            results[name] = f"{type(e).__name__}: {e}"

    values = good.values().clone()
    values[int(good.length_per_key()[0])] = 37  # first id of tf1 (table t1, 37 rows), on rank 1 only
    bad = KeyedJaggedTensor(good.keys(), values, None, good.lengths(), stride=good.stride())
    attempt("too_large", bad if rank == 1 else good)
    attempt("capacity", good, PgasConfig(max_local_batch_size=16, max_ids_per_rank=2))
    return results


def test_bad_inputs_raise_clear_errors() -> None:
    r0, r1 = run_distributed(_bad_inputs, 2)
    assert r1["too_large"] == "PgasInputError: pgas_table_wise: feature 'tf1' (table 't1') has id 37 outside [0, 37)"
    assert r0["too_large"].startswith("PgasPeerAbortError: rank 1 aborted") and "feature 'tf1'" in r0["too_large"]
    assert "above the capacity of 2" in r0["capacity"] + r1["capacity"]


def _backward(rank: int, world: int) -> List[str]:
    model = default_model()
    sharded = shard(model, _spread(model, world), dist.group.WORLD, CPU, SMALL)
    kjt, wkjt = sample_batches(model, rank)[0]
    out = sharded(kjt, wkjt)
    try:
        sum(out[k].sum() for k in out.keys()).backward()
    except NotImplementedError as e:
        return [str(e)]
    return []


def test_backward_is_refused_with_the_stock_twin_named() -> None:
    for msgs in run_distributed(_backward, 2):
        assert msgs and "pgas_table_wise has no backward pass yet" in msgs[0] and "'table_wise'" in msgs[0]


def _corrupt_peer(rank: int, world: int, kind: str) -> str:
    """Rank 1's ids put to rank 0 carry a row rank 0 does not hold (a corrupt peer, injected at its runtime
    put); rank 0 must refuse them before its TBE reads them, and abort rank 1 instead of hanging it."""
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE) if kind == PGAS_ROW_WISE else _spread(model, world)
    sharded = shard(model, types, dist.group.WORLD, CPU, SMALL)
    if rank == 1:
        for lookup in pgas_lookups(sharded):
            pipe = lookup._pipeline
            assert pipe is not None
            put, ids_off = pipe.rt.put, pipe.layout.ids_off

            def corrupt(buf: Any, dest: int, offset: int, data: torch.Tensor, put: Any = put, ids_off: int = ids_off) -> None:
                if dest == 0 and offset % pipe.layout.index_block_bytes == ids_off and data.numel():
                    data = data.clone()
                    data[0] = 10**6
                put(buf, dest, offset, data)

            pipe.rt.put = corrupt  # type: ignore[method-assign]
    kjt, wkjt = sample_batches(model, rank)[0]
    try:
        with torch.no_grad():
            sharded(kjt, wkjt)
    except PgasError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("kind", [PGAS_ROW_WISE, PGAS_TABLE_WISE])
def test_owner_refuses_rows_it_does_not_hold(kind: str) -> None:
    r0, r1 = run_distributed(_corrupt_peer, 2, kind)
    assert r0 == "PgasError: corrupt index data from rank 1: a row outside this rank's shard", r0
    assert r1.startswith("PgasPeerAbortError: rank 0 aborted"), r1
