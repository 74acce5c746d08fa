"""The fused GPU kernels of a PGAS step (the ``nvshmem`` backend), for both shardings.

Table-wise is the one-owner case of row-wise (``csrc/step_protocol.cuh``): a
row-wise table is W row blocks of ``ceil(N/W)`` rows on ranks ``0..W-1``, a
table-wise table one block of N rows on its owner. ``DeviceStep`` describes
each feature that way (``FeatureOwners``, one ``FeatureDesc`` per feature) and
launches the same three kernels per step (index dist, pooled lookup, combine
partials) on the current stream, whatever the number of tables: no host sync,
graph capturable.

A training step's backward (``csrc/grad_exchange.cu``, ``device/backward.py``): the gradient rows go to the owners
that served each bag, the owner applies them, and a step that failed on any rank (device-side errors are recorded,
not raised) changes no weight: its backward raises the error on every rank instead. FBGEMM's path rebuilds the kept
ids at the one host sync (the id count FBGEMM's backward needs, which brings the step's error record and the
sources' flags along) and replays the stock lookup under autograd. The owner update op (``OwnerBackward.PGAS``, the
default) needs no id count: the owner lays its ids out at a fixed capacity (``ReceivedBlocks.kept_ids_padded``) and
the op applies nothing where a device word says the step failed on some rank (an eager step past
``PgasTrainingConfig.max_padded_eager_ids`` reads each TBE's id count instead, and lays out exactly those ids). An
eager step at capacity launches it before reading the flags (the host waits for the exchange, not for the update),
and under CUDA-graph capture (``torchrec_pgas.CapturedTrainStep``) the
backward reads nothing on the host: its kernels take each replay's epoch from the device. Those kernels also serve
eager steps that follow their own forward, replayed as one graph (``PgasTrainingConfig.eager_backward_graphs``). The kernels' feature table is ``device/features.py``, their error
records ``device/errors.py``, the comm timeline ``device/tracing.py``.
"""

from typing import List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.runtime import one_host
from torchrec_pgas.sharding.capture import record_captured_backward, record_captured_step
from torchrec_pgas.sharding.device.backward import DeviceBackward, last_training_step_refused
from torchrec_pgas.sharding.device.errors import ErrorRecords
from torchrec_pgas.sharding.device.features import (
    BOUNDS_MODES,
    FeatureOwners,
    bind_lookup_weights,
    column_features,
    feature_descs,
)
from torchrec_pgas.sharding.device.slots import SlotEvents
from torchrec_pgas.sharding.device.tracing import CommTrace
from torchrec_pgas.sharding.group import GroupMember
from torchrec_pgas.sharding.step import BackwardGraphStats, PgasStep, StepSpec
from torchrec_pgas.sharding.tbe_counters import advance_tbe_iterations
from torchrec_pgas.sharding.tickets import PoolFn, StepTicket
from torchrec_pgas.step_abi import FeatureDesc, StateWord, as_tensor, as_words
from torchrec_pgas.types import PgasError


