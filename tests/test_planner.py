"""The planner extension on CPU: cost-model arithmetic, the fit, PgasEnumerator in TorchRec's planner."""

import copy
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from torchrec_pgas import PgasConfig, PgasEmbeddingBagCollectionSharder
from torchrec_pgas.planner.calibrate import TRAIN_COLUMNS, fit, prediction_table, validate
from torchrec_pgas.planner.cost_model import (
    BWD,
    NCCL_RW,
    NCCL_TW,
    PGAS_RW,
    PGAS_TW,
    Coefficients,
    CostModel,
    HardwareProfile,
    StepBytes,
    TableLoad,
    backward_bytes,
    expected_owners,
    fit_coefficients,
    load_profile,
    table_bytes,
)
from torchrec_pgas.placement import rank_placement
from torchrec_pgas.planner.enumerator import PgasDecisionStats, PgasEnumerator
from torchrec_pgas.planner.explain import explain
from torchrec_pgas.planner.inter_node import (
    PGAS_TABLE_ROW_WISE,
    TABLE_ROW_WISE,
    InterNodeLink,
    StepShape,
    TableRowWiseCost,
    inter_node_bytes,
)
from torchrec_pgas.testing import copy_state_dict, default_model, random_kjt, run_distributed, seeded, shard


def _planner(topo: Topology, batch: int, **kwargs: Any) -> EmbeddingShardingPlanner:
    """TorchRec's planner, its storage reservation given: without one TorchRec 1.9 warns (FutureWarning, an
    error here) that its default, HeuristicalStorageReservation, is known to cause issues."""
    return EmbeddingShardingPlanner(topology=topo, batch_size=batch,
                                    storage_reservation=FixedPercentageStorageReservation(percentage=0.15), **kwargs)


def _profile(nccl: Coefficients, pgas: Coefficients) -> HardwareProfile:
    return HardwareProfile("test", "test", 2, "hand-made", {"eager": {NCCL_RW: nccl, PGAS_RW: pgas}})


def test_bytes_per_table_by_hand() -> None:
    t = TableLoad("t", rows=100, dim=8, pooling=[2.0, 3.0])  # 2 features, fp32
    # batch 10/rank, W=4: 50 ids, 20 bags; 3/4 of the ids and 3 of 4 partials cross; 32-byte partials
    pgas = table_bytes(t, 10, 4, PGAS_RW)
    assert (pgas.hbm, pgas.wire, pgas.local) == (50 * 32, 50 * 4 * 0.75 + 20 * 32 * 3, 20 * 32 * 4)
    assert table_bytes(t, 10, 4, NCCL_RW).wire == 50 * 8 * 0.75 + 20 * 32 * 3


def test_expected_owners_per_bag() -> None:
    assert expected_owners(1.0, 8) == pytest.approx(1.0)  # one id: one owner
    assert expected_owners(0.0, 8) == 0.0
    assert expected_owners(2.0, 4) == pytest.approx(4 * (1 - 0.75 ** 2))  # 1.75
    assert expected_owners(500.0, 4) == pytest.approx(4.0)  # many ids: every owner
    assert expected_owners(7.0, 1) == 1.0  # table-wise: the one owner


def test_backward_bytes_by_hand() -> None:
    """Same table as the forward's: 50 ids, 20 bags per rank, W=4, 32-byte fp32 gradient rows and rows."""
    t = TableLoad("t", rows=100, dim=8, pooling=[2.0, 3.0])
    tbe = 2 * 50 * 32 + 4 * 20 * 32  # read + write the 50 rows this owner serves, read W ranks' bag gradients
    # stock RW: the reduce-scatter's backward all-gathers the gradient: W-1 ranks' bags in, its own copied
    assert backward_bytes(t, 10, 4, NCCL_RW) == StepBytes(hbm=tbe, wire=3 * 20 * 32, local=20 * 32)
    # PGAS RW: a bag's row goes only to the owners of its ids (1.75 of 4 for L=2, 2.3125 for L=3), 3/4
    # of them remote; the owner also replays the lookup (one more gather of its 50 rows)
    owners = 10 * (1.75 + 2.3125)  # (bag, owner) pairs: 40.625
    pgas = backward_bytes(t, 10, 4, PGAS_RW)
    assert (pgas.hbm, pgas.wire, pgas.local) == pytest.approx((tbe + 50 * 32, owners * 32 * 0.75, owners * 32 / 4))
    assert (pgas.hbm, pgas.wire, pgas.local) == pytest.approx((7360, 975, 325))  # all-gather: 5760, 1920, 640
    # TW: the owner updates all 4 ranks' 200 rows and receives the other 3 ranks' bags (PGAS one-sided)
    tw = StepBytes(hbm=2 * 200 * 32 + 4 * 20 * 32, wire=3 * 20 * 32, local=20 * 32)
    assert backward_bytes(t, 10, 4, NCCL_TW) == tw
    assert backward_bytes(t, 10, 4, PGAS_TW) == StepBytes(tw.hbm + 200 * 32, tw.wire, tw.local)


def test_training_prices_forward_and_backward_and_fitted_backward_coefficients_win() -> None:
    """Without backward coefficients the backward's bytes go at the forward's per-byte prices and no fixed
    cost; a profile's "<backend>_bwd" entry replaces them (and survives the JSON round trip)."""
    fwd = Coefficients(1.0, 1e-9, 2e-9, 3e-9)
    prof = _profile(fwd, fwd)
    t = TableLoad("t", rows=100, dim=8, pooling=[2.0, 3.0])
    infer, train = CostModel(prof, 4, 10), CostModel(prof, 4, 10, training=True)
    assert infer.table_price(t, PGAS_RW, 2)[2:] == (0.0, 0.0)
    b = backward_bytes(t, 10, 4, PGAS_RW)
    price = train.table_price(t, PGAS_RW, 2)
    assert price[:2] == infer.table_price(t, PGAS_RW, 2)[:2]  # the forward is as in inference
    assert price.bwd_compute == pytest.approx(b.hbm * 1e-9)
    assert price.bwd_comms == pytest.approx(b.wire * 2e-9 + b.local * 3e-9)  # no fixed cost
    assert train.table_ms(t, PGAS_RW, 2) == pytest.approx(infer.table_ms(t, PGAS_RW, 2) + b.hbm * 1e-9
                                                          + b.wire * 2e-9 + b.local * 3e-9)
    assert train.step_ms([t], NCCL_RW) == pytest.approx(infer.step_ms([t], NCCL_RW) + sum(
        x * k for x, k in zip(dataclasses.astuple(backward_bytes(t, 10, 4, NCCL_RW)), (1e-9, 2e-9, 3e-9))))
    bwd = Coefficients(0.5, 1e-8, 0.0, 0.0)
    fitted = HardwareProfile.from_json(HardwareProfile(
        "bwd", "test", 4, "hand-made", {"eager": {NCCL_RW: fwd, PGAS_RW: fwd, PGAS_RW + "_bwd": bwd}}).to_json())
    model = CostModel(fitted, 4, 10, training=True)
    assert model.backends == [NCCL_RW, PGAS_RW] and fitted.has_backward(PGAS_RW) and not fitted.has_backward(NCCL_RW)
    got = model.table_price(t, PGAS_RW, 2)
    assert (got.bwd_compute, got.bwd_comms) == pytest.approx((b.hbm * 1e-8, 0.5 / 2))  # half the fixed cost
    assert model.alpha_ms(PGAS_RW) == 1.5 and model.alpha_ms(NCCL_RW) == 1.0
    assert model.table_price(t, NCCL_RW, 2) == train.table_price(t, NCCL_RW, 2)  # not fitted: forward's
    # the shipped 8x H200 profile was fitted on forward runs only; the 2-GPU ones on training runs too
    assert not any(load_profile(world_size=8).has_backward(b) for b in (NCCL_RW, PGAS_RW))
    assert all(load_profile(world_size=2).has_backward(b) for b in (NCCL_RW, PGAS_RW, NCCL_TW, PGAS_TW))


