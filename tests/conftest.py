"""GPU tests are marked ``gpu`` and skip cleanly where there is no GPU. They run ``PGAS_TEST_WORLD`` ranks
(default 2; those also marked ``peers`` at least two), one per GPU while the GPUs suffice and otherwise all
on one GPU over gloo (``torchrec_pgas.placement``; ``TORCHREC_PGAS_SHARED_GPU=1`` asks for that mode on any
machine). Tests marked ``one_gpu`` run W ranks' kernels in one process (``torchrec_pgas.virtual_ranks``).
``PGAS_TEST_REPORT=<dir>``: each failure's report is appended to ``<dir>/failures.log`` as it happens (a run
cut short by a time limit keeps them; pytest prints its own only at the end)."""

import os

import pytest
import torch

# Keep NVLink multicast off in every process (shared GPU hosts).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    have = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and have == 0:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    folder = os.environ.get("PGAS_TEST_REPORT")
    if folder and report.failed:
        with open(os.path.join(folder, "failures.log"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n{report.capstderr[-4000:]}\n")
