"""A small 2-rank pgas_row_wise forward for compute-sanitizer (torchrun --nproc_per_node=2)."""

import os

import torch
import torch.distributed as dist

from torchrec_pgas import check_errors
from torchrec_pgas.testing import default_model, random_kjt, seeded, shard
from torchrec_pgas.types import PGAS_ROW_WISE, PgasConfig


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", rank)
    model = default_model()
    types = {c.name: PGAS_ROW_WISE for e in (model.ebc, model.webc) for c in e.embedding_bag_configs()}
    pgas = shard(model, types, dist.group.WORLD, dev, PgasConfig(max_local_batch_size=8))
    gen = seeded(rank)
    with torch.no_grad():
        for _ in range(3):
            kjt = random_kjt(model.ebc.embedding_bag_configs(), 8, gen).to(dev)
            wkjt = random_kjt(model.webc.embedding_bag_configs(), 8, gen, weighted=True).to(dev)
            pgas(kjt, wkjt)
        check_errors(pgas)
    print(f"sanitizer_case rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
