"""The sharder users add to DistributedModelParallel, and the ShardedEBC it builds."""

import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingContext
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, KJTList
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import (
    LazyAwaitable,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_pgas.sharding.device_step import DeviceStep
from torchrec_pgas.sharding.group import StepGroup, groups_of
from torchrec_pgas.sharding.owner_choice import OwnerBackwardTrial
from torchrec_pgas.sharding.rw_sharding import PgasRwPooledEmbeddingSharding
from torchrec_pgas.sharding.stages import PgasShardingMixin, strip_pgas_fused_params
from torchrec_pgas.sharding.step import PgasStep
from torchrec_pgas.sharding.tbe_counters import StockForwardCounters, counting_tbes
from torchrec_pgas.sharding.tw_sharding import PgasTwPooledEmbeddingSharding
from torchrec_pgas.sharding.twrw_sharding import PgasTwRwPooledEmbeddingSharding
from torchrec_pgas.static_kjt import FeatureGroup
from torchrec_pgas.types import (
    FUSED_PARAM_PGAS_CONFIG,
    PGAS_ROW_WISE,
    PGAS_SHARDING_TYPES,
    PGAS_TABLE_ROW_WISE,
    PGAS_TABLE_WISE,
    PgasConfig,
    pgas_config_from_fused_params,
)


_SUM_THEN_DIVIDE = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
_PGAS_SHARDINGS = {PGAS_ROW_WISE: PgasRwPooledEmbeddingSharding, PGAS_TABLE_WISE: PgasTwPooledEmbeddingSharding,
                   PGAS_TABLE_ROW_WISE: PgasTwRwPooledEmbeddingSharding}


class PgasShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """ShardedEBC that also knows the PGAS sharding types; everything else is stock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # TorchRec's mean callback (installed when a stock RW/TWRW table uses
        # MEAN) divides every feature it does not list as SUM by the bag length.
        # Only RW/TWRW run MEAN as SUM in the TBE; every other sharding (the PGAS
        # ones, which divide in their combine, and TW/CW, whose TBE already
        # averages) must be listed as SUM or it is divided twice. Stock TorchRec
        # 1.6.1 misses the TW/CW case: a MEAN table_wise table next to a MEAN
        # row_wise table in one EBC comes out divided twice.
        for config in self._embedding_bag_configs:
            if self.module_sharding_plan[config.name].sharding_type not in _SUM_THEN_DIVIDE:
                self._pooling_type_to_rs_features[PoolingType.SUM.value].extend(
                    config.feature_names
                )
        steps = list(pgas_steps(self))
        self.step_group = StepGroup()  # the module's PGAS steps; its sharder puts in the model's group
        self.step_group.join(steps)
        self._first_step: Optional[PgasStep] = steps[0] if steps else None
        self._holds_stock = any(not isinstance(s, PgasShardingMixin) for s in self._embedding_shardings)
        # Where a refused step could reach a backward on some ranks only: stock tables (their collectives), or GPU
        # node steps (a failure the kernels record stays on its node).
        self._agrees_before_backward = self._holds_stock or (
            any(isinstance(s, PgasTwRwPooledEmbeddingSharding) for s in self._embedding_shardings)
            and any(isinstance(step, DeviceStep) for step in steps))
        self.stock_counters = StockForwardCounters([
            tbe for sharding, lookup in zip(self._embedding_shardings, self._lookups)
            if not isinstance(sharding, PgasShardingMixin) for tbe in counting_tbes(lookup)])
        self.step_group.count_stock_forwards(self.stock_counters)

    def compute_and_output_dist(
        self, ctx: EmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        if self._holds_stock:
            self.stock_counters.before_forward(self._step_epochs(ahead=1))
        awaitable = super().compute_and_output_dist(ctx, input)  # the lookups ran: their epoch is this step's
        if self._agrees_before_backward:
            awaitable.callbacks.append(functools.partial(self._refuse_before_backward, self._step_epochs(ahead=0)))
        return awaitable

    def _step_epochs(self, ahead: int) -> Tuple[int, ...]:
        """The model's step this forward runs, before its lookups (``ahead=1``) or after them (0): its first PGAS
        sharding's, or for a module with none, M or M + 1 (the model's other EBCs ran step M's lookups before
        this one, or will run step M + 1's after it)."""
        if self._first_step is not None:
            return (self._first_step.looked_up + ahead,)
        last = max((step.looked_up for step in self.step_group.members()), default=0)
        return (last, last + 1)

    def _refuse_before_backward(self, epochs: Tuple[int, ...], out: KeyedTensor) -> KeyedTensor:
        """A module holding stock shardings (or GPU node steps): the gradient of its output first checks the
        model's step for errors its PGAS shardings' kernels recorded in the forward on any rank
        (``StepGroup.refuse_failed_step``: one sync and one small all-reduce a step), so that a refused step reaches
        no stock sharding's fused backward, nor another node's update (GPUs find bad ids in the kernels; on CPUs
        they raise in the forward, and the check finds none)."""
        values, group = out.values(), self.step_group
        if values.requires_grad:
            agree = functools.partial(first_failed_rank, self._env.process_group, values.device)
            values.register_hook(lambda grad: group.refuse_failed_step(epochs, agree))
        return out

    @property
    def static_feature_groups(self) -> Optional[Tuple[FeatureGroup, ...]]:
        """The features each sharding reads (positions in the input KJT) and its ids capacity, where this module
        can take a ``StaticKJT`` (a captured step's batch whose id count per feature varies): every sharding a PGAS
        one reading its input whole, no feature read by two of them, no mean callback (it reads per-key sizes);
        None otherwise, or before its first forward (which sets up its input dist from a real batch)."""
        shardings = self._embedding_shardings
        if (self._has_uninitialized_input_dist or self._has_mean_pooling_callback or not shardings
                or not all(isinstance(s, PgasShardingMixin) and s.reads_input_order and s.step is not None
                           for s in shardings)):
            return None
        capacities = [s.step.spec.ids_capacity for s in shardings]  # type: ignore[attr-defined]
        if len(shardings) == 1 and not self._has_features_permute:  # it reads the input in its input order
            return (FeatureGroup(tuple(range(len(shardings[0].feature_names()))), capacities[0]),)
        order = self._features_order if self._has_features_permute else list(range(sum(self._feature_splits)))
        if len(set(order)) != len(order):
            return None
        starts = [sum(self._feature_splits[:s]) for s in range(len(shardings))]
        return tuple(FeatureGroup(tuple(order[a:a + n]), c)
                     for a, n, c in zip(starts, self._feature_splits, capacities))

    def _create_input_dist(self, input_feature_names: List[str]) -> None:
        """Stock, except that a module holding one PGAS sharding (and no mean callback, which reads
        the permuted KJT) gives the sharding its feature order instead of permuting a copy of the
        whole KJT every step."""
        super()._create_input_dist(input_feature_names)
        if not self._has_features_permute or len(self._embedding_shardings) != 1 or self._has_mean_pooling_callback:
            return
        sharding = self._embedding_shardings[0]
        if isinstance(sharding, PgasShardingMixin) and sharding.reads_input_order and sharding.step is not None:
            sharding.step.read_input_order(self._features_order)
            self._has_features_permute = False
            self._features_order = []  # a TensorDict input stays in input order too

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding[
        EmbeddingShardingContext, KeyedJaggedTensor, torch.Tensor, torch.Tensor
    ]:
        config = pgas_config_from_fused_params(sharding_infos[0].fused_params)
        infos = [strip_pgas_fused_params(i, FUSED_PARAM_PGAS_CONFIG) for i in sharding_infos]
        sharding_type = infos[0].param_sharding.sharding_type
        if sharding_type in _PGAS_SHARDINGS:
            return _PGAS_SHARDINGS[sharding_type](
                infos, env, device, pgas_config=config, qcomm_codecs_registry=qcomm_codecs_registry
            )
        return super().create_embedding_bag_sharding(
            infos, env, device, permute_embeddings, qcomm_codecs_registry
        )


def first_failed_rank(pg: Optional[dist.ProcessGroup], device: torch.device, failed: bool) -> int:
    """Collective over ``pg``: the lowest rank whose ``failed`` is True, -1 if none (on ``device``: NCCL reduces
    device tensors)."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    word = torch.tensor([world - rank if failed else 0], dtype=torch.int64, device=device)
    dist.all_reduce(word, op=dist.ReduceOp.MAX, group=pg)
    top = int(word.item())
    return world - top if top else -1


class PgasEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Drop-in replacement for ``EmbeddingBagCollectionSharder`` adding ``pgas_row_wise`` and
    ``pgas_table_wise`` (both backends: ``nvshmem`` on GPUs, ``shm`` on CPU).

    Tables planned with stock sharding types are sharded exactly as before.
    ``sharding_types()`` lists only the stock types: TorchRec's own enumerator
    (what DMP uses when given no plan) cannot size shards of a type it does not
    know. PGAS types come from a plan: ``PgasEnumerator`` (it offers them for
    this sharder) or a hand-built one (``torchrec_pgas.planner.pgas_row_wise``).

    Args:
        fused_params: as for the stock sharder (TBE optimizer, output dtype,
            ``bounds_check_mode``; PGAS shardings default to ``FATAL``).
        pgas_config: sizes of the symmetric buffers and the peer wait timeout.
    """

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        pgas_config: Optional[PgasConfig] = None,
        sharded_module_order_overwrite: Optional[List[str]] = None,
    ) -> None:
        fused = dict(fused_params or {})
        fused[FUSED_PARAM_PGAS_CONFIG] = pgas_config or PgasConfig()
        super().__init__(
            fused_params=fused,
            qcomm_codecs_registry=qcomm_codecs_registry,
            sharded_module_order_overwrite=sharded_module_order_overwrite,
        )
        self._group = StepGroup()

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> PgasShardedEmbeddingBagCollection:
        """Stock's sharded EBC with the PGAS types; its PGAS shardings join this sharder's group (the model's:
        ``torchrec_pgas.sharding.group``)."""
        sharded = PgasShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )
        self._group.join(pgas_steps(sharded))
        sharded.step_group = self._group
        self._group.count_stock_forwards(sharded.stock_counters)
        return sharded

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if sharding_type in PGAS_SHARDING_TYPES:
            # The PGAS lookup reads TBE weight storage: the HBM/DDR-resident TBE.
            return [EmbeddingComputeKernel.FUSED.value]
        return super().compute_kernels(sharding_type, compute_device_type)

    @property
    def sharded_module_type(self) -> Type[ShardedEmbeddingBagCollection]:
        return PgasShardedEmbeddingBagCollection


