"""Training through pgas_row_wise and pgas_table_wise against stock TorchRec (CPU, shm backend, gloo).

Both models start from the same weights and take the same batches and upstream gradients; after every
step every local weight shard and fused-optimizer state tensor is compared (``train_against_stock``).
Bit-exact where stock is deterministic: table-wise (the owner's TBE sees what stock's sees), and row-wise
whose EBC has no MEAN table. A row-wise EBC with a MEAN table: stock's mean callback divides the EBC's
SUM features by 1 + 1e-6 as well, pgas_row_wise by 1, so gradients differ by that factor: 1e-5. With fp16
outputs as well, stock's callback divides the fp16 sum by an fp32 divisor, which makes its output fp32 (so
its upstream gradient is never rounded to fp16), while pgas_row_wise's output keeps the configured fp16: fp16
weights then differ by about one fp16 ulp, Adagrad's fp32 sums of squared gradients by about twice the gradient's
fp16 rounding (2^-11) relative: 2e-3.

Row-wise Adagrad's weight decay (L2, DECOUPLE) with the default owner update: FBGEMM 1.6's CPU kernels drop it
for fp32 tables (its GPU kernels apply it), so stock CPU is not the reference there; those cases train against the
same plan with ``owner_backward="reference"`` (the owner backward in torch ops, float64 sums, FBGEMM's GPU
semantics) instead. With FBGEMM's owner backward both sides run FBGEMM's CPU kernels: compared with stock.

A representative subset runs in ``make test``; the whole matrix is marked ``matrix`` (CI runs it after).
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torchrec.modules.embedding_configs import DataType, PoolingType

from torchrec_pgas.testing import (
    TrainBatch,
    TwoEbcModel,
    all_tables,
    default_tables,
    random_kjt,
    rank_device,
    run_distributed,
    seeded,
    spread_tables,
    train_against_stock,
    with_training,
)
from torchrec_pgas.sharding.owner_backward import op_available
from torchrec_pgas.sharding import kept_ids as kept_ids_module
from torchrec_pgas.sharding.kept_ids import ReceivedBlocks
from torchrec_pgas.step_abi import OwnerKeysConfig, as_tensor, build
from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_WISE, PgasConfig

STEPS = 20
MATRIX_STEPS = 8  # each case's state still passes empty batches and Adagrad's growing sums; 2.5x fewer steps
CONFIG = PgasConfig(max_local_batch_size=16, avg_pooling_capacity=12, wait_timeout_s=60)


@dataclasses.dataclass(frozen=True)
class Case:
    """One training comparison: its plan, optimizer, tables and loop."""

    kind: str  # PGAS_ROW_WISE, PGAS_TABLE_WISE, "pgas_mixed" or "mixed" (``_types``)
    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    weight_decay: float = 0.0
    decay_mode: WeightDecayMode = WeightDecayMode.NONE  # row-wise Adagrad's weight_decay_mode
    pooling: str = "sum"  # "sum", or "mixed": default_tables' MEAN tables
    data_type: DataType = DataType.FP32
    output_dtype: SparseType = SparseType.FP32
    loop: str = "plain"
    eval_every: int = 0  # an eval forward after every that many steps
    eval_grad: bool = False  # ... with grad enabled, its output dropped
    owner_backward: str = "fbgemm"  # PgasConfig.owner_backward (FBGEMM's path: bitwise equal to stock)
    max_padded_eager_ids: Optional[int] = None  # ... and its eager layout's bound (None: the device's default)
    twin: str = "stock"  # what it trains against: "stock", or "reference" (the same plan, the owner backward's
    # torch-ops reference: where stock's CPU kernels drop weight decay)

    @property
    def tolerance(self) -> float:
        """0 (bit-exact; fp16 weights too, stochastic rounding off) unless a row-wise EBC has a MEAN table
        (module docstring); the owner backward sums in its own order."""
        fp16 = self.output_dtype == SparseType.FP16 or self.data_type == DataType.FP16
        if self.owner_backward in ("pgas", "auto") or self.twin == "reference":  # its own sums' order: fp32 rounding,
            # or one fp16 ulp
            return 1e-3 if fp16 else 1e-5
        if self.pooling != "mixed" or self.kind == PGAS_TABLE_WISE:
            return 0.0
        return 2e-3 if self.output_dtype == SparseType.FP16 else 1e-5


def _model(case: Case, seed: int, min_rows: int) -> TwoEbcModel:
    """``default_tables`` with the case's pooling and weight dtype; tables of fewer than ``min_rows`` rows
    grow to it (FBGEMM's CPU TBE backward refuses a shard of zero rows, stock's and ours alike: a table
    smaller than W trains on GPUs only, test_gpu_training.py)."""
    def tables(prefix: str, weighted: bool) -> List[Any]:
        out = []
        for t in default_tables(prefix):
            pooling = PoolingType.SUM if case.pooling == "sum" or weighted else t.pooling
            out.append(dataclasses.replace(t, pooling=pooling, data_type=case.data_type,
                                           num_embeddings=max(t.num_embeddings, min_rows)))
        return out

    return TwoEbcModel(tables("t", False), tables("w", True), seed=seed)


def _types(case: Case, model: TwoEbcModel, world: int) -> Dict[str, str]:
    if case.kind == PGAS_TABLE_WISE:
        return spread_tables(model, world)
    types = all_tables(model, PGAS_ROW_WISE)
    if case.kind in ("mixed", "pgas_mixed"):  # both PGAS types in one EBC each, "mixed": stock's two as well (the
        last = min(1, world - 1)  # table-wise ones on rank 0 alone at W = 1)
        types.update({"t1": f"pgas_table_wise@{last}", "w0": "pgas_table_wise@0"})
        if case.kind == "mixed":
            types.update({"t0": "row_wise", "t3": "table_wise@0", "w2": f"table_wise@{last}"})
    return types


def _batches(model: TwoEbcModel, rank: int, steps: int) -> List[TrainBatch]:
    """Bags of 0-6 ids, every third step all empty on rank 1 (a rank with nothing to look up)."""
    gen = seeded(77 + rank)
    t, w = model.ebc.embedding_bag_configs(), model.webc.embedding_bag_configs()
    return [TrainBatch(random_kjt(t, 8, gen, 6, empty=rank == 1 and i % 3 == 2),
                       random_kjt(w, 8, gen, 6, weighted=True)) for i in range(steps)]


def _train_cases(rank: int, world: int, cases: List[Case], device_type: str,
                 steps: int = STEPS) -> List[Tuple[str, float, float]]:
    """(case, worst |pgas - stock| over the steps, its tolerance) for every case, one process group."""
    out = []
    for i, case in enumerate(cases):
        model = _model(case, seed=i, min_rows=world if device_type == "cpu" else 1)
        fused: Dict[str, Any] = {"optimizer": case.optimizer, "learning_rate": 0.05, "eps": 1e-3,
                                 "weight_decay": case.weight_decay, "weight_decay_mode": case.decay_mode,
                                 "stochastic_rounding": False,
                                 "output_dtype": case.output_dtype}
        config = with_training(CONFIG, owner_backward=case.owner_backward,
                               max_padded_eager_ids=case.max_padded_eager_ids)
        twin = with_training(config, owner_backward="reference") if case.twin == "reference" else None
        diffs = train_against_stock(model, _types(case, model, world), _batches(model, rank, steps),
                                    dist.group.WORLD, rank_device(rank, device_type), fused, config,
                                    loop=case.loop, eval_every=case.eval_every, eval_grad=case.eval_grad,
                                    twin_config=twin)
        out.append((repr(case), max(diffs), case.tolerance))
    return out


def _assert_equal(results: List[List[Tuple[str, float, float]]]) -> None:
    for rank_results in results:
        for case, worst, tol in rank_results:
            assert worst <= tol * (1 + 1e-9) + (0 if tol == 0 else 1e-7), f"{case}: |pgas - stock| / max(1, |stock|) {worst} > {tol}"


QUICK = [
    Case(PGAS_ROW_WISE),
    Case(PGAS_TABLE_WISE, pooling="mixed"),
    Case(PGAS_ROW_WISE, EmbOptimType.EXACT_SGD, pooling="mixed"),
    Case("mixed", weight_decay=0.01, decay_mode=WeightDecayMode.L2, eval_every=4),
    Case("mixed", weight_decay=0.01, decay_mode=WeightDecayMode.DECOUPLE, owner_backward="pgas", twin="reference"),
    Case(PGAS_ROW_WISE, eval_every=3, eval_grad=True),
    Case(PGAS_ROW_WISE, loop="sparse_dist"),
    Case(PGAS_TABLE_WISE, loop="three_in_flight"),
    Case(PGAS_ROW_WISE, EmbOptimType.EXACT_ADAGRAD, pooling="mixed", data_type=DataType.FP16,
         output_dtype=SparseType.FP16),
]


@pytest.mark.stacks
def test_training_matches_stock_at_two_ranks() -> None:
    """Row-wise and table-wise, SGD and row-wise Adagrad (weight decay), SUM and MEAN, weighted features, a
    shared table, empty bags, a table of W rows and rows not divisible by W, a mixed plan, eval forwards
    between steps (no_grad, and with grad whose output is dropped: its buffer slot is released at the next
    step), fp16 weights and outputs with a MEAN table, TorchRec's TrainPipelineSparseDist, and
    TrainPipelineSemiSync's order (three steps in flight; the pipeline itself runs on GPUs only,
    tests/test_gpu_training.py): every weight and optimizer state equal (module docstring: tolerances)."""
    _assert_equal(run_distributed(_train_cases, 2, QUICK, "cpu"))


def _padded_ids_match(rank: int, world: int, kind: str) -> int:
    """Train a few steps with every owner's ``kept_ids`` checked against the torch ops' reading of the same
    bags (the ``kept_bags`` op's fallback) and against what a captured step reads: the ``owner_keys`` op over
    ``kept_ids_padded`` (no host sync, a fixed capacity), with every feature's key base 0, gives the same ids,
    bags and weights, then padding (key past every table, bag -1) and nothing else. Returns how many owner
    rebuilds were checked."""
    checked: List[int] = []
    exact = ReceivedBlocks.kept_ids
    key_limit = 2 ** 40  # past any id of the test's tables

    def both(received: ReceivedBlocks, epoch: int, rows: int, block_features: Tuple[int, int, int], batches: torch.Tensor,
             whole: Any = None) -> Any:
        kjt = exact(received, epoch, rows, block_features, batches, whole)
        kept_ids_module.op_available = lambda: False  # the same bags read by torch ops (a pure-Python install)
        try:
            by_torch = exact(received, epoch, rows, block_features, batches, whole)
        finally:
            kept_ids_module.op_available = op_available
        assert torch.equal(kjt.offsets(), by_torch.offsets()) and torch.equal(kjt.values(), by_torch.values())
        assert (kjt.weights_or_none() is None) == (by_torch.weights_or_none() is None)
        assert kjt.weights_or_none() is None or torch.equal(kjt.weights(), by_torch.weights())
        lay = received.layout
        slot_base = torch.tensor(lay.index_block(epoch % lay.num_slots, 0))
        padded = received.kept_ids_padded(slot_base, rows, block_features, batches, torch.tensor(True))
        n, lengths, nbags = kjt.values().numel(), kjt.lengths(), kjt.lengths().numel()
        assert padded.capacity == world * lay.ids_capacity >= n and padded.stride == kjt.stride()
        assert torch.equal(padded.bags.offsets, kjt.offsets())
        config = build(OwnerKeysConfig, first_bag=0, end_bag=nbags, stride=padded.stride, key_limit=key_limit)
        keys, bags, psw = torch.ops.torchrec_pgas.owner_keys(
            padded.ids, padded.weights, padded.bags.first_id, padded.bags.first_weight, padded.bags.offsets,
            torch.zeros(nbags // padded.stride, dtype=torch.int64), as_tensor(config), padded.capacity)
        assert torch.equal(keys[:n], kjt.values()) and keys.numel() == padded.capacity  # past n: not written
        assert torch.equal(bags[:n], torch.repeat_interleave(torch.arange(nbags, dtype=torch.int32), lengths))
        if kjt.weights_or_none() is not None:
            assert torch.equal(psw[:n], kjt.weights())
        checked.append(n)
        return kjt

    ReceivedBlocks.kept_ids = both  # type: ignore[method-assign]
    try:
        case = Case(kind, pooling="mixed")
        model = _model(case, seed=1, min_rows=world)
        fused = {"optimizer": case.optimizer, "learning_rate": 0.05, "eps": 1e-3, "stochastic_rounding": False}
        train_against_stock(model, _types(case, model, world), _batches(model, rank, 4), dist.group.WORLD,
                            rank_device(rank, "cpu"), fused, with_training(CONFIG, owner_backward="fbgemm"))
    finally:  # FBGEMM's owner backward: every eager step reads the kept ids (the owner update's may not)
        ReceivedBlocks.kept_ids = exact  # type: ignore[method-assign]
    return len(checked)


@pytest.mark.skipif(not op_available(), reason="the owner_keys op is not built (no nvcc here)")
@pytest.mark.parametrize("kind", [PGAS_ROW_WISE, PGAS_TABLE_WISE])
def test_kept_ids_padded_reads_what_kept_ids_reads(kind: str) -> None:
    """The captured step's rebuild of the kept ids (device offsets, the owner_keys op at a fixed capacity whose
    positions past the ids it leaves unwritten) reads every id, bag and weight the eager rebuild reads, here on
    the CPU backend's buffers (the GPU replay test covers it in a graph: test_gpu_training.py)."""
    assert all(n >= 4 for n in run_distributed(_padded_ids_match, 2, kind))


