"""The symmetric-buffer layout of pgas_row_wise: blocks are disjoint, aligned and in bounds."""

import itertools

import pytest
import torch

from torchrec_pgas.layout import RwLayout, id_bytes_for


@pytest.mark.parametrize("world,features,batch,cap,dim,weighted,id_bytes", [
    (2, 1, 1, 1, 4, False, 8),
    (3, 5, 7, 33, 36, True, 4),
    (8, 26, 4096, 1 << 20, 26 * 64, True, 4),
])
def test_blocks_are_disjoint_aligned_and_in_bounds(
    world: int, features: int, batch: int, cap: int, dim: int, weighted: bool, id_bytes: int
) -> None:
    lay = RwLayout(world, features, batch, cap, dim, weighted, id_bytes=id_bytes)
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
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert spans[0][0] == 0 and spans[-1][1] == lay.nbytes
    for start, _ in spans:
        assert start % 16 == 0
    assert len({lay.index_signal(p) for p in range(world)} | {lay.output_signal(p) for p in range(world)}) == 2 * world
    assert max(lay.output_signal(p) for p in range(world)) < lay.num_signal_slots


def test_ids_are_int32_unless_a_shard_needs_64_bits() -> None:
    assert id_bytes_for([10, 2**31 - 1]) == 4
    assert id_bytes_for([10, 2**31]) == 8
    assert RwLayout(2, 1, 1, 8, 4, False, id_bytes=4).id_dtype == torch.int32
