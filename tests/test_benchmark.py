"""benchmarks.embedding end to end on CPU (gloo + shm), the smoke preset, at 2, 4 and 8 ranks: the presets
and the byte accounting hold for any world size (the 4- and 8-GPU runs use the same code)."""

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, Optional

import pytest
import torch

from benchmarks.embedding import ID_HASH, PRESETS, _ids, make_inputs, own_models, shared_models
from benchmarks.owner_op import INPUT_SEED, MAX_TIMED_STEPS, timed_steps
from torchrec_pgas.sharding.owner_backward import op_available

STOCK_STAGES = ["bucketize", "splits_a2a", "values_a2a", "lookup", "output_dist"]
PGAS_STAGES = ["index_dist", "lookup", "combine", "output_dist"]  # "lookup" is the step's own mark


def _run(tmp: str, world: int, *extra: str) -> Dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GIT_COMMIT="testsha")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "benchmarks.embedding", "--preset", "smoke", "--steps", "5", "--warmup", "1", "--stage-steps", "2",
           "--out", tmp, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "smoke: geomean speedup eager" in proc.stdout
    with open(os.path.join(tmp, "results.json")) as f:
        return json.load(f)


def _expected_hbm_bytes(w: Any, world: int) -> int:
    """Rows gathered by the busiest owner (mean over the input sets), recomputed from the inputs."""
    block = (w.rows + world - 1) // world
    k = PRESETS["smoke"](world).index(w)
    per_owner = torch.zeros(world, dtype=torch.float64)
    for rank in range(world):
        for x in make_inputs(w, w.tables, w.batch_per_gpu, 4, seed=1000 * rank + k, device=torch.device("cpu")):
            per_owner += torch.bincount(x.values() // block, minlength=world).double() / 4
    return int((per_owner * 4 * w.dim).max())


# 4 and 8 processes on the 2-core CI machine: the matrix stage's (make test's budget, README "Tests").
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.stacks), pytest.param(4, marks=pytest.mark.matrix),
                                   pytest.param(8, marks=[pytest.mark.slow, pytest.mark.matrix])])
def test_smoke_preset_verifies_times_and_accounts(tmp_path: Any, world: int) -> None:
    out = _run(str(tmp_path), world)
    assert out["meta"]["commit"] == "testsha" and out["meta"]["world_size"] == world
    workloads = PRESETS["smoke"](world)
    assert [r["name"] for r in out["rows"]] == [w.name for w in workloads]
    for row, w in zip(out["rows"], workloads):
        assert row["max_abs_err"] <= 1e-4  # both sides agreed before timing
        for side in ("stock", "pgas"):
            assert 0 < row[f"{side}_p50_ms"] <= row[f"{side}_p90_ms"]
        assert abs(row["speedup_eager"] - row["stock_p50_ms"] / row["pgas_p50_ms"]) < 1e-9
        assert list(row["stock_stages_ms"]) == STOCK_STAGES and list(row["pgas_stages_ms"]) == PGAS_STAGES
        assert all(v >= 0 for v in [*row["stock_stages_ms"].values(), *row["pgas_stages_ms"].values()])
        assert row["hbm_bytes"] == _expected_hbm_bytes(w, world)
        assert row["pgas_graph_p50_ms"] is None and "not capturable" in row["stock_graph"]  # CPU: no graphs
    with open(os.path.join(tmp_path, "results.csv")) as f:
        header = f.readline().strip().split(",")
    assert "pgas_stage_lookup_ms" in header and "stock_stage_values_a2a_ms" in header


@pytest.mark.matrix  # ~10 s; make test benchmarks the row-wise pair (--pair tw's stage names and bytes: CI's matrix)
def test_table_wise_pair(tmp_path: Any) -> None:
    """--pair tw: stock table_wise vs pgas_table_wise (tables round-robin), bit-exact, its own stage names,
    and HBM bytes = the ids of the busiest owner's tables from every rank."""
    out = _run(str(tmp_path), 2, "--pair", "tw")
    for row, w in zip(out["rows"], PRESETS["smoke"](2)):
        assert (row["stock"], row["pgas"], row["max_abs_err"]) == ("table_wise", "pgas_table_wise", 0.0)
        assert list(row["stock_stages_ms"]) == ["splits_launch", *STOCK_STAGES[1:]]
        assert list(row["pgas_stages_ms"]) == PGAS_STAGES
        k = PRESETS["smoke"](2).index(w)
        per_owner = torch.zeros(2, dtype=torch.float64)
        for rank in range(2):
            for x in make_inputs(w, w.tables, w.batch_per_gpu, 4, seed=1000 * rank + k, device=torch.device("cpu")):
                per_table = x.lengths().view(w.tables, -1).sum(1).double()
                per_owner += torch.zeros(2, dtype=torch.float64).index_add_(0, torch.arange(w.tables) % 2, per_table) / 4
        assert row["hbm_bytes"] == int((per_owner * 4 * w.dim).max())


