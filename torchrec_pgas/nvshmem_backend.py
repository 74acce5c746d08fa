"""CUDA backend: the NVSHMEM symmetric heap, puts and signals on the current stream.

Bootstrap follows DeepEP/pplx: rank 0 makes an NVSHMEM unique id, the process
group broadcasts it, every rank calls ``nvshmemx_init_attr`` from our extension
(which also registers our device state when PyTorch's symmetric memory already
initialized NVSHMEM in this process). NVLink multicast stays off.

The fused kernels of a step use only the heap and its peer pointers
(``sharding/device_step.py``). ``put``, ``signal`` and ``wait`` below are the
reference path of the runtime API, on the current stream (tests; peers that
are not load/store reachable later); ``abort`` is built on put + signal.
Waits are device-side: ``wait`` enqueues a kernel that spins until the signals
arrive, so the host never blocks. A timeout or a peer's abort is written to a
pinned status word; ``check`` raises it on the host after the stream has been
synchronized.
"""

import os
from typing import List, Sequence

import torch
import torch.distributed as dist

from torchrec_pgas import step_abi
from torchrec_pgas.op_fakes import register_fakes
from torchrec_pgas.runtime import (
    PAD_HEADER_WORDS,
    PgasRuntime,
    SignalPad,
    SymmetricBuffer,
    decode_abort,
    encode_abort,
    rank_hosts,
)
from torchrec_pgas.step_abi import DeviceStatus, PadWord
from torchrec_pgas.types import PgasBackendType, PgasError, PgasPeerAbortError, PgasTimeoutError

DEFAULT_HEAP_BYTES = 2 << 30


def load_extension() -> None:
    """Import ``torchrec_pgas._C`` (registers ``torch.ops.torchrec_pgas``) or explain why not, and check
    that it was built from the contract this package mirrors."""
    try:
        import torchrec_pgas._C  # noqa: F401
    except ImportError as e:
        raise PgasError(
            "the nvshmem backend needs the CUDA extension torchrec_pgas._C; build it with "
            "`pip install --no-build-isolation .` on a machine with nvcc (not TORCH_PGAS_NO_CUDA=1)"
        ) from e
    step_abi.check_extension()
    register_fakes()


class NvshmemRuntime(PgasRuntime):
    backend_type = PgasBackendType.NVSHMEM
    finalize_at_exit = False

    def __init__(self, pg: dist.ProcessGroup, device: torch.device, heap_hint: int = 0) -> None:
        super().__init__(pg, device)
        load_extension()
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # multicast off (shared hosts)
        # The heap is sized once, at init: leave room for the other shardings
        # of the model (each allocates its own buffer) unless the user chose.
        if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(max(DEFAULT_HEAP_BYTES, 4 * heap_hint))
        torch.cuda.set_device(device)
        torch.cuda.init()
        # Before NVSHMEM starts: a sharding whose peers span hosts raises our message (``runtime.one_host``). Over
        # several hosts only pgas_table_row_wise's node steps run (load/store among one host's PEs); NVSHMEM's own
        # collectives (allocation, barriers, teardown) still span the job and use its remote transport.
        self.hosts = rank_hosts(pg)
        ops = torch.ops.torchrec_pgas
        uid = ops.unique_id() if self.rank == 0 else None
        box: List[object] = [uid]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        ops.init(box[0], self.rank, self.world_size)
        self._status = torch.zeros(2, dtype=torch.int64).pin_memory()
        self._allocs: List[torch.Tensor] = []

    def _alloc_bytes(self, name: str, nbytes: int) -> torch.Tensor:
        try:
            buf = torch.ops.torchrec_pgas.alloc(nbytes)
        except RuntimeError as e:
            raise PgasError(
                f"cannot allocate {nbytes} bytes of symmetric memory for '{name}' from the "
                f"NVSHMEM heap (NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE')}): "
                "set NVSHMEM_SYMMETRIC_SIZE to the sum over all PGAS shardings before the first "
                "one is built, or lower PgasConfig.max_local_batch_size / max_ids_per_rank"
            ) from e
        self._allocs.append(buf)
        return buf

    def _put_bytes(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        dst = buf.local[offset : offset + src.numel()]
        torch.ops.torchrec_pgas.put(dst, src.to(self.device), peer)

    def _signal_word(self, pad: SignalPad, peer: int, word: int, value: int) -> None:
        torch.ops.torchrec_pgas.signal(pad.words[word : word + 1], value, peer)

    def wait(
        self, pad: SignalPad, slots: Sequence[int], value: int, timeout_s: float, what: str, step: int = 0
    ) -> None:
        """Stream-ordered: work enqueued after this sees the signals; see ``check``. (The reference wait
        takes its step from the value: the runtime tests wait for epoch signals.)"""
        idx = torch.tensor([PAD_HEADER_WORDS + s for s in slots], dtype=torch.int64)
        torch.ops.torchrec_pgas.wait(
            pad.words, idx.to(self.device, non_blocking=True), value, int(timeout_s * 1e9), self._status
        )
        self._last_wait = (pad, what, value)

    def check(self) -> None:
        """Raise a device-reported timeout or peer abort (call after a stream sync)."""
        code = int(self._status[0])
        if code == 0:
            return
        pad, what, epoch = self._last_wait
        self._status.zero_()
        if code == DeviceStatus.PEER_ABORT:
            rank, msg = decode_abort(pad.words[:PAD_HEADER_WORDS].cpu())
            raise PgasPeerAbortError(f"rank {rank} aborted '{pad.name}': {msg}")
        raise PgasTimeoutError(
            f"rank {self.rank} timed out on '{pad.name}' waiting for {what} (epoch {epoch}, "
            f"slot {int(self._status[1])})"
        )

    def abort(self, pad: SignalPad, reason: str, step: int) -> None:
        abort_pes(pad, self.rank, reason, step, range(self.world_size), self.device)

    def barrier(self) -> None:
        torch.ops.torchrec_pgas.barrier_all()

    def finalize(self) -> None:
        torch.cuda.synchronize(self.device)
        for buf in reversed(self._allocs):
            torch.ops.torchrec_pgas.free(buf)
        self._allocs.clear()
        super().finalize()
        torch.ops.torchrec_pgas.finalize()


def abort_pes(pad: SignalPad, rank: int, reason: str, step: int, pes: Sequence[int], device: torch.device) -> None:
    """``rank``'s abort of ``step`` into ``pad`` on every PE of ``pes``: the reason first, then the abort word (a
    put completes before the signal that follows it)."""
    word, msg = encode_abort(rank, reason, step)
    header = torch.cat([torch.tensor([word]), msg]).to(device)
    for pe in pes:
        torch.ops.torchrec_pgas.put(pad.words[PadWord.ABORT_MESSAGE:PAD_HEADER_WORDS], header[1:], pe)
        torch.ops.torchrec_pgas.signal(pad.words[PadWord.ABORT:PadWord.ABORT + 1], word, pe)
