"""The host path of a PGAS step: the algorithm over the runtime API (put, signal, wait) with torch ops and
the stock TBE lookup. It is what the ``shm`` CPU backend runs, a real implementation of the same three
stages the fused kernels run on GPUs (``device_step.py``).

``HostRwStep`` (``pgas_row_wise``), for W ranks with local batch B and the F features of the sharding:

1. index dist (requester): bucketize each local bag's ids by owning rank
   (local row = id - owner * block) and put ids, lengths and weights into the
   owner's index block for this source; then signal the owner.
2. lookup (owner): for every source, remote ones first, wait for its signal,
   pool the received bags with the stock TBE lookup and put the partial pooled
   ``[B, D]`` block straight into the requester's output block for this owner;
   then signal the requester.
3. combine (requester): wait for the W owners, sum the partials in rank order,
   apply mean pooling.

``HostTwStep`` (``pgas_table_wise``): table t lives whole on its owner, and TorchRec's TW orders the
features rank by rank, so owner d's features are one contiguous range. The requester puts that range's
lengths, ids and weights into d's index block (no bucketize, no splits exchange); the owner pools each
source's bags at that source's batch (from its header: ranks may feed different local batch sizes, as stock
TW allows) with the stock TW lookup (MEAN included) and puts the ``[B_src, D_owner]`` block into the
source's output block; the owners' blocks side by side, in rank order, are the stock TW output.

Backward (``PgasStep``): the requester puts its gradient into every owner's gradient block (row-wise: the
whole ``[B, D]`` block, divided by the MEAN divisor and the gradient division as stock's autograd does;
table-wise: the owner's columns), signals ``2 * epoch``, and waits for its sources' gradients; the owner
applies them to the ids it kept (the owner update's CPU path, or FBGEMM's through a replayed stock lookup:
``PgasStep``), then releases the step's blocks. Any error raises during the
forward on every rank (the failing rank aborts the step), so a failed step never reaches a backward.
"""

import abc
import itertools
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.layout import StepLayout
from torchrec_pgas.sharding.group import GroupMember
from torchrec_pgas.sharding.step import PgasStep, StepSpec, gradient_divisor
from torchrec_pgas.sharding.tbe_counters import advance_tbe_iterations, iterations_kept, sync_tbe_iterations
from torchrec_pgas.sharding.tickets import PoolFn, StepTicket
from torchrec_pgas.runtime import PAD_HEADER_WORDS, PgasRuntime, SignalPad, SymmetricBuffer
from torchrec_pgas.types import PgasError, PgasInputError, PgasTimeoutError

MEAN_EPS: float = 1e-6  # TorchRec's RW mean divisor guard (embeddingbag.py)


class StepDeadlines:
    """One deadline for every wait of a step, forward and backward: ``timeout_s`` from the step's first wait
    (``PgasConfig.wait_timeout_s``). A stalled peer so fails the step once, after the configured time,
    whichever of the step's waits it stalls (csrc/step_protocol.cuh keeps the same rule on GPUs)."""

    _KEPT = 16  # steps whose first wait is remembered: more than a step's slots and pipelines keep in flight

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._first_wait: Dict[int, float] = {}

    def left(self, epoch: int) -> float:
        """Seconds the next wait of step ``epoch`` may take (its first wait starts the clock)."""
        now = time.monotonic()
        start = self._first_wait.setdefault(epoch, now)
        for old in [e for e in self._first_wait if e <= epoch - self._KEPT]:
            del self._first_wait[old]
        return max(0.0, start + self.timeout_s - now)

    def waited(self, epoch: int) -> float:
        """Seconds since step ``epoch``'s first wait."""
        return time.monotonic() - self._first_wait.get(epoch, time.monotonic())

    def wait(self, rt: PgasRuntime, pad: SignalPad, slots: Dict[int, int], value: int, epoch: int, what: str) -> None:
        """Wait until the pad's slot of every peer (``slots``: peer -> slot) reaches ``value``, within step
        ``epoch``'s deadline; a timeout names the peers still missing and how long the step has waited."""
        try:
            rt.wait(pad, list(slots.values()), value, self.left(epoch), what, step=epoch)
        except PgasTimeoutError as e:
            words = pad.words[PAD_HEADER_WORDS:].tolist()
            missing = [peer for peer, slot in slots.items() if words[slot] < value]
            raise PgasTimeoutError(
                f"rank {rt.rank} waited {self.waited(epoch):.1f}s (step {epoch}'s deadline, "
                f"wait_timeout_s={self.timeout_s:g} from its first wait) for {what} from rank(s) "
                f"{missing}: a peer crashed, diverged, or is not running this step") from e


