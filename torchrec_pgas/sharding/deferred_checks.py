"""A model's backward checks deferred to the end of the autograd backward.

A GPU sharding's eager backward launches its gradient exchange and its update (which applies nothing unless every
source sent its rows), then must read the sources' flags on the host to raise a refused step inside
``backward()``. Waiting for them in the sharding's autograd node would stall the host there, with only the
kernels queued before it to run on the GPU, while the rest of the model's backward (the bottom MLP's, ...) waits
to be launched. So the node hands its check to its model's ``DeferredChecks``, which runs every check of the
backward once autograd has launched all of it (a final callback of the graph task), and raises the step's error
from there: ``backward()`` still raises it, on every rank. A sharding whose backward runs after a deferred one
of the same step adopts its refusal on the device (``DeviceBackward``), as it adopts an earlier failure of the
siblings still awaiting their backward, so every sharding of a refused step applies nothing.

A node that must read the flags itself (the owner update at the count, FBGEMM's path: they sync for the id count)
hands a refused step's error over the same way instead of raising it, so every rank raises at the end of the
backward, whichever path its node took, and none stops its backward early while its peers go on.

A backward that raises elsewhere after the node never runs its final callbacks: its checks are settled at the
model's next index dist or ``check_errors`` (bookkeeping only: that backward already raised).
"""

from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch

from torchrec_pgas.sharding.tickets import StepTicket
from torchrec_pgas.types import PgasError

Refusal = Tuple[Optional[PgasError], bool]  # the cause, if known; whether the step failed on this rank


def refuses(refusal: Refusal) -> bool:
    """Whether ``refusal`` refuses its step: a cause, or a failure on this rank."""
    return refusal[0] is not None or refusal[1]


class DeferredCheck(Protocol):
    """One sharding's check of one step's backward (``FlagsCheck``)."""

    ticket: StepTicket
    owner: Any  # the sharding's step (a ``GroupMember``)

    def refusal(self) -> Refusal:
        """Wait for the step's flags, then why its gradients were not applied (once: records are consumed)."""
        ...

    def known(self) -> Optional[Refusal]:
        """The refusal if it was read (the sharding's device words may since hold a later step's), else None."""
        ...

    def failed_here(self) -> PgasError:
        """The error of a step that failed on this rank for a cause no sharding recorded."""
        ...


def backward_task() -> int:
    """The autograd graph task running on this thread: -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


Settle = Callable[[Sequence[DeferredCheck]], Optional[PgasError]]


class DeferredChecks:
    """The deferred checks of one model's backwards (``StepGroup.deferred``); ``settle`` runs a backward's
    checks and returns the error it must raise (``StepGroup.settle_checks``)."""

    def __init__(self, settle: Settle) -> None:
        self._settle = settle
        self._checks: List[Tuple[int, DeferredCheck]] = []  # (graph task, check), in the order the nodes ran

    def defer(self, check: DeferredCheck) -> bool:
        """Run ``check`` at the end of the autograd backward running it; False outside one (the caller checks
        at once)."""
        task = backward_task()
        if task < 0:
            return False
        if not any(t == task for t, _ in self._checks):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(task))
        self._checks.append((task, check))
        return True

    def pending(self, owner: Any, epoch: int) -> bool:
        """Whether ``owner``'s backward of step ``epoch`` ran and its check waits."""
        return self._find(owner, epoch) is not None

    def cause(self, owner: Any, epoch: int) -> Optional[PgasError]:
        """The recorded cause of the refusal of ``owner``'s pending check of step ``epoch``, if it was refused."""
        return self._pending(owner, epoch).refusal()[0]

    def known(self, owner: Any, epoch: int) -> Optional[Refusal]:
        """The refusal of ``owner``'s pending check of step ``epoch`` if it was read already (``DeferredCheck``)."""
        return self._pending(owner, epoch).known()

    def _find(self, owner: Any, epoch: int) -> Optional[DeferredCheck]:
        return next((c for _, c in self._checks if c.owner is owner and c.ticket.epoch == epoch), None)

    def _pending(self, owner: Any, epoch: int) -> DeferredCheck:
        check = self._find(owner, epoch)
        assert check is not None, "callers ask of a pending check only"
        return check

    def settle(self) -> None:
        """Settle the checks of backwards that raised before their end (bookkeeping, no raise). Not under a CUDA
        graph's capture (the settling syncs): the checks then wait for the next call."""
        if not self._checks or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        checks, self._checks = [c for _, c in self._checks], []
        self._settle_all(checks)

    def _finish(self, task: int) -> None:
        checks = [c for t, c in self._checks if t == task]
        self._checks = [(t, c) for t, c in self._checks if t != task]
        cause = self._settle_all(checks)
        if cause is not None:
            try:
                raise cause
            finally:  # else the traceback's frame and the exception form a cycle that keeps the step's graph
                del cause

    def _settle_all(self, checks: List[DeferredCheck]) -> Optional[PgasError]:
        """``settle`` of ``checks``; where it fails part-way, they wait for the next ``settle`` (their reads are
        kept; the bookkeeping of the steps settled before the failure runs again, harmless: a counter is put back
        only while it still holds the step's count, and the next index dist settles before the next forward)."""
        try:
            return self._settle(checks)
        except BaseException:
            self._checks[:0] = [(-1, c) for c in checks]
            raise
