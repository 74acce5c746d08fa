"""pgas_row_wise through DistributedModelParallel on the shm backend, against stock TorchRec."""

import warnings
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.embeddingbag import pgas_steps
from torchrec_pgas.testing import (
    all_tables,
    compare_with_stock,
    default_model,
    run_distributed,
    sample_batches,
    shard,
    shard_metadata,
)
from torchrec_pgas.types import (
    PGAS_ROW_WISE,
    PgasConfig,
    PgasError,
)

CPU = torch.device("cpu")
SMALL = PgasConfig(max_local_batch_size=16, wait_timeout_s=60)


def _matches_stock(rank: int, world: int) -> Dict[str, Any]:
    model = default_model()
    cmp = compare_with_stock(model, all_tables(model, PGAS_ROW_WISE), sample_batches(model, rank), dist.group.WORLD, CPU, SMALL)
    pgas = shard(model, all_tables(model, PGAS_ROW_WISE), dist.group.WORLD, CPU, SMALL)
    stock = shard(model, all_tables(model, "row_wise"), dist.group.WORLD, CPU, stock=True)
    return {
        "steps": len(list(pgas_steps(pgas))),
        "diffs": cmp.max_abs_diff,
        "same_state_dict": shard_metadata(pgas.state_dict()) == shard_metadata(stock.state_dict()),
        "keys": sorted(pgas.state_dict().keys()),
        "optim_keys": sorted(pgas.fused_optimizer.state_dict()["state"].keys()),
        "stock_optim_keys": sorted(stock.fused_optimizer.state_dict()["state"].keys()),
    }


@pytest.mark.stacks
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_stock_row_wise(world: int) -> None:
    for res in run_distributed(_matches_stock, world):
        # compare_with_stock asserted closeness per batch; every key was seen.
        assert len(res["diffs"]) == 10
        assert res["steps"] == 2  # check_errors reaches both EBCs' PGAS steps
        assert res["same_state_dict"]
        assert "ebc.embedding_bags.t1.weight" in res["keys"]
        assert res["optim_keys"] == res["stock_optim_keys"] and res["optim_keys"]


def _mixed(rank: int, world: int) -> Dict[str, float]:
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE)
    types.update({"t0": "row_wise", "w1": "row_wise", "w2": "table_wise"})
    return compare_with_stock(model, types, sample_batches(model, rank), dist.group.WORLD, CPU, SMALL).max_abs_diff


def test_mixed_plan_row_wise_pgas_and_table_wise() -> None:
    for diffs in run_distributed(_mixed, 2):
        assert len(diffs) == 10


def _mean_next_to_table_wise(rank: int, world: int) -> Dict[str, float]:
    """MEAN tables of three sharding types in one EBC, against the unsharded model."""
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE)
    types.update({"t1": "row_wise", "t3": "table_wise"})
    sharded = shard(model, types, dist.group.WORLD, CPU, SMALL)
    kjt, wkjt = sample_batches(model, rank)[0]
    with torch.no_grad():
        out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
    return {k: float((out[k] - ref[k]).abs().max()) for k in ref}


def test_mean_pooling_is_divided_once() -> None:
    # Stock TorchRec 1.6.1 divides t3 (MEAN, table_wise) a second time here.
    for diffs in run_distributed(_mean_next_to_table_wise, 2):
        assert max(diffs.values()) < 1e-5, diffs


def _bad_inputs(rank: int, world: int) -> Dict[str, str]:
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    results: Dict[str, str] = {}

    def attempt(name: str, kjt: KeyedJaggedTensor, wkjt: KeyedJaggedTensor, **kw: Any) -> None:
        sharded = shard(model, types, dist.group.WORLD, CPU, kw.pop("config", SMALL), **kw)
        local_before = {k: v.local_shards()[0].tensor.clone() for k, v in sharded.state_dict().items()}
        try:
            with torch.no_grad():
                sharded(kjt, wkjt)
            results[name] = "ok"
        except PgasError as e:
            results[name] = f"{type(e).__name__}: {e}"
        for k, v in sharded.state_dict().items():  # no rank's weights were written
            assert torch.equal(v.local_shards()[0].tensor, local_before[k]), (name, k)

    good, wgood = sample_batches(model, rank)[0]

    def with_id(kjt: KeyedJaggedTensor, pos: int, value: int) -> KeyedJaggedTensor:
        values = kjt.values().clone()
        values[pos] = value
        return KeyedJaggedTensor(kjt.keys(), values, kjt.weights_or_none(), kjt.lengths(), stride=kjt.stride())

    # First id of feature tf1 (table t1, 37 rows) out of range, on rank 1 only.
    pos_tf1 = int(good.length_per_key()[0])
    attempt("too_large", with_id(good, pos_tf1, 37) if rank == 1 else good, wgood)
    attempt("negative", with_id(good, 0, -5) if rank == 0 else good, wgood)
    attempt("capacity", good, wgood, config=PgasConfig(max_local_batch_size=16, max_ids_per_rank=2))
    one_sixteenth = {t: 1 / 16 for t in ("t0", "t1", "t2", "t3")}  # one id a feature in a batch of 16
    attempt("pooling_capacity", good, wgood, config=PgasConfig(max_local_batch_size=16, pooling_capacity=one_sixteenth))
    small, wsmall = sample_batches(model, rank, batch=3 if rank == 1 else 4)[0]
    attempt("batch_mismatch", small, wsmall)
    big, wbig = sample_batches(model, rank, batch=17)[0]
    attempt("batch_too_large", big, wbig)
    for mode in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bad = with_id(good, pos_tf1, 1000) if rank == 1 else good
            attempt(mode.name, bad, wgood, fused_params={"bounds_check_mode": mode})
        results[mode.name] += f" warned={any('tf1' in str(w.message) for w in caught)}"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return results


