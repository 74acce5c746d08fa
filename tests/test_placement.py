"""Where ranks run: one GPU each, all on one GPU when they outnumber the GPUs (or when asked), or CPU."""

import pytest
import torch

from torchrec_pgas.placement import SHARED_GPU_ENV, rank_placement


@pytest.mark.parametrize("gpus,ranks,asked,shared", [(2, 2, "0", False), (1, 2, "0", True), (1, 4, "0", True),
                                                    (8, 4, "0", False), (8, 2, "1", True)])
def test_ranks_share_a_gpu_when_they_outnumber_the_gpus_or_when_asked(
    monkeypatch: pytest.MonkeyPatch, gpus: int, ranks: int, asked: str, shared: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv(SHARED_GPU_ENV, asked)
    p = rank_placement(ranks, "cuda")
    assert p.shared_gpu == shared
    assert [p.device(r) for r in range(ranks)] == [torch.device("cuda", 0 if shared else r) for r in range(ranks)]
    assert p.backend == ("gloo" if shared else "nccl")  # NCCL refuses two ranks on one GPU
    assert p.local_size(ranks) == (1 if shared else ranks)  # TorchRec then places every shard on cuda:0


def test_cpu_ranks_use_gloo_whatever_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    p = rank_placement(3, "cpu")
    assert (p.shared_gpu, p.backend, p.device(2), p.local_size(3)) == (False, "gloo", torch.device("cpu"), 3)
