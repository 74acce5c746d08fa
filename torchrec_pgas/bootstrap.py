"""Where a process's PGAS runtimes come from: one per (process group, backend), created on first use.

Kept apart from ``runtime.py`` (the API both backends implement) so that the backends import the API and
this module imports the backends, never the other way round.
"""

import atexit
import gc
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_pgas.nvshmem_backend import NvshmemRuntime
from torchrec_pgas.runtime import PgasRuntime
from torchrec_pgas.shm_backend import ShmRuntime
from torchrec_pgas.types import PgasBackendType

_RUNTIMES: Dict[Tuple[int, str], PgasRuntime] = {}


def init_runtime(
    pg: Optional[dist.ProcessGroup] = None,
    backend: Optional[PgasBackendType] = None,
    device: Optional[torch.device] = None,
    heap_hint: int = 0,
) -> PgasRuntime:
    """Collective: the PGAS runtime of ``pg`` (default world), created on first use.

    ``backend`` defaults to ``nvshmem`` for a CUDA ``device`` and ``shm``
    otherwise. ``heap_hint``: bytes the first user will allocate, so the
    NVSHMEM heap can be sized before it exists.
    """
    pg = pg if pg is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed must be initialized before torchrec_pgas.init"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if (
            backend == PgasBackendType.NVSHMEM
        ) else torch.device("cpu")
    if backend is None:
        backend = PgasBackendType.NVSHMEM if device.type == "cuda" else PgasBackendType.SHM
    key = (id(pg), backend.value)  # the runtime holds ``pg``, so the id stays unique
    if key not in _RUNTIMES:
        if backend == PgasBackendType.SHM:
            _RUNTIMES[key] = ShmRuntime(pg, device)
        else:
            _RUNTIMES[key] = NvshmemRuntime(pg, device, heap_hint)
    return _RUNTIMES[key]


def finalize_all() -> None:
    """Collective: release every runtime of this process."""
    while _RUNTIMES:
        _, rt = _RUNTIMES.popitem()
        rt.finalize()


def _finalize_local() -> None:
    """Release the runtimes whose teardown is local (shm); NVSHMEM's is collective and would hang behind a
    rank that already died."""
    for key, rt in list(_RUNTIMES.items()):
        if rt.finalize_at_exit:
            del _RUNTIMES[key]
            rt.finalize()


def shutdown() -> None:
    """Local: ``dist.destroy_process_group()``, made to destroy the group now. Call it instead, at the end.

    A runtime holds its process group, and so does a model that is gone but not yet collected (TorchRec's
    sharded modules form reference cycles): either would keep gloo's group, with its worker and transport
    threads, alive past ``destroy_process_group``, to be torn down by the last garbage collection of
    interpreter teardown, after Python has begun finalizing: where ranks were seen to die at exit now and then
    (SIGABRT, "terminate called without an active exception"). So: collect (dead models let go of the shm
    segments), release the runtimes that finalize locally, destroy, all while Python is whole. Still keeping
    the group: a model still referenced (drop it first), and ``torch.distributed.optim`` when first imported
    after init_process_group (a default argument of its ZeroRedundancyOptimizer module; import it before).
    NVSHMEM runtimes stay, as at exit (``finalize_all`` is their collective release).
    """
    gc.collect()
    _finalize_local()
    if dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_finalize_local)
