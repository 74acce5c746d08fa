"""One PGAS sharding's step: what it is built from (``StepSpec``) and the state every backend shares.

A step is three stages (index dist, lookup, combine; see ``torchrec_pgas/layout.py`` for the buffer they
share), and, when it trains, a backward. ``PgasStep`` holds the symmetric buffer, the signal pad, the
host-side checks that need no device sync, the FIFO stage counters and the steps that wait for their
backward; ``HostStep`` (``host_step.py``, the ``shm`` CPU backend) and ``DeviceStep`` (``device_step.py``,
the fused kernels) run the stages. ``stages.py`` plugs a step into TorchRec's ``EmbeddingSharding`` slots.

The backward of a step (both backends): the requester's gradient of its pooled output goes one-sided into
the gradient blocks of the owners that served its bags (a ``StepTicket`` carries the step through autograd:
``tickets.py``). Each owner reads back the ids it kept in the step's index blocks as stock TorchRec would have
handed them to its TBE (``kept_ids.py``) and applies the gradients through its owner backward (``owner_apply.py``).
A failed backward gives the step up in the model's other shardings too (``group.py``).
"""

import abc
import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed import comm_ops
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas.bootstrap import init_runtime
from torchrec_pgas.layout import StepLayout, id_bytes_for
from torchrec_pgas.sharding.group import GroupMember, StepGroup
from torchrec_pgas.sharding.kept_ids import ReceivedBlocks
from torchrec_pgas.sharding.owner_apply import OwnerApply
from torchrec_pgas.sharding.tickets import AwaitedBackwards, NoBackward, PoolFn, StepBackward, StepTicket
from torchrec_pgas.static_kjt import StaticKJT
from torchrec_pgas.types import PgasCapacityError, PgasConfig, PgasError, PgasInputError, PgasTrainingConfig


class BackwardGraphStats(NamedTuple):
    """How a sharding's eager backwards replayed CUDA graphs (``PgasTrainingConfig.eager_backward_graphs``, GPUs
    only)."""

    kept: int  # graphs kept: one per batch size, buffer slot and set of siblings, a bounded number
    captured: int  # graphs captured so far: more than ``kept`` where graphs were dropped and captured again
    replays: int  # eager backwards that replayed a graph


def gradient_divisor(world_size: int) -> float:
    """What stock's output dist divides the gradient by: the world size while TorchRec's gradient
    division is on (its default), else 1."""
    return float(world_size) if comm_ops.get_gradient_division() else 1.0


