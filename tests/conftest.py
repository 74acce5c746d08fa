"""GPU tests are marked ``gpu`` and skip cleanly where fewer GPUs exist than their world size (2, or
``PGAS_TEST_WORLD``)."""

import os

import pytest
import torch

# Keep NVLink multicast off in every process (shared GPU hosts).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    need = max(2, int(os.environ.get("PGAS_TEST_WORLD", "2")))  # tests/test_gpu.py's world size
    if torch.cuda.device_count() >= need:
        return
    skip = pytest.mark.skip(reason=f"needs {need} GPUs, found {torch.cuda.device_count()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
