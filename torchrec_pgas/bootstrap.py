"""Where a process's PGAS runtimes come from: one per (process group, backend), created on first use.

Kept apart from ``runtime.py`` (the API both backends implement) so that the backends import the API and
this module imports the backends, never the other way round.
"""

import atexit
import gc
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_pgas.node_runtime import NodeRuntime
from torchrec_pgas.nvshmem_backend import NvshmemRuntime
from torchrec_pgas.runtime import PgasRuntime
from torchrec_pgas.shm_backend import ShmRuntime
from torchrec_pgas.types import PgasBackendType, PgasError

# Runtimes hold their group weakly: this registry keeps no process group alive.
_RUNTIMES: Dict[Tuple[int, str], PgasRuntime] = {}
_EXIT_HOOKED = False


def init_runtime(
    pg: Optional[dist.ProcessGroup] = None,
    backend: Optional[PgasBackendType] = None,
    device: Optional[torch.device] = None,
    heap_hint: int = 0,
) -> PgasRuntime:
    """Collective: the PGAS runtime of ``pg`` (default world), created on first use. NVSHMEM starts once a
    process, over the whole job: a smaller group (a node's) gets a view of it (``NodeRuntime``), and creating
    its first one is collective over the job.

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
    key = (id(pg), backend.value)
    stale = _RUNTIMES.get(key)
    if stale is not None and not stale.serves(pg):  # a destroyed group's runtime; ``pg`` reuses its id
        if not stale.finalize_at_exit:
            raise PgasError("a destroyed process group's NVSHMEM runtime is still up: finalize_all() first")
        del _RUNTIMES[key]
        stale.finalize()
    if key not in _RUNTIMES:
        _at_exit_once()
        if backend == PgasBackendType.SHM:
            _RUNTIMES[key] = ShmRuntime(pg, device)
        elif dist.get_world_size(pg) < dist.get_world_size():  # a node's group: a view of the one NVSHMEM world
            # every PE sizes its heap alike: a node view allocates the largest size any node asks for
            hints: List[object] = [None] * dist.get_world_size()
            dist.all_gather_object(hints, heap_hint)
            world = init_runtime(None, backend, device, max(int(h) for h in hints))  # type: ignore[call-overload]
            assert isinstance(world, NvshmemRuntime)
            _RUNTIMES[key] = NodeRuntime(world, pg)
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


def _at_exit() -> None:
    """At exit, while Python is whole: collect the dead models (TorchRec's sharded modules are cycles that hold
    the process group) and release the local runtimes. After the user's ``destroy_process_group`` that frees
    gloo's group here, joining its threads, instead of in interpreter finalization: where, presumably, a
    worker thread letting go of its last work's tensors takes the GIL and CPython ends it with
    ``pthread_exit``, whose unwinding through a noexcept destructor is ``std::terminate`` (the SIGABRT with
    "terminate called without an active exception" seen at exit of two-process CPU jobs; never reproduced on
    demand, so the mechanism is upstream's account, not our backtrace)."""
    gc.collect()
    _finalize_local()


def _at_exit_once() -> None:
    """Registered with the first runtime: atexit runs last-registered first, so it runs before the hooks of
    torch and of the modules imported before it."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_at_exit)
        _EXIT_HOOKED = True


def shutdown() -> None:
    """Local: the whole teardown now, while Python is whole: collect garbage (dead models let go of the shm
    segments), release the runtimes that finalize locally, ``dist.destroy_process_group()``.

    A user's plain ``dist.destroy_process_group()`` and exit is safe as well: runtimes hold their group weakly,
    and the exit hook registered with the first runtime collects the dead models (TorchRec's sharded modules
    form reference cycles that hold the group) before interpreter finalization, so gloo's group and its
    threads go there, not in finalization, where ranks were seen to die now and then (SIGABRT, "terminate
    called without an active exception"). What still keeps a group past its destroy: a model still referenced
    (drop it first), and ``torch.distributed.nn`` (which TorchRec imports) or ``torch.distributed.optim`` when
    first imported after init_process_group (their functions take ``group.WORLD`` as a default argument: import
    torchrec and torchrec_pgas before init_process_group). NVSHMEM runtimes stay, as at exit (``finalize_all``
    is their collective release).
    """
    _at_exit()
    if dist.is_initialized():
        dist.destroy_process_group()

