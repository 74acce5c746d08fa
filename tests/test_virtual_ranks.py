"""The fused kernels of W ranks on one GPU (``torchrec_pgas.virtual_ranks``) against a float64 reference.

World sizes a machine lacks (3, 4; 2 on a one-GPU machine) run here, each rank's path as it runs on W GPUs:
the row-wise index dist's owner paths (two owners, and the general one), a lookup serving W sources, a
combine summing W partials, table-wise owners with their own batches. Five steps per case, so every buffer
slot is used twice (the second use waits for the owners' release of the first) and the device epochs advance.
"""

import random
from typing import List, Optional, Tuple

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from torchrec_pgas.step_abi import ErrorCode

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu]

# Unit roundoff of the 16-bit output dtypes: row-wise partials are stored in the output dtype, so each owner's
# partial is rounded before the requester sums them (as stock RW's reduce-scatter does).
_UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
_MAX_LEN = 40  # ids per bag


def _inputs(rnd: random.Random, hash_sizes: List[int], batch: int, weighted: bool,
            dev: torch.device) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """One rank's step: bags of 0..40 ids (empty ones included; long ones fill a group's row stages more than
    once), uniform or all in one corner of the table."""
    lengths, values = [], []
    for n in hash_sizes:
        hot = rnd.random() < 0.3  # every id in the first or last few rows: one owner gets them all
        for _ in range(batch):
            k = rnd.choice([0, rnd.randint(1, 12), rnd.randint(1, 12), rnd.randint(13, _MAX_LEN)])
            lengths.append(k)
            lo, hi = (0, min(n, 3)) if hot and rnd.random() < 0.5 else (max(0, n - 3), n) if hot else (0, n)
            values += [rnd.randrange(lo, hi) for _ in range(k)]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    weights = torch.tensor([rnd.uniform(0.5, 1.5) for _ in values]) if weighted else None
    ids = torch.tensor(values, dtype=rnd.choice([torch.int64, torch.int32]))
    return ids.to(dev), offsets.to(dev), weights.to(dev) if weighted else None, batch


def _check_pooled(out: torch.Tensor, tables: List[torch.Tensor], inp: Tuple, is_mean: List[bool],
                  table_wise: bool, where: str) -> None:
    """fp32: within 1e-5 of the float64 reference. 16-bit outputs: within two roundings of every partial and
    of the result, 2u (sum |w x| + |ref|), where sum |w x| (the pool of |rows|, weights > 0) bounds each
    partial's magnitude; a missing or extra row is far outside that."""
    from torchrec_pgas.virtual_ranks import reference_pool

    ref = reference_pool(tables, inp, is_mean, table_wise)
    assert out.shape == ref.shape, (where, out.shape, ref.shape)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{where}: {m}")
        return
    bound = reference_pool([t.abs() for t in tables], inp, is_mean, table_wise)
    allowed = 2 * _UNIT[out.dtype] * (bound + ref.abs()) + 1e-6
    excess = (out.double() - ref).abs() / allowed
    assert float(excess.max()) <= 1.0, f"{where}: {int((excess > 1).sum())} elements off by up to {float(excess.max()):.2f}x the bound"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("table_wise", [False, True], ids=["rw", "tw"])
def test_virtual_ranks_match_reference(world: int, table_wise: bool) -> None:
    from torchrec_pgas.virtual_ranks import VirtualRanks

    dev = torch.device("cuda", 0)
    for seed in range(12):
        rnd = random.Random(1000 * world + 10 * seed + table_wise)
        num = rnd.randint(1, 5)
        # Tables smaller than W (empty row blocks), W*W, W+1, and a few thousand rows.
        hash_sizes = [rnd.choice([max(1, world - 1), world * world, world + 1, rnd.randint(10, 5000)])
                      for _ in range(num)]
        w_dtype = rnd.choice([torch.float32, torch.float16])
        out_dtype = rnd.choice([torch.float32, torch.float16, torch.bfloat16])
        tables = [torch.randn(n, 4 * rnd.randint(1, 48), device=dev).mul_(0.1).to(w_dtype) for n in hash_sizes]
        is_mean = [rnd.random() < 0.4 for _ in tables]
        weighted = rnd.random() < 0.4
        owners = sorted(rnd.randrange(world) for _ in tables) if table_wise else None
        vr = VirtualRanks(tables, world, max_batch=40, ids_capacity=40 * _MAX_LEN * num, owners=owners,
                          is_mean=is_mean, weighted=weighted, out_dtype=out_dtype)
        same_batch = rnd.randint(1, 40)
        for step in range(5):
            inputs = [_inputs(rnd, hash_sizes, rnd.randint(1, 40) if table_wise else same_batch, weighted, dev)
                      for _ in range(world)]
            outs = vr.step(inputs)
            vr.check()
            for r, (out, inp) in enumerate(zip(outs, inputs)):
                assert out.dtype == out_dtype, (seed, step, r, out.dtype)
                _check_pooled(out, tables, inp, is_mean, table_wise, f"seed {seed} step {step} rank {r}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", [BoundsCheckMode.FATAL, BoundsCheckMode.WARNING], ids=["fatal", "warning"])