def test_step_and_table_prices_and_the_choice() -> None:
    # NCCL: large fixed cost, fast bytes; PGAS: small fixed cost, slow gather (a made-up machine)
    prof = _profile(Coefficients(1.0, 1e-9, 0.0, 0.0), Coefficients(0.1, 1e-8, 0.0, 0.0))
    model = CostModel(prof, world_size=2, batch_per_rank=1000)
    small, big = TableLoad("small", 10, 4, [1.0]), TableLoad("big", 10**6, 256, [100.0])
    # big: 1e5 ids * 1 KiB = 1.024e8 bytes -> nccl 0.1024 ms, pgas 1.024 ms of gather
    assert model.marginal_ms(big, NCCL_RW) == pytest.approx(0.1024)
    assert model.step_ms([small, big], PGAS_RW) == pytest.approx(0.1 + 1.024 + 1.6e-4)
    assert model.table_ms(big, NCCL_RW, num_tables=2) == pytest.approx(0.5 + 0.1024)
    # per table, small goes PGAS and big NCCL; but that step pays both fixed costs, and all-NCCL is faster
    mixed = {"small": PGAS_RW, "big": NCCL_RW}
    assert model.plan_ms([small, big], mixed) > model.step_ms([small, big], NCCL_RW)
    assert model.choose([small, big]) == {"small": NCCL_RW, "big": NCCL_RW}
    assert model.step_ms([], PGAS_RW) == 0.0


def test_fit_recovers_known_coefficients_and_never_goes_negative() -> None:
    truth = Coefficients(0.2, 3e-10, 2e-9, 0.0)
    samples = [{"hbm": h, "wire": w, "local": lo,
                "ms": truth.alpha_ms + h * truth.k_hbm + w * truth.k_wire + lo * truth.k_local}
               for h, w, lo in [(1e6, 1e5, 1e4), (1e9, 1e7, 5e6), (1e7, 1e8, 1e5), (5e8, 3e5, 2e7), (1e3, 1e3, 1e3)]]
    got = fit_coefficients(samples)
    for a, b in zip((got.alpha_ms, got.k_hbm, got.k_wire), (truth.alpha_ms, truth.k_hbm, truth.k_wire)):
        assert a == pytest.approx(b, rel=1e-6)
    assert got.k_local == pytest.approx(0.0, abs=1e-15) and got.k_local >= 0


def _result_row(tables: int, batch: int, pooling: int, prof: HardwareProfile, world: int = 2,
                train: bool = False, dim: int = 32) -> Dict[str, Any]:
    """A row-wise pair's benchmark row measured exactly as ``prof`` prices it; ``train``: a training run's."""
    row = {"preset": "s004", "name": f"t{tables}-b{batch}-p{pooling}-d{dim}", "tables": tables, "rows": 1000,
           "dim": dim, "batch_per_gpu": batch, "pooling": pooling, "pooling_dist": "fixed", "ids": "uniform",
           "world_size": world}
    loads = [TableLoad(f"t{i}", 1000, dim, [float(pooling)]) for i in range(tables)]
    model = CostModel(prof, world, batch)
    row["stock_p50_ms"] = model.step_ms(loads, NCCL_RW)
    row["pgas_p50_ms"] = model.step_ms(loads, PGAS_RW)
    row["pgas_graph_p50_ms"] = row["pgas_p50_ms"] / 2
    if train:
        trained = CostModel(prof, world, batch, training=True)
        row.update(mode="train", optimizer="EXACT_ROWWISE_ADAGRAD", stock_train_p50_ms=trained.step_ms(loads, NCCL_RW),
                   pgas_train_p50_ms=trained.step_ms(loads, PGAS_RW))
    return row


def test_calibration_fits_a_benchmark_run() -> None:
    prof = _profile(Coefficients(2.0, 5e-10, 1e-9, 6e-10), Coefficients(0.25, 3e-10, 2e-9, 1e-10))
    rows = [_result_row(t, b, p, prof) for t in (2, 8, 64) for b in (128, 4096) for p in (4, 16)]
    results = {"meta": {"presets": ["s004"], "commit": "x", "date": "d", "world_size": 2, "device": "GPU"},
               "rows": rows}
    fitted = fit(results, "fit")
    assert fitted.get(PGAS_RW, "eager").alpha_ms == pytest.approx(0.25, rel=1e-4)
    assert fitted.get(NCCL_RW, "graph") == fitted.get(NCCL_RW, "eager")  # stock has no graph mode
    _, errors = prediction_table(fitted, results)
    assert max(largest for _, largest in errors.values()) < 1e-4


# Forward and backward truths of the row-wise pair. The backward's k_wire is the forward's: at one world size
# the backward's wire bytes are W - 1 times its local ones, so a fit takes the wire's price from the forward.
FWD_TRUTH = {NCCL_RW: Coefficients(2.0, 5e-10, 1e-9, 6e-10), PGAS_RW: Coefficients(0.25, 3e-10, 2e-9, 1e-10)}
BWD_TRUTH = {NCCL_RW: Coefficients(1.0, 8e-10, 1e-9, 4e-10), PGAS_RW: Coefficients(0.5, 6e-10, 2e-9, 3e-10)}
TRUTH = HardwareProfile("truth", "test", 2, "hand-made",
                        {"eager": {**FWD_TRUTH, **{b + BWD: c for b, c in BWD_TRUTH.items()}}})
META = {"presets": ["s004"], "commit": "x", "date": "d", "world_size": 2, "device": "GPU"}


def _grid(world: int = 2, train: bool = False) -> List[Dict[str, Any]]:
    """16 workloads; two dims, else a forward's wire bytes are a sum of its HBM and local ones."""
    return [_result_row(t, b, p, TRUTH, world, train, d) for t in (2, 64) for b in (128, 4096) for p in (4, 16)
            for d in (16, 128)]


def _close(got: Coefficients, want: Coefficients) -> bool:
    return all(g == pytest.approx(w, rel=1e-6, abs=1e-15)
               for g, w in zip(dataclasses.astuple(got), dataclasses.astuple(want)))


def test_fit_holds_known_terms() -> None:
    """A term in ``known`` keeps its price and the others fit the rest of each sample's ms; without it, a
    term the samples have no bytes of is not fitted into a price (0)."""
    truth = Coefficients(0.2, 3e-10, 2e-9, 5e-10)
    points = [(1e6, 1e5, 1e4), (1e9, 1e7, 5e6), (1e7, 1e8, 1e5), (5e8, 3e5, 2e7), (1e3, 1e3, 1e3)]
    samples = [{"hbm": h, "wire": w, "local": lo, "ms": 0.2 + h * 3e-10 + w * 2e-9 + lo * 5e-10}
               for h, w, lo in points]
    assert _close(fit_coefficients(samples, {"wire": 2e-9}), truth)
    wrong = fit_coefficients(samples, {"wire": 1e-9})  # held where told, even when the samples disagree
    assert wrong.k_wire == 1e-9 and not _close(wrong, truth)
    no_wire = [{**s, "wire": 0.0, "ms": s["ms"] - s["wire"] * 2e-9} for s in samples]
    assert _close(fit_coefficients(no_wire, {"wire": 7e-9}), dataclasses.replace(truth, k_wire=7e-9))
    assert _close(fit_coefficients(no_wire), dataclasses.replace(truth, k_wire=0.0))


