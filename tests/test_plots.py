"""benchmarks/plots.py on a tiny synthetic result file (CPU only)."""

import json
import os
from typing import Any, Dict

import pytest

pytest.importorskip("matplotlib")

from benchmarks.plots import crossovers, make_plots, train_stages  # noqa: E402

META = {"device": "test GPU", "world_size": 2, "commit": "abc1234", "torch": "x", "date": "2026-01-01",
        "presets": ["s004", "s000-weak"], "steps": 10, "warmup": 2, "input_sets": 2,
        "hbm_gbps": 4800.0, "p2p_gbps": 450.0}


def _row(preset: str, tables: int, batch: int, pooling: int, stock: float, pgas: float) -> Dict[str, Any]:
    floor, nvlink = 0.01 * tables * batch / 1024, tables * batch * 256
    graph = pgas / 2 if preset == "s004" else None  # one row without a graph time
    return {
        "preset": preset, "name": f"t{tables}-b{batch}-p{pooling}-uniform", "tables": tables, "rows": 1000,
        "dim": 64, "batch_per_gpu": batch, "pooling": pooling, "pooling_dist": "uniform", "ids": "uniform",
        "stock": "row_wise", "pgas": "pgas_row_wise",
        "stock_p50_ms": stock, "stock_p90_ms": stock, "pgas_p50_ms": pgas, "pgas_p90_ms": pgas,
        "pgas_graph_p50_ms": graph, "pgas_graph_p90_ms": graph,
        "speedup_eager": stock / pgas, "speedup_graph": graph and stock / graph,
        "stock_stages_ms": {"bucketize": stock / 4, "splits_a2a": stock / 4, "values_a2a": stock / 4,
                            "lookup": stock / 8, "output_dist": stock / 8},
        "pgas_stages_ms": {"index_dist": pgas / 4, "lookup": pgas / 2, "combine": pgas / 8, "output_dist": pgas / 8},
        "hbm_bytes": 8 * nvlink, "nvlink_bytes": nvlink, "floor_ms": floor,
        "roofline_stock": floor / stock, "roofline_pgas": floor / pgas, "roofline_graph": graph and floor / graph,
        "max_abs_err": 0.0,
    }


def _train_row(preset: str, tables: int, stock: float, pgas: float, floor: bool = True,
               graph: bool = True) -> Dict[str, Any]:
    """A ``--mode train`` row: the forward's fields, then the training step's (backward ~2x the forward), and
    its replay as one CUDA graph (``--train-graph``) at half the eager step."""
    row = _row(preset, tables, 4096, 32, stock, pgas)
    st, pt = 3 * stock, 2.5 * pgas
    train_floor = 3 * row["floor_ms"] if floor else None
    row.update(
        mode="train", optimizer="sgd", stock_train_p50_ms=st, stock_train_p90_ms=st, pgas_train_p50_ms=pt,
        pgas_train_p90_ms=pt, speedup_train=st / pt,
        stock_train_stages_ms={**row["stock_stages_ms"], "grad_output_dist": stock, "owner_backward": stock},
        pgas_train_stages_ms={**row["pgas_stages_ms"], "grad_exchange": pgas / 2, "kept_ids": pgas / 8,
                              "replay_lookup": pgas / 2, "owner_backward": pgas / 2},
        distinct_rows=1000.0, train_hbm_bytes=3 * row["hbm_bytes"], train_nvlink_bytes=2 * row["nvlink_bytes"],
        train_floor_ms=train_floor, roofline_train_stock=train_floor and train_floor / st,
        roofline_train_pgas=train_floor and train_floor / pt,
        pgas_train_graph_p50_ms=pt / 2 if graph else None, speedup_train_graph=2 * st / pt if graph else None)
    return row


def _write(path: str, results: Dict[str, Any]) -> None:
    with open(os.path.join(path, "results.json"), "w") as f:
        json.dump(results, f)


