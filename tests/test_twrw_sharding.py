"""``pgas_table_row_wise`` against stock ``table_row_wise`` at 2 nodes x 2 ranks on CPUs: four processes declared
two nodes (``LOCAL_WORLD_SIZE=2``: TorchRec's intra- and cross-node groups), the ``shm`` backend inside each node,
gloo across. Tables alternate over the nodes; MEAN, weighted, shared and tiny tables included."""

import copy
import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.embeddingbag import PgasEmbeddingBagCollectionSharder, pgas_steps
from torchrec_pgas.placement import rank_placement
from torchrec_pgas.planner import pgas_row_wise, pgas_table_row_wise, with_compute_kernel
from torchrec_pgas.testing import (
    LossModel,
    TrainBatch,
    copy_state_dict,
    default_model,
    iteration_counts,
    random_kjt,
    rank_device,
    run_distributed,
    seeded,
    state_difference,
    train_steps,
)
from torchrec_pgas.types import PgasConfig, PgasError

NODE_SIZE = 2
CPU = torch.device("cpu")
FUSED: Dict[str, Any] = {"learning_rate": 0.05, "stochastic_rounding": False,
                         "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "eps": 1e-3}
STEPS, BAD_STEP = 5, 2


# Per table of the weighted EBC in the mixed plan (table i on node i % 2 where table-row-wise): PGAS table-row-wise
# on each node (a node step needs a table), pgas_row_wise over the job, stock table-row-wise.
MIXED = ("pgas_table_row_wise", "pgas_table_row_wise", "pgas_row_wise", "table_row_wise")


def _generator(kind: str, pgas: bool, table: int) -> Any:
    """Table ``table``'s plan: ``kind``, or its stock twin where not ``pgas``; table-row-wise on node table % 2."""
    fused = EmbeddingComputeKernel.FUSED.value
    if kind.endswith("table_row_wise"):
        if pgas and kind.startswith("pgas"):
            return pgas_table_row_wise(host_index=table % 2)
        return with_compute_kernel(table_row_wise(host_index=table % 2), fused)
    return pgas_row_wise() if pgas and kind.startswith("pgas") else row_wise(compute_kernel=fused)


def _sharded(wrapped: LossModel, pgas: bool, world: int, mixed: Tuple[str, ...] = (),
             device: torch.device = CPU) -> DistributedModelParallel:
    """``wrapped`` with every table table-row-wise, table i on node i % 2 (PGAS or stock); ``mixed``: the
    weighted EBC's tables' kinds. On GPUs every shard sits on its rank's device (``RankPlacement.place_shards``:
    the plan keeps its two nodes when the ranks share a GPU)."""
    sharder = (PgasEmbeddingBagCollectionSharder(fused_params=FUSED, pgas_config=PgasConfig(max_local_batch_size=16))
               if pgas else EmbeddingBagCollectionSharder(fused_params=FUSED))
    plan = {}
    for name, ebc in (("ebc", wrapped.model.ebc), ("webc", wrapped.model.webc)):
        kinds = mixed if mixed and name == "webc" else ("pgas_table_row_wise",) * len(MIXED)
        gens = {c.name: _generator(kinds[i], pgas, i) for i, c in enumerate(ebc.embedding_bag_configs())}
        plan[f"model.{name}"] = construct_module_sharding_plan(ebc, gens, sharder=sharder, local_size=NODE_SIZE,
                                                              world_size=world, device_type=device.type)
    placed = rank_placement(world, device.type).place_shards(ShardingPlan(plan))
    dmp = DistributedModelParallel(copy.deepcopy(wrapped), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=device, plan=placed, sharders=[sharder])
    copy_state_dict(dmp.state_dict(), wrapped.state_dict())
    return dmp


def _train(dmp: DistributedModelParallel, batch: TrainBatch) -> torch.Tensor:
    loss, pooled = dmp(batch)
    loss.backward()
    dmp.fused_optimizer.step()
    return pooled.detach()


def _bad(batch: TrainBatch, what: str, gen: torch.Generator, tables: Tuple[Any, Any]) -> TrainBatch:
    """``batch`` with its first id past every table ("id"), or a batch of 17 samples, over max_local_batch_size
    ("capacity")."""
    if what == "capacity":
        return TrainBatch(random_kjt(tables[0], 17, gen, 5), random_kjt(tables[1], 17, gen, 5, weighted=True))
    kjt = batch.kjt
    values = kjt.values().clone()
    values[0] = 10**6
    return TrainBatch(KeyedJaggedTensor(kjt.keys(), values, None, kjt.lengths(), stride=kjt.stride()), batch.wkjt)


def _twrw(rank: int, world: int, mixed: bool, what: str, device_type: str = "cpu") -> Dict[str, Any]:
    """PGAS and stock TWRW trained on the same batches; the last rank's batch BAD_STEP is bad (``_bad``: every rank
    skips that step, stock never sees it). Per step: the largest output and state difference, the errors, the
    PGAS steps' epochs and the TBEs' iteration counters."""
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE_SIZE)  # TorchRec's node groups: 2 x 2
    device = rank_device(rank, device_type)
    wrapped = LossModel(default_model(min_rows=NODE_SIZE))
    kinds = MIXED if mixed else ()
    pgas, stock = _sharded(wrapped, True, world, kinds, device), _sharded(wrapped, False, world, kinds, device)
    gen = seeded(3 + rank)
    t, w = wrapped.model.ebc.embedding_bag_configs(), wrapped.model.webc.embedding_bag_configs()
    out: Dict[str, List[Any]] = {"outputs": [], "states": [], "errors": [], "epochs": [], "counters": []}
    for i in range(STEPS):
        batch = TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True)).to(device)
        if i == BAD_STEP:
            try:
                _train(pgas, _bad(batch, what, gen, (t, w)).to(device) if rank == world - 1 else batch)
            except PgasError as e:
                out["errors"].append((i, type(e).__name__, str(e)))
        else:
            got, want = _train(pgas, batch), _train(stock, batch)
            out["outputs"].append(float((got - want).abs().max()))
        out["states"].append(state_difference(pgas, stock))
        out["epochs"].append(sorted({step.issued for step in pgas_steps(pgas)}))
        out["counters"].append((iteration_counts(pgas), iteration_counts(stock)))
    return out


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mixed,what", [(False, "id"), (True, "id"), (False, "capacity")])
def test_matches_stock_table_row_wise_and_refuses_a_bad_batch_on_every_node(mixed: bool, what: str,
                                                                             device_type: str) -> None:
    """Forward and training equal to stock TWRW within fp32 rounding (every weight and optimizer state after
    every step); a bad id on one rank raises on all four (its own error there, the abort elsewhere) before
    anything moved, and the steps after it train as stock does without the batch. ``mixed``: the second EBC
    also holds pgas_row_wise over the job and stock TWRW. On GPUs (``cuda``): the node steps are the fused
    kernels among each node's PEs of one NVSHMEM world of four (ranks sharing a GPU where there are fewer)."""
    results = run_distributed(_twrw, 2 * NODE_SIZE, mixed, what, device_type, device_type=device_type)
    bad_error, bad_message = {"id": ("PgasInputError", "has id 1000000 outside"),
                              "capacity": ("PgasCapacityError", "local batch size 17 exceeds")}[what]
    for rank, r in enumerate(results):
        own = rank == len(results) - 1
        assert [e[:2] for e in r["errors"]] == [(BAD_STEP, bad_error if own else "PgasPeerAbortError")], r
        assert (bad_message if own else f"rank {len(results) - 1} aborted") in r["errors"][0][2]
        assert max(r["outputs"]) <= 1e-5 and max(r["states"]) <= 1e-5, (rank, r["outputs"], r["states"])
        assert r["epochs"] == [[i + 1] for i in range(STEPS)], (rank, r["epochs"])
        assert all(set(got) == set(ref) for got, ref in r["counters"]), (rank, r["counters"])