@pytest.mark.slow
@pytest.mark.matrix
def test_table_row_wise_pair(tmp_path: Any) -> None:
    """--pair twrw --node-size 2 at four ranks: stock table_row_wise vs pgas_table_row_wise (table i on node i % 2,
    rows in two blocks there), agreeing within the fp32 rounding of other summation orders; HBM bytes = the ids
    of the busiest owner, the row block of its node's tables."""
    out = _run(str(tmp_path), 4, "--pair", "twrw", "--node-size", "2", "--mode", "train")
    for row, w in zip(out["rows"], PRESETS["smoke"](4)):
        assert (row["stock"], row["pgas"]) == ("table_row_wise", "pgas_table_row_wise") and row["max_abs_err"] <= 1e-4
        k, block = PRESETS["smoke"](4).index(w), (w.rows + 1) // 2
        per_owner = torch.zeros(4, dtype=torch.float64)
        for rank in range(4):
            for x in make_inputs(w, w.tables, w.batch_per_gpu, 4, seed=1000 * rank + k, device=torch.device("cpu")):
                table = torch.repeat_interleave(torch.arange(w.tables), torch.tensor(x.length_per_key()))
                owner = (table % 2) * 2 + x.values() // block
                per_owner += torch.bincount(owner, minlength=4).double() / 4
        assert row["hbm_bytes"] == int((per_owner * 4 * w.dim).max())


STOCK_TRAIN_STAGES = [*STOCK_STAGES, "grad_output_dist", "owner_backward"]
PGAS_TRAIN_STAGES = [*PGAS_STAGES, "grad_exchange", "kept_ids", "replay_lookup", "owner_backward"]


def test_train_mode_with_the_owner_backward(tmp_path: Any) -> None:
    """The default owner backward (PgasConfig's, the owner update; with --own-models: a model a workload): the PGAS
    side's updates come from the owner backward (no replayed lookup among its stages), and the states still agree
    with stock's after the timed steps (the benchmark's own check raises past atol 1e-4 + rtol 1e-5: the op's compensated sums and FBGEMM's
    CPU running sums differ in the last bits, most in row-wise Adagrad's sums of squares, which run to tens)."""
    out = _run(str(tmp_path), 2, "--mode", "train", "--own-models", "--host-profile", "2",
               "--max-padded-eager-ids", str(1 << 20))  # the layout at capacity, as on GPUs
    assert out["meta"]["owner_backward"] == "pgas" and out["meta"]["eager_backward_graphs"]  # GPUs only
    assert out["meta"]["max_padded_eager_ids"] == 1 << 20
    assert out["meta"]["own_models"]
    for row in out["rows"]:
        assert row["max_state_diff"] <= 1e-3
        for side in ("stock", "pgas"):  # --host-profile: the host's time a step and where it goes
            assert row[f"{side}_train_host_p50_ms"] > 0
            with open(os.path.join(tmp_path, "host_profile", f"{row['name']}-{side}.txt")) as f:
                text = f.read()
            assert text.startswith("2 calls, host p50") and "(train_step)" in text
        assert row["pgas_backward_graphs_captured"] == row["pgas_backward_graph_replays"] == 0  # CPU: launched
        # the op splits its stage: the keys and their sort, then the op (the torch-ops reference does not)
        op_stages = ["owner_sort", "owner_update"] if op_available() else []
        assert list(row["pgas_train_stages_ms"]) == [*PGAS_STAGES, "grad_exchange", "kept_ids", *op_stages,
                                                     "owner_backward"]


@pytest.mark.skipif(not op_available(), reason="the owner_update op is not built (no nvcc here)")
@pytest.mark.parametrize("optimizer,only,min_timed_ms,steps,counted", [
    pytest.param("sgd", "zipf1.2", 0, 3, True, marks=pytest.mark.matrix),  # sgd: ~4 s
    ("rowwise_adagrad", None, 1e6, MAX_TIMED_STEPS, False)])