@pytest.mark.stacks
def test_bad_inputs_raise_clear_errors() -> None:
    r0, r1 = run_distributed(_bad_inputs, 2)
    # The rank with the bad id names the feature, table and value; its peer learns why.
    assert r1["too_large"] == (
        "PgasInputError: pgas_row_wise: feature 'tf1' (table 't1') has id 37 outside [0, 37)"
    )
    assert r0["too_large"].startswith("PgasPeerAbortError: rank 1 aborted")
    assert "feature 'tf1'" in r0["too_large"]
    assert r0["negative"] == "PgasInputError: pgas_row_wise: feature 'tf0' (table 't0') has id -5 outside [0, 100)"
    assert r1["negative"].startswith("PgasPeerAbortError: rank 0 aborted")
    assert "PgasCapacityError" in r0["capacity"] + r1["capacity"]
    assert "ids in one step, above the capacity of 2" in r0["capacity"] + r1["capacity"]
    assert "PgasCapacityError" in r0["pooling_capacity"] + r1["pooling_capacity"]
    assert "(PgasConfig.max_ids_per_rank / pooling_capacity / avg_pooling_capacity)" in r0["pooling_capacity"]
    for r in (r0, r1):
        assert "equal local batch sizes" in r["batch_mismatch"]
        assert "has 3" in r["batch_mismatch"] and "has 4" in r["batch_mismatch"]
        assert "17 exceeds PgasConfig.max_local_batch_size=16" in r["batch_too_large"]
    assert r1["WARNING"] == "ok warned=True" and r0["WARNING"] == "ok warned=False"
    assert r1["IGNORE"] == "ok warned=False"


def _warning_mode_reads_row_zero(rank: int, world: int) -> float:
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE)
    kjt, wkjt = sample_batches(model, rank)[0]
    bad_values = kjt.values().clone()
    bad_values[0] = 10_000
    bad = KeyedJaggedTensor(kjt.keys(), bad_values, None, kjt.lengths(), stride=kjt.stride())
    fixed_values = kjt.values().clone()
    fixed_values[0] = 0
    fixed = KeyedJaggedTensor(kjt.keys(), fixed_values, None, kjt.lengths(), stride=kjt.stride())
    sharded = shard(model, types, dist.group.WORLD, CPU, SMALL, fused_params={"bounds_check_mode": BoundsCheckMode.IGNORE})
    with torch.no_grad():
        got = sharded(bad, wkjt)["tf0"]
        ref = model(fixed, wkjt)["tf0"]
    return float((got - ref).abs().max())


def test_ignore_mode_replaces_bad_ids_by_row_zero() -> None:
    assert max(run_distributed(_warning_mode_reads_row_zero, 2)) < 1e-5


def _pipelined(rank: int, world: int) -> str:
    """Three index dists in flight before the first lookup (TorchRec's TrainPipelineSemiSync keeps three
    steps in flight); a fourth is refused."""
    model = default_model()
    sharded = shard(model, all_tables(model, PGAS_ROW_WISE), dist.group.WORLD, CPU, SMALL)
    sebc = sharded.module.ebc
    batches = [b for b, _ in sample_batches(model, rank)]
    ctxs, inputs = [], []
    for kjt in batches[:3]:
        ctx = sebc.create_context()
        inputs.append(sebc.input_dist(ctx, kjt).wait().wait())
        ctxs.append(ctx)
    with torch.no_grad():
        for ctx, dist_input, kjt in zip(ctxs, inputs, batches):
            got = sebc.compute_and_output_dist(ctx, dist_input).wait().to_dict()
            ref = model.ebc(kjt).to_dict()
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5)
        for kjt in batches:  # a fourth in flight is refused
            sebc.input_dist(sebc.create_context(), kjt)
    return "unreachable"


def test_three_index_dists_may_run_ahead() -> None:
    with pytest.raises(Exception, match="at most 3 may run ahead"):
        run_distributed(_pipelined, 2)
