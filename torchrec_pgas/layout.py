"""Byte layout of the symmetric buffer of one PGAS sharding (``pgas_row_wise``; see below for table-wise).

Every rank holds the same buffer (sizes are plan-time constants)::

    index region   [slot][src] blocks, written by rank ``src`` (the requester)
        header   int64[4]          epoch, local batch B, nnz, gave up (1: the source gave the step up)
        offsets  int64[F*Bmax+1]   where bag (f, b)'s ids start in ``ids``, [f][b] order
        lengths  int32[F*Bmax]     how many ids of bag (f, b) this owner holds
        ids      int32|int64[C]    local row offsets into this rank's shards (int32
                                   unless a shard has 2^31 rows or more: ``id_bytes``)
        weights  float32[C]        per-sample weights (weighted EBCs only)
    output region  [slot][owner] blocks, written by rank ``owner``
        partial  [Bmax, D] in the output dtype (<= 4 bytes), rows 0..B-1 used
    gradient region  [slot][src] blocks, written by rank ``src`` in its backward (trainable layouts)
        gradient [Bmax, D] like an output block: the rows of the bags this owner held ids of

Reading rule for the owner, on both backends: bag ``fb`` is
``ids[offsets[fb] : offsets[fb] + lengths[fb]]`` and every position is below
``nnz <= C``. The CPU backend compacts (offsets are the prefix sums of this
owner's lengths); the GPU index-dist kernel compacts within tiles of 32 bags
(one warp each): this owner's ids of a tile are packed in bag order at the
start of the tile's span in the requester's own CSR values, which needs no
scan across tiles.

``slot = epoch % num_slots``. A trainable layout has three slots: a step's
blocks stay until its backward has consumed them, and TorchRec's train
pipelines keep up to three steps in flight (``TrainPipelineSemiSync``: batch
i+2's input dist and i+1's lookup before i's backward); an inference-only
layout (``PgasConfig(training=None)``) has two and no gradient region. The
signal pad holds four epoch slots per peer (index, output, gradient, release:
``step_abi.SignalGroup``); peers store the epoch there after the block is
complete, and an owner releases a requester's blocks of a step once its lookup
(no backward) or its backward is done with them.

``pgas_table_wise`` uses the same layout with whole-table row ids. On the
host path an index block holds only the features of its owner's tables, and an
output block is the owner's ``[B, D_owner]`` pooled columns (``D`` here is the
widest owner's). The GPU kernels run it as the one-owner case of row-wise: an
index block is indexed like row-wise (the owner reads its features' bags), and
an output block is the full ``[B, D]`` row, of which the owner writes its
tables' columns.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from torchrec_pgas.step_abi import BoundsMode, SignalGroup, StepConfig, build

_ALIGN = 16  # 16-byte aligned blocks: vector loads/stores on the GPU


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def divisor_magic(divisor: int, hash_size: int) -> Tuple[int, int]:
    """``(magic, shift)`` with ``id // divisor == (id * magic) >> shift`` for every id in ``[0, 2^31)``.

    The index-dist kernel finds an id's owner with this multiply-shift instead of
    an integer division, as one 32x32->64-bit multiply: ``magic = ceil(2^k /
    divisor) < 2^32`` with ``k = 31 + ceil(log2 divisor)`` errs by ``e < divisor
    <= 2^(k-31)``, and ``id * e < 2^k`` keeps the floor exact. ``(0, 0)`` (the
    kernel divides) when ids can reach 2^31.
    """
    if divisor < 1:
        raise ValueError(f"divisor_magic: divisor {divisor} (a table with no rows?)")
    if hash_size > 2**31 - 1:
        return 0, 0
    shift = 31 + (divisor - 1).bit_length()
    return -(-(1 << shift) // divisor), shift


def id_bytes_for(block_rows: Sequence[int]) -> int:
    """4 if every shard's local rows fit int32, else 8."""
    return 4 if max(block_rows, default=0) < 2**31 else 8


