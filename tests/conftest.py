"""GPU tests are marked ``gpu`` and skip cleanly where there is no GPU. They run ``PGAS_TEST_WORLD`` ranks
(default 2; those also marked ``peers`` at least two), one per GPU while the GPUs suffice and otherwise all
on one GPU over gloo (``torchrec_pgas.placement``; ``TORCHREC_PGAS_SHARED_GPU=1`` asks for that mode on any
machine). Tests marked ``one_gpu`` run W ranks' kernels in one process (``torchrec_pgas.virtual_ranks``)."""

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
