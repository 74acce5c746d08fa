"""The PGAS shardings of one model: what one's failed step must tell the others.

An exception in one sharding's forward ends the model's whole forward, and one in its backward the whole
backward, so the model's other PGAS shardings whose stages of that step had not run never will: they give the
step up too (``forward_failed``, ``give_up_backward``), and so every sharding of the model runs each step at
the same epoch. That lets the step's waits share one deadline, the group leader's (its first member: the
model's first PGAS sharding), in every EBC of the model. Which shardings belong together is the model's
business, not the process's: two models trained in one process, their steps interleaved, share epochs but not
backwards. The group is the sharder's (``PgasEmbeddingBagCollectionSharder``: DMP shards every module of a
model through the one sharder it is given), so it spans a model's EBCs; give each model its own sharder.
"""

import collections
import weakref
from typing import Callable, Deque, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

from torchrec_pgas.sharding.deferred_checks import DeferredCheck, DeferredChecks, refuses
from torchrec_pgas.sharding.tbe_counters import StockForwardCounters, sync_tbe_iterations, undo_tbe_iterations
from torchrec_pgas.sharding.tickets import AwaitedBackwards, StepTicket
from torchrec_pgas.types import PgasError, PgasPeerAbortError, PgasTimeoutError


class GroupMember(Protocol):
    """What a group needs of a sharding's step (``PgasStep``)."""

    kind: str
    group: "StepGroup"
    backwards: AwaitedBackwards

    issued: int

    def fail(self, err: PgasError, epoch: int) -> PgasError: ...

    def earliest_recorded(self) -> Optional[int]: ...

    def take_recorded(self, epoch: int) -> Optional[PgasError]: ...

    def step_failure(self, epoch: int) -> Optional[PgasError]: ...

    def abandon_backward(self, epoch: int) -> None: ...

    def consume_failed_step(self, epoch: int, err: PgasError) -> None: ...

    def share_deadlines(self, leader: "GroupMember") -> None: ...

    def sync_forward(self, epoch: int) -> None: ...


def first_cause(errors: Iterable[Optional[PgasError]]) -> Optional[PgasError]:
    """Of one step's errors in the model's sharding order, the one that stands for the step: a rank's own failure
    before a timeout, a timeout before a peer's abort, the first sharding's among equals. A failure sets off
    consequences in the later shardings of the step: once a stalled peer's deadline passes in one, their waits
    of the step expire at once (one deadline a step of the model), naming whichever peer each waited for, and
    abort it; those peers then record that abort."""
    order = {PgasPeerAbortError: 2, PgasTimeoutError: 1}
    return min((e for e in errors if e is not None), key=lambda e: order.get(type(e), 0), default=None)


def groups_of(steps: Iterable[GroupMember]) -> List["StepGroup"]:
    """The groups (models) ``steps`` belong to, each once, in the order of their first step."""
    groups: List[StepGroup] = []
    for step in steps:
        if not any(g is step.group for g in groups):
            groups.append(step.group)
    return groups


