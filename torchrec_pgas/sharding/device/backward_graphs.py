"""The eager backward's kernels replayed as CUDA graphs (``PgasTrainingConfig.eager_backward_graphs``): each
sharding's cache of graphs, and what the graphs of every sharding on one device share.

Process-wide on purpose: one memory pool a device (``device_graphs``), so the pool holds one capture's scratch
rather than a sharding's each, and the pinned flags a captured graph copies into, kept for the process."""

from typing import Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from torchrec_pgas.sharding.step import BackwardGraphStats

# The graphs one sharding keeps of its eager backward (batch sizes × slots × sibling sets), least recently
# replayed dropped first.
MAX_BACKWARD_GRAPHS = 12
FLAGS_UNSET = -1  # what the host writes into the pinned flags before a replay: no source flag is negative


class DeviceGraphs:
    """What the eager backwards' graphs of every sharding on one device share: one memory pool, so the pool
    holds the scratch of one capture at a time rather than a sharding's each, and the event after the last
    replay, which the next replay's stream waits on. Replays one after another never overlap, so their
    scratch may alias: the one rule that makes sharing the pool safe, kept across streams."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.done = torch.cuda.Event()  # recorded again after each replay: no event a step
        self.replays = 0

    def after_last(self, stream: torch.cuda.Stream) -> None:
        if self.replays:
            stream.wait_event(self.done)

    def replayed(self, stream: torch.cuda.Stream) -> None:
        self.done.record(stream)
        self.replays += 1


_DEVICE_GRAPHS: Dict[torch.device, DeviceGraphs] = {}
# The pinned flags a backward graph copies into, kept for the process once captured: the caching host allocator
# remembers the capture's stream for the block, and freeing the block while another capture runs on that stream
# would record its event into that capture.
_CAPTURED_FLAGS: List[torch.Tensor] = []


def device_graphs(device: torch.device) -> DeviceGraphs:
    """The graphs' shared state on ``device``, made at its first use."""
    return _DEVICE_GRAPHS.setdefault(device, DeviceGraphs())


class BackwardGraph(NamedTuple):
    """An eager backward's kernels as one CUDA graph (``BackwardReplay``, ``device/backward.py``)."""

    graph: torch.cuda.CUDAGraph  # grad_dist, await_grads, the flags to pinned memory, ``exchanged``, the update
    exchanged: torch.cuda.Event  # recorded inside the graph once the flags are on the host (external)
    grad: torch.Tensor  # the static gradient the exchange reads: [batch, dim_sum], the output dtype
    whole: torch.Tensor  # the exchange's verdict that the update reads, in the graph's pool
    siblings: Tuple[object, ...]  # the steps whose device words the exchange reads (held: their ids are the key)


class BackwardGraphCache:
    """One sharding's graphs of its eager backward, by key (batch, slot, gradient divisor, siblings' ids), valid
    for the TBEs' storage of the last eager update at capacity (which built what a capture reads: the TBEs'
    layouts and hyper-parameter words); ``failed`` once a capture was refused here (graphs are then off)."""

    def __init__(self) -> None:
        self._graphs: Dict[Hashable, BackwardGraph] = {}
        self._storage: Optional[List[Tuple[int, ...]]] = None
        self.failed = False
        self.captures = 0
        self.replays = 0

    @property
    def stats(self) -> BackwardGraphStats:
        return BackwardGraphStats(len(self._graphs), self.captures, self.replays)

    def built_for(self, storage: List[Tuple[int, ...]]) -> None:
        """An eager update at capacity ran on TBEs at ``storage``: what a capture reads exists for it."""
        self._storage = storage

    def serves(self, storage: List[Tuple[int, ...]]) -> bool:
        """Whether graphs may serve TBEs at ``storage``. Where the storage moved, every graph is dropped (they
        write through the old addresses: never again, even if they return) until ``built_for`` again."""
        if self._storage is not None and self._storage != storage:
            self._graphs.clear()
            self._storage = None
        return self._storage is not None

    def take(self, key: Hashable) -> Optional[BackwardGraph]:
        """The graph of ``key``, out of the cache until ``keep`` puts it back as the most recent."""
        return self._graphs.pop(key, None)

    def keep(self, key: Hashable, graph: BackwardGraph) -> None:
        if len(self._graphs) >= MAX_BACKWARD_GRAPHS:
            self._graphs.pop(next(iter(self._graphs)))  # the dict's order is least recent first
        self._graphs[key] = graph

    def captured(self, flags_host: torch.Tensor) -> None:
        """A capture succeeded; its pinned flags (``flags_host``) stay for the process from the first one."""
        if self.captures == 0:
            _CAPTURED_FLAGS.append(flags_host)
        self.captures += 1

    def clear(self) -> None:
        self._graphs.clear()