@pytest.mark.parametrize("forward_rows", [False, True])
def test_fit_recovers_backward_coefficients_from_training_rows(forward_rows: bool) -> None:
    """Training rows fit the forward (their forward columns) and each backend's backward on the step less
    the forward; next to forward-only rows too. The backward is eager only, so graph mode gets the same."""
    rows = _grid(train=True) + (_grid() if forward_rows else [])
    results = {"meta": META, "rows": rows}
    fitted = fit(results, "fit")
    for b in (NCCL_RW, PGAS_RW):
        assert _close(fitted.get(b, "eager"), FWD_TRUTH[b]), b
        assert fitted.has_backward(b) and _close(fitted.backward(b, "eager"), BWD_TRUTH[b]), b
        assert fitted.backward(b, "graph") == fitted.backward(b, "eager")
    assert "backward: 16 training rows, EXACT_ROWWISE_ADAGRAD, k_wire the forward's" in fitted.source
    table, errors = prediction_table(fitted, results)
    assert {k.split("/", 1)[1] for k in errors} == {"eager/fwd", "graph/fwd", "eager/bwd", "eager/train"}
    assert max(largest for _, largest in errors.values()) < 1e-6
    assert table.count(" bwd ") == table.count(" train ") == 2 * 16
    assert HardwareProfile.from_json(fitted.to_json()).backward(PGAS_RW, "eager") == fitted.backward(PGAS_RW, "eager")
    forward_only = fit({"meta": META, "rows": _grid()}, "fwd")
    assert not forward_only.has_backward(NCCL_RW) and "backward" not in forward_only.source


def test_backward_fit_weighs_a_row_by_its_step() -> None:
    """One training row's stock forward measured 1 ms slow (host noise), so its step less that forward is
    0.01 ms: fitted in the step's relative error, the backward still prices every step within 1%; in the
    difference's own relative error that row would pull the stock backward's fixed cost to ~0 and every
    other stock step ~30% low."""
    train = _grid(train=True)
    train[0]["stock_p50_ms"] = train[0]["stock_train_p50_ms"] - 0.01
    results = {"meta": META, "rows": train + _grid()}
    fitted = fit(results, "noisy")
    _, errors = prediction_table(fitted, results)
    assert errors[f"{NCCL_RW}/eager/train"][1] < 0.01
    assert fitted.backward(NCCL_RW, "eager").alpha_ms == pytest.approx(BWD_TRUTH[NCCL_RW].alpha_ms, rel=0.05)


def test_owner_backward_named_and_never_mixed() -> None:
    """``merge`` tags a training run's rows with its owner backward, which the profile's source names; one
    fit of training runs of both owner backwards is refused (one backward cannot price both)."""
    from torchrec_pgas.planner.calibrate import merge

    runs = [{"meta": {**META, "mode": "train", "owner_backward": owner}, "rows": _grid(train=True)}
            for owner in ("fbgemm", "pgas")]
    forward = {"meta": {**META, "mode": "forward", "owner_backward": "fbgemm"}, "rows": _grid()}
    assert ", FBGEMM owner backward, k_wire" in fit(merge([forward, runs[0]]), "fbgemm").source
    with pytest.raises(ValueError, match="different owner backwards"):
        fit(merge(runs), "mixed")


def test_backward_fit_at_one_gpu_invents_no_wire_price() -> None:
    """At W = 1 a backward has no wire bytes: the owner's terms (fixed, HBM, local) are fitted and the wire
    keeps the forward's price, here known from forward rows at W = 2 (``fit`` takes rows of any size)."""
    fitted = fit({"meta": META, "rows": _grid(world=1, train=True) + _grid()}, "w1")
    for b in (NCCL_RW, PGAS_RW):
        bwd = fitted.backward(b, "eager")
        assert bwd.k_wire == fitted.get(b, "eager").k_wire == pytest.approx(FWD_TRUTH[b].k_wire, rel=1e-6)
        assert _close(bwd, BWD_TRUTH[b]), b
    alone = fit({"meta": {**META, "world_size": 1}, "rows": _grid(world=1, train=True)}, "w1")
    assert all(alone.backward(b, "eager").k_wire == alone.get(b, "eager").k_wire for b in (NCCL_RW, PGAS_RW))


def test_backward_from_one_gpu_joins_a_multi_gpu_forward_profile() -> None:
    """``fit(..., base=)``: a W = 1 training run adds its backward terms to a W = 2 forward profile, whose
    forward coefficients, world size and wire price stay (the eager forward's: graph mode's backward is the eager
    one, whatever the graph forward's price); results without training rows are refused."""
    base = fit({"meta": META, "rows": _grid()}, "fwd")
    for b in (NCCL_RW, PGAS_RW):
        base.coefficients["graph"][b] = dataclasses.replace(base.get(b, "eager"), k_wire=1e-9)
    joined = fit({"meta": {**META, "world_size": 1}, "rows": _grid(world=1, train=True)}, "joined", base=base)
    assert (joined.world_size, joined.device) == (base.world_size, base.device)
    assert "backward (replacing any above) from" in joined.source
    for b in (NCCL_RW, PGAS_RW):
        assert joined.get(b, "eager") == base.get(b, "eager") and joined.has_backward(b, "graph")
        assert joined.backward(b, "eager").k_wire == base.get(b, "eager").k_wire
        assert joined.backward(b, "graph") == joined.backward(b, "eager")
        assert _close(joined.backward(b, "eager"), BWD_TRUTH[b]), b
    with pytest.raises(ValueError, match="no training rows"):
        fit({"meta": {**META, "world_size": 1}, "rows": _grid(world=1)}, "none", base=base)


def test_in_sample_errors_of_the_training_terms_by_hand() -> None:
    """Fixed costs only: the model says nccl fwd 1.0 + bwd 0.5 = train 1.5 ms, pgas 0.2 + 0.3 = 0.5 ms."""
    prof = HardwareProfile("hand", "test", 2, "hand-made", {"eager": {
        NCCL_RW: Coefficients(1.0, 0, 0, 0), NCCL_RW + BWD: Coefficients(0.5, 0, 0, 0),
        PGAS_RW: Coefficients(0.2, 0, 0, 0), PGAS_RW + BWD: Coefficients(0.3, 0, 0, 0)}})
    base = {"preset": "p", "tables": 1, "rows": 10, "dim": 4, "batch_per_gpu": 8, "pooling": 1,
            "pooling_dist": "fixed", "ids": "uniform", "world_size": 2, "mode": "train"}
    rows = [{**base, "name": "off", "stock_p50_ms": 1.25, "stock_train_p50_ms": 2.0, "pgas_p50_ms": 0.2,
             "pgas_train_p50_ms": 0.4},
            {**base, "name": "exact", "stock_p50_ms": 1.0, "stock_train_p50_ms": 1.5, "pgas_p50_ms": 0.2,
             "pgas_train_p50_ms": 0.5},
            {**base, "name": "skewed", "ids": "zipf", "stock_p50_ms": 9.0, "stock_train_p50_ms": 99.0}]
    table, errors = prediction_table(prof, {"rows": rows})
    lines = [line.split() for line in table.splitlines()[1:]]
    # a backward's error is a share of the step: nccl (0.5 - 0.75) / 2.0, pgas (0.3 - 0.2) / 0.4
    assert ["p/off", "eager", "bwd", NCCL_RW, "0.750", "0.500", "-12.5%"] in lines
    assert ["p/off", "eager", "train", PGAS_RW, "0.400", "0.500", "+25.0%"] in lines
    assert len(lines) == 12 and not any(line[0] == "p/skewed" for line in lines)
    assert errors[f"{NCCL_RW}/eager/bwd"] == pytest.approx((0.0625, 0.125))
    assert errors[f"{NCCL_RW}/eager/train"] == pytest.approx((0.125, 0.25))
    assert errors[f"{NCCL_RW}/eager/fwd"] == pytest.approx((0.1, 0.2))
    assert errors[f"{PGAS_RW}/eager/bwd"] == pytest.approx((0.125, 0.25))


