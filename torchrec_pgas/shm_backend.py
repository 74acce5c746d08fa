"""CPU backend: a genuine single-host PGAS over POSIX shared memory.

Each rank's symmetric heap is one segment per allocation under ``/dev/shm``
(what ``shm_open`` uses on Linux). Every local rank maps every peer's segment,
so a put is a ``memcpy`` into the peer's mapping and a signal is an aligned
8-byte store into the peer's signal pad. Segments are unlinked as soon as all
ranks have mapped them, so nothing outlives the processes, even after a crash.

Ordering: a put is a copy issued before the signal store by the same thread;
x86-64's total store order makes the data visible to a peer before the signal,
and the reader's loads are not reordered either. On weaker memory models this
backend would need explicit fences, so it refuses to start there.
"""

import mmap
import os
import platform
import socket
import tempfile
import time
import uuid
from typing import Dict, List, Sequence

import numpy as np
import torch
import torch.distributed as dist

from torchrec_pgas.runtime import (
    ABORT_MSG_WORDS,
    ABORT_WORD,
    PAD_HEADER_WORDS,
    PgasRuntime,
    SignalPad,
    SymmetricBuffer,
    aborted_step,
    decode_abort,
    encode_abort,
)
from torchrec_pgas.types import PgasBackendType, PgasError, PgasPeerAbortError, PgasTimeoutError

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmRuntime(PgasRuntime):
    backend_type = PgasBackendType.SHM

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(pg, device)
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise PgasError(
                f"the shm backend relies on x86-64 store ordering; this is {platform.machine()}"
            )
        ids: List[object] = [None] * self.world_size
        dist.all_gather_object(ids, (socket.gethostname(), uuid.uuid4().hex[:12]), group=pg)
        self.hosts = [str(h) for h, _ in ids]  # type: ignore[misc]
        if len(set(self.hosts)) != 1:
            raise PgasError(f"the shm backend needs all ranks on one host, got {sorted(set(self.hosts))}")
        self._tag: str = ids[0][1]  # type: ignore[index]
        self._seq = 0
        self._maps: List[mmap.mmap] = []
        # name -> per-rank uint8 tensors (buffers) or int64 numpy arrays (pads)
        self._peer_bytes: Dict[str, List[torch.Tensor]] = {}
        self._peer_words: Dict[str, List[np.ndarray]] = {}

    def _alloc_bytes(self, name: str, nbytes: int) -> torch.Tensor:
        # Names are agreed collectively; files are named by sequence number.
        path = os.path.join(_SHM_DIR, f"trpgas-{self._tag}-{self._seq}-{{}}")
        self._seq += 1
        fd = os.open(path.format(self.rank), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        dist.barrier(group=self.pg)
        views: List[torch.Tensor] = []
        words: List[np.ndarray] = []
        for r in range(self.world_size):
            fd = os.open(path.format(r), os.O_RDWR)
            try:
                m = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self._maps.append(m)
            views.append(torch.frombuffer(m, dtype=torch.uint8, count=nbytes))
            words.append(np.frombuffer(m, dtype=np.int64, count=nbytes // 8))
        dist.barrier(group=self.pg)
        os.unlink(path.format(self.rank))
        self._peer_bytes[name] = views
        self._peer_words[name] = words
        return views[self.rank]

    def _put_bytes(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        self._peer_bytes[buf.name][peer][offset : offset + src.numel()].copy_(src)

    def _signal_word(self, pad: SignalPad, peer: int, word: int, value: int) -> None:
        self._peer_words["sig:" + pad.name][peer][word] = value

    def wait(
        self, pad: SignalPad, slots: Sequence[int], value: int, timeout_s: float, what: str, step: int = 0
    ) -> None:
        words = self._peer_words["sig:" + pad.name][self.rank]
        idx = np.asarray([PAD_HEADER_WORDS + s for s in slots], dtype=np.int64)
        step = step or value
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            # The signals first, then the abort word: a peer that gives a step up aborts before it signals a
            # later one (x86-64 keeps both its stores and these loads in order), so a signal read here cannot
            # hide an abort of this step written before it.
            arrived = bool((words[idx] >= value).all())
            if aborted_step(int(words[ABORT_WORD])) == step:
                rank, msg = decode_abort(torch.from_numpy(words[:PAD_HEADER_WORDS].copy()))
                raise PgasPeerAbortError(f"rank {rank} aborted step {step} of '{pad.name}': {msg}")
            if arrived:
                return
            spins += 1
            if spins > 200:
                # Two CI cores may host three ranks: give the peer the CPU.
                time.sleep(min(1e-3, 1e-6 * spins))
                if time.monotonic() > deadline:
                    missing = [s for s, i in zip(slots, idx) if words[i] < value]
                    raise PgasTimeoutError(
                        f"rank {self.rank} waited {timeout_s:.0f}s on '{pad.name}' for {what} "
                        f"(step {step}); still missing slots {missing}: a peer crashed, "
                        "diverged, or is not running this step"
                    )

    def abort(self, pad: SignalPad, reason: str, step: int) -> None:
        word, msg = encode_abort(self.rank, reason, step)
        msg_np = msg.numpy()
        for words in self._peer_words["sig:" + pad.name]:
            words[1 : 1 + ABORT_MSG_WORDS] = msg_np
            words[ABORT_WORD] = word

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def finalize(self) -> None:
        super().finalize()
        self._peer_bytes.clear()
        self._peer_words.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                # A tensor view still references the mapping; the OS unmaps at exit.
                pass
        self._maps.clear()
