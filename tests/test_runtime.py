"""Unit tests of the PGAS runtime on the shm backend (real processes, real shared memory)."""

import os
import weakref
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import torchrec_pgas
from torchrec_pgas import shm_backend
from torchrec_pgas.runtime import PAD_HEADER_WORDS, one_host
from torchrec_pgas.testing import all_tables, default_model, run_distributed, sample_batches, shard
from torchrec_pgas.types import (
    PGAS_ROW_WISE,
    PgasBackendType,
    PgasError,
    PgasPeerAbortError,
    PgasTimeoutError,
)


def _puts_signals_epochs(rank: int, world: int) -> Dict[str, object]:
    rt = torchrec_pgas.init(backend=PgasBackendType.SHM)
    assert rt.backend_type == PgasBackendType.SHM
    assert torchrec_pgas.init(backend=PgasBackendType.SHM) is rt  # one runtime per group
    buf = rt.alloc("data", 64 * world)
    again = rt.alloc("data", 64 * world)  # named, reused
    assert again is buf
    pad = rt.alloc_signals("sig", world)
    assert int(pad.words.abs().sum()) == 0  # zeroed; nobody signals before the barrier
    rt.barrier()
    out: Dict[str, object] = {}
    for epoch in (1, 2, 3):
        # Every rank writes its 16 floats into slot [rank] of every peer, then signals.
        payload = torch.full((16,), float(100 * epoch + rank))
        for peer in range(world):
            rt.put(buf, peer, rank * 64, payload)
            rt.signal(pad, peer, rank, epoch)
        rt.wait(pad, list(range(world)), epoch, timeout_s=30, what="payloads")
        got = buf.view(torch.float32, 0, 16 * world).view(world, 16)[:, 0].tolist()
        out[f"epoch{epoch}"] = got
        # Nobody may overwrite before everybody has read this epoch.
        rt.barrier()
    # A wait for an epoch no peer has reached times out, naming what it waited for.
    with pytest.raises(PgasTimeoutError, match="nothing-coming"):
        rt.wait(pad, [(rank + 1) % world], 99, timeout_s=0.2, what="nothing-coming")
    # Out-of-range puts and signals raise before touching memory.
    with pytest.raises(PgasError, match="outside symmetric buffer"):
        rt.put(buf, 0, 64 * world - 4, torch.zeros(2))
    with pytest.raises(PgasError, match="outside symmetric buffer"):
        rt.put(buf, 0, -8, torch.zeros(1))
    with pytest.raises(PgasError, match="peer rank"):
        rt.put(buf, world, 0, torch.zeros(1))
    with pytest.raises(PgasError, match="signal slot"):
        rt.signal(pad, 0, world, 1)
    with pytest.raises(PgasError, match="exists with"):
        rt.alloc("data", 8)
    rt.barrier()
    return out


@pytest.mark.stacks
@pytest.mark.parametrize("world", [2, 3])
def test_puts_signals_epochs(world: int) -> None:
    results = run_distributed(_puts_signals_epochs, world)
    for got in results:
        for epoch in (1, 2, 3):
            assert got[f"epoch{epoch}"] == [100.0 * epoch + r for r in range(world)]


def _abort_propagates(rank: int, world: int) -> List[str]:
    rt = torchrec_pgas.init()
    pad = rt.alloc_signals("abortable", world)
    if rank == 1:
        rt.abort(pad, "feature 'f' has id -3", 1)
        rt.barrier()
        rt.signal(pad, 0, 1, 2)  # step 2 runs: its signal reaches rank 0
        return ["aborted"]
    got = []
    try:
        rt.wait(pad, [1], 1, timeout_s=60, what="rank 1")
    except PgasPeerAbortError as e:
        got.append(str(e))
    rt.barrier()
    if rank == 0:  # an abort ends its step only: the next step's wait is not aborted
        rt.wait(pad, [1], 2, timeout_s=60, what="rank 1")
        got.append("step 2 ok")
    return got


def test_abort_wakes_waiting_peers_and_ends_that_step_only() -> None:
    results = run_distributed(_abort_propagates, 3)
    assert results[1] == ["aborted"]
    assert results[0][1] == "step 2 ok" and len(results[2]) == 1
    for r in (0, 2):
        assert "rank 1 aborted step 1 of 'abortable': feature 'f' has id -3" in results[r][0]


