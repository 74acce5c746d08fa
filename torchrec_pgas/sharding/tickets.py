"""A training step's backward as autograd sees it: the ticket a step's output carries to its backward, the
autograd functions that carry it, and one sharding's steps whose output still waits for its backward."""

import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Sequence, Set

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.types import PgasError

PoolFn = Callable[[KeyedJaggedTensor], torch.Tensor]


@dataclass(eq=False)
class StepTicket:
    """What a training step keeps for its backward. The autograd graph of the step's output holds it: when
    the graph goes without a backward (an eval forward with grad enabled), the step's blocks are released
    at the next index dist."""

    epoch: int
    batch: int  # the rows the step looked up here: 0 where this rank gave it up on the host (its batch may not fit)
    pool: PoolFn  # the stock TBE-backed lookup, replayed by the owner
    tbe_iters: List[Optional[int]]  # each TBE's iteration counter as stock's forward of this step left it
    tbes: Sequence[nn.Module]
    host: Any = None  # what the host path keeps (its MEAN divisor, the sources' batches)
    done: bool = False


class BackwardRunner(Protocol):
    """What a training step's autograd node calls (``PgasStep``)."""

    def backward(self, ticket: "StepTicket", grad: torch.Tensor) -> None: ...


class StepBackward(torch.autograd.Function):
    """The autograd node of a training step's pooled output; its backward is the step's backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, out: torch.Tensor, step: BackwardRunner,  # type: ignore[override]
                ticket: StepTicket) -> torch.Tensor:
        ctx.step, ctx.ticket = step, ticket
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.step.backward(ctx.ticket, grad)
        return None, None, None, None


class NoBackward(torch.autograd.Function):
    """The output of a sharding built without what a backward needs: a backward through it raises."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, kind: str) -> torch.Tensor:  # type: ignore[override]
        ctx.kind = kind
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        raise PgasError(f"{ctx.kind} was sharded with PgasConfig(training=None), which keeps no gradient "
                        "buffers: shard it with a PgasTrainingConfig (the default) to train through it")


class AwaitedBackwards:
    """One sharding's training steps whose output still waits for its backward (the step's buffer slot holds
    what that backward reads), each with its ticket, and those whose output went without one (an eval forward
    with grad enabled: their slots are released at the next index dist)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._awaiting: Set[int] = set()
        self._tickets: "weakref.WeakValueDictionary[int, StepTicket]" = weakref.WeakValueDictionary()
        self._dropped: List[int] = []

    def issue(self, ticket: StepTicket) -> None:
        """``ticket``'s step now awaits its backward; should its graph go without one, it is dropped."""
        self._awaiting.add(ticket.epoch)
        self._tickets[ticket.epoch] = ticket
        weakref.finalize(ticket, self._dropped.append, ticket.epoch)

    def begin(self, ticket: StepTicket) -> None:
        """``ticket``'s backward starts: once only, and not after the step was given up."""
        if ticket.done:
            raise PgasError(f"{self.kind}: a second backward through step {ticket.epoch}'s output "
                            "(retain_graph): its gradients were applied by the first")
        if ticket.epoch not in self._awaiting:
            raise PgasError(f"{self.kind}: step {ticket.epoch} was given up (its error was raised by an "
                            "earlier backward through its output): nothing of it is applied")
        ticket.done = True
        self._awaiting.discard(ticket.epoch)

    def awaits(self, epoch: int) -> bool:
        return epoch in self._awaiting

    def epochs(self) -> List[int]:
        """The steps that await their backward, their output alive (not those dropped since the last claim)."""
        return [e for e in sorted(self._awaiting) if self._tickets.get(e) is not None]

    def pending(self) -> bool:
        """Whether any step awaits its backward."""
        return bool(self._awaiting)

    def ticket(self, epoch: int) -> Optional[StepTicket]:
        """The ticket of step ``epoch`` if it awaits its backward."""
        return self._tickets.get(epoch) if epoch in self._awaiting else None

    def abandon(self, epoch: int) -> bool:
        """Step ``epoch``'s backward will not run: whether it was awaited (its slot is then the caller's to
        release)."""
        awaited = epoch in self._awaiting
        self._awaiting.discard(epoch)
        return awaited

    def take_dropped(self) -> List[int]:
        """The steps whose output went without a backward since the last call."""
        dropped, self._dropped = self._dropped, []
        return dropped