def test_owner_op_benchmark_times_both_backwards_after_checking_them(tmp_path: Any, optimizer: str,
                                                                     only: Optional[str], min_timed_ms: float,
                                                                     steps: int, counted: bool) -> None:
    """benchmarks.owner_op on CPU: both backwards on the same ids, states compared after the first step (within
    the training benchmark's tolerance of FBGEMM's CPU kernel), the op's two stages and the backward's bytes;
    ``--only`` keeps the preset's workloads whose name holds it; --min-timed-ms past every step's time times
    the bound's steps, 0 times --steps; ``--counted`` (a captured step's sort and walk) recorded."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GIT_COMMIT="testsha")
    cmd = [sys.executable, "-m", "benchmarks.owner_op", "--preset", "smoke", "--steps", "3", "--warmup", "1",
           "--min-timed-ms", str(min_timed_ms), "--optimizer", optimizer, "--out", str(tmp_path)]
    cmd += (["--only", only] if only else []) + (["--counted"] if counted else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(tmp_path, "results.json")) as f:
        out = json.load(f)
    assert out["meta"]["commit"] == "testsha" and out["meta"]["sides"] == ["fbgemm", "pgas"]
    assert out["meta"]["counted"] is counted
    workloads = [w for w in PRESETS["smoke"](1) if only is None or only in w.name]
    assert workloads and [r["name"] for r in out["rows"]] == [w.name for w in workloads]
    for row, w in zip(out["rows"], workloads):
        assert 0 <= row["state_error"] <= 1 and row["steps"] == steps
        assert list(row["pgas_stages_ms"]) == ["owner_sort", "owner_update"]
        assert 0 < row["fbgemm_p50_ms"] <= row["fbgemm_p90_ms"] and 0 < row["pgas_p50_ms"] <= row["pgas_p90_ms"]
        x = make_inputs(w, w.tables, w.batch_per_gpu, 1, INPUT_SEED, torch.device("cpu"))[0]
        distinct = sum(jt.values().unique().numel() for jt in x.to_dict().values())
        assert row["distinct_rows"] == distinct and row["ids"] > distinct
        state_bytes = 4 if optimizer == "rowwise_adagrad" else 0
        assert row["hbm_bytes"] == row["ids"] * (4 * w.dim + 24) + distinct * 2 * (4 * w.dim + state_bytes)


def test_owner_op_times_small_workloads_longer() -> None:
    """A side whose warmup's last step took 0.25 ms gets --min-timed-ms' worth of steps (within the bound); one
    that fills it with --steps keeps --steps; the faster side decides."""
    args = argparse.Namespace(steps=6, min_timed_ms=30.0)
    assert timed_steps(args, {"pgas": [3.0, 0.25]}) == 121
    assert timed_steps(args, {"pgas": [9.0, 7.0]}) == 6
    assert timed_steps(args, {"pgas": [0.25], "fbgemm": [1.0]}) == 121
    assert timed_steps(args, {"pgas": [0.0]}) == MAX_TIMED_STEPS
    assert timed_steps(argparse.Namespace(steps=6, min_timed_ms=0.0), {"pgas": [0.25]}) == 6


@pytest.mark.matrix  # ~15 s a pair: make test's budget; test_train_mode_with_the_owner_backward trains there
@pytest.mark.parametrize("pair", ["rw", "tw"])
def test_train_mode_verifies_states_and_accounts_the_backward(tmp_path: Any, pair: str) -> None:
    """--mode train with FBGEMM's owner backward: both sides' weights and optimizer states agree after the
    warm-up and after the timed steps (bit-exact on CPU), the training step's stages in order, and the
    backward's floor bytes: a gradient row and a sort pair per owned id, a read and write of each distinct
    row and its row-wise Adagrad state, recomputed here from the inputs."""
    out = _run(str(tmp_path), 2, "--pair", pair, "--mode", "train", "--owner-backward", "fbgemm")
    assert out["meta"]["mode"] == "train" and out["meta"]["optimizer"] == "rowwise_adagrad"
    with open(os.path.join(tmp_path, "results.csv")) as f:
        assert "pgas_train_stage_kept_ids_ms" in f.readline()
    for row, w in zip(out["rows"], PRESETS["smoke"](2)):
        assert row["mode"] == "train" and row["max_state_diff"] == 0.0
        for side in ("stock", "pgas"):
            assert 0 < row[f"{side}_train_p50_ms"] <= row[f"{side}_train_p90_ms"]
        assert abs(row["speedup_train"] - row["stock_train_p50_ms"] / row["pgas_train_p50_ms"]) < 1e-9
        stock_first = "bucketize" if pair == "rw" else "splits_launch"
        assert list(row["stock_train_stages_ms"]) == [stock_first, *STOCK_TRAIN_STAGES[1:]]
        assert list(row["pgas_train_stages_ms"]) == PGAS_TRAIN_STAGES
        k = PRESETS["smoke"](2).index(w)
        block = (w.rows + 1) // 2
        ids, distinct = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for s in range(4):
            keys = []
            for rank in range(2):
                x = make_inputs(w, w.tables, w.batch_per_gpu, 4, seed=1000 * rank + k, device=torch.device("cpu"))[s]
                table = torch.repeat_interleave(torch.arange(w.tables), x.lengths().view(w.tables, -1).sum(1))
                keys.append(torch.stack([table, x.values()], 1))
            key = torch.cat(keys)
            owner = key[:, 1] // block if pair == "rw" else key[:, 0] % 2
            ids += torch.bincount(owner, minlength=2).double() / 4
            uniq = torch.unique(key, dim=0)
            uniq_owner = uniq[:, 1] // block if pair == "rw" else uniq[:, 0] % 2
            distinct += torch.bincount(uniq_owner, minlength=2).double() / 4
        row_bytes = 4 * w.dim
        assert row["distinct_rows"] == float(distinct.max())
        bwd = ids * (row_bytes + 24) + distinct * 2 * (row_bytes + 4)
        assert row["train_hbm_bytes"] == int((ids * row_bytes + bwd).max())
        assert row["train_floor_ms"] is None  # CPU: no bandwidths measured


@pytest.mark.matrix  # ~20 s: two layouts benchmarked
def test_layout_ab_times_both_layouts_after_checking_them(tmp_path: Any) -> None:
    """--layout-ab: the PGAS forward with PgasConfig(training=False) is checked against stock, then timed in
    blocks alternating with the training layout's; each row gets both medians."""
    out = _run(str(tmp_path), 2, "--pair", "tw", "--layout-ab", "--steps", "20")
    for row in out["rows"]:
        assert row["pgas_training_layout_p50_ms"] > 0 and row["pgas_inference_layout_p50_ms"] > 0, row
    bad = subprocess.run([sys.executable, "-m", "benchmarks.embedding", "--layout-ab", "--inference-only"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--layout-ab" in bad.stderr


def test_hashed_zipf_ids_are_the_zipf_ranks_scattered_by_the_hash() -> None:
    """``hzipf``: the same draws as ``zipf`` (row r's count is rank r's), each rank moved to rank * hash mod rows,
    as examples/dlrm/data.py moves them: the hottest stays row 0, the next ones are scattered over the table (an
    owner of row-wise blocks does not hold all of them)."""
    rows, n = 1000, 20_000
    ranks = _ids(n, rows, "zipf1.05", torch.Generator().manual_seed(3), torch.device("cpu"))
    hashed = _ids(n, rows, "hzipf1.05", torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(hashed, ranks * ID_HASH % rows)
    counts, moved = torch.bincount(ranks, minlength=rows), torch.bincount(hashed, minlength=rows)
    assert torch.equal(moved[torch.arange(rows) * ID_HASH % rows], counts)
    second = int(moved.topk(2).indices[1])
    assert second == ID_HASH % rows and second >= rows // 8
    assert [w.ids for w in PRESETS["s000-strong-zipf"](4)] == ["hzipf0.9", "hzipf1.05", "hzipf1.2"]


def test_each_workload_owns_its_models_under_auto_whatever_differs() -> None:
    """--owner-backward auto (and --own-models) gives every workload its own models: the three hashed Zipf
    workloads of a preset differ only in their ids, and a shared model's trial would choose for all three on the
    first one's skew (what the s000-weak-zipf runs of two sessions did)."""
    workloads = PRESETS["s000-weak-zipf"](2)
    assert len({shared_models(w) for w in workloads}) == 1
    assert len({own_models(w) for w in workloads}) == len(workloads) == 3
