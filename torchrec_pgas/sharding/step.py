"""One PGAS sharding's step: what it is built from (``StepSpec``) and the state every backend shares.

A step is three stages (index dist, lookup, combine; see ``torchrec_pgas/layout.py`` for the buffer they
share), and, when it trains, a backward. ``PgasStep`` holds the symmetric buffer, the signal pad, the
host-side checks that need no device sync, the FIFO stage counters and the steps that wait for their
backward; ``HostStep`` (``host_step.py``, the ``shm`` CPU backend) and ``DeviceStep`` (``device_step.py``,
the fused kernels) run the stages. ``stages.py`` plugs a step into TorchRec's ``EmbeddingSharding`` slots.

The backward of a step (both backends): the requester's gradient of its pooled output goes one-sided into
the gradient blocks of the owners that served its bags. Each owner rebuilds, from the ids it kept in the
step's index blocks, the ids stock TorchRec would have handed its TBE (feature-major, then source rank,
then sample: :meth:`PgasStep.kept_ids`, or at their capacity :meth:`PgasStep.kept_ids_padded`). By default
(``owner_backward="pgas"``) the owner update sorts them by row and applies SGD, row-wise Adagrad or Adam in
the TBE's own storage (``owner_backward.py``). For other optimizers and options, and with
``owner_backward="fbgemm"``, the owner replays the stock TBE-backed lookup on them under autograd with the
received gradients (:meth:`PgasStep.replay`), so FBGEMM's own fused backward and optimizer update the
weights, as in stock TorchRec: replaying the forward (one more gather of the rows) rather than calling
FBGEMM's backward op keeps every optimizer and option of ``fused_optimizer`` working, since its backward
ops differ per optimizer and FBGEMM release and the lookup invokers do not.
"""

import abc
import contextlib
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed import comm_ops
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.bootstrap import init_runtime
from torchrec_pgas.sharding.owner_backward import op_available, owner_backward, padded_owner_backward, storage_key
from torchrec_pgas.sharding.owner_backward import unsupported as unsupported_update
from torchrec_pgas.layout import StepLayout, id_bytes_for
from torchrec_pgas.step_abi import KeptBagsConfig, as_tensor, build
from torchrec_pgas.types import (
    PgasCapacityError,
    PgasConfig,
    PgasError,
    PgasInputError,
    PgasPeerAbortError,
    PgasTimeoutError,
)

PoolFn = Callable[[KeyedJaggedTensor], torch.Tensor]


class KeptBags(NamedTuple):
    """The bags an owner kept of a step (feature-major, then source, then sample): id counts, their offsets,
    and where each bag's ids and per-sample weights start, as elements of the owner's buffer."""

    lengths: torch.Tensor
    offsets: torch.Tensor
    first_id: torch.Tensor
    first_weight: Optional[torch.Tensor]


class PaddedIds(NamedTuple):
    """The ids an owner kept of a step as a captured step reads them (``PgasStep.kept_ids_padded``): the kept
    bags (their offsets computed on the device) and the owner's buffer as ids and as fp32 weights, which the
    ``owner_keys`` op lays out at a fixed capacity; ``stride``: bags per feature."""

    bags: KeptBags
    ids: torch.Tensor
    weights: Optional[torch.Tensor]
    capacity: int
    stride: int


class BackwardGraphStats(NamedTuple):
    """How a sharding's eager backwards replayed CUDA graphs (``PgasConfig.eager_backward_graphs``, GPUs only)."""

    kept: int  # graphs kept: one per batch size, buffer slot and set of siblings, a bounded number
    captured: int  # graphs captured so far: more than ``kept`` where graphs were dropped and captured again
    replays: int  # eager backwards that replayed a graph


@dataclass(eq=False)
class StepTicket:
    """What a training step keeps for its backward. The autograd graph of the step's output holds it: when
    the graph goes without a backward (an eval forward with grad enabled), the step's blocks are released
    at the next index dist."""

    epoch: int
    batch: int
    pool: PoolFn  # the stock TBE-backed lookup, replayed by the owner
    tbe_iters: List[Optional[int]]  # each TBE's iteration counter as stock's forward of this step left it
    tbes: Sequence[nn.Module]
    host: Any = None  # what the host path keeps (its MEAN divisor, the sources' batches)
    done: bool = False


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


