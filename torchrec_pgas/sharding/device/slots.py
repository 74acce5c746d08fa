"""When each buffer slot of a GPU sharding is free again on this rank (``DeviceStep``): a step's blocks live in slot
``epoch % num_slots`` until its combine (no backward) or its backward's release, and the next step that claims the
slot must wait for that, on whatever stream it runs (TorchRec's train pipelines run the input dist on their own).
One CUDA event a slot, recorded and waited outside CUDA-graph capture only (a captured step's replays are ordered
by the graph)."""

from typing import Optional

import torch


class SlotEvents:
    """The events of ``num_slots`` slots on ``device``."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self._events = [torch.cuda.Event() for _ in range(num_slots)]
        self._device = device

    def wait(self, epoch: int) -> torch.cuda.Stream:
        """The current stream, made to wait for the last step that used ``epoch``'s slot on this rank."""
        stream = torch.cuda.current_stream(self._device)
        if not torch.cuda.is_current_stream_capturing():
            stream.wait_event(self._events[epoch % len(self._events)])
        return stream

    def record(self, epoch: int, stream: Optional[torch.cuda.Stream] = None) -> None:
        """``epoch``'s slot is free once the work enqueued so far on ``stream`` (default: the current one) ran."""
        if not torch.cuda.is_current_stream_capturing():
            self._events[epoch % len(self._events)].record(stream)

    def synchronize(self, epoch: int) -> None:
        """Wait on the host until ``epoch``'s slot is free (its error record is then on the host too)."""
        if not torch.cuda.is_current_stream_capturing():
            self._events[epoch % len(self._events)].synchronize()
