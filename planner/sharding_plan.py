"""Plan generators for hand-built plans, the PGAS twins of ``torchrec.distributed.sharding_plan``."""

import dataclasses
from typing import Optional

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import ParameterShardingGenerator, row_wise, table_row_wise, table_wise
from torchrec.distributed.types import ModuleSharder, ParameterSharding

from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_ROW_WISE, PGAS_TABLE_WISE


def _renamed(stock: ParameterShardingGenerator, sharding_type: str,
             compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    def _generator(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[nn.Module],
    ) -> ParameterSharding:
        ps = stock(param, local_size, world_size, device_type, sharder)
        return dataclasses.replace(ps, sharding_type=sharding_type, compute_kernel=compute_kernel or ps.compute_kernel)

    return _generator


def pgas_table_wise(rank: int, compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """Like ``table_wise(rank)``: the whole table on ``rank``, the same ``state_dict``."""
    return _renamed(table_wise(rank=rank, compute_kernel=compute_kernel or EmbeddingComputeKernel.FUSED.value),
                    PGAS_TABLE_WISE)


def pgas_row_wise(compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """Like ``row_wise()``: the same ``ceil(N/W)`` shards and ``EnumerableShardingSpec``,
    so checkpoints interchange with ``row_wise``; only the sharding type differs.

    Example::

        plan = construct_module_sharding_plan(
            ebc, {"t0": pgas_row_wise(), "t1": row_wise()}, sharder=PgasEmbeddingBagCollectionSharder()
        )
    """
    return _renamed(row_wise(compute_kernel=compute_kernel or EmbeddingComputeKernel.FUSED.value), PGAS_ROW_WISE)


def pgas_table_row_wise(host_index: int, compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """Like ``table_row_wise(host_index)``: the table on node ``host_index`` (the plan's ``local_size`` ranks
    a node), in the same ``ceil(N/local_size)`` row blocks, so checkpoints interchange with
    ``table_row_wise``."""
    return _renamed(table_row_wise(host_index=host_index), PGAS_TABLE_ROW_WISE,
                    compute_kernel or EmbeddingComputeKernel.FUSED.value)
