"""A model's backward checks deferred to the end of the autograd backward (``DeferredChecks``), with stand-in
steps and checks on CPU autograd: the check runs after every later node of the backward and its error still
leaves ``backward()``; a step's checks settle together (its recorded cause first, counters counted or put back);
a backward that raised before its end leaves its checks to ``settle``; ``DeviceBackward``'s host logic over them
(a refusal read in the node, a sibling's read refusal adopted) on a stand-in step whose device words live on the CPU.
The GPU sharding's use of it (the sources' flags read there) is in test_gpu_training.py's refusal, failed-backward
and stall tests."""

import contextlib
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import pytest
import torch

from torchrec_pgas.sharding.deferred_checks import Refusal
from torchrec_pgas.sharding.device.backward import DeviceBackward
from torchrec_pgas.sharding.group import StepGroup
from torchrec_pgas.step_abi import StateWord
from torchrec_pgas.types import PgasError, PgasInputError, PgasPeerAbortError, PgasTimeoutError

from tests.test_group import _Step


class _Check:
    """A sharding's check of one step: ``cause`` and ``failed`` are what its flags and records say, read once and
    kept, as ``FlagsCheck`` keeps them (``log``: each read)."""

    def __init__(self, step: _Step, log: List[str], cause: Optional[PgasError] = None, failed: bool = False) -> None:
        self.owner, self.ticket = step, step.tickets[-1]
        self.log, self.cause, self.failed = log, cause, failed
        self.read: Optional[Refusal] = None

    def refusal(self) -> Refusal:
        if self.read is None:
            self.log.append(f"check {self.owner.kind}")
            self.read = self.cause, self.failed
        return self.read

    def known(self) -> Optional[Refusal]:
        return self.read

    def failed_here(self) -> PgasError:
        return PgasError(f"{self.owner.kind}: step failed here")


class _Node(torch.autograd.Function):
    """An autograd node whose backward runs ``action``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.action = action
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.action()
        return grad, None


def _backward(*actions: Callable[[], None]) -> None:
    """One backward through a chain of nodes: ``actions`` run in this order (the last node applied first)."""
    x = torch.ones(2, requires_grad=True)
    y = x
    for action in reversed(actions):
        y = _Node.apply(y, action)
    y.sum().backward()


def _defers(model: StepGroup, check: _Check) -> Callable[[], None]:
    """A sharding's node: it hands its check to the model."""
    def node() -> None:
        check.log.append(f"node {check.owner.kind}")
        assert model.deferred.defer(check)
    return node


def _model(*names: str, epoch: int = 4) -> Tuple[StepGroup, List[_Step]]:
    steps = [_Step(n) for n in names]
    model = StepGroup()
    model.join(steps)
    for s in steps:
        s.await_backward(epoch)
        s.backwards.begin(s.tickets[-1])  # its backward ran
        s.tbe.iter_cpu.fill_(7)
    return model, steps


def test_a_check_runs_after_the_later_nodes_and_its_error_leaves_backward() -> None:
    """The refused step's recorded cause is raised by ``backward()`` once every node ran; its counter goes back
    and the model gives the step up."""
    model, (a,) = _model("a")
    log: List[str] = []
    check = _Check(a, log, PgasInputError("a: id 37 outside [0, 37)"), failed=True)
    with pytest.raises(PgasInputError, match="id 37"):
        _backward(_defers(model, check), lambda: log.append("mlp"))
    assert log == ["node a", "mlp", "check a"]
    assert int(a.tbe.iter_cpu) == 6 and not model.deferred.pending(a, 4)


def test_an_applied_step_counts_its_iterations_and_raises_nothing() -> None:
    model, (a, b) = _model("a", "b")
    log: List[str] = []
    checks = [_Check(a, log), _Check(b, log)]
    a.tbe.iter.fill_(3)
    _backward(_defers(model, checks[0]), _defers(model, checks[1]))
    assert log == ["node a", "node b", "check a", "check b"]
    assert int(a.tbe.iter) == 7 and int(a.tbe.iter_cpu) == 7  # the device counter as a replayed step leaves it