def test_make_plots_writes_every_figure(tmp_path: Any) -> None:
    rows = [_row("s004", t, b, p, 2.0 + t / 8, 0.2 + t * b / 4096)  # stock wins at t8-b4096: a crossover
            for t in (2, 8) for b in (128, 4096) for p in (4, 8)]
    rows.append(_row("s000-weak", 26, 4096, 32, 3.0, 1.5))
    rows[-1]["comm_timeline"] = {"pgas": [[0.0, 0], [0.2, 10**6], [1.4, 9 * 10**6]],
                                 "stock_model": [[0.0, 0], [1.0, 0], [1.5, 10**6], [2.5, 10**6], [3.0, 9 * 10**6]]}
    single = [{"preset": "s000-weak", "tables": 26, "batch": 4096, "p50_ms": 1.8, "p90_ms": 1.9}]
    _write(str(tmp_path), {"meta": META, "rows": rows, "single_gpu": single})
    with open(tmp_path / "planner_validation.csv", "w") as f:
        f.write("workload,mode,backend,measured_ms,predicted_ms,error,chosen,regret\n"
                "t2-b128-p4-uniform,eager,nccl_rw,2.0,2.2,0.1,pgas_rw,0.0\n"
                "t2-b128-p4-uniform,graph,pgas_rw,0.1,0.09,-0.1,pgas_rw,0.0\n")
    paths = make_plots(str(tmp_path))
    names = ["speedup_heatmap", "crossover", "stages", "scaling", "roofline", "planner_scatter", "comm_timeline"]
    assert paths == [str(tmp_path / f"{n}.png") for n in names]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_crossover_per_world_size() -> None:
    """Issue 9 reports where stock catches up at each world size: found per world, None where PGAS always wins."""
    rows = []
    for world, pgas_slope in ((2, 1 / 4), (8, 1 / 32)):
        for t in (2, 8, 32):
            row = _row("s004", t, 1024, 8, 2.0 + t / 8, 0.2 + pgas_slope * t)
            row["world_size"] = world
            rows.append(row)
    found = crossovers(rows)
    assert set(found) == {2, 8} and found[8] is None
    # World 2: PGAS wins at 2 and 8 tables, loses at 32 (stock 6.0 ms, PGAS 8.2): the crossover lies between.
    assert 8 * 1024 * 256 < found[2] < 32 * 1024 * 256


def test_make_plots_skips_missing_data(tmp_path: Any) -> None:
    """A CPU run's file: no s004/quick rows, no single-GPU entries, no bandwidths, so no floor."""
    row = _row("s000-weak", 26, 4096, 32, 3.0, 1.5)
    row.update(floor_ms=None, roofline_stock=None, roofline_pgas=None, roofline_graph=None)
    meta = {**META, "hbm_gbps": None, "p2p_gbps": None}
    _write(str(tmp_path), {"meta": meta, "rows": [row], "single_gpu": []})
    assert [os.path.basename(p) for p in make_plots(str(tmp_path))] == ["crossover.png", "stages.png"]


def test_world_scaling_from_a_merged_scaling_run(tmp_path: Any) -> None:
    """gpu_check.sh scaling merges runs of several world sizes; the per-world figure replaces `scaling`."""
    rows = []
    for world in (1, 2, 4):
        for stock, pgas in (("row_wise", "pgas_row_wise"), ("table_wise", "pgas_table_wise")):
            row = _row("s000-weak", 64 * world, 16384 // world, 128, 4.0 + world, 3.0 + world / 2)
            row.update(world_size=world, stock=stock, pgas=pgas)
            rows.append(row)
    single = [{"preset": "s000-weak", "tables": 64, "batch": 16384, "p50_ms": 5.0, "p90_ms": 5.1}]
    _write(str(tmp_path), {"meta": {**META, "world_size": "1-4"}, "rows": rows, "single_gpu": single})
    names = [os.path.basename(p) for p in make_plots(str(tmp_path))]
    assert "world_scaling.png" in names and "scaling.png" not in names


def test_make_plots_draws_the_training_figures(tmp_path: Any) -> None:
    """A --mode train run: the training step over its forward, its stages, its floor fraction, and the
    replayed step's speedups."""
    rows = [_train_row("s000-weak", 26, 3.0, 1.5), _train_row("s000-strong", 26, 6.0, 2.0)]
    _write(str(tmp_path), {"meta": {**META, "mode": "train"}, "rows": rows, "single_gpu": []})
    names = [os.path.basename(p) for p in make_plots(str(tmp_path))]
    assert names[-4:] == ["train_step.png", "train_stages.png", "train_roofline.png", "train_graph.png"]
    for name in names[-4:]:
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The forward's stages (both sides') first, in greens; the backward's after them, in purples.
    fig = train_stages(META, rows)
    assert fig is not None
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["bucketize", "splits_a2a", "values_a2a", "lookup", "output_dist", "index_dist", "combine",
                      "grad_output_dist", "owner_backward", "grad_exchange", "kept_ids", "replay_lookup"]
    colors = [h.get_facecolor() for h in fig.legends[0].legend_handles]
    assert all(g > max(r, b) for r, g, b, _ in colors[:7]) and all(b > g for r, g, b, _ in colors[7:])


def test_training_figures_skipped_without_their_data(tmp_path: Any) -> None:
    """A CPU train run has no floor (no train_roofline) and no replay (no train_graph); a forward-only run draws
    none of the four."""
    _write(str(tmp_path), {"meta": {**META, "mode": "train"},
                           "rows": [_train_row("s000-weak", 26, 3.0, 1.5, floor=False, graph=False)], "single_gpu": []})
    names = [os.path.basename(p) for p in make_plots(str(tmp_path))]
    assert "train_step.png" in names and "train_stages.png" in names and "train_roofline.png" not in names
    assert "train_graph.png" not in names
    forward = tmp_path / "forward"
    forward.mkdir()
    _write(str(forward), {"meta": META, "rows": [_row("s000-weak", 26, 4096, 32, 3.0, 1.5)], "single_gpu": []})
    assert not [p for p in make_plots(str(forward)) if os.path.basename(p).startswith("train_")]
