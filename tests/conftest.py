"""GPU tests are marked ``gpu`` and skip cleanly where fewer than two GPUs exist."""

import os

import pytest
import torch

# Keep NVLink multicast off in every process (shared GPU hosts).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason=f"needs 2 GPUs, found {torch.cuda.device_count()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