def test_a_steps_checks_settle_together_its_recorded_cause_first() -> None:
    """A sharding that adopted its sibling's failure fails here with no record of its own (its check runs
    first); the sibling's recorded bad id stands for the step, and both counters go back."""
    model, (w, t) = _model("webc", "ebc")
    log: List[str] = []
    bad = PgasInputError("ebc: id 37 outside [0, 37)")
    checks = [_Check(w, log, failed=True), _Check(t, log, bad, failed=True)]
    with pytest.raises(PgasInputError) as raised:
        _backward(_defers(model, checks[0]), _defers(model, checks[1]))
    assert raised.value is bad
    assert int(w.tbe.iter_cpu) == int(t.tbe.iter_cpu) == 6


def test_a_failure_here_with_no_recorded_cause_still_raises() -> None:
    model, (a,) = _model("a")
    with pytest.raises(PgasError, match="a: step failed here"):
        _backward(_defers(model, _Check(a, [], failed=True)))


def test_outside_a_backward_nothing_is_deferred() -> None:
    model, (a,) = _model("a")
    assert not model.deferred.defer(_Check(a, []))
    assert not model.deferred.pending(a, 4)


def test_a_backward_that_raised_later_leaves_its_checks_to_settle() -> None:
    """A node after the deferring one raises: autograd skips the end of the backward, the check waits, and
    ``settle`` (the model's next index dist) reads it and gives the refused step up without raising."""
    model, (a,) = _model("a")
    check = _Check(a, [], PgasPeerAbortError("rank 1 gave up"))

    def dense_fails() -> None:
        raise RuntimeError("dense layer failed")

    with pytest.raises(RuntimeError, match="dense layer"):
        _backward(_defers(model, check), dense_fails)
    assert model.deferred.pending(a, 4) and check.log == ["node a"]
    model.deferred.settle()
    assert check.log == ["node a", "check a"] and not model.deferred.pending(a, 4) and int(a.tbe.iter_cpu) == 6


def test_a_sibling_that_raises_in_its_node_names_the_deferred_ones_cause_and_settles_them() -> None:
    """Sharding c's backward raises in its node (a launch failed) after a's and b's deferred theirs: its error
    names a's recorded cause (``step_error`` reads the deferred checks), while a pending check's own
    ``step_error`` leaves the others to be settled with it; giving the step up settles both (autograd skips the
    backward's end)."""
    model, (a, b, c) = _model("a", "b", "c")
    bad = PgasInputError("a: id 37 outside [0, 37)")
    checks = [_Check(a, [], bad, failed=True), _Check(b, [], PgasPeerAbortError("rank 1 gave up"))]

    def c_node() -> None:
        assert model.step_error(a, 4, None) is None  # a's own: b's check is not read into it
        assert checks[1].read is None
        err = model.step_error(c, 4, None)
        assert err is bad
        model.give_up_backward(c, c.tickets[-1], err)
        raise err

    with pytest.raises(PgasInputError):
        _backward(_defers(model, checks[0]), _defers(model, checks[1]), c_node)
    assert all(ch.read is not None for ch in checks) and not model.deferred.pending(a, 4)
    assert [int(s.tbe.iter_cpu) for s in (a, b, c)] == [6, 6, 6]


def test_a_refusal_read_on_the_host_is_adopted_from_there() -> None:
    """A deferred check read already (a later backward of its sharding reused the flags, or a sibling's node read
    it): the model reports its refusal on the host, where its device words may hold a later step's."""
    model, (a, b) = _model("a", "b")
    refused, applied = _Check(a, [], failed=True), _Check(b, [])
    with pytest.raises(PgasError, match="a: step failed here"):
        _backward(_defers(model, refused), _defers(model, applied),
                  lambda: setattr(b, "seen", (model.refused_on_host(b, 4), model.refused_on_host(a, 4))))
    assert b.seen == (False, False)  # nothing read yet: the device words serve
    model, (a, b) = _model("a", "b")
    refused, applied = _Check(a, [], failed=True), _Check(b, [])

    def read_then_ask() -> None:
        refused.refusal()
        applied.refusal()
        b.seen = (model.refused_on_host(b, 4), model.refused_on_host(a, 4))

    with pytest.raises(PgasError, match="a: step failed here"):
        _backward(_defers(model, refused), _defers(model, applied), read_then_ask)
    assert b.seen == (True, False)


def test_a_settle_that_fails_part_way_keeps_its_checks() -> None:
    model, (a,) = _model("a")

    class _Failing(_Check):
        def refusal(self) -> Refusal:
            raise RuntimeError("CUDA error: an illegal memory access")

    check = _Failing(a, [])
    with pytest.raises(RuntimeError, match="illegal memory"):
        _backward(_defers(model, check))
    assert model.deferred.pending(a, 4)  # for the next settle


