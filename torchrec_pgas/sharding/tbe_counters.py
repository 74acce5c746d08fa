"""The TBEs' iteration counters across PGAS steps. FBGEMM's forward adds one to a TBE's counter (optimizers past
EXACT_ADAGRAD count forwards and read it, e.g. Adam's bias correction) and its backward reads it. A PGAS step
runs stock's forward on no TBE, so it moves the counters as that forward would (``advance_tbe_iterations``),
sets the device copy once its owner update ran (``sync_tbe_iterations``), puts them back for a failed step
(``undo_tbe_iterations``), and gives a replayed FBGEMM backward the counter its forward saw
(``iterations_before_forward``). A counter is None for a TBE that does not count. A model's stock-sharded TBEs
count their own forwards; a step the model refuses puts theirs back too (``StockForwardCounters``)."""

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn


@contextlib.contextmanager
def iterations_before_forward(tbes: Sequence[nn.Module], iters: Sequence[Optional[int]]) -> Iterator[None]:
    """The TBEs' iteration counters as they were before stock's forward of the replayed step (FBGEMM's
    forward adds one and hands it to the optimizer, e.g. Adam's bias correction), restored after."""
    saved = [(tbe, int(tbe.iter_cpu)) for tbe, it in zip(tbes, iters) if it is not None]
    _set_counts([(tbe, it - 1) for tbe, it in zip(tbes, iters) if it is not None])
    try:
        yield
    finally:
        _set_counts(saved)


@contextlib.contextmanager
def iterations_kept(tbes: Sequence[nn.Module]) -> Iterator[None]:
    """The TBEs' iteration counters as they were, after stock lookups that must not count: the host path runs
    one per source of a step, and a step counts once (``advance_tbe_iterations``), or not at all if it fails."""
    saved = [(tbe, int(tbe.iter_cpu)) for tbe in tbes if hasattr(tbe, "iter_cpu")]
    try:
        yield
    finally:
        _set_counts(saved)


def _set_counts(counts: Sequence[Tuple[nn.Module, int]]) -> None:
    for tbe, it in counts:
        tbe.iter_cpu.fill_(it)
        tbe.iter.fill_(it)


def advance_tbe_iterations(tbes: Sequence[nn.Module]) -> List[Optional[int]]:
    """What stock's forward does to each TBE's iteration counter (the optimizers past EXACT_ADAGRAD count
    forwards, ``no_grad`` ones too), done on the host copy only; the replay sets the device copy."""
    out: List[Optional[int]] = []
    for tbe in tbes:
        if not _counts_iterations(tbe):
            out.append(None)
            continue
        if int(tbe.iter_cpu) == 0:  # a loaded checkpoint's count, once (as FBGEMM's forward does)
            tbe.iter_cpu.fill_(int(tbe.iter.cpu()))
        out.append(int(tbe.iter_cpu.add_(1)))
    return out


def sync_tbe_iterations(tbes: Sequence[nn.Module], iters: Sequence[Optional[int]]) -> None:
    """Each counting TBE's device counter as a replayed FBGEMM step leaves it (checkpoints carry it), after an
    owner update that did not run FBGEMM's (``iters``: the step's, None for a TBE that does not count)."""
    for tbe, it in zip(tbes, iters):
        if it is not None:
            tbe.iter.fill_(int(tbe.iter_cpu))


def _counts_iterations(tbe: nn.Module) -> bool:
    return hasattr(tbe, "iter_cpu") and getattr(tbe, "optimizer", None) not in (
        EmbOptimType.NONE, EmbOptimType.EXACT_SGD, EmbOptimType.LARS_SGD, EmbOptimType.EXACT_ADAGRAD)


def undo_tbe_iterations(tbes: Sequence[nn.Module], iters: Sequence[Optional[int]]) -> None:
    """A failed step's counters back to before its forward, unless a later forward moved them."""
    for tbe, it in zip(tbes, iters):
        if it is not None and int(tbe.iter_cpu) == it:
            tbe.iter_cpu.fill_(it - 1)


def counting_tbes(module: nn.Module) -> List[nn.Module]:
    """The TBEs inside ``module`` whose forward counts iterations."""
    return [m for m in module.modules() if _counts_iterations(m)]


class StockForwardCounters:
    """The iteration counters of a module's stock-sharded TBEs as they were before its last forward, so that a
    step the model refuses (on every rank, as stock never saw it) leaves them as stock leaves them: FBGEMM's
    forward of the refused step counted it, and Adam's bias correction would read one step too many from then
    on. FBGEMM's forward moves its host and device counters together, so the host count says both (read from
    the device only where a loaded checkpoint's count is not on the host yet: once)."""

    def __init__(self, tbes: Sequence[nn.Module]) -> None:
        self._tbes = list(tbes)
        self._epochs: Tuple[int, ...] = ()
        self._before: List[int] = []

    def before_forward(self, epochs: Tuple[int, ...]) -> None:
        """The module's forward of the model's step (one of ``epochs``: a module with no PGAS sharding knows its
        step only as M or M + 1) is about to run its stock lookups."""
        self._epochs = epochs
        self._before = [int(t.iter_cpu) or int(t.iter.cpu()) for t in self._tbes]

    def undo(self, epoch: int) -> None:
        """The model refused step ``epoch``: counters its forward moved go back (not those a later forward
        moved on)."""
        if epoch not in self._epochs:
            return
        _set_counts([(tbe, count) for tbe, count in zip(self._tbes, self._before) if int(tbe.iter_cpu) == count + 1])
        self._epochs, self._before = (), []
