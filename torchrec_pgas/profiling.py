"""Opt-in stage timing: where a sharded forward spends its time.

The benchmark wraps steps in :func:`stage_timer` and marks stage boundaries;
the PGAS steps mark their internal boundaries (between the lookup and the
combine; in a backward, after the gradient exchange, the owner's id rebuild, the
replayed lookup and FBGEMM's backward + optimizer) through :func:`mark`, which
costs one global read when no timer is active. On CUDA a mark is an event on the current stream, so a stage's time
is what the GPU timeline spent between two marks: kernel time plus any time the
GPU waited for the host (host syncs, launch gaps), which is what a step pays.
On CPU a mark is the wall clock.

:class:`HostProfile` is the host's side: cProfile over chosen calls (a step each), reported per call, to find
which Python a host-bound step spends its time in.
"""

import contextlib
import cProfile
import os
import pstats
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


class HostProfile:
    """cProfile over the calls run inside it (``with profile: step()``, a call each), reported in microseconds a
    call: pstats prints seconds to three places, which rounds a step's functions to zero."""

    def __init__(self) -> None:
        self._profile = cProfile.Profile()
        self.calls = 0

    def __enter__(self) -> "HostProfile":
        self._profile.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.disable()
        self.calls += 1

    def table(self, header: str, top: int = 40) -> str:
        """The ``top`` functions by own time, then by cumulative time, after a ``header`` line."""
        stats = pstats.Stats(self._profile)
        entries = [(func, nc, tt, ct) for func, (_, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
        calls = max(self.calls, 1)
        out = [f"{header}; us a call"]
        for title, k in (("own time", 2), ("cumulative time", 3)):
            out.append(f"\nby {title}:\n{'calls':>7} {'own us':>9} {'cum us':>9}  function")
            for func, nc, tt, ct in sorted(entries, key=lambda e: -e[k])[:top]:
                where = f"{func[0]}:{func[1]}({func[2]})" if func[0] != "~" else func[2]
                out.append(f"{nc / calls:7.1f} {1e6 * tt / calls:9.1f} {1e6 * ct / calls:9.1f}  "
                           f"{where.replace(os.getcwd() + os.sep, '')}")
        return "\n".join(out) + "\n"
