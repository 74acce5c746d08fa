"""Two CPU probes behind ``docs/plan-table-row-wise.md`` (2026-11-29): four processes declared 2 nodes x 2
(``LOCAL_WORLD_SIZE=2``), gloo between them.

``stock``: TorchRec's own ``table_row_wise`` (tables alternating over the two nodes), forward against the unsharded
EBC, then a backward. ``intra``: a ``pgas_row_wise`` model whose world is its node's group (TorchRec's
``intra_and_cross_node_pg``), one per node, on the ``shm`` backend.

    .venv/bin/python benchmarks/archive/twrw_probes.py stock|intra
"""

import copy
import os
import sys
import traceback
from typing import Any, Dict

os.environ["LOCAL_WORLD_SIZE"] = "2"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchrec.distributed.comm import get_local_size, intra_and_cross_node_pg  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise  # noqa: E402
from torchrec.distributed.types import ShardingEnv, ShardingPlan  # noqa: E402

from torchrec_pgas.testing import copy_state_dict, default_model, random_kjt, run_distributed, seeded, shard  # noqa


def stock(rank: int, world: int) -> Dict[str, Any]:
    ebc = default_model(min_rows=world).ebc
    sharder = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.05})
    gens = {c.name: table_row_wise(host_index=i % 2) for i, c in enumerate(ebc.embedding_bag_configs())}
    plan = construct_module_sharding_plan(ebc, gens, sharder=sharder, local_size=2, world_size=world,
                                          device_type="cpu")
    dmp = DistributedModelParallel(copy.deepcopy(ebc), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])
    copy_state_dict(dmp.state_dict(), ebc.state_dict())
    kjt = random_kjt(ebc.embedding_bag_configs(), 8, seeded(rank), 5)
    out, ref = dmp(kjt).to_dict(), ebc(kjt).to_dict()
    sum(v.sum() for v in out.values()).backward()
    return {"local_size": get_local_size(), "fwd_diff": max(float((out[k] - ref[k]).abs().max()) for k in ref)}


def intra(rank: int, world: int) -> Dict[str, Any]:
    group, _ = intra_and_cross_node_pg(backend="gloo")
    model = default_model(min_rows=2)
    types = {c.name: "pgas_row_wise" for e in (model.ebc, model.webc) for c in e.embedding_bag_configs()}
    dmp = shard(model, types, group, torch.device("cpu"))
    kjt = random_kjt(model.ebc.embedding_bag_configs(), 8, seeded(rank), 5)
    wkjt = random_kjt(model.webc.embedding_bag_configs(), 8, seeded(rank + 9), 5, weighted=True)
    with torch.no_grad():
        out, ref = dmp(kjt, wkjt), model(kjt, wkjt)
    return {"node_world": dist.get_world_size(group), "fwd_diff": max(float((out[k] - ref[k]).abs().max()) for k in ref)}


def probe(rank: int, world: int, which: str) -> Dict[str, Any]:
    try:
        return {"rank": rank, **{"stock": stock, "intra": intra}[which](rank, world)}
    except Exception as e:  # a probe reports, it does not fail
        return {"rank": rank, "error": "".join(traceback.format_exception(e))[-600:]}


if __name__ == "__main__":
    for result in run_distributed(probe, 4, sys.argv[1]):
        print(result)