class _StepBackward(torch.autograd.Function):
    """The autograd node of a training step's pooled output; its backward is the step's backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, out: torch.Tensor, step: "PgasStep",  # type: ignore[override]
                ticket: StepTicket) -> torch.Tensor:
        ctx.step, ctx.ticket = step, ticket
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.step.backward(ctx.ticket, grad)
        return None, None, None, None


class _NoBackward(torch.autograd.Function):
    """The output of a sharding built without what a backward needs: a backward through it raises."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, kind: str) -> torch.Tensor:  # type: ignore[override]
        ctx.kind = kind
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        raise PgasError(f"{ctx.kind} was sharded with PgasConfig(training=False), which keeps no gradient "
                        "buffers: shard it with training=True (the default) to train through it")


@contextlib.contextmanager
def _tbe_iterations(tbes: Sequence[nn.Module], iters: Sequence[Optional[int]]) -> Iterator[None]:
    """The TBEs' iteration counters as they were before stock's forward of the replayed step (FBGEMM's
    forward adds one and hands it to the optimizer, e.g. Adam's bias correction), restored after."""
    saved = []
    for tbe, it in zip(tbes, iters):
        if it is not None:
            saved.append((tbe, int(tbe.iter_cpu)))
            tbe.iter_cpu.fill_(it - 1)
            tbe.iter.fill_(it - 1)
    try:
        yield
    finally:
        for tbe, it in saved:
            tbe.iter_cpu.fill_(it)
            tbe.iter.fill_(it)


def advance_tbe_iterations(tbes: Sequence[nn.Module]) -> List[Optional[int]]:
    """What stock's forward does to each TBE's iteration counter (the optimizers past EXACT_ADAGRAD count
    forwards, ``no_grad`` ones too), done on the host copy only; the replay sets the device copy."""
    out: List[Optional[int]] = []
    for tbe in tbes:
        if not _counts_iterations(tbe):
            out.append(None)
            continue
        if int(tbe.iter_cpu) == 0:  # a loaded checkpoint's count, once (as FBGEMM's forward does)
            tbe.iter_cpu.fill_(int(tbe.iter.cpu()))
        out.append(int(tbe.iter_cpu.add_(1)))
    return out


def sync_tbe_iterations(tbes: Sequence[nn.Module], iters: Sequence[Optional[int]]) -> None:
    """Each counting TBE's device counter as a replayed FBGEMM step leaves it (checkpoints carry it), after an
    owner update that did not run FBGEMM's (``iters``: the step's, None for a TBE that does not count)."""
    for tbe, it in zip(tbes, iters):
        if it is not None:
            tbe.iter.fill_(int(tbe.iter_cpu))


def _counts_iterations(tbe: nn.Module) -> bool:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return hasattr(tbe, "iter_cpu") and getattr(tbe, "optimizer", None) not in (
        EmbOptimType.NONE, EmbOptimType.EXACT_SGD, EmbOptimType.LARS_SGD, EmbOptimType.EXACT_ADAGRAD)


def gradient_divisor(world_size: int) -> float:
    """What stock's output dist divides the gradient by: the world size while TorchRec's gradient
    division is on (its default), else 1."""
    return float(world_size) if comm_ops.get_gradient_division() else 1.0


@dataclass(frozen=True)
class StepSpec:
    """Everything a sharding's step is built from, fixed when the module is sharded. Per-feature fields
    are in the sharding's feature order (TorchRec's grouping; table-wise: rank by rank)."""

    name: str  # unique per sharding: names its collective allocations
    kind: str  # PGAS_ROW_WISE or PGAS_TABLE_WISE
    feature_names: Tuple[str, ...]
    feature_tables: Tuple[str, ...]
    hash_sizes: Tuple[int, ...]
    dims: Tuple[int, ...]
    is_mean: Tuple[bool, ...]
    shard_rows: Tuple[int, ...]  # rows one owner holds of the feature's table: ceil(N / W), or N (table-wise)
    weighted: bool
    config: PgasConfig
    bounds_check_mode: BoundsCheckMode
    out_dtype: torch.dtype  # the pooled output's (one per sharding)
    features_per_rank: Tuple[int, ...] = ()  # table-wise: how many features each rank owns, in rank order
    dim_sum_per_rank: Tuple[int, ...] = ()  # table-wise: their output columns per rank

    @property
    def num_features(self) -> int:
        return len(self.feature_names)


