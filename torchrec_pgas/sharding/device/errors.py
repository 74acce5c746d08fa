"""A GPU sharding's failed steps: the ``ErrorRecord`` its kernels write a buffer slot (pinned host memory the
device writes and the host reads without a sync, ``csrc/step_abi.h``), the errors of the steps this rank gave up
on the host, and how each reads as a Python exception."""

import warnings
from typing import Callable, Dict, Optional, Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from torchrec_pgas.step_abi import ERROR_RECORD_WORDS, ErrorCode
from torchrec_pgas.types import PgasError, PgasInputError, PgasPeerAbortError, PgasTimeoutError

_STAGES = ("the release of its blocks", "index data", "pooled outputs", "the gradients")  # ErrorRecord a of TIMEOUT


class ErrorRecords:
    """One sharding's records of failed steps (``kind``, ``rank``: its own, for messages; ``bad_id_message``:
    the message of a bad id of (feature, value))."""

    def __init__(self, kind: str, rank: int, num_slots: int, bounds_mode: BoundsCheckMode,
                 bad_id_message: Callable[[int, int], str]) -> None:
        self.kind = kind
        self.rank = rank
        self.num_slots = num_slots
        self.bounds_mode = bounds_mode
        self.bad_id_message = bad_id_message
        self.status = torch.zeros(num_slots, ERROR_RECORD_WORDS, dtype=torch.int64).pin_memory()
        # Steps this rank gave up (bad input seen on the host): the error to raise for each, in place of the
        # record its kernels leave (a peer abort by this rank).
        self.gave_up: Dict[int, PgasError] = {}

    def record(self, epoch: int) -> torch.Tensor:
        """The record of ``epoch``'s slot (a view)."""
        return self.status[epoch % self.num_slots]

    def own_failure(self, epoch: int) -> Optional[PgasError]:
        """Why step ``epoch`` failed on this rank, consumed: what it gave up for, else its record if the record
        is the step's."""
        record = self.record(epoch)
        err = self.error(record.tolist()) if int(record[0]) == epoch else None
        record.zero_()
        return self.gave_up.pop(epoch, err)

    def consume_refusal(self, epoch: int) -> None:
        """Clear the refusal a graph's ``await_grads`` published for step ``epoch`` (a source gave up or timed out;
        csrc/grad_exchange.cu ``publish_refusal``): the backward raises it, the next forward must not again."""
        record = self.record(epoch)
        if int(record[0]) == epoch and int(record[1]) in (ErrorCode.PEER_ABORT, ErrorCode.TIMEOUT):
            record.zero_()

    def step_failure(self, epoch: int) -> Optional[PgasError]:
        """Step ``epoch``'s error if it failed here, consumed."""
        record = self.record(epoch)
        epoch_of, code = record.tolist()[:2]
        failed = epoch_of == epoch and code not in (ErrorCode.NONE, ErrorCode.BAD_ID_WARN)
        if not failed and epoch not in self.gave_up:
            return None
        err = self.gave_up.pop(epoch, None) or self.error(record.tolist())
        if failed:
            record.zero_()
        return err

    def earliest_finished(self, awaits_backward: Callable[[int], bool]) -> Optional[int]:
        """The earliest step with a record (a warning's too) that does not wait for its backward (the backward
        raises that one), as the host sees the records now: no sync; None if there is none. A record whose step
        is not its slot's (torn: the host's clearing of a slot raced the device's next record there) is not a
        step's and is left to be overwritten."""
        epochs = [epoch for slot, (epoch, code, *_) in enumerate(self.status.tolist())
                  if code != ErrorCode.NONE and epoch > 0 and epoch % self.num_slots == slot
                  and not awaits_backward(epoch)]
        return min(epochs, default=None)

    def take_finished(self, epoch: int, awaits_backward: Callable[[int], bool]) -> Optional[PgasError]:
        """Step ``epoch``'s recorded error, the record consumed (a WARNING-mode bad id warns and gives None);
        None without a record of the step, or while the step waits for its backward (which raises it)."""
        if awaits_backward(epoch):
            return None
        record = self.record(epoch)
        values = record.tolist()
        if values[0] != epoch or values[1] == ErrorCode.NONE:
            return None
        record.zero_()
        return self.gave_up.pop(epoch, None) or self.error(values)

    def error(self, record: Sequence[int]) -> Optional[PgasError]:
        """The error an ErrorRecord (epoch, code, a, b, c) reports; a WARNING-mode bad id warns instead."""
        _, code, a, b, c = record
        if code == ErrorCode.NONE:
            return None
        if code == ErrorCode.BAD_ID_WARN:
            if self.bounds_mode == BoundsCheckMode.WARNING:
                warnings.warn(self.bad_id_message(a, b) + "; such ids read row 0 (BoundsCheckMode.WARNING)")
            return None
        if code == ErrorCode.BAD_ID:
            return PgasInputError(self.bad_id_message(a, b))
        if code == ErrorCode.BATCH_MISMATCH:
            return PgasInputError(
                f"{self.kind} requires equal local batch sizes on all ranks: rank "
                f"{a} has {b}, rank {self.rank} has {c}"
            )
        if code == ErrorCode.TIMEOUT:  # c: how long the step had waited, from its first wait (ms)
            return PgasTimeoutError(
                f"rank {self.rank} waited {c / 1000:.1f}s (the step's deadline, from its first wait) for "
                f"{_STAGES[a]} from rank {b}: a peer crashed, diverged, or is not running this step"
            )
        if code == ErrorCode.PEER_ABORT:
            return PgasPeerAbortError(f"rank {a} aborted the {self.kind} step (see its error)")
        return PgasError(f"{self.kind}: corrupt data from rank {a} (kind {b})")