class DeviceStep(PgasStep):
    """Three fused kernel launches per forward on the current stream, no host sync; a backward's one wait is
    for the gradient exchange (``DeviceBackward``).

    Device-side errors (bad ids, batch mismatch, timeouts, a peer's abort) land
    in a pinned ``ErrorRecord`` that the next step reads without syncing;
    ``check()`` synchronizes first. The tensors every stage op shares
    (``state_args``) are public to the backward.
    """

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device, owners: FeatureOwners) -> None:
        super().__init__(spec, env, device, block_dim_sum=sum(spec.dims))
        owners.check(self.world_size, self.rank)
        lay = self.layout
        self._peers = _peer_table(self)
        # Weights are bound from the TBEs at the first lookup, input features by read_input_order.
        self.descs = feature_descs(spec.shard_rows, spec.hash_sizes, spec.dims, owners)
        self._features = as_words(self.descs, FeatureDesc).to(device)
        self._col_feature = column_features(spec.dims, device)
        self.state_words = torch.zeros(StateWord.STATE_WORDS, dtype=torch.int64, device=device)
        self._bag_div = torch.zeros(lay.num_slots, lay.num_features * lay.max_batch, device=device)
        self.errors = ErrorRecords(self.kind, self.rank, lay.num_slots, spec.bounds_check_mode, spec.bad_id_message)
        self.grad_flags = torch.zeros(self.world_size + 1, dtype=torch.int64, device=device)
        self.grad_flags_host = torch.zeros(self.world_size + 1, dtype=torch.int64).pin_memory()
        # [slot, source]: the int64 word of the buffer that holds the source's batch (its index block's header)
        self.batch_words = torch.tensor([[(lay.index_block(slot, src) + lay.header_off + 8) // 8 for src in
                                          range(self.world_size)] for slot in range(lay.num_slots)], device=device)
        self.owners = owners
        self._config_args = dict(timeout_ns=int(spec.config.wait_timeout_s * 1e9), rank=self.rank,
                                 bounds_mode=BOUNDS_MODES[spec.bounds_check_mode],
                                 lookup_features=owners.lookup, variable_batch=owners.variable_batch)
        self._config = as_tensor(lay.config(**self._config_args))
        self._max_dim = max(spec.dims[owners.lookup[0]:owners.lookup[1]], default=4)
        self._tbe_key: List[int] = [-1]
        # The stream of this step's last index dist if no lookup was issued since (see lookup).
        self._dist_stream: Optional[torch.cuda.Stream] = None
        self._slots = SlotEvents(lay.num_slots, device)  # free again after a combine or a backward's release
        self.backward_runner = DeviceBackward(self)
        self.comm_trace = CommTrace(self.state_words, self._set_trace)  # torchrec_pgas.trace_comm
        self._deadline_owner: Optional[torch.Tensor] = None  # the state whose deadline words the waits use
        self._owed_lookups: Set[int] = set()  # refused steps whose (empty) lookup waits for an earlier one

    def share_deadlines(self, leader: GroupMember) -> None:
        """The waits use the deadline words of ``leader``'s state (csrc/step_protocol.cuh: one deadline a step
        of the model, whichever sharding's wait it is; its stages run on the same stream as this one's)."""
        shared = leader is not self and isinstance(leader, DeviceStep) and leader.device == self.device
        words = leader.state_words if shared and isinstance(leader, DeviceStep) else None
        self._deadline_owner = words  # kept alive while the kernels read its words
        at = words.data_ptr() + 8 * int(StateWord.STEP_DEADLINE) if words is not None else 0
        self.state_words[StateWord.DEADLINE_AT] = at

    def read_input_order(self, order: Sequence[int]) -> None:
        """The index dist reads feature f's bags at KJT feature ``order[f]`` (no permuted copy)."""
        super().read_input_order(order)
        for desc, f in zip(self.descs, order):
            desc.input_feature = f
        self._features.copy_(as_words(self.descs, FeatureDesc))

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return kjt  # the kernels read through the order; the lookup only needs the batch

    def state_args(self) -> Tuple[torch.Tensor, ...]:
        """What every stage op takes after its own inputs: the buffers, peers, features and device state."""
        return (self.buf.local, self.pad.words, self._peers, self._features, self.state_words, self._bag_div,
                self.errors.status, self._config)

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        self.group.deferred.settle()  # a backward that raised elsewhere left its checks
        self.group.raise_records(self)
        epoch = self.claim_slot()
        err = self.spec.input_error(kjt, self.rank)
        stream = self._slots.wait(epoch)
        if err is not None:
            self._give_up(err, epoch)
        else:
            weights = kjt.weights_or_none()
            try:
                torch.ops.torchrec_pgas.index_dist(
                    kjt.values(), kjt.offsets().to(torch.int64), weights.float() if weights is not None else None,
                    *self.state_args(), kjt.stride(), False, self.trains(),
                )
            except RuntimeError as e:
                raise self.fail(PgasError(f"{self.kind} index dist failed to launch: {e}"), epoch) from e
        self.issued = epoch
        self._dist_stream = stream

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
                                           *self.state_args(), 0, True, False)
        self.errors.gave_up[epoch] = err

    def consume_failed_step(self, epoch: int, err: PgasError) -> None:
        """Step ``epoch`` was refused in the model's forward on every rank (``pgas_table_row_wise``'s input check),
        or a sibling's launch failed here (the peers' kernels then see this rank's abort): run this sharding's
        stages of it that did not run, empty (as ``_give_up``), so that its epochs stay the model's."""
        if self.looked_up >= epoch or self.issued < epoch - 1:
            return
        if self.issued < epoch:
            self.claim_slot()
            self._slots.wait(epoch)
            self._give_up(PgasError(f"{self.kind}: step {epoch} was refused: {err}"), epoch)
            self.issued = epoch
        self._owed_lookups.add(epoch)
        self._look_up_owed()

    def _look_up_owed(self) -> None:
        """Look up, empty, the refused steps next in epoch order (a train pipeline's input dist runs a step ahead
        of the lookup: a refused step waits behind the pending one). No backward comes: the lookup releases the
        slot, and the step's record is dropped (the forward raised its cause)."""
        ops = torch.ops.torchrec_pgas
        while self.looked_up + 1 in self._owed_lookups:
            epoch = self.next_lookup_epoch()
            self._owed_lookups.discard(epoch)
            ops.pooled_lookup(*self.state_args(), 0, self._max_dim, self.spec.out_dtype, False, True)
            ops.combine_partials(*self.state_args(), self._col_feature, 0, self.spec.out_dtype)
            self._slots.record(epoch)
            self.sync_forward(epoch)
            self.errors.step_failure(epoch)

    def _bind_weights(self, tbes: Sequence[nn.Module]) -> None:
        """Point the feature table at the TBEs' weight storage (again only if it moved).

        The TBEs hold the features of this rank's lookup range, in order. Per
        step this costs one pointer read per TBE group, not per table.
        """
        key = [t.weights_dev.data_ptr() for t in tbes]
        if key == self._tbe_key:
            return
        bind_lookup_weights(self.descs, tbes, self.lookup_features, self.spec)
        self._features.copy_(as_words(self.descs, FeatureDesc))
        self._tbe_key = key

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        self._look_up_owed()
        epoch = self.next_lookup_epoch()
        trains = self.trains()
        batch = 0 if epoch in self.errors.gave_up else kjt.stride()
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
            ops.pooled_lookup(*self.state_args(), batch, self._max_dim, self.spec.out_dtype, after_exit, not trains)
            profiling.mark("lookup")
            out = ops.combine_partials(*self.state_args(), self._col_feature, batch, self.spec.out_dtype)
            if batch != kjt.stride():  # a given-up step: the forward's shape, its error raised later
                out = torch.zeros(kjt.stride(), self.layout.dim_sum, dtype=self.spec.out_dtype, device=self.device)
        except PgasError as e:  # peers wait for this rank's pooled rows: abort them
            raise self.fail(e, epoch)
        except RuntimeError as e:
            raise self.fail(PgasError(f"{self.kind} lookup failed to launch: {e}"), epoch) from e
        self._slots.record(epoch)
        iters = advance_tbe_iterations(tbes)
        if torch.cuda.is_current_stream_capturing():
            record_captured_step(self, tbes, iters)
        return self.forward_output(out, StepTicket(epoch, batch, pool, iters, tbes) if trains else None)

    def run_backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        if torch.cuda.is_current_stream_capturing():
            self.backward_runner.captured(ticket, grad)
            record_captured_backward(self, ticket)
            return
        self.backward_runner.run(ticket, grad)

    @property
    def backward_graph_stats(self) -> BackwardGraphStats:
        """The graphs of its eager backward this sharding keeps (at most ``MAX_BACKWARD_GRAPHS``), has
        captured, and replayed."""
        return self.backward_runner.replay.cache.stats

    def device_siblings(self, epoch: int) -> Tuple["DeviceStep", ...]:
        """The model's other GPU shardings whose step ``epoch`` awaits its backward."""
        return tuple(o for o, _ in self.group.siblings_awaiting(self, epoch) if isinstance(o, DeviceStep))

    def deferred_siblings(self, epoch: int) -> Tuple["DeviceStep", ...]:
        """The model's other GPU shardings whose backward of step ``epoch`` ran, its check deferred and not read
        yet: their device words are still that step's (a later backward of theirs reads the check first)."""
        return tuple(o for o in self.group.deferred_siblings(self, epoch)
                     if isinstance(o, DeviceStep) and self.group.deferred.known(o, epoch) is None)

    def step_failure(self, epoch: int) -> Optional[PgasError]:
        return self.errors.step_failure(epoch)

    def sync_forward(self, epoch: int) -> None:
        """Wait for step ``epoch``'s combine (the event recorded after it; its error record is then on the
        host). Not under a CUDA graph's capture, which records no errors to read."""
        self._slots.synchronize(epoch)

    def release(self, epoch: int) -> None:
        stream = self._slots.wait(epoch)
        torch.ops.torchrec_pgas.release_sources(*self.state_args(), epoch)
        self._slots.record(epoch, stream)

    def _set_trace(self, on: bool) -> None:
        """Launch the kernels' comm-timeline builds (or not) from the next step on."""
        self._config.copy_(as_tensor(self.layout.config(**self._config_args, trace=on)))
        self.backward_runner.replay.cache.clear()  # their kernels were captured with the config as it was

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def last_step_refused(self) -> Optional[torch.Tensor]:
        return last_training_step_refused(self)

    def earliest_recorded(self) -> Optional[int]:
        return self.errors.earliest_finished(self.backwards.awaits)

    def take_recorded(self, epoch: int) -> Optional[PgasError]:
        return self.errors.take_finished(epoch, self.backwards.awaits)


def _peer_table(step: PgasStep) -> torch.Tensor:
    """``[2, W]``: each peer's address of this rank's buffer and signal pad (NVSHMEM peer pointers of the peers'
    PEs: a node step's peers are its node's), checked reachable by load/store."""
    ops, rt = torch.ops.torchrec_pgas, step.rt
    one_host(rt.hosts, step.kind)  # our message, not a null peer pointer's, for a job beyond one host
    peers = [[ops.peer_ptr(step.buf.local, rt.pe(p)) for p in range(step.world_size)],
             [ops.peer_ptr(step.pad.words, rt.pe(p)) for p in range(step.world_size)]]
    unreachable = [p for p, ptr in enumerate(peers[0]) if ptr == 0]
    if unreachable:
        raise PgasError(f"ranks {unreachable} are not reachable by load/store from rank {step.rank} "
                        f"({step.kind} needs its peers in one NVLink domain; beyond it, plan pgas_table_row_wise "
                        "or a stock type)")
    return torch.tensor(peers, dtype=torch.int64, device=step.device)
