"""``OwnerBackward.AUTO``: which owner backward applies a sharding's gradients on this rank, chosen by timing both.

Neither path wins everywhere: the owner update sorts and walks the kept ids (its cost follows the ids, their
skew and the row width), FBGEMM's backward re-runs a lookup and reads the id count on the host (fixed costs a
step). So a sharding's first eager backwards alternate them, each apply timed from the end of the gradient
exchange (the same for both) to the end of its update, host gaps included, and the faster median serves every
later step. On GPUs the times are CUDA events on the backward's stream, read once they have completed
(``Event.query``): the choice adds no host sync, and steps run the owner update, launched, until it is made (its
kernels are launched one by one in the trial too: an eager backward replayed as a graph saves their launch cost,
tens of microseconds, which the trial counts against it). On CPUs the apply is synchronous and timed on the host.
An apply that updates no row (no ids kept this step) is not a measure and is not counted; an apply that raises is
not counted either, and where FBGEMM's backward raises for another reason than the step's failure (it does not
train this configuration: FBGEMM 1.6's GPU Adam with fp16 weights) the owner update is chosen at once.

Each rank chooses for its own rows: its owners' ids and skew are its own, and the two paths update the same rows
alike (within the sums' rounding), so ranks may differ. A choice made from timings may differ between two runs;
``OwnerBackward.PGAS`` or ``FBGEMM`` pins it."""

import contextlib
import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from torchrec_pgas.types import OwnerBackward, PgasError

logger = logging.getLogger(__name__)

# Each path runs this many untimed backwards (first-step costs: descriptor uploads, the allocator's growth to the
# path's temporaries, which grow again with a larger step's id count) and then TIMED_TRIALS timed ones, the two
# paths alternating so that drift (clocks, the cache) falls on both alike; five timed a path, so that one late
# growth of the allocator cannot move a median. A trial's backwards are a few of a training job's thousands.
UNTIMED_TRIALS = 2
TIMED_TRIALS = 5
_PATHS = (OwnerBackward.PGAS, OwnerBackward.FBGEMM)
AUTO_TRIAL_BACKWARDS = len(_PATHS) * (UNTIMED_TRIALS + TIMED_TRIALS)  # the eager backwards a sharding's trial takes

_Timing = Union[Tuple[torch.cuda.Event, torch.cuda.Event], float]


@dataclass
class TrialApply:
    """One apply under the trial: its path, and whether it updated rows (the apply says when it did not)."""

    path: OwnerBackward
    updated: bool = True


class OwnerBackwardTrial:
    """One sharding's trial of the two owner backwards on one rank (``kind``: the sharding's, for the log)."""

    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind = kind
        self.device = device
        self._schedule = list(_PATHS) * (UNTIMED_TRIALS + TIMED_TRIALS)
        self._next = 0  # the schedule's next backward
        self._timings: Dict[OwnerBackward, List[_Timing]] = {p: [] for p in _PATHS}
        self.chosen: Optional[OwnerBackward] = None  # once every timed trial has completed
        self.medians: Dict[OwnerBackward, float] = {}  # the median apply (ms) of each path the choice compared

    def path(self) -> OwnerBackward:
        """The owner backward of the next apply: the schedule's while it lasts, then the choice (the owner update
        while the last trials' events are still in flight)."""
        if self.chosen is None and self._next >= len(self._schedule):
            self._choose()
        if self.chosen is not None:
            return self.chosen
        return self._schedule[self._next] if self._next < len(self._schedule) else OwnerBackward.PGAS

    def report(self) -> Tuple[Optional[str], Dict[str, float]]:
        """The choice's value (None while timing) and the medians it compared (ms by path value), for reports."""
        return (None if self.chosen is None else self.chosen.value,
                {path.value: ms for path, ms in self.medians.items()})

    def deciding(self) -> bool:
        """Whether backwards are still being timed."""
        return self._next < len(self._schedule)

    def settle(self, path: OwnerBackward, why: str) -> None:
        """Choose ``path`` now, ending the trial."""
        self.chosen, self._next = path, len(self._schedule)
        self._timings = {p: [] for p in _PATHS}
        warnings.warn(f"{self.kind}: owner_backward='auto' chose {path.value!r}: {why}")

    @contextlib.contextmanager
    def timed(self) -> Iterator[TrialApply]:
        """Run one apply of :meth:`path`'s backward, timed if the schedule times it and counted if it updated
        rows and did not raise (module docstring)."""
        apply, index = TrialApply(self.path()), self._next
        if not self.deciding():
            yield apply
            return
        start = self._mark()
        try:
            yield apply
        except Exception as e:
            if apply.path == OwnerBackward.FBGEMM and not isinstance(e, PgasError):
                self.settle(OwnerBackward.PGAS, f"FBGEMM's backward failed here ({e})")
            raise
        end = self._mark()
        if not apply.updated:
            return
        self._next += 1
        if index >= len(_PATHS) * UNTIMED_TRIALS:
            self._timings[apply.path].append(end - start if isinstance(start, float) else (start, end))  # type: ignore
        if not self.deciding():
            self._choose()

    def _mark(self) -> Union[torch.cuda.Event, float]:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _choose(self) -> None:
        """Choose the faster median once every timed trial has completed (no wait: a trial still in flight
        leaves the choice to a later step)."""
        medians = {}
        for path, timings in self._timings.items():
            ms: List[float] = []
            for t in timings:
                if isinstance(t, float):
                    ms.append(t * 1e3)
                elif not t[1].query():
                    return
                else:
                    ms.append(t[0].elapsed_time(t[1]))
            medians[path] = statistics.median(ms)
        self.chosen, self.medians = min(_PATHS, key=lambda p: medians[p]), medians  # the owner update on a tie
        self._timings = {p: [] for p in _PATHS}
        other = next(p for p in _PATHS if p != self.chosen)
        logger.info("%s: owner_backward='auto' chose %r (median apply %.3f ms; %r: %.3f ms)", self.kind,
                    self.chosen.value, medians[self.chosen], other.value, medians[other])
