"""The owner update op (``torch.ops.torchrec_pgas.owner_update``, ``csrc/owner_update.h``) against its torch-ops
reference (``owner_backward(..., reference=True)``), FBGEMM style: random cases over every optimizer, weight
and gradient dtype, pooling, per-sample weights, shared tables, hot rows and table widths, on CPU (the op's
CPU path: the same algorithm as its CUDA kernel) and, with a GPU, on the GPU; and its input checks.

FBGEMM's CPU TBE has no Adam, so the tables here live in a plain flat buffer laid out as a TBE's (one
allocation, a ``[rows, dim]`` view per table, fp32 optimizer states of FBGEMM's shapes); the comparison with
FBGEMM's own update is ``tests/test_owner_backward.py``.
"""

from types import SimpleNamespace
from typing import Any, List, Optional, Sequence, Tuple

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, WeightDecayMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.owner_backward import OP_MAX_DIM, op_available, op_update, owner_backward
from torchrec_pgas.step_abi import (
    KeptBagsConfig,
    OwnerFeatureDesc,
    OwnerHyper,
    OwnerKeysConfig,
    OwnerUpdateConfig,
    Optimizer,
    WeightDecay,
    as_tensor,
    as_words,
    build,
)

pytestmark = [pytest.mark.skipif(not op_available(), reason="torchrec_pgas._C not built (no nvcc)"),
              pytest.mark.stacks]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class FlatTables:
    """What ``owner_backward`` reads of a TBE, over one flat buffer per state as FBGEMM lays them out."""

    def __init__(self, tables: Sequence[Tuple[int, int]], feature_table_map: List[int], optimizer: EmbOptimType,
                 dtype: torch.dtype, pooling: PoolingMode, mode: WeightDecayMode, device: torch.device) -> None:
        self.embedding_specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in tables]
        self.feature_table_map, self.optimizer, self.pooling_mode = feature_table_map, optimizer, pooling
        self.optimizer_args = SimpleNamespace(eps=1e-3, beta1=0.8, beta2=0.95, weight_decay=0.01 if mode else 0.0,
                                              weight_decay_mode=int(mode))
        gen = torch.Generator().manual_seed(len(tables))
        sizes = [rows * dim for rows, dim in tables]
        self._weights = (torch.randn(sum(sizes), generator=gen) * 0.5).to(dtype).to(device)
        self._states = {
            EmbOptimType.EXACT_SGD: [],
            EmbOptimType.EXACT_ROWWISE_ADAGRAD: [torch.rand(sum(r for r, _ in tables), generator=gen)],
            EmbOptimType.ADAM: [torch.randn(sum(sizes), generator=gen) * 0.1, torch.rand(sum(sizes), generator=gen)],
        }[optimizer]
        self._states = [s.to(device) for s in self._states]

    def get_learning_rate(self) -> float:
        return 0.05

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return [v.view(r, d) for v, (r, d, *_) in zip(self._split(self._weights, False), self.embedding_specs)]

    def split_optimizer_states(self) -> List[List[torch.Tensor]]:
        per_row = self.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
        parts = [self._split(s, per_row) for s in self._states]
        return [[p[t] if per_row else p[t].view(r, d) for p in parts]
                for t, (r, d, *_) in enumerate(self.embedding_specs)]

    def _split(self, flat: torch.Tensor, per_row: bool) -> List[torch.Tensor]:
        return list(flat.split([r if per_row else r * d for r, d, *_ in self.embedding_specs]))

    def state(self) -> List[torch.Tensor]:
        return [self._weights] + self._states