def received_index_block(buf: SymmetricBuffer, lay: StepLayout, src: int, src_block: int, keys: Sequence[str],
                         key_rows: Sequence[int], nnz: int, batch: int) -> KeyedJaggedTensor:
    """Source ``src``'s index block as a KJT for the stock lookup, after checking what the peer wrote: lengths
    sum to ``nnz`` and are >= 0, and every id is a row this rank holds (``key_rows`` per key). The TBE's own
    bounds check follows the user's mode, which may be off; these decide what is read."""
    lengths = buf.view(torch.int32, src_block + lay.lengths_off, len(keys) * batch)
    ids = buf.view(lay.id_dtype, src_block + lay.ids_off, nnz).to(torch.int64)
    if bool((lengths < 0).any()) or int(lengths.sum()) != nnz:
        raise PgasError(f"corrupt index lengths from rank {src}: negative, or not summing to {nnz}")
    per_key = lengths.view(len(keys), batch).sum(1)
    limit = torch.repeat_interleave(torch.tensor(list(key_rows), dtype=torch.int64), per_key.to(torch.int64))
    if bool(((ids < 0) | (ids >= limit)).any()):
        raise PgasError(f"corrupt index data from rank {src}: a row outside this rank's shard")
    return KeyedJaggedTensor(keys=list(keys), values=ids, lengths=lengths.to(torch.int64), stride=batch,
                             weights=buf.view(torch.float32, src_block + lay.weights_off, nnz) if lay.weighted else None)