def test_leave_one_out_validation_and_regret() -> None:
    """Rows that follow the model are predicted exactly from the others and chosen right; a row measured
    against the model's choice shows up as regret (the measured ratio of the two backends)."""
    prof = _profile(Coefficients(2.0, 5e-10, 1e-9, 6e-10), Coefficients(0.25, 3e-10, 2e-9, 1e-10))
    rows = [_result_row(t, b, p, prof) for t in (2, 8, 64) for b in (128, 4096) for p in (4, 16)]
    meta = {"presets": ["s004"], "commit": "x", "date": "d", "world_size": 2, "device": "GPU"}
    out, summary = validate({"meta": meta, "rows": rows}, "s004")
    assert len(out) == 3 * len(rows) and list(summary) == ["inference"]  # nccl eager, pgas eager, pgas graph
    inference = summary["inference"]
    assert inference["median_abs_error"] < 1e-4 and inference["max_regret"] == 0 and inference["within_5pct"] == 1
    rows[0]["pgas_p50_ms"] = rows[0]["stock_p50_ms"] * 1.5  # the model still says PGAS for this config
    out, summary = validate({"meta": meta, "rows": rows}, "s004")
    bad = [v for v in out if v["workload"] == rows[0]["name"] and v["mode"] == "eager"]
    assert {v["chosen"] for v in bad} == {PGAS_RW} and bad[0]["regret"] == pytest.approx(0.5)
    inference = summary["inference"]
    assert inference["max_regret"] == pytest.approx(0.5) and inference["within_5pct"] == pytest.approx(23 / 24)
    for r in rows:  # a run without graph captures (CPU, --no-graph): eager rows only
        r["pgas_graph_p50_ms"] = None
    out, _ = validate({"meta": meta, "rows": rows}, "s004")
    assert len(out) == 2 * len(rows) and {v["mode"] for v in out} == {"eager"}
    with pytest.raises(ValueError, match="no uniform-id rows of preset 's000-weak'"):
        validate({"meta": meta, "rows": rows}, "s000-weak")


def test_validation_of_forward_and_training_runs() -> None:
    """With a forward run and a training run of each workload, the forward is checked against the forward
    run's (the training run's forward columns, here 10% slower, are timed between training steps) and the
    training step (mode "train") against the training run's; one summary per kind."""
    train = _grid(train=True)
    for r in train:
        r["stock_p50_ms"], r["pgas_p50_ms"] = 1.1 * r["stock_p50_ms"], 1.1 * r["pgas_p50_ms"]
    forward = {r["name"]: r for r in _grid()}
    out, summary = validate({"meta": META, "rows": list(forward.values()) + train}, "s004")
    assert len(out) == 5 * len(train) and list(summary) == ["inference", "training"]
    columns = {("eager", NCCL_RW): "stock_p50_ms", ("eager", PGAS_RW): "pgas_p50_ms",
               ("graph", PGAS_RW): "pgas_graph_p50_ms"}
    for v in out:
        if v["mode"] == "train":
            measured = next(r for r in train if r["name"] == v["workload"])[TRAIN_COLUMNS[v["backend"] == PGAS_RW]]
        else:
            measured = forward[v["workload"]][columns[v["mode"], v["backend"]]]
        assert v["measured_ms"] == measured
    assert summary["training"]["max_regret"] == 0 and summary["training"]["median_abs_error"] < 0.05


H100 = "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name() on the 2x H100 machine


def _committed_results(prof: HardwareProfile) -> List[str]:
    """The results files of the run a shipped profile was fitted on (its source names the commit): committed,
    so the fit can be redone and checked."""
    commit = re.search(r"commit (\w+)", prof.source)
    assert commit is not None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return glob.glob(os.path.join(root, "benchmarks", "results", f"*-{commit.group(1)}*", "**", "results.json*"),
                     recursive=True)


@pytest.mark.parametrize("device,world,gpu,fitted_at", [
    (None, 2, "H200", 2), (None, 8, "H200", 8), (None, 4, "H200", 2), (None, None, "H200", 2),
    ("NVIDIA H200", 8, "H200", 8), (H100, 2, "H100", 2), (H100, 8, "H100", 2)])
def test_shipped_profile_loads_and_unknown_hardware_warns(device: Optional[str], world: Optional[int], gpu: str,
                                                          fitted_at: int) -> None:
    """The profile fitted on the planner's GPU (H200 if unnamed) at its world size when one is shipped, else
    that GPU's 2-GPU one; a GPU without a profile gets H200's, with a warning."""
    prof = load_profile(device_name=device, world_size=world)
    assert prof.world_size == fitted_at and gpu in prof.device and _committed_results(prof)
    with pytest.warns(UserWarning, match="no hardware profile for 'NVIDIA A100'.*H200"):
        load_profile(device_name="NVIDIA A100", world_size=world)


def test_shipped_h100_profile_has_training_terms() -> None:
    """The 2x H100 profile was fitted on its forward runs, its backward on training runs with the owner update
    (the default): every backend has backward terms, graph mode's the eager ones (the training benchmark times
    the eager step)."""
    prof = load_profile(device_name=H100, world_size=2)
    assert "7761925" in prof.source and "3ae36b2" in prof.source and "PGAS owner backward" in prof.source
    assert _committed_results(prof)
    for b in (NCCL_RW, PGAS_RW, NCCL_TW, PGAS_TW):
        assert prof.has_backward(b, "eager") and prof.backward(b, "graph") == prof.backward(b, "eager")


