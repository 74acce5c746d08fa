"""The fused GPU kernels of a PGAS step (the ``nvshmem`` backend), for both shardings.

Table-wise is the one-owner case of row-wise (``csrc/step_protocol.cuh``): a
row-wise table is W row blocks of ``ceil(N/W)`` rows on ranks ``0..W-1``, a
table-wise table one block of N rows on its owner. ``DeviceStep`` describes
each feature that way (``FeatureOwners``, one ``FeatureDesc`` per feature) and
launches the same three kernels per step (index dist, pooled lookup, combine
partials) on the current stream, whatever the number of tables: no host sync,
graph capturable.

A training step's backward (``csrc/grad_exchange.cu``): ``grad_dist`` stores
the gradient rows into the owners that served each bag, ``await_grads`` waits
for this owner's sources, the owner applies them (the owner update, or FBGEMM's
path: below) and ``release_sources`` hands the slot back. A step that failed
on any rank (device-side errors are recorded, not raised) changes no weight:
its backward raises the error on every rank instead. FBGEMM's path rebuilds the
kept ids at the one host sync (the id count FBGEMM's backward needs, which
brings the step's error record and the sources' flags along) and replays the
stock lookup under autograd.

The owner update op (``OwnerBackward.PGAS``, the default) needs no id count: the owner lays its ids out at a
fixed capacity (``ReceivedBlocks.kept_ids_padded``, the ``owner_keys`` op) and the op applies nothing where a
device word says the step failed on some rank. An eager step launches it before reading the flags
(``OwnerApply.update_at_capacity``: the host waits for the exchange, not for the update;
``PgasTrainingConfig.max_padded_eager_ids`` bounds the capacity it sorts), and under CUDA-graph capture
(``torchrec_pgas.CapturedTrainStep``) the backward reads nothing on the host: its kernels take each replay's
epoch from the device. Those kernels also serve eager steps that follow their own forward
(``PgasTrainingConfig.eager_backward_graphs``, ``device/backward_graphs.py``): captured once per batch size and
slot as one graph, which copies the flags to the host and records an event between the exchange and the update
(the host waits for that event). The kernels' feature table is ``device/features.py``, their error records
``device/errors.py``.
"""

import warnings
from typing import List, Optional, Sequence, Tuple, Union

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.sharding.capture import record_captured_backward, record_captured_step
from torchrec_pgas.sharding.device.backward_graphs import (
    FLAGS_UNSET,
    BackwardGraph,
    BackwardGraphCache,
    device_graphs,
)
from torchrec_pgas.sharding.device.errors import ErrorRecords
from torchrec_pgas.sharding.device.features import (
    BOUNDS_MODES,
    WEIGHT_DTYPES,
    FeatureOwners,
    bind_weights,
    column_features,
    feature_descs,
    per_feature,
)
from torchrec_pgas.sharding.owner_backward import storage_key, write_hyper
from torchrec_pgas.sharding.step import BackwardGraphStats, PgasStep, StepSpec, gradient_divisor
from torchrec_pgas.sharding.tbe_counters import advance_tbe_iterations, sync_tbe_iterations
from torchrec_pgas.sharding.tickets import PoolFn, StepTicket
from torchrec_pgas.step_abi import FeatureDesc, StateWord, as_tensor, as_words
from torchrec_pgas.types import OwnerBackward, PgasError, PgasPeerAbortError, PgasTimeoutError