# FBGEMM's CPU TBE trains with SGD and the Adagrads only, and has no bf16 output: Adam, LAMB and bf16 run on
# GPUs (test_gpu_training.py). A mixed plan runs fp32 only: its stock table_wise tables of an EBC sit on one
# rank, and stock TorchRec over gloo aborts on such a sharding with fp16 outputs by itself (the rank that owns
# none receives fp32-sized data: "Received data size doesn't match expected size"), with no PGAS table in it.
FULL = [Case(kind, opt, wd, mode, pooling, data_type, out, loop=loop)
        for kind in (PGAS_ROW_WISE, PGAS_TABLE_WISE, "mixed")
        for opt, wd, mode in ((EmbOptimType.EXACT_SGD, 0.0, WeightDecayMode.NONE),
                              (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.0, WeightDecayMode.NONE),
                              (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.01, WeightDecayMode.L2),
                              (EmbOptimType.EXACT_ADAGRAD, 0.0, WeightDecayMode.NONE))
        for pooling in ("sum", "mixed")
        for data_type, out in ((DataType.FP32, SparseType.FP32), (DataType.FP16, SparseType.FP16))
        for loop in ("plain", "sparse_dist", "three_in_flight")
        if kind != "mixed" or out == SparseType.FP32]
# The default owner update with weight decay, against its reference (module docstring).
FULL += [Case(kind, EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.01, mode, pooling, data_type, out, owner_backward="pgas",
              twin="reference")
         for kind in (PGAS_ROW_WISE, PGAS_TABLE_WISE, "mixed")
         for mode in (WeightDecayMode.L2, WeightDecayMode.DECOUPLE)
         for pooling in ("sum", "mixed")
         for data_type, out in ((DataType.FP32, SparseType.FP32), (DataType.FP16, SparseType.FP16))
         if kind != "mixed" or out == SparseType.FP32]


