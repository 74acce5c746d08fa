"""The owner's fused backward + optimizer in the TBE's own storage (``OwnerBackward.PGAS``).

What FBGEMM's fused backward does for its exact optimizers, as one pass over the ids an owner kept of a step
(``ReceivedBlocks.kept_ids``) and the gradient rows its requesters pushed (``ReceivedBlocks.kept_grads``):

1. gradient rows: every (bag, id) pair's row is its bag's pooled gradient (times 1/length, rounded to the
   gradient's dtype, when the TBE pools by MEAN), times the id's per-sample weight;
2. aggregation: summed per distinct (table, row), in the order the ids arrived (a stable sort by row, then a
   segment sum in fp32): deterministic on every device;
3. update: one optimizer step of each distinct row, in fp32, stored back in the weights' precision (round to
   nearest: stochastic rounding falls back to FBGEMM), into ``split_embedding_weights()`` and
   ``split_optimizer_states()``, the tensors ``state_dict`` and ``fused_optimizer`` hold, so checkpoints and
   learning-rate changes stay stock's.

The update formulas are those of FBGEMM's GPU kernels (its CPU kernels ignore row-wise Adagrad's weight
decay and round fp16 SGD stochastically). Two implementations of the one algorithm: the extension's op
``torch.ops.torchrec_pgas.owner_update`` (``csrc/owner_update.h``: two CUDA kernels, a warp per chunk of sorted ids,
a hot row's ids split over chunks and their partial sums added in chunk order; and its CPU path, the same two
phases with a thread per chunk; steps 1-3 fused, no per-id gradient rows in memory),
used where the extension is built; and the reference below in torch ops on any device (a pure-Python install, tables
wider than the op takes, and the tests' oracle). Both cover EXACT_SGD, EXACT_ROWWISE_ADAGRAD (no, L2 or
decoupled weight decay) and ADAM (no weight decay); ``unsupported`` names what they do not cover, and
FBGEMM's path (``OwnerApply.apply_at_count``) serves those. ``OwnerBackward.REFERENCE`` trains through the reference
itself.
"""

import ctypes
import functools
import itertools
import weakref
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_pgas import profiling, step_abi
from torchrec_pgas.op_fakes import register_fakes
from torchrec_pgas.types import PgasError
from torchrec_pgas.step_abi import (
    OwnerFeatureDesc,
    OwnerHyper,
    OwnerKeysConfig,
    OwnerUpdateConfig,
    Optimizer,
    as_tensor,
    as_words,
    build,
)


class KeptBags(NamedTuple):
    """The bags an owner kept of a step (feature-major, then source, then sample): id counts, their offsets,
    and where each bag's ids and per-sample weights start, as elements of the owner's buffer."""

    lengths: torch.Tensor
    offsets: torch.Tensor
    first_id: torch.Tensor
    first_weight: Optional[torch.Tensor]


class PaddedIds(NamedTuple):
    """The ids an owner kept of a step as a captured step reads them (``ReceivedBlocks.kept_ids_padded``): the
    kept bags (their offsets computed on the device) and the owner's buffer as ids and as fp32 weights, which
    the ``owner_keys`` op lays out at a fixed capacity; ``stride``: bags per feature."""

    bags: KeptBags
    ids: torch.Tensor
    weights: Optional[torch.Tensor]
    capacity: int
    stride: int


SUPPORTED_OPTIMIZERS = (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM)
# FBGEMM's weight_decay_mode values the row-wise Adagrad update knows: none, L2 (into the gradient's
# square sum and a correction of the weight), decoupled (a correction of the weight only).
_WD_NONE, _WD_L2, _WD_DECOUPLE = 0, 1, 2
_OPTIMIZERS = {EmbOptimType.EXACT_SGD: Optimizer.SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD: Optimizer.ROWWISE_ADAGRAD,
               EmbOptimType.ADAM: Optimizer.ADAM}
OP_MAX_DIM = 512  # csrc/owner_update.h kOwnerMaxDim: wider tables take the reference