def test_enumerator_prices_with_the_local_gpus_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning for CUDA on a host with a GPU uses that GPU's shipped profile; a dry run without one, H200's."""
    assert "H200" in PgasEnumerator(Topology(world_size=2, compute_device="cpu"), 8).model.profile.device
    topo = Topology(world_size=2, compute_device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    assert PgasEnumerator(topo, 8).model.profile.device == "2x " + H100


CONSTRAINTS = {
    "t0": ParameterConstraints(sharding_types=["row_wise", "pgas_row_wise"]),
    "t1": ParameterConstraints(sharding_types=["row_wise"]),
    "t2": ParameterConstraints(sharding_types=["table_wise"]),
    "t3": ParameterConstraints(sharding_types=["pgas_row_wise"]),
    **{f"w{i}": ParameterConstraints(sharding_types=["row_wise", "pgas_row_wise"]) for i in range(4)},
}


def _plan_reasons(backends: str) -> Dict[str, str]:
    """The reason column of the decision table, per table."""
    topo = Topology(world_size=2, compute_device="cuda")
    stats = PgasDecisionStats()
    _planner(topo, 8, constraints=CONSTRAINTS, stats=[stats],
             enumerator=PgasEnumerator(topo, 8, constraints=CONSTRAINTS, backends=backends),
             ).plan(default_model(), [PgasEmbeddingBagCollectionSharder()])
    assert stats.lines[0].split()[:6] == ["table", "rows", "dim", "pool", "HBM", "MB"]
    # name, rows, dim, pool, HBM, wire, four prices, reason..., choice
    return {line.split()[0]: " ".join(line.split()[10:-1]) for line in stats.lines[1:]}


def test_decision_table_says_why() -> None:
    auto, nccl = _plan_reasons("auto"), _plan_reasons("nccl")
    # every table here is constrained to fewer than the four options (t0, w*: the row-wise pair)
    assert auto["t0"] == auto["t1"] == auto["t2"] == auto["t3"] == auto["w0"] == "constraints"
    assert nccl["t0"] == "backends=nccl" and nccl["t3"] == "constraints"


def _plan_types(backends: str = "auto", training: bool = False) -> Dict[str, str]:
    # Planning is a dry run: a CUDA topology needs no GPU (TorchRec offers no row-wise on CPU). The H200 profile
    # on any host (on a GPU host the enumerator would take that GPU's).
    topo = Topology(world_size=2, compute_device="cuda")
    enumerator = PgasEnumerator(topo, 8, constraints=CONSTRAINTS, backends=backends, training=training,
                                profile=load_profile(world_size=2))
    stats = PgasDecisionStats()
    planner = _planner(topo, 8, enumerator=enumerator, constraints=CONSTRAINTS, stats=[stats])
    plan = planner.plan(default_model(), [PgasEmbeddingBagCollectionSharder()])
    types = {t: ps.sharding_type for m in plan.plan.values() for t, ps in m.items()}
    rows = {line.split()[0]: line.split()[-1] for line in stats.lines[1:]}
    assert rows == types  # the stats table names every RW- and TW-family table with its choice
    return types


def _unpriced_perfs(profile: HardwareProfile, training: bool) -> Dict[str, Any]:
    """Shard perfs of the options TorchRec prices itself (t1 row-wise, t2 table-wise, both on UVM caching)."""
    uvm = ["fused_uvm_caching"]
    constraints = {"t1": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=uvm),
                   "t2": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=uvm)}
    enumerator = PgasEnumerator(Topology(world_size=2, compute_device="cuda"), 8, constraints=constraints,
                                training=training, profile=profile)
    options = enumerator.enumerate(default_model(), [PgasEmbeddingBagCollectionSharder()])
    return {o.name: o.shards[0].perf for o in options if o.name in constraints}


def test_options_torchrec_prices_carry_stock_fixed_costs_as_the_priced_ones() -> None:
    """A non-fused option pays stock's fixed costs as ``table_price`` shares them (n = 8 tables, W = 2):
    row-wise 1 / n of nccl_rw's on each shard, table-wise W / n of nccl_tw's on its owner; the backward's
    only when training. Checked as the difference a profile with 1 ms more fixed cost makes."""
    base = load_profile(world_size=2)
    eager = {b: dataclasses.replace(c, alpha_ms=c.alpha_ms + 1.0) for b, c in base.coefficients["eager"].items()}
    dearer = dataclasses.replace(base, coefficients={**base.coefficients, "eager": eager})
    for training in (False, True):
        cheap, dear = _unpriced_perfs(base, training), _unpriced_perfs(dearer, training)
        for name, share in (("t1", 1 / 8), ("t2", 2 / 8)):
            assert dear[name].fwd_comms - cheap[name].fwd_comms == pytest.approx(share)
            assert dear[name].bwd_comms - cheap[name].bwd_comms == pytest.approx(share if training else 0.0)
            assert (dear[name].fwd_compute, dear[name].bwd_compute) == (cheap[name].fwd_compute,
                                                                       cheap[name].bwd_compute)


@pytest.mark.stacks
def test_enumerator_prices_both_and_honours_constraints_and_modes() -> None:
    auto = _plan_types()
    # the shipped H200 profile: PGAS's fixed cost is ~8x lower, so every free RW table goes PGAS
    assert auto == {"t0": "pgas_row_wise", "t1": "row_wise", "t2": "table_wise", "t3": "pgas_row_wise",
                    **{f"w{i}": "pgas_row_wise" for i in range(4)}}
    nccl = _plan_types("nccl")  # t3's constraint (PGAS only) wins over the preference
    assert nccl == {**auto, "t0": "row_wise", **{f"w{i}": "row_wise" for i in range(4)}}
    # training offers the PGAS types too (t3 allows only PGAS); at batch 8 the backward changes nothing
    assert _plan_types(training=True) == auto and _plan_types("nccl", training=True) == nccl
    with pytest.raises(ValueError, match="backends"):
        PgasEnumerator(Topology(world_size=2, compute_device="cuda"), 8, backends="mpi")


def _plan_beyond_one_node(constraints: Dict[str, ParameterConstraints],
                          model: Optional[nn.Module] = None) -> Tuple[Dict[str, Any], List[str]]:
    """Two nodes of two GPUs (TorchRec's intra_group_size 2, world 4), at 4096 bags a GPU: the plan's
    ParameterShardings by table, and the decision table."""
    topo = Topology(world_size=4, local_world_size=2, compute_device="cuda")
    stats = PgasDecisionStats()
    enumerator = PgasEnumerator(topo, 4096, constraints=constraints, profile=load_profile(world_size=2))
    plan = _planner(topo, 4096, enumerator=enumerator, constraints=constraints, stats=[stats],
                    callbacks=[enumerator.name_pgas_table_row_wise]).plan(model or default_model(),
                                                                          [PgasEmbeddingBagCollectionSharder()])
    return {t: ps for m in plan.plan.values() for t, ps in m.items()}, stats.lines


def test_beyond_one_nvlink_domain_table_row_wise_and_its_pgas_twin_are_priced() -> None:
    """Beyond one NVLink domain the one-sided row-wise and table-wise types are never offered; table_row_wise and
    pgas_table_row_wise are, priced by the inter-node model (the node's row-wise step at N·B bags, the rail bytes
    over the link): the planner picks pgas_table_row_wise for the tables it prices lower,
    each on the two ranks of one node, and its decision table shows both prices. (Each table is constrained to the
    pair: the test model's tables are small enough to be data parallel otherwise.)"""
    pair = ParameterConstraints(sharding_types=["table_row_wise", "pgas_table_row_wise"])
    shardings, lines = _plan_beyond_one_node({t: pair for t in [*(f"t{i}" for i in range(4)),
                                                                 *(f"w{i}" for i in range(4))]})
    types = {t: ps.sharding_type for t, ps in shardings.items()}
    assert not {"pgas_row_wise", "pgas_table_wise"} & set(types.values()), types
    assert "pgas_table_row_wise" in types.values(), types
    for module in ("t", "w"):  # every node holds a table of each module's node steps (dealt over the nodes)
        nodes = {ps.ranks[0] // 2 for t, ps in shardings.items() if t.startswith(module)}
        assert nodes == {0, 1}, (module, shardings)
    assert all(sorted(ps.ranks) in ([0, 1], [2, 3]) for ps in shardings.values()), shardings
    assert "table_row_wise ms" in lines[0] and "pgas_table_row_wise ms" in lines[0], lines[0]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    for t, cells in rows.items():
        twrw, pgas = float(cells[5]), float(cells[6])
        assert cells[-1] == ("pgas_table_row_wise" if pgas < twrw else types[t]), (t, cells)


def test_a_module_that_cannot_give_every_node_a_table_keeps_table_row_wise() -> None:
    """One table of a module may be table-row-wise (the others data parallel): its node step would leave the other
    node without a table, so the plan keeps it stock table_row_wise."""
    constraints = {f"w{i}": ParameterConstraints(sharding_types=["data_parallel"]) for i in range(1, 4)}
    constraints["w0"] = ParameterConstraints(sharding_types=["table_row_wise", "pgas_table_row_wise"])
    shardings, _ = _plan_beyond_one_node(constraints)
    assert shardings["w0"].sharding_type == "table_row_wise", shardings["w0"]


def _run_planned_table_row_wise(rank: int, world: int) -> Dict[str, float]:
    """The planner's 2 x 2 plan (every table offered the table-row-wise pair) sharded on CPUs (four processes
    declared two nodes), against the unsharded model."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    pair = ParameterConstraints(sharding_types=["table_row_wise", "pgas_table_row_wise"])
    model = default_model(min_rows=2)
    shardings, _ = _plan_beyond_one_node({c.name: pair for e in (model.ebc, model.webc)
                                          for c in e.embedding_bag_configs()}, model)
    plan = ShardingPlan({name: {t: ps for t, ps in shardings.items() if t in {c.name for c in ebc.embedding_bag_configs()}}
                         for name, ebc in (("ebc", model.ebc), ("webc", model.webc))})
    plan = rank_placement(world, "cpu").place_shards(plan)
    sharder = PgasEmbeddingBagCollectionSharder(pgas_config=PgasConfig(max_local_batch_size=8))
    sharded = DistributedModelParallel(copy.deepcopy(model), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                       device=torch.device("cpu"), plan=plan, sharders=[sharder])
    copy_state_dict(sharded.state_dict(), model.state_dict())
    gen = seeded(rank)
    kjt = random_kjt(model.ebc.embedding_bag_configs(), 8, gen)
    wkjt = random_kjt(model.webc.embedding_bag_configs(), 8, gen, weighted=True)
    with torch.no_grad():
        out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
    assert {ps.sharding_type for ps in shardings.values()} == {"pgas_table_row_wise"}, shardings
    return {k: float((out[k] - ref[k]).abs().max()) for k in ref}


def test_the_planned_table_row_wise_plan_runs_on_two_nodes() -> None:
    for rank, diffs in enumerate(run_distributed(_run_planned_table_row_wise, 4)):
        assert max(diffs.values()) < 1e-5, (rank, diffs)


def test_beyond_one_nvlink_domain_a_table_constrained_to_one_node_types_raises() -> None:
    """Constraints that allow only pgas_row_wise beyond one NVLink domain raise, naming the table and the types
    that cross nodes; the stock-only constrained tables stay stock."""
    free = {k: v for k, v in CONSTRAINTS.items() if k != "t3"}
    shardings, _ = _plan_beyond_one_node(free)
    assert not any(ps.sharding_type.startswith("pgas") for ps in shardings.values()), shardings
    topo = Topology(world_size=4, local_world_size=2, compute_device="cuda")
    with pytest.raises(ValueError, match=r"table t3: its constraints allow only \['pgas_row_wise'\].*allow "
                                         "pgas_table_row_wise or a stock type"):
        PgasEnumerator(topo, 8, constraints=CONSTRAINTS, profile=load_profile(world_size=2)).enumerate(
            default_model(), [PgasEmbeddingBagCollectionSharder()])


def _run_planned(rank: int, world: int, types: Dict[str, str]) -> Dict[str, float]:
    """The planned types on the shm backend, against the unsharded model (not stock: TorchRec 1.6.1's
    mean callback also divides a table_wise SUM feature next to a row_wise MEAN one, as here)."""
    model = default_model()
    sharded = shard(model, types, dist.group.WORLD, torch.device("cpu"), PgasConfig(max_local_batch_size=8))
    gen = seeded(rank)
    kjt = random_kjt(model.ebc.embedding_bag_configs(), 8, gen)
    wkjt = random_kjt(model.webc.embedding_bag_configs(), 8, gen, weighted=True)
    with torch.no_grad():
        out, ref = sharded(kjt, wkjt), model(kjt, wkjt)
    return {k: float((out[k] - ref[k]).abs().max()) for k in ref}


@pytest.mark.stacks
def test_planned_mixed_plan_runs_on_shm() -> None:
    types = _plan_types()
    assert {"pgas_row_wise", "row_wise", "table_wise"} <= set(types.values())
    for diffs in run_distributed(_run_planned, 2, types):
        assert max(diffs.values()) < 1e-5, diffs


@pytest.mark.stacks
def test_explain_cli(tmp_path: Any) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("world_size: 2\nbatch_per_rank: 1024\ntables:\n"
                   "  - {name: a, rows: 1000, dim: 16, pooling: 4}\n  - {name: b, rows: 50, dim: 8, pooling: [1, 2]}\n")
    out = subprocess.run([sys.executable, "-m", "torchrec_pgas.planner.explain", str(cfg)],
                         capture_output=True, text=True, check=True).stdout
    assert "pgas_row_wise" in out and out.count("\n") >= 4 and "all table_wise" in out


def test_explain_training() -> None:
    """Training: every price cell is "fwd+bwd", the header says so and which coefficients priced the backward
    (2x H200: fitted for all four; 8x H200, fitted on forward runs only: the forward's per-byte stand-in)."""
    cfg = {"world_size": 2, "batch_per_rank": 8192, "tables": [{"name": "a", "rows": 10**6, "dim": 128, "pooling": 32}]}
    infer, train = explain(cfg).splitlines(), explain({**cfg, "training": True}).splitlines()
    assert "training" not in infer[0] and "bwd: fitted for nccl_rw, pgas_rw, nccl_tw, pgas_tw" in train[0]
    assert "bwd: the forward's per-byte coefficients" in explain({**cfg, "world_size": 8, "training": True})
    assert "pgas_rw ms f+b" in train[1] and "f+b" not in infer[1]
    cells, plain = train[2].split()[6:10], infer[2].split()[6:10]
    assert all(float(c.split("+")[1]) > 0 for c in cells)
    assert [float(c.split("+")[0]) for c in cells] == [float(c) for c in plain]  # the forward as in inference


def test_explain_training_with_a_fitted_profile(tmp_path: Any) -> None:
    """A profile fitted on training rows prices the backward with its fitted terms, and says so; one fitted
    for some backends only names those and the stand-in for the rest."""
    fitted = fit({"meta": META, "rows": _grid(train=True)}, "fit")
    forward = HardwareProfile("fwd", "test", 2, "x", {"eager": {b: fitted.get(b, "eager") for b in FWD_TRUTH}})
    partial = HardwareProfile("partial", "test", 2, "x", {"eager": {
        **forward.coefficients["eager"], NCCL_RW + BWD: fitted.backward(NCCL_RW, "eager")}})
    cfg = {"world_size": 2, "batch_per_rank": 4096, "training": True,
           "tables": [{"name": "a", "rows": 1000, "dim": 32, "pooling": 16}]}
    out: Dict[str, List[str]] = {}
    for prof in (fitted, forward, partial):
        path = tmp_path / f"{prof.name}.json"
        path.write_text(json.dumps(prof.to_json()))
        out[prof.name] = explain({**cfg, "profile": str(path)}).splitlines()
    assert "bwd: fitted for nccl_rw, pgas_rw)" in out["fit"][0]
    assert "bwd: the forward's per-byte coefficients, no fixed cost (no training fit)" in out["fwd"][0]
    assert "bwd: fitted for nccl_rw, else the forward's per-byte coefficients" in out["partial"][0]
    table = TableLoad("a", 1000, 32, [16.0])
    for name, prof in (("fit", fitted), ("fwd", forward)):
        parts = CostModel(prof, 2, 4096, training=True).contribution_parts(table, PGAS_RW, 1)
        assert out[name][2].split()[7] == f"{parts[0]:.3f}+{parts[1]:.3f}"
    assert out["fit"][2].split()[7] != out["fwd"][2].split()[7]  # the fitted backward, not the stand-in


@pytest.mark.matrix  # ~25 s: a benchmark run, then the fit
def test_calibrate_measures_and_writes_a_profile(tmp_path: Any) -> None:
    """The one-command calibration: benchmark run (smoke preset on 2 CPU ranks here), fit, profile JSON."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "profile.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", GIT_COMMIT="testsha")
    proc = subprocess.run([sys.executable, "-m", "torchrec_pgas.planner.calibrate", "--measure", "2", "-o", str(out),
                           "--", "--preset", "smoke", "--steps", "3", "--warmup", "1", "--stage-steps", "1"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    prof = load_profile(str(out))
    assert "presets smoke; commit testsha" in prof.source
    assert prof.get(PGAS_RW, "graph") == prof.get(PGAS_RW, "eager")  # a CPU run captures no graphs
    assert all((tmp_path / "profile_results" / pair / "results.json").exists() for pair in ("rw", "tw"))
    assert prof.has(PGAS_TW) and prof.has(NCCL_TW)  # both pairs measured: four backends


def test_stock_planner_accepts_the_pgas_sharder() -> None:
    """DMP plans with TorchRec's own planner when given no plan: it must not meet a type it cannot size."""
    topo = Topology(world_size=2, compute_device="cuda")
    plan = _planner(topo, 8).plan(default_model(), [PgasEmbeddingBagCollectionSharder()])
    types = {ps.sharding_type for m in plan.plan.values() for ps in m.values()}
    assert types and not types & {"pgas_row_wise"}


def test_pgas_offered_only_to_the_modules_of_the_pgas_sharder() -> None:
    """An EmbeddingCollection next to the EBC, planned with its own stock sharder: its tables may not get
    pgas_row_wise (no sharder of that module can shard it)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = default_model().ebc
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=1000,
                                                                  feature_names=["ef0"])], device=torch.device("meta"))

    topo = Topology(world_size=2, compute_device="cuda")
    rw = {t: ParameterConstraints(sharding_types=["row_wise", "pgas_row_wise"]) for t in ("e0", "t0")}
    plan = _planner(topo, 8, constraints=rw, stats=[PgasDecisionStats()],
                    enumerator=PgasEnumerator(topo, 8, constraints=rw)).plan(
        Both(), [PgasEmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
    assert plan.plan["ec"]["e0"].sharding_type == "row_wise"
    assert plan.plan["ebc"]["t0"].sharding_type == "pgas_row_wise"


def test_four_options_per_table() -> None:
    """Each table may get any of the four types, and the plan follows the prices. A made-up machine: NCCL
    has a large fixed cost, row-wise gathers are slow, table-wise bytes nearly free. A tiny table goes PGAS
    (the smallest fixed costs), a gather-heavy table pgas_table_wise, and one constrained to the stock types
    table_wise."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    coeffs = {NCCL_RW: Coefficients(5.0, 1e-8, 1e-9, 0.0), PGAS_RW: Coefficients(0.1, 1e-8, 1e-8, 0.0),
              NCCL_TW: Coefficients(5.0, 1e-12, 1e-9, 0.0), PGAS_TW: Coefficients(0.3, 1e-12, 1e-12, 0.0)}
    prof = HardwareProfile("four", "test", 2, "hand-made", {"eager": coeffs})
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="tiny", num_embeddings=100, embedding_dim=8, feature_names=["f_tiny"]),
        EmbeddingBagConfig(name="wide", num_embeddings=100_000, embedding_dim=512, feature_names=["f_wide"]),
        EmbeddingBagConfig(name="heavy", num_embeddings=100_000, embedding_dim=128, feature_names=["f_heavy"]),
    ], device=torch.device("meta"))
    four = ["row_wise", "pgas_row_wise", "table_wise", "pgas_table_wise"]
    constraints = {"tiny": ParameterConstraints(sharding_types=four, pooling_factors=[1.0]),
                   "wide": ParameterConstraints(sharding_types=four, pooling_factors=[8.0]),
                   "heavy": ParameterConstraints(sharding_types=["row_wise", "table_wise"], pooling_factors=[200.0])}
    topo = Topology(world_size=2, compute_device="cuda")
    enumerator = PgasEnumerator(topo, 4096, constraints=constraints, profile=prof)
    stats = PgasDecisionStats()
    plan = _planner(topo, 4096, enumerator=enumerator, constraints=constraints,
                    stats=[stats]).plan(ebc, [PgasEmbeddingBagCollectionSharder()])
    types = {t: ps.sharding_type for m in plan.plan.values() for t, ps in m.items()}
    # The partitioner minimizes the busiest rank: the tiny table may ride table-wise on the idle owner.
    assert types["wide"] == "pgas_table_wise" and types["heavy"] == "table_wise", types
    assert types["tiny"] in ("pgas_row_wise", "pgas_table_wise"), types
    rows = {line.split()[0]: line.split() for line in stats.lines[1:]}
    for t in ("tiny", "wide"):  # four prices, nothing constrains the choice
        assert "-" not in rows[t][6:10] and rows[t][10:12] != ["constraints"], rows[t]
    assert rows["heavy"][7] == rows["heavy"][9] == "-" and rows["heavy"][10] == "constraints"


