"""The comm timeline of a GPU sharding's kernels (``torchrec_pgas.trace_comm``): the device words that say where
the kernels record (ns, cumulative remote bytes) pairs, and the launch config that switches the recording on."""

from typing import Callable, Optional

import torch

from torchrec_pgas.step_abi import StateWord


class CommTrace:
    """One sharding's trace buffer. ``state``: its kernels' state words; ``set_config(on)``: rewrite the kernels'
    launch config with tracing on or off (what was captured with the old config must be dropped)."""

    def __init__(self, state: torch.Tensor, set_config: Callable[[bool], None]) -> None:
        self._state = state
        self._set_config = set_config
        self._buffer: Optional[torch.Tensor] = None  # kept alive while the kernels hold its address

    def start(self, records: int, step_bytes: int) -> torch.Tensor:
        """An int64 ``[records, 2]`` buffer of (ns, cumulative remote bytes) that the next steps fill, one record
        per ``step_bytes`` (record 0: the step's start)."""
        if records < 1 or step_bytes < 1:
            raise ValueError(f"trace_comm: records {records} and step_bytes {step_bytes} must be >= 1")
        trace = torch.zeros(records, 2, dtype=torch.int64, device=self._state.device)
        # No step in flight (on any stream) while the trace words and the buffer change.
        torch.cuda.synchronize(self._state.device)
        self._buffer = trace
        self._state[StateWord.TRACE_BUF] = trace.data_ptr()
        self._state[StateWord.TRACE_STEP] = step_bytes
        self._state[StateWord.TRACE_CAP] = records
        self._state[StateWord.TRACE_BYTES] = 0
        self._set_config(True)
        return trace

    def stop(self) -> None:
        torch.cuda.synchronize(self._state.device)
        self._set_config(False)

    def remote_bytes(self) -> int:
        """Bytes this rank's kernels stored into other ranks' memory since ``start`` (syncs)."""
        return int(self._state[StateWord.TRACE_BYTES])
