"""What an owner's sources wrote into its buffer for a step, read back for the step's backward: the ids it kept
(as stock hands them to its TBE, or at their capacity for the owner update op) and the gradient rows. Every bag
is read by the owners' reading rule (``torchrec_pgas/layout.py``, ``csrc/owner_keys.h``), whatever a header
holds."""

from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.layout import StepLayout
from torchrec_pgas.runtime import SymmetricBuffer
from torchrec_pgas.sharding.owner_backward import KeptBags, PaddedIds, op_available
from torchrec_pgas.step_abi import KeptBagsConfig, as_tensor, build


class ReceivedBlocks:
    """One sharding's reader of its buffer as an owner (``layout``: the buffer's; ``held_keys``: the features
    whose rows this rank holds, in order)."""

    def __init__(self, layout: StepLayout, buf: SymmetricBuffer, world_size: int, held_keys: Sequence[str]) -> None:
        self.layout = layout
        self.buf = buf
        self.world_size = world_size
        self.held_keys = tuple(held_keys)

    def kept_ids(self, epoch: int, rows: int, block_features: Tuple[int, int, int], batches: torch.Tensor,
                 whole: Optional[torch.Tensor] = None) -> KeyedJaggedTensor:
        """The ids this rank kept of step ``epoch`` for the features it holds, as stock hands them to its
        TBE: feature-major, then source rank, then sample (``rows`` per source, padded with empty bags).

        ``block_features``: where those features sit in an index block (first, count, features per
        block); ``batches``: each source's batch (a tensor: it may live on the device). Every bag is read
        by the owners' reading rule (``layout.py``); the one host sync is the total id count.
        """
        lay = self.layout
        bags = self._kept_bags(lay.index_block(epoch % lay.num_slots, 0), rows, block_features, batches, whole)
        total = int(bags.offsets[-1])
        k = torch.arange(total, device=bags.offsets.device)  # kept id k is element first + (k - its bag's offset)

        def gather(first: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return self.buffer_as(dtype)[torch.repeat_interleave(first - bags.offsets[:-1], bags.lengths,
                                                                 output_size=total) + k]

        ids = gather(bags.first_id, lay.id_dtype).to(torch.int64)
        weights = gather(bags.first_weight, torch.float32) if bags.first_weight is not None else None
        return KeyedJaggedTensor(keys=list(self.held_keys), values=ids, lengths=bags.lengths,
                                 offsets=bags.offsets, weights=weights, stride=self.world_size * rows)

    def kept_ids_padded(self, slot_base: Union[int, torch.Tensor], rows: int, block_features: Tuple[int, int, int],
                        batches: torch.Tensor, whole: torch.Tensor) -> PaddedIds:
        """:meth:`kept_ids` without the host sync, for the owner update op: the ids are left where the sources
        wrote them, for the ``owner_keys`` op to read at a fixed capacity (what the sources' index blocks can
        hold for this rank). ``slot_base``: the slot's first byte, an int, or a device tensor for a step
        captured in a CUDA graph (the device's slot)."""
        lay = self.layout
        bags = self._kept_bags(slot_base, rows, block_features, batches, whole)
        return PaddedIds(bags, self.buffer_as(lay.id_dtype), self.buffer_as(torch.float32) if lay.weighted else None,
                         self.world_size * lay.ids_capacity, self.world_size * rows)

    def buffer_as(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's whole buffer as elements of ``dtype`` (a view)."""
        local = self.buf.local
        return local[:local.numel() - local.numel() % dtype.itemsize].view(dtype)

    def _kept_bags(self, slot_base: Any, rows: int, block_features: Tuple[int, int, int], batches: torch.Tensor,
                   whole: Optional[torch.Tensor]) -> "KeptBags":
        """Every kept bag's id count and where its ids (and weights) start, as elements of the buffer, for the
        slot at byte ``slot_base`` (an int, or a device tensor); bags past a source's batch, and every bag
        where ``whole`` is false, hold no ids. The extension's ``kept_bags`` op reads them where it is built
        (csrc/owner_keys.h); torch ops by the same rule elsewhere (a pure-Python install)."""
        lay, world = self.layout, self.world_size
        first, count, per_block = block_features
        dev = self.buf.local.device
        if op_available():  # one kernel, a thread a bag, where the torch ops below launch about thirty
            base = slot_base if isinstance(slot_base, torch.Tensor) else torch.full((1,), slot_base, device=dev)
            config = build(KeptBagsConfig, index_block_bytes=lay.index_block_bytes, lengths_off=lay.lengths_off,
                           offsets_off=lay.offsets_off, ids_off=lay.ids_off,
                           weights_off=lay.weights_off if lay.weighted else -1, id_bytes=lay.id_bytes,
                           max_batch=lay.max_batch, features_per_block=per_block, first_feature=first,
                           num_features=count, world=world, rows=rows)
            lengths, first_id, first_weight = torch.ops.torchrec_pgas.kept_bags(
                self.buf.local, base.to(dev, torch.int64).reshape(1), batches.to(dev, torch.int64),
                None if whole is None else whole.to(dev).reshape(1), as_tensor(config), count * world * rows,
                lay.weighted)
            return KeptBags(lengths, torch.ops.fbgemm.asynchronous_complete_cumsum(lengths), first_id,
                            first_weight if lay.weighted else None)
        block = slot_base + torch.arange(world, device=dev) * lay.index_block_bytes  # each source's block, bytes

        def per_source(off: int, dtype: torch.dtype, n: int) -> torch.Tensor:
            return self.buffer_as(dtype)[(block[:, None] + off) // dtype.itemsize + torch.arange(n, device=dev)]

        lengths = per_source(lay.lengths_off, torch.int32, per_block * lay.max_batch)
        starts = per_source(lay.offsets_off, torch.int64, per_block * lay.max_batch + 1)
        f = torch.arange(first, first + count, device=dev)[:, None, None]
        src = torch.arange(world, device=dev)[None, :, None]
        b = torch.arange(rows, device=dev)[None, None, :]
        batches = batches.to(dev).clamp(0, lay.max_batch)  # a failed step's headers may be stale
        bag = (f * batches[None, :, None] + b).expand(count, world, rows)  # the bag in its source's block
        valid = b < batches[None, :, None]
        if whole is not None:
            valid = valid & whole
        bag = torch.where(valid, bag, 0)
        src = src.expand_as(bag)
        # clamped: a corrupt negative length would make the offsets decrease (owner_keys' bags overlap)
        new_lengths = torch.where(valid, lengths[src, bag].to(torch.int64), 0).clamp(min=0).reshape(-1)
        start = starts[src, bag].reshape(-1)
        src = src.reshape(-1)
        first_weight = None
        if lay.weighted:
            first_weight = start + (block[src] + lay.weights_off) // 4
        return KeptBags(new_lengths, torch.ops.fbgemm.asynchronous_complete_cumsum(new_lengths),
                        start + (block[src] + lay.ids_off) // lay.id_bytes, first_weight)

    def kept_grads(self, slot: Union[int, torch.Tensor], rows: int, columns: Tuple[int, int, int],
                   dtype: torch.dtype) -> torch.Tensor:
        """The gradient rows this rank's sources stored for it in buffer slot ``slot`` (an int, or a device
        tensor for a captured step), ``[W * rows, D_held]`` in the order of :meth:`kept_ids` (``columns``:
        first, end and row width of a gradient block)."""
        lay, world = self.layout, self.world_size
        lo, hi, width = columns
        per_block = lay.output_block_bytes // dtype.itemsize
        blocks = self.buf.view(dtype, lay.grad_block(0, 0), lay.num_slots * world * per_block).view(
            lay.num_slots, world, per_block)
        mine = blocks[slot] if isinstance(slot, int) else blocks.index_select(0, slot.view(1))[0]
        return mine[:, :rows * width].view(world, rows, width)[:, :, lo:hi].reshape(world * rows, hi - lo)
