"""What a CUDA-graph capture of a training step recorded of the PGAS steps it ran (``train_graph.py``): each
replay must move the host's step state as the eager step would. The record is the innermost capture's of this
process (a stack: captures nest, one stream captures at a time), not a model's: a capture records whatever
PGAS steps it runs."""

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, List, Optional, Sequence, Tuple

from torch import nn

from torchrec_pgas.sharding.owner_backward import storage_key
from torchrec_pgas.sharding.tickets import StepTicket
from torchrec_pgas.types import PgasError

if TYPE_CHECKING:  # types only: a step records itself
    from torchrec_pgas.sharding.step import PgasStep


@dataclass(eq=False)
class CapturedStep:
    """A sharding's step captured in a CUDA graph (``torchrec_pgas.train_graph``): what each replay must move
    on the host as the eager step would (the stage counters; with a backward, the TBEs' iteration counters
    and the hyper-parameters their update reads), and the TBE storage the graph writes through."""

    step: "PgasStep"
    tbes: Sequence[nn.Module]
    iterations: List[Optional[int]]  # the TBEs' counters as the captured step saw them
    storage: List[Tuple[int, ...]]  # the TBEs' storage addresses at the capture
    backward: bool = False


_RECORDING: List[List[CapturedStep]] = []  # the innermost capture's record (recording_captured_steps)


@contextlib.contextmanager
def recording_captured_steps() -> Iterator[List[CapturedStep]]:
    """Collect the steps captured while the context is open (a training step's CUDA-graph capture)."""
    record: List[CapturedStep] = []
    _RECORDING.append(record)
    try:
        yield record
    finally:
        _RECORDING.pop()


def record_captured_step(step: "PgasStep", tbes: Sequence[nn.Module], iterations: List[Optional[int]]) -> None:
    """Called by a lookup under capture (outside ``recording_captured_steps``: a forward-only graph, whose
    replays the caller accounts for)."""
    if _RECORDING:
        _RECORDING[-1].append(CapturedStep(step, tbes, list(iterations), [storage_key(t) for t in tbes]))


def record_captured_backward(step: "PgasStep", ticket: StepTicket) -> None:
    """Called by a step's backward under capture; outside ``recording_captured_steps`` it raises: a replay that
    nobody advances would reuse the step's host state."""
    captured = [c for c in (_RECORDING[-1] if _RECORDING else []) if c.step is step]
    if not captured:
        raise PgasError(f"{step.kind}: a training step through PGAS shardings replays only through "
                        "torchrec_pgas.CapturedTrainStep, which moves the host's step state along each replay")
    captured[-1].backward = True
