"""Checkpoints move between pgas_row_wise and stock row_wise, and between world sizes, as stock allows.

``torch.distributed.checkpoint`` saves the weights and the fused optimizer's state; PGAS shards are stock
TorchRec shards (same ShardedTensor metadata and optimizer keys), so 10 PGAS steps saved and loaded into
stock, then 10 stock steps, equal 20 stock steps (and the reverse); a PGAS checkpoint saved at W = 2 loads
at W = 3 and trains on there exactly as stock does. CPU (shm backend), SUM tables: bit-exact training.
"""

import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchrec_pgas.testing import (
    LossModel,
    TrainBatch,
    all_tables,
    default_model,
    local_state,
    random_kjt,
    run_distributed,
    seeded,
    shard,
    stock_twin,
)
from torchrec_pgas.types import PGAS_ROW_WISE, OwnerBackward, PgasConfig, PgasTrainingConfig

FUSED: Dict[str, Any] = {"learning_rate": 0.05, "stochastic_rounding": False}
CPU = torch.device("cpu")


def _dmp(stock: bool, owner_backward: str = OwnerBackward.PGAS) -> Any:
    """SUM tables of at least 3 rows (FBGEMM's CPU TBE backward refuses a shard of zero rows)."""
    model = default_model(all_sum=True, min_rows=3)
    types = all_tables(model, PGAS_ROW_WISE)
    if stock:
        types = {k: stock_twin(v) for k, v in types.items()}
    config = PgasConfig(max_local_batch_size=8, training=PgasTrainingConfig(owner_backward=owner_backward))
    return shard(LossModel(model), types, dist.group.WORLD, CPU, config, FUSED, stock=stock, path="model.")


def _batches(rank: int, steps: int, seed: int) -> List[TrainBatch]:
    model = default_model()
    gen = seeded(seed + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    return [TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True)) for _ in range(steps)]


def _train(dmp: Any, batches: List[TrainBatch]) -> None:
    for batch in batches:
        loss, _ = dmp(batch)
        loss.backward()
        dmp.fused_optimizer.step()


def _state(dmp: Any) -> Dict[str, Any]:
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _load(dmp: Any, path: str) -> None:
    state = _state(dmp)
    dcp.load(state, checkpoint_id=path)
    dmp.fused_optimizer.load_state_dict(state["optim"])


def _interchange(rank: int, world: int, root: str, pgas_first: bool) -> bool:
    """10 steps on one side, saved, loaded into the other, 10 more there == 20 on stock alone, bit for bit:
    FBGEMM's owner backward (stock's own sums; the default's sum in their own order)."""
    batches = _batches(rank, 20, seed=11)
    first, second = _dmp(not pgas_first, "fbgemm"), _dmp(pgas_first, "fbgemm")
    reference = _dmp(stock=True)
    _train(first, batches[:10])
    path = os.path.join(root, "pgas_first" if pgas_first else "stock_first")
    dcp.save(_state(first), checkpoint_id=path)
    dist.barrier()
    _load(second, path)
    _train(second, batches[10:])
    _train(reference, batches)
    got, ref = local_state(second), local_state(reference)
    return got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.stacks
def test_checkpoints_move_between_pgas_and_stock(tmp_path: Any) -> None:
    for pgas_first in (True, False):
        assert all(run_distributed(_interchange, 2, str(tmp_path), pgas_first)), pgas_first


def _save_at_two(rank: int, world: int, root: str) -> None:
    dmp = _dmp(stock=False)
    _train(dmp, _batches(rank, 5, seed=3))
    dcp.save(_state(dmp), checkpoint_id=os.path.join(root, "w2"))


def _load_at_three(rank: int, world: int, root: str) -> bool:
    """The W = 2 PGAS checkpoint (the default owner backward) into PGAS and into stock at W = 3: equal, and
    after 5 more steps equal within the owner backward's summation order (fp32 rounding)."""
    sides = [_dmp(stock=False), _dmp(stock=True)]
    batches = _batches(rank, 5, seed=8)
    for dmp in sides:
        _load(dmp, os.path.join(root, "w2"))
    same = [local_state(dmp) for dmp in sides]
    for dmp in sides:
        _train(dmp, batches)
    after = [local_state(dmp) for dmp in sides]
    loaded = same[0].keys() == same[1].keys() and all(torch.equal(same[0][k], same[1][k]) for k in same[1])
    return loaded and after[0].keys() == after[1].keys() and all(
        torch.allclose(after[0][k], after[1][k], rtol=1e-5, atol=1e-6) for k in after[1])


@pytest.mark.stacks
def test_a_pgas_checkpoint_saved_at_two_ranks_loads_at_three(tmp_path: Any) -> None:
    run_distributed(_save_at_two, 2, str(tmp_path))
    assert all(run_distributed(_load_at_three, 3, str(tmp_path)))
