"""``StaticKJT``: a captured step's input KJT at a fixed ids capacity, so that one CUDA graph takes batches whose id
count per feature varies (multi-hot features).

A graph reads fixed addresses and shapes. The PGAS stages read a KJT's bags through its offsets on the device and
take ``values().numel()`` only as a bound (the index dist refuses a span past it, on the device), so a values buffer
of the sharding's ids capacity serves every batch up to that capacity: the batch's ids fill its first ``count``
positions, the rest is never read. What the host knows of the batch it was last filled with (its id count per
key) is kept here, so that no stage syncs to learn it.

A sharded EBC holding several PGAS shardings permutes and splits its input KJT by sharding: TorchRec does that with
per-key sizes read on the host, a static KJT with fixed-shape device ops (``permute``, ``split``), each sharding's
part at that sharding's own ids capacity (its ``FeatureGroup``).
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.types import PgasCapacityError, PgasError


@dataclasses.dataclass(frozen=True)
class FeatureGroup:
    """The features one sharding reads (their positions in the KJT, in the sharding's order) and its ids
    capacity: the most ids of those features a batch may hold."""

    features: Tuple[int, ...]
    capacity: int


class StaticKJT(KeyedJaggedTensor):
    """A KJT whose values (and weights) hold ``capacity`` positions, of which the first ``count`` are the batch's
    ids; lengths and offsets are the batch's. Build it with :meth:`at_capacity`, refill it with :meth:`fill_`.

    Only a sharded EBC whose shardings are all PGAS ones reading their input whole takes it
    (``PgasShardedEmbeddingBagCollection.static_feature_groups``): one reads it in its input order, several take
    the parts ``permute`` and ``split`` cut on the device, each at its sharding's capacity.
    """

    counts: List[int]  # the id count per key of the batch last filled in, as the host knew it
    groups: Tuple[FeatureGroup, ...]  # the features each sharding reads, and its capacity
    # device index tensors of ``permute`` and ``split``, made at their first (eager) call, shared with the KJTs they
    # make: a capture cannot copy a host list to the device
    _indices: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor]
    _whole: Optional["StaticKJT"]  # the static KJT a part was cut from (its errors name that batch); None: this one

    @classmethod
    def at_capacity(cls, batch: KeyedJaggedTensor,
                    capacity: Union[int, Sequence[FeatureGroup]]) -> "StaticKJT":
        """A static KJT on ``batch``'s device, shaped as ``batch`` (keys, batch size, weightedness), filled with
        ``batch``, with room for ``capacity`` ids: a count, or the groups of features the shardings read with
        their capacities (room for all of them)."""
        groups = (tuple(capacity) if not isinstance(capacity, int)
                  else (FeatureGroup(tuple(range(len(batch.keys()))), capacity),))
        if not covers_keys(groups, len(batch.keys())):  # a key no group holds would take room no group checks
            raise PgasError(f"StaticKJT: the groups {[list(g.features) for g in groups]} do not hold each of the "
                            f"batch's {len(batch.keys())} keys once")
        total = sum(g.capacity for g in groups)
        weights = batch.weights_or_none()
        values = torch.zeros(total, dtype=batch.values().dtype, device=batch.device())
        static = cls(keys=batch.keys(), values=values, lengths=torch.empty_like(batch.lengths()),
                     offsets=torch.empty_like(batch.offsets()), stride=batch.stride(),
                     weights=None if weights is None else torch.zeros(total, dtype=weights.dtype,
                                                                      device=weights.device))
        static.counts, static.groups, static._indices, static._whole = [0] * len(batch.keys()), groups, {}, None
        static.fill_(batch, past_capacity=True)  # a batch past it: refused by the step that reads it
        if len(groups) > 1:  # TorchRec's permute and split, once now: their index tensors made before any capture
            order = tuple(f for g in groups for f in g.features)
            ordered = static if order == tuple(range(len(order))) else static.permute(list(order))
            ordered.split([len(g.features) for g in groups])
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
        """The error of a fill past a sharding's capacity (naming the feature with the most ids), None if it
        fitted."""
        return self._over_capacity(self.counts)

    def _over_capacity(self, counts: Sequence[int]) -> Optional[PgasCapacityError]:
        whole = self if self._whole is None else self._whole
        total = sum(counts) if self._whole is None else whole.count
        for group in self.groups:
            held = [counts[f] for f in group.features]
            if sum(held) > group.capacity:
                top = max(range(len(held)), key=lambda k: held[k])
                key = self.keys()[group.features[top]]
                if len(whole.groups) == 1:
                    over = f"its static KJT's capacity of {group.capacity} ids (the PGAS sharding's: "
                else:
                    over = (f"the capacity of the PGAS sharding that reads '{key}': {sum(held)} ids of its "
                            f"{len(held)} features, over its {group.capacity} (")
                return PgasCapacityError(f"a batch of {total} ids (feature '{key}': {held[top]} of them) "
                                         f"exceeds {over}PgasConfig.max_ids_per_rank / pooling_capacity)")
        return None

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
        over = self._over_capacity(counts)
        if over is not None and not past_capacity:
            raise over
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
                        "replay); only a sharded EBC of PGAS shardings may take it (its permute and split)")

    def offset_per_key(self) -> List[int]:
        return self.length_per_key()  # raises: as above

    def permute(self, indices: List[int], indices_tensor: Optional[torch.Tensor] = None) -> "StaticKJT":
        """The features ``indices`` in that order, cut on the device: room for every group's ids, the groups
        following their features to their new positions (TorchRec's sharded EBC orders its input by sharding)."""
        order = tuple(indices)
        if sorted(order) != sorted(f for g in self.groups for f in g.features):
            raise PgasError(f"StaticKJT: the order {list(order)} does not give each feature to one sharding "
                            f"({[list(g.features) for g in self.groups]})")
        moved = tuple(FeatureGroup(tuple(k for k, f in enumerate(order) if f in g.features), g.capacity)
                      for g in self.groups)
        return self._select(order, self.capacity, moved)

    def split(self, segments: List[int]) -> List[KeyedJaggedTensor]:
        """One part a sharding, its features the next ``segments[s]`` ones: ``self`` where one sharding reads it
        whole, else each group's part at its capacity, cut on the device."""
        starts = [sum(segments[:s]) for s in range(len(segments))]
        wanted = [tuple(range(a, a + n)) for a, n in zip(starts, segments)]
        if wanted != [g.features for g in self.groups]:
            raise PgasError(f"StaticKJT: a split into {list(segments)} features is not its shardings' "
                            f"({[list(g.features) for g in self.groups]})")
        if len(self.groups) == 1:
            return [self]
        return [self._select(g.features, g.capacity, (FeatureGroup(tuple(range(len(g.features))), g.capacity),))
                for g in self.groups]

    def _select(self, features: Tuple[int, ...], capacity: int, groups: Tuple[FeatureGroup, ...]) -> "StaticKJT":
        """The KJT of ``features`` (in that order) at ``capacity`` ids, in fixed-shape device ops: each feature's
        bags and ids moved whole, the ids packed from position 0 and the rest zero; past the capacity, the offsets
        stay whole and the ids are cut (the step that reads it refuses it on the device, as a fill past it)."""
        batch, index = self.stride(), self._index("features", features)
        lengths = self.lengths().view(-1, batch).index_select(0, index).reshape(-1)
        offsets = self.offsets()
        first = offsets.index_select(0, index * batch)  # each feature's first id
        sizes = offsets.index_select(0, (index + 1) * batch) - first
        ends = torch.cumsum(sizes, 0)  # where each feature's ids end in the part
        position = self._index("positions", (capacity,))
        feature = torch.searchsorted(ends, position, right=True)  # len(features) past the part's ids
        held = feature < len(features)
        feature = feature.clamp(max=len(features) - 1)
        source = (position - (ends - sizes).gather(0, feature) + first.gather(0, feature)).to(torch.int64)
        inside = held & (source < self.capacity)  # a batch past the whole capacity: its cut ids read as zeros
        source = torch.where(inside, source, 0)

        def pick(tensor: torch.Tensor) -> torch.Tensor:
            zero = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
            return torch.where(inside, tensor.gather(0, source), zero)

        weights = self.weights_or_none()
        part = StaticKJT(keys=[self.keys()[f] for f in features], values=pick(self.values()), lengths=lengths,
                         offsets=torch.cat([offsets.new_zeros(1), torch.cumsum(lengths, 0).to(offsets.dtype)]),
                         stride=batch, weights=None if weights is None else pick(weights))
        part.counts, part.groups, part._indices = [self.counts[f] for f in features], groups, self._indices
        part._whole = self if self._whole is None else self._whole
        return part

    def _index(self, kind: str, key: Tuple[int, ...]) -> torch.Tensor:
        """The ``features`` listed in ``key``, or the ``positions`` below ``key[0]``, as a device tensor of the
        offsets' dtype: made once (``at_capacity`` makes every one TorchRec's permute and split ask for) and reused."""
        if (kind, key) not in self._indices:
            if self.values().is_cuda and torch.cuda.is_current_stream_capturing():
                raise PgasError(f"StaticKJT: {kind} {key[:8]} asked for in a capture, not made before it (a "
                                "permute or split other than its groups')")
            values = key if kind == "features" else range(key[0])
            self._indices[kind, key] = torch.tensor(values, dtype=self.offsets().dtype, device=self.device())
        return self._indices[kind, key]


def covers_keys(groups: Sequence[FeatureGroup], num_keys: int) -> bool:
    """Whether ``groups`` hold each of ``num_keys`` keys once: a static KJT's room is its groups' capacities."""
    return sorted(f for g in groups for f in g.features) == list(range(num_keys))
