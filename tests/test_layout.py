"""The symmetric-buffer layout of a PGAS step: blocks are disjoint, aligned and in bounds."""

import itertools

import pytest
import torch

from torchrec_pgas.layout import StepLayout, divisor_magic, id_bytes_for


@pytest.mark.parametrize("world,features,batch,cap,dim,weighted,id_bytes,trainable", [
    (2, 1, 1, 1, 4, False, 8, True),
    (3, 5, 7, 33, 36, True, 4, True),
    (8, 26, 4096, 1 << 20, 26 * 64, True, 4, False),
])
def test_blocks_are_disjoint_aligned_and_in_bounds(
    world: int, features: int, batch: int, cap: int, dim: int, weighted: bool, id_bytes: int, trainable: bool
) -> None:
    lay = StepLayout(world, features, batch, cap, dim, weighted, id_bytes=id_bytes, trainable=trainable)
    assert lay.num_slots == (3 if trainable else 2)
    spans = []
    for slot, peer in itertools.product(range(lay.num_slots), range(world)):
        i = lay.index_block(slot, peer)
        assert lay.offsets_off >= 32 and lay.lengths_off >= lay.offsets_off + 8 * (features * batch + 1)
        assert lay.ids_off >= lay.lengths_off + 4 * features * batch
        assert lay.weights_off >= lay.ids_off + lay.id_bytes * cap
        spans.append((i, i + lay.index_block_bytes))
        o = lay.output_block(slot, peer)
        assert lay.output_block_bytes >= 4 * batch * dim
        spans.append((o, o + lay.output_block_bytes))
        if trainable:
            g = lay.grad_block(slot, peer)
            spans.append((g, g + lay.output_block_bytes))
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert spans[0][0] == 0 and spans[-1][1] == lay.nbytes
    for start, _ in spans:
        assert start % 16 == 0
    signals = [f(p) for f in (lay.index_signal, lay.output_signal, lay.grad_signal, lay.release_signal)
               for p in range(world)]
    assert sorted(signals) == list(range(4 * world)) == list(range(lay.num_signal_slots))


def test_ids_are_int32_unless_a_shard_needs_64_bits() -> None:
    assert id_bytes_for([10, 2**31 - 1]) == 4
    assert id_bytes_for([10, 2**31]) == 8
    assert StepLayout(2, 1, 1, 8, 4, False, id_bytes=4).id_dtype == torch.int32


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 1000, 500_000, 2**20, 2**20 + 1, 2**30 + 7, 2**31 - 1])
def test_divisor_magic_is_exact_on_every_id_below_2_31(divisor: int) -> None:
    """The kernel's owner = (id * magic) >> shift must equal id // block exactly (a 32x32->64-bit product)."""
    magic, shift = divisor_magic(divisor, hash_size=2**31 - 1)
    assert 0 < magic < 2**32
    gen = torch.Generator().manual_seed(divisor)
    ids = torch.randint(0, 2**31, (200_000,), generator=gen, dtype=torch.int64).tolist()
    edges = [0, 2**31 - 1] + [q * divisor + r for q in (1, 2, (2**31 - 1) // divisor) for r in (-1, 0, 1)]
    for i in ids + [e for e in edges if 0 <= e < 2**31]:
        assert (i * magic) >> shift == i // divisor, (i, divisor)


def test_divisor_magic_falls_back_to_division_for_huge_tables() -> None:
    assert divisor_magic(2**31, hash_size=2**32) == (0, 0)
