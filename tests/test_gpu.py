"""GPU tests (2+ GPUs): the nvshmem backend against stock TorchRec with NCCL."""

import dataclasses
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import PoolingType

import torchrec_pgas
from torchrec_pgas.runtime import PAD_HEADER_WORDS
from torchrec_pgas.testing import TwoEbcModel, compare_with_stock, default_tables, random_kjt, run_distributed, seeded
from torchrec_pgas.types import PGAS_ROW_WISE, PgasBackendType, PgasConfig

pytestmark = pytest.mark.gpu


def _runtime_roundtrip(rank: int, world: int) -> List[float]:
    rt = torchrec_pgas.init(backend=PgasBackendType.NVSHMEM, device=torch.device("cuda", rank))
    buf = rt.alloc("gpu_data", 64 * world)
    pad = rt.alloc_signals("gpu_sig", world)
    got: List[float] = []
    for epoch in (1, 2):
        payload = torch.full((16,), float(10 * epoch + rank), device=rt.device)
        for peer in range(world):
            rt.put(buf, peer, rank * 64, payload)
            rt.signal(pad, peer, rank, epoch)
        rt.wait(pad, list(range(world)), epoch, timeout_s=30, what="payloads")
        got += buf.view(torch.float32, 0, 16 * world).view(world, 16)[:, 0].tolist()
        rt.check()
        dist.barrier()
    assert pad.words[PAD_HEADER_WORDS:].tolist() == [2] * world
    return got


def test_nvshmem_runtime_puts_and_signals() -> None:
    world = 2
    for got in run_distributed(_runtime_roundtrip, world, backend="nccl"):
        assert got == [10.0 + r for r in range(world)] + [20.0 + r for r in range(world)]


def _harness(rank: int, world: int) -> Dict[str, float]:
    wtables = [dataclasses.replace(t, pooling=PoolingType.SUM) for t in default_tables("w")]
    model = TwoEbcModel(default_tables("t"), wtables)
    gen = seeded(rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    batches = [(random_kjt(t, 8, gen), random_kjt(w, 8, gen, weighted=True)) for _ in range(4)]
    types = {c.name: PGAS_ROW_WISE for c in t + w}
    return compare_with_stock(
        model, types, batches, dist.group.WORLD, torch.device("cuda", rank), PgasConfig(max_local_batch_size=8)
    ).max_abs_diff


def test_harness_on_nvshmem_matches_stock_nccl() -> None:
    for diffs in run_distributed(_harness, 2, backend="nccl"):
        assert len(diffs) == 10