def test_virtual_ranks_bad_id(world: int, mode: BoundsCheckMode) -> None:
    """An id past its table on rank 1: recorded there with the feature and the id; FATAL drops it (no rank
    receives it), WARNING reads row 0. Every other bag of every rank is exact."""
    from torchrec_pgas.virtual_ranks import VirtualRanks, reference_pool

    dev = torch.device("cuda", 0)
    rnd = random.Random(world)
    hash_sizes = [1000, 37]
    tables = [torch.randn(n, 16, device=dev) for n in hash_sizes]
    vr = VirtualRanks(tables, world, max_batch=8, ids_capacity=8 * _MAX_LEN * 2 + 1, bounds_mode=mode)
    inputs = [_inputs(rnd, hash_sizes, 8, False, dev) for _ in range(world)]
    values, offsets, _, batch = inputs[1]
    bag = batch + 3  # feature 1 (37 rows), bag 3: give it one more id, 37
    values = torch.cat([values[:offsets[bag + 1]], torch.tensor([37], dtype=values.dtype, device=dev),
                        values[offsets[bag + 1]:]])
    offsets = offsets + (torch.arange(offsets.numel(), device=dev) > bag)
    inputs[1] = (values, offsets, None, batch)
    outs = vr.step(inputs)
    errors = vr.errors()
    assert errors[1][:3] == (ErrorCode.BAD_ID if mode == BoundsCheckMode.FATAL else ErrorCode.BAD_ID_WARN, 1, 37), errors
    assert all(e[0] == 0 for r, e in enumerate(errors) if r != 1), errors
    row0 = values.clone()
    row0[offsets[bag + 1] - 1] = 0
    for r, (out, inp) in enumerate(zip(outs, inputs)):
        ref = reference_pool(tables, (row0, offsets, None, batch) if r == 1 else inp, [False, False], False)
        if r == 1 and mode == BoundsCheckMode.FATAL:  # the dropped id's bag lacks only that id's row
            ref[3, 16:] -= tables[1][0].double()
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The next step is clean on every rank: nothing of the bad step is left in a buffer or counter.
    inputs = [_inputs(rnd, hash_sizes, 8, False, dev) for _ in range(world)]
    for out, inp in zip(vr.step(inputs), inputs):
        torch.testing.assert_close(out.double(), reference_pool(tables, inp, [False, False], False),
                                   atol=1e-5, rtol=1e-5)
    vr.check()


@pytest.mark.parametrize("world", [2, 3])
def test_virtual_ranks_a_failed_step_gives_its_gradients_up(world: int) -> None:
    """A FATAL bad id on rank 1 in a training step: rank 1's grad dist stores nothing and signals that it gave
    up, its await_grads waits for no one (flags 3, and 1 for its own step); every other rank sees rank 1 give
    up (1) and the others arrive (0). The next training step exchanges normally on every rank."""
    from torchrec_pgas.virtual_ranks import VirtualRanks

    dev = torch.device("cuda", 0)
    rnd = random.Random(world)
    hash_sizes = [1000, 37]
    vr = VirtualRanks([torch.randn(n, 8, device=dev) for n in hash_sizes], world, max_batch=8,
                      ids_capacity=8 * _MAX_LEN * 2 + 1)
    inputs = [_inputs(rnd, hash_sizes, 8, False, dev) for _ in range(world)]
    values, offsets, _, batch = inputs[1]
    inputs[1] = (torch.cat([values, torch.tensor([37], dtype=values.dtype, device=dev)]),
                 torch.cat([offsets[:-1], offsets[-1:] + 1]), None, batch)  # the last bag gets id 37 of 37 rows
    vr.step(inputs, trains=True)
    assert vr.errors()[1][:3] == (ErrorCode.BAD_ID, 1, 37)
    for d in range(world):
        vr.gradient_rows(d, 1, 8).fill_(123.0)  # sentinel: rank 1 stores nothing
    flags = vr.exchange_gradients([torch.randn(8, 16, device=dev) for _ in range(world)], float(world))
    assert flags[1] == [3] * world + [1], flags
    for r in (r for r in range(world) if r != 1):
        assert flags[r] == [1 if s == 1 else 0 for s in range(world)] + [0], flags
    assert all(bool((vr.gradient_rows(d, 1, 8) == 123.0).all()) for d in range(world))
    vr.release()
    vr.step([_inputs(rnd, hash_sizes, 8, False, dev) for _ in range(world)], trains=True)
    assert vr.exchange_gradients([torch.randn(8, 16, device=dev) for _ in range(world)], float(world)) == \
        [[0] * (world + 1)] * world
    vr.release()