# At three ranks (row blocks of unequal sizes, a third source of every owner's ids, table-wise tables on three
# ranks), the cases where that changes what our code does: every plan x pooling x dtypes x loop with row-wise
# Adagrad; each other optimizer once a plan and dtype (its states' shapes over the uneven row blocks), plain loop;
# and the owner update against its reference (it sums every source's ids itself). Elsewhere the optimizer's math
# is FBGEMM's on both sides (owner_backward="fbgemm"), and the world size leaves it as the two-rank matrix ran it.
THREE_RANKS = [c for c in FULL if c.owner_backward == "pgas" or (c.optimizer, c.weight_decay) == (
    EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.0) or (c.loop, c.pooling) == ("plain", "mixed")]


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1500)  # about 1.5 minutes at W = 2 on an idle 2-core machine, 1.3 at W = 3
@pytest.mark.parametrize("world,cases", [(2, FULL), (3, THREE_RANKS)], ids=["2", "3"])
def test_training_matrix_matches_stock(world: int, cases: List[Case]) -> None:
    """Every sharding x optimizer x pooling x dtypes x loop (120 cases) and the owner update's weight decay against
    its reference (20) at 2 ranks; at 3, the 65 of them where the world size matters (THREE_RANKS). CI, after make
    test."""
    _assert_equal(run_distributed(_train_cases, world, cases, "cpu", MATRIX_STEPS))
