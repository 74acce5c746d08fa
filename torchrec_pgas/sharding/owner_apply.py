"""How an owner applies the gradients its sources sent for a step: the owner update op over the kept ids at
their fixed capacity (no host sync), or over the ids at their count, or FBGEMM's backward through a replay of
stock's lookup, whichever ``PgasConfig.owner_backward`` (``AUTO``: the faster of the first two measured,
``owner_choice.py``) and the TBEs allow (``owner_backward.py``)."""

import contextlib
import warnings
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling
from torchrec_pgas.sharding.kept_ids import ReceivedBlocks
from torchrec_pgas.sharding.owner_choice import OwnerBackwardTrial, TrialApply
from torchrec_pgas.sharding.owner_backward import op_available, owner_backward, padded_owner_backward, tbe_id_counts
from torchrec_pgas.sharding.owner_backward import unsupported as unsupported_update
from torchrec_pgas.sharding.tbe_counters import iterations_before_forward, sync_tbe_iterations
from torchrec_pgas.sharding.tickets import StepTicket
from torchrec_pgas.types import OwnerBackward, PgasTrainingConfig


class OwnerApply:
    """One sharding's choice and run of its owner backward (``kind``: the sharding's, for warnings;
    ``slot_bases``: each buffer slot's first byte, where the update at capacity reads a slot from)."""

    def __init__(self, kind: str, training: PgasTrainingConfig, received: ReceivedBlocks, device: torch.device,
                 out_dtype: torch.dtype, slot_bases: torch.Tensor) -> None:
        self.kind = kind
        self.training = training
        self.received = received
        self.device = device
        self.out_dtype = out_dtype
        self._slot_bases = slot_bases
        self.gap: Optional[str] = None  # what the owner backward does not cover, once known
        self._op_refused = False  # the update op refused a TBE: FBGEMM's or the reference's path instead
        self.trial = OwnerBackwardTrial(kind, device) if training.owner_backward == OwnerBackward.AUTO else None
        self._applying: Optional[TrialApply] = None  # the apply in progress (AUTO)

    def path(self) -> OwnerBackward:
        """The owner backward this sharding runs now: the configured one, or under ``AUTO`` the trial's."""
        if self.trial is None:
            return self.training.owner_backward
        return self._applying.path if self._applying is not None else self.trial.path()

    def choosing(self) -> bool:
        """Whether ``AUTO`` has not chosen yet: its owner updates run launched (no backward graph is captured for
        a path that may not be kept)."""
        return self.trial is not None and self.trial.chosen is None

    @contextlib.contextmanager
    def applying(self, tbes: Sequence[nn.Module]) -> Iterator[None]:
        """One step's apply, from the end of its gradient exchange: under ``AUTO``, timed for the trial, with
        :meth:`path` fixed for it (a sharding whose TBEs the owner update does not take settles on FBGEMM's
        backward at once)."""
        if self.trial is None:
            yield
            return
        if self.trial.chosen is None and not self.update_covers(tbes):
            self.trial.settle(OwnerBackward.FBGEMM, f"the owner update does not cover {self.gap}")
        with self.trial.timed() as apply:
            self._applying = apply
            try:
                yield
            finally:
                self._applying = None

    def op_serves(self, ticket: StepTicket) -> bool:
        """Whether the owner update op applies this step (``OwnerBackward.PGAS``, or ``AUTO``'s trial or choice of
        it; the extension built; every TBE taken, and none refused by the op so far)."""
        return (not self._op_refused and self.path() == OwnerBackward.PGAS and self.covers(ticket.tbes)
                and op_available())

    def at_capacity(self, ticket: StepTicket) -> bool:
        """Whether an eager step's owner update lays the kept ids out at their fixed capacity, as a captured one
        does, rather than at their count, which the host reads: the op serves (:meth:`op_serves`), and the
        positions sorted, TBEs × W × ids capacity, are within ``PgasTrainingConfig.max_padded_eager_ids`` (by
        default none on CPUs)."""
        # each TBE sorts the capacity
        positions = len(ticket.tbes) * self.received.world_size * self.received.layout.ids_capacity
        return positions <= self.training.padded_eager_ids(self.device.type) and self.op_serves(ticket)

    def update(self, ticket: StepTicket, slot: Union[int, torch.Tensor], rows: int,
               block_features: Tuple[int, int, int], columns: Tuple[int, int, int], batches: torch.Tensor,
               whole: torch.Tensor, iterations: Optional[Sequence[Optional[int]]], at_count: bool = False) -> bool:
        """The owner update op over the ids kept in ``slot`` (an int, or the device's slot under capture), read
        where the sources wrote them (``ReceivedBlocks.kept_ids_padded``, ``kept_grads``' arguments) and applied
        only where the device word ``whole`` is true. Laid out at their fixed capacity, nothing read on the host;
        or, ``at_count``, at each TBE's id count, read on the host (the one sync: a sort of exactly the ids, with
        no rebuild of them as a KJT). False, with nothing applied, where the op does not take some TBE."""
        bases = self._slot_bases
        base = bases[slot:slot + 1] if isinstance(slot, int) else bases.index_select(0, slot.view(1))  # int: a view
        kept = self.received.kept_ids_padded(base, rows, block_features, batches, whole)
        counts = tbe_id_counts(ticket.tbes, kept) if at_count else None
        profiling.mark("kept_ids")
        if at_count and counts is None:  # not the TBEs' bags: the op does not take them
            self._op_refused = True
            return False
        if counts is not None and not any(counts):
            self.applies_nothing()  # no row to update
        grads = self.received.kept_grads(slot, rows, columns, self.out_dtype)
        taken = padded_owner_backward(ticket.tbes, kept, grads, whole.long().view(1), iterations, counts)
        self._op_refused = not taken  # the op's reasons (dims, dtypes) hold for the next steps too
        return taken

    def applies_nothing(self) -> None:
        """The apply under way updates no row (none to update, or its step was refused): not a measure of
        ``auto``'s trial."""
        if self._applying is not None:
            self._applying.updated = False

    def apply_at_count(self, ticket: StepTicket, kjt: KeyedJaggedTensor, grads: torch.Tensor) -> None:
        """Apply the received gradients to the kept ids at their count (``kjt``): through the owner update where it
        covers the TBEs (``owner_backward``), else by re-running stock's lookup of the ids under autograd and
        backpropagating the gradients, so FBGEMM's fused backward + optimizer update the weights and optimizer
        state in place.

        Why a re-run lookup and not FBGEMM's backward op called directly: that op's signature differs per
        optimizer and per FBGEMM release (state tensors, hyper-parameters, the lookup's saved metadata), and the
        TBE module builds those arguments itself. The re-run costs one more pooled lookup of the owner's rows
        (about the forward's own lookup) and follows every optimizer FBGEMM ships, bit for bit."""
        if kjt.values().numel() == 0:
            self.applies_nothing()
            return  # no row to update
        if self.covers(ticket.tbes):
            owner_backward(ticket.tbes, kjt, grads, ticket.tbe_iters,
                           reference=self.training.owner_backward == OwnerBackward.REFERENCE)
            sync_tbe_iterations(ticket.tbes, ticket.tbe_iters)
            profiling.mark("owner_backward")
            return
        with torch.enable_grad(), iterations_before_forward(ticket.tbes, ticket.tbe_iters):
            out = ticket.pool(kjt)
        profiling.mark("replay_lookup")
        torch.autograd.backward(out, grads.to(out.dtype))
        profiling.mark("owner_backward")

    def covers(self, tbes: Sequence[nn.Module]) -> bool:
        """Whether the owner update (``OwnerBackward.PGAS`` or ``REFERENCE``, or ``AUTO``'s trial or choice of it)
        applies this step to every TBE of this sharding (:meth:`update_covers`)."""
        return self.path() != OwnerBackward.FBGEMM and self.update_covers(tbes)

    def update_covers(self, tbes: Sequence[nn.Module]) -> bool:
        """Whether the owner update takes every TBE of this sharding; the first time it does not, a warning says
        why (FBGEMM's replay serves the sharding then)."""
        if self.gap is None:
            reasons = [r for r in map(unsupported_update, tbes) if r is not None]
            self.gap = "; ".join(reasons)
            if reasons:
                warnings.warn(f"{self.kind}: owner_backward={self.training.owner_backward.value!r} does not cover "
                              f"{self.gap}: FBGEMM's fused backward applies this sharding's gradients "
                              "(PgasTrainingConfig(owner_backward='fbgemm') chooses it without this warning)")
        return not self.gap
