"""The examples, launched the way users launch them (torchrun, 2 processes, CPU here)."""

import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import List

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def torchrun(*args: str, nproc: int = 2) -> List[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # TorchRec's FutureWarnings name an API the examples call the old way, but for the one TorchRec 1.9's
    # DDP wrapper raises itself (pyproject's filterwarnings, for the tests in this process)
    warned = re.findall(r"torchrec/\S+\.py:\d+: FutureWarning: (.*)", proc.stderr)
    assert all(w.startswith("`broadcast_buffers` is deprecated") for w in warned), warned
    return proc.stdout.splitlines()


@pytest.mark.matrix  # ~13 s: make test's budget; make demo runs a 2-process sharded model against stock
def test_minimal_example() -> None:
    lines = sorted(line for line in torchrun("examples/minimal.py") if line.startswith("rank"))
    assert lines == [
        f"rank {r}: shm backend on cpu, pooled user (8, 64), item (8, 32)" for r in range(2)
    ]


@pytest.mark.matrix  # ~17 s: make test's budget; make test trains the example (below), checked against stock
def test_dlrm_inference_with_pgas_matches_stock() -> None:
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "pgas", "--batch-size", "32",
                   "--steps", "6", "--max-rows", "2000", "--validate")
    summary = next(line for line in out if line.startswith("DLRM inference, sharding=pgas (shm)"))
    assert "samples/s" in summary and "AUC" in summary
    assert any(line.startswith("validate:") and line.endswith("PASS") for line in out), out


@pytest.mark.stacks
def test_dlrm_trains_with_pgas_like_stock(tmp_path: pathlib.Path) -> None:
    """--train --sharding pgas --validate: the stock twin trained on the same batches has the same loss after
    every step (1e-4 relative) and the same final AUC (1e-3); the trajectories are the run's own report.
    --profile writes each side's op table: the owner update on the PGAS side only."""
    report = tmp_path / "dlrm_train.json"
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "pgas", "--train", "--batch-size", "32",
                   "--steps", "8", "--max-rows", "2000", "--validate", "--report", str(report),
                   "--profile", str(tmp_path / "profile"))
    assert any(line.startswith("DLRM train, sharding=pgas (shm)") for line in out), out
    assert any(line.startswith("validate: 8 training steps") and line.endswith("PASS") for line in out), out
    got = json.loads(report.read_text())
    assert len(got["losses"]) == len(got["stock_losses"]) == 8
    assert len(got["step_ms"]) == len(got["stock_step_ms"]) == 8 - 3  # after the default warmup
    assert min(got["step_ms"] + got["stock_step_ms"]) > 0
    assert any(line.startswith("samples/s (plain loop): pgas ") and " ms (" in line for line in out), out
    assert got["losses"][-1] < got["losses"][0]  # it trained
    assert max(abs(a - b) / b for a, b in zip(got["losses"], got["stock_losses"])) <= 1e-4
    ours, stock = ((tmp_path / "profile" / f"{side}_b32.txt").read_text() for side in ("pgas", "nccl"))
    assert ours.startswith("5 steps") and "torchrec_pgas::owner_update" in ours, ours
    assert "torchrec_pgas::" not in stock, stock
    trace = json.loads(gzip.decompress((tmp_path / "profile" / "pgas_b32.trace.json.gz").read_bytes()))
    assert any(e.get("name") == "torchrec_pgas::owner_update" for e in trace["traceEvents"])


@pytest.mark.matrix  # ~10 s; make test trains through the replay pipeline one-hot (below)
def test_dlrm_multi_hot_replays_like_stock(tmp_path: pathlib.Path) -> None:
    """--max-ids-per-bag 20: multi-hot features (1 to 20 ids a bag), the PGAS buffers sized for the largest bags
    from the plan's pooling factors, through the replay pipeline: every batch after the first takes the graph's
    step (a StaticKJT at that capacity); the stock twin on the same batches: equal step by step."""
    report = tmp_path / "dlrm_multi_hot.json"
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "pgas", "--train", "--max-ids-per-bag", "20",
                   "--pipeline", "replay", "--batch-size", "32", "--steps", "6", "--max-rows", "2000", "--validate",
                   "--report", str(report))
    assert any(line.startswith("validate: 6 training steps") and line.endswith("PASS") for line in out), out
    got = json.loads(report.read_text())
    assert got["pass"] and got["batches_off_graph"] == 0


def test_synthetic_criteo_multi_hot_bags_and_one_hot_default() -> None:
    from examples.dlrm.data import SyntheticCriteo

    one, many = (next(iter(SyntheticCriteo(64, 1, 2000, seed=3, max_ids_per_bag=n))).sparse_features for n in (1, 20))
    assert bool((one.lengths() == 1).all()) and one.values().numel() == 26 * 64
    assert int(many.lengths().min()) == 1 and int(many.lengths().max()) == 20
    assert many.values().numel() == int(many.lengths().sum())


