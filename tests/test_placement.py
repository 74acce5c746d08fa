"""Where ranks run: one GPU each, all on one GPU when they outnumber the GPUs (or when asked), or CPU."""

import pytest
import torch
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_pgas.placement import SHARED_GPU_ENV, RankPlacement, rank_placement


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


@pytest.mark.parametrize("shared", [True, False])
def test_placed_shards_keep_the_plans_nodes(shared: bool) -> None:
    """A 2 x 2 table-row-wise plan (local_size 2, so TorchRec names cuda:0 and cuda:1) placed for four ranks on one
    shared GPU or on a GPU each: the shards stay on their ranks (the two nodes' row blocks), their devices are the
    ranks' devices."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10,
                                                     feature_names=[f"f{i}"]) for i in range(2)])
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        ebc, {"t0": table_row_wise(host_index=0), "t1": table_row_wise(host_index=1)}, local_size=2, world_size=4,
        device_type="cuda")})
    placed = RankPlacement("cuda", shared_gpu=shared).place_shards(plan)
    shards = {t: [(s.placement.rank(), str(s.placement.device()), s.shard_offsets[0]) for s in
                  placed.plan["ebc"][t].sharding_spec.shards] for t in ("t0", "t1")}  # type: ignore[index,union-attr]
    dev = (lambda r: "cuda:0") if shared else (lambda r: f"cuda:{r}")
    assert shards == {"t0": [(0, dev(0), 0), (1, dev(1), 5)], "t1": [(2, dev(2), 0), (3, dev(3), 5)]}
