"""A GPU sharding's backward (``DeviceStep.run_backward``): the gradient exchange and the owner's update, launched
eagerly, replayed as one graph (``BackwardReplay``), or captured in a training step's graph; and why a step's
gradients must not be applied (the sources' flags, this rank's records, the model's other shardings').

``grad_dist`` stores the gradient rows into the owners that served each bag, ``await_grads`` waits for this owner's
sources, the owner applies them (the owner update op, or FBGEMM's path: ``OwnerApply``) and ``release_sources``
hands the slot back. A step that failed on any rank changes no weight: its backward raises the error on every rank
instead. Where the update runs at capacity (launched or replayed), it applies nothing unless every source sent its
rows, and the host reads the sources' flags at the end of the autograd backward (``FlagsCheck``,
``DeferredChecks``), not in this sharding's node.
"""

import warnings
from typing import Any, List, Optional, Protocol, Sequence, Tuple, Union

import torch

from torchrec_pgas import profiling
from torchrec_pgas.layout import StepLayout
from torchrec_pgas.sharding.deferred_checks import Refusal, refuses
from torchrec_pgas.sharding.device.backward_graphs import (
    FLAGS_UNSET,
    BackwardGraph,
    BackwardGraphCache,
    device_graphs,
)
from torchrec_pgas.sharding.device.errors import ErrorRecords
from torchrec_pgas.sharding.device.features import FeatureOwners
from torchrec_pgas.sharding.group import GroupMember
from torchrec_pgas.sharding.kept_ids import ReceivedBlocks
from torchrec_pgas.sharding.owner_apply import OwnerApply
from torchrec_pgas.sharding.owner_backward import storage_key, write_hyper
from torchrec_pgas.sharding.step import StepSpec, gradient_divisor
from torchrec_pgas.sharding.tbe_counters import sync_tbe_iterations
from torchrec_pgas.sharding.tickets import StepTicket
from torchrec_pgas.step_abi import FeatureDesc, StateWord
from torchrec_pgas.types import OwnerBackward, PgasError, PgasPeerAbortError, PgasTimeoutError


class BackwardStep(GroupMember, Protocol):
    """What a GPU sharding's backward reads of its step (``DeviceStep``): the stage state its kernels share, the
    step's records, and the model's other GPU shardings awaiting the same step's backward."""

    spec: StepSpec
    layout: StepLayout
    rank: int
    world_size: int
    device: torch.device
    looked_up: int
    owner_apply: OwnerApply
    received: ReceivedBlocks
    owners: FeatureOwners
    descs: List[FeatureDesc]
    errors: ErrorRecords
    state_words: torch.Tensor
    grad_flags: torch.Tensor
    grad_flags_host: torch.Tensor
    batch_words: torch.Tensor

    @property
    def lookup_features(self) -> Tuple[int, int]: ...

    def state_args(self) -> Tuple[torch.Tensor, ...]: ...

    def release(self, epoch: int) -> None: ...

    def device_siblings(self, epoch: int) -> Tuple["BackwardStep", ...]: ...

    def deferred_siblings(self, epoch: int) -> Tuple["BackwardStep", ...]: ...


def _failed_word(step: BackwardStep, epoch: int) -> torch.Tensor:
    """The device word of ``step`` that holds the epoch of the last failed step in ``epoch``'s slot."""
    return step.state_words[StateWord.STEP_FAILED + epoch % step.layout.num_slots]


def last_lookup_failed(step: BackwardStep) -> torch.Tensor:
    """Whether the step of ``step``'s last lookup failed there: a one-element device bool (no host read)."""
    epoch = step.state_words[StateWord.CTR_LOOKUP]
    return step.state_words.index_select(0, (StateWord.STEP_FAILED + epoch % step.layout.num_slots).view(1)).eq(epoch)


def last_training_step_refused(step: BackwardStep) -> torch.Tensor:
    """Whether ``step``'s last training step was refused on any rank, after its backward: a one-element device bool
    (no host read). Its lookup failed here, or a source's gradients did not come: a peer whose own batch failed
    (a bad id) after this rank's forward passed gives its gradients up, and this owner then applies none."""
    return last_lookup_failed(step) | (step.grad_flags != 0).any().view(1)


