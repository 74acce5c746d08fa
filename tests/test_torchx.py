"""The torchx component end to end: `torchx run -s local_cwd` with 2 processes on the shm backend."""

import os
import pathlib
import subprocess
import sys

import pytest

from torchrec_pgas.components import dlrm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _torchx_dlrm(*script_args: str, nnodes: int = 1) -> str:
    bin_dir = str(pathlib.Path(sys.executable).parent)  # torchx and torchrun of this environment
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [os.path.join(bin_dir, "torchx"), "run", "-s", "local_cwd", "torchrec_pgas/components.py:dlrm",
         "--nnodes", str(nnodes), "--nproc_per_node", "2", "--",
         *script_args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "job finished: SUCCEEDED" in log, log[-4000:]
    return log


@pytest.mark.matrix  # ~17 s; make test runs the example directly (test_examples.py) and the component's arguments
def test_torchx_local_cwd_runs_the_dlrm_example() -> None:
    log = _torchx_dlrm("--sharding", "pgas", "--batch-size", "32", "--steps", "4", "--max-rows", "2000", "--validate")
    assert "DLRM inference, sharding=pgas (shm), world 2" in log
    assert "validate: first 3 steps" in log and "-> PASS" in log


@pytest.mark.matrix  # ~20 s; make test trains the example directly (test_examples.py)
def test_torchx_local_cwd_trains_the_dlrm_example_with_pgas() -> None:
    log = _torchx_dlrm("--sharding", "pgas", "--train", "--batch-size", "32", "--steps", "4", "--max-rows", "2000",
                       "--validate")
    assert "DLRM train, sharding=pgas (shm), world 2" in log
    assert "validate: 4 training steps" in log and "-> PASS" in log


@pytest.mark.matrix  # ~25 s: four processes
def test_torchx_local_cwd_trains_the_dlrm_example_on_two_nodes() -> None:
    """--nnodes 2: two replicas of two processes (TorchRec's nodes), every table pgas_table_row_wise, validated
    against stock table_row_wise."""
    log = _torchx_dlrm("--sharding", "pgas", "--train", "--batch-size", "32", "--steps", "4", "--max-rows", "2000",
                       "--validate", nnodes=2)
    assert "DLRM train, sharding=pgas (shm, table-row-wise over 2 nodes x 2), world 4" in log
    assert "validate: 4 training steps" in log and "-> PASS" in log


def test_component_passes_script_args_through() -> None:
    """Whatever follows ``--`` reaches examples.dlrm.run as given (the training loop's --pipeline too)."""
    role = dlrm("--sharding", "pgas", "--train", "--pipeline", "sparse_dist").roles[0]
    assert role.args[-1].endswith("-m examples.dlrm.run --sharding pgas --train --pipeline sparse_dist")
