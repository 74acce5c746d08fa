"""The smallest complete torchrec-pgas program: shard an EBC with the PGAS sharder, run a forward.

    torchrun --nproc_per_node=2 examples/minimal.py

With a GPU it uses the nvshmem backend (fused GPU kernels) over NCCL, one GPU
per process; otherwise gloo and the shm backend on CPU. Nothing else changes.
More processes than GPUs share one GPU over gloo (torchrec_pgas.placement): a
way to test multi-rank behaviour on one GPU, never a performance setup.
"""

import os

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from torchrec_pgas import PgasEmbeddingBagCollectionSharder, check_errors, shutdown
from torchrec_pgas.placement import best_placement
from torchrec_pgas.planner import pgas_row_wise


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    placement = best_placement(local_world)
    device = placement.device(int(os.environ["LOCAL_RANK"]))
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(placement.backend)

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t_user", num_embeddings=100_000, embedding_dim=64, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", num_embeddings=50_000, embedding_dim=32, feature_names=["item"]),
        ],
        device=torch.device("meta"),  # DMP materializes only this rank's shards
    )
    sharder = PgasEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc, {"t_user": pgas_row_wise(), "t_item": pgas_row_wise()},
        sharder=sharder, local_size=placement.local_size(local_world), world_size=world, device_type=device.type,
    )
    model = DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
        plan=ShardingPlan({"": plan}), sharders=[sharder],
    )

    batch = 8  # local batch: user bags of 2 ids, item bags of 3 ids
    gen = torch.Generator().manual_seed(rank)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "item"],
        values=torch.cat([torch.randint(0, 100_000, (2 * batch,), generator=gen),
                          torch.randint(0, 50_000, (3 * batch,), generator=gen)]),
        lengths=torch.tensor([2] * batch + [3] * batch),
    ).to(device)
    with torch.no_grad():
        out = model(kjt).to_dict()
    check_errors(model)  # GPU kernels report bad ids here (or at the next forward)
    line = (f"rank {rank}: {'nvshmem' if on_gpu else 'shm'} backend on {device}"
            f"{' (shared)' if placement.shared_gpu else ''}, pooled user {tuple(out['user'].shape)}, "
            f"item {tuple(out['item'].shape)}")
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    del model  # it holds the process group: shutdown destroys the group only once nothing does
    shutdown()


if __name__ == "__main__":
    main()