def pgas_steps(module: nn.Module) -> Iterator[PgasStep]:
    """The PGAS steps inside ``module`` (a DMP or a sharded model), one per PGAS sharding, in module order."""
    for m in module.modules():
        if isinstance(m, PgasShardedEmbeddingBagCollection):
            for sharding in m._embedding_shardings:
                if isinstance(sharding, PgasShardingMixin) and sharding.step is not None:
                    yield sharding.step


def trace_comm(module: nn.Module, records: int, step_bytes: int) -> Dict[str, torch.Tensor]:
    """Start the comm timeline of every GPU step in ``module``: per step name, the int64 ``[records, 2]``
    buffer of (ns, cumulative bytes stored into peers) the next steps fill, one record per ``step_bytes``.
    ``DeviceStep.comm_trace.stop()`` ends it; ``DeviceStep.comm_trace.remote_bytes()`` reads the count."""
    return {step.spec.name: step.comm_trace.start(records, step_bytes)
            for step in pgas_steps(module) if isinstance(step, DeviceStep)}


def owner_backward_trials(module: nn.Module) -> List[OwnerBackwardTrial]:
    """The ``owner_backward="auto"`` trial of each PGAS sharding inside ``module`` on this rank, in module order
    (``chosen``: the path it chose, None while timing; ``medians``: the apply times it compared); empty under
    another owner backward."""
    return [step.owner_apply.trial for step in pgas_steps(module) if step.owner_apply.trial is not None]


def check_errors(module: nn.Module) -> None:
    """Synchronize and raise what the GPU recorded for finished PGAS steps.

    Fused kernels never sync with the host; a bad id (FATAL), a batch-size
    mismatch or a peer's abort is raised at the next forward of the module at
    the latest, or here.
    """
    steps = list(pgas_steps(module))
    for step in steps:
        step.synchronize()
    for group in groups_of(steps):
        group.deferred.settle()  # a backward that raised before its end left its checks
        group.raise_recorded()
