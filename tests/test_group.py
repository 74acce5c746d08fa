"""StepGroup alone, with stand-in steps: who leads the deadlines, who consumes a failed forward, and the check a
mixed EBC runs before any backward (GPU kernels record a bad id instead of raising it in the forward; the end-to-end
case is the refusal matrix's GPU twin in test_gpu_training.py)."""

import gc
import weakref
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from torchrec_pgas.sharding.device.errors import ErrorRecords
from torchrec_pgas.sharding.group import StepGroup, first_cause
from torchrec_pgas.sharding.tickets import AwaitedBackwards, StepTicket
from torchrec_pgas.step_abi import ErrorCode
from torchrec_pgas.types import PgasError, PgasInputError, PgasPeerAbortError, PgasTimeoutError


class _Tbe(torch.nn.Module):
    def __init__(self, it: int) -> None:
        super().__init__()
        self.iter_cpu = torch.tensor(it)
        self.iter = torch.tensor(it)


class _Step:
    """A sharding's step as the group sees it; ``failure``: the error its forward recorded for ``epoch``."""

    def __init__(self, name: str, failure: Optional[PgasError] = None) -> None:
        self.kind = name
        self.group = StepGroup()
        self.group.join([self])
        self.backwards = AwaitedBackwards(name)
        self.failure = failure
        self.leader: Optional["_Step"] = None
        self.calls: List[Tuple[str, int]] = []
        self.tbe = _Tbe(7)
        self.tickets: List[StepTicket] = []  # the autograd graph's part: AwaitedBackwards holds them weakly

    def await_backward(self, epoch: int) -> None:
        self.tickets.append(StepTicket(epoch, 4, lambda kjt: kjt, [7], [self.tbe]))
        self.backwards.issue(self.tickets[-1])

    def fail(self, err: PgasError, epoch: int) -> PgasError:
        self.calls.append(("fail", epoch))
        return err

    def step_failure(self, epoch: int) -> Optional[PgasError]:
        failure, self.failure = self.failure, None
        return failure

    def abandon_backward(self, epoch: int) -> None:
        self.calls.append(("abandon", epoch))
        self.backwards.abandon(epoch)

    def consume_failed_step(self, epoch: int, err: PgasError) -> None:
        self.calls.append(("consume", epoch))

    def share_deadlines(self, leader: "_Step") -> None:
        self.leader = leader

    def sync_forward(self, epoch: int) -> None:
        self.calls.append(("sync", epoch))


def test_the_first_member_leads_the_deadlines_and_moved_steps_leave_their_group() -> None:
    a, b, c = _Step("a"), _Step("b"), _Step("c")
    module = StepGroup()
    module.join([b, c])
    assert c.leader is b and module.members() == [b, c]
    model = StepGroup()
    model.join([a])
    model.join([b, c])
    assert model.members() == [a, b, c] and module.members() == []
    assert b.leader is a and c.leader is a and a.leader is None
    assert all(s.group is model for s in (a, b, c))


def _alone(failed: bool) -> int:
    """The ranks' agreement of a one-rank job (``first_failed_rank``)."""
    return 0 if failed else -1


def test_a_failed_forward_is_consumed_by_every_other_step_of_the_model() -> None:
    a, b, c = _Step("a"), _Step("b"), _Step("c")
    model = StepGroup()
    model.join([a, b, c])
    model.forward_failed(b, 5, PgasInputError("bad id"))
    assert a.calls == [("consume", 5)] and c.calls == [("consume", 5)] and b.calls == []


def test_a_step_that_failed_in_the_forward_is_refused_before_any_backward() -> None:
    """The rank's own error wins over a peer's abort; every step awaiting the backward gives it up (its slot
    released, its TBE counter back); a step with no error anywhere passes untouched."""
    a, b, c = _Step("a", PgasPeerAbortError("rank 1 aborted")), _Step("b", PgasInputError("bad id")), _Step("c")
    model = StepGroup()
    model.join([a, b, c])
    for s in (a, b, c):
        s.await_backward(3)
        s.tbe.iter_cpu.fill_(7)
    with pytest.raises(PgasInputError, match="bad id"):
        model.refuse_failed_step((3,), _alone)
    for s in (a, b, c):
        assert s.calls == [("sync", 3), ("abandon", 3)], (s.kind, s.calls)
        assert int(s.tbe.iter_cpu) == 6 and not s.backwards.awaits(3)
        with pytest.raises(PgasError, match="step 3 was given up"):  # a retried backward applies nothing
            s.backwards.begin(s.tickets[0])
    fine = [_Step("d"), _Step("e")]
    model.join(fine)
    for s in fine:
        s.await_backward(4)
    model.refuse_failed_step((4,), _alone)
    assert all(s.calls == [("sync", 4)] and s.backwards.awaits(4) for s in fine)
    asked: List[bool] = []  # the model's next module checking step 4: agreed already, no sync, no collective
    model.refuse_failed_step((4,), lambda failed: asked.append(failed) or -1)
    assert asked == [] and all(s.calls == [("sync", 4)] for s in fine)


