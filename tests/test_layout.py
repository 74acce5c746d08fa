"""The symmetric-buffer layout of pgas_row_wise: blocks are disjoint, aligned and in bounds."""

import itertools

import pytest

from torchrec_pgas.layout import RwLayout


@pytest.mark.parametrize("world,features,batch,cap,dim,weighted", [
    (2, 1, 1, 1, 4, False),
    (3, 5, 7, 33, 36, True),
    (8, 26, 4096, 1 << 20, 26 * 64, True),
])
def test_blocks_are_disjoint_aligned_and_in_bounds(
    world: int, features: int, batch: int, cap: int, dim: int, weighted: bool
) -> None:
    lay = RwLayout(world, features, batch, cap, dim, weighted)
    spans = []
    for slot, peer in itertools.product(range(lay.num_slots), range(world)):
        i = lay.index_block(slot, peer)
        assert lay.offsets_off >= 32 and lay.lengths_off >= lay.offsets_off + 8 * (features * batch + 1)
        assert lay.ids_off >= lay.lengths_off + 4 * features * batch
        assert lay.weights_off >= lay.ids_off + 8 * cap
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
