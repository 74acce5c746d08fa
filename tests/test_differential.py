"""Randomized differential test: pgas_row_wise vs stock row_wise on random EBCs and inputs."""

import dataclasses
import random
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from torchrec_pgas.testing import TwoEbcModel, compare_with_stock, random_kjt, run_distributed, seeded
from torchrec_pgas.types import PGAS_ROW_WISE, PgasConfig

pytestmark = pytest.mark.stacks


def random_config(seed: int, world: int) -> Tuple[TwoEbcModel, Dict[str, str], Dict[str, int]]:
    """Tables of dims 4..32 (multiples of 4), 1..300 rows (often < or not divisible by W),
    shared tables, MEAN/SUM, and a random mix of pgas_row_wise / row_wise / table_wise."""
    rnd = random.Random(seed)
    types: Dict[str, str] = {}

    def tables(prefix: str, weighted: bool) -> List[EmbeddingBagConfig]:
        out: List[EmbeddingBagConfig] = []
        for i in range(rnd.randint(1, 4)):
            out.append(
                EmbeddingBagConfig(
                    name=f"{prefix}{i}",
                    num_embeddings=rnd.choice([1, world - 1 or 1, world + 1, rnd.randint(2, 300)]),
                    embedding_dim=4 * rnd.randint(1, 8),
                    feature_names=[f"{prefix}{i}f{j}" for j in range(rnd.choice([1, 1, 1, 2]))],
                    pooling=PoolingType.SUM if weighted else rnd.choice([PoolingType.SUM, PoolingType.MEAN]),
                )
            )
        # table_wise only where stock TorchRec is right: no MEAN row_wise table beside it.
        has_mean = any(c.pooling == PoolingType.MEAN for c in out)
        choices = [PGAS_ROW_WISE, PGAS_ROW_WISE, "row_wise"] + ([] if has_mean else ["table_wise"])
        groups: Dict[Tuple[str, PoolingType], int] = {}
        for i, c in enumerate(out):
            types[c.name] = rnd.choice(choices)
            key = (types[c.name], c.pooling)
            groups[key] = i if key not in groups or c.num_embeddings > out[groups[key]].num_embeddings else groups[key]
        # FBGEMM's CPU TBE fails (stock row_wise too) when a rank owns no row of
        # any table of a TBE group: give each group one table of >= W*W rows,
        # which leaves every ceil(N/W) block non-empty.
        for i in groups.values():
            out[i] = dataclasses.replace(out[i], num_embeddings=max(out[i].num_embeddings, world * world))
        return out

    model = TwoEbcModel(tables("t", False), tables("w", True), seed=seed)
    shape = {"batch": rnd.randint(1, 8), "max_len": rnd.choice([0, 1, 3, 8])}
    return model, types, shape


def _run(rank: int, world: int, seeds: List[int]) -> int:
    checked = 0
    for seed in seeds:
        model, types, shape = random_config(seed, world)
        gen = seeded(seed * 7919 + rank)
        batches = [
            (
                random_kjt(model.ebc.embedding_bag_configs(), shape["batch"], gen, shape["max_len"]),
                random_kjt(model.webc.embedding_bag_configs(), shape["batch"], gen, shape["max_len"], weighted=True),
            )
            for _ in range(2)
        ]
        try:
            compare_with_stock(
                model, types, batches, dist.group.WORLD, torch.device("cpu"), PgasConfig(max_local_batch_size=8)
            )
        except Exception as e:
            raise AssertionError(f"seed {seed}, types {types}, shape {shape}: {e}") from e
        checked += 1
    return checked


@pytest.mark.parametrize("world,n_configs", [(2, 50), (3, 12)])
def test_random_configs_match_stock(world: int, n_configs: int) -> None:
    seeds = list(range(world * 1000, world * 1000 + n_configs))
    assert run_distributed(_run, world, seeds) == [n_configs] * world
