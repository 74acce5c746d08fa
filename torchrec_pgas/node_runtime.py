"""A node's view of the process's one NVSHMEM world (``pgas_table_row_wise`` on GPUs).

NVSHMEM starts once a process, over every rank of the job (``nvshmem_backend.NvshmemRuntime``). A node step
(``sharding/twrw_sharding.py``) runs the row-wise protocol among its node's L ranks only: its kernels address
peers through a peer table (``DeviceStep``), so the view maps node rank ``i`` to its world PE (``pe(i)``) and
nothing else changes. Symmetric allocations stay world-collective: NVSHMEM allocates the same size at the same
heap offset on every PE, so every node asks for the largest size any node needs and uses its own prefix.
Puts, signals and aborts of the reference path go to the node's PEs; waits and their errors are the world's.
"""

from typing import List, Sequence

import torch
import torch.distributed as dist

from torchrec_pgas.nvshmem_backend import NvshmemRuntime, abort_pes
from torchrec_pgas.runtime import PgasRuntime, SignalPad, SymmetricBuffer
from torchrec_pgas.types import PgasBackendType, PgasError


class NodeRuntime(PgasRuntime):
    """The ranks of ``pg`` (a node: TorchRec's intra-node group) inside ``world``'s NVSHMEM world."""

    backend_type = PgasBackendType.NVSHMEM
    finalize_at_exit = False  # the world's teardown frees what the node allocated

    def __init__(self, world: NvshmemRuntime, pg: dist.ProcessGroup) -> None:
        super().__init__(pg, world.device)
        self._world = world
        self._pes: List[int] = [dist.get_group_rank(world.pg, r) for r in dist.get_process_group_ranks(pg)]
        self.hosts = [world.hosts[pe] for pe in self._pes]
        if len(set(self.hosts)) != 1:
            raise PgasError(f"a node's ranks {dist.get_process_group_ranks(pg)} span hosts {sorted(set(self.hosts))}: "
                            "pgas_table_row_wise needs each node (the plan's local_size ranks, LOCAL_WORLD_SIZE) "
                            "on one host")

    def pe(self, peer: int) -> int:
        self._check_peer(peer)
        return self._pes[peer]

    def _alloc_bytes(self, name: str, nbytes: int) -> torch.Tensor:
        """World-collective: every rank of the job allocates ``name`` at the largest size any rank asks for."""
        asked: list = [None] * self._world.world_size
        dist.all_gather_object(asked, (name, nbytes), group=self._world.pg)
        if any(a[0] != name for a in asked):
            raise PgasError(f"ranks disagree on a collective allocation: {asked}")
        return self._world._alloc_bytes(name, max(a[1] for a in asked))[:nbytes]

    def _put_bytes(self, buf: SymmetricBuffer, peer: int, offset: int, src: torch.Tensor) -> None:
        self._world._put_bytes(buf, self._pes[peer], offset, src)

    def _signal_word(self, pad: SignalPad, peer: int, word: int, value: int) -> None:
        self._world._signal_word(pad, self._pes[peer], word, value)

    def wait(self, pad: SignalPad, slots: Sequence[int], value: int, timeout_s: float, what: str,
             step: int = 0) -> None:
        self._world.wait(pad, slots, value, timeout_s, what, step)

    def check(self) -> None:
        self._world.check()

    def abort(self, pad: SignalPad, reason: str, step: int) -> None:
        abort_pes(pad, self.rank, reason, step, self._pes, self.device)

    def barrier(self) -> None:
        """The node's ranks, on the host (NVSHMEM's barrier is the world's)."""
        torch.cuda.current_stream(self.device).synchronize()
        dist.barrier(group=self.pg)
