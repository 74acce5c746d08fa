"""A small 2-rank pgas_row_wise case for compute-sanitizer (torchrun --nproc_per_node=2): three no-grad
forwards, then three training steps (the gradient exchange and the owners' update: by default the owner
update kernel, ``owner_backward="pgas"``; ``SANITIZER_OWNER_BACKWARD=fbgemm``: FBGEMM's backward).

One GPU per rank, or both ranks on one GPU (torchrec_pgas.placement) when the machine has one.
``SANITIZER_WAIT_S`` raises the PGAS wait timeout: memcheck slows the kernels."""

import os

import torch
import torch.distributed as dist

from torchrec_pgas import check_errors
from torchrec_pgas.placement import rank_placement
from torchrec_pgas.testing import LossModel, TrainBatch, default_model, random_kjt, seeded, shard
from torchrec_pgas.types import PGAS_ROW_WISE, PgasConfig, PgasTrainingConfig


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    placement = rank_placement(int(os.environ["LOCAL_WORLD_SIZE"]))
    dev = placement.device(rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(placement.backend)
    model = default_model()
    types = {c.name: PGAS_ROW_WISE for e in (model.ebc, model.webc) for c in e.embedding_bag_configs()}
    config = PgasConfig(max_local_batch_size=8, wait_timeout_s=float(os.environ.get("SANITIZER_WAIT_S", "120")),
                        training=PgasTrainingConfig(
                            owner_backward=os.environ.get("SANITIZER_OWNER_BACKWARD", "pgas")))
    pgas = shard(LossModel(model), types, dist.group.WORLD, dev, config, {"learning_rate": 0.05}, path="model.")
    gen = seeded(rank)
    for step in range(6):
        batch = TrainBatch(random_kjt(model.ebc.embedding_bag_configs(), 8, gen),
                           random_kjt(model.webc.embedding_bag_configs(), 8, gen, weighted=True)).to(dev)
        with torch.set_grad_enabled(step >= 3):
            loss, _ = pgas(batch)
        if step >= 3:
            loss.backward()
            pgas.fused_optimizer.step()
    check_errors(pgas)
    print(f"sanitizer_case rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