def test_a_step_another_rank_failed_is_refused_here_too() -> None:
    """A bad id is recorded on its own rank only: where the ranks' agreement names another rank, every step
    awaiting the backward gives the step up here as well and the abort naming that rank is raised."""
    a, b = _Step("a"), _Step("b")
    model = StepGroup()
    model.join([a, b])
    for s in (a, b):
        s.await_backward(4)
    asked = []
    with pytest.raises(PgasPeerAbortError, match="rank 1 aborted step 4"):
        model.refuse_failed_step((4,), lambda failed: asked.append(failed) or 1)
    assert asked == [False] and all(s.calls == [("sync", 4), ("abandon", 4)] for s in (a, b))


def test_an_all_stock_module_checks_the_first_of_its_candidate_steps_awaiting_its_backward() -> None:
    """An EBC with no PGAS sharding knows only that its forward came after the model's step M's lookups:
    its step is M if that still awaits its backward, else M + 1; a step none of the model awaits is not
    checked."""
    a, b = _Step("a"), _Step("b", PgasInputError("bad id"))
    model = StepGroup()
    model.join([a, b])
    for s in (a, b):
        s.await_backward(7)
    model.refuse_failed_step((5, 6), _alone)  # neither awaits: nothing checked, nothing given up
    assert a.calls == [] and b.failure is not None
    with pytest.raises(PgasInputError):
        model.refuse_failed_step((6, 7), _alone)
    assert a.calls == [("sync", 7), ("abandon", 7)] and a.backwards.epochs() == []
    StepGroup().refuse_failed_step((1, 2), _alone)  # a model without PGAS shardings: nothing to check


def test_a_step_raises_its_cause_not_the_consequences_in_later_shardings() -> None:
    """A rank stalls: the model's first sharding times out naming it; the step's deadline has then passed for
    the later shardings, whose waits expire at once, naming and aborting healthy peers (what the GPU stall
    twin raised before: "rank 2 aborted", from the second EBC, whose backward runs first). The backward raises
    the cause: an own error before a timeout before an abort, the model's first sharding among equals; every
    sibling's record of the step is consumed and its counter put back."""
    stalled, healthy = PgasTimeoutError("waited 10.0s for index data from rank 3"), PgasTimeoutError("rank 0")
    assert first_cause([PgasPeerAbortError("rank 2 aborted"), stalled, healthy]) is stalled
    bad = PgasInputError("bad id")
    assert first_cause([None, stalled, PgasPeerAbortError("x"), bad]) is bad
    assert first_cause([None, None]) is None
    a, b, c = _Step("a", stalled), _Step("b"), _Step("c", healthy)
    model = StepGroup()
    model.join([a, b, c])
    for s in (a, b, c):
        s.await_backward(9)
        s.tbe.iter_cpu.fill_(7)
    assert model.step_error(b, 9, PgasPeerAbortError("rank 2 aborted")) is stalled
    assert a.failure is None and c.failure is None  # consumed
    assert [int(s.tbe.iter_cpu) for s in (a, b, c)] == [6, 7, 6]  # b's own backward puts back its own
    assert model.step_error(b, 9, None) is None