@pytest.mark.stacks
def test_dlrm_trains_through_the_replay_pipeline_like_stock_sparse_dist(tmp_path: pathlib.Path) -> None:
    """--pipeline replay: the PGAS side trains through ReplayTrainPipeline (eagerly on CPUs, which have no CUDA
    graphs), its stock twin through TrainPipelineSparseDist, on the same batches: equal step by step.
    --host-profile writes each side's Python functions over its 3 timed steps: ours through the PGAS step."""
    report = tmp_path / "dlrm_replay.json"
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "pgas", "--train", "--pipeline", "replay",
                   "--batch-size", "32", "--steps", "6", "--max-rows", "2000", "--validate", "--report", str(report),
                   "--host-profile", str(tmp_path / "host"))
    assert any(line.startswith("validate: 6 training steps") and line.endswith("PASS") for line in out), out
    got = json.loads(report.read_text())
    assert got["pass"] and got["pipeline"] == "replay" and len(got["losses"]) == 6
    ours, stock = ((tmp_path / "host" / f"{side}_b32.host.txt").read_text() for side in ("pgas", "nccl"))
    assert ours.startswith("3 timed steps under cProfile") and "by cumulative time:" in ours, ours
    assert "torchrec_pgas/train_pipeline.py" in ours and "torchrec_pgas/" not in stock, stock


@pytest.mark.stacks
def test_dlrm_trains_through_train_pipeline_sparse_dist(tmp_path: pathlib.Path) -> None:
    """--pipeline sparse_dist: both sides train through TorchRec's TrainPipelineSparseDist on the same batches,
    still equal to stock step by step (with --owner-backward auto: the two owner backwards alternate); the
    report carries both samples/s."""
    report = tmp_path / "dlrm_pipeline.json"
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "pgas", "--train", "--pipeline", "sparse_dist",
                   "--owner-backward", "auto", "--batch-size", "32", "--steps", "6", "--max-rows", "2000",
                   "--validate", "--report", str(report))
    assert any(line.startswith("samples/s (sparse_dist loop): pgas ") and "nccl twin" in line for line in out), out
    assert any(line.startswith("validate: 6 training steps") and line.endswith("PASS") for line in out), out
    got = json.loads(report.read_text())
    assert got["pass"] and got["pipeline"] == "sparse_dist"
    assert got["samples_per_s"] > 0 and got["stock_samples_per_s"] > 0
    assert len(got["losses"]) == len(got["stock_losses"]) == 6
    # auto's trial of each PGAS sharding on rank 0 (14 backwards: still timing after 6 steps)
    assert got["owner_backward_chosen"] and set(got["owner_backward_chosen"]) == {None}, got


@pytest.mark.matrix  # ~10 s: the example's --sharding auto runs in CI's matrix stage only; make test plans mixed
def test_dlrm_auto_sharding_runs_the_planner_and_matches_stock() -> None:  # plans (test_planner) and trains them
    """--sharding auto: collective_plan with PgasEnumerator decides per table (the shipped H200 profile
    prices PGAS lower for every row-wise table), and the result still matches stock."""
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "auto", "--batch-size", "32",
                   "--steps", "4", "--max-rows", "2000", "--validate")
    table = out[out.index("planner (PgasEnumerator, shipped profile):") + 2:][:26]
    assert [line.split()[-1] for line in table] == ["pgas_row_wise"] * 26, table
    assert any(line.startswith("DLRM inference, sharding=auto (26 tables pgas_row_wise, 0 row_wise)")
               for line in out), out
    assert any(line.startswith("validate:") and line.endswith("PASS") for line in out), out


@pytest.mark.matrix  # ~10 s; as the inference case above (test_training_errors trains hand-written mixed plans)
def test_dlrm_auto_sharding_trains_like_stock() -> None:
    """--train --sharding auto: the planner prices forward + backward and plans PGAS tables here (the shipped
    profile's training terms), which train as stock does."""
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "auto", "--train", "--batch-size", "32",
                   "--steps", "6", "--max-rows", "2000", "--validate")
    planned = [re.match(r"DLRM train, sharding=auto \((\d+) tables pgas_row_wise", line) for line in out]
    assert any(m and int(m.group(1)) > 0 for m in planned), out
    assert any(line.startswith("validate: 6 training steps") and line.endswith("PASS") for line in out), out


@pytest.mark.matrix  # four processes (make test's budget: tests/test_twrw_sharding.py trains table-row-wise there)
def test_dlrm_trains_beyond_one_node_like_stock_table_row_wise() -> None:
    """Four processes declared 2 nodes x 2 (--node-size 2): every table pgas_table_row_wise, its twin stock
    table_row_wise, trained on the same batches: the same loss after every step and the same AUC."""
    out = torchrun("-m", "examples.dlrm.run", "--sharding", "pgas", "--train", "--batch-size", "32", "--steps", "6",
                   "--max-rows", "2000", "--validate", "--node-size", "2", nproc=4)
    assert any(line.startswith("DLRM train, sharding=pgas (shm, table-row-wise over 2 nodes x 2)") for line in out), out
    assert any(line.startswith("validate: 6 training steps") and line.endswith("PASS") for line in out), out