def unsupported(tbe: nn.Module) -> Optional[str]:
    """Why this TBE's update must stay FBGEMM's, or None when the owner backward reproduces it."""
    args = tbe.optimizer_args
    if tbe.optimizer not in SUPPORTED_OPTIMIZERS:
        return f"optimizer {tbe.optimizer.name}"
    if tbe.weights_precision not in (SparseType.FP32, SparseType.FP16):
        return f"{tbe.weights_precision.name} weights"
    if tbe.weights_precision == SparseType.FP16 and args.stochastic_rounding:
        return "fp16 weights with stochastic rounding"
    if any(spec[2] not in (EmbeddingLocation.DEVICE, EmbeddingLocation.HOST) for spec in tbe.embedding_specs):
        return "weights in UVM or behind a cache"  # an update beside the cache would leave it stale
    if tbe.pooling_mode not in (PoolingMode.SUM, PoolingMode.MEAN):
        return f"pooling {tbe.pooling_mode.name}"
    if args.gradient_clipping or args.max_norm > 0:
        return "gradient clipping or max_norm"
    if tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD and args.weight_decay_mode not in (
            _WD_NONE, _WD_L2, _WD_DECOUPLE):
        return f"weight_decay_mode {args.weight_decay_mode}"
    if tbe.optimizer == EmbOptimType.ADAM and (args.use_rowwise_bias_correction or args.weight_decay != 0):
        return "Adam with row-wise bias correction or weight decay"  # not yet compared with FBGEMM's on a GPU
    return None


def feature_gradients(kjt: KeyedJaggedTensor, grad: torch.Tensor, feature: int,
                      mean: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids, their gradient rows) of ``feature``'s bags (step 1): ``grad`` is the feature's ``[B, D]``
    columns."""
    batch, offsets, weights = kjt.stride(), kjt.offsets(), kjt.weights_or_none()
    bounds = offsets[feature * batch:(feature + 1) * batch + 1]
    lo, hi = bounds[[0, -1]].tolist()
    lengths = bounds[1:] - bounds[:-1]
    bag = torch.repeat_interleave(torch.arange(batch, device=grad.device), lengths, output_size=hi - lo)
    rows = grad.float()[bag]
    if mean:  # FBGEMM's GPU backward: the bag's gradient times 1/length, in the gradient's dtype
        rows = (rows * (1.0 / lengths[bag].double()).float()[:, None]).to(grad.dtype).float()
    if weights is not None:
        rows = rows * weights[lo:hi].float()[:, None]
    return kjt.values()[lo:hi], rows


def aggregate(ids: torch.Tensor, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(distinct ids, their summed gradient rows) in arrival order per id (step 2). Summed in float64 and
    rounded once: the oracle of the op's compensated fp32 sums, which a plain fp32 sum misses by ~n eps / 4
    on a row of n ids."""
    order = torch.sort(ids, stable=True).indices
    distinct, counts = torch.unique_consecutive(ids[order], return_counts=True)
    return distinct, torch.segment_reduce(rows[order].double(), "sum", lengths=counts, axis=0).to(rows.dtype)


def update_rows(tbe: nn.Module, weights: torch.Tensor, states: Sequence[torch.Tensor], distinct: torch.Tensor,
                grad: torch.Tensor, iteration: Optional[int]) -> None:
    """One optimizer step of a table's ``distinct`` rows with their summed gradients (step 3), as FBGEMM's
    exact optimizers take it: ``weights`` and ``states`` are the table's views in the TBE's storage."""
    args, lr = tbe.optimizer_args, float(tbe.get_learning_rate())
    w = weights[distinct].float()
    if tbe.optimizer == EmbOptimType.EXACT_SGD:
        w = w - lr * grad
    elif tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        (momentum,) = states
        g_wd = grad + args.weight_decay * w if args.weight_decay_mode == _WD_L2 else grad
        m = momentum[distinct] + (g_wd * g_wd).sum(1) / grad.shape[1]
        momentum[distinct] = m
        multiplier = lr / (m.sqrt() + args.eps)
        if args.weight_decay_mode == _WD_L2:
            correction = 1.0 - multiplier * args.weight_decay
        elif args.weight_decay_mode == _WD_DECOUPLE:
            correction = torch.full_like(multiplier, 1.0 - lr * args.weight_decay)
        else:
            correction = torch.ones_like(multiplier)
        w = correction[:, None] * w - multiplier[:, None] * grad
    else:  # ADAM: bias-corrected moments
        m1_state, m2_state = states
        t = float(iteration or 1)
        m1 = args.beta1 * m1_state[distinct] + (1.0 - args.beta1) * grad
        m2 = args.beta2 * m2_state[distinct] + (1.0 - args.beta2) * grad * grad
        m1_state[distinct], m2_state[distinct] = m1, m2
        step = m1 / (1.0 - args.beta1 ** t) / ((m2 / (1.0 - args.beta2 ** t)).sqrt() + args.eps)
        w = w - lr * step
    weights[distinct] = w.to(weights.dtype)