def _refused_here(step: BackwardStep, epoch: int) -> torch.Tensor:
    """Whether ``step``'s backward of step ``epoch``, which ran last, applied nothing: its own step failed here or
    a source's flag refused it (one-element device bool, no host read)."""
    return _failed_word(step, epoch).eq(epoch).view(1) | (step.grad_flags != 0).any().view(1)


class FlagsCheck:
    """The host's check of one eager backward at capacity (a ``DeferredCheck``): once ``exchanged`` (an event after
    the sources' flags were copied to the host) has passed, why the step's gradients were not applied, if they
    were not (read once: it consumes records). A replayed backward (``stream``: its stream) fills the host flags
    before the replay: where one still holds the fill, the event did not wait (the CUDA docs imply that a graph's
    event is armed by each launch rather than promise it; the drivers we ran do), and the stream's sync does."""

    def __init__(self, backward: "DeviceBackward", ticket: StepTicket, exchanged: Optional[torch.cuda.Event],
                 stream: Optional[torch.cuda.Stream], refusal: Optional[Refusal] = None) -> None:
        """``refusal``: read already (in a node that synced), where ``exchanged`` is None."""
        self.backward = backward
        self.owner = backward.step
        self.ticket = ticket
        self.exchanged = exchanged
        self.stream = stream
        self._refusal = refusal

    def refusal(self) -> Refusal:
        if self._refusal is None:
            self._wait()
            self._refusal = self.backward.refusal(self.ticket.epoch)
        return self._refusal

    def known(self) -> Optional[Refusal]:
        return self._refusal

    def failed_here(self) -> PgasError:
        return self.backward.failed_here(self.ticket.epoch)

    def _wait(self) -> None:
        assert self.exchanged is not None  # a check without an event is read when made
        self.exchanged.synchronize()
        step = self.owner
        if self.stream is not None and min(step.grad_flags_host.tolist()) == FLAGS_UNSET:
            warnings.warn(f"{step.kind}: the backward graph's event returned before its flags copy ran; waiting for "
                          "the stream instead (the update too)")
            self.stream.synchronize()