_STEPS: "weakref.WeakSet[PgasStep]" = weakref.WeakSet()  # every live step of this process (failed_sibling)


def _undo_iterations(ticket: StepTicket) -> None:
    """A failed step's TBE iteration counters back to before its forward, unless a later forward moved them."""
    for tbe, it in zip(ticket.tbes, ticket.tbe_iters):
        if it is not None and int(tbe.iter_cpu) == it:
            tbe.iter_cpu.fill_(it - 1)


class PgasStep(abc.ABC):
    """State shared by the stage modules of one PGAS sharding.

    Each stage keeps its own FIFO step counter, the way a GPU stream would; the
    k-th lookup consumes the k-th index dist. A step's blocks live in buffer
    slot ``epoch % num_slots`` until its lookup (no backward) or its backward is
    done with them; an index dist that would need a slot still held raises.
    """

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device, block_dim_sum: int) -> None:
        """``block_dim_sum``: the columns of one owner's output block."""
        self.spec = spec
        self.kind = spec.kind
        self.layout = StepLayout(
            world_size=env.world_size,
            num_features=spec.num_features,
            max_batch=spec.config.max_local_batch_size,
            ids_capacity=spec.config.ids_capacity(spec.feature_tables),
            dim_sum=block_dim_sum,
            weighted=spec.weighted,
            id_bytes=id_bytes_for(spec.shard_rows),
            trainable=spec.config.training,
        )
        self.rt = init_runtime(env.process_group, device=device, heap_hint=self.layout.nbytes)
        self.rank = self.rt.rank
        self.world_size = self.rt.world_size
        self.device = device
        self.buf = self.rt.alloc(spec.name, self.layout.nbytes)
        self.pad = self.rt.alloc_signals(spec.name, self.layout.num_signal_slots)
        # each slot's first byte, beside the buffer: what the owner update at capacity reads its slot from
        self._slot_bases = torch.tensor([self.layout.index_block(s, 0) for s in range(self.layout.num_slots)],
                                        dtype=torch.int64, device=self.buf.local.device)
        self.issued = 0  # index dists issued (epochs are 1-based)
        self.looked_up = 0  # lookups completed
        self._input_order: Optional[List[int]] = None
        self._owner_backward_gap: Optional[str] = None  # what owner_backward="pgas" does not cover, once known
        self._op_refused_capacity = False  # the update op refused a TBE at capacity: read the count instead
        self._awaiting_backward: Set[int] = set()  # training steps whose blocks their backward still needs
        self._tickets: "weakref.WeakValueDictionary[int, StepTicket]" = weakref.WeakValueDictionary()
        _STEPS.add(self)
        self._dropped: List[int] = []  # of those, steps whose output went without a backward
        self._anchor = torch.zeros((), requires_grad=True)  # makes a training step's output require grad
        self._module_steps: List["weakref.ref[PgasStep]"] = []  # the PGAS steps of this step's module

    @property
    def feature_names(self) -> Tuple[str, ...]:
        return self.spec.feature_names

    @property
    def lookup_features(self) -> Tuple[int, int]:
        """``[lo, hi)``: the features whose rows this rank holds (all of them for row-wise)."""
        if not self.spec.features_per_rank:
            return 0, self.spec.num_features
        lo = sum(self.spec.features_per_rank[: self.rank])
        return lo, lo + self.spec.features_per_rank[self.rank]

    @property
    def reads_input_order(self) -> bool:
        """True once the module's KJT is read in its input order (``read_input_order``), not permuted."""
        return self._input_order is not None

    def fail(self, err: PgasError, epoch: int) -> PgasError:
        """Abort step ``epoch`` on every peer, so that peers waiting on this rank for it raise instead of
        hanging (later steps run); returns ``err``."""
        self.rt.abort(self.pad, str(err), epoch)
        return err

    def join_module(self, steps: Sequence["PgasStep"]) -> None:
        """The PGAS steps of this step's module (this one among them), in module order (``forward_failed``)."""
        self._module_steps = [weakref.ref(s) for s in steps]

    def forward_failed(self, err: PgasError, epoch: int) -> None:
        """This step raised ``err`` for step ``epoch`` in its module's forward, which ends that forward on
        every rank (the failing rank raises its error, the peers the abort): every other PGAS step of the
        module consumes step ``epoch`` as well (``consume_failed_step``), so that all of them run the next
        batch at the next epoch on every rank, whichever of them had run their stages of the failed step."""
        for ref in self._module_steps:
            other = ref()
            if other is not None and other is not self:
                other.consume_failed_step(epoch, err)

    def consume_failed_step(self, epoch: int, err: PgasError) -> None:
        """A sibling sharding failed step ``epoch`` in the module's forward: this step's stages of it that did
        not run will not (``forward_failed``). A backend whose forward raises (the host path) consumes them
        here; the device path raises no step error in the forward (it gives a step up by running its stages
        empty and raises at the backward), so it has nothing to consume."""

    def bad_id_message(self, f: int, value: int) -> str:
        spec = self.spec
        return (
            f"{self.kind}: feature '{spec.feature_names[f]}' (table "
            f"'{spec.feature_tables[f]}') has id {value} outside [0, {spec.hash_sizes[f]})"
        )

    def input_error(self, kjt: KeyedJaggedTensor) -> Optional[PgasError]:
        """What is wrong with the next step's input on host-known sizes (no device sync), if anything."""
        lay = self.layout
        if kjt.variable_stride_per_key():
            return PgasInputError(f"{self.kind} does not support variable batch size per feature")
        batch = kjt.stride()
        if batch > lay.max_batch:
            return PgasCapacityError(
                f"{self.kind}: local batch size {batch} exceeds PgasConfig.max_local_batch_size={lay.max_batch}"
            )
        nnz = kjt.values().numel()
        if nnz > lay.ids_capacity:
            return PgasCapacityError(
                f"{self.kind}: rank {self.rank} has {nnz} ids in one step, above the capacity of "
                f"{lay.ids_capacity} (PgasConfig.max_ids_per_rank / pooling_capacity / avg_pooling_capacity)"
            )
        return None

    def claim_slot(self) -> int:
        """The epoch of the next index dist, once its buffer slot is free on this rank: the step that last
        used it has had its lookup (and backward, if it trains). Releases the slots of dropped steps."""
        epoch, lay = self.issued + 1, self.layout
        if self.issued - self.looked_up >= lay.num_slots:
            raise PgasError(f"{self.kind}: {self.issued - self.looked_up} index dists are already in flight; "
                            f"at most {lay.num_slots} may run ahead of the lookup")
        for dropped in self._dropped:
            self.abandon_backward(dropped)
        self._dropped.clear()
        if epoch - lay.num_slots in self._awaiting_backward:
            raise PgasError(
                f"{self.kind}: step {epoch - lay.num_slots}'s output still waits for its backward, whose ids "
                f"this step's buffer slot holds: at most {lay.num_slots} steps may be in flight (TorchRec's "
                "TrainPipelineSparseDist and TrainPipelineSemiSync keep up to 3); run a forward that will "
                "not be backpropagated under torch.no_grad()"
            )
        return epoch

    def replayed(self) -> None:
        """One more replay of a captured training step: the device ran a step the host did not see (its
        index dist, lookup and backward), so the host's stage counters move as that step's would have."""
        self.issued += 1
        self.looked_up += 1

    def next_lookup_epoch(self) -> int:
        if self.looked_up >= self.issued:
            raise self.fail(PgasError(f"{self.kind}: lookup called without an index dist"), self.issued + 1)
        self.looked_up += 1
        return self.looked_up

    def trains(self) -> bool:
        """Whether the step being looked up will have a backward: grad is enabled and the layout keeps
        what a backward needs (``PgasConfig.training``)."""
        return torch.is_grad_enabled() and self.layout.trainable

    def forward_output(self, out: torch.Tensor, ticket: Optional[StepTicket]) -> torch.Tensor:
        """``out`` as a step's output: with ``ticket`` (a training step), its backward runs this step's
        (``backward``); with grad enabled on a layout that cannot train, a backward raises."""
        if ticket is not None:
            self._awaiting_backward.add(ticket.epoch)
            self._tickets[ticket.epoch] = ticket
            weakref.finalize(ticket, self._dropped.append, ticket.epoch)
            return _StepBackward.apply(self._anchor, out, self, ticket)
        if torch.is_grad_enabled():
            return _NoBackward.apply(out.requires_grad_(), self.kind)
        return out

    def backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """The step's backward on this rank: send the gradient, and, as owner, apply its sources'. A step
        that failed changes nothing: not its weights, nor (unless a later forward moved them since) its
        TBEs' iteration counters."""
        if ticket.done:
            raise PgasError(f"{self.kind}: a second backward through step {ticket.epoch}'s output "
                            "(retain_graph): its gradients were applied by the first")
        ticket.done = True
        self._awaiting_backward.discard(ticket.epoch)
        try:
            self.run_backward(ticket, grad.contiguous())
        except Exception as err:
            # The exception ends the whole backward: the other shardings' backwards of this step will not
            # run either, so their counters go back too, their records of the step are consumed (this
            # error stands for the step; a record left behind would raise later on this rank alone) and
            # their slots are released now, not when the step's graph is freed: a kept loss, or this
            # exception's traceback until a garbage collection, holds it past the slot's next use. A
            # failure of this rank's own (not a peer's abort or silence) aborts their step on the peers
            # too, which may wait in them first.
            local = not isinstance(err, (PgasPeerAbortError, PgasTimeoutError))
            _undo_iterations(ticket)
            for other, t in self.siblings_awaiting(ticket.epoch):
                if local:
                    other.fail(PgasError(f"{other.kind}: sharding {self.kind} failed step {ticket.epoch}'s "
                                         f"backward: {err}"), ticket.epoch)
                other.step_failure(ticket.epoch)
                _undo_iterations(t)
                other.abandon_backward(ticket.epoch)
            raise

    def abandon_backward(self, epoch: int) -> None:
        """Release step ``epoch``'s slot if the step still awaits its backward, which will not run."""
        if epoch in self._awaiting_backward:
            self._awaiting_backward.discard(epoch)
            self.release(epoch)

    @abc.abstractmethod
    def run_backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """Exchange the gradients of ``ticket``'s step and apply the received ones; release its slot."""

    def step_failure(self, epoch: int) -> Optional[PgasError]:
        """Step ``epoch``'s error on this rank if the step failed, consumed (its backward would raise it).
        The host path raises its errors in the forward, so none is left by the time of a backward."""
        return None

    def failed_sibling(self, epoch: int) -> Optional[PgasError]:
        """The error of step ``epoch`` of another PGAS sharding (of this process) whose backward of that step
        has not run yet, if that step failed: then no sharding of the model may apply the step. Each
        sharding runs each forward of a model once, so their epochs agree; every rank records a failed step
        (the failing rank its error, the others the abort), so every rank refuses alike. The failed step's
        TBE counters go back as its own backward would put them."""
        first: Optional[PgasError] = None
        for other, ticket in self.siblings_awaiting(epoch):
            err = other.step_failure(epoch)  # consumed in every sibling: none raises it again later
            if err is not None:
                _undo_iterations(ticket)
                first = first or err
        return first

    def siblings_awaiting(self, epoch: int) -> List[Tuple["PgasStep", StepTicket]]:
        """The other PGAS shardings of this process on this device whose step ``epoch`` still awaits its
        backward, with that step's ticket (the shardings of one model run each forward once, so their epochs
        agree; two models trained at once in one process are not told apart)."""
        pairs = [(other, other._tickets.get(epoch)) for other in list(_STEPS)
                 if other is not self and other.device == self.device and epoch in other._awaiting_backward]
        return [(other, ticket) for other, ticket in pairs if ticket is not None]

    @abc.abstractmethod
    def release(self, epoch: int) -> None:
        """Tell every source that this rank is done with its blocks of step ``epoch``."""

    def kept_ids(self, epoch: int, rows: int, block_features: Tuple[int, int, int], batches: torch.Tensor,
                 whole: Optional[torch.Tensor] = None) -> KeyedJaggedTensor:
        """The ids this rank kept of step ``epoch`` for the features it holds, as stock hands them to its
        TBE: feature-major, then source rank, then sample (``rows`` per source, padded with empty bags).

        ``block_features``: where those features sit in an index block (first, count, features per
        block); ``batches``: each source's batch (a tensor: it may live on the device). Every bag is read
        by the owners' reading rule (``layout.py``); the one host sync is the total id count.
        """
        lay = self.layout
        bags = self._kept_bags(lay.index_block(epoch % lay.num_slots, 0), rows, block_features, batches, whole)
        total = int(bags.offsets[-1])
        k = torch.arange(total, device=bags.offsets.device)  # kept id k is element first + (k - its bag's offset)

        def gather(first: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return self._buffer_as(dtype)[torch.repeat_interleave(first - bags.offsets[:-1], bags.lengths,
                                                                  output_size=total) + k]

        ids = gather(bags.first_id, lay.id_dtype).to(torch.int64)
        weights = gather(bags.first_weight, torch.float32) if bags.first_weight is not None else None
        lo, hi = self.lookup_features
        return KeyedJaggedTensor(keys=list(self.feature_names[lo:hi]), values=ids, lengths=bags.lengths,
                                 offsets=bags.offsets, weights=weights, stride=self.world_size * rows)

    def kept_ids_padded(self, slot_base: Union[int, torch.Tensor], rows: int, block_features: Tuple[int, int, int],
                        batches: torch.Tensor, whole: torch.Tensor) -> PaddedIds:
        """:meth:`kept_ids` without the host sync, for the owner update op: the ids are left where the sources
        wrote them, for the ``owner_keys`` op to read at a fixed capacity (what the sources' index blocks can
        hold for this rank). ``slot_base``: the slot's first byte, an int, or a device tensor for a step
        captured in a CUDA graph (the device's slot)."""
        lay = self.layout
        bags = self._kept_bags(slot_base, rows, block_features, batches, whole)
        return PaddedIds(bags, self._buffer_as(lay.id_dtype), self._buffer_as(torch.float32) if lay.weighted else None,
                         self.world_size * lay.ids_capacity, self.world_size * rows)

    def updates_at_capacity(self, ticket: StepTicket) -> bool:
        """Whether an eager step's owner update lays the kept ids out at their fixed capacity, as a captured one
        does, rather than at their count, which the host must read: the op applies every TBE
        (``owner_backward="pgas"``, the extension built, and it has not refused one), and the positions sorted,
        TBEs × W × ids capacity, are within ``PgasConfig.max_padded_eager_ids`` (by default none on CPUs)."""
        positions = len(ticket.tbes) * self.world_size * self.layout.ids_capacity  # each TBE sorts the capacity
        return (positions <= self.spec.config.padded_eager_ids(self.device.type) and not self._op_refused_capacity
                and self.spec.config.owner_backward == "pgas" and self._owner_backward_applies(ticket.tbes)
                and op_available())

    @property
    def backward_graph_stats(self) -> BackwardGraphStats:
        """This sharding's eager backwards replayed as CUDA graphs: none here (``DeviceStep`` replays them)."""
        return BackwardGraphStats(0, 0, 0)

    def update_at_capacity(self, ticket: StepTicket, slot: Union[int, torch.Tensor], rows: int,
                           block_features: Tuple[int, int, int], columns: Tuple[int, int, int],
                           batches: torch.Tensor, whole: torch.Tensor,
                           iterations: Optional[Sequence[Optional[int]]]) -> bool:
        """The owner update op over the ids kept in ``slot`` (an int, or the device's slot under capture) at their
        fixed capacity (``kept_ids_padded``, ``kept_grads``' arguments), applied only where the device word
        ``whole`` is true: nothing read on the host. False, with nothing applied, where the op does not take
        some TBE."""
        bases = self._slot_bases
        base = bases[slot:slot + 1] if isinstance(slot, int) else bases.index_select(0, slot.view(1))  # int: a view
        kept = self.kept_ids_padded(base, rows, block_features, batches, whole)
        profiling.mark("kept_ids")
        grads = self.kept_grads(slot, rows, columns, self.spec.out_dtype)
        taken = padded_owner_backward(ticket.tbes, kept, grads, whole.long().view(1), iterations)
        self._op_refused_capacity = not taken  # the op's reasons (dims, dtypes) hold for the next steps too
        return taken

    def _buffer_as(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's whole buffer as elements of ``dtype`` (a view)."""
        local = self.buf.local
        return local[:local.numel() - local.numel() % dtype.itemsize].view(dtype)

    def _kept_bags(self, slot_base: Any, rows: int, block_features: Tuple[int, int, int], batches: torch.Tensor,
                   whole: Optional[torch.Tensor]) -> "KeptBags":
        """Every kept bag's id count and where its ids (and weights) start, as elements of the buffer, for the
        slot at byte ``slot_base`` (an int, or a device tensor); bags past a source's batch, and every bag
        where ``whole`` is false, hold no ids. The extension's ``kept_bags`` op reads them where it is built
        (csrc/owner_keys.h); torch ops by the same rule elsewhere (a pure-Python install)."""
        lay, world = self.layout, self.world_size
        first, count, per_block = block_features
        dev = self.buf.local.device
        if op_available():  # one kernel, a thread a bag, where the torch ops below launch about thirty
            base = slot_base if isinstance(slot_base, torch.Tensor) else torch.full((1,), slot_base, device=dev)
            config = build(KeptBagsConfig, index_block_bytes=lay.index_block_bytes, lengths_off=lay.lengths_off,
                           offsets_off=lay.offsets_off, ids_off=lay.ids_off,
                           weights_off=lay.weights_off if lay.weighted else -1, id_bytes=lay.id_bytes,
                           max_batch=lay.max_batch, features_per_block=per_block, first_feature=first,
                           num_features=count, world=world, rows=rows)
            lengths, first_id, first_weight = torch.ops.torchrec_pgas.kept_bags(
                self.buf.local, base.to(dev, torch.int64).reshape(1), batches.to(dev, torch.int64),
                None if whole is None else whole.to(dev).reshape(1), as_tensor(config))
            return KeptBags(lengths, torch.ops.fbgemm.asynchronous_complete_cumsum(lengths), first_id,
                            first_weight if lay.weighted else None)
        block = slot_base + torch.arange(world, device=dev) * lay.index_block_bytes  # each source's block, bytes

        def per_source(off: int, dtype: torch.dtype, n: int) -> torch.Tensor:
            return self._buffer_as(dtype)[(block[:, None] + off) // dtype.itemsize + torch.arange(n, device=dev)]

        lengths = per_source(lay.lengths_off, torch.int32, per_block * lay.max_batch)
        starts = per_source(lay.offsets_off, torch.int64, per_block * lay.max_batch + 1)
        f = torch.arange(first, first + count, device=dev)[:, None, None]
        src = torch.arange(world, device=dev)[None, :, None]
        b = torch.arange(rows, device=dev)[None, None, :]
        batches = batches.to(dev).clamp(0, lay.max_batch)  # a failed step's headers may be stale
        bag = (f * batches[None, :, None] + b).expand(count, world, rows)  # the bag in its source's block
        valid = b < batches[None, :, None]
        if whole is not None:
            valid = valid & whole
        bag = torch.where(valid, bag, 0)
        src = src.expand_as(bag)
        # clamped: a corrupt negative length would make the offsets decrease (owner_keys' bags overlap)
        new_lengths = torch.where(valid, lengths[src, bag].to(torch.int64), 0).clamp(min=0).reshape(-1)
        start = starts[src, bag].reshape(-1)
        src = src.reshape(-1)
        first_weight = None
        if lay.weighted:
            first_weight = start + (block[src] + lay.weights_off) // 4
        return KeptBags(new_lengths, torch.ops.fbgemm.asynchronous_complete_cumsum(new_lengths),
                        start + (block[src] + lay.ids_off) // lay.id_bytes, first_weight)

    def kept_grads(self, slot: Union[int, torch.Tensor], rows: int, columns: Tuple[int, int, int],
                   dtype: torch.dtype) -> torch.Tensor:
        """The gradient rows this rank's sources stored for it in buffer slot ``slot`` (an int, or a device
        tensor for a captured step), ``[W * rows, D_held]`` in the order of :meth:`kept_ids` (``columns``:
        first, end and row width of a gradient block)."""
        lay, world = self.layout, self.world_size
        lo, hi, width = columns
        per_block = lay.output_block_bytes // dtype.itemsize
        blocks = self.buf.view(dtype, lay.grad_block(0, 0), lay.num_slots * world * per_block).view(
            lay.num_slots, world, per_block)
        mine = blocks[slot] if isinstance(slot, int) else blocks.index_select(0, slot.view(1))[0]
        return mine[:, :rows * width].view(world, rows, width)[:, :, lo:hi].reshape(world * rows, hi - lo)

    def replay(self, ticket: StepTicket, kjt: KeyedJaggedTensor, grads: torch.Tensor) -> None:
        """Stock's lookup of the kept ids under autograd, then its backward with the received gradients:
        FBGEMM's fused backward + optimizer update the weights and optimizer state in place (or, where
        ``PgasConfig.owner_backward == "pgas"`` covers the TBEs, ``owner_backward`` does, without the lookup).

        Why a replay and not FBGEMM's backward op called directly: that op's signature differs per optimizer
        and per FBGEMM release (state tensors, hyper-parameters, the lookup's saved metadata), and the TBE
        module builds those arguments itself. The replay costs one more pooled lookup of the owner's rows (measured
        at about the forward's own lookup: benchmarks/NOTES.md §29) and follows every optimizer FBGEMM ships, bit
        for bit."""
        if kjt.values().numel() == 0:
            return  # no row to update
        if self._owner_backward_applies(ticket.tbes):
            owner_backward(ticket.tbes, kjt, grads, ticket.tbe_iters,
                           reference=self.spec.config.owner_backward == "reference")
            sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)
            profiling.mark("owner_backward")
            return
        with torch.enable_grad(), _tbe_iterations(ticket.tbes, ticket.tbe_iters):
            out = ticket.pool(kjt)
        profiling.mark("replay_lookup")
        torch.autograd.backward(out, grads.to(out.dtype))
        profiling.mark("owner_backward")

    def _owner_backward_applies(self, tbes: Sequence[nn.Module]) -> bool:
        """Whether the owner backward (``PgasConfig.owner_backward`` "pgas" or "reference") covers every TBE of
        this sharding; the first time it does not, a warning says why (FBGEMM's replay serves the sharding then)."""
        if self.spec.config.owner_backward not in ("pgas", "reference"):
            return False
        if self._owner_backward_gap is None:
            reasons = [r for r in map(unsupported_update, tbes) if r is not None]
            self._owner_backward_gap = "; ".join(reasons)
            if reasons:
                warnings.warn(f"{self.kind}: owner_backward={self.spec.config.owner_backward!r} does not cover "
                              f"{self._owner_backward_gap}: "
                              "FBGEMM's fused backward applies this sharding's gradients "
                              "(PgasConfig(owner_backward='fbgemm') chooses it without this warning)")
        return not self._owner_backward_gap

    def read_input_order(self, order: Sequence[int]) -> None:
        """Take the module's KJT in its input order: feature f of this sharding is input feature
        ``order[f]`` (``ShardedEmbeddingBagCollection`` would otherwise permute a copy each step)."""
        if sorted(order) != list(range(self.spec.num_features)):
            raise PgasError(f"{self.kind}: input feature order {list(order)} is not a permutation of "
                            f"the sharding's {self.spec.num_features} features")
        self._input_order = list(order)

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The local KJT in this sharding's feature order (what the index dist and lookup take)."""
        return kjt if self._input_order is None else kjt.permute(self._input_order)

    @abc.abstractmethod
    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        """Stage 1 (requester): put this rank's ids into their owners, then signal them."""

    @abc.abstractmethod
    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        """Stages 2 and 3 (owner, then requester); returns the final ``[B, D]`` pooled output.

        ``pool`` is the stock TBE lookup of a received KJT, ``tbes`` the TBE
        modules whose weight storage the fused kernels read directly.
        """

    def raise_recorded(self) -> None:
        """Raise the errors the device recorded for finished steps, without a sync; the host path raises its
        errors as they happen."""

    def check(self) -> None:
        """Raise errors the device recorded (after a stream sync); nothing to do where stages raise."""