def reference_update(tbe: nn.Module, kjt: KeyedJaggedTensor, grads: torch.Tensor, first_col: int,
                     iteration: Optional[int]) -> None:
    """Steps 1-3 in torch ops for one TBE of a lookup: ``kjt`` holds its features, ``grads[:, first_col:]``
    their pooled gradients side by side."""
    table_map: List[int] = list(tbe.feature_table_map)
    cols = list(itertools.accumulate([first_col] + [tbe.embedding_specs[t][1] for t in table_map]))
    mean = tbe.pooling_mode == PoolingMode.MEAN
    weights = tbe.split_embedding_weights()
    states = tbe.split_optimizer_states() if tbe.optimizer != EmbOptimType.EXACT_SGD else [[]] * len(weights)
    for table in sorted(set(table_map)):
        # a shared table's features in order
        parts = [feature_gradients(kjt, grads[:, cols[f]:cols[f + 1]], f, mean)
                 for f, t in enumerate(table_map) if t == table]
        table_ids = torch.cat([ids for ids, _ in parts])
        if table_ids.numel():
            distinct, summed = aggregate(table_ids, torch.cat([rows for _, rows in parts]))
            update_rows(tbe, weights[table], states[table], distinct, summed, iteration)


@functools.lru_cache(maxsize=None)
def op_available() -> bool:
    """Whether the extension's ``owner_update`` op is here (built, loadable, and of this package's contract)."""
    try:
        import torchrec_pgas._C  # noqa: F401
    except ImportError:
        return False
    step_abi.check_extension()
    register_fakes()
    return hasattr(torch.ops.torchrec_pgas, "owner_update")


_STORAGE = ("weights_dev", "weights_host", "weights_uvm", "momentum1_dev", "momentum1_host", "momentum1_uvm",
            "momentum2_dev", "momentum2_host", "momentum2_uvm")


class _OpLayout(NamedTuple):
    """What the op needs of a TBE that does not change between steps."""

    tables: Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]  # weights, momentum1, momentum2
    features: torch.Tensor  # OwnerFeatureDesc words (CPU)
    feature_base: torch.Tensor  # each feature's first row key, on the gradient's device, in the keys' dtype: int32
    # where the TBE's rows allow (half the bytes a sort moves)
    key_limit: int  # the rows of all its tables: a key past every row


# Per TBE: (its storage's addresses, the gradient's device and first column; the layout, None where the op does
# not take the TBE). Rebuilt when the storage moves; splitting 64 tables' views alone costs ~0.7 ms a step.
_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, Tuple[Tuple[object, ...], Optional[_OpLayout]]]" = (
    weakref.WeakKeyDictionary())


def storage_key(tbe: nn.Module) -> Tuple[int, ...]:
    """The addresses of a TBE's weight and optimizer-state storage: what a captured update wrote through."""
    return tuple(t.data_ptr() for t in (getattr(tbe, name, None) for name in _STORAGE) if isinstance(t, torch.Tensor))


def _op_layout(tbe: nn.Module, grads: torch.Tensor, first_col: int) -> Optional[_OpLayout]:
    storage = storage_key(tbe)
    key = (storage, str(grads.device), first_col)
    cached = _LAYOUTS.get(tbe)
    if storage and cached is not None and cached[0] == key:
        return cached[1]
    if grads.is_cuda and torch.cuda.is_current_stream_capturing():  # building uploads: eager updates build it
        raise PgasError("a training step through the owner update op is captured only after an eager step (and "
                        "again after the TBE's storage moved)")
    layout = _build_layout(tbe, grads, first_col)
    _LAYOUTS[tbe] = (key, layout)
    return layout