def _abort_between_the_reads(rank: int, world: int) -> str:
    """A peer gives step 1 up and signals step 2 right after this rank's wait reads the abort word (its
    stores run inside that read here): the wait must still raise the abort, not take step 2's signal for
    step 1's data."""
    rt = torchrec_pgas.init(backend=PgasBackendType.SHM)
    pad = rt.alloc_signals("interleaved", 2)
    read_abort_word = shm_backend.aborted_step

    def peer_stores_after_the_read(word: int) -> int:
        step = read_abort_word(word)
        if not int(pad.words[PAD_HEADER_WORDS + 1]):
            rt.abort(pad, "gave step 1 up", 1)  # the peer's program order: abort, then the later signal
            rt.signal(pad, rank, 1, 2)
        return step

    shm_backend.aborted_step = peer_stores_after_the_read
    try:
        rt.wait(pad, [1], 1, timeout_s=5, what="slot 1")
    except PgasPeerAbortError as e:
        return str(e)
    finally:
        shm_backend.aborted_step = read_abort_word
    return "returned"


def test_a_signal_after_an_abort_does_not_hide_it() -> None:
    assert "aborted step 1 of 'interleaved': gave step 1 up" in run_distributed(_abort_between_the_reads, 1)[0]


def _disagreeing_alloc(rank: int, world: int) -> str:
    rt = torchrec_pgas.init()
    try:
        rt.alloc(f"buf{rank}", 16)
    except PgasError as e:
        return str(e)
    return "no error"


def test_collective_alloc_must_agree() -> None:
    for msg in run_distributed(_disagreeing_alloc, 2):
        assert "disagree on a collective allocation" in msg


def _signals_are_per_source(rank: int, world: int) -> List[int]:
    rt = torchrec_pgas.init()
    pad = rt.alloc_signals("per_source", world)
    rt.signal(pad, 0, rank, 10 + rank)
    rt.barrier()
    return pad.words[PAD_HEADER_WORDS:].tolist()


def test_signals_land_in_the_source_slot() -> None:
    results = run_distributed(_signals_are_per_source, 3)
    assert results[0] == [10, 11, 12]
    assert results[1] == [0, 0, 0] and results[2] == [0, 0, 0]


def _gloo_threads() -> int:
    """This process's gloo worker threads (torch names them; 0 where a version names them otherwise)."""
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)


def _shutdown_destroys_the_group(rank: int, world: int) -> Dict[str, int]:
    """A PGAS model ran a forward and was dropped (garbage in reference cycles: collected only by a GC), and its
    shm runtime is registered: neither may keep the process group past ``shutdown``."""
    group = weakref.ref(dist.group.WORLD)
    model = default_model()
    pgas = shard(model, all_tables(model, PGAS_ROW_WISE), dist.group.WORLD, torch.device("cpu"))
    with torch.no_grad():
        pgas(*sample_batches(model, rank)[0])
    del pgas
    before = _gloo_threads()
    torchrec_pgas.shutdown()
    return {"alive": int(group() is not None), "threads_before": before, "threads_after": _gloo_threads()}


@pytest.mark.stacks
def test_shutdown_destroys_the_process_group_while_python_is_whole() -> None:
    """Else gloo's threads are joined by the interpreter's teardown, where a rank could die with SIGABRT."""
    for r in run_distributed(_shutdown_destroys_the_group, 2):
        assert r["alive"] == 0 and r["threads_after"] == 0, r


def test_a_sharding_over_ranks_on_several_hosts_is_refused_naming_table_row_wise() -> None:
    """pgas_row_wise / pgas_table_wise reach every peer by load/store: ranks on two hosts raise our message (which
    ranks live where, and the type that crosses nodes), before any peer pointer is taken."""
    one_host(["a", "a"], "pgas_row_wise")
    with pytest.raises(PgasError, match=r"pgas_table_wise needs every rank on one host.*\{'a': \[0, 1\], 'b': \[2\]\}"
                       r".*plan pgas_table_row_wise"):
        one_host(["a", "a", "b"], "pgas_table_wise")
