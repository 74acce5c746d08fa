"""``StaticKJT``: a captured step's input KJT at a fixed ids capacity, so that one CUDA graph takes batches whose id
count per feature varies (multi-hot features).

A graph reads fixed addresses and shapes. The PGAS stages read a KJT's bags through its offsets on the device and
take ``values().numel()`` only as a bound (the index dist refuses a span past it, on the device), so a values buffer
of the sharding's ids capacity serves every batch up to that capacity: the batch's ids fill its first ``count``
positions, the rest is never read. What the host knows of the batch it was last filled with (its id count per
key) is kept here, so that no stage syncs to learn it.
"""

from typing import List, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.types import PgasCapacityError, PgasError


class StaticKJT(KeyedJaggedTensor):
    """A KJT whose values (and weights) hold ``capacity`` positions, of which the first ``count`` are the batch's
    ids; lengths and offsets are the batch's. Build it with :meth:`at_capacity`, refill it with :meth:`fill_`.

    Only a module that reads the KJT whole takes it: a sharded EBC holding one PGAS sharding, which reads it in
    its input order (``PgasShardedEmbeddingBagCollection.static_ids_capacity``). ``split`` into several
    shardings would need the per-key sizes on the host and raises.
    """

    counts: List[int]  # the id count per key of the batch last filled in, as the host knew it

    @classmethod
    def at_capacity(cls, batch: KeyedJaggedTensor, capacity: int) -> "StaticKJT":
        """A static KJT on ``batch``'s device, shaped as ``batch`` (keys, batch size, weightedness) with room for
        ``capacity`` ids, filled with ``batch``."""
        weights = batch.weights_or_none()
        values = torch.zeros(capacity, dtype=batch.values().dtype, device=batch.device())
        static = cls(keys=batch.keys(), values=values, lengths=torch.empty_like(batch.lengths()),
                     offsets=torch.empty_like(batch.offsets()), stride=batch.stride(),
                     weights=None if weights is None else torch.zeros(capacity, dtype=weights.dtype,
                                                                      device=weights.device))
        static.counts = [0] * len(batch.keys())
        static.fill_(batch, past_capacity=True)  # a batch past it: refused by the step that reads it
        return static

    @property
    def capacity(self) -> int:
        return self.values().numel()

    @property
    def count(self) -> int:
        """The ids of the batch last filled in (may exceed the capacity: see :meth:`fill_`)."""
        return sum(self.counts)

    def fits(self, batch: KeyedJaggedTensor) -> Optional[str]:
        """Why ``batch`` cannot fill this KJT (other keys, batch size or weightedness), None if it can."""
        if batch.keys() != self.keys():
            return f"keys {batch.keys()} (the static batch's: {self.keys()})"
        if batch.stride() != self.stride():
            return f"batch size {batch.stride()} (the static batch's: {self.stride()})"
        weighted = batch.weights_or_none() is not None
        if weighted != (self.weights_or_none() is not None):
            return f"{'' if weighted else 'no '}weights (the static batch's: {'none' if weighted else 'weights'})"
        return None

    def capacity_error(self) -> Optional[PgasCapacityError]:
        """The error of a fill past the capacity (naming the feature with the most ids), None if it fitted."""
        return _over(self.keys(), self.counts, self.capacity) if self.count > self.capacity else None

    def fill_(self, batch: KeyedJaggedTensor, past_capacity: bool = False) -> None:
        """Refill with ``batch`` (the same keys, batch size and weightedness) in the current stream, without a sync
        where ``batch``'s id count per key is known (a host batch moved with ``.to()`` carries it).

        A batch of more ids than the capacity raises ``PgasCapacityError`` before anything is copied, unless
        ``past_capacity``: then its lengths and offsets are copied whole and its ids up to the capacity, so that a
        replay refuses the step on the device, on every rank alike (the index dist finds a bag past the values),
        and :meth:`capacity_error` says why."""
        reason = self.fits(batch)
        if reason is not None:
            raise PgasError(f"StaticKJT: a batch of {reason} cannot fill it")
        counts = batch.length_per_key()
        n = min(sum(counts), self.capacity)
        if sum(counts) > self.capacity and not past_capacity:
            raise _over(self.keys(), counts, self.capacity)
        self.counts = list(counts)
        self.values()[:n].copy_(batch.values()[:n], non_blocking=True)
        self.lengths().copy_(batch.lengths(), non_blocking=True)
        self.offsets().copy_(batch.offsets(), non_blocking=True)
        weights = batch.weights_or_none()
        if weights is not None:
            self.weights()[:n].copy_(weights[:n], non_blocking=True)

    def unpadded(self) -> KeyedJaggedTensor:
        """The batch as a plain KJT (its ids without the unused positions), for the host path, which reads every
        value it is given."""
        n = min(self.count, self.capacity)
        weights = self.weights_or_none()
        return KeyedJaggedTensor(keys=self.keys(), values=self.values()[:n], lengths=self.lengths(),
                                 offsets=self.offsets(), weights=None if weights is None else weights[:n],
                                 stride=self.stride(), length_per_key=self.counts)

    def length_per_key(self) -> List[int]:
        """Not on the host for a captured step's batch (a cached value would be the capture's, stale in every
        replay): a module that reads per-key sizes must take plain KJTs (``ReplayTrainPipeline(...,
        variable_counts=False)``)."""
        raise PgasError("StaticKJT: a captured step's batch keeps no per-key sizes on the host (they change every "
                        "replay); only a sharded EBC holding one PGAS sharding may take it, unchanged")

    def offset_per_key(self) -> List[int]:
        return self.length_per_key()  # raises: as above

    def split(self, segments: List[int]) -> List[KeyedJaggedTensor]:
        if list(segments) == [len(self.keys())]:
            return [self]  # one sharding reads it whole: no host sizes needed
        raise PgasError(f"StaticKJT: a split into {list(segments)} features needs per-key sizes on the host; only "
                        "a sharded EBC holding one PGAS sharding takes a static KJT")


def _over(keys: Sequence[str], counts: Sequence[int], capacity: int) -> PgasCapacityError:
    top = max(range(len(counts)), key=lambda k: counts[k])
    return PgasCapacityError(
        f"a batch of {sum(counts)} ids (feature '{keys[top]}': {counts[top]} of them) exceeds its static KJT's "
        f"capacity of {capacity} ids (the PGAS sharding's: PgasConfig.max_ids_per_rank / pooling_capacity)")
