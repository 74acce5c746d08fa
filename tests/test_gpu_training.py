"""Training on GPUs (the nvshmem backend's kernels and FBGEMM's CUDA TBE) against stock TorchRec.

The CPU twins are test_training.py, test_training_errors.py; here the optimizers FBGEMM trains only on
GPUs (Adam, LAMB), TorchRec's TrainPipelineSemiSync itself, tables smaller than W, and the device-side
error path: a bad id is recorded by the kernels, so the step's backward (not its forward) raises, on every
rank, and changes nothing. World size ``PGAS_TEST_WORLD`` (ranks share a GPU when they outnumber them).
``PGAS_TEST_REPORT=<dir>``: each case's worst |pgas - stock| goes to ``<dir>/training_diffs.json``.
"""

import json
import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from torchrec.modules.embedding_configs import DataType

from test_training import Case, _train_cases
from test_training_errors import _bad_batch, _failed_backward, _misuse, check_failed_backward, check_misuse
from torchrec_pgas.testing import run_distributed

pytestmark = pytest.mark.gpu
WORLD = int(os.environ.get("PGAS_TEST_WORLD", "2"))
PEERS = max(WORLD, 2)
# FBGEMM's CUDA backward sums a row's gradients in the same order for both (the ids arrive in stock's order),
# but its kernels are not promised deterministic: 1e-5, and the report shows the differences measured.
GPU_TOL = 1e-5

CASES = [
    Case("pgas_row_wise"),
    Case("pgas_table_wise", pooling="mixed"),
    Case("mixed", EmbOptimType.EXACT_SGD, pooling="mixed", eval_every=3, eval_grad=True),
    Case("pgas_row_wise", EmbOptimType.ADAM, weight_decay=0.01, eval_every=4),
    Case("pgas_table_wise", EmbOptimType.LAMB),
    Case("pgas_row_wise", EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.01, data_type=DataType.FP16,
         output_dtype=SparseType.FP16),
    Case("pgas_table_wise", output_dtype=SparseType.BF16),
    Case("pgas_row_wise", loop="sparse_dist"),
    Case("pgas_row_wise", EmbOptimType.ADAM, loop="semi_sync"),
    Case("pgas_table_wise", loop="semi_sync"),
    # the owner backward (PgasConfig.owner_backward="pgas") in place of FBGEMM's
    Case("pgas_row_wise", owner_backward="pgas"),
    Case("pgas_table_wise", EmbOptimType.EXACT_SGD, pooling="mixed", owner_backward="pgas"),
    Case("pgas_row_wise", EmbOptimType.ADAM, owner_backward="pgas", loop="sparse_dist"),
    Case("pgas_row_wise", EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.01, data_type=DataType.FP16,
         output_dtype=SparseType.FP16, owner_backward="pgas"),
]


def _report(name: str, results: List[List[Tuple[str, float, float]]]) -> None:
    folder = os.environ.get("PGAS_TEST_REPORT")
    if not folder:
        return
    path = os.path.join(folder, "training_diffs.json")
    report: Dict[str, Any] = json.load(open(path)) if os.path.exists(path) else {}
    report[name] = [[case, worst] for case, worst, _ in results[0]]
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def test_training_matches_stock_on_gpus() -> None:
    """Every case above: every local weight shard and optimizer state within 1e-5 of stock's after every
    step (the owner backward's fp16 cases: one fp16 ulp), at PGAS_TEST_WORLD ranks (1: the whole path on one rank)."""
    results = run_distributed(_train_cases, WORLD, CASES, "cuda")
    _report(f"world {WORLD}", results)
    for rank_results in results:
        for case, worst, tol in rank_results:
            assert worst <= max(GPU_TOL, tol), f"{case}: |pgas - stock| {worst}"


@pytest.mark.peers
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
@pytest.mark.parametrize("what", ["id", "wid", "capacity"])
def test_a_bad_batch_changes_nothing_on_gpus(kind: str, what: str) -> None:
    """A bad id is recorded on the device of its rank only (``id``: in the EBC whose backward runs second, so
    the first one's backward must give the step up from that record; ``wid``: in the one that runs first); a
    batch over the capacity gives the step up on the host (its forward returns zeros and runs the stages
    empty, so every sharding of the model stays in step). Either way the step's backward raises on both ranks
    (the bad rank its error, the peer the abort), no weight moves, and the next steps train on both."""
    results = run_distributed(_bad_batch, 2, kind, what, "cuda")
    r0, r1 = results
    expected = "exceeds PgasConfig.max_local_batch_size=16" if what == "capacity" else "has id 37 outside [0, 37)"
    assert [e[:2] for e in r1["errors"]] == [(2, "PgasCapacityError" if what == "capacity" else "PgasInputError")], r1
    assert expected in r1["errors"][0][2]
    assert [e[:2] for e in r0["errors"]] == [(2, "PgasPeerAbortError")], r0
    assert r0["equal"] and r1["equal"], (r0, r1)


@pytest.mark.peers
def test_misuse_raises_clearly_on_gpus() -> None:
    check_misuse(run_distributed(_misuse, 2, "cuda"), "from rank 1")


@pytest.mark.peers
@pytest.mark.parametrize("kind", ["pgas_row_wise", "pgas_table_wise"])
def test_a_failed_backward_holds_no_slot_on_gpus(kind: str) -> None:
    """The CPU twin's case. On GPUs a failed backward's exception alone (a reference cycle through the frame
    that raised it) keeps the step's graph to a garbage collection: test_a_bad_batch_changes_nothing_on_gpus
    failed so, three steps after the bad one."""
    check_failed_backward(run_distributed(_failed_backward, 2, kind, "cuda"))
