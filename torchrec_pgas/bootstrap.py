"""Where a process's PGAS runtimes come from: one per (process group, backend), created on first use.

Kept apart from ``runtime.py`` (the API both backends implement) so that the backends import the API and
this module imports the backends, never the other way round.
"""

import atexit
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


def _finalize_at_exit() -> None:
    for key, rt in list(_RUNTIMES.items()):
        if rt.finalize_at_exit:
            del _RUNTIMES[key]
            rt.finalize()


atexit.register(_finalize_at_exit)
