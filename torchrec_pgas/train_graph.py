"""A training step through PGAS shardings captured as one CUDA graph and replayed (``CapturedTrainStep``).

With ``PgasConfig(owner_backward="pgas")`` no stage of a PGAS training step reads device memory on the
host: the forward's three kernels, the gradient exchange and the owner update take their epochs, their
failure checks and the kept ids' count from the device (``DeviceBackward.captured``). What the host
still does per step is small, and this wrapper does it outside the graph around each replay: the
shardings' stage counters, each TBE's iteration counter (checkpoints read it), and the hyper-parameters the
owner update reads from device words (the learning rate as ``fused_optimizer`` last set it on the TBE,
Adam's bias corrections). Stock TorchRec cannot capture its step: its input dist reads the splits on the
host.
"""

from typing import Any, Callable, List, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.sharding.capture import CapturedStep, recording_captured_steps
from torchrec_pgas.sharding.group import groups_of
from torchrec_pgas.sharding.owner_backward import storage_key, write_hyper
from torchrec_pgas.sharding.tbe_counters import advance_tbe_iterations, sync_tbe_iterations
from torchrec_pgas.static_kjt import StaticKJT
from torchrec_pgas.types import PgasError


class CapturedTrainStep:
    """Replays ``train_step`` (forward, loss and ``backward()`` of a model whose embedding tables are PGAS
    shardings with ``owner_backward="pgas"``; it may return the loss) as one CUDA graph.

    ``train_step`` reads its batch from static device tensors the caller refills before each call
    (``copy_kjt_``). The first ``warmup_steps`` calls run it eagerly (real training steps: they also build
    what the update caches), the next one captures it, and every call from then on replays it: one launch
    for the whole step. A learning rate changed through ``fused_optimizer`` (then ``fused_optimizer.step()``,
    as in eager training) reaches the next replay. A step refused on the device (a bad id on some rank)
    applies nothing on any rank, and its error is raised by a later call on every rank (the failing rank's
    own, its peers' ``PgasPeerAbortError``), as eager forwards raise recorded errors; its TBE iteration
    counters still count it. A replay lays out and sorts each owner's kept ids at their fixed capacity,
    W × ``max_ids_per_rank``: size ``PgasConfig.max_ids_per_rank`` to the batch.
    """

    def __init__(self, train_step: Callable[[], Any], warmup_steps: int = 2) -> None:
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps {warmup_steps}: at least one eager step must run before the capture")
        self._train_step = train_step
        self._warmup_left = warmup_steps
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._captured: List[CapturedStep] = []
        self._loss: Any = None
        self._launches = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def launches(self) -> int:
        """The graph's launches so far: a call that raised a recorded error after its launch still trained."""
        return self._launches

    def __call__(self) -> Any:
        """One training step on the static inputs' current contents; returns what ``train_step`` returned
        (for a replay: the captured step's output tensors, overwritten by the next replay)."""
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return self._train_step()
        if self._graph is None:
            self._capture()  # the capture's host side is the first replay's
        else:
            self._check_storage()
            for c in self._captured:
                c.step.replayed()
                c.iterations = advance_tbe_iterations(c.tbes)
        for c in self._captured:
            for tbe, iteration in zip(c.tbes, c.iterations):
                write_hyper(tbe, iteration)
        assert self._graph is not None
        self._graph.replay()
        self._launches += 1
        for c in self._captured:
            sync_tbe_iterations(c.tbes, c.iterations)  # the device counters, as an eager step leaves them
        for group in groups_of(c.step for c in self._captured):
            group.raise_recorded()  # an earlier replay's refused step (no sync: the records are pinned)
        return self._loss

    def _check_storage(self) -> None:
        """The graph writes through the addresses of the capture: raise, before the replay, where a TBE's
        weights or optimizer state moved since (``load_state_dict(assign=True)``, ``.to()``)."""
        for c in self._captured:
            if [storage_key(t) for t in c.tbes] != c.storage:
                raise PgasError(f"CapturedTrainStep: the storage of {c.step.kind}'s tables moved since the "
                                "capture; build a new CapturedTrainStep")

    def _capture(self) -> None:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with recording_captured_steps() as captured:
                with torch.cuda.graph(graph):
                    self._loss = self._train_step()
        except Exception as e:  # the shardings' host state moved for a step their devices never ran
            raise PgasError(f"CapturedTrainStep: the capture failed ({e}); the model's PGAS shardings are now a "
                            "step ahead of their devices: reload or rebuild the model before using it") from e
        if not any(c.backward for c in captured):
            raise PgasError("CapturedTrainStep: the step ran no backward through a PGAS sharding; capture it "
                            "with torch.cuda.graph directly")
        self._graph, self._captured = graph, captured


def copy_kjt_(static: KeyedJaggedTensor, batch: KeyedJaggedTensor) -> None:
    """Refill a captured step's input KJT with ``batch``: the same keys, batch size, id count per key and
    weights or none (a captured graph reads fixed shapes; the ids and the bags' lengths within a key may
    change); into a ``StaticKJT``, any id counts up to its capacity (a batch past it raises
    ``PgasCapacityError`` here, before the replay: raise it on every rank, or its peers' replays wait for this
    rank until ``PgasConfig.wait_timeout_s``). Pass CPU batches, or device ones whose ``length_per_key`` is
    known, to copy without a sync."""
    if isinstance(static, StaticKJT):
        static.fill_(batch)
        return
    same = (static.keys() == batch.keys() and static.stride() == batch.stride()
            and static.values().numel() == batch.values().numel()
            and (static.weights_or_none() is None) == (batch.weights_or_none() is None))
    # per-key counts: a host sync for a device KJT that has not computed them
    same = same and static.length_per_key() == batch.length_per_key()
    if not same:
        raise PgasError(
            f"copy_kjt_: a batch of keys {batch.keys()}, batch size {batch.stride()}, "
            f"{batch.values().numel()} ids does not fit the captured one (keys {static.keys()}, batch size "
            f"{static.stride()}, {static.values().numel()} ids, the same count per key, weights alike)")
    static.values().copy_(batch.values(), non_blocking=True)
    static.lengths().copy_(batch.lengths(), non_blocking=True)
    static.offsets().copy_(batch.offsets(), non_blocking=True)
    if batch.weights_or_none() is not None:
        static.weights().copy_(batch.weights(), non_blocking=True)