def _kjt(tables: Sequence[Tuple[int, int]], feature_table_map: List[int], batch: int, weighted: bool,
         seed: int, device: torch.device) -> KeyedJaggedTensor:
    """Random bags (empty ones among them), and one bag of 2000 ids of one row (a hot row)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (len(feature_table_map) * batch,), generator=gen)
    lengths[1] = 2000
    ids = torch.cat([torch.randint(0, tables[feature_table_map[bag // batch]][0], (int(n),), generator=gen)
                     if bag != 1 else torch.full((2000,), 3) for bag, n in enumerate(lengths)])
    weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=[f"f{f}" for f in range(len(feature_table_map))], values=ids.to(device),
                             lengths=lengths.to(device), weights=None if weights is None else weights.to(device),
                             stride=batch)


TABLES = [(40, 8), (29, 16), (6, 4), (9, 64), (7, 128), (9, OP_MAX_DIM)]
# Table 1 is shared by features 1 and 2; the hot row is in table 0. The widest table of a layout picks the GPU
# kernel's columns a lane (a warp per row: 1 up to dim 32, 2 up to 64, 4 up to 128, 16 up to the widest dim the
# op takes) and with them its rows in flight.
LAYOUTS = {"dim16": [0, 1, 1, 2], "dim64": [0, 1, 1, 2, 3], "dim128": [0, 1, 1, 2, 4], "dim512": [0, 1, 1, 2, 5]}
CASES = [
    pytest.param(opt, wdt, gdt, pooling, weighted, mode, id=f"{opt.name}-{mode.name}-{str(wdt)[6:]}-{str(gdt)[6:]}-"
                 f"{pooling.name}{'-weighted' if weighted else ''}")
    for opt, mode in ((EmbOptimType.EXACT_SGD, WeightDecayMode.NONE),
                      (EmbOptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.NONE),
                      (EmbOptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.L2),
                      (EmbOptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.DECOUPLE),
                      (EmbOptimType.ADAM, WeightDecayMode.NONE))
    for wdt, gdt in ((torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.bfloat16))
    for pooling, weighted in ((PoolingMode.SUM, False), (PoolingMode.SUM, True), (PoolingMode.MEAN, True))
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("optimizer,weight_dtype,grad_dtype,pooling,weighted,mode", CASES)
def test_op_matches_reference(device: str, layout: str, optimizer: EmbOptimType, weight_dtype: torch.dtype,
                              grad_dtype: torch.dtype, pooling: PoolingMode, weighted: bool,
                              mode: WeightDecayMode) -> None:
    dev, batch, feature_tables = torch.device(device), 6, LAYOUTS[layout]
    tables = TABLES[:max(feature_tables) + 1]
    ref, ours = (FlatTables(tables, feature_tables, optimizer, weight_dtype, pooling, mode, dev) for _ in range(2))
    dim_sum = sum(tables[t][1] for t in feature_tables)
    for step in range(3):
        kjt = _kjt(tables, feature_tables, batch, weighted, seed=step, device=dev)
        grad = (torch.randn(batch + 2, dim_sum + 4, generator=torch.Generator().manual_seed(step)) * 0.1)
        # a view: row stride > D, unit column stride; its rows off the 4-element grid (steps 0, 2) and on it (1)
        start = 4 if step == 1 else 2
        grad = grad.to(grad_dtype).to(dev)[:batch, start:start + dim_sum]
        owner_backward([ref], kjt, grad, [step + 1], reference=True)
        assert op_update(ours, kjt, grad, 0, step + 1)  # the op takes this layout (no fallback)
        for got, want in zip(ours.state(), ref.state()):
            if got.dtype == torch.float16:  # the same fp32 update, rounded once: one fp16 ulp at most
                ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp(min=2.0 ** -14)
                assert bool(((got.float() - want.float()).abs() <= ulp).all()), f"step {step}"
            else:  # roundings differ (fmas, the row's square sum); Adam's step divides by the root of a small
                # second moment and carries them to a few 1e-6 relative: issue 29's fp32 tolerance, rtol 1e-5
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        assert not torch.equal(ours.state()[0], FlatTables(tables, feature_tables, optimizer, weight_dtype, pooling,
                                                             mode, dev).state()[0])  # it did update


LONG_RUN = 100_000  # ids of one row in one step: ~390 chunks of 256 positions, summed in two phases
LONG_TABLES, LONG_FEATURES = [(3000, 64), (500, 16)], [0, 1, 1]


def _long_run_kjt(batch: int, weighted: bool, device: torch.device) -> KeyedJaggedTensor:
    """Row 7 of table 0 hit by LONG_RUN ids spread over feature 0's bags (bags of different lengths, so MEAN
    factors and per-sample weights vary along the run), between random ids; row 3 of table 1 by 5,000 ids over
    features 1 and 2 (a shared table)."""
    gen = torch.Generator().manual_seed(44)
    bags = []
    for f, t in enumerate(LONG_FEATURES):
        hot_row, hot_ids = (7, LONG_RUN) if t == 0 else (3, 2500)
        hot = torch.full((hot_ids,), hot_row)
        hot_bag = torch.randint(0, batch, (hot_ids,), generator=gen)
        for b in range(batch):
            cold = torch.randint(0, LONG_TABLES[t][0], (int(torch.randint(0, 40, (1,), generator=gen)),),
                                 generator=gen)
            ids = torch.cat([cold, hot[hot_bag == b]])
            bags.append(ids[torch.randperm(ids.numel(), generator=gen)])
    lengths = torch.tensor([b.numel() for b in bags])
    values = torch.cat(bags)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=[f"f{f}" for f in range(len(LONG_FEATURES))], values=values.to(device),
                             lengths=lengths.to(device), weights=None if weights is None else weights.to(device),
                             stride=batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer,weight_dtype,grad_dtype,pooling,weighted,mode",
                         [c for c in CASES if c.values[2] != torch.bfloat16])
def test_a_row_of_100k_ids_matches_the_float64_reference(device: str, optimizer: EmbOptimType,
                                                         weight_dtype: torch.dtype, grad_dtype: torch.dtype,
                                                         pooling: PoolingMode, weighted: bool,
                                                         mode: WeightDecayMode) -> None:
    """A run of 10^5 ids crosses hundreds of chunks: its partials and the head of the chunk it ends in, added in
    phase 2, give the row's sum as the reference's float64 sum does, within rtol 1e-5 (fp16 weights: one ulp);
    two runs of the op agree bit for bit."""
    dev, batch = torch.device(device), 32
    kjt = _long_run_kjt(batch, weighted, dev)
    grad = (torch.randn(batch, 64 + 16 + 16, generator=torch.Generator().manual_seed(2)) * 0.1).to(grad_dtype).to(dev)
    ref, ours, again = (FlatTables(LONG_TABLES, LONG_FEATURES, optimizer, weight_dtype, pooling, mode, dev)
                        for _ in range(3))
    owner_backward([ref], kjt, grad, [1], reference=True)
    assert op_update(ours, kjt, grad, 0, 1) and op_update(again, kjt, grad, 0, 1)
    for got, want, repeat in zip(ours.state(), ref.state(), again.state()):
        assert torch.equal(got, repeat)
        if got.dtype == torch.float16:
            ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp(min=2.0 ** -14)
            assert bool(((got.float() - want.float()).abs() <= ulp).all())
        else:  # a column whose 10^5 terms cancel to a small sum keeps the compensated sum's ~n eps^2 error
            # of the terms' magnitude, which Adam's step carries to ~1e-6 absolute (measured on an H200: 1.3e-6)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)


def test_the_cpu_walk_does_not_depend_on_the_thread_count() -> None:
    """The CPU path's chunks are fixed by the used positions, not by its threads: one thread and two update
    a long run bit for bit alike."""
    kjt = _long_run_kjt(16, True, torch.device("cpu"))
    grad = torch.randn(16, 96, generator=torch.Generator().manual_seed(3))
    states = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            tbe = FlatTables(LONG_TABLES, LONG_FEATURES, EmbOptimType.ADAM, torch.float32, PoolingMode.MEAN,
                             WeightDecayMode.NONE, torch.device("cpu"))
            assert op_update(tbe, kjt, grad, 0, 1)
            states.append(tbe.state())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*states))


@pytest.mark.parametrize("device", DEVICES)
def test_op_update_skips_ids_outside_their_tables(device: str) -> None:
    """Ids outside their table's rows update nothing: a KJT with them (negative, past the table, inside the
    next table's keys, past 2^31 where the keys are int32) updates as the KJT without them does, bit for bit;
    a KJT without ids updates nothing."""
    dev, batch, feature_tables = torch.device(device), 4, [0, 1, 1]
    tables = TABLES[:2]
    good = _kjt(tables, feature_tables, batch, weighted=False, seed=7, device=torch.device("cpu"))
    bad_ids = [-3, 40, 47, 2 ** 32 + 5]  # table 0 has 40 rows; key 47 would be table 1's row 7
    per_bag = list(good.values().split(good.lengths().tolist()))
    with_bad = [torch.cat([ids, torch.tensor(bad_ids[:bag % 5], dtype=torch.int64)])
                for bag, ids in enumerate(per_bag)]

    def kjt_of(bags: List[torch.Tensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=good.keys(), values=torch.cat(bags).to(dev),
                                 lengths=torch.tensor([b.numel() for b in bags]).to(dev), stride=batch)

    grad = (torch.randn(batch, 40, generator=torch.Generator().manual_seed(1)) * 0.1).to(dev)
    states = []
    for bags in (per_bag, with_bad):
        tbe = FlatTables(tables, feature_tables, EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.float32,
                         PoolingMode.SUM, WeightDecayMode.L2, dev)
        assert op_update(tbe, kjt_of(bags), grad, 0, 1)
        states.append(tbe.state())
    assert all(torch.equal(a, b) for a, b in zip(*states))
    tbe = FlatTables(tables, feature_tables, EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.float32, PoolingMode.SUM,
                     WeightDecayMode.L2, dev)
    before = [t.clone() for t in tbe.state()]
    assert op_update(tbe, kjt_of([torch.empty(0, dtype=torch.int64)] * len(per_bag)), grad, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(tbe.state(), before))


def _op_args(**change: object) -> dict:
    """A valid one-table, one-feature SGD update (4 ids, batch 2), with ``change`` applied."""
    args = dict(
        keys=torch.tensor([1, 1, 3, 9]), bags=torch.tensor([0, 0, 1, 1], dtype=torch.int32),
        offsets=torch.tensor([0, 2, 4]), per_sample_weights=None, grad=torch.ones(2, 4),
        weights=[torch.zeros(10, 4)], momentum1=[], momentum2=[],
        features=as_words([build(OwnerFeatureDesc, table=0, grad_col=0)], OwnerFeatureDesc),
        hyper=as_tensor(build(OwnerHyper, lr=0.5, eps=0, beta1=0, beta2=0, weight_decay=0, bias_correction1=1,
                              bias_correction2=1, reserved=0)).view(torch.float32),
        config=as_tensor(build(OwnerUpdateConfig, optimizer=Optimizer.SGD, weight_decay_mode=WeightDecay.NONE,
                               mean=0, weighted=0, batch=2)))
    args.update(change)
    return args


def _run(args: dict) -> torch.Tensor:
    torch.ops.torchrec_pgas.owner_update(**args)
    return args["weights"][0]


def test_op_sums_each_rows_ids_and_skips_keys_outside_the_table() -> None:
    """Row 1 gets two ids of bag 0, row 3 one of bag 1, and key 9 is row 9 (in range); lr 0.5."""
    w = _run(_op_args())
    assert w[1].tolist() == [-1.0] * 4 and w[3].tolist() == [-0.5] * 4 and w[9].tolist() == [-0.5] * 4
    assert float(w.abs().sum()) == 8.0
    out_of_range = _run(_op_args(keys=torch.tensor([1, 1, 3, 10])))  # key 10 is past the table's 10 rows
    assert out_of_range[1].tolist() == [-1.0] * 4 and float(out_of_range.abs().sum()) == 6.0


def test_op_takes_each_rows_table_from_its_key() -> None:
    """Two tables (10 and 5 rows): key 12 is row 2 of table 1. An id whose feature reads table 0 but whose key
    lies in table 1 (a corrupt id) adds nothing there, and the run's other ids still apply."""
    w0, w1 = torch.zeros(10, 4), torch.zeros(5, 4)
    features = as_words([build(OwnerFeatureDesc, table=0, grad_col=0), build(OwnerFeatureDesc, table=1, grad_col=4)],
                        OwnerFeatureDesc)
    args = _op_args(keys=torch.tensor([1, 12, 12]), bags=torch.tensor([0, 1, 2], dtype=torch.int32),
                    offsets=torch.tensor([0, 1, 2, 3, 3]), grad=torch.ones(2, 8), weights=[w0, w1],
                    features=features)
    _run(args)  # bag 1 is feature 0 (table 0): skipped in table 1's run; bag 2 is feature 1, sample 0
    assert w0[1].tolist() == [-0.5] * 4 and float(w0.abs().sum()) == 2.0
    assert w1[2].tolist() == [-0.5] * 4 and float(w1.abs().sum()) == 2.0


