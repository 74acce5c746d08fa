"""Opt-in stage timing: where a sharded forward spends its time.

The benchmark wraps steps in :func:`stage_timer` and marks stage boundaries;
the PGAS steps mark their internal boundaries (between the lookup and the
combine; in a backward, after the gradient exchange, the owner's id rebuild, the
replayed lookup and FBGEMM's backward + optimizer) through :func:`mark`, which
costs one global read when no timer is active. On CUDA a mark is an event on the current stream, so a stage's time
is what the GPU timeline spent between two marks: kernel time plus any time the
GPU waited for the host (host syncs, launch gaps), which is what a step pays.
On CPU a mark is the wall clock.
"""

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

_active: Optional["StageTimer"] = None


class StageTimer:
    """Named marks in stream order; ``stages()`` sums the intervals per end-mark name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: List[Tuple[str, Union[torch.cuda.Event, float]]] = []

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def stages(self) -> Dict[str, float]:
        """Milliseconds per stage, in first-seen order (synchronizes on CUDA)."""
        out: Dict[str, float] = {}
        if self.device.type == "cuda" and self._marks:
            self._marks[-1][1].synchronize()  # type: ignore[union-attr]
        for (_, start), (name, end) in zip(self._marks, self._marks[1:]):
            if isinstance(start, float):
                ms = (end - start) * 1e3  # type: ignore[operator]
            else:
                ms = start.elapsed_time(end)  # type: ignore[arg-type]
            out[name] = out.get(name, 0.0) + ms
        return out


@contextlib.contextmanager
def stage_timer(device: torch.device) -> Iterator[StageTimer]:
    """Activate a timer for the enclosed steps; the first mark should be a start mark."""
    global _active
    if _active is not None:
        raise RuntimeError("stage_timer is not reentrant")
    _active = StageTimer(device)
    try:
        yield _active
    finally:
        _active = None


def mark(name: str) -> None:
    """Record a stage boundary if a :func:`stage_timer` is active."""
    if _active is not None:
        _active.mark(name)