class DeviceBackward:
    """The backward of one GPU sharding's training steps (``step``: its stage state and records)."""

    def __init__(self, step: BackwardStep) -> None:
        self.step = step
        self.grad_sent = 0  # the last step whose gradient (or give-up) grad_dist sent
        self.replay = BackwardReplay(self)  # eager backwards replayed as CUDA graphs
        self._unread: Optional[FlagsCheck] = None  # the last deferred check: the next backward reuses its flags

    def check(self, ticket: StepTicket, exchanged: torch.cuda.Event, stream: Optional[torch.cuda.Stream]) -> None:
        """The host's check of ``ticket``'s step (``FlagsCheck``): at the end of the autograd backward running
        it (``DeferredChecks``), or now outside one."""
        check = FlagsCheck(self, ticket, exchanged, stream)
        if self.step.group.deferred.defer(check):
            self._unread = check
            return
        if self.settle_read(ticket, check.refusal()):
            sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)

    def settle_read(self, ticket: StepTicket, refusal: Refusal) -> bool:
        """A refusal this node read itself (after its sync): whether the step's gradients may be applied. A refused
        step's error goes to the end of the autograd backward with the deferred checks (every rank raises there,
        whichever path its node took), or is raised now outside one."""
        if not refuses(refusal):
            return True
        check = FlagsCheck(self, ticket, None, None, refusal)
        if not self.step.group.deferred.defer(check):
            self._raise(refusal[0] or check.failed_here())
        return False

    def run(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """The eager backward of ``ticket``'s step: exchange, then update (launched, or one graph replay)."""
        step, epoch = self.step, ticket.epoch
        if self._unread is not None:  # read its flags before this backward's copy replaces them
            self._unread.refusal()
            self._unread = None
        try:
            self._exchange_and_apply(ticket, grad)
        except PgasError:
            raise
        except RuntimeError as e:  # an op refused or failed to launch: peers must not wait for this rank
            if self.grad_sent != epoch:  # their await_grads reads the grad signal only: say this rank gave up
                empty = torch.empty(0, step.layout.dim_sum, dtype=step.spec.out_dtype, device=step.device)
                torch.ops.torchrec_pgas.grad_dist(empty, *step.state_args(), epoch, 0,
                                                  gradient_divisor(step.world_size), True)
            raise step.fail(PgasError(f"{step.kind} backward of step {epoch} failed: {e}"), epoch) from e
        finally:
            step.release(epoch)

    def _exchange_and_apply(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        if self.replay.serves(ticket) and self.replay.replay(ticket, grad):
            return
        step, epoch = self.step, ticket.epoch
        ops, lay = torch.ops.torchrec_pgas, step.layout
        slot = epoch % lay.num_slots
        args = step.state_args()
        # Given up here, it sends nothing (its batch may not fit the buffers; ticket.batch is 0) and says so. The
        # record may be gone: a sibling's check of the step, read on the host, consumed it (then the sibling's
        # refusal gives the step up here: _adopt_sibling_failures).
        gave_up = epoch in step.errors.gave_up
        batch = ticket.batch
        sibling_gave_up = self._adopt_sibling_failures(epoch)
        ops.grad_dist(self.sent_gradient(grad, batch), *args, epoch, batch, gradient_divisor(step.world_size),
                      gave_up or sibling_gave_up)
        self.grad_sent = epoch
        ops.await_grads(*args, step.grad_flags, epoch)
        profiling.mark("grad_exchange")
        whole = (step.grad_flags == 0).all()
        step.grad_flags_host.copy_(step.grad_flags, non_blocking=True)
        # Row-wise sources all feed this rank's batch (checked by the lookup); table-wise ones their own.
        rows = lay.max_batch if step.owners.variable_batch else batch
        with step.owner_apply.applying(ticket.tbes):
            self._apply(ticket, slot, rows, whole, gave_up)

    def _apply(self, ticket: StepTicket, slot: int, rows: int, whole: torch.Tensor, gave_up: bool) -> None:
        """The owner update op at capacity where it serves (launched before the sources' flags are read, it applies
        nothing unless ``whole``: the host reads them later, ``check``), else at the count: the op's where it
        serves, else the kept ids as a KJT for FBGEMM's replay or the reference."""
        step, epoch = self.step, ticket.epoch
        f_lo, f_hi = step.lookup_features
        if f_hi > f_lo and rows > 0 and not gave_up and step.owner_apply.op_serves(ticket):
            at_count = not step.owner_apply.at_capacity(ticket)
            exchanged = None if at_count else torch.cuda.current_stream(step.device).record_event()
            if self.update_held(ticket, slot, rows, whole, ticket.tbe_iters, at_count):
                if exchanged is None:  # at the count: after its sync
                    if self.settle_read(ticket, self.refusal(epoch)):
                        sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)
                    else:
                        step.owner_apply.applies_nothing()
                    return
                if step.owner_apply.training.eager_backward_graphs:  # the TBEs' layouts and hyper-parameter words
                    self.replay.cache.built_for([storage_key(t) for t in ticket.tbes])
                self.check(ticket, exchanged, None)
                return
        self._count_and_apply(ticket, slot, rows, whole)

    def _count_and_apply(self, ticket: StepTicket, slot: int, rows: int, whole: torch.Tensor) -> None:
        """The kept ids as a KJT of their exact count (the one host sync), then FBGEMM's replay or the
        reference."""
        step = self.step
        f_lo, f_hi = step.lookup_features
        batches = self._kept_batches(slot)
        kjt = step.received.kept_ids(ticket.epoch, rows, (f_lo, f_hi - f_lo, step.layout.num_features), batches, whole)
        profiling.mark("kept_ids")
        if not self.settle_read(ticket, self.refusal(ticket.epoch)):  # after the sync
            step.owner_apply.applies_nothing()
            return
        if f_hi > f_lo:
            grads = step.received.kept_grads(slot, rows, self._held_columns(), step.spec.out_dtype)
            step.owner_apply.apply_at_count(ticket, kjt, grads)

    @staticmethod
    def _raise(problem: Optional[PgasError]) -> None:
        if problem is not None:
            try:
                raise problem
            finally:  # else the traceback holds this frame and the frame the exception: a cycle that keeps the
                del problem  # step's graph and its GPU tensors alive until a garbage collection

    def refusal(self, epoch: int) -> Refusal:
        """Why step ``epoch``'s gradients must not be applied (after a sync past the exchange: every sharding's
        records of the step are in, their combines ran before, and the sources' flags on the host), if they must not:
        this rank's failure, a peer's (its flag), or the step's failure in another sharding of the model, the
        cause first (``StepGroup.step_error``); and whether the step failed on this rank (its cause may be
        recorded by no sharding: ``failed_here``)."""
        step = self.step
        flags = step.grad_flags_host.tolist()
        if flags[step.world_size]:  # this rank's step failed: its record (or what it gave up for) says why
            return step.group.step_error(step, epoch, step.errors.own_failure(epoch)), True
        if any(flag in (1, 2) for flag in flags[:step.world_size]):
            step.errors.consume_refusal(epoch)
        return step.group.step_error(step, epoch, self._flagged_source(epoch, flags[:step.world_size])), False

    def failed_here(self, epoch: int) -> PgasError:
        step = self.step
        return PgasError(f"{step.kind}: step {epoch} failed on rank {step.rank}")

    def _flagged_source(self, epoch: int, flags: Sequence[int]) -> Optional[PgasError]:
        """The first source whose gradient flag refuses step ``epoch``: it gave the backward up (1), or this
        rank's wait for its gradients timed out (2)."""
        step = self.step
        for src, flag in enumerate(flags):
            if flag == 1:
                return PgasPeerAbortError(f"rank {src} gave up on step {epoch} of {step.kind} (see its error): "
                                          "no rank applies its gradients")
            if flag == 2:
                return PgasTimeoutError(
                    f"rank {step.rank} waited {step.spec.config.wait_timeout_s:.1f}s (the step's deadline, from its "
                    f"first wait) for the gradients of step {epoch} from rank {src}: a peer crashed, diverged, or "
                    "skipped this step's backward")
        return None

    def update_held(self, ticket: StepTicket, slot: Union[int, torch.Tensor], rows: int, whole: torch.Tensor,
                    iterations: Optional[Sequence[Optional[int]]], at_count: bool = False) -> bool:
        """``OwnerApply.update`` of the features this rank holds, their sources' batches read on the device."""
        step = self.step
        f_lo, f_hi = step.lookup_features
        return step.owner_apply.update(ticket, slot, rows, (f_lo, f_hi - f_lo, step.layout.num_features),
                                       self._held_columns(), self._kept_batches(slot), whole, iterations, at_count)

    def _kept_batches(self, slot: Union[int, torch.Tensor]) -> torch.Tensor:
        """Each source's batch from its index block's header in ``slot`` (an int, or a device tensor), on the
        device."""
        words = self.step.batch_words
        words = words[slot] if isinstance(slot, int) else words.index_select(0, slot.view(1))
        return self.step.received.buffer_as(torch.int64)[words.view(-1)]

    def captured(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """The backward under CUDA-graph capture: the same stages as :meth:`_exchange_and_apply` with nothing
        read on the host. The kernels take the step's epoch from the device (each replay's own), the kept
        ids fill a fixed capacity, and the failure check is a device word: the update applies nothing where a
        rank or a sibling sharding failed the step (every rank then refuses it; the error records raise at
        the next check). Only the owner update op can run so (FBGEMM's backward needs the id count)."""
        step = self.step
        owner_backward = step.owner_apply.training.owner_backward
        if owner_backward not in (OwnerBackward.PGAS, OwnerBackward.AUTO) or not step.owner_apply.update_covers(
                ticket.tbes):
            gap = step.owner_apply.gap or f"owner_backward={owner_backward.value!r}"
            raise PgasError(f"{step.kind}: a training step captured in a CUDA graph needs "
                            f"PgasTrainingConfig(owner_backward='pgas' or 'auto') covering every TBE ({gap}): "
                            "FBGEMM's backward reads the step's id count on the host")
        if ticket.epoch in step.errors.gave_up:
            raise step.errors.gave_up.pop(ticket.epoch)
        if ticket.epoch != step.looked_up or step.backwards.pending():  # the kernels take the last lookup's epoch
            raise PgasError(f"{step.kind}: a captured training step must run each sharding's forward once, then "
                            f"its backward (step {ticket.epoch}'s backward after lookup {step.looked_up})")
        whole = self.exchange_kernels(grad, ticket.batch, step.device_siblings(ticket.epoch), ())
        self.update_kernels(ticket, step.state_words[StateWord.CTR_LOOKUP] % step.layout.num_slots, whole)
        torch.ops.torchrec_pgas.release_sources(*step.state_args(), 0)

    def exchange_kernels(self, grad: torch.Tensor, batch: int, siblings: Sequence[BackwardStep],
                         deferred: Sequence[BackwardStep]) -> torch.Tensor:
        """The gradient exchange with nothing read on the host, for a CUDA graph (a captured training step's, or
        an eager step's: ``BackwardReplay``): the epoch is the device's last lookup's, and the failures of the
        step in ``siblings`` (awaiting their backward) and its refusals in ``deferred`` (their backward ran, its
        check deferred) fail it here too. Returns ``whole``: the device word that says every source sent its
        rows."""
        step = self.step
        ops, args, state = torch.ops.torchrec_pgas, step.state_args(), step.state_words
        epoch = state[StateWord.CTR_LOOKUP]  # the replayed step's, on the device
        if siblings or deferred:  # as _adopt_sibling_failures, from device words
            failed = torch.cat([last_lookup_failed(o) for o in siblings]
                               + [last_training_step_refused(o) for o in deferred]).any()
            at = (StateWord.STEP_FAILED + epoch % step.layout.num_slots).view(1)  # index_select, not [tensor]:
            state.index_put_((at,), torch.where(failed, epoch, state.index_select(0, at)))  # no read
        ops.grad_dist(self.sent_gradient(grad, batch), *args, 0, batch, gradient_divisor(step.world_size), False)
        ops.await_grads(*args, step.grad_flags, 0)
        return (step.grad_flags == 0).all()

    def update_kernels(self, ticket: StepTicket, slot: Union[int, torch.Tensor], whole: torch.Tensor) -> None:
        """The owner update at capacity of the ids kept in ``slot`` (an int, or the device's), applied only where
        ``whole``, for a CUDA graph: the hyper-parameters are device words written before each replay."""
        step = self.step
        f_lo, f_hi = step.lookup_features
        rows = step.layout.max_batch if step.owners.variable_batch else ticket.batch
        if f_hi > f_lo and not self.update_held(ticket, slot, rows, whole, None):
            specs = [t.embedding_specs for t in ticket.tbes]
            raise PgasError(f"{step.kind}: the owner update op does not take the TBEs {specs} (or a "
                            f"{step.spec.out_dtype} gradient): they cannot train in a CUDA graph")

    def sent_gradient(self, grad: torch.Tensor, batch: int) -> torch.Tensor:
        """The first ``batch`` rows of the output's gradient, in the output dtype, starting on 16 bytes (a view
        into its storage may not: grad_dist reads rows in 16-byte vectors)."""
        sent = grad[:batch].to(self.step.spec.out_dtype)
        return sent.clone() if sent.data_ptr() % 16 else sent

    def _held_columns(self) -> Tuple[int, int, int]:
        """The output columns of the features this rank holds (first, end) and the row width of a gradient
        block: what ``kept_grads`` reads."""
        step = self.step
        f_lo, f_hi = step.lookup_features
        descs = step.descs
        return descs[f_lo].out_col, descs[f_hi - 1].out_col + descs[f_hi - 1].dim, step.layout.dim_sum

    def _adopt_sibling_failures(self, epoch: int) -> bool:
        """Make step ``epoch`` failed here where it failed in another sharding of the model whose backward has
        not run (a device-recorded bad id is recorded on its rank only), or where another's backward that ran,
        its check deferred, applied nothing: this rank's grad dist then gives up, so every peer refuses this
        sharding's step too. Device words, no sync; True where a sibling gave the step up on the host."""
        siblings, deferred = self.step.device_siblings(epoch), self.step.deferred_siblings(epoch)
        refused_on_host = self.step.group.refused_on_host(self.step, epoch)
        if not (siblings or deferred or refused_on_host):  # the common case: the model's one sharding
            return False
        word = _failed_word(self.step, epoch)
        if refused_on_host:  # failed here, as a device adoption leaves it: its check then reads the sibling's cause
            word.fill_(epoch)
        elif siblings or deferred:
            failed = torch.cat([_failed_word(o, epoch).eq(epoch).view(1) for o in siblings]
                               + [_refused_here(o, epoch) for o in deferred]).any()
            word.copy_(torch.where(failed, epoch, word))
        return refused_on_host or any(epoch in o.errors.gave_up for o in siblings)


class BackwardReplay:
    """An eager backward's kernels replayed as one CUDA graph (``PgasTrainingConfig.eager_backward_graphs``),
    captured once per batch size, slot and sibling sets (``BackwardGraphCache``). The graph copies the sources'
    flags to the host and records an event between the exchange and the update: as on the launched path, the
    host checks them later (``DeviceBackward.check``), and raises as it does."""

    def __init__(self, backward: DeviceBackward) -> None:
        self.backward = backward
        self.cache = BackwardGraphCache()

    def serves(self, ticket: StepTicket) -> bool:
        """Whether this eager backward replays a graph: ``eager_backward_graphs`` (and no capture failed here), the
        capacity path (``OwnerApply.at_capacity``) taken since the TBEs' storage last moved (it builds what a
        capture reads), and a step whose kernels may take the device's epoch: it follows its own forward in this
        sharding and in every sibling awaiting it or deferring its check, and no sharding gave it up on the
        host."""
        step, epoch = self.backward.step, ticket.epoch
        if not step.owner_apply.training.eager_backward_graphs or self.cache.failed or step.owner_apply.choosing():
            return False
        if not (self.cache.serves([storage_key(t) for t in ticket.tbes])
                and epoch == step.looked_up and not step.backwards.pending() and epoch not in step.errors.gave_up
                and step.lookup_features[1] > step.lookup_features[0] and step.owner_apply.at_capacity(ticket)
                and (step.owners.variable_batch or ticket.batch > 0)):  # the launched path's rows > 0
            return False
        siblings, deferred = step.device_siblings(epoch), step.deferred_siblings(epoch)
        return (len(siblings) == len(step.group.siblings_awaiting(step, epoch))
                and not step.group.refused_on_host(step, epoch)
                and all(o.looked_up == epoch and epoch not in o.errors.gave_up for o in siblings + deferred))

    def replay(self, ticket: StepTicket, grad: torch.Tensor) -> bool:
        """The backward of ``ticket``'s step as one replay; False, with nothing run, where the capture failed (the
        launched path serves)."""
        step, epoch = self.backward.step, ticket.epoch
        siblings, deferred = step.device_siblings(epoch), step.deferred_siblings(epoch)
        slot = epoch % step.layout.num_slots
        key = (ticket.batch, slot, gradient_divisor(step.world_size), tuple(sorted(id(o) for o in siblings)),
               tuple(sorted(id(o) for o in deferred)))
        graph = self.cache.take(key) or self._capture(ticket, grad, siblings, deferred, slot)
        if graph is None:
            return False
        self.cache.keep(key, graph)
        stream, shared = torch.cuda.current_stream(step.device), device_graphs(step.device)
        shared.after_last(stream)
        for tbe, iteration in zip(ticket.tbes, ticket.tbe_iters):
            write_hyper(tbe, iteration)
        graph.grad.copy_(grad[:ticket.batch])
        step.grad_flags_host.fill_(FLAGS_UNSET)  # every earlier write into them was waited for
        graph.graph.replay()
        self.backward.grad_sent = epoch
        shared.replayed(stream)
        profiling.mark("owner_update")
        self.cache.replays += 1
        self.backward.check(ticket, graph.exchanged, stream)
        return True

    def _capture(self, ticket: StepTicket, grad: torch.Tensor, siblings: Tuple[Any, ...], deferred: Tuple[Any, ...],
                 slot: int) -> Optional[BackwardGraph]:
        """The backward's graph for this step's batch, slot and sibling sets, reading the gradient from a static
        buffer, in the device's pool (``DeviceGraphs``). A capture runs nothing: where ours refuses (a
        ``PgasError`` inside a valid capture), graphs are off for this sharding (a warning says why), and None.
        A CUDA error that breaks the capture propagates: the allocator and stream are then not ours to fall back
        on."""
        backward, step = self.backward, self.backward.step
        static = backward.sent_gradient(grad, ticket.batch).clone()
        pool = device_graphs(step.device).pool
        graph, exchanged = torch.cuda.CUDAGraph(), torch.cuda.Event(external=True)
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                whole = backward.exchange_kernels(static, ticket.batch, siblings, deferred)
                step.grad_flags_host.copy_(step.grad_flags, non_blocking=True)
                exchanged.record()
                backward.update_kernels(ticket, slot, whole)
        except PgasError as e:  # nothing ran: the launched path takes this step and the next ones
            self.cache.failed = True
            warnings.warn(f"{step.kind}: eager backwards are launched, not replayed as CUDA graphs: the capture "
                          f"failed ({e})")
            return None
        self.cache.captured(step.grad_flags_host)
        return BackwardGraph(graph, exchanged, static, whole, siblings + deferred)
