"""pgas_table_wise through DistributedModelParallel, against stock TorchRec table_wise.

The comparisons run on the shm backend (CPU, gloo) and, marked ``gpu``, on the
nvshmem backend's fused kernels (one process per GPU with NCCL for the stock twin, or ranks sharing a GPU
over gloo, ``torchrec_pgas.placement``);
the GPU's bad-input and graph tests are in test_gpu.py.
"""

import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.embeddingbag import PgasShardedEmbeddingBagCollection, pgas_steps
from torchrec_pgas.testing import (
    all_tables,
    check_errors,
    compare_with_stock,
    default_model,
    rank_device,
    run_distributed,
    sample_batches,
    shard,
    shard_metadata,
    spread_tables,
)
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasConfig, PgasError

CPU = torch.device("cpu")
SMALL = PgasConfig(max_local_batch_size=16, wait_timeout_s=60)
GPU_WORLD = int(os.environ.get("PGAS_TEST_WORLD", "2"))
# Two ranks on either backend (ranks named in the plans below).
BACKENDS = [pytest.param("cpu", id="shm"),
            pytest.param("cuda", id="nvshmem", marks=(pytest.mark.gpu, pytest.mark.peers))]


def _device(kind: str, rank: int) -> torch.device:
    return rank_device(rank, kind)


def _run(fn: Any, world: int, device: str, *args: Any) -> List[Any]:
    return run_distributed(fn, world, device, *args, device_type=device)


def _matches_stock(rank: int, world: int, device: str) -> Dict[str, Any]:
    model = default_model()
    dev = _device(device, rank)
    types = spread_tables(model, world)
    cmp = compare_with_stock(model, types, sample_batches(model, rank), dist.group.WORLD, dev, SMALL, tol=0.0)
    pgas = shard(model, types, dist.group.WORLD, dev, SMALL)
    stock = shard(model, spread_tables(model, world, "table_wise"), dist.group.WORLD, dev, stock=True)
    with torch.no_grad():
        pgas(*_on(sample_batches(model, rank), dev)[0])
    ebcs = [m for m in pgas.modules() if isinstance(m, PgasShardedEmbeddingBagCollection)]
    return {
        # TW orders features rank by rank: the sharding reads the input order, TorchRec copies nothing.
        "permutes": [m._has_features_permute for m in ebcs],
        "input_orders": [step.reads_input_order for m in ebcs for step in pgas_steps(m)],
        "diffs": cmp.max_abs_diff,
        "steps": len(list(pgas_steps(pgas))),
        "same_state_dict": shard_metadata(pgas.state_dict()) == shard_metadata(stock.state_dict()),
        "optim_keys": sorted(pgas.fused_optimizer.state_dict()["state"].keys()),
        "stock_optim_keys": sorted(stock.fused_optimizer.state_dict()["state"].keys()),
    }


@pytest.mark.stacks
@pytest.mark.parametrize("device,world", [("cpu", 2), ("cpu", 3), pytest.param("cuda", GPU_WORLD, marks=pytest.mark.gpu)])
def test_matches_stock_table_wise_bit_exact(device: str, world: int) -> None:
    """Stock TW's TBE and ours (the TBE on shm, the fused kernel on GPUs) sum the same rows in the same
    order, and the GPU kernel means with the TBE's arithmetic: tol=0 (bit-exact)."""
    for res in _run(_matches_stock, world, device):
        assert len(res["diffs"]) == 10 and max(res["diffs"].values()) == 0.0
        assert res["steps"] == 2 and res["same_state_dict"]
        # at W >= 4 each EBC's four tables land on ranks 0-3 in input order: there is no permute to take over
        assert res["permutes"] == [False, False] and (any(res["input_orders"]) or world >= 4)
        assert res["optim_keys"] == res["stock_optim_keys"] and res["optim_keys"]


def _mixed(rank: int, world: int, device: str) -> Dict[str, float]:
    """RW, PGAS-RW, TW and PGAS-TW in one EBC, against the unsharded model (stock 1.6.1 divides a TW MEAN
    feature twice next to a RW MEAN table, see test_rw_sharding)."""
    model = default_model()
    dev = _device(device, rank)
    types = all_tables(model, PGAS_ROW_WISE)
    types.update({"t0": "row_wise", "t1": "pgas_table_wise@1", "t3": "table_wise@0", "w0": "pgas_table_wise@0",
                  "w2": "pgas_table_wise@1"})
    sharded = shard(model, types, dist.group.WORLD, dev, SMALL)
    model.to(dev)
    diffs: Dict[str, float] = {}
    for kjt, wkjt in _on(sample_batches(model, rank), dev):
        with torch.no_grad():
            out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
        check_errors(sharded)
        for k in ref:
            diffs[k] = max(diffs.get(k, 0.0), float((out[k] - ref[k]).abs().max()) if ref[k].numel() else 0.0)
    return diffs


