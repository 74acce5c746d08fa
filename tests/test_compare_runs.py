"""scripts/compare_runs.py, the A/B of two builds: every workload of a preset kept apart, training rows read, and
the rounds' verdict (tree against old next to each build's spread)."""

import importlib.util
import json
import os
from typing import Any, Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def compare_runs() -> Any:
    spec = importlib.util.spec_from_file_location("compare_runs", os.path.join(ROOT, "scripts", "compare_runs.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(name: str, world: int, scale: float, host: float) -> Dict[str, Any]:
    return {"preset": "s004", "name": name, "world_size": world, "pgas_p50_ms": 1.0 * scale,
            "pgas_stages_ms": {"finalize": 0.5 * scale}, "pgas_train_p50_ms": 2.0 * scale,
            "pgas_train_graph_p50_ms": 1.5 * scale, "pgas_train_host_p50_ms": host, "stock_train_p50_ms": 3.0}


def write_round(tmp: str, build: str, scale: float, host: float) -> None:
    """A packed round: two s004 workloads (one preset) at W = 1 and 2, as gpu_check's run folders hold them."""
    for world in (1, 2):
        folder = os.path.join(tmp, f"run-{build}", f"bench-rw-w{world}")
        os.makedirs(folder)
        rows: List[Dict[str, Any]] = [row(n, world, scale, host) for n in ("t2-b128", "t64-b4096")]
        json.dump({"meta": {}, "rows": rows}, open(os.path.join(folder, "results.json"), "w"))


def test_pack_keeps_every_workload_of_a_preset_and_each_world(compare_runs: Any, tmp_path: Any) -> None:
    write_round(str(tmp_path), "tree", 1.0, 0.4)
    compare_runs.pack(str(tmp_path / "run-tree"), str(tmp_path / "tree.json"))
    times = compare_runs._times(json.load(open(tmp_path / "tree.json")))
    steps = sorted(k[:3] for k in times if k[3] == "train")
    assert steps == [("W=1", "rw", "s004/t2-b128"), ("W=1", "rw", "s004/t64-b4096"),
                     ("W=2", "rw", "s004/t2-b128"), ("W=2", "rw", "s004/t64-b4096")]
    assert times[("W=2", "rw", "s004/t2-b128", "combine")] == 0.5  # an older build's stage name, mapped


def test_rounds_give_tree_over_old_per_round_and_each_builds_spread(compare_runs: Any, tmp_path: Any) -> None:
    # tree rounds 1.10x and 1.00x of old's; old's second round 2% slower than its first; host 0.8 against 0.4
    for build, scale, host in (("tree", 1.1, 0.8), ("old", 1.0, 0.4), ("tree2", 1.02, 0.8), ("old2", 1.02, 0.4)):
        write_round(str(tmp_path), build, scale, host)
        os.makedirs(tmp_path / "out", exist_ok=True)
        compare_runs.pack(str(tmp_path / f"run-{build}"), str(tmp_path / "out" / f"{build}.json"))
    lines = list(compare_runs.rounds(str(tmp_path / "out")))
    assert lines[0].startswith("2 tree and 2 old rounds")
    by = {tuple(line.split()[:2]): line for line in lines[1:]}
    assert "tree/old 1.100 1.000" in by[("W=1", "train")]
    # old against its neighbours tree and tree2 (sqrt(1.1 * 1.02)), tree2 against old and old2 (1.02 / sqrt(1.02))
    assert by[("W=1", "train")].endswith("bracketed 1.059 1.010")
    assert "spread 0.927 1.020" in by[("W=2", "train-graph")]  # tree2 / tree, old2 / old
    assert "tree/old 2.000 2.000" in by[("W=2", "train-host")]
    assert "tree/old 1.000 1.000" in by[("W=1", "stock-train")]


def test_rounds_say_so_when_a_build_has_none(compare_runs: Any, tmp_path: Any) -> None:
    assert list(compare_runs.rounds(str(tmp_path))) == ["nothing to compare: a build has no rounds"]