@pytest.mark.parametrize("device", DEVICES)
def test_op_leaves_a_row_whose_ids_were_all_skipped(device: str) -> None:
    """Adam changes a row even with a zero gradient (its moments decay): a row reached only by corrupt ids (key 13,
    row 3 of table 1, from a bag of table 0's feature) must keep its weights and moments; row 1's id applies."""
    dev = torch.device(device)
    tables = [torch.zeros(10, 4, device=dev), torch.zeros(5, 4, device=dev)]
    m1, m2 = [torch.ones_like(t) for t in tables], [torch.ones_like(t) for t in tables]
    features = as_words([build(OwnerFeatureDesc, table=0, grad_col=0), build(OwnerFeatureDesc, table=1, grad_col=4)],
                        OwnerFeatureDesc)
    torch.ops.torchrec_pgas.owner_update(
        torch.tensor([1, 13], device=dev), torch.tensor([0, 1], dtype=torch.int32, device=dev),
        torch.tensor([0, 1, 2, 2, 2], device=dev), None, torch.ones(2, 8, device=dev), tables, m1, m2, features,
        as_tensor(build(OwnerHyper, lr=0.5, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0, bias_correction1=1,
                        bias_correction2=1, reserved=0)).view(torch.float32).to(dev),
        as_tensor(build(OwnerUpdateConfig, optimizer=Optimizer.ADAM, weight_decay_mode=WeightDecay.NONE, mean=0,
                        weighted=0, batch=2)))
    assert tables[0][1].tolist() == pytest.approx([-0.5] * 4) and float(tables[0].abs().sum()) == 2.0  # row 1
    assert not tables[1].any() and bool((m1[1] == 1).all()) and bool((m2[1] == 1).all())  # row 3: untouched