class _Recording(_Step):
    """A GPU sharding's step as the group reads its error records (``records``: step -> error, as its kernels
    left them; ``None``: a warning's record)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.records: Dict[int, Optional[PgasError]] = {}

    def earliest_recorded(self) -> Optional[int]:
        return min(self.records, default=None)

    def take_recorded(self, epoch: int) -> Optional[PgasError]:
        return self.records.pop(epoch, None)


def _model(*names: str) -> Tuple[StepGroup, List[_Recording]]:
    steps = [_Recording(n) for n in names]
    model = StepGroup()
    model.join(steps)
    return model, steps


def _raised(model: StepGroup) -> Optional[PgasError]:
    try:
        model.raise_recorded()
    except PgasError as e:
        return e
    return None


def test_a_step_recorded_in_several_shardings_raises_once_and_each_step_in_order() -> None:
    """A step refused on the device in several shardings of a model (a replay of a batch past the capacity of
    both) records it in each: one call raises its first cause and consumes every sharding's record, so that no
    sibling's record fails the next, good step (what the GPU replay of a mixed plan raised before); records of
    different steps raise one step a call, the earliest first; a sibling's record of a step already raised,
    seen late (no sync), is consumed silently; a warning's record raises nothing."""
    corrupt, abort = PgasError("row_wise: corrupt data from rank 0 (kind 1)"), PgasPeerAbortError("rank 1 aborted")
    model, (tw, rw) = _model("table_wise", "row_wise")
    tw.records, rw.records = {5: abort}, {5: corrupt}
    assert _raised(model) is corrupt and tw.records == rw.records == {}
    assert _raised(model) is None
    bad = PgasInputError("bad id")
    tw.records, rw.records = {6: abort, 7: bad}, {7: corrupt}
    assert _raised(model) is abort and _raised(model) is bad and _raised(model) is None
    rw.records = {7: corrupt}  # step 7's record in the second sharding, published after the first was raised
    tw.records = {8: None}  # a warning
    assert _raised(model) is None and rw.records == tw.records == {}


def test_a_raised_record_keeps_no_frame_alive() -> None:
    """The raise leaves no reference cycle through its frame: what the caller held is freed at once, not at the
    next garbage collection (GPU tensors of a step)."""
    model, (step,) = _model("row_wise")
    held = torch.zeros(4)
    ref = weakref.ref(held)

    def caller(t: torch.Tensor) -> None:
        step.records = {3: PgasError("corrupt")}
        try:
            model.raise_recorded()
        except PgasError:
            pass

    gc.disable()
    try:
        caller(held)
        del held
        assert ref() is None
    finally:
        gc.enable()


class _Device(_Step):
    """A GPU sharding's step with its real error records (three slots; host memory standing in for pinned)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.errors = ErrorRecords(name, 0, 3, BoundsCheckMode.FATAL, lambda f, v: f"feature {f}: bad id {v}")

    def record(self, epoch: int, code: ErrorCode, slot: Optional[int] = None) -> None:
        self.errors.status[epoch % 3 if slot is None else slot] = torch.tensor([epoch, int(code), 1, 0, 0])

    def earliest_recorded(self) -> Optional[int]:
        return self.errors.earliest_finished(self.backwards.awaits)

    def take_recorded(self, epoch: int) -> Optional[PgasError]:
        return self.errors.take_finished(epoch, self.backwards.awaits)


@pytest.fixture
def host_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no GPU here: the records in host memory


def test_records_of_a_step_awaiting_its_backward_and_torn_records_stay(host_records: None) -> None:
    """The group's raise leaves a sharding's record of a step that waits for its backward there (its backward
    raises it, and the ranks agree on it: ``refuse_failed_step``), though a sibling that does not wait raises
    its own record of the step; it does not spin on a torn record (a slot whose step is not the slot's: the host
    cleared it while the device wrote its next record); and a new model's group raises its own steps again."""
    a, b = _Device("a"), _Device("b")
    model = StepGroup()
    model.join([a, b])
    a.await_backward(5)
    a.record(5, ErrorCode.PEER_ABORT)
    b.record(5, ErrorCode.PEER_ABORT)
    assert isinstance(_raised(model), PgasPeerAbortError)
    assert isinstance(a.errors.step_failure(5), PgasPeerAbortError)  # a's backward still finds it
    b.record(0, ErrorCode.TIMEOUT, slot=2)  # torn: step 0 in slot 2
    assert _raised(model) is None
    del a, b
    c = _Device("c")
    model.join([c])
    c.record(5, ErrorCode.PEER_ABORT)  # the new model's step 5, not the old one's
    assert isinstance(_raised(model), PgasPeerAbortError)