@dataclass(frozen=True)
class StepSpec:
    """Everything a sharding's step is built from, fixed when the module is sharded. Per-feature fields
    are in the sharding's feature order (TorchRec's grouping; table-wise: rank by rank)."""

    name: str  # unique per sharding: names its collective allocations
    kind: str  # PGAS_ROW_WISE, PGAS_TABLE_WISE or PGAS_TABLE_ROW_WISE
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

    @staticmethod
    def over_tables(name: str, kind: str, tables: Sequence[ShardedEmbeddingTable], owners: int, config: PgasConfig,
                    bounds_check_mode: BoundsCheckMode, out_dtype: torch.dtype, **table_wise: Tuple[int, ...]
                    ) -> "StepSpec":
        """The spec over ``tables``' features in order (TorchRec's grouped configs list them so), each table's rows
        in ``owners`` blocks of ``ceil(N / owners)`` (1: whole tables); ``table_wise``: its per-rank fields."""
        per_feature = [t for t in tables for _ in t.feature_names]
        return StepSpec(
            name=name,
            kind=kind,
            feature_names=tuple(f for t in tables for f in t.feature_names),
            feature_tables=tuple(t.name for t in per_feature),
            hash_sizes=tuple(t.num_embeddings for t in per_feature),
            dims=tuple(t.embedding_dim for t in per_feature),
            is_mean=tuple(t.pooling == PoolingType.MEAN for t in per_feature),
            shard_rows=tuple((t.num_embeddings + owners - 1) // owners for t in per_feature),
            weighted=any(t.is_weighted for t in tables),
            config=config,
            bounds_check_mode=bounds_check_mode,
            out_dtype=out_dtype,
            **table_wise,
        )

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @functools.cached_property
    def ids_capacity(self) -> int:
        """The most ids one rank may feed this sharding in one step (computed once: every step checks it)."""
        return self.config.ids_capacity(self.feature_tables)

    @functools.cached_property
    def _hash_size_tensors(self) -> Dict[torch.device, torch.Tensor]:
        """``hash_sizes`` as a tensor per device (each built once: every step's check reads it)."""
        return {}

    def bad_ids(self, kjt: KeyedJaggedTensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[Tuple[int, int]]]:
        """``kjt``'s ids (int64, features in this spec's order), which of them lie outside their feature's table,
        and the first such (feature, id), if any: a host read of the ids (the CPU path's check)."""
        values = kjt.values().to(torch.int64)
        per_feature = kjt.length_per_key()
        sizes = self._hash_size_tensors.get(values.device)
        if sizes is None:
            sizes = self._hash_size_tensors[values.device] = torch.tensor(self.hash_sizes, device=values.device)
        hash_per_id = torch.repeat_interleave(sizes, torch.tensor(per_feature, dtype=torch.int64, device=values.device),
                                              output_size=values.numel())
        bad = (values < 0) | (values >= hash_per_id)
        if not bool(bad.any()):
            return values, bad, None
        pos = int(torch.nonzero(bad)[0])
        return values, bad, (bisect.bisect_right(list(itertools.accumulate(per_feature)), pos), int(values[pos]))

    def bad_id_message(self, f: int, value: int) -> str:
        return (f"{self.kind}: feature '{self.feature_names[f]}' (table '{self.feature_tables[f]}') has id {value} "
                f"outside [0, {self.hash_sizes[f]})")

    def input_error(self, kjt: KeyedJaggedTensor, rank: int) -> Optional[PgasError]:
        """What is wrong with ``rank``'s next input against the buffers' limits, on host-known sizes (no device
        sync), if anything."""
        if kjt.variable_stride_per_key():
            return PgasInputError(f"{self.kind} does not support variable batch size per feature")
        batch, max_batch = kjt.stride(), self.config.max_local_batch_size
        if batch > max_batch:
            return PgasCapacityError(
                f"{self.kind}: local batch size {batch} exceeds PgasConfig.max_local_batch_size={max_batch}")
        # a static KJT's host-known count; a capture records the index dist whatever it holds: every rank's graph
        # then runs the same stages (and collectives), and the device refuses a batch past the capacity in each replay
        over = kjt.capacity_error() if isinstance(kjt, StaticKJT) and not _capturing(kjt) else None
        if over is not None:
            return PgasCapacityError(f"{self.kind}: rank {rank}: {over}")
        nnz = kjt.values().numel()
        if nnz > self.ids_capacity:
            return PgasCapacityError(
                f"{self.kind}: rank {rank} has {nnz} ids in one step, above the capacity of {self.ids_capacity} "
                "(PgasConfig.max_ids_per_rank / pooling_capacity / avg_pooling_capacity)")
        return None


def _capturing(kjt: KeyedJaggedTensor) -> bool:
    return kjt.values().is_cuda and torch.cuda.is_current_stream_capturing()


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
            ids_capacity=spec.ids_capacity,
            dim_sum=block_dim_sum,
            weighted=spec.weighted,
            id_bytes=id_bytes_for(spec.shard_rows),
            trainable=spec.config.training is not None,
        )
        self.rt = init_runtime(env.process_group, device=device, heap_hint=self.layout.nbytes)
        self.rank = self.rt.rank
        self.world_size = self.rt.world_size
        self.device = device
        self.buf = self.rt.alloc(spec.name, self.layout.nbytes)
        self.pad = self.rt.alloc_signals(spec.name, self.layout.num_signal_slots)
        self.received = ReceivedBlocks(self.layout, self.buf, self.world_size,
                                       spec.feature_names[slice(*self.lookup_features)])
        # each slot's first byte, beside the buffer: what the owner update at capacity reads its slot from
        slot_bases = torch.tensor([self.layout.index_block(s, 0) for s in range(self.layout.num_slots)],
                                  dtype=torch.int64, device=self.buf.local.device)
        self.owner_apply = OwnerApply(self.kind, spec.config.training or PgasTrainingConfig(), self.received, device,
                                      spec.out_dtype, slot_bases)
        self.issued = 0  # index dists issued (epochs are 1-based)
        self.looked_up = 0  # lookups completed
        self._input_order: Optional[List[int]] = None
        self.backwards = AwaitedBackwards(self.kind)  # training steps whose blocks their backward still needs
        self.group = StepGroup()  # the model's PGAS steps (its sharder joins them into one)
        self.group.join([self])
        self._anchor = torch.zeros((), requires_grad=True)  # makes a training step's output require grad

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

    def forward_failed(self, err: PgasError, epoch: int) -> None:
        """This step raised ``err`` for step ``epoch`` in the model's forward: the model's other PGAS steps
        consume that step too (``StepGroup.forward_failed``)."""
        self.group.forward_failed(self, epoch, err)

    def sync_forward(self, epoch: int) -> None:
        """Wait until the forward of step ``epoch`` has run here, so that its errors are known: the host path
        has run it (and raised them) by the time the call returned."""

    @abc.abstractmethod
    def share_deadlines(self, leader: GroupMember) -> None:
        """Wait against ``leader``'s deadlines (the model's first PGAS step): one deadline a step of the model."""

    def consume_failed_step(self, epoch: int, err: PgasError) -> None:
        """A sibling sharding failed step ``epoch`` in the model's forward: this step's stages of it that did
        not run will not (``forward_failed``): each backend consumes them here, so that the model's shardings run
        the next batch at the next epoch."""

    def claim_slot(self) -> int:
        """The epoch of the next index dist, once its buffer slot is free on this rank: the step that last
        used it has had its lookup (and backward, if it trains). Releases the slots of dropped steps."""
        epoch, lay = self.issued + 1, self.layout
        if self.issued - self.looked_up >= lay.num_slots:
            raise PgasError(f"{self.kind}: {self.issued - self.looked_up} index dists are already in flight; "
                            f"at most {lay.num_slots} may run ahead of the lookup")
        for dropped in self.backwards.take_dropped():
            self.abandon_backward(dropped)
        if self.backwards.awaits(epoch - lay.num_slots):
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
        what a backward needs (``PgasConfig.training`` is set)."""
        return torch.is_grad_enabled() and self.layout.trainable

    def forward_output(self, out: torch.Tensor, ticket: Optional[StepTicket]) -> torch.Tensor:
        """``out`` as a step's output: with ``ticket`` (a training step), its backward runs this step's
        (``backward``); with grad enabled on a layout that cannot train, a backward raises."""
        if ticket is not None:
            self.backwards.issue(ticket)
            return StepBackward.apply(self._anchor, out, self, ticket)
        if torch.is_grad_enabled():
            return NoBackward.apply(out.requires_grad_(), self.kind)
        return out

    def backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """The step's backward on this rank: send the gradient, and, as owner, apply its sources'. A step
        that failed changes nothing: not its weights, nor (unless a later forward moved them since) its
        TBEs' iteration counters."""
        self.backwards.begin(ticket)
        try:
            self.run_backward(ticket, grad.contiguous())
        except Exception as err:
            self.group.give_up_backward(self, ticket, err)
            raise

    def abandon_backward(self, epoch: int) -> None:
        """Release step ``epoch``'s slot if the step still awaits its backward, which will not run."""
        if self.backwards.abandon(epoch):
            self.release(epoch)

    @abc.abstractmethod
    def run_backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        """Exchange the gradients of ``ticket``'s step and apply the received ones; release its slot."""

    def step_failure(self, epoch: int) -> Optional[PgasError]:
        """Step ``epoch``'s error on this rank if the step failed, consumed (its backward would raise it).
        The host path raises its errors in the forward, so none is left by the time of a backward."""
        return None

    @abc.abstractmethod
    def release(self, epoch: int) -> None:
        """Tell every source that this rank is done with its blocks of step ``epoch``."""

    @property
    def backward_graph_stats(self) -> BackwardGraphStats:
        """This sharding's eager backwards replayed as CUDA graphs: none here (``DeviceStep`` replays them)."""
        return BackwardGraphStats(0, 0, 0)

    def read_input_order(self, order: Sequence[int]) -> None:
        """Take the module's KJT in its input order: feature f of this sharding is input feature
        ``order[f]`` (``ShardedEmbeddingBagCollection`` would otherwise permute a copy each step)."""
        if sorted(order) != list(range(self.spec.num_features)):
            raise PgasError(f"{self.kind}: input feature order {list(order)} is not a permutation of "
                            f"the sharding's {self.spec.num_features} features")
        self._input_order = list(order)

    def in_sharding_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The local KJT in this sharding's feature order (what the index dist and lookup take); a static KJT's
        batch without its unused positions (one past its capacity stays whole: the index dist refuses it)."""
        if isinstance(kjt, StaticKJT):
            if kjt.capacity_error() is not None:
                return kjt
            kjt = kjt.unpadded()
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

    def last_step_refused(self) -> Optional[torch.Tensor]:
        """Whether the last training step (forward and backward) was refused on any rank, as a one-element device
        bool that no host reads; None on the host path, whose refused steps raise in their forward."""
        return None

    def earliest_recorded(self) -> Optional[int]:
        """The earliest finished step whose error the device recorded (no sync; the backward raises a step that
        waits for it), None if none; the host path raises its errors as they happen."""
        return None

    def take_recorded(self, epoch: int) -> Optional[PgasError]:
        """Step ``epoch``'s recorded error, consumed (``StepGroup.raise_recorded`` raises it), unless the step waits
        for its backward here (the backward raises it)."""
        return None

    def synchronize(self) -> None:
        """Wait for the step's device work (its error records are then complete); nothing where stages raise."""
