"""``ReplayTrainPipeline``: TorchRec's train-pipeline shape, each training step replayed as one CUDA graph.

TorchRec's pipelines overlap a batch's host-to-device copy and input dist with the step before it, but each step
still launches its kernels one by one and syncs with the host in its input dist. A model whose embedding tables
are PGAS shardings training with ``owner_backward="pgas"`` has no host sync left in its step, so the whole step
can be one CUDA graph (``CapturedTrainStep``). This pipeline runs it as TorchRec users run a pipeline,
``progress(dataloader_iter)`` once a step: the next batch's copy to the device runs on a side stream while the
current step replays, the graph's static batch is refilled on the device, and the dense optimizer runs after
each replay.

The dense part. ``DistributedModelParallel`` wraps the dense modules in DDP, whose reducer a graph can capture
only if DDP was built on a side stream and warmed up for 11 steps (PyTorch's CUDA-graph notes); TorchRec builds
it inside the model, with ``static_graph=True``, which also refuses ``no_sync``. So the pipeline calls the module
DDP wraps (DDP's hooks then stay idle, as under ``no_sync``) and averages the dense gradients over the ranks
itself, one flat all-reduce a dtype as DDP's buckets would: inside the graph under NCCL, right after the replay
under gloo (whose collectives a graph cannot capture). The dense optimizer then runs eagerly after the replay:
any optimizer and learning-rate schedule works, for a few launches a step. A step the PGAS shardings refused on the
device (a bad id, a batch past the capacity, on any rank) is known to no host before a later step, so the dense
step is put back on the device where it was refused (``step_unless``), as eager training never takes it. A learning
rate set on the tables' ``fused_optimizer`` reaches the next replay (``CapturedTrainStep``).

A batch the graph cannot take (another batch size or weightedness than the captured one, an epoch's short last
batch say, or other id counts per feature where the model cannot take a ``StaticKJT``) trains eagerly, with a
one-time message naming the difference; the warm-up steps before the capture run the graph's step eagerly, as
every step does on CPUs, which have no CUDA graphs; an eval step runs forward only, as TorchRec's pipelines do.
"""

import contextlib
import dataclasses
import gc
import logging
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.train_pipeline import TrainPipeline
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from torchrec_pgas.embeddingbag import PgasShardedEmbeddingBagCollection, check_errors, pgas_steps
from torchrec_pgas.static_kjt import StaticKJT, covers_keys
from torchrec_pgas.train_graph import CapturedTrainStep, copy_kjt_
from torchrec_pgas.types import PgasError

logger = logging.getLogger(__name__)

In = TypeVar("In", bound=Pipelineable)
Out = TypeVar("Out")
Signature = Dict[str, str]  # a batch's fixed shapes, by path in the batch ("batch.sparse_features")