def test_training_prices_the_backward_in_the_plan() -> None:
    """training=True: every fused RW/TW option, stock and PGAS, carries the model's backward in its Perf
    (inference: none), and the plan follows the totals. A made-up machine where PGAS's fixed cost is a bit
    lower and gathers cost the same: PGAS wins the forward, but its backward replays the lookup, which
    costs this gather-heavy table more than the fixed-cost saving, so training keeps it stock."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    coeffs = {NCCL_RW: Coefficients(0.5, 1e-9, 1e-10, 1e-10), PGAS_RW: Coefficients(0.4, 1e-9, 1e-10, 1e-10),
              NCCL_TW: Coefficients(5.0, 1e-9, 1e-9, 0.0), PGAS_TW: Coefficients(5.0, 1e-9, 1e-9, 0.0)}
    prof = HardwareProfile("train", "test", 2, "hand-made", {"eager": coeffs})
    four = ["row_wise", "pgas_row_wise", "table_wise", "pgas_table_wise"]
    constraints = {"big": ParameterConstraints(sharding_types=four, pooling_factors=[100.0])}
    topo = Topology(world_size=2, compute_device="cuda")

    def planned(training: bool) -> str:
        ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="big", num_embeddings=1_000_000, embedding_dim=128, feature_names=["f"])], device=torch.device("meta"))
        enumerator = PgasEnumerator(topo, 4096, constraints=constraints, profile=prof, training=training)
        options = enumerator.enumerate(ebc, [PgasEmbeddingBagCollectionSharder()])
        fused = [o for o in options if o.compute_kernel == "fused" and o.sharding_type in four]
        assert {o.sharding_type for o in fused} == set(four)
        for o in fused:
            for shard in o.shards:
                assert (shard.perf.bwd_compute > 0 and shard.perf.bwd_comms > 0) if training else \
                    shard.perf.bwd_compute == shard.perf.bwd_comms == 0.0, (o.sharding_type, shard.perf)
        plan = _planner(topo, 4096, enumerator=enumerator, constraints=constraints,
                        stats=[PgasDecisionStats()]).plan(ebc, [PgasEmbeddingBagCollectionSharder()])
        return plan.plan[""]["big"].sharding_type  # type: ignore[index]

    assert planned(training=False) == "pgas_row_wise"
    assert planned(training=True) == "row_wise"


def test_table_wise_fixed_cost_is_paid_by_every_rank() -> None:
    """A table-wise shard carries W/num_tables of its backend's fixed cost on its owner, so balanced owners
    carry all of it, as every rank pays it. Eight equal tables on the shipped profile: the model's steps
    say row-wise PGAS (one alpha on every rank) beats table-wise PGAS, and the planner must agree."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=1_000_000, embedding_dim=32, feature_names=[f"f{i}"])
              for i in range(8)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    constraints = {t.name: ParameterConstraints(pooling_factors=[4.0]) for t in tables}
    topo = Topology(world_size=2, compute_device="cuda")
    enumerator = PgasEnumerator(topo, 4096, constraints=constraints)
    plan = _planner(topo, 4096, enumerator=enumerator, constraints=constraints,
                    stats=[PgasDecisionStats()]).plan(ebc, [PgasEmbeddingBagCollectionSharder()])
    model = enumerator.model
    loads = [TableLoad(t.name, 1_000_000, 32, [4.0]) for t in tables]
    assert model.step_ms(loads, PGAS_RW) < model.step_ms(loads, PGAS_TW)
    assert {ps.sharding_type for m in plan.plan.values() for ps in m.values()} == {"pgas_row_wise"}