def _build_layout(tbe: nn.Module, grads: torch.Tensor, first_col: int) -> Optional[_OpLayout]:
    """The TBE's layout for the op, or None where its tables are not what the op writes (contiguous
    ``[rows, dim]`` weights beside ``grads``, fp32 states of the optimizer's shapes, dims up to ``OP_MAX_DIM``)."""
    weights = list(tbe.split_embedding_weights())
    states = tbe.split_optimizer_states() if tbe.optimizer != EmbOptimType.EXACT_SGD else [()] * len(weights)
    for (rows, dim, *_), w, st in zip(tbe.embedding_specs, weights, states):
        shapes = {EmbOptimType.EXACT_SGD: [], EmbOptimType.EXACT_ROWWISE_ADAGRAD: [(rows,)],
                  EmbOptimType.ADAM: [(rows, dim), (rows, dim)]}[tbe.optimizer]
        if (dim > OP_MAX_DIM or tuple(w.shape) != (rows, dim) or not w.is_contiguous() or w.device != grads.device
                or [tuple(x.shape) for x in st] != shapes
                or any(x.dtype != torch.float32 or not x.is_contiguous() for x in st)):
            return None
    table_map: List[int] = list(tbe.feature_table_map)
    cols = itertools.accumulate([first_col] + [tbe.embedding_specs[t][1] for t in table_map])
    # a table's row r has the key (rows of the tables before it) + r, as the op reads them
    key_bases = list(itertools.accumulate([0] + [spec[0] for spec in tbe.embedding_specs]))
    key_dtype = torch.int32 if key_bases[-1] < 2 ** 31 else torch.int64
    return _OpLayout(
        tables=(weights, [st[0] for st in states if len(st) > 0], [st[1] for st in states if len(st) > 1]),
        features=as_words([build(OwnerFeatureDesc, table=t, grad_col=c) for t, c in zip(table_map, cols)],
                          OwnerFeatureDesc),
        feature_base=_upload(torch.tensor([key_bases[t] for t in table_map], dtype=key_dtype), grads.device),
        key_limit=key_bases[-1])


def op_update(tbe: nn.Module, kjt: KeyedJaggedTensor, grads: torch.Tensor, first_col: int,
              iteration: Optional[int], counted: bool = False) -> bool:
    """Steps 1-3 for one TBE in the extension's op (arguments as :func:`reference_update`); False where the
    op does not take the TBE's tables or this gradient (nothing applied then). ``counted``: as a captured step
    runs it, the keys laid out at twice the ids' positions (the rest unwritten) and sorted and walked up to a
    device word counting the ids, not to their number known on the host (the same update)."""
    layout = _op_layout(tbe, grads, first_col)
    batch, values, lengths = kjt.stride(), kjt.values(), kjt.lengths().long()
    if not _op_takes(layout, grads, lengths.numel(), len(tbe.feature_table_map) * batch):
        return False
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    weights = kjt.weights_or_none()
    weights = weights.float().contiguous() if weights is not None else None
    # each bag's ids start at its offset in the KJT's values (and weights)
    keys, bags, psw = _owner_keys(layout, values.contiguous(), weights, offsets[:-1],
                                  None if weights is None else offsets[:-1], offsets, 0, lengths.numel(), batch,
                                  values.numel() * (2 if counted else 1))
    _sort_and_update(tbe, layout, keys, bags, psw if weights is not None else None, offsets, grads, batch,
                     _eager_hyper(tbe, grads.device, iteration), used=offsets[-1:] if counted else None)
    return True