def _interchange(rank: int, world: int, root: str) -> List[float]:
    """Three steps on one side, saved with DCP, loaded into a fresh model of the other side: each direction's
    largest difference between the saved states and the loaded ones (weights and fused-optimizer state)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE_SIZE)
    wrapped = LossModel(default_model(min_rows=NODE_SIZE))
    gen = seeded(5 + rank)
    t, w = wrapped.model.ebc.embedding_bag_configs(), wrapped.model.webc.embedding_bag_configs()
    batches = [TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True)) for _ in range(3)]
    out = []
    for pgas_first in (True, False):
        first, second = _sharded(wrapped, pgas_first, world), _sharded(wrapped, not pgas_first, world)
        for batch in batches:
            _train(first, batch)
        path = os.path.join(root, "pgas_first" if pgas_first else "stock_first")
        dcp.save({"model": first.state_dict(), "optim": first.fused_optimizer.state_dict()}, checkpoint_id=path)
        dist.barrier()
        state = {"model": second.state_dict(), "optim": second.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        second.fused_optimizer.load_state_dict(state["optim"])
        out.append(state_difference(second, first))
    return out


def test_checkpoints_interchange_with_stock_table_row_wise(tmp_path: Any) -> None:
    """A DCP checkpoint of either side loads into the other: every weight and optimizer state shard is the
    same (the shards and their metadata are stock TWRW's), both directions."""
    for rank, diffs in enumerate(run_distributed(_interchange, 2 * NODE_SIZE, str(tmp_path))):
        assert diffs == [0.0, 0.0], (rank, diffs)


def _in_flight(rank: int, world: int) -> List[float]:
    """TrainPipelineSemiSync's order (step i+2's input dist and step i+1's lookup before step i's backward: three
    steps' ids in flight, the rail exchanges of several steps interleaved) against stock trained step by step;
    the largest state difference after each step."""
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE_SIZE)
    wrapped = LossModel(default_model(min_rows=NODE_SIZE))
    gen = seeded(9 + rank)
    t, w = wrapped.model.ebc.embedding_bag_configs(), wrapped.model.webc.embedding_bag_configs()
    batches = [TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True)) for _ in range(5)]
    pgas, stock = _sharded(wrapped, True, world), _sharded(wrapped, False, world)
    diffs = []
    for _ in zip(train_steps(pgas, batches, "three_in_flight", CPU), train_steps(stock, batches, "plain", CPU)):
        diffs.append(state_difference(pgas, stock))
    return diffs


def test_three_steps_in_flight_train_as_stock_table_row_wise() -> None:
    for rank, diffs in enumerate(run_distributed(_in_flight, 2 * NODE_SIZE)):
        assert len(diffs) == 5 and max(diffs) <= 1e-5, (rank, diffs)


def _empty_node(rank: int, world: int) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE_SIZE)
    try:
        _sharded(LossModel(default_model(min_rows=NODE_SIZE)), True, world,
                 ("pgas_table_row_wise", "table_row_wise", "pgas_row_wise", "table_row_wise"))
    except PgasError as e:
        return str(e)
    return "sharded"


def test_a_node_without_a_table_of_the_sharding_is_refused_at_sharding_on_every_rank() -> None:
    """One pgas_table_row_wise table in a module of two nodes: node 1's step would have no table; every rank
    raises, naming the node, before any collective."""
    for message in run_distributed(_empty_node, 2 * NODE_SIZE):
        assert "nodes [1] hold none of this module's pgas_table_row_wise tables" in message, message