def test_among_equal_causes_the_models_first_sharding_names_the_step() -> None:
    """A stalled peer: the model's first sharding timed out naming it; the step's deadline had then passed for
    the later one, whose wait named a healthy peer. The later sharding's node runs first (autograd's order); the
    first sharding's timeout is raised (the GPU stall test named rank 2 for rank 3 when the nodes' order chose)."""
    model, (ebc, webc) = _model("ebc", "webc")
    stalled, consequence = PgasTimeoutError("waited for rank 3"), PgasTimeoutError("waited for rank 2")
    checks = [_Check(webc, [], consequence, failed=True), _Check(ebc, [], stalled, failed=True)]
    with pytest.raises(PgasTimeoutError) as raised:
        _backward(_defers(model, checks[0]), _defers(model, checks[1]))
    assert raised.value is stalled


class _DeviceStep(_Step):
    """A GPU sharding's step as its backward's host logic reads it (``DeviceBackward``): its device words on the
    CPU, and its model's siblings as ``DeviceStep`` lists them."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.rank, self.state_words = 0, torch.zeros(StateWord.STATE_WORDS, dtype=torch.int64)
        self.layout, self.errors = SimpleNamespace(num_slots=3), SimpleNamespace(gave_up={})
        self.grad_flags = torch.zeros(3, dtype=torch.int64)

    def device_siblings(self, epoch: int) -> Tuple["_DeviceStep", ...]:
        return ()

    def deferred_siblings(self, epoch: int) -> Tuple["_DeviceStep", ...]:
        deferred = self.group.deferred
        return tuple(o for o in self.group.deferred_siblings(self, epoch) if deferred.known(o, epoch) is None)


def _device_model() -> Tuple[StepGroup, List[_DeviceStep]]:
    steps = [_DeviceStep("a"), _DeviceStep("b")]
    model = StepGroup()
    model.join(steps)
    for s in steps:
        s.await_backward(4)
        s.backwards.begin(s.tickets[-1])
    return model, steps


def _failed_word(step: _DeviceStep, epoch: int) -> int:
    return int(step.state_words[StateWord.STEP_FAILED + epoch % 3])


def test_a_node_that_read_a_refusal_hands_it_to_the_end_and_applies_nothing() -> None:
    """``DeviceBackward.settle_read`` (the owner update at the count, FBGEMM's path): inside a backward a refused
    step is deferred (False: apply nothing) and raised at the end; a step not refused applies; outside a backward
    the refusal raises at once."""
    model, (a, _) = _device_model()
    backward = DeviceBackward(a)
    cause = PgasPeerAbortError("rank 1 gave up on step 4")
    answers: List[bool] = []
    with pytest.raises(PgasPeerAbortError, match="rank 1"):
        _backward(lambda: answers.extend([backward.settle_read(a.tickets[-1], (None, False)),
                                          backward.settle_read(a.tickets[-1], (cause, False))]))
    assert answers == [True, False] and int(a.tbe.iter_cpu) == 6 and not model.deferred.pending(a, 4)
    with pytest.raises(PgasError, match="a: step 4 failed on rank 0"):
        backward.settle_read(a.tickets[-1], (None, True))


def test_a_refusal_read_on_the_host_fails_the_adopting_step_on_the_device() -> None:
    """Sharding a's refusal of step 4 was read on the host (its device words may hold a later step's): b's backward
    adopts it from the host, gives up its gradients and marks its own step failed, so its check reads a's cause and
    never names this rank; a check read that accepted the step adopts nothing."""
    seen: List[Tuple[bool, int]] = []

    def b_node() -> None:
        checks[0].refusal()  # read on the host, as a node at the count reads its siblings' through step_error
        seen.append((DeviceBackward(b)._adopt_sibling_failures(4), _failed_word(b, 4)))

    for refused in (True, False):
        model, (a, b) = _device_model()
        checks = [_Check(a, [], PgasPeerAbortError("rank 1 gave up"), failed=False) if refused else _Check(a, [])]
        raised = pytest.raises(PgasPeerAbortError) if refused else contextlib.nullcontext()
        with raised:
            _backward(_defers(model, checks[0]), b_node)
    assert seen == [(True, 4), (False, 0)]