def _eager_hyper(tbe: nn.Module, dev: torch.device, iteration: Optional[int]) -> torch.Tensor:
    """The device words an eager update of the TBE reads its hyper-parameters from, written for this step (made
    by the TBE's first eager update: a capture then finds them)."""
    hyper = _HYPER.get(tbe)
    if hyper is None or hyper.device != dev:
        hyper = _HYPER[tbe] = torch.empty(ctypes.sizeof(OwnerHyper) // 4, device=dev)
        _HYPER_WRITTEN.pop(tbe, None)
    write_hyper(tbe, iteration)
    return hyper


def _owner_keys(layout: "_OpLayout", ids: torch.Tensor, weights: Optional[torch.Tensor], first_id: torch.Tensor,
                first_weight: Optional[torch.Tensor], offsets: torch.Tensor, first_bag: int, end_bag: int,
                stride: int, capacity: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TBE's kept ids (bags [first_bag, end_bag) of ``offsets``) as row keys, bags and weights at
    ``capacity`` positions, in one ``owner_keys`` kernel. An id whose key would lie past every table becomes
    padding, which the update never walks; one whose key lands in another table's rows the update skips."""
    config = build(OwnerKeysConfig, first_bag=first_bag, end_bag=end_bag, stride=stride, key_limit=layout.key_limit)
    return torch.ops.torchrec_pgas.owner_keys(ids, weights, first_id, first_weight, offsets, layout.feature_base,
                                              as_tensor(config), capacity)


def _op_takes(layout: Optional["_OpLayout"], grads: torch.Tensor, num_bags: int, expected_bags: int) -> bool:
    return (layout is not None and grads.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and grads.stride(1) == 1 and num_bags == expected_bags
            and num_bags < 2 ** 31)  # the op numbers bags in int32


def _sort_and_update(tbe: nn.Module, layout: "_OpLayout", keys: torch.Tensor, bags: torch.Tensor,
                     psw: Optional[torch.Tensor], offsets: torch.Tensor, grads: torch.Tensor, batch: int,
                     hyper: torch.Tensor, apply: Optional[torch.Tensor] = None,
                     used: Optional[torch.Tensor] = None) -> None:
    """The ids sorted by row key (stable: a row's ids in arrival order), each with its bag and weight, then the
    op (``apply``: the step's device word; ``used``: the device word counting the positions that hold ids, which
    the sort and the update stop at; None: all of them)."""
    ops, weighted = torch.ops.torchrec_pgas, psw is not None
    keys, bags, sorted_psw = ops.sort_owner_keys(
        keys, bags, psw if weighted else keys.new_empty(0, dtype=torch.float32), layout.key_limit, used)
    profiling.mark("owner_sort")  # the benchmark's owner backward in two: the keys and their sort; the op
    mode = tbe.optimizer_args.weight_decay_mode if tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD else _WD_NONE
    config = build(OwnerUpdateConfig, optimizer=_OPTIMIZERS[tbe.optimizer], weight_decay_mode=mode,
                   mean=tbe.pooling_mode == PoolingMode.MEAN, weighted=weighted, batch=batch)
    ops.owner_update(keys, bags, offsets, sorted_psw if weighted else None, grads, *layout.tables, layout.features,
                     hyper, as_tensor(config), apply, used)
    profiling.mark("owner_update")


def hyper_words(tbe: nn.Module, iteration: Optional[int]) -> OwnerHyper:
    """The op's hyper-parameters for the TBE's next update: ``fused_optimizer``'s learning rate as the TBE
    holds it, and Adam's bias corrections at ``iteration`` (1 for the other optimizers, which read none: so
    their words change only with the learning rate, and ``write_hyper`` copies nothing a step)."""
    args, t = tbe.optimizer_args, float(iteration or 1)
    adam = tbe.optimizer == EmbOptimType.ADAM
    return build(OwnerHyper, lr=float(tbe.get_learning_rate()), eps=args.eps, beta1=args.beta1, beta2=args.beta2,
                 weight_decay=args.weight_decay, bias_correction1=1.0 - args.beta1 ** t if adam else 1.0,
                 bias_correction2=1.0 - args.beta2 ** t if adam else 1.0, reserved=0.0)


# Per TBE: the device words its update reads the hyper-parameters from, written before each update on the
# update's stream (``write_hyper``): by the eager step itself, by ``CapturedTrainStep`` before each replay. Made
# by the TBE's first eager update, outside any graph's memory pool, so a capture finds them.
_HYPER: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()
# Per TBE: (the device words' address, the bytes last written there); a step whose hyper-parameters are the
# last step's (no learning-rate change, an optimizer without bias corrections) writes nothing. Safe across streams
# as the TBE's updates are: each update is ordered after the last one, and so after the copy that preceded it.
_HYPER_WRITTEN: "weakref.WeakKeyDictionary[nn.Module, Tuple[int, bytes]]" = weakref.WeakKeyDictionary()


def write_hyper(tbe: nn.Module, iteration: Optional[int]) -> None:
    """Write the hyper-parameters of the TBE's next update into the device words the update reads, where they
    changed since the last write."""
    words = _HYPER.get(tbe)
    if words is not None:
        hyper = hyper_words(tbe, iteration)
        written = (words.data_ptr(), bytes(hyper))
        if _HYPER_WRITTEN.get(tbe) == written:
            return
        host = as_tensor(hyper).view(torch.float32)
        # one copy straight from pinned memory, no stream sync (the caching host allocator keeps the block
        # until the copy has run)
        words.copy_(host.pin_memory() if words.is_cuda else host, non_blocking=True)
        _HYPER_WRITTEN[tbe] = written


def padded_owner_backward(tbes: Sequence[nn.Module], kept: PaddedIds, grads: torch.Tensor, apply: torch.Tensor,
                          iterations: Optional[Sequence[Optional[int]]],
                          counts: Optional[Sequence[int]] = None) -> bool:
    """The owner backward over the kept ids where the sources wrote them: each TBE's ids laid out by the
    ``owner_keys`` op, sorted and applied, nothing applied where the device word ``apply`` is 0. Without
    ``counts``, at a fixed capacity (padding keys past every table after its own ids, which the sort and the
    update stop before, at the count word: no host sync); with them (:func:`tbe_id_counts`, an eager step), at
    exactly each TBE's ids, which CUB's sort takes whole. ``iterations``: an eager step's, whose hyper-parameters
    it writes; None under capture (``CapturedTrainStep`` writes them before each replay). False, with nothing
    applied, where the op does not take some TBE or the gradient."""
    held_bags = sum(len(tbe.feature_table_map) for tbe in tbes) * kept.stride
    layouts = [_op_layout(tbe, grads, col) for tbe, col in zip(tbes, _first_columns(tbes))]
    if not all(_op_takes(layout, grads, kept.bags.offsets.numel() - 1, held_bags) for layout in layouts):
        return False
    first_bag = 0
    for i, (tbe, layout) in enumerate(zip(tbes, layouts)):
        assert layout is not None  # _op_takes
        hyper = _eager_hyper(tbe, grads.device, iterations[i]) if iterations is not None else _HYPER.get(tbe)
        if hyper is None or hyper.device != grads.device:
            raise PgasError("a training step through the owner update op is captured only after an eager step")
        end_bag = first_bag + len(tbe.feature_table_map) * kept.stride
        if counts is None or counts[i]:
            capacity = kept.capacity if counts is None else counts[i]
            keys, bags, psw = _owner_keys(layout, kept.ids, kept.weights, kept.bags.first_id,
                                          kept.bags.first_weight, kept.bags.offsets, first_bag, end_bag, kept.stride,
                                          capacity)
            offsets = kept.bags.offsets[first_bag:end_bag + 1]
            if first_bag:  # the op counts this TBE's ids from its first bag's
                offsets = offsets - offsets[0]
            _sort_and_update(tbe, layout, keys, bags, psw if kept.weights is not None else None, offsets, grads,
                             kept.stride, hyper, apply, offsets[-1:] if counts is None else None)
        first_bag = end_bag
    return True


def tbe_id_counts(tbes: Sequence[nn.Module], kept: PaddedIds) -> Optional[List[int]]:
    """Each TBE's kept ids (its bags' in the kept offsets, TBEs in order), read on the host in one sync, at most
    the capacity (the ``owner_keys`` op writes no position past it, whatever the sources' headers say); None
    where the kept bags are not the TBEs' (:func:`padded_owner_backward` refuses them)."""
    firsts = list(itertools.accumulate([0] + [len(tbe.feature_table_map) * kept.stride for tbe in tbes]))
    if kept.bags.offsets.numel() != firsts[-1] + 1:
        return None
    offsets = kept.bags.offsets  # the TBEs' first offsets as views, gathered by one cat: no host-to-device copy
    cuts = torch.cat([offsets[f:f + 1] for f in firsts]).tolist()
    return [max(0, min(hi - lo, kept.capacity)) for lo, hi in zip(cuts, cuts[1:])]


def _upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on ``dev`` without a stream sync (a copy from pageable memory would sync)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def owner_backward(tbes: Sequence[nn.Module], kjt: KeyedJaggedTensor, grads: torch.Tensor,
                   iterations: Sequence[Optional[int]], reference: bool = False, counted: bool = False) -> None:
    """Apply one step's gradients to the TBEs of a stock lookup (``GroupedPooledEmbeddingsLookup``: the KJT's
    features split over the TBEs in order, their pooled outputs side by side in ``grads``): in the
    extension's op where it is built and takes the TBE (``counted``: as :func:`op_update` takes it), else (or
    with ``reference``) in torch ops."""
    subs = kjt.split([len(t.feature_table_map) for t in tbes])
    for tbe, sub, first_col, iteration in zip(tbes, subs, _first_columns(tbes), iterations):
        if reference or not op_available() or not op_update(tbe, sub, grads, first_col, iteration, counted):
            reference_update(tbe, sub, grads, first_col, iteration)


def _first_columns(tbes: Sequence[nn.Module]) -> List[int]:
    """Each TBE's first column of the step's gradient (their pooled outputs lie side by side, in order)."""
    widths = [sum(tbe.embedding_specs[t][1] for t in tbe.feature_table_map) for tbe in tbes]
    return list(itertools.accumulate([0] + widths))[:-1]