def test_stage_ops_refuse_a_config_that_does_not_match() -> None:
    """An op checks its StepConfig against the tensors before any launch, and says why (a raised error, not a
    crash), e.g. a pad too small for the world size the config names."""
    from torchrec_pgas.virtual_ranks import VirtualRanks

    dev = torch.device("cuda", 0)
    vr = VirtualRanks([torch.randn(10, 8, device=dev)], 2, max_batch=4, ids_capacity=16)
    ((values, offsets, weights, batch),) = [_inputs(random.Random(0), [10], 4, False, dev)]
    state = list(vr.stage_args(0))
    state[1] = state[1][:3]  # the signal pad, cut below 32 header words + 4 W slots
    with pytest.raises(RuntimeError, match="signal pad of 3 words for 2 ranks"):
        torch.ops.torchrec_pgas.index_dist(values, offsets, weights, *state, batch, False, False)
    state = list(vr.stage_args(0))
    state[-1] = state[-1][:-8]  # a config of another size
    with pytest.raises(RuntimeError, match="config must be the"):
        torch.ops.torchrec_pgas.pooled_lookup(*state, batch, 8, torch.float32, True, True)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("table_wise", [False, True], ids=["rw", "tw"])
def test_virtual_ranks_gradients_reach_exactly_the_owners_that_served_each_bag(world: int, table_wise: bool) -> None:
    """grad_dist at W ranks: owner d's gradient block from source s holds, for every bag of s that d held
    ids of, s's gradient row of the bag (MEAN features divided by the bag's divisor, then all by W), and
    nothing else: a bag d held no ids of leaves the block's sentinel. Five training steps: the fourth and fifth
    reuse released slots."""
    from torchrec_pgas.virtual_ranks import VirtualRanks

    dev = torch.device("cuda", 0)
    rnd = random.Random(7 * world + table_wise)
    hash_sizes = [max(1, world - 1), 37, 1000]
    tables = [torch.randn(n, 8, device=dev) for n in hash_sizes]
    is_mean = [False, True, False]
    owners = sorted(rnd.randrange(world) for _ in tables) if table_wise else None
    vr = VirtualRanks(tables, world, max_batch=8, ids_capacity=8 * _MAX_LEN * 3, owners=owners, is_mean=is_mean)
    for step in range(5):
        inputs = [_inputs(rnd, hash_sizes, 8, False, dev) for _ in range(world)]
        vr.step(inputs, trains=True)
        vr.check()
        for d in range(world):
            for s in range(world):
                vr.gradient_rows(d, s, 8).fill_(123.0)  # sentinel: rows no bag of s sends to d
        grads = [torch.randn(8, 24, device=dev) for _ in range(world)]
        flags = vr.exchange_gradients(grads, float(world))
        assert flags == [[0] * (world + 1)] * world, flags
        for s, (values, offsets, _, batch) in enumerate(inputs):
            for f, n in enumerate(hash_sizes):
                block = n if table_wise else (n + world - 1) // world
                for b in range(batch):
                    ids = values[offsets[f * batch + b]:offsets[f * batch + b + 1]].long()
                    held = ({owners[f]} if table_wise else set((ids // block).tolist())) if len(ids) else set()
                    want = grads[s][b, 8 * f:8 * f + 8]
                    if is_mean[f] and not table_wise:  # the kernel's fp32 arithmetic: (length + 1e-6f), then / W
                        want = want / (torch.tensor(float(len(ids))) + torch.tensor(1e-6)).to(dev)
                    want = want / world
                    for d in range(world):
                        got = vr.gradient_rows(d, s, batch)[b, 8 * f:8 * f + 8]
                        if d in held:
                            torch.testing.assert_close(got, want, atol=0, rtol=0)
                        else:
                            assert bool((got == 123.0).all()), (step, s, f, b, d)
        vr.release()
