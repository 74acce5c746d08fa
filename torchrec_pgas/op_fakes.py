"""Fake implementations of the extension's ops that take their launch config as a CPU tensor beside device
tensors (``kept_bags``, ``owner_keys``; schemas in ``csrc/ops.cpp``).

FakeTensor (``torch.compile``, ``opcheck``) gives an op with a C++ Meta kernel its inputs' common device, and a
CPU tensor of more than one element beside CUDA ones has none. A Python fake says where the outputs live (the
device of the buffers the op reads) and also serves as the ops' Meta kernel. Shapes as the kernels allocate them
(``csrc/owner_keys_host.cpp``: ``empty_kept_bags``, ``empty_owner_keys``).
"""

from typing import Optional, Tuple

import torch

_registered = False


def register_fakes() -> None:
    """Once a process, after ``torchrec_pgas._C`` has registered the ops' schemas."""
    global _registered
    if _registered:
        return
    torch.library.register_fake("torchrec_pgas::kept_bags", _kept_bags)
    torch.library.register_fake("torchrec_pgas::owner_keys", _owner_keys)
    _registered = True


def _kept_bags(buffer: torch.Tensor, slot_base: torch.Tensor, batches: torch.Tensor, whole: Optional[torch.Tensor],
               config: torch.Tensor, num_bags: int, weighted: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lengths, first_id, first_weight) per bag, int64, on the buffer's device; no weights: an empty third."""
    return (buffer.new_empty(num_bags, dtype=torch.int64), buffer.new_empty(num_bags, dtype=torch.int64),
            buffer.new_empty(num_bags if weighted else 0, dtype=torch.int64))


def _owner_keys(ids: torch.Tensor, weights: Optional[torch.Tensor], first_id: torch.Tensor,
                first_weight: Optional[torch.Tensor], offsets: torch.Tensor, feature_base: torch.Tensor,
                config: torch.Tensor, capacity: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys in the feature base's dtype, int32 bags, fp32 per-sample weights: empty when unweighted) at
    ``capacity`` positions, on the offsets' device."""
    return (offsets.new_empty(capacity, dtype=feature_base.dtype), offsets.new_empty(capacity, dtype=torch.int32),
            offsets.new_empty(capacity if weights is not None else 0, dtype=torch.float32))