def test_choice_is_never_worse_than_one_backend_for_all() -> None:
    """Per-table contributions assume table-wise tables balance; one big table does not, so the choice
    falls back to the best single backend when that step is faster."""
    model = CostModel(load_profile(), world_size=2, batch_per_rank=8192, mode="graph")
    tables = [TableLoad("big", 10_000_000, 256, [1.0])]
    choice = model.choose(tables)
    assert model.plan_ms(tables, choice) <= min(model.step_ms(tables, b) for b in model.backends) + 1e-12


def test_merge_refuses_results_of_different_machines() -> None:
    from torchrec_pgas.planner.calibrate import merge

    meta = {"presets": ["s004"], "commit": "a", "date": "d", "world_size": 2, "device": "GPU"}
    merged = merge([{"meta": meta, "rows": [1]}, {"meta": {**meta, "commit": "b", "presets": ["x"]}, "rows": [2]}])
    assert merged["meta"]["commit"] == "a+b" and merged["meta"]["presets"] == ["s004", "x"] and merged["rows"] == [1, 2]
    with pytest.raises(ValueError, match="different machines"):
        merge([{"meta": meta, "rows": []}, {"meta": {**meta, "world_size": 4}, "rows": []}])


def test_inter_node_bytes_follow_the_shardings_data_movement() -> None:
    """The issue's example (B = 4096, 1024 fp32 columns, 2 x 8 GPUs): row-wise sends 128 MiB of partial pools off
    the node per GPU, table-row-wise 8 MiB of rail rows; the PGAS twin sends the same rows and ids, and each
    length once instead of once per local rank."""
    from torchrec_pgas.planner.inter_node import StepShape, inter_node_bytes

    shape = StepShape("example", batch=4096, features=16, dim_sum=1024, pooling=4.0)
    rw, twrw, pgas = (inter_node_bytes(shape, t, 2, 8) for t in ("row_wise", "table_row_wise", "pgas_table_row_wise"))
    assert rw["pooled"] == rw["gradients"] == 128 * 2**20
    assert twrw["pooled"] == pgas["pooled"] == twrw["gradients"] == 8 * 2**20
    assert twrw["ids"] == pgas["ids"] == rw["ids"]
    assert pgas["lengths"] * 8 == twrw["lengths"] and rw["lengths"] == 2 * twrw["lengths"]
    assert inter_node_bytes(shape, "table_row_wise", 1, 8)["pooled"] == 0.0  # one node: nothing leaves it


