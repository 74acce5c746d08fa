"""Plan generators for hand-built plans, the PGAS twins of ``torchrec.distributed.sharding_plan``."""

import dataclasses
from typing import Optional

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import ParameterShardingGenerator, row_wise, table_row_wise, table_wise
from torchrec.distributed.types import ModuleSharder, ParameterSharding

from torchrec_pgas.types import PGAS_ROW_WISE, PGAS_TABLE_ROW_WISE, PGAS_TABLE_WISE


def _replaced(stock: ParameterShardingGenerator, **fields: str) -> ParameterShardingGenerator:
    def _generator(
        param: nn.Parameter,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: ModuleSharder[nn.Module],
    ) -> ParameterSharding:
        return dataclasses.replace(stock(param, local_size, world_size, device_type, sharder), **fields)

    return _generator


def _renamed(stock: ParameterShardingGenerator, sharding_type: str) -> ParameterShardingGenerator:
    return _replaced(stock, sharding_type=sharding_type)


def with_compute_kernel(generator: ParameterShardingGenerator, compute_kernel: str) -> ParameterShardingGenerator:
    """``generator``'s sharding on ``compute_kernel``: e.g. stock ``table_row_wise(h)``, which takes no kernel and
    gets the sharder's first (on CPUs the dense one, which a fused optimizer does not train), on ``"fused"``."""
    return _replaced(generator, compute_kernel=compute_kernel)


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
    return _replaced(table_row_wise(host_index=host_index), sharding_type=PGAS_TABLE_ROW_WISE,
                     compute_kernel=compute_kernel or EmbeddingComputeKernel.FUSED.value)