class HostStep(PgasStep):
    """What both host shardings share: checks of the local input, of what peers wrote, and the waits."""

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device, block_dim_sum: int) -> None:
        super().__init__(spec, env, device, block_dim_sum)
        self._warned: set = set()
        self._deadlines = StepDeadlines(spec.config.wait_timeout_s)

    def _wait(self, signal: Callable[[int], int], peers: Sequence[int], value: int, epoch: int, what: str) -> None:
        """Wait until ``signal(peer)`` of every peer reaches ``value``, within step ``epoch``'s deadline."""
        self._deadlines.wait(self.rt, self.pad, {peer: signal(peer) for peer in peers}, value, epoch, what)

    def share_deadlines(self, leader: GroupMember) -> None:
        if isinstance(leader, HostStep):
            self._deadlines = leader._deadlines

    def _order(self) -> List[int]:
        """Remote peers first (their bytes travel), this rank last."""
        return [(self.rank + 1 + k) % self.world_size for k in range(self.world_size)]

    def begin_index_dist(self, kjt: KeyedJaggedTensor) -> Tuple[int, torch.Tensor]:
        """The next step's epoch and its checked ids, once every owner has released this rank's blocks of
        the step that last used the slot. Bad input gives the step up on every rank (it raises here, and
        peers raise at their waits for this rank) and consumes its epoch, so the next step runs; so does a
        peer's abort seen while waiting for the slot (a peer that gave the step up already)."""
        epoch = self.claim_slot()
        err = self.spec.input_error(kjt, self.rank)
        values = self._checked_ids(kjt, epoch) if err is None else None
        if err is not None or values is None:
            raise self._give_up(err or PgasError(f"{self.kind}: no ids"), epoch)
        lay = self.layout
        if epoch > lay.num_slots:
            try:
                self._wait(lay.release_signal, range(self.world_size), epoch - lay.num_slots, epoch,
                           "the release of this rank's blocks")
            except PgasError as peer_err:  # a peer gave the step up (its abort wakes this wait) or died
                raise self._give_up(peer_err, epoch)
        self.issued = epoch
        return epoch, values

    def _give_up(self, err: PgasError, epoch: int) -> PgasError:
        self.fail(err, epoch)
        self.issued = max(self.issued, epoch)  # a sibling's failed step may lie behind index dists run ahead
        self.looked_up = epoch
        self.release(epoch)
        return err

    def consume_failed_step(self, epoch: int, err: PgasError) -> None:
        """Give step ``epoch`` up here too if its lookup has not run: abort it (a peer waiting on this rank
        for this sharding's ids or output raises instead of waiting) and release its blocks, as a step that
        fails its own index dist does. A step whose lookup ran keeps its output: the dropped autograd graph
        releases it."""
        if self.looked_up >= epoch or self.issued < epoch - 1:
            return
        self._give_up(PgasError(f"{self.kind}: another sharding of the model failed step {epoch}: {err}"), epoch)

    def release(self, epoch: int) -> None:
        for src in self._order():
            self.rt.signal(self.pad, src, self.layout.release_signal(self.rank), epoch)

    def _checked_ids(self, kjt: KeyedJaggedTensor, epoch: int) -> torch.Tensor:
        """The ids after the bounds mode (ids decide the owner and the remote address); FATAL gives the
        step up."""
        values, bad, first = self.spec.bad_ids(kjt)
        if first is None:
            return values
        f = first[0]
        msg = self.spec.bad_id_message(*first)
        if self.spec.bounds_check_mode == BoundsCheckMode.FATAL:
            raise self._give_up(PgasInputError(msg), epoch)
        if self.spec.bounds_check_mode == BoundsCheckMode.WARNING and f not in self._warned:
            self._warned.add(f)
            warnings.warn(msg + "; such ids read row 0 (BoundsCheckMode.WARNING)")
        return torch.where(bad, torch.zeros_like(values), values)

    def _put_index_block(self, dest: int, block: int, epoch: int, batch: int, lengths: torch.Tensor,
                         ids: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        """Put one owner's share of this step (compacted: offsets are the prefix sums of ``lengths``), then
        signal it."""
        lay = self.layout
        header = torch.tensor([epoch, batch, ids.numel(), 0], dtype=torch.int64)
        self.rt.put(self.buf, dest, block + lay.header_off, header)
        self.rt.put(self.buf, dest, block + lay.offsets_off, torch.ops.fbgemm.asynchronous_complete_cumsum(lengths))
        self.rt.put(self.buf, dest, block + lay.lengths_off, lengths.to(torch.int32))
        self.rt.put(self.buf, dest, block + lay.ids_off, ids.to(lay.id_dtype))
        if lay.weighted:
            assert weights is not None
            self.rt.put(self.buf, dest, block + lay.weights_off, weights.float())
        self.rt.signal(self.pad, dest, lay.index_signal(self.rank), epoch)

    def _source_index(self, src: int, epoch: int) -> Tuple[int, int, int]:
        """Wait for ``src``'s index block of ``epoch``; its (offset, batch, nnz) once the header checks out
        (it decides what is read, so it is checked like any address)."""
        lay = self.layout
        self._wait(lay.index_signal, [src], epoch, epoch, "index data")
        block = lay.index_block(epoch % lay.num_slots, src)
        h_epoch, h_batch, nnz, _ = self.buf.view(torch.int64, block + lay.header_off, 4).tolist()
        self.rt.check()
        if h_epoch != epoch or not 0 <= h_batch <= lay.max_batch or not 0 <= nnz <= lay.ids_capacity:
            raise self.fail(PgasError(
                f"corrupt index header from rank {src}: epoch {h_epoch}, batch {h_batch}, nnz {nnz}"), epoch)
        return block, h_batch, nnz

    def _await_outputs(self, epoch: int, what: str) -> None:
        """Wait until every owner has written this rank's output block of ``epoch``."""
        lay = self.layout
        self._wait(lay.output_signal, range(self.world_size), epoch, epoch, what)

    def _received(self, src: int, src_block: int, keys: Sequence[str], key_rows: Sequence[int], nnz: int,
                  batch: int, epoch: int) -> KeyedJaggedTensor:
        """Source ``src``'s index block as a KJT for the stock lookup (``received_index_block``)."""
        try:
            return received_index_block(self.buf, self.layout, src, src_block, keys, key_rows, nnz, batch)
        except PgasError as e:
            raise self.fail(e, epoch)

    def lookup(self, kjt: KeyedJaggedTensor, pool: PoolFn, tbes: Sequence[nn.Module]) -> torch.Tensor:
        epoch = self.next_lookup_epoch()
        trains = self.trains()
        try:
            with iterations_kept(tbes):
                out, kept = self.serve_and_combine(kjt, pool, epoch, release=not trains)
        except BaseException:
            self.release(epoch)  # no backward will come for this step
            raise
        after = advance_tbe_iterations(tbes)
        ticket = StepTicket(epoch, kjt.stride(), pool, after, tbes, host=kept) if trains else None
        return self.forward_output(out, ticket)

    @abc.abstractmethod
    def serve_and_combine(self, kjt: KeyedJaggedTensor, pool: PoolFn, epoch: int,
                          release: bool) -> Tuple[torch.Tensor, Any]:
        """Stages 2 and 3 of ``epoch``: the output, and what the backward keeps (releasing each source
        once served when ``release``)."""

    def _serve(self, src: int, epoch: int, out_block: Optional[torch.Tensor], release: bool) -> None:
        """Put this owner's block of ``src``'s output (if any), then signal (and release) ``src``."""
        lay = self.layout
        if out_block is not None:
            self.rt.put(self.buf, src, lay.output_block(epoch % lay.num_slots, self.rank), out_block)
        self.rt.signal(self.pad, src, lay.output_signal(self.rank), epoch)
        if release:
            self.rt.signal(self.pad, src, lay.release_signal(self.rank), epoch)

    def run_backward(self, ticket: StepTicket, grad: torch.Tensor) -> None:
        lay, epoch = self.layout, ticket.epoch
        slot = epoch % lay.num_slots
        try:
            self._send_gradients(ticket, grad, slot)
            self._await_gradients(epoch)
            profiling.mark("grad_exchange")
            with self.owner_apply.applying(ticket.tbes):
                self._apply(ticket, slot)
        finally:
            self.release(epoch)

    def _apply(self, ticket: StepTicket, slot: int) -> None:
        """The owner update op at capacity or at the count where it serves, else the kept ids as a KJT and their
        apply (the host path raised any failure of the step before its backward: the step is whole here)."""
        rows, block_features, columns, batches = self.owner_view(ticket)
        apply = self.owner_apply
        if (block_features[1] and rows > 0 and apply.op_serves(ticket)
                and apply.update(ticket, slot, rows, block_features, columns, batches,
                                 torch.ones((), dtype=torch.bool), ticket.tbe_iters,
                                 at_count=not apply.at_capacity(ticket))):
            sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)
            return
        kjt = self.received.kept_ids(ticket.epoch, rows, block_features, batches)
        profiling.mark("kept_ids")
        grads = self.received.kept_grads(slot, rows, columns, self.spec.out_dtype)
        apply.apply_at_count(ticket, kjt, grads)

    def _send_gradients(self, ticket: StepTicket, grad: torch.Tensor, slot: int) -> None:
        """Put this rank's gradient rows into every owner's gradient block, then signal the owners: only once
        every put has landed, so that an owner never applies a step this rank failed to send whole. A failure
        here aborts the step on every peer (they raise ``PgasPeerAbortError``, nothing is applied anywhere)."""
        lay, epoch = self.layout, ticket.epoch
        try:
            for dest, rows in self.gradient_blocks(grad, ticket):
                if rows.dtype != self.spec.out_dtype or rows.numel() * rows.element_size() > lay.output_block_bytes:
                    raise PgasError(f"{self.kind}: step {epoch}'s gradient for rank {dest} is {tuple(rows.shape)} "
                                    f"{rows.dtype}, not within a {lay.output_block_bytes}-byte "
                                    f"{self.spec.out_dtype} gradient block")
                if rows.numel():
                    self.rt.put(self.buf, dest, lay.grad_block(slot, self.rank), rows)
        except Exception as e:  # noqa: BLE001 - any failure (an OOM too) gives the step up on every rank
            raise self.fail(PgasError(f"{self.kind} backward of step {epoch} failed on rank {self.rank} "
                                      f"before its gradients were sent: {e}"), epoch) from e
        for dest in self._order():
            self.rt.signal(self.pad, dest, lay.grad_signal(self.rank), 2 * epoch)

    def _await_gradients(self, epoch: int) -> None:
        self._wait(self.layout.grad_signal, range(self.world_size), 2 * epoch, epoch, f"the gradients of step {epoch}")

    @abc.abstractmethod
    def gradient_blocks(self, grad: torch.Tensor, ticket: StepTicket) -> Iterator[Tuple[int, torch.Tensor]]:
        """(owner, the gradient rows it gets) for every owner, remote ones first."""

    @abc.abstractmethod
    def owner_view(self, ticket: StepTicket) -> Tuple[int, Tuple[int, int, int], Tuple[int, int, int], torch.Tensor]:
        """How this owner reads its kept ids and gradients (``ReceivedBlocks.kept_ids``, ``kept_grads``): rows per
        source, the held features in an index block, the gradient columns, the sources' batches."""