def test_table_row_wise_prices_add_the_node_step_and_the_rail_bytes() -> None:
    """A table-row-wise table costs its node's row-wise step over the rail's N·B bags (the single-node model at
    the node's size) plus the bytes each GPU sends off its node over the link and the rail all-to-alls' fixed cost
    (PGAS: one more, the input check), shared over the tables."""
    profile, link = load_profile(world_size=2), InterNodeLink(bytes_per_ms=1e6, alpha_ms=0.1)
    cost = TableRowWiseCost(profile, 2, 2, 1024, link)
    t = TableLoad("t", 10**6, 64, [4.0])
    for sharding, backend, exchanges in ((TABLE_ROW_WISE, NCCL_RW, 2), (PGAS_TABLE_ROW_WISE, PGAS_RW, 3)):
        node = CostModel(profile, 2, 2048).table_price(t, backend, 10)
        moved = inter_node_bytes(StepShape("t", 1024, 1, 64, 4.0), sharding, 2, 2)
        price = cost.table_price(t, sharding, 10)
        assert price.fwd_compute == node.fwd_compute and price.bwd_compute == price.bwd_comms == 0.0
        wire = (moved["ids"] + moved["lengths"] + moved["pooled"] + moved["check"]) / 1e6
        assert price.fwd_comms == pytest.approx(node.fwd_comms + wire + exchanges * 0.1 / 10)


def test_explain_two_nodes() -> None:
    """The 2 x 8 example: each table priced under both table-row-wise types with its choice, and the inter-node
    bytes a GPU sends under row_wise over the job against the table-row-wise types (an order of magnitude more)."""
    import yaml

    with open(os.path.join(os.path.dirname(__file__), "..", "examples", "planner", "two_nodes.yaml")) as f:
        cfg = yaml.safe_load(f)
    lines = explain(cfg).splitlines()
    assert "2 nodes x 8 GPUs" in lines[0] and "pgas_table_row_wise ms f+b" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert set(rows) == {t["name"] for t in cfg["tables"]}
    for cells in rows.values():
        assert cells[-1] == ("pgas_table_row_wise" if float(cells[6]) < float(cells[5]) else "table_row_wise")
    moved = dict(re.findall(r"(\w+) ([\d,.]+)", lines[-1].split(":", 1)[1]))
    assert float(moved["row_wise"].replace(",", "")) > 10 * float(moved["table_row_wise"].replace(",", ""))