def _on(batches: List[Tuple[Any, Any]], dev: torch.device) -> List[Tuple[Any, Any]]:
    return [(kjt.to(dev), wkjt.to(dev)) for kjt, wkjt in batches]


@pytest.mark.parametrize("device", BACKENDS)
def test_mixed_plan_of_four_sharding_types(device: str) -> None:
    for diffs in _run(_mixed, 2, device):
        assert len(diffs) == 10 and max(diffs.values()) < 1e-5, diffs


def _variable_batch(rank: int, world: int, device: str) -> float:
    """Ranks feed different local batch sizes; each gets its own rows back."""
    model = default_model()
    dev = _device(device, rank)
    sharded = shard(model, spread_tables(model, world), dist.group.WORLD, dev, SMALL)
    model.to(dev)
    diff = 0.0
    for batch in (3 + 2 * rank, 16 - 5 * rank):
        kjt, wkjt = _on(sample_batches(model, rank, batch=batch)[:1], dev)[0]
        with torch.no_grad():
            out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
        check_errors(sharded)
        assert out["tf0"].shape[0] == batch
        diff = max(diff, *(float((out[k] - ref[k]).abs().max()) for k in ref))
    return diff


@pytest.mark.parametrize("device", BACKENDS)
def test_variable_local_batch_size(device: str) -> None:
    assert max(_run(_variable_batch, 2, device)) < 1e-5


def _bad_inputs(rank: int, world: int) -> Dict[str, str]:
    model = default_model()
    results: Dict[str, str] = {}
    good, wgood = sample_batches(model, rank)[0]

    def attempt(name: str, kjt: KeyedJaggedTensor, config: PgasConfig = SMALL) -> None:
        sharded = shard(model, spread_tables(model, world), dist.group.WORLD, CPU, config)
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


def _corrupt_peer(rank: int, world: int, kind: str) -> str:
    """Rank 1's ids put to rank 0 carry a row rank 0 does not hold (a corrupt peer, injected at its runtime
    put); rank 0 must refuse them before its TBE reads them, and abort rank 1 instead of hanging it."""
    model = default_model()
    types = all_tables(model, PGAS_ROW_WISE) if kind == PGAS_ROW_WISE else spread_tables(model, world)
    sharded = shard(model, types, dist.group.WORLD, CPU, SMALL)
    if rank == 1:
        for step in pgas_steps(sharded):
            put, layout = step.rt.put, step.layout

            def corrupt(buf: Any, dest: int, offset: int, data: torch.Tensor, put: Any = put, layout: Any = layout) -> None:
                if dest == 0 and offset % layout.index_block_bytes == layout.ids_off and data.numel():
                    data = data.clone()
                    data[0] = 10**6
                put(buf, dest, offset, data)

            step.rt.put = corrupt  # type: ignore[method-assign]
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


def test_feature_owners_must_match_the_ranks_and_the_lookup_range() -> None:
    """The kernels index peer buffers by owner: inconsistent owners are refused before any launch."""
    from types import SimpleNamespace

    from torchrec_pgas.sharding.device.features import FeatureOwners
    from torchrec_pgas.sharding.stages import pooled_output_dtype

    FeatureOwners([0, 0, 0], 3, [0, 1, 0], (0, 3), False).check(world=3, rank=2)  # row-wise
    FeatureOwners([0, 1, 1, 2], 1, [0] * 4, (1, 3), True).check(world=3, rank=1)  # table-wise
    for bad in (FeatureOwners([0, 3], 1, [0, 0], (0, 1), True),  # owner 3 of 3 ranks
                FeatureOwners([0, 1], 1, [0, 0], (0, 2), True),  # serves feature 1 it does not hold
                FeatureOwners([0, 0], 3, [0, 0], (0, 2), False)):  # 3 row blocks on 2 ranks
        with pytest.raises(PgasError, match="inconsistent feature owners"):
            bad.check(world=2, rank=0)

    def info(name: str, fused: Any) -> Any:
        return SimpleNamespace(embedding_config=SimpleNamespace(name=name), fused_params=fused)

    from fbgemm_gpu.split_embedding_configs import SparseType

    assert pooled_output_dtype([info("a", None), info("b", {})], "k") == torch.float32
    assert pooled_output_dtype([info("a", {"output_dtype": SparseType.FP16})], "k") == torch.float16
    with pytest.raises(PgasError, match="one output dtype.*'b': 'fp16'"):
        pooled_output_dtype([info("a", None), info("b", {"output_dtype": SparseType.FP16})], "pgas_table_wise")
