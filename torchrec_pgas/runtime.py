"""The PGAS runtime: symmetric buffers, one-sided puts, epoch signals.

One small API with two backends behind it (``torchrec_pgas.bootstrap`` picks one):

* ``shm`` (CPU): every rank's symmetric heap is a POSIX shared-memory segment that
  all local ranks map; a put is a copy into the peer's mapping, a signal is a
  store into the peer's signal pad. The host step (``sharding/host_step.py``)
  runs on put, signal and wait.
* ``nvshmem`` (CUDA): the NVSHMEM symmetric heap (see
  ``torchrec_pgas.nvshmem_backend``). The fused kernels use only the heap and
  its peer pointers: they store into peers themselves. Put, signal and wait run
  on the current stream as the reference path (tests; peers that are not
  load/store reachable later), and ``abort`` is built on put + signal.

``torch.distributed`` is used only to bootstrap (agree on names, exchange ids,
barriers at allocation time); a step never calls a collective.

Signals carry a monotonically increasing *epoch* rather than a flag that is
reset: a waiter for epoch ``e`` waits until the word is ``>= e``, so a peer that
is already at step ``e + 1`` can never be mistaken for one at ``e - 1`` and no
reset can race with a late reader.
"""

import abc
import socket
import weakref
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from torchrec_pgas.step_abi import ABORT_RANK_BITS, PadWord
from torchrec_pgas.types import PgasBackendType, PgasError

# Signal pads start with a small control area (PadWord): word 0 holds the abort
# word of the last step a rank gave up on, ``(epoch << ABORT_RANK_BITS) |
# (aborting_rank + 1)`` (0 = healthy); the next words hold the reason as UTF-8.
# An abort ends that step only: waits of later steps ignore it.
ABORT_WORD: int = PadWord.ABORT
PAD_HEADER_WORDS: int = PadWord.HEADER_WORDS
ABORT_MSG_WORDS: int = PAD_HEADER_WORDS - PadWord.ABORT_MESSAGE