class StepGroup:
    """The PGAS steps of one model (weakly held: a group never keeps a sharded module alive)."""

    def __init__(self) -> None:
        self._refs: List["weakref.ref[GroupMember]"] = []  # in joining order: the first live one leads
        self._stock: List["weakref.ref[StockForwardCounters]"] = []  # the model's stock-sharded TBEs' counters
        self._agreed_whole = 0  # the last step the ranks agreed no rank failed (``refuse_failed_step``)
        self._raised: Deque[int] = collections.deque(maxlen=8)  # the last steps ``raise_recorded`` raised
        self.deferred = DeferredChecks(self.settle_checks)  # backward checks run at the end of the backward

    def __reduce__(self) -> Tuple[type, Tuple[()]]:
        """A copied or pickled group (of a copied or pickled sharder) is a new, empty one: steps belong to the
        model they were sharded for."""
        return (StepGroup, ())

    def members(self) -> List[GroupMember]:
        """The live steps of the group, in joining order."""
        return [step for step in (ref() for ref in self._refs) if step is not None]

    def join(self, steps: Iterable[GroupMember]) -> None:
        """Make ``steps`` members of this group, leaving the group each was in; every member then waits
        against the leader's deadlines."""
        if not self.members():  # a new model (a sharder reused): its epochs start again
            self._raised.clear()
        for step in steps:
            if any(member is step for member in self.members()):
                continue
            step.group._leave(step)
            step.group = self
            self._refs.append(weakref.ref(step))
        members = self.members()
        for step in members[1:]:  # a step alone keeps its own (the one a step starts with)
            step.share_deadlines(members[0])

    def count_stock_forwards(self, counters: StockForwardCounters) -> None:
        """A module of the model holds stock shardings: a step the model refuses puts back their TBEs'
        iteration counters too, as stock without the step leaves them."""
        self._stock = [ref for ref in self._stock if ref() is not None and ref() is not counters]
        self._stock.append(weakref.ref(counters))

    def _undo_stock_forwards(self, epoch: int) -> None:
        for counters in (ref() for ref in self._stock):
            if counters is not None:
                counters.undo(epoch)

    def _leave(self, step: GroupMember) -> None:
        self._refs = [ref for ref in self._refs if ref() is not None and ref() is not step]

    def raise_records(self, step: GroupMember) -> None:
        """Raise the finished steps' recorded errors of every sharding of the model (GPUs record them), but only
        before the model's first index dist of a step: once another sharding has claimed the next epoch, ``step``
        must claim it too (raising here would leave it an epoch behind); the records wait for the next step's
        first index dist."""
        if any(m.issued > step.issued for m in self.members()):
            return
        self.raise_recorded()

    def raise_recorded(self) -> None:
        """Raise what the model's shardings recorded for finished steps (no sync), the earliest step first: its
        records consumed in every sharding, the first cause standing for them (a step refused in several shardings
        records it in each: raising one would leave the others to fail a later, good step); a later step's records
        wait for the next call. A sharding's record of a step already raised, seen late (each sharding publishes
        its record at its own stage of the step), is consumed silently; a warning's record warns; a sharding whose
        step waits for its backward keeps its record (the backward raises it, and the ranks agree on it)."""
        members = self.members()
        taken: Set[int] = set()  # the steps this call took: a record no member consumes is not spun on
        while True:
            epoch = min((e for e in (m.earliest_recorded() for m in members) if e is not None), default=None)
            if epoch is None or epoch in taken:
                return
            taken.add(epoch)
            errors = [m.take_recorded(epoch) for m in members]
            cause = None if epoch in self._raised else first_cause(errors)
            if cause is not None:
                self._raised.append(epoch)
                try:
                    raise cause
                finally:  # else the traceback's frames (this one's locals: the errors) and the exception form a
                    del cause, errors  # cycle that keeps the caller's tensors alive until a garbage collection

    def forward_failed(self, step: GroupMember, epoch: int, err: PgasError) -> None:
        """``step`` raised ``err`` for step ``epoch`` in the model's forward, which ends that forward on every
        rank (the failing rank raises its error, the peers the abort): every other step of the model consumes
        step ``epoch`` too, whichever of its stages had run, so that all of them run the next batch at the next
        epoch on every rank."""
        for other in self.members():
            if other is not step:
                other.consume_failed_step(epoch, err)
        self._undo_stock_forwards(epoch)

    def siblings_awaiting(self, step: GroupMember, epoch: int) -> List[Tuple[GroupMember, StepTicket]]:
        """The group's other steps whose step ``epoch`` still awaits its backward, with that step's ticket (the
        shardings of one model run each step at the same epoch: ``forward_failed``)."""
        pairs = [(other, other.backwards.ticket(epoch)) for other in self.members() if other is not step]
        return [(other, ticket) for other, ticket in pairs if ticket is not None]

    def deferred_siblings(self, step: GroupMember, epoch: int) -> List[GroupMember]:
        """The group's other steps whose backward of step ``epoch`` ran and whose check waits for the end of the
        autograd backward (``DeferredChecks``)."""
        return [other for other in self.members() if other is not step and self.deferred.pending(other, epoch)]

    def refused_on_host(self, step: GroupMember, epoch: int) -> bool:
        """Whether another sharding's deferred check of step ``epoch``, read on the host already, refused it."""
        known = (self.deferred.known(other, epoch) for other in self.deferred_siblings(step, epoch))
        return any(r is not None and refuses(r) for r in known)

    def settle_checks(self, checks: Sequence[DeferredCheck]) -> Optional[PgasError]:
        """A backward's deferred checks, each step's in the model's sharding order (as ``step_error`` reads them):
        a step applied everywhere counts its TBEs' iterations; a refused one puts every sharding's counters back
        and is given up in the model (``give_up_backward``, as a sharding's backward that raised would). Returns
        the earliest refused step's error: its cause first (``first_cause``: among equals the model's first
        sharding's, not the first node's: a stalled peer's timeout in the first sharding, not the consequences a
        later one recorded), a failure here that no sharding recorded after every recorded cause."""
        first: Optional[PgasError] = None
        members = self.members()
        order = {id(m): i for i, m in enumerate(members)}  # the model's sharding order, not the nodes'
        for epoch in sorted({c.ticket.epoch for c in checks}):
            of_step = sorted((c for c in checks if c.ticket.epoch == epoch),
                             key=lambda c: order.get(id(c.owner), len(members)))
            refusals = [c.refusal() for c in of_step]
            cause = first_cause(err for err, _ in refusals)
            if cause is None:
                cause = next((c.failed_here() for c, (_, failed) in zip(of_step, refusals) if failed), None)
            if cause is None:
                for c in of_step:
                    sync_tbe_iterations(c.ticket.tbes, c.ticket.tbe_iters)
                continue
            for c in of_step:
                undo_tbe_iterations(c.ticket.tbes, c.ticket.tbe_iters)
            self.give_up_backward(of_step[0].owner, of_step[0].ticket, cause)
            first = first or cause
        return first

    def step_error(self, step: GroupMember, epoch: int, own: Optional[PgasError]) -> Optional[PgasError]:
        """Step ``epoch``'s error for the model, as ``step``'s backward raises it: ``own`` (``step``'s, or None)
        and the errors of the step in the other shardings whose backward of it has not run yet (then no sharding
        of the model may apply the step) or whose check of it is deferred (unless ``step``'s is: the deferred
        checks are then settled together, ``settle_checks``), its cause first (``first_cause``). Every rank
        records a failed step (the failing rank its error, the others the abort), so every rank refuses alike.
        The siblings' records are consumed (none raises the step again later) and the TBE counters of those
        awaiting their backward go back as their own backwards would put them."""
        awaiting = dict((id(other), ticket) for other, ticket in self.siblings_awaiting(step, epoch))
        deferred = set() if self.deferred.pending(step, epoch) else {
            id(other) for other in self.deferred_siblings(step, epoch)}
        errors: List[Optional[PgasError]] = []
        for member in self.members():
            ticket = awaiting.get(id(member))
            if member is step:
                errors.append(own)
            elif ticket is not None:
                errors.append(member.step_failure(epoch))
                if errors[-1] is not None:
                    undo_tbe_iterations(ticket.tbes, ticket.tbe_iters)
            elif id(member) in deferred:
                errors.append(self.deferred.cause(member, epoch))
        return first_cause(errors)

    def refuse_failed_step(self, epochs: Sequence[int], first_failed_rank: Callable[[bool], int]) -> None:
        """Raise a step's error before any sharding's backward of it runs, if the step failed in the forward of
        any PGAS sharding of the model on any rank (its kernels' records, read after they ran); the step is the
        first of ``epochs`` that still awaits its backward (a module with no PGAS sharding knows only that its
        forward came after the model's step M's lookups: M or M + 1). A bad id is recorded on its own rank only,
        so the ranks agree (``first_failed_rank``: collective, whether this rank failed in, the lowest failed
        rank or -1 out): every rank raises (its own error, or the abort), and no stock-sharded table of the model
        applies the step, nor waits in its backward's collectives for a rank that refused. The step is given up
        in every sharding (records consumed, TBE counters back, slots released). The model's other modules that
        check the same step find it agreed (its forward had ended everywhere: its records were final), so a
        model step costs one sync and one all-reduce, whatever its number of modules."""
        if not self.members():  # a model with no PGAS sharding (the same on every rank: the plan's)
            return
        epoch = next((e for e in epochs if any(e in step.backwards.epochs() for step in self.members())), None)
        if epoch is not None and epoch == self._agreed_whole:  # every rank's check of it followed the same path
            return
        awaiting = [] if epoch is None else [(step, ticket) for step in self.members()
                                             for ticket in [step.backwards.ticket(epoch)] if ticket is not None]
        for step, _ in awaiting:
            step.sync_forward(epoch)  # type: ignore[arg-type]  # awaiting is empty without an epoch
        errors = [err for err in (step.step_failure(epoch) for step, _ in awaiting) if err is not None]
        failed_rank = first_failed_rank(bool(errors))
        if failed_rank < 0:
            self._agreed_whole = epoch or self._agreed_whole
            return
        if not errors:
            errors = [PgasPeerAbortError(f"rank {failed_rank} aborted step {epoch} (see its error)")]
        for step, ticket in awaiting:
            undo_tbe_iterations(ticket.tbes, ticket.tbe_iters)
            step.abandon_backward(epoch)
        if epoch is not None:
            self._undo_stock_forwards(epoch)
        raise first_cause(errors)  # type: ignore[misc]  # errors is not empty

    def give_up_backward(self, step: GroupMember, ticket: StepTicket, err: Exception) -> None:
        """``step``'s backward of ``ticket``'s step raised ``err``, which ends the model's whole backward: the
        other shardings' backwards of that step will not run either. Every sharding's counters go back, the
        siblings' records of the step are consumed (``err`` stands for the step; a record left behind would
        raise later on this rank alone) and their slots are released now, not when the step's graph is freed
        (a kept loss, or this exception's traceback until a garbage collection, holds it past the slot's next
        use). A failure of this rank's own (not a peer's abort or silence) aborts their step on the peers too,
        which may wait in them first."""
        self.deferred.settle()  # the checks of the backward's earlier nodes: this exception skips its end
        local = not isinstance(err, (PgasPeerAbortError, PgasTimeoutError))
        undo_tbe_iterations(ticket.tbes, ticket.tbe_iters)
        for other, t in self.siblings_awaiting(step, ticket.epoch):
            if local:
                other.fail(PgasError(f"{other.kind}: sharding {step.kind} failed step {ticket.epoch}'s "
                                     f"backward: {err}"), ticket.epoch)
            other.step_failure(ticket.epoch)
            undo_tbe_iterations(t.tbes, t.tbe_iters)
            other.abandon_backward(ticket.epoch)