class DeviceStep(PgasStep):
    """Three fused kernel launches per forward on the current stream, no host sync; a backward's one wait is
    for the gradient exchange (``_raise_backward_problem``).

    Device-side errors (bad ids, batch mismatch, timeouts, a peer's abort) land
    in a pinned ``ErrorRecord`` that the next step reads without syncing;
    ``check()`` synchronizes first.
    """

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device, owners: FeatureOwners) -> None:
        super().__init__(spec, env, device, block_dim_sum=sum(spec.dims))
        owners.check(self.world_size, self.rank)
        lay = self.layout
        ops = torch.ops.torchrec_pgas
        peers = [
            [ops.peer_ptr(self.buf.local, pe) for pe in range(self.world_size)],
            [ops.peer_ptr(self.pad.words, pe) for pe in range(self.world_size)],
        ]
        unreachable = [pe for pe, ptr in enumerate(peers[0]) if ptr == 0]
        if unreachable:
            raise PgasError(
                f"ranks {unreachable} are not reachable by load/store from rank {self.rank} "
                f"({self.kind} on GPUs needs one NVLink domain for now)"
            )
        self._peers = torch.tensor(peers, dtype=torch.int64, device=device)
        # Weights are bound from the TBEs at the first lookup, input features by read_input_order.
        self._descs = feature_descs(spec.shard_rows, spec.hash_sizes, spec.dims, owners)
        self._features = as_words(self._descs, FeatureDesc).to(device)
        self._col_feature = column_features(spec.dims, device)
        self._state = torch.zeros(StateWord.STATE_WORDS, dtype=torch.int64, device=device)
        self._bag_div = torch.zeros(lay.num_slots, lay.num_features * lay.max_batch, device=device)
        self._errors = ErrorRecords(self.kind, self.rank, lay.num_slots, spec.bounds_check_mode, spec.bad_id_message)
        self._grad_flags = torch.zeros(self.world_size + 1, dtype=torch.int64, device=device)
        self._grad_flags_host = torch.zeros(self.world_size + 1, dtype=torch.int64).pin_memory()
        # [slot, source]: the int64 word of the buffer that holds the source's batch (its index block's header)
        self._batch_words = torch.tensor([[(lay.index_block(slot, src) + lay.header_off + 8) // 8
                                           for src in range(self.world_size)] for slot in range(lay.num_slots)],
                                         dtype=torch.int64, device=device)
        self._owners = owners
        self._config_args = dict(timeout_ns=int(spec.config.wait_timeout_s * 1e9), rank=self.rank,
                                 bounds_mode=BOUNDS_MODES[spec.bounds_check_mode],
                                 lookup_features=owners.lookup, variable_batch=owners.variable_batch)
        self._config = as_tensor(lay.config(**self._config_args))
        self._max_dim = max(spec.dims[owners.lookup[0]:owners.lookup[1]], default=4)
        self._tbe_key: List[int] = [-1]
        # The stream of this step's last index dist if no lookup was issued since (see lookup).
        self._dist_stream: Optional[torch.cuda.Stream] = None
        # Recorded after each combine, per slot (see index_dist).
        self._slot_free = [torch.cuda.Event() for _ in range(lay.num_slots)]
        self._trace: Optional[torch.Tensor] = None
        self._grad_sent = 0  # the last step whose gradient (or give-up) grad_dist sent
        self._graphs = BackwardGraphCache()  # eager backwards replayed as CUDA graphs (_replay_backward)
        self._deadline_owner: Optional[torch.Tensor] = None  # the state whose deadline words the waits use

    def share_deadlines(self, leader: PgasStep) -> None:
        """The waits use the deadline words of ``leader``'s state (csrc/step_protocol.cuh: one deadline a step
        of the model, whichever sharding's wait it is; its stages run on the same stream as this one's)."""
        shared = leader is not self and isinstance(leader, DeviceStep) and leader.device == self.device
        self._deadline_owner = leader._state if shared else None  # kept alive while the kernels read its words
        self._state[StateWord.DEADLINE_AT] = (
            leader._state.data_ptr() + 8 * int(StateWord.STEP_DEADLINE) if shared else 0)

    def read_input_order(self, order: Sequence[int]) -> None:
        """The index dist reads feature f's bags at KJT feature ``order[f]`` (no permuted copy)."""
        super().read_input_order(order)
        for desc, f in zip(self._descs, order):
            desc.input_feature = f
        self._features.copy_(as_words(self._descs, FeatureDesc))

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return kjt  # the kernels read through the order; the lookup only needs the batch

    def _state_args(self) -> Tuple[torch.Tensor, ...]:
        """What every stage op takes after its own inputs: the buffers, peers, features and device state."""
        return (self.buf.local, self.pad.words, self._peers, self._features, self._state, self._bag_div,
                self._errors.status, self._config)

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        self._raise_model_records()
        epoch = self.claim_slot()
        err = self.spec.input_error(kjt, self.rank)
        stream = self._await_slot(epoch)
        if err is not None:
            self._give_up(err, epoch)
        else:
            weights = kjt.weights_or_none()
            try:
                torch.ops.torchrec_pgas.index_dist(
                    kjt.values(), kjt.offsets().to(torch.int64), weights.float() if weights is not None else None,
                    *self._state_args(), kjt.stride(), False, self.trains(),
                )
            except RuntimeError as e:
                raise self.fail(PgasError(f"{self.kind} index dist failed to launch: {e}"), epoch) from e
        self.issued = epoch
        self._dist_stream = stream

    def _raise_model_records(self) -> None:
        """Raise the finished steps' errors of every sharding of the model, but only before the model's first
        index dist of a step: once another EBC has claimed the next epoch, this one must claim it too (raising
        here would leave it an epoch behind); the records wait for the next step's first index dist."""
        members = [m for m in self.group.members() if isinstance(m, DeviceStep)]
        if any(m.issued > self.issued for m in members):
            return
        for step in members if self in members else members + [self]:
            step.raise_recorded()

    def _await_slot(self, epoch: int) -> torch.cuda.Stream:
        """The current stream, made to wait for the last step that used ``epoch``'s slot on this rank (its
        combine, or its backward): TorchRec's train pipelines run the input dist on their own stream."""
        stream = torch.cuda.current_stream(self.device)
        if not torch.cuda.is_current_stream_capturing():
            stream.wait_event(self._slot_free[epoch % self.layout.num_slots])
        return stream

    def _give_up(self, err: PgasError, epoch: int) -> None:
        """Give step ``epoch`` up on every rank, as device-side errors are: abort it, then run its stages with
        no ids (the index dist says it gave up; the lookup and combine run at batch 0), so every rank's
        epochs stay in step, every sharding of the model runs the step, and its backward (or the next
        forward, or ``check_errors``) raises ``err`` here and the abort on the peers."""
        self.fail(err, epoch)
        dev = self.device
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        weights = torch.zeros(0, device=dev) if self.layout.weighted else None
        torch.ops.torchrec_pgas.index_dist(empty, torch.zeros(1, dtype=torch.int64, device=dev), weights,
                                           *self._state_args(), 0, True, False)
        self._errors.gave_up[epoch] = err

    def _bind_weights(self, tbes: Sequence[nn.Module]) -> None:
        """Point the feature table at the TBEs' weight storage (again only if it moved).

        The TBEs hold the features of this rank's lookup range, in order. Per
        step this costs one pointer read per TBE group, not per table.
        """
        key = [t.weights_dev.data_ptr() for t in tbes]
        if key == self._tbe_key:
            return
        weights = [w for t in tbes for w in per_feature(t)]
        out_dtypes = {SparseType.from_int(t.output_dtype).as_dtype() for t in tbes}
        f_lo, f_hi = self.lookup_features
        if len(weights) != f_hi - f_lo or not out_dtypes <= {self.spec.out_dtype}:
            raise PgasError(
                f"{self.kind}: {len(weights)} TBE features with output dtypes {out_dtypes} "
                f"for the {f_hi - f_lo} features this rank holds (output dtype {self.spec.out_dtype})"
            )
        for f, w in enumerate(weights, start=f_lo):
            if w.dtype not in WEIGHT_DTYPES or not w.is_cuda or w.dim() != 2 or w.stride(0) != w.size(1):
                raise PgasError(
                    f"{self.kind}: feature '{self.feature_names[f]}' has weights of dtype "
                    f"{w.dtype} on {w.device}; the GPU lookup reads row-major fp32/fp16 HBM"
                )
            bind_weights(self._descs[f], w)
        self._features.copy_(as_words(self._descs, FeatureDesc))
        self._tbe_key = key

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        epoch = self.next_lookup_epoch()
        trains = self.trains()
        batch = 0 if epoch in self._errors.gave_up else kjt.stride()
        ops = torch.ops.torchrec_pgas
        # The lookup may start before the kernel ahead of it on the stream has
        # completed (csrc/pgas_common.cuh: launch_after_exit) only if an index dist
        # of this step lies between it and the previous combine on this stream:
        # that plain launch began after the previous step's kernels had completed.
        # Not so when a train pipeline distributes on its own stream.
        after_exit = self._dist_stream == torch.cuda.current_stream(self.device)
        self._dist_stream = None
        try:
            self._bind_weights(tbes)
            ops.pooled_lookup(*self._state_args(), batch, self._max_dim, self.spec.out_dtype, after_exit, not trains)
            profiling.mark("lookup")
            out = ops.combine_partials(*self._state_args(), self._col_feature, batch, self.spec.out_dtype)
            if batch != kjt.stride():  # a given-up step: the forward's shape, its error raised later
                out = torch.zeros(kjt.stride(), self.layout.dim_sum, dtype=self.spec.out_dtype, device=self.device)
        except PgasError as e:  # peers wait for this rank's pooled rows: abort them
            raise self.fail(e, epoch)
        except RuntimeError as e:
            raise self.fail(PgasError(f"{self.kind} lookup failed to launch: {e}"), epoch) from e
        if not torch.cuda.is_current_stream_capturing():
            self._slot_free[epoch % self.layout.num_slots].record()
        iters = advance_tbe_iterations(tbes)
        if torch.cuda.is_current_stream_capturing():
            record_captured_step(self, tbes, iters)
        return self.forward_output(out, StepTicket(epoch, kjt.stride(), pool, iters, tbes) if trains else None)

    def run_backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        epoch = ticket.epoch
        if torch.cuda.is_current_stream_capturing():
            self._captured_backward(ticket, grad)
            return
        try:
            self._exchange_and_apply(ticket, grad)
        except PgasError:
            raise
        except RuntimeError as e:  # an op refused or failed to launch: peers must not wait for this rank
            if self._grad_sent != epoch:  # their await_grads reads the grad signal only: say this rank gave up
                empty = torch.empty(0, self.layout.dim_sum, dtype=self.spec.out_dtype, device=self.device)
                torch.ops.torchrec_pgas.grad_dist(empty, *self._state_args(), epoch, 0,
                                                  gradient_divisor(self.world_size), True)
            raise self.fail(PgasError(f"{self.kind} backward of step {epoch} failed: {e}"), epoch) from e
        finally:
            self.release(epoch)

    def _exchange_and_apply(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        if self._replays_backward(ticket) and self._replay_backward(ticket, grad):
            return
        ops, lay, epoch = torch.ops.torchrec_pgas, self.layout, ticket.epoch
        slot = epoch % lay.num_slots
        args = self._state_args()
        gave_up = epoch in self._errors.gave_up  # its batch may not fit the buffers: it sends nothing, says so
        batch = 0 if gave_up else ticket.batch
        sibling_gave_up = self._adopt_sibling_failures(epoch)
        ops.grad_dist(self._sent_gradient(grad, batch), *args, epoch, batch, gradient_divisor(self.world_size),
                      gave_up or sibling_gave_up)
        self._grad_sent = epoch
        ops.await_grads(*args, self._grad_flags, epoch)
        profiling.mark("grad_exchange")
        whole = (self._grad_flags == 0).all()
        self._grad_flags_host.copy_(self._grad_flags, non_blocking=True)
        f_lo, f_hi = self.lookup_features
        # Row-wise sources all feed this rank's batch (checked by the lookup); table-wise ones their own.
        rows = lay.max_batch if self._owners.variable_batch else batch
        if f_hi > f_lo and rows > 0 and not gave_up and self.owner_apply.at_capacity(ticket):
            # The update is launched before the sources' flags are read and applies nothing unless ``whole``:
            # the host waits for the exchange only, not for the update.
            exchanged = torch.cuda.current_stream(self.device).record_event()
            if self._update_held(ticket, slot, rows, whole, ticket.tbe_iters):
                self._raise_backward_problem(epoch, exchanged)
                sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)
                if self.owner_apply.training.eager_backward_graphs:  # the TBEs' layouts and hyper-parameter words
                    self._graphs.built_for([storage_key(t) for t in ticket.tbes])
                return
        self._count_and_apply(ticket, slot, rows, whole)

    @property
    def backward_graph_stats(self) -> BackwardGraphStats:
        """The graphs of its eager backward this sharding keeps (at most ``MAX_BACKWARD_GRAPHS``), has
        captured, and replayed."""
        return self._graphs.stats

    def _replays_backward(self, ticket: StepTicket) -> bool:
        """Whether this eager backward replays CUDA graphs of the backward's kernels (``_exchange_kernels``,
        ``_update_kernels``): ``PgasTrainingConfig.eager_backward_graphs`` (and no capture failed here), the capacity
        path (``OwnerApply.at_capacity``) taken since the TBEs' storage last moved (it builds what a capture reads),
        and a step whose kernels may take the device's epoch: it follows its own forward in this sharding and
        in every sibling awaiting it, and no sharding gave it up on the host."""
        epoch = ticket.epoch
        if not self.owner_apply.training.eager_backward_graphs or self._graphs.failed:
            return False
        if not (self._graphs.serves([storage_key(t) for t in ticket.tbes])
                and epoch == self.looked_up and not self.backwards.pending() and epoch not in self._errors.gave_up
                and self.lookup_features[1] > self.lookup_features[0] and self.owner_apply.at_capacity(ticket)
                and (self._owners.variable_batch or ticket.batch > 0)):  # the launched path's rows > 0
            return False
        return all(isinstance(o, DeviceStep) and o.looked_up == epoch and epoch not in o._errors.gave_up
                   for o, _ in self.group.siblings_awaiting(self, epoch))

    def _replay_backward(self, ticket: StepTicket, grad: torch.Tensor) -> bool:
        """The eager backward as one graph replay, which copies the sources' flags to the host and records an
        event between the exchange and the update: as the launched path, the host then waits for the exchange
        only, and raises as it does. False, with nothing run, where the capture failed (the launched path
        serves)."""
        epoch, lay = ticket.epoch, self.layout
        siblings = tuple(o for o, _ in self.group.siblings_awaiting(self, epoch) if isinstance(o, DeviceStep))
        slot = epoch % lay.num_slots
        key = (ticket.batch, slot, gradient_divisor(self.world_size), tuple(sorted(id(o) for o in siblings)))
        graph = self._graphs.take(key) or self._capture_backward(ticket, grad, siblings, slot)
        if graph is None:
            return False
        self._graphs.keep(key, graph)
        stream, shared = torch.cuda.current_stream(self.device), device_graphs(self.device)
        shared.after_last(stream)
        for tbe, iteration in zip(ticket.tbes, ticket.tbe_iters):
            write_hyper(tbe, iteration)
        graph.grad.copy_(grad[:ticket.batch])
        self._grad_flags_host.fill_(FLAGS_UNSET)  # every earlier write into them was waited for
        graph.graph.replay()
        self._grad_sent = epoch
        shared.replayed(stream)
        profiling.mark("owner_update")
        self._graphs.replays += 1
        self._await_replayed_flags(graph.exchanged, stream)
        self._raise_backward_problem(epoch, None)
        sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)
        return True

    def _await_replayed_flags(self, exchanged: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        """Wait until the replay's copy of the flags is on the host: on ``exchanged``, the event recorded inside the
        graph, which each launch arms (the CUDA docs imply it rather than promise it; the drivers we ran do). Where
        a flag still holds the host's fill, the event did not wait: the stream's sync does, the update included."""
        exchanged.synchronize()
        if min(self._grad_flags_host.tolist()) == FLAGS_UNSET:
            warnings.warn(f"{self.kind}: the backward graph's event returned before its flags copy ran; waiting for "
                          "the stream instead (the update too)")
            stream.synchronize()

    def _capture_backward(self, ticket: StepTicket, grad: torch.Tensor, siblings: Tuple["DeviceStep", ...],
                          slot: int) -> Optional[BackwardGraph]:
        """The backward's graph for this step's batch, slot and siblings, reading the gradient from a static
        buffer, in the device's pool (``DeviceGraphs``). A capture runs nothing: where ours
        refuses (a ``PgasError`` inside a valid capture), graphs are off for this sharding (a warning says why),
        and None. A CUDA error that breaks the capture propagates: the allocator and stream are then not ours
        to fall back on."""
        static = self._sent_gradient(grad, ticket.batch).clone()
        pool = device_graphs(self.device).pool
        graph, exchanged = torch.cuda.CUDAGraph(), torch.cuda.Event(external=True)
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                whole = self._exchange_kernels(static, ticket.batch, siblings)
                self._grad_flags_host.copy_(self._grad_flags, non_blocking=True)
                exchanged.record()
                self._update_kernels(ticket, slot, whole)
        except PgasError as e:  # nothing ran: the launched path takes this step and the next ones
            self._graphs.failed = True
            warnings.warn(f"{self.kind}: eager backwards are launched, not replayed as CUDA graphs: the capture "
                          f"failed ({e})")
            return None
        self._graphs.captured(self._grad_flags_host)
        return BackwardGraph(graph, exchanged, static, whole, siblings)

    def _count_and_apply(self, ticket: StepTicket, slot: int, rows: int, whole: torch.Tensor) -> None:
        """The kept ids as a KJT of their exact count (the one host sync), then FBGEMM's replay or the op."""
        f_lo, f_hi = self.lookup_features
        batches = self._kept_batches(slot)
        kjt = self.received.kept_ids(ticket.epoch, rows, (f_lo, f_hi - f_lo, self.layout.num_features), batches, whole)
        profiling.mark("kept_ids")
        self._raise_backward_problem(ticket.epoch, None)  # after the sync
        if f_hi > f_lo:
            grads = self.received.kept_grads(slot, rows, self._held_columns(), self.spec.out_dtype)
            self.owner_apply.apply_at_count(ticket, kjt, grads)

    def _raise_backward_problem(self, epoch: int, ready: Optional[torch.cuda.Event]) -> None:
        """Raise why step ``epoch``'s gradients must not be applied, if they must not, once ``ready`` (an event
        after the exchange; None: already synced) has passed: then every sharding's records of the step are
        in (their combines ran before), and the sources' flags on the host."""
        if ready is not None:
            ready.synchronize()
        problem = self._backward_problem(epoch)
        if problem is not None:
            try:
                raise problem
            finally:  # else the traceback holds this frame and the frame the exception: a cycle that keeps the
                del problem  # step's graph and its GPU tensors alive until a garbage collection

    def _update_held(self, ticket: StepTicket, slot: Union[int, torch.Tensor], rows: int, whole: torch.Tensor,
                     iterations: Optional[Sequence[Optional[int]]]) -> bool:
        """``update_at_capacity`` of the features this rank holds, their sources' batches read on the device."""
        f_lo, f_hi = self.lookup_features
        return self.owner_apply.update_at_capacity(ticket, slot, rows, (f_lo, f_hi - f_lo, self.layout.num_features),
                                                   self._held_columns(), self._kept_batches(slot), whole, iterations)

    def _kept_batches(self, slot: Union[int, torch.Tensor]) -> torch.Tensor:
        """Each source's batch from its index block's header in ``slot`` (an int, or a device tensor), on the
        device."""
        words = self._batch_words[slot] if isinstance(slot, int) else self._batch_words.index_select(0, slot.view(1))
        return self.received.buffer_as(torch.int64)[words.view(-1)]

    def _captured_backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """The backward under CUDA-graph capture: the same stages as :meth:`_exchange_and_apply` with nothing
        read on the host. The kernels take the step's epoch from the device (each replay's own), the kept
        ids fill a fixed capacity, and the failure check is a device word: the update applies nothing where a
        rank or a sibling sharding failed the step (every rank then refuses it; the error records raise at
        the next check). Only the owner update op can run so (FBGEMM's backward needs the id count)."""
        owner_backward = self.owner_apply.training.owner_backward
        if owner_backward != OwnerBackward.PGAS or not self.owner_apply.covers(ticket.tbes):
            gap = self.owner_apply.gap or f"owner_backward={owner_backward.value!r}"
            raise PgasError(f"{self.kind}: a training step captured in a CUDA graph needs "
                            f"PgasTrainingConfig(owner_backward='pgas') covering every TBE ({gap}): FBGEMM's "
                            "backward reads the step's id count on the host")
        if ticket.epoch in self._errors.gave_up:
            raise self._errors.gave_up.pop(ticket.epoch)
        if ticket.epoch != self.looked_up or self.backwards.pending():  # the kernels take the last lookup's epoch
            raise PgasError(f"{self.kind}: a captured training step must run each sharding's forward once, then "
                            f"its backward (step {ticket.epoch}'s backward after lookup {self.looked_up})")
        siblings = tuple(o for o, _ in self.group.siblings_awaiting(self, ticket.epoch) if isinstance(o, DeviceStep))
        whole = self._exchange_kernels(grad, ticket.batch, siblings)
        self._update_kernels(ticket, self._state[StateWord.CTR_LOOKUP] % self.layout.num_slots, whole)
        torch.ops.torchrec_pgas.release_sources(*self._state_args(), 0)
        record_captured_backward(self, ticket)

    def _exchange_kernels(self, grad: torch.Tensor, batch: int, siblings: Sequence["DeviceStep"]) -> torch.Tensor:
        """The gradient exchange with nothing read on the host, for a CUDA graph (a captured training step's, or
        an eager step's: ``_replay_backward``): the epoch is the device's last lookup's, and ``siblings``' failures
        of the step fail it here too. Returns ``whole``: the device word that says every source sent its rows."""
        ops, args = torch.ops.torchrec_pgas, self._state_args()
        epoch = self._state[StateWord.CTR_LOOKUP]  # the replayed step's, on the device
        if siblings:  # as _adopt_sibling_failures, from device words
            failed = torch.cat([o.device_step_failed() for o in siblings]).any()
            at = (StateWord.STEP_FAILED + epoch % self.layout.num_slots).view(1)  # index_select, not [tensor]:
            self._state.index_put_((at,), torch.where(failed, epoch, self._state.index_select(0, at)))  # no read
        ops.grad_dist(self._sent_gradient(grad, batch), *args, 0, batch, gradient_divisor(self.world_size), False)
        ops.await_grads(*args, self._grad_flags, 0)
        return (self._grad_flags == 0).all()

    def _update_kernels(self, ticket: StepTicket, slot: Union[int, torch.Tensor], whole: torch.Tensor) -> None:
        """The owner update at capacity of the ids kept in ``slot`` (an int, or the device's), applied only where
        ``whole``, for a CUDA graph: the hyper-parameters are device words written before each replay."""
        lay = self.layout
        f_lo, f_hi = self.lookup_features
        rows = lay.max_batch if self._owners.variable_batch else ticket.batch
        if f_hi > f_lo and not self._update_held(ticket, slot, rows, whole, None):
            specs = [t.embedding_specs for t in ticket.tbes]
            raise PgasError(f"{self.kind}: the owner update op does not take the TBEs {specs} (or a "
                            f"{self.spec.out_dtype} gradient): they cannot train in a CUDA graph")

    def _sent_gradient(self, grad: torch.Tensor, batch: int) -> torch.Tensor:
        """The first ``batch`` rows of the output's gradient, in the output dtype, starting on 16 bytes (a view
        into its storage may not: grad_dist reads rows in 16-byte vectors)."""
        sent = grad[:batch].to(self.spec.out_dtype)
        return sent.clone() if sent.data_ptr() % 16 else sent

    def _held_columns(self) -> Tuple[int, int, int]:
        """The output columns of the features this rank holds (first, end) and the row width of a gradient
        block: what ``kept_grads`` reads."""
        f_lo, f_hi = self.lookup_features
        return self._descs[f_lo].out_col, self._descs[f_hi - 1].out_col + self._descs[f_hi - 1].dim, self.layout.dim_sum

    def device_step_failed(self) -> torch.Tensor:
        """Whether the step of this sharding's last lookup failed here: a one-element device bool."""
        epoch = self._state[StateWord.CTR_LOOKUP]
        return self._state.index_select(0, (StateWord.STEP_FAILED + epoch % self.layout.num_slots).view(1)).eq(epoch)

    def _adopt_sibling_failures(self, epoch: int) -> bool:
        """Make step ``epoch`` failed here where it failed in another sharding of the model whose backward has
        not run (a device-recorded bad id is recorded on its rank only): this rank's grad dist then gives
        up, so every peer refuses this sharding's step too. Device words, no sync; True where a sibling gave
        the step up on the host."""
        siblings = [other for other, _ in self.group.siblings_awaiting(self, epoch) if isinstance(other, DeviceStep)]
        if not siblings:
            return False
        failed = torch.stack([o.failed_word(epoch) for o in siblings]).eq(epoch).any()
        word = self.failed_word(epoch)
        word.copy_(torch.where(failed, epoch, word))
        return any(epoch in o._errors.gave_up for o in siblings)

    def failed_word(self, epoch: int) -> torch.Tensor:
        """The device word that holds the epoch of the last failed step in ``epoch``'s slot."""
        return self._state[StateWord.STEP_FAILED + epoch % self.layout.num_slots]

    def _backward_problem(self, epoch: int) -> Optional[PgasError]:
        """Why step ``epoch``'s gradients must not be applied (after the sync), if they must not: this rank's
        failure, a peer's (its flag), or the step's failure in another sharding of the model, the cause first
        (``StepGroup.step_error``)."""
        flags = self._grad_flags_host.tolist()
        if flags[self.world_size]:  # this rank's step failed: its record (or what it gave up for) says why
            err = self.group.step_error(self, epoch, self._errors.own_failure(epoch))
            return err or PgasError(f"{self.kind}: step {epoch} failed on rank {self.rank}")
        if any(flag in (1, 2) for flag in flags[:self.world_size]):
            self._errors.consume_refusal(epoch)
        return self.group.step_error(self, epoch, self._flagged_source(epoch, flags[:self.world_size]))

    def _flagged_source(self, epoch: int, flags: Sequence[int]) -> Optional[PgasError]:
        """The first source whose gradient flag refuses step ``epoch``: it gave the backward up (1), or this
        rank's wait for its gradients timed out (2)."""
        for src, flag in enumerate(flags):
            if flag == 1:
                return PgasPeerAbortError(f"rank {src} gave up on step {epoch} of {self.kind} (see its error): "
                                          "no rank applies its gradients")
            if flag == 2:
                return PgasTimeoutError(
                    f"rank {self.rank} waited {self.spec.config.wait_timeout_s:.1f}s (the step's deadline, from its "
                    f"first wait) for the gradients of step {epoch} from rank {src}: a peer crashed, diverged, or "
                    "skipped this step's backward")
        return None

    def step_failure(self, epoch: int) -> Optional[PgasError]:
        return self._errors.step_failure(epoch)

    def sync_forward(self, epoch: int) -> None:
        """Wait for step ``epoch``'s combine (the event recorded after it; its error record is then on the
        host). Not under a CUDA graph's capture, which records no errors to read."""
        if not torch.cuda.is_current_stream_capturing():
            self._slot_free[epoch % self.layout.num_slots].synchronize()

    def release(self, epoch: int) -> None:
        stream = self._await_slot(epoch)
        torch.ops.torchrec_pgas.release_sources(*self._state_args(), epoch)
        if not torch.cuda.is_current_stream_capturing():
            self._slot_free[epoch % self.layout.num_slots].record(stream)

    def trace_comm(self, records: int, step_bytes: int) -> torch.Tensor:
        """Start the comm timeline: an int64 ``[records, 2]`` buffer of (ns, cumulative remote bytes)
        that the next steps fill, one record per ``step_bytes`` (record 0: the step's start)."""
        if records < 1 or step_bytes < 1:
            raise ValueError(f"trace_comm: records {records} and step_bytes {step_bytes} must be >= 1")
        trace = torch.zeros(records, 2, dtype=torch.int64, device=self.device)
        # No step in flight (on any stream) while the trace words and the buffer change.
        torch.cuda.synchronize(self.device)
        self._trace = trace  # kept alive while the kernels hold its address
        self._state[StateWord.TRACE_BUF] = trace.data_ptr()
        self._state[StateWord.TRACE_STEP] = step_bytes
        self._state[StateWord.TRACE_CAP] = records
        self._state[StateWord.TRACE_BYTES] = 0
        self._set_trace(True)
        return trace

    def stop_trace(self) -> None:
        torch.cuda.synchronize(self.device)
        self._set_trace(False)

    def traced_remote_bytes(self) -> int:
        """Bytes this rank's kernels stored into other ranks' memory since ``trace_comm`` (syncs)."""
        return int(self._state[StateWord.TRACE_BYTES])

    def _set_trace(self, on: bool) -> None:
        """Launch the kernels' comm-timeline builds (or not) from the next step on."""
        self._config.copy_(as_tensor(self.layout.config(**self._config_args, trace=on)))
        self._graphs.clear()  # their kernels were captured with the config as it was

    def check(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        self.raise_recorded()

    def raise_recorded(self) -> None:
        """Raise (or warn about) the error records of finished steps, the earliest first; no sync. A step
        that waits for its backward keeps its record: the backward raises it."""
        self._errors.raise_finished(self.backwards.awaits)
