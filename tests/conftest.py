"""GPU tests are marked ``gpu`` and skip cleanly where fewer GPUs exist than their world size (2, or
``PGAS_TEST_WORLD``: 1 runs them on a one-GPU machine); those also marked ``peers`` need two ranks, those
marked ``one_gpu`` one GPU."""

import os

import pytest
import torch

# Keep NVLink multicast off in every process (shared GPU hosts).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    world = int(os.environ.get("PGAS_TEST_WORLD", "2"))  # the GPU tests' world size
    have = torch.cuda.device_count()
    for item in items:
        if "gpu" not in item.keywords:
            continue
        # peers: at least two ranks; one_gpu: every rank on one GPU, whatever the world size
        need = 1 if "one_gpu" in item.keywords else max(world, 2) if "peers" in item.keywords else world
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, found {have}"))