@dataclass(frozen=True)
class StepLayout:
    """Offsets and sizes of one sharding's symmetric buffer and signal pad (the same on every rank)."""

    world_size: int
    num_features: int
    max_batch: int
    ids_capacity: int
    dim_sum: int
    weighted: bool
    id_bytes: int = 8  # 4: local rows as int32 (half the index bytes on NVLink)
    trainable: bool = True  # a gradient region and three slots (module docstring)
    max_output_bytes: int = 4  # partials are stored in the TBE output dtype

    header_off: int = 0
    offsets_off: int = 32

    @property
    def lengths_off(self) -> int:
        return _align(self.offsets_off + 8 * (self.num_features * self.max_batch + 1))

    @property
    def ids_off(self) -> int:
        return _align(self.lengths_off + 4 * self.num_features * self.max_batch)

    @property
    def weights_off(self) -> int:
        return _align(self.ids_off + self.id_bytes * self.ids_capacity)

    @property
    def index_block_bytes(self) -> int:
        return _align(self.weights_off + (4 * self.ids_capacity if self.weighted else 0))

    @property
    def output_block_bytes(self) -> int:
        return _align(self.max_output_bytes * self.max_batch * self.dim_sum)

    @property
    def num_slots(self) -> int:
        return 3 if self.trainable else 2

    @property
    def output_region_off(self) -> int:
        return self.num_slots * self.world_size * self.index_block_bytes

    @property
    def grad_region_off(self) -> int:
        return self.output_region_off + self.num_slots * self.world_size * self.output_block_bytes

    @property
    def nbytes(self) -> int:
        grads = self.num_slots * self.world_size * self.output_block_bytes if self.trainable else 0
        return self.grad_region_off + grads

    @property
    def num_signal_slots(self) -> int:
        return SignalGroup.SIGNAL_GROUPS * self.world_size

    @property
    def id_dtype(self) -> torch.dtype:
        return torch.int32 if self.id_bytes == 4 else torch.int64

    def config(self, timeout_ns: int, rank: int, bounds_mode: BoundsMode,
               lookup_features: Optional[Tuple[int, int]] = None, variable_batch: bool = False,
               trace: bool = False) -> StepConfig:
        """The ``StepConfig`` every kernel op takes (csrc/step_abi.h).

        ``lookup_features``: the features whose rows this rank holds (all, for row-wise);
        ``variable_batch``: owners take each source's batch from its header (table-wise);
        ``trace``: launch the kernels' comm-timeline builds.
        """
        f_lo, f_hi = lookup_features if lookup_features is not None else (0, self.num_features)
        return build(
            StepConfig,
            index_block_bytes=self.index_block_bytes, output_region_off=self.output_region_off,
            output_block_bytes=self.output_block_bytes, grad_region_off=self.grad_region_off,
            offsets_off=self.offsets_off,
            lengths_off=self.lengths_off, ids_off=self.ids_off, weights_off=self.weights_off,
            num_slots=self.num_slots, max_batch=self.max_batch, capacity=self.ids_capacity,
            dim_sum=self.dim_sum, num_features=self.num_features, timeout_ns=timeout_ns,
            rank=rank, world=self.world_size, weighted=self.weighted, bounds_mode=bounds_mode,
            id_bytes=self.id_bytes, lookup_f_lo=f_lo, lookup_f_hi=f_hi, variable_batch=variable_batch,
            trace=trace,
        )

    def index_block(self, slot: int, src: int) -> int:
        return (slot * self.world_size + src) * self.index_block_bytes

    def output_block(self, slot: int, owner: int) -> int:
        return self.output_region_off + (slot * self.world_size + owner) * self.output_block_bytes

    def grad_block(self, slot: int, src: int) -> int:
        return self.grad_region_off + (slot * self.world_size + src) * self.output_block_bytes

    def index_signal(self, src: int) -> int:
        return SignalGroup.INDEX_SIGNALS * self.world_size + src

    def output_signal(self, owner: int) -> int:
        return SignalGroup.OUTPUT_SIGNALS * self.world_size + owner

    def grad_signal(self, src: int) -> int:
        return SignalGroup.GRAD_SIGNALS * self.world_size + src

    def release_signal(self, owner: int) -> int:
        return SignalGroup.RELEASE_SIGNALS * self.world_size + owner
