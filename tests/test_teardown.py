"""Issue 43: a user's plain ``dist.destroy_process_group()`` then exit must leave no gloo group to finalization.

Gloo's group, with its worker threads, must be gone by the end of the atexit hooks (while Python is whole),
not torn down in interpreter finalization, where ranks died with SIGABRT ("terminate called without an active
exception"). The ranks here are fresh interpreters launched as by ``torchrun`` and exit as a user's script
does: drop the model, ``destroy_process_group``, return.
"""

import atexit
import os
import subprocess
import sys
import weakref
from typing import Any, Callable, List

import pytest
import torch.distributed as dist


def _gloo_threads() -> int:
    """This process's gloo worker threads."""
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)


def _report(group: Callable[[], Any]) -> None:
    """The last atexit hook (registered first): what finalization would be left with."""
    print(f"at exit: group alive {group() is not None}, gloo threads {_gloo_threads()}", file=sys.stderr, flush=True)


def _rank() -> None:
    """One rank: a PGAS-sharded model's forward, the model dropped (garbage in cycles), the plain exit."""
    import torch

    from torchrec_pgas.testing import all_tables, default_model, sample_batches, shard
    from torchrec_pgas.types import PGAS_ROW_WISE

    # Imported first: torch.distributed.nn (TorchRec imports it) takes group.WORLD as default arguments.
    dist.init_process_group("gloo")
    atexit.register(_report, weakref.ref(dist.group.WORLD))  # before torchrec_pgas's exit hook: runs after it
    model = default_model()
    pgas = shard(model, all_tables(model, PGAS_ROW_WISE), dist.group.WORLD, torch.device("cpu"))
    with torch.no_grad():
        pgas(*sample_batches(model, dist.get_rank())[0])
    del pgas
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.stacks
def test_plain_destroy_then_exit_leaves_no_gloo_group_to_finalization() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs: List[subprocess.Popen] = [
        subprocess.Popen([sys.executable, __file__], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[1] for p in procs]
    for rank, (proc, err) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0 and "terminate called" not in err, f"rank {rank}: {proc.returncode}\n{err}"
        assert "at exit: group alive False, gloo threads 0" in err, f"rank {rank}:\n{err}"


if __name__ == "__main__":
    _rank()