class HostRwStep(HostStep):
    """``pgas_row_wise`` on the host path (module docstring)."""

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device) -> None:
        super().__init__(spec, env, device, block_dim_sum=sum(spec.dims))
        self._block_sizes = torch.tensor(spec.shard_rows, dtype=torch.int64, device=device)
        # This rank's rows of each table (the last block is short, or empty for tiny tables).
        self._local_rows = [max(0, min(b, n - self.rank * b)) for b, n in zip(spec.shard_rows, spec.hash_sizes)]
        self._mean = torch.tensor(spec.is_mean, device=device)
        self._dims = torch.tensor(spec.dims, device=device)

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        epoch, values = self.begin_index_dist(kjt)
        weights = kjt.weights_or_none()
        lengths, ids, bucket_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            kjt.lengths().view(-1).to(torch.int64),
            values,
            bucketize_pos=False,
            sequence=False,
            block_sizes=self._block_sizes,
            my_size=self.world_size,
            weights=weights.float() if weights is not None else None,
        )
        per_dest = lengths.view(self.world_size, -1)  # [dest][f][b]
        starts = [0] + per_dest.sum(1).cumsum(0).tolist()
        block = self.layout.index_block(epoch % self.layout.num_slots, self.rank)
        for dest in self._order():
            span = slice(starts[dest], starts[dest + 1])
            self._put_index_block(dest, block, epoch, kjt.stride(), per_dest[dest], ids[span],
                                  bucket_weights[span] if bucket_weights is not None else None)

    def serve_and_combine(self, kjt: KeyedJaggedTensor, pool: PoolFn, epoch: int,
                          release: bool) -> Tuple[torch.Tensor, Any]:
        lay = self.layout
        slot = epoch % lay.num_slots
        batch = kjt.stride()
        out_dtype = self.spec.out_dtype
        for src in self._order():
            block, h_batch, nnz = self._source_index(src, epoch)
            if h_batch != batch:
                raise self.fail(PgasInputError(
                    "pgas_row_wise requires equal local batch sizes on all ranks: rank "
                    f"{src} has {h_batch}, rank {self.rank} has {batch}"
                ), epoch)
            with torch.no_grad():
                partial = pool(self._received(src, block, self.feature_names, self._local_rows, nnz, batch, epoch))
            out_dtype = partial.dtype
            self._serve(src, epoch, partial, release)
        profiling.mark("lookup")
        self._await_outputs(epoch, "partial pooled outputs")
        out = torch.zeros(batch, lay.dim_sum, dtype=torch.float32, device=self.device)
        for s in range(self.world_size):  # rank order: deterministic sums
            out += self.buf.view(out_dtype, lay.output_block(slot, s), batch * lay.dim_sum).view(batch, lay.dim_sum)
        divisor = self._mean_divisor(kjt) if any(self.spec.is_mean) else None
        if divisor is not None:
            out = out / divisor
        return out.to(out_dtype), divisor

    def gradient_blocks(self, grad: torch.Tensor, ticket: StepTicket) -> Iterator[Tuple[int, torch.Tensor]]:
        """Stock's autograd of the RW output: divided by the MEAN divisor, then by the gradient division;
        every owner gets the whole block (a masked copy costs more than it saves on the host)."""
        g = (grad / ticket.host).to(grad.dtype) if ticket.host is not None else grad  # fp16 stays fp16
        g = g / gradient_divisor(self.world_size)
        for dest in self._order():
            yield dest, g

    def owner_view(self, ticket: StepTicket) -> Tuple[int, Tuple[int, int, int], Tuple[int, int, int], torch.Tensor]:
        num, dim_sum = self.spec.num_features, self.layout.dim_sum
        batches = torch.full((self.world_size,), ticket.batch, dtype=torch.int64)
        return ticket.batch, (0, num, num), (0, dim_sum, dim_sum), batches

    def _mean_divisor(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """[B, D] divisor, like TorchRec RW: bag length (or weight sum) + eps; 1 for sum."""
        weights = kjt.weights_or_none()
        if weights is not None:
            lengths = torch.ops.fbgemm.segment_sum_csr(1, kjt.offsets().int(), weights.float())
        else:
            lengths = kjt.lengths().float()
        per_bag = lengths.view(self.spec.num_features, -1) + MEAN_EPS  # [F, B]
        per_bag = torch.where(self._mean[:, None], per_bag, torch.ones_like(per_bag))
        return torch.repeat_interleave(per_bag.t(), self._dims, dim=1)


class HostTwStep(HostStep):
    """``pgas_table_wise`` on the host path (module docstring). An output block holds the owner's columns
    only, ``[B, D_owner]`` (the layout's ``dim_sum`` is the widest owner's)."""

    def __init__(self, spec: StepSpec, env: ShardingEnv, device: torch.device) -> None:
        super().__init__(spec, env, device, block_dim_sum=max(spec.dim_sum_per_rank, default=0))
        self._first = list(itertools.accumulate([0, *spec.features_per_rank]))  # owner d: [first[d], first[d+1])
        lo, hi = self.lookup_features
        self._local_features = spec.feature_names[lo:hi]
        self._local_rows = spec.shard_rows[lo:hi]  # whole tables

    def index_dist(self, kjt: KeyedJaggedTensor) -> None:
        epoch, values = self.begin_index_dist(kjt)
        batch = kjt.stride()
        weights = kjt.weights_or_none()
        lengths, offsets = kjt.lengths().to(torch.int64), kjt.offsets()
        block = self.layout.index_block(epoch % self.layout.num_slots, self.rank)
        for dest in self._order():
            f0, f1 = self._first[dest] * batch, self._first[dest + 1] * batch
            span = slice(int(offsets[f0]), int(offsets[f1]))
            self._put_index_block(dest, block, epoch, batch, lengths[f0:f1], values[span],
                                  weights[span] if weights is not None else None)

    def serve_and_combine(self, kjt: KeyedJaggedTensor, pool: PoolFn, epoch: int,
                          release: bool) -> Tuple[torch.Tensor, Any]:
        lay = self.layout
        slot = epoch % lay.num_slots
        out_dtype = self.spec.out_dtype
        batches = [0] * self.world_size
        for src in self._order():
            block, batches[src], nnz = self._source_index(src, epoch)
            received = self._received(src, block, self._local_features, self._local_rows, nnz, batches[src], epoch)
            pooled = None
            if self._local_features:
                with torch.no_grad():
                    pooled = pool(received).to(out_dtype)
            self._serve(src, epoch, pooled, release)
        profiling.mark("lookup")
        self._await_outputs(epoch, "pooled outputs")
        batch = kjt.stride()
        blocks = [self.buf.view(out_dtype, lay.output_block(slot, owner), batch * d).view(batch, d)
                  for owner, d in enumerate(self.spec.dim_sum_per_rank) if d > 0]
        out = torch.cat(blocks, dim=1) if blocks else torch.empty(batch, 0, dtype=out_dtype)
        return out, batches

    def gradient_blocks(self, grad: torch.Tensor, ticket: StepTicket) -> Iterator[Tuple[int, torch.Tensor]]:
        """Stock's autograd of the TW output: divided by the gradient division; owner d gets its columns."""
        g = grad / gradient_divisor(self.world_size)
        cols = list(itertools.accumulate([0, *self.spec.dim_sum_per_rank]))
        for dest in self._order():
            yield dest, g[:, cols[dest]:cols[dest + 1]].contiguous()

    def owner_view(self, ticket: StepTicket) -> Tuple[int, Tuple[int, int, int], Tuple[int, int, int], torch.Tensor]:
        held = len(self._local_features)
        width = self.spec.dim_sum_per_rank[self.rank]
        batches = torch.tensor(ticket.host, dtype=torch.int64)
        return max(ticket.host), (0, held, held), (0, width, width), batches