def batch_signature(batch: Any, path: str = "batch") -> Signature:
    """What a captured step fixes of its batch, by path: each tensor's shape and dtype; each KJT's keys, batch
    size, weightedness and id count per key (computed here: pass host batches, whose count costs no device sync,
    and whose ``.to()`` carries it to the device copy)."""
    if isinstance(batch, KeyedJaggedTensor):
        signature = {f"{path}.keys": str(batch.keys()), f"{path}.batch_size": str(batch.stride()),
                     f"{path}.weights": "weighted" if batch.weights_or_none() is not None else "unweighted"}
        signature.update({f"{path}.ids[{key!r}]": str(n) for key, n in zip(batch.keys(), batch.length_per_key())})
        return signature
    if isinstance(batch, torch.Tensor):
        return {path: f"shape {tuple(batch.shape)}, {batch.dtype}"}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items: Any = ((f".{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch))
    elif isinstance(batch, dict):
        items = ((f"[{k!r}]", v) for k, v in batch.items())
    elif isinstance(batch, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(batch))
    else:
        return {path: repr(batch)}
    signature = {}
    for name, value in items:
        signature.update(batch_signature(value, path + name))
    return signature


def signature_difference(captured: Signature, batch: Signature) -> Optional[Tuple[str, str]]:
    """Where ``batch`` first differs from the captured batch (its path), and how, in words; None where it fits."""
    for path in sorted(set(captured) | set(batch)):
        if captured.get(path) != batch.get(path):
            return path, f"{path}: {batch.get(path, 'absent')} (the captured batch: {captured.get(path, 'absent')})"
    return None


def without_counts(signature: Signature, kjt_path: Optional[str]) -> Signature:
    """``signature`` without the id counts per key of the KJT at ``kjt_path`` (a ``StaticKJT``'s: they may vary)."""
    if kjt_path is None:
        return signature
    return {path: v for path, v in signature.items() if not path.startswith(f"{kjt_path}.ids[")}


def kjt_paths(signature: Signature) -> List[str]:
    """The paths of a batch's KJTs (``batch_signature``)."""
    return [path.removesuffix(".keys") for path in signature if path.endswith(".keys")]


def copy_batch_(static: Any, batch: Any) -> None:
    """Refill the captured step's batch ``static`` with ``batch``, on the device, in the current stream (their
    signatures are equal: ``batch_signature``; a ``StaticKJT`` takes any id counts, one past its capacity refused
    by the step, on every rank: ``StaticKJT.fill_``)."""
    if isinstance(static, StaticKJT):
        static.fill_(batch, past_capacity=True)
    elif isinstance(static, KeyedJaggedTensor):
        copy_kjt_(static, batch)
    elif isinstance(static, torch.Tensor):
        static.copy_(batch, non_blocking=True)
    elif dataclasses.is_dataclass(static):
        for f in dataclasses.fields(static):
            copy_batch_(getattr(static, f.name), getattr(batch, f.name))
    elif isinstance(static, dict):
        for key, value in static.items():
            copy_batch_(value, batch[key])
    elif isinstance(static, (list, tuple)):
        for mine, theirs in zip(static, batch):
            copy_batch_(mine, theirs)


def map_batch(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """``batch`` with ``fn`` applied to each KJT and tensor in it, the same nesting (dataclasses, dicts, sequences)."""
    if isinstance(batch, (KeyedJaggedTensor, torch.Tensor)):
        return fn(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: map_batch(getattr(batch, f.name), fn)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, dict):
        return {k: map_batch(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_batch(v, fn) for v in batch)
    return batch


def _clone(leaf: Any) -> Any:
    if isinstance(leaf, KeyedJaggedTensor):
        weights = leaf.weights_or_none()
        return KeyedJaggedTensor(keys=leaf.keys(), values=leaf.values().clone(), lengths=leaf.lengths().clone(),
                                 offsets=leaf.offsets().clone(), weights=None if weights is None else weights.clone(),
                                 stride=leaf.stride(), length_per_key=leaf.length_per_key())
    return leaf.detach().clone()


def clone_batch(batch: Any) -> Any:
    """A detached copy of ``batch`` in memory of its own, the same nesting: a graph's static batch must not share
    a dataloader's tensors (refilling it would overwrite them), and a step on the static batch returns tensors the
    next step rewrites (a replay's outputs, the static batch's own labels passed through)."""
    return map_batch(batch, _clone)


def step_unless(optimizer: torch.optim.Optimizer, refused: Optional[torch.Tensor]) -> None:
    """``optimizer.step()``, its parameters and state put back where ``refused`` (a one-element device bool) holds:
    a copy of the dense state a step, a few kernels per dtype, no host read, except for state the optimizer keeps
    on the host (Adam's step count unless ``capturable`` or ``fused``: one sync a step). State the step creates (on
    its first call) stays as it made it."""
    if refused is None:
        optimizer.step()
        return
    params = [p for group in optimizer.param_groups for p in group["params"]  # what the step may change
              if p.grad is not None and not hasattr(p, "_in_backward_optimizers")]
    tensors = params + [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        before = {key: _flatten_dense_tensors(ts) for key, ts in groups.items()}
        optimizer.step()
        for key, ts in groups.items():
            kept = before[key]
            torch.where(refused.to(key[1]), kept, _flatten_dense_tensors(ts), out=kept)
            torch._foreach_copy_(ts, list(_unflatten_dense_tensors(kept, ts)))


class ReplayDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's DDP wrapping of the dense modules, built in a side stream. DDP holds each dense parameter's
    gradient accumulator, which runs in the stream it was made in; one made in the default stream cannot take part
    in a captured backward ("operation would make the legacy stream depend on a capturing blocking stream"), so
    PyTorch's CUDA-graph notes build DDP in a side stream. ``ReplayTrainPipeline`` rewraps a model built with
    TorchRec's default wrapper this way (and refuses other wrappers); pass this one to
    ``DistributedModelParallel(data_parallel_wrapper=...)`` to build it so at once."""

    def wrap(self, dmp: Any, env: ShardingEnv, device: torch.device) -> None:
        if device.type != "cuda":
            super().wrap(dmp, env, device)
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            super().wrap(dmp, env, device)
        torch.cuda.current_stream(device).wait_stream(side)


def wrap_dense_in_side_stream(model: nn.Module, device: torch.device) -> None:
    """Rewrap the DDP of a ``DistributedModelParallel`` built by TorchRec's default wrapper in a side stream
    (``ReplayDataParallelWrapper``, the same settings): the old DDP and the gradient accumulators it kept go. A
    collective: DDP's construction checks and broadcasts the dense parameters (rank 0's, as when DMP built it)."""
    ddp = getattr(model, "_dmp_wrapped_module", None)
    built_by = getattr(model, "_data_parallel_wrapper", None)
    if not isinstance(ddp, DistributedDataParallel) or isinstance(built_by, ReplayDataParallelWrapper):
        return
    if type(built_by) is not DefaultDataParallelWrapper:
        raise PgasError(f"ReplayTrainPipeline: the model's DDP was built by {type(built_by).__name__}, in the default "
                        "stream, where a CUDA graph cannot take its gradient accumulators: build the model with "
                        "DistributedModelParallel(data_parallel_wrapper=torchrec_pgas.ReplayDataParallelWrapper(...))")
    wrapper = ReplayDataParallelWrapper.__new__(ReplayDataParallelWrapper)
    wrapper.__dict__.update(built_by.__dict__)  # the user's settings: bucket size, static graph, params to ignore
    model._dmp_wrapped_module = ddp.module  # type: ignore[assignment]
    del ddp
    gc.collect()  # the reducer's accumulators must go before the new DDP makes its own
    wrapper.wrap(model, model._env, device)  # type: ignore[arg-type]
    model._data_parallel_wrapper = wrapper  # type: ignore[assignment]


class DenseGradients:
    """The dense optimizer's parameters' gradients: zeroed before each step, and, where DDP wraps the dense modules
    (``DistributedModelParallel``'s default), averaged over its group as DDP would. ``module`` is what to call in
    place of the model, so that DDP's reducer takes no part in the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        wrapped = getattr(model, "_dmp_wrapped_module", model)  # DMP holds its DDP there (TorchRec's pipelines too)
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        self.module: nn.Module = model if ddp is None else ddp.module
        self.params: List[torch.Tensor] = [  # the dense ones: not the tables', whose optimizer runs in backward
            p for group in optimizer.param_groups for p in group["params"]
            if isinstance(p, nn.Parameter) and p.requires_grad and not hasattr(p, "_in_backward_optimizers")]
        self._group = None if ddp is None else ddp.process_group
        self._world = 1 if ddp is None else dist.get_world_size(self._group)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture the average: NCCL's collectives (or nothing to average), not gloo's."""
        backend = dist.get_backend(self._group)  # "nccl", "gloo", or per device type: "cpu:gloo,cuda:nccl"
        return self._world == 1 or backend == "nccl" or "cuda:nccl" in backend

    def zero_(self) -> None:
        """Zero the gradients in place (a graph's backward then accumulates into the tensors it captured); where
        they are averaged, every parameter has one, so that every rank's all-reduce has the same size."""
        if self._world > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def average(self) -> None:
        """Each gradient's mean over the ranks, one all-reduce a dtype (DDP's buckets, flattened)."""
        if self._world == 1:
            return
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads).div_(self._world)
            dist.all_reduce(flat, group=self._group)
            torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))

    def held(self) -> List[Optional[torch.Tensor]]:
        return [p.grad for p in self.params]

    def restore(self, grads: List[Optional[torch.Tensor]]) -> None:
        """Point the parameters' ``.grad`` at the tensors a graph writes (none before the capture)."""
        for p, g in zip(self.params, grads):
            p.grad = g


class ReplayTrainPipeline(TrainPipeline[In, Out]):
    """Trains ``model`` (``forward(batch) -> (losses, output)``, as TorchRec's pipelines call it) one batch a
    ``progress`` call, its steps replayed as one CUDA graph after ``warmup_steps`` eager ones (module docstring).

    ``optimizer`` is the dense parameters' (the tables' optimizer runs in their backward); it steps after each
    replay. Returns the step's ``output`` (a copy, on the device). Batches come from ``dataloader_iter`` on the
    host; every batch the graph replays must match the first one's shapes (``batch_signature``), others train
    eagerly. Where the model's one sharded EBC can take a ``StaticKJT`` (``variable_counts``, the default), the
    id counts per feature may vary up to its capacity; pass ``variable_counts=False`` for a model that reads the
    batch's per-key sizes itself. A refused step raises from ``progress`` with its batch consumed, as eager
    training raises; a replay raises an earlier replay's refusal after its own launch, its own batch trained
    (``CapturedTrainStep``). On GPUs the constructor is a collective where it rebuilds DDP
    (``wrap_dense_in_side_stream``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 warmup_steps: int = 2, variable_counts: bool = True) -> None:
        super().__init__()
        self._model, self._optimizer, self._device = model, optimizer, device
        cuda = device.type == "cuda"
        if cuda:
            wrap_dense_in_side_stream(model, device)
        self._dense = DenseGradients(model, optimizer)
        self._steps = list(pgas_steps(model))  # whose device words say whether a step was refused
        self._copy_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if cuda else None
        self._replay: Optional[CapturedTrainStep] = (
            CapturedTrainStep(self._graph_step, warmup_steps) if cuda else None)
        self._static: Optional[In] = None  # the graph's batch, refilled on the device before each replay
        self._static_signature: Signature = {}
        self._graph_grads: List[Optional[torch.Tensor]] = []
        self._next: Optional[Tuple[In, Signature]] = None  # the next batch on the device, its host signature
        self._connected = False
        self._said: Set[str] = set()
        self._batches_off_graph = 0
        self._counts_checked = not variable_counts  # whether the static batch's KJT may be a StaticKJT was decided
        self._static_kjt: Optional[StaticKJT] = None
        self._static_path: Optional[str] = None  # its path in the batch (``batch_signature``)
        self._graph_refused: Optional[torch.Tensor] = None  # whether the graph's step was refused (``_refused``)

    @property
    def captured(self) -> bool:
        """Whether the training step has been captured: the next fitting batch replays it."""
        return self._replay is not None and self._replay.captured

    @property
    def batches_off_graph(self) -> int:
        """The training batches that did not fit the graph's batch, trained eagerly so far."""
        return self._batches_off_graph

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        if not self._connected:
            self._next, self._connected = self._fetch(dataloader_iter), True
        if self._next is None:
            raise StopIteration()
        (batch, signature), self._next = self._next, None
        # a capture records the current device's streams: this pipeline's, whatever the caller's current device
        with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
            try:
                self._wait_for_copy(batch)
                if not self._model.training:  # an eval step: forward only, as TorchRec's pipelines
                    with torch.no_grad():
                        return self._dense.module(batch)[1]
                return self._train(batch, signature)
            finally:  # a batch refused with an error is consumed too, as in eager training
                self._next = self._fetch(dataloader_iter)  # its copy overlaps the step just enqueued

    def _train(self, batch: In, signature: Signature) -> Out:
        """One training step on ``batch``: through the graph's step where it fits the graph's batch (eagerly
        until the capture; always on CPUs), else eagerly; then the dense optimizer's step."""
        if self._static is None:
            self._static, self._static_signature = clone_batch(batch), signature  # the graph's batch from now on
        else:
            if not self._counts_checked:  # the first step set up the model's input dists
                self._take_variable_counts()
            difference = signature_difference(self._static_signature, without_counts(signature, self._static_path))
            if difference is not None:  # said once per kind of difference (a KJT's id counts: once for all keys)
                path, words = difference
                self._say_once(re.sub(r"\[.*?\]", "", path), "ReplayTrainPipeline: a batch the graph cannot take, "
                               f"trained eagerly (said once per kind of difference): {words}")
                return self._eager_step(batch)
            copy_batch_(self._static, batch)
        if self._replay is None:  # CPUs: the graph's step on the static batch, eagerly
            self._say_once("cpu", "ReplayTrainPipeline: no CUDA graphs on CPUs: every step runs eagerly")
            output = self._graph_step()
            self._step_dense(averaged=self._dense.capturable, refused=self._graph_refused)
            return clone_batch(output)
        was_captured, launches, returned = self._replay.captured, self._replay.launches, False
        past_capacity = self._static_kjt is not None and self._static_kjt.capacity_error() is not None
        try:
            output = self._replay()
            returned = True
        finally:
            # A replay raises an earlier replay's refused step after its own launch: this batch trained all the same
            if returned or self._replay.launches > launches:
                if not was_captured and self._replay.captured:  # this call captured the step
                    self._graph_grads = self._dense.held()
                self._dense.restore(self._graph_grads)
                self._step_dense(averaged=self._dense.capturable, refused=self._graph_refused)
                if past_capacity:  # this step's error; an earlier step's raised by the replay is its context
                    self._raise_past_capacity()
        return clone_batch(output)

    def _take_variable_counts(self) -> None:
        """Where the model's one sharded EBC can take a ``StaticKJT`` (``static_feature_groups``) and the batch
        holds one KJT, make the static batch's KJT one at its shardings' capacities: batches of any id count per
        key then replay (those past a capacity are refused on the device). Before the capture: the graph reads it
        from then on."""
        self._counts_checked = True
        ebcs = [m for m in self._model.modules() if isinstance(m, PgasShardedEmbeddingBagCollection)]
        groups = ebcs[0].static_feature_groups if len(ebcs) == 1 else None
        paths = kjt_paths(self._static_signature)
        if groups is None or len(paths) != 1 or (self._replay is not None and self._replay.captured):
            return

        def at_capacity(leaf: Any) -> Any:
            if not isinstance(leaf, KeyedJaggedTensor) or not covers_keys(groups, len(leaf.keys())):
                return leaf  # keys the EBC does not read: their ids would take room no sharding checks
            self._static_kjt = StaticKJT.at_capacity(leaf, groups)
            return self._static_kjt

        self._static = map_batch(self._static, at_capacity)
        if self._static_kjt is None:
            return
        self._static_path = paths[0]
        self._static_signature = without_counts(self._static_signature, self._static_path)

    def _raise_past_capacity(self) -> None:
        """A replayed batch past its ``StaticKJT``'s capacity was refused on the device, on every rank: its rank
        raises the capacity error now (one sync, on this path only), not a later step a corrupt-input one."""
        err = self._static_kjt.capacity_error() if self._static_kjt is not None else None
        assert err is not None
        try:
            check_errors(self._model)
        except PgasError as recorded:
            raise err from recorded
        raise err

    def _step_dense(self, averaged: bool, refused: Optional[torch.Tensor]) -> None:
        """The dense optimizer's step, undone on the device where ``refused`` says the PGAS step was refused on the
        device (a bad id or a batch past the capacity on some rank: no rank knows it yet without a sync), as eager
        training, whose refused steps raise before it, never takes it."""
        if not averaged:
            self._dense.average()
        step_unless(self._optimizer, refused)

    def _refused(self) -> Optional[torch.Tensor]:
        """Whether the PGAS step just run was refused on the device (any sharding, any rank), a device bool no host
        reads; None on the host path, whose refused steps raise."""
        flags = [r for r in (s.last_step_refused() for s in self._steps) if r is not None]
        return torch.cat(flags).any() if flags else None

    def _forward_backward(self, batch: In) -> Out:
        self._dense.restore(self._graph_grads)  # a caller's zero_grad(set_to_none=True) may have dropped them
        self._dense.zero_()
        losses, output = self._dense.module(batch)
        torch.sum(losses, dim=0).backward()
        return output

    def _graph_step(self) -> Out:
        """What the graph holds: forward and backward on the static batch (the tables' update in it), and the
        dense gradients' average where it can be captured."""
        assert self._static is not None
        output = self._forward_backward(self._static)
        if self._dense.capturable:
            self._dense.average()
        self._graph_refused = self._refused()  # captured too: each replay rewrites it
        return output

    def _eager_step(self, batch: In) -> Out:
        self._batches_off_graph += 1
        output = self._forward_backward(batch)
        self._step_dense(averaged=False, refused=self._refused())
        return output

    def _fetch(self, dataloader_iter: Iterator[In]) -> Optional[Tuple[In, Signature]]:
        """The next host batch, its signature, and its copy to the device on the copy stream (None: no more)."""
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            return None
        signature = batch_signature(batch)
        with torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext():
            return batch.to(self._device, non_blocking=True), signature

    def _wait_for_copy(self, batch: In) -> None:
        if self._copy_stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._copy_stream)
            batch.record_stream(current)

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)