def _on(device: torch.device, args: dict) -> dict:
    """``args`` with every tensor the op reads on the device moved there (its descriptors and config stay on
    the host), the lists' tensors copied."""
    def move(name: str, v: object) -> object:
        if isinstance(v, list):
            return [t.clone().to(device) for t in v]
        return v.to(device) if isinstance(v, torch.Tensor) and name not in ("features", "config") else v
    return {name: move(name, v) for name, v in args.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_op_stops_at_the_padding_past_every_table_and_applies_nothing_when_told(device: str) -> None:
    """A captured step's fixed capacity: 700 positions of a key past every table's rows (bag -1) after the
    real ids, over several chunks, change nothing, whether or not the device word ``used`` says where the ids
    end; a device word ``apply`` of 0 (a refused step) applies nothing at all, 1 applies the step."""
    dev, pad = torch.device(device), 700
    exact = _run(_on(dev, _op_args()))
    padded = dict(keys=torch.cat([torch.tensor([1, 1, 3, 9]), torch.full((pad,), 10)]),
                  bags=torch.cat([torch.tensor([0, 0, 1, 1]), torch.full((pad,), -1)]).to(torch.int32))
    for used in (None, torch.tensor([4]), torch.tensor([pad + 4]), torch.tensor([10 ** 9])):
        assert torch.equal(_run(_on(dev, _op_args(**padded, used=used))), exact), used
    assert float(_run(_on(dev, _op_args(apply=torch.tensor([0])))).abs().sum()) == 0.0
    assert torch.equal(_run(_on(dev, _op_args(apply=torch.tensor([1])))), exact)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n", [40, 3000, 200_000])
def test_op_walks_alike_at_any_chunk_size(n: int) -> None:
    """The GPU's chunks follow the ids per warp (32 to 256 positions): a step of ``n`` ids (a quarter of them
    on one hot row, runs across chunk boundaries) updates the weights and momentum as the CPU path's
    256-position chunks do, padded to a capacity or not, with or without ``used``."""
    gen = torch.Generator().manual_seed(n)
    rows, dim, batch = 5000, 48, 64
    keys = torch.cat([torch.randint(0, rows, (n - n // 4,), generator=gen), torch.full((n // 4,), 17)]).sort().values
    bags = torch.randint(0, batch, (n,), generator=gen, dtype=torch.int32)
    args = _op_args(offsets=torch.arange(batch + 1) * (n // batch), grad=torch.randn(batch, dim, generator=gen),
                    weights=[torch.randn(rows, dim, generator=gen)], momentum1=[torch.rand(rows, generator=gen)],
                    config=as_tensor(build(OwnerUpdateConfig, optimizer=Optimizer.ROWWISE_ADAGRAD,
                                           weight_decay_mode=WeightDecay.NONE, mean=0, weighted=0, batch=batch)))
    want = _on(torch.device("cpu"), dict(args, keys=keys, bags=bags))
    _run(want)
    pad = 5000
    for used in (None, torch.tensor([n])):
        got = _on(torch.device("cuda"), dict(args, keys=torch.cat([keys, torch.full((pad,), rows)]),
                                             bags=torch.cat([bags, torch.full((pad,), -1, dtype=torch.int32)]),
                                             used=used))
        _run(got)
        # the same terms; the GPU's chunks (and so its sums' pieces) and its square sum's order differ
        for name in ("weights", "momentum1"):
            torch.testing.assert_close(got[name][0].cpu(), want[name][0], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}, used {used}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_split_walk_is_bit_identical_eager_and_replayed() -> None:
    """The GPU's chunks follow the used positions and the device, not the launch: an eager update at the ids'
    count and the same update captured at a capacity four times larger (the count in the device word ``used``)
    and replayed write the same bits, as do two eager runs; a run of 10^5 ids crosses hundreds of chunks."""
    dev, rows, dim, batch = torch.device("cuda"), 4000, 64, 128
    gen = torch.Generator().manual_seed(9)
    n = 300_000
    keys = torch.cat([torch.randint(0, rows, (n - LONG_RUN,), generator=gen), torch.full((LONG_RUN,), 11)])
    keys = keys.sort(stable=True).values
    base = _op_args(offsets=torch.arange(batch + 1) * (n // batch), grad=torch.randn(batch, dim, generator=gen),
                    weights=[torch.randn(rows, dim, generator=gen)], momentum1=[torch.randn(rows, dim, generator=gen)],
                    momentum2=[torch.rand(rows, dim, generator=gen)],
                    config=as_tensor(build(OwnerUpdateConfig, optimizer=Optimizer.ADAM,
                                           weight_decay_mode=WeightDecay.NONE, mean=0, weighted=0, batch=batch)),
                    keys=keys, bags=torch.randint(0, batch, (n,), generator=gen, dtype=torch.int32))
    eager = [_on(dev, base) for _ in range(2)]
    for args in eager:
        _run(args)
    pad = 3 * n
    captured = _on(dev, dict(base, keys=torch.cat([keys, torch.full((pad,), rows)]),
                             bags=torch.cat([base["bags"], torch.full((pad,), -1, dtype=torch.int32)]),
                             used=torch.tensor([n])))
    start = [t.clone() for name in ("weights", "momentum1", "momentum2") for t in captured[name]]
    _run(captured)  # the first update uploads the descriptors: never under capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _run(captured)
    torch.cuda.current_stream().wait_stream(stream)
    for t, s in zip((t for name in ("weights", "momentum1", "momentum2") for t in captured[name]), start):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    for name in ("weights", "momentum1", "momentum2"):
        assert torch.equal(eager[0][name][0], eager[1][name][0]), name
        assert torch.equal(captured[name][0], eager[0][name][0]), name


def _kept_buffer(device: torch.device, lengths: List[int], first_id: List[int]) -> dict:
    """Six kept bags over a 50-id buffer (id e at element e, weight e / 2 at element e + 5); the TBE holds bags
    2-5, two features of two bags (key bases 100 and 200, keys below 240)."""
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return dict(ids=torch.arange(50, dtype=torch.int32, device=device),
                weights=torch.arange(60, dtype=torch.float32, device=device) / 2,
                first_id=torch.tensor(first_id, device=device), first_weight=torch.tensor(first_id, device=device) + 5,
                offsets=offsets.to(device), feature_base=torch.tensor([100, 200], device=device),
                config=as_tensor(build(OwnerKeysConfig, first_bag=2, end_bag=6, stride=2, key_limit=240)))


@pytest.mark.parametrize("device", DEVICES)
def test_owner_keys_lays_out_a_tbes_ids_and_leaves_the_rest_of_the_capacity(device: str) -> None:
    """Bag 2 (feature 0): ids 10-12, keys 110-112, bag 0; bag 3 empty; bag 4 (feature 1): ids 30-31, keys
    230-231, bag 2; bag 5: id 49 (key 249, past the tables) and element 50 (past the buffer) become padding.
    The capacity's last two positions, past the 7 ids, are not written (their prior contents stay, as the
    caching allocator hands the same block back). Unweighted: no weights at all."""
    dev = torch.device(device)
    args = _kept_buffer(dev, [1, 2, 3, 0, 2, 2], [0, 5, 10, 20, 30, 49])
    keys, bags, psw = torch.ops.torchrec_pgas.owner_keys(**args, capacity=9)
    assert keys[:7].tolist() == [110, 111, 112, 230, 231, 240, 240] and keys.dtype == torch.int64
    assert bags[:7].tolist() == [0, 0, 0, 2, 2, -1, -1] and psw[:7].tolist() == [7.5, 8.0, 8.5, 17.5, 18.0, 0.0, 0.0]
    if dev.type == "cuda":  # the same block again, marked: the positions past the ids keep the marks
        marks = [t.data_ptr() for t in (keys, bags, psw)]
        for t in (keys, bags, psw):
            t.fill_(-9)
        del keys, bags, psw
        keys, bags, psw = torch.ops.torchrec_pgas.owner_keys(**args, capacity=9)
        if [t.data_ptr() for t in (keys, bags, psw)] == marks:
            assert keys[7:].tolist() == [-9, -9] and bags[7:].tolist() == [-9, -9] and psw[7:].tolist() == [-9.0] * 2
    _, _, unweighted = torch.ops.torchrec_pgas.owner_keys(**dict(args, weights=None, first_weight=None), capacity=9)
    assert unweighted.numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_owner_keys_writes_only_inside_its_capacity_and_reads_only_inside_the_buffer(device: str) -> None:
    """Corrupt headers (a negative length, counts past the capacity, ids far outside the buffer): every
    position written is one of the capacity's, every read inside the buffer (memcheck on the GPU), and what
    cannot be read is padding."""
    dev = torch.device(device)
    args = _kept_buffer(dev, [1, 2, 3, -7, 10 ** 6, 2], [0, 5, -1000, 2 ** 40, 45, 10 ** 9])
    keys, bags, _ = torch.ops.torchrec_pgas.owner_keys(**args, capacity=16)
    assert keys.numel() == 16 and bool(((keys == 240) == (bags == -1)).all())
    assert bool(((keys >= 100) & (keys <= 240)).all())
    with pytest.raises(RuntimeError, match="first_id has 4 elements, at least 6 needed"):
        torch.ops.torchrec_pgas.owner_keys(**dict(args, first_id=args["first_id"][:4]), capacity=16)
    with pytest.raises(RuntimeError, match="bags \\[2, 5\\) are not whole features of 2 bags"):
        torch.ops.torchrec_pgas.owner_keys(**dict(args, config=as_tensor(build(
            OwnerKeysConfig, first_bag=2, end_bag=5, stride=2, key_limit=240))), capacity=16)


@pytest.mark.gpu
@pytest.mark.parametrize("ids_dtype,weighted,key_dtype", [(torch.int32, True, torch.int64),
                                                          (torch.int64, False, torch.int32)])
@pytest.mark.parametrize("shape", ["short", "long", "corrupt"])
def test_owner_keys_on_the_gpu_writes_what_the_cpu_path_writes(ids_dtype: torch.dtype, weighted: bool,
                                                                key_dtype: torch.dtype, shape: str) -> None:
    """The GPU's warps take 32 bags a group and write their concatenated positions in rounds (several warps a
    group where bags are long); the CPU writes bag by bag: the same positions. ``short``: 5,000 bags of 0-70 ids
    over 4 features (runs of empty bags, bags longer than a warp, ids past the tables, starts whose ids run past
    the buffer), a capacity that cuts the last bags. ``long``: the second half (first_bag 600) of 1,200 bags of
    200-900 ids, a capacity past the ids (their positions compared; that the rest stay unwritten is
    test_owner_keys_lays_out_a_tbes_ids_and_leaves_the_rest_of_the_capacity's). ``corrupt``: offsets that decrease
    (kept bags' never do: theirs are sums of lengths clamped to >= 0): only the positions no two bags share are
    compared."""
    gen = torch.Generator().manual_seed({"short": 7, "long": 8, "corrupt": 9}[shape])
    bags, first_bag = (1200, 600) if shape == "long" else (5000, 0)
    lengths = (torch.randint(200, 901, (bags,), generator=gen) if shape == "long"
               else torch.randint(0, 71, (bags,), generator=gen) * (torch.rand(bags, generator=gen) > 0.2))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    if shape == "corrupt":
        offsets[1::97] -= 40
    n = int(lengths.sum())
    first_id = torch.randint(0, n, (bags,), generator=gen)
    ids = torch.randint(-5, 4000, (n,), generator=gen).to(ids_dtype)
    held = bags - first_bag
    args = dict(ids=ids, weights=torch.rand(n + 9, generator=gen) if weighted else None, first_id=first_id,
                first_weight=first_id + 9 if weighted else None, offsets=offsets,
                feature_base=torch.tensor([0, 1000, 2000, 3000], dtype=key_dtype)[:2 if shape == "long" else 4],
                config=as_tensor(build(OwnerKeysConfig, first_bag=first_bag, end_bag=bags,
                                       stride=held // (2 if shape == "long" else 4), key_limit=3900)))
    count = int(offsets[-1] - offsets[first_bag])
    capacity = count + 100 if shape == "long" else count - 500
    cpu = torch.ops.torchrec_pgas.owner_keys(**args, capacity=capacity)
    gpu = torch.ops.torchrec_pgas.owner_keys(**{k: v.cuda() if isinstance(v, torch.Tensor) and k != "config" else v
                                                 for k, v in args.items()}, capacity=capacity)
    covered = torch.zeros(capacity, dtype=torch.int64)
    rel = (offsets - offsets[first_bag]).clamp(0, capacity)
    for lo, hi in zip(rel[first_bag:-1].tolist(), rel[first_bag + 1:].tolist()):
        covered[lo:max(lo, hi)] += 1
    once = covered == 1
    assert bool(once[:min(count, capacity)].all()) == (shape != "corrupt") and not bool(covered[count:].any())
    for want, got in zip(cpu, gpu):
        if want.numel():
            assert torch.equal(want[once], got.cpu()[once])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n,key_limit", [(5000, 777), (70_000, 2 ** 17 + 3), (70_000, 2 ** 24 + 5),
                                         (70_000, 2 ** 26 + 7)])
def test_sort_owner_keys_is_a_stable_sort_of_the_clamped_keys(device: str, key_dtype: torch.dtype, weighted: bool,
                                                              n: int, key_limit: int) -> None:
    """Keys outside [0, key_limit] become key_limit; equal keys keep their order (a hot key of 500 ids among
    them), each with its bag and weight: as torch.sort(stable=True) of the clamped keys. Key limits of 10, 18, 25
    and 27 bits over one tile and over many (the GPU's radix passes, whole digits and a partial last one)."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randint(-50, key_limit + 50, (n,), generator=gen).to(key_dtype)
    keys[torch.randperm(n, generator=gen)[:500]] = 3
    bags = torch.arange(n, dtype=torch.int32)
    psw = torch.rand(n, generator=gen) if weighted else torch.empty(0)
    got = torch.ops.torchrec_pgas.sort_owner_keys(keys.to(device), bags.to(device), psw.to(device), key_limit)
    clamped = torch.where((keys < 0) | (keys > key_limit), key_limit, keys)
    order = torch.sort(clamped, stable=True).indices
    assert torch.equal(got[0].cpu(), clamped[order]) and got[0].dtype == key_dtype
    assert torch.equal(got[1].cpu(), bags[order])
    assert torch.equal(got[2].cpu(), psw[order] if weighted else psw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [0, 1, 2047, 4608, 4609, 5760, 5761, 11520, 30000, 40000, 10 ** 9, -5])
def test_sort_owner_keys_sorts_the_positions_its_count_word_says_only(device: str, count: int) -> None:
    """With a count (a device word, clamped to [0, keys]): the first count positions are the stable sort of the
    first count keys, although the positions past it hold smaller keys (a sort that covered the capacity
    would move them in front), weighted and not; a hot key of a third of the ids included. Counts inside one
    of the GPU sort's tiles and at their ends (CUB's onesweep tiles: 5,760 keys here, 4,608 weighted), and
    over several tiles (those past the count take no tile)."""
    gen, n, key_limit = torch.Generator().manual_seed(4), 40000, (1 << 20) + 3
    keys = torch.randint(1000, key_limit + 9, (n,), generator=gen)
    keys[torch.randperm(n, generator=gen)[: n // 3]] = 77777
    kept = min(max(count, 0), n)
    keys[kept:] = torch.randint(0, 1000, (n - kept,), generator=gen)
    bags = torch.arange(n, dtype=torch.int32)
    psw = torch.rand(n, generator=gen)
    word = torch.tensor([count], device=device)
    for weights in (psw, torch.empty(0)):
        got = torch.ops.torchrec_pgas.sort_owner_keys(keys.to(device), bags.to(device), weights.to(device),
                                                      key_limit, word)
        head = torch.where(keys[:kept] > key_limit, key_limit, keys[:kept])
        order = torch.sort(head, stable=True).indices
        assert torch.equal(got[0][:kept].cpu(), head[order]) and got[0].numel() == n
        assert torch.equal(got[1][:kept].cpu(), bags[order])
        assert torch.equal(got[2][:kept].cpu(), weights[order] if weights.numel() else weights)


@pytest.mark.parametrize("device", DEVICES)
def test_a_counted_update_sorts_and_walks_to_its_count_word_alike(device: str, monkeypatch: Any) -> None:
    """``op_update(counted=True)`` (the owner op benchmark's ``--counted``: a captured step's sort and walk)
    lays the ids out at twice their positions and sorts them up to a device word holding their count, and its
    update is the uncounted one's bit for bit (both sorts are stable; the chunks follow the count)."""
    dev, batch, feature_tables = torch.device(device), 6, LAYOUTS["dim64"]
    tables = TABLES[:max(feature_tables) + 1]
    plain, counted = (FlatTables(tables, feature_tables, EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.float32,
                                 PoolingMode.SUM, WeightDecayMode.NONE, dev) for _ in range(2))
    sort, calls = torch.ops.torchrec_pgas.sort_owner_keys, []

    def recording(keys: torch.Tensor, bags: torch.Tensor, psw: torch.Tensor, key_limit: int,
                  count: Optional[torch.Tensor] = None) -> Any:
        calls.append((keys.numel(), None if count is None else int(count.item())))
        return sort(keys, bags, psw, key_limit, count)

    monkeypatch.setattr(torch.ops.torchrec_pgas, "sort_owner_keys", recording)
    dim_sum = sum(tables[t][1] for t in feature_tables)
    for step in range(2):
        kjt = _kjt(tables, feature_tables, batch, True, seed=step, device=dev)
        grad = (torch.randn(batch, dim_sum, generator=torch.Generator().manual_seed(step)) * 0.1).to(dev)
        assert op_update(plain, kjt, grad, 0, step + 1) and op_update(counted, kjt, grad, 0, step + 1, counted=True)
        ids = kjt.values().numel()
        assert calls[-2:] == [(ids, None), (2 * ids, ids)]
        for got, want in zip(counted.state(), plain.state()):
            assert torch.equal(got, want), f"step {step}"


# Two sources' index blocks of 4096 bytes (3 features of up to 8 samples) after a 1024-byte slot gap:
# lengths at 64, starts at 256, ids at 512, weights at 2048 within a block.
BAGS_LAYOUT = dict(index_block_bytes=4096, lengths_off=64, offsets_off=256, ids_off=512, max_batch=8,
                   features_per_block=3, world=2)


def _bags_buffer(gen: torch.Generator) -> torch.Tensor:
    """A buffer whose blocks hold random lengths (some negative: corrupt) and starts."""
    lay = SimpleNamespace(**BAGS_LAYOUT)
    buf = torch.zeros(1024 + lay.world * lay.index_block_bytes, dtype=torch.uint8)
    bags = lay.features_per_block * lay.max_batch
    for src in range(lay.world):
        block = 1024 + src * lay.index_block_bytes
        lengths = buf[block + lay.lengths_off:block + lay.lengths_off + 4 * bags].view(torch.int32)
        lengths.copy_(torch.randint(-2, 9, (bags,), generator=gen))
        starts = buf[block + lay.offsets_off:block + lay.offsets_off + 8 * (bags + 1)].view(torch.int64)
        starts.copy_(torch.randint(0, 300, (bags + 1,), generator=gen))
    return buf


def _kept_bags_by_the_rule(buf: torch.Tensor, slot_base: int, batches: List[int], whole: Optional[bool],
                           config: dict) -> Tuple[List[int], List[int], List[int]]:
    """The reading rule of csrc/owner_keys.h, one bag at a time: the expected lengths and starts."""
    c = SimpleNamespace(**config)

    def word(at: int, dtype: torch.dtype) -> int:  # 0 unless inside the buffer, aligned
        size = dtype.itemsize
        return int(buf[at:at + size].view(dtype)[0]) if 0 <= at <= buf.numel() - size and at % size == 0 else 0

    lengths, first_id, first_weight = [], [], []
    for f in range(c.first_feature, c.first_feature + c.num_features):
        for src, header in enumerate(batches):
            block, batch = slot_base + src * c.index_block_bytes, min(max(header, 0), c.max_batch)
            for b in range(c.rows):
                valid = b < batch and whole is not False
                bag = f * batch + b if valid else 0
                lengths.append(max(word(block + c.lengths_off + 4 * bag, torch.int32), 0) if valid else 0)
                start = word(block + c.offsets_off + 8 * bag, torch.int64)
                first_id.append(start + (block + c.ids_off) // c.id_bytes)
                first_weight.append(start + (block + c.weights_off) // 4)
    return lengths, first_id, first_weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted,id_bytes", [(False, 4), (True, 4), (True, 8)])
@pytest.mark.parametrize("batches,whole,slot_base", [
    ([8, 5], True, 1024),  # a full source, a short one
    ([8, 5], None, 1024),  # no step-wide word: the same
    ([11, -3], True, 1024),  # headers past max_batch or negative: clamped
    ([8, 8], False, 1024),  # a failed step: no bag keeps ids
    ([8, 8], True, 1024 + 8192 - 200),  # a slot whose blocks run past the buffer: those reads give 0
    ([8, 8], True, 1028),  # a slot off 8 bytes: its starts are unaligned, read as 0; the lengths are not
])
def test_kept_bags_reads_each_bags_length_and_starts_from_its_sources_block(
        device: str, weighted: bool, id_bytes: int, batches: List[int], whole: Optional[bool],
        slot_base: int) -> None:
    """Features 1-2 of the three, 6 rows a source: each bag's id count and where its ids (weights) start,
    as the reading rule says, whatever the headers hold."""
    buf = _bags_buffer(torch.Generator().manual_seed(sum(batches)))
    config = dict(BAGS_LAYOUT, weights_off=2048 if weighted else -1, id_bytes=id_bytes, first_feature=1,
                  num_features=2, rows=6)
    dev = torch.device(device)
    lengths, first_id, first_weight = torch.ops.torchrec_pgas.kept_bags(
        buf.to(dev), torch.tensor([slot_base], device=dev), torch.tensor(batches, device=dev),
        None if whole is None else torch.tensor([whole], device=dev), as_tensor(build(KeptBagsConfig, **config)),
        2 * 2 * 6, weighted)
    want = _kept_bags_by_the_rule(buf, slot_base, batches, whole, config)
    assert lengths.tolist() == want[0] and first_id.tolist() == want[1]
    assert first_weight.tolist() == (want[2] if weighted else [])
    assert lengths.device == first_id.device == buf.to(dev).device  # outputs on the buffer's device


@pytest.mark.parametrize("change,message", [
    (dict(world=0), "world 0"),
    (dict(rows=9), "rows 9 of max_batch 8"),
    (dict(first_feature=2, num_features=2), r"features \[2, \+2\) outside a block's 3"),
    (dict(id_bytes=2), "id_bytes 2 is not 4 or 8"),
    (dict(lengths_off=-8), "negative or its extent past 2\\^40"),
    (dict(num_features=2 ** 32 + 1, world=2 ** 32 - 1, rows=1), "negative or its extent past 2\\^40"),
])
def test_kept_bags_refuses_a_config_that_names_no_block(change: dict, message: str) -> None:
    fields = dict(BAGS_LAYOUT, weights_off=-1, id_bytes=4, first_feature=0, num_features=3, rows=8)
    fields.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.torchrec_pgas.kept_bags(torch.zeros(9216, dtype=torch.uint8), torch.tensor([1024]),
                                          torch.tensor([8] * min(max(fields["world"], 1), 2)), None,
                                          as_tensor(build(KeptBagsConfig, **fields)), 0, False)


def test_kept_bags_refuses_a_buffer_off_its_words_and_sizes_not_its_configs() -> None:
    config = as_tensor(build(KeptBagsConfig, **BAGS_LAYOUT, weights_off=-1, id_bytes=4, first_feature=0,
                             num_features=3, rows=8))
    with pytest.raises(RuntimeError, match="starting on 8 bytes"):
        torch.ops.torchrec_pgas.kept_bags(torch.zeros(9217, dtype=torch.uint8)[1:], torch.tensor([1024]),
                                          torch.tensor([8, 8]), None, config, 48, False)
    with pytest.raises(RuntimeError, match="num_bags 47, weighted 0 are not the config's 48 bags, weighted 0"):
        torch.ops.torchrec_pgas.kept_bags(torch.zeros(9216, dtype=torch.uint8), torch.tensor([1024]),
                                          torch.tensor([8, 8]), None, config, 47, False)
    with pytest.raises(RuntimeError, match="weighted 1 are not the config's 48 bags, weighted 0"):
        torch.ops.torchrec_pgas.kept_bags(torch.zeros(9216, dtype=torch.uint8), torch.tensor([1024]),
                                          torch.tensor([8, 8]), None, config, 48, True)


@pytest.mark.parametrize("change,message", [
    (dict(weights=[torch.zeros(10, OP_MAX_DIM + 4)]), "table 0 has dim 516"),
    (dict(weights=[torch.zeros(10, 8)[:, :4]]), r"weights\[0\] must be a contiguous"),
    (dict(weights=[torch.zeros(10, 4, dtype=torch.float64)]), "weights are Double, not fp32 or fp16"),
    (dict(features=as_words([build(OwnerFeatureDesc, table=0, grad_col=2)], OwnerFeatureDesc)),
     r"feature 0's columns \[2, \+4\) exceed the gradient's 4"),
    (dict(features=as_words([build(OwnerFeatureDesc, table=1, grad_col=0)], OwnerFeatureDesc)),
     "feature 0 names table 1 of 1"),
    (dict(offsets=torch.tensor([0, 4])), "offsets has 2 elements, expected 3"),
    (dict(apply=torch.tensor([1, 1])), "apply must be one int64 word"),
    (dict(used=torch.tensor([4.0])), "used must be one int64 word"),
    (dict(bags=torch.tensor([0, 0, 1, 1])), "bags must be a contiguous 1-D Int tensor"),
    (dict(keys=torch.tensor([1, 1, 3, 9], dtype=torch.int16)), "keys must be a contiguous 1-D Long tensor"),
    (dict(config=torch.zeros(8, dtype=torch.uint8)), "the 40 bytes of an OwnerUpdateConfig"),
    (dict(config=as_tensor(build(OwnerUpdateConfig, optimizer=Optimizer.ROWWISE_ADAGRAD, weight_decay_mode=0,
                                 mean=0, weighted=0, batch=2))), "momentum1 has 0 tensors; table 0 needs one"),
    (dict(config=as_tensor(build(OwnerUpdateConfig, optimizer=Optimizer.ADAM, weight_decay_mode=0, mean=0,
                                 weighted=0, batch=2)), momentum1=[torch.zeros(10, 4)], momentum2=[torch.zeros(10)]),
     r"momentum2\[0\] must be a contiguous fp32 tensor of 40 elements"),
    (dict(config=as_tensor(build(OwnerUpdateConfig, optimizer=0, weight_decay_mode=0, mean=0, weighted=1,
                                 batch=2))), "needs contiguous fp32 per-sample weights"),
])
def test_op_refuses_inputs_that_would_address_outside_the_tables(change: dict, message: str) -> None:
    args = _op_args(**change)
    weights = args["weights"][0]
    with pytest.raises(RuntimeError, match=message):
        _run(args)
    assert not weights.any()  # nothing written


def _opcheck_cases(dev: torch.device) -> dict:
    """Each op of the owner backward on small valid inputs (those above), by name."""
    kept = _kept_buffer(dev, [1, 2, 3, 0, 2, 2], [0, 5, 10, 20, 30, 49])
    update = _on(dev, _op_args(weights=[torch.zeros(10, 4)], momentum1=[], momentum2=[]))
    bags_config = dict(BAGS_LAYOUT, weights_off=2048, id_bytes=4, first_feature=1, num_features=2, rows=6)
    keys = torch.tensor([5, 3, 9, 3, 1], device=dev)
    return {
        "kept_bags": ((_bags_buffer(torch.Generator().manual_seed(1)).to(dev), torch.tensor([1024], device=dev),
                       torch.tensor([8, 5], device=dev), torch.tensor([True], device=dev),
                       as_tensor(build(KeptBagsConfig, **bags_config)), 2 * 2 * 6, True), {}),
        "owner_keys": ((), dict(kept, capacity=7)),  # the kept ids exactly: every output position written
        "sort_owner_keys": ((keys, torch.arange(5, dtype=torch.int32, device=dev), torch.rand(5, device=dev), 7,
                             torch.tensor([5], device=dev)), {}),
        "owner_update": ((), update),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["kept_bags", "owner_keys", "sort_owner_keys", "owner_update"])
def test_the_owner_backwards_ops_pass_opcheck(device: str, name: str) -> None:
    """The dispatcher's view of each op (its schema's mutations and aliasing, its Meta impl, its use under
    torch.compile's fake tensors) matches what the kernel does: torch.library.opcheck. The ops that wait on
    peers (index_dist ... await_grads) cannot run alone, so they are not checked."""
    args, kwargs = _opcheck_cases(torch.device(device))[name]
    torch.library.opcheck(getattr(torch.ops.torchrec_pgas, name).default, args, kwargs)