@dataclass
class SymmetricBuffer:
    """A named region of the same size on every rank; ``local`` is this rank's part."""

    name: str
    nbytes: int
    local: torch.Tensor  # uint8, this rank's segment

    def view(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        """Typed view of ``numel`` elements of this rank's segment at byte ``offset``."""
        nbytes = numel * dtype.itemsize
        _check_range(self, offset, nbytes)
        return self.local[offset : offset + nbytes].view(dtype)


@dataclass
class SignalPad:
    """Per-rank int64 words written by peers: a control header, then ``num_slots`` slots."""

    name: str
    num_slots: int
    words: torch.Tensor  # int64 [PAD_HEADER_WORDS + num_slots], this rank's pad


def _check_range(buf: SymmetricBuffer, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes:
        raise PgasError(
            f"access [{offset}, {offset + nbytes}) is outside symmetric buffer "
            f"'{buf.name}' of {buf.nbytes} bytes"
        )


class PgasRuntime(abc.ABC):
    """One process's handle on the PGAS world of a process group."""

    backend_type: PgasBackendType
    hosts: List[str]  # each rank's host name, by rank
    # Tear down at interpreter exit? Not for NVSHMEM, whose teardown is
    # collective and would hang behind a rank that already died.
    finalize_at_exit: bool = True

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        # Weak: the registry of runtimes is process-global, and a strong reference would keep gloo's group,
        # and its threads, alive past the user's destroy_process_group into interpreter finalization (issue 43).
        self._pg = weakref.ref(pg)
        self.rank: int = dist.get_rank(pg)
        self.world_size: int = dist.get_world_size(pg)
        self.device = device
        self._buffers: Dict[str, SymmetricBuffer] = {}
        self._pads: Dict[str, SignalPad] = {}

    @property
    def pg(self) -> dist.ProcessGroup:
        """The process group this runtime bootstraps over; an error once the group was destroyed."""
        pg = self._pg()
        if pg is None:
            raise PgasError("the process group of this PGAS runtime was destroyed")
        return pg

    def pe(self, peer: int) -> int:
        """``peer``'s PE in the NVSHMEM world (its rank in the world's group): ``peer`` itself, except in a
        node's view of the world (``node_runtime.NodeRuntime``)."""
        self._check_peer(peer)
        return peer

    def serves(self, pg: dist.ProcessGroup) -> bool:
        """Is this the runtime of ``pg`` (not of a destroyed group whose id ``pg`` reuses)?"""
        return self._pg() is pg

    # ---- allocation (collective) -------------------------------------------
    def alloc(self, name: str, nbytes: int) -> SymmetricBuffer:
        """Collective: a buffer of ``nbytes`` on every rank; re-allocating a name reuses it."""
        if name in self._buffers:
            buf = self._buffers[name]
            if buf.nbytes != nbytes:
                raise PgasError(
                    f"symmetric buffer '{name}' exists with {buf.nbytes} bytes, asked for {nbytes}"
                )
            return buf
        self._agree("alloc", name, nbytes)
        buf = SymmetricBuffer(name, nbytes, self._alloc_bytes(name, max(nbytes, 8)))
        buf.local = buf.local[:nbytes]
        self._buffers[name] = buf
        return buf

    def alloc_signals(self, name: str, num_slots: int) -> SignalPad:
        """Collective: a zeroed signal pad with ``num_slots`` epoch slots on every rank."""
        if name in self._pads:
            pad = self._pads[name]
            if pad.num_slots != num_slots:
                raise PgasError(f"signal pad '{name}' exists with {pad.num_slots} slots")
            return pad
        self._agree("alloc_signals", name, num_slots)
        nwords = PAD_HEADER_WORDS + num_slots
        words = self._alloc_bytes("sig:" + name, nwords * 8).view(torch.int64)
        pad = SignalPad(name, num_slots, words)
        self._pads[name] = pad
        return pad

    def _agree(self, what: str, name: str, size: int) -> None:
        """Every rank must allocate the same names with the same sizes, in the same order."""
        mine = (what, name, size)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.pg)
        if any(g != mine for g in gathered):
            raise PgasError(f"ranks disagree on a collective allocation: {gathered}")

    # ---- data movement ------------------------------------------------------
    def put(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        """One-sided: copy ``src``'s bytes into ``peer``'s part of ``buf`` at byte ``offset``."""
        self._check_peer(peer)
        nbytes = src.numel() * src.element_size()
        _check_range(buf, offset, nbytes)
        if nbytes:
            self._put_bytes(buf, peer, offset, src.contiguous().view(-1).view(torch.uint8))

    def signal(self, pad: SignalPad, peer: int, slot: int, epoch: int) -> None:
        """Set ``peer``'s ``slot`` to ``epoch``, ordered after this rank's earlier puts."""
        self._check_peer(peer)
        if not 0 <= slot < pad.num_slots:
            raise PgasError(f"signal slot {slot} outside pad '{pad.name}' of {pad.num_slots}")
        self._signal_word(pad, peer, PAD_HEADER_WORDS + slot, epoch)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size:
            raise PgasError(f"peer rank {peer} outside world of size {self.world_size}")

    @abc.abstractmethod
    def _alloc_bytes(self, name: str, nbytes: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _put_bytes(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _signal_word(self, pad: SignalPad, peer: int, word: int, value: int) -> None: ...

    @abc.abstractmethod
    def wait(
        self, pad: SignalPad, slots: Sequence[int], value: int, timeout_s: float, what: str, step: int = 0
    ) -> None:
        """Block until every local ``slot`` of ``pad`` is ``>= value``.

        Raises ``PgasPeerAbortError`` if a peer aborted step ``step`` (default:
        ``value``, the step an epoch signal belongs to), and
        ``PgasTimeoutError`` (naming ``what`` and the missing sources) after
        ``timeout_s``.
        """

    def check(self) -> None:
        """Raise an error a device-side wait recorded (no-op where waits block the host)."""

    @abc.abstractmethod
    def abort(self, pad: SignalPad, reason: str, step: int) -> None:
        """Tell every rank that waits on ``pad`` for step ``step`` that this rank gave up on it, and why."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def finalize(self) -> None:
        self._buffers.clear()
        self._pads.clear()


def rank_hosts(pg: dist.ProcessGroup) -> List[str]:
    """Collective: each rank's host name, in ``pg``'s rank order."""
    hosts: List[object] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(hosts, socket.gethostname(), group=pg)
    return [str(h) for h in hosts]


def one_host(hosts: Sequence[str], kind: str) -> None:
    """Raise unless every rank of a sharding that runs among all the job's ranks (``hosts``: theirs, by rank) is
    on one host: the one-sided types reach peers by load/store, inside one NVLink domain."""
    if len(set(hosts)) > 1:
        spans = {h: [r for r, x in enumerate(hosts) if x == h] for h in dict.fromkeys(hosts)}
        raise PgasError(f"{kind} needs every rank on one host (one NVLink domain); ranks by host: {spans}. Beyond "
                        "one node, plan pgas_table_row_wise (torchrec_pgas.planner.pgas_table_row_wise) or a stock "
                        "sharding type")


def encode_abort(rank: int, reason: str, step: int) -> Tuple[int, torch.Tensor]:
    """The abort word of ``step`` and the reason packed into ABORT_MSG_WORDS int64 words."""
    raw = reason.encode("utf-8")[: ABORT_MSG_WORDS * 8 - 1]
    buf = torch.zeros(ABORT_MSG_WORDS * 8, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return (step << ABORT_RANK_BITS) | (rank + 1), buf.view(torch.int64)


def aborted_step(word: int) -> int:
    """The step an abort word ends (0: none)."""
    return word >> ABORT_RANK_BITS


def decode_abort(words: torch.Tensor) -> Tuple[int, str]:
    """(aborting rank, reason) from a pad's control header on the CPU."""
    rank = (int(words[ABORT_WORD]) & ((1 << ABORT_RANK_BITS) - 1)) - 1
    raw = words[PadWord.ABORT_MESSAGE:PAD_HEADER_WORDS].contiguous().view(torch.uint8).tolist()
    msg = bytes(raw).split(b"\0", 1)[0].decode("utf-8", errors="replace")
    return rank, msg
