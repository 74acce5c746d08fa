"""Two PGAS models trained in one process, their steps interleaved, each against its stock twin (CPU, shm).

The shardings of one model form one group (the sharder's): a failed backward consumes the step of its own
model's other shardings, never of another model's step at the same epoch. Each model holds two PGAS EBCs
(``TwoEbcModel``), so a group spans modules. Orders: A's and B's forwards, then their backwards in either order;
and a step whose backward fails on the last rank in model A (its gradient exchange, as
``test_training_errors``' "exchange" fault) while B's same step is in flight: A's step changes nothing on any
rank, B's trains as stock's.
"""

import copy
import pickle
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_pgas import PgasEmbeddingBagCollectionSharder
from torchrec_pgas.testing import (
    LossModel,
    TrainBatch,
    default_model,
    failing_puts,
    random_kjt,
    run_distributed,
    seeded,
    shard,
    state_difference,
    stock_twin,
)
from torchrec_pgas.types import PgasConfig, PgasError

FUSED: Dict[str, Any] = {"learning_rate": 0.05, "stochastic_rounding": False, "eps": 1e-3,
                         "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
# pgas_row_wise and pgas_table_wise tables in both EBCs, no stock sharding: a failed backward's peers must not
# wait in a stock collective (README, limits)
TYPES = {"t0": "pgas_row_wise", "t1": "pgas_table_wise@1", "t2": "pgas_row_wise", "t3": "pgas_table_wise@0",
         "w0": "pgas_table_wise@0", "w1": "pgas_row_wise", "w2": "pgas_table_wise@1", "w3": "pgas_row_wise"}
STEPS, FAILED_STEP = 6, 3


def _pair(rank: int, seed: int) -> Tuple[Any, Any]:
    """A PGAS model and its stock twin from one initial model, each with its own sharder."""
    model = LossModel(default_model(seed, all_sum=True, min_rows=2))
    config = PgasConfig(max_local_batch_size=16, wait_timeout_s=4)
    dev = torch.device("cpu")
    pgas = shard(model, TYPES, dist.group.WORLD, dev, config, FUSED, path="model.")
    stock = shard(model, {k: stock_twin(v) for k, v in TYPES.items()}, dist.group.WORLD, dev, fused_params=FUSED,
                  stock=True, path="model.")
    return pgas, stock


def _interleaved(rank: int, world: int, order: str) -> Dict[str, Any]:
    """Both models' forwards, then their backwards (``order``: "ab", "ba", or "ab-fail": A's backward of step
    FAILED_STEP fails on the last rank); both stock twins train the same batches (A's skips a failed step)."""
    (a, stock_a), (b, stock_b) = _pair(rank, 0), _pair(rank, 1)
    gen = seeded(40 + rank)
    t, w = default_model().ebc.embedding_bag_configs(), default_model().webc.embedding_bag_configs()
    errors: List[Tuple[str, int, str]] = []
    diffs: List[Tuple[float, float]] = []
    for i in range(STEPS):
        batch_a, batch_b = (TrainBatch(random_kjt(t, 8, gen, 5), random_kjt(w, 8, gen, 5, weighted=True))
                            for _ in range(2))
        loss_a, loss_b = a(batch_a)[0], b(batch_b)[0]
        failing = order == "ab-fail" and i == FAILED_STEP
        for name, loss in ((("b", loss_b), ("a", loss_a)) if order == "ba" else (("a", loss_a), ("b", loss_b))):
            try:
                if failing and name == "a" and rank == world - 1:
                    with failing_puts(after=1):
                        loss.backward()
                else:
                    loss.backward()
            except PgasError as e:
                errors.append((name, i, type(e).__name__))
        for stock, batch in ((stock_a, batch_a), (stock_b, batch_b)):
            if not (failing and stock is stock_a):
                stock(batch)[0].backward()
        diffs.append((state_difference(a, stock_a), state_difference(b, stock_b)))
    return {"errors": errors, "diffs": diffs}


def _orders(rank: int, world: int) -> Dict[str, Dict[str, Any]]:
    return {order: _interleaved(rank, world, order) for order in ("ab", "ba", "ab-fail")}


def test_two_models_trained_interleaved_each_equal_stock() -> None:
    results = run_distributed(_orders, 2)
    for rank, per_order in enumerate(results):
        for order, r in per_order.items():
            failed = "PgasError" if rank == 1 else "PgasPeerAbortError"
            assert r["errors"] == ([("a", FAILED_STEP, failed)] if order == "ab-fail" else []), (rank, order, r)
            assert max(max(d) for d in r["diffs"]) <= 1e-5, (rank, order, r["diffs"])


def test_a_copied_or_pickled_sharder_starts_a_group_of_its_own() -> None:
    """A sharder copied or pickled (by a launcher, a config system) stays usable, with an empty group: the
    steps of the models the original sharded are not the copy's."""
    sharder = PgasEmbeddingBagCollectionSharder(pgas_config=PgasConfig(max_local_batch_size=8))
    for copied in (copy.deepcopy(sharder), pickle.loads(pickle.dumps(sharder))):
        assert isinstance(copied, PgasEmbeddingBagCollectionSharder)
        assert copied.fused_params == sharder.fused_params
