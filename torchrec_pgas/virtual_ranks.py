"""W ranks of the fused GPU kernels on one GPU: a test and profiling harness, not a backend.

The ``nvshmem`` backend runs one rank per GPU. Here every rank's symmetric buffer, signal pad, device state
and table shards are plain allocations on one GPU, and the peer-address table the kernels index points at
them, so the three stage kernels (``csrc/index_dist.cu``, ``pooled_lookup.cu``, ``combine_partials.cu``) run the protocol of W ranks, unchanged, on a one-GPU
machine: the GPU tests check them against a reference at world sizes a machine does not have, and
``benchmarks.virtual_ranks`` times each rank's stages (the owner-dependent paths of the index dist, a lookup
serving W sources, a combine summing W partials).

A step launches every rank's index dist, then every rank's lookup, then every rank's combine, on the current
stream. Each wait of a kernel is for a signal that a kernel earlier on the stream stored, so none spins on a
kernel that cannot start. What it lacks: NVLink (a store into a "peer" lands in this GPU's HBM) and ranks
running at the same time, so its times are each stage's work without the wire.
"""

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from torchrec_pgas.layout import StepLayout, id_bytes_for
from torchrec_pgas.nvshmem_backend import load_extension
from torchrec_pgas.runtime import PAD_HEADER_WORDS
from torchrec_pgas.sharding.device.features import (
    BOUNDS_MODES,
    FeatureOwners,
    bind_weights,
    column_features,
    feature_descs,
)
from torchrec_pgas.step_abi import ERROR_RECORD_WORDS, FeatureDesc, StateWord, as_tensor, as_words
from torchrec_pgas.types import PgasError

# One rank's input of a step: KJT values, int64 offsets [F * B + 1] in [f][b] order, per-sample weights, B.
RankInput = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]
STAGES = ("index_dist", "lookup", "combine")


class VirtualRanks:
    """``world`` ranks of one ``pgas_row_wise`` or ``pgas_table_wise`` sharding on the current GPU.

    ``tables``: each feature's whole table ``[N, D]`` (fp32 or fp16, row-major); a rank's shard is a view of
    it. ``owners``: table-wise, the rank owning each table (non-decreasing: a rank serves one contiguous
    feature range); ``None``: row-wise, ``ceil(N / W)`` rows per rank.
    """

    def __init__(self, tables: Sequence[torch.Tensor], world: int, max_batch: int, ids_capacity: int,
                 owners: Optional[Sequence[int]] = None, is_mean: Optional[Sequence[bool]] = None,
                 weighted: bool = False, out_dtype: torch.dtype = torch.float32,
                 bounds_mode: BoundsCheckMode = BoundsCheckMode.FATAL, timeout_s: float = 20.0) -> None:
        load_extension()
        if owners is not None and list(owners) != sorted(owners):
            raise ValueError(f"table-wise owners {list(owners)} must be non-decreasing")
        self.world = world
        self.tables = list(tables)
        device = self.tables[0].device
        hash_sizes = [t.size(0) for t in self.tables]
        dims = [t.size(1) for t in self.tables]
        mean = list(is_mean) if is_mean is not None else [False] * len(self.tables)
        if owners is None:
            shard_rows = [(n + world - 1) // world for n in hash_sizes]
            per_rank = [FeatureOwners.row_wise(world, mean)] * world
        else:
            shard_rows = hash_sizes
            counts = [list(owners).count(d) for d in range(world)]
            per_rank = [FeatureOwners.table_wise(counts, r, mean) for r in range(world)]
        self.layout = StepLayout(world_size=world, num_features=len(self.tables), max_batch=max_batch,
                               ids_capacity=ids_capacity, dim_sum=sum(dims), weighted=weighted,
                               id_bytes=id_bytes_for(shard_rows))
        self.out_dtype = out_dtype
        self._col_feature = column_features(dims, device)
        self.epoch = 0  # steps run
        self._ranks: List[Dict[str, torch.Tensor]] = []
        self._configs: List[torch.Tensor] = []
        self._max_dims: List[int] = []
        for r, own in enumerate(per_rank):
            own.check(world, r)
            descs = feature_descs(shard_rows, hash_sizes, dims, own)
            f_lo, f_hi = own.lookup
            for f in range(f_lo, f_hi):
                lo = r * shard_rows[f] if owners is None else 0
                bind_weights(descs[f], self.tables[f][min(lo, hash_sizes[f]):lo + shard_rows[f]])
            self._ranks.append(dict(
                buf=torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device),
                pad=torch.zeros(PAD_HEADER_WORDS + self.layout.num_signal_slots, dtype=torch.int64, device=device),
                features=as_words(descs, FeatureDesc).to(device),
                state=torch.zeros(StateWord.STATE_WORDS, dtype=torch.int64, device=device),
                bag_div=torch.zeros(self.layout.num_slots, self.layout.num_features * max_batch, device=device),
                status=torch.zeros(self.layout.num_slots, ERROR_RECORD_WORDS, dtype=torch.int64).pin_memory(),
                config=as_tensor(self.layout.config(int(timeout_s * 1e9), r, BOUNDS_MODES[bounds_mode],
                                                    lookup_features=own.lookup, variable_batch=own.variable_batch)),
            ))
            self._max_dims.append(max(dims[f_lo:f_hi], default=4))
        self._peers = torch.tensor([[s["buf"].data_ptr() for s in self._ranks],
                                    [s["pad"].data_ptr() for s in self._ranks]], dtype=torch.int64, device=device)

    def step(self, inputs: Sequence[RankInput],
             events: Optional[Dict[str, List[torch.cuda.Event]]] = None, trains: bool = False) -> List[torch.Tensor]:
        """One step of every rank; each rank's pooled ``[B, sum(D)]`` output. ``events``: per stage, W + 1
        timing events recorded around that stage's launches (an event between two kernels also makes the
        second wait for the first to complete). ``trains``: a backward follows (``exchange_gradients``), so
        the owners keep the sources' blocks until it releases them."""
        if len(inputs) != self.world:
            raise ValueError(f"{len(inputs)} inputs for {self.world} ranks")
        ops = torch.ops.torchrec_pgas

        def mark(stage: str, r: int) -> None:
            if events is not None:
                events[stage][r].record()

        for r, ((values, offsets, weights, batch), state) in enumerate(zip(inputs, self._state_args())):
            mark("index_dist", r)
            ops.index_dist(values, offsets, weights, *state, batch, False, False)  # a bad id stays its rank's
        mark("index_dist", self.world)
        for r, (inp, state) in enumerate(zip(inputs, self._state_args())):
            mark("lookup", r)
            # After exit: an index dist (a plain launch) lies between this and the rank's previous combine.
            # Without a backward, each source's blocks are released once served.
            ops.pooled_lookup(*state, inp[3], self._max_dims[r], self.out_dtype, True, not trains)
        mark("lookup", self.world)
        outs = []
        for r, (inp, state) in enumerate(zip(inputs, self._state_args())):
            mark("combine", r)
            outs.append(ops.combine_partials(*state, self._col_feature, inp[3], self.out_dtype))
        mark("combine", self.world)
        self.epoch += 1
        return outs

    def exchange_gradients(self, grads: Sequence[torch.Tensor], divisor: float) -> List[List[int]]:
        """The backward's exchange of the last (training) step: every rank sends its gradient ``[B, D]``
        (grad_dist), then every rank waits for its sources' (await_grads); each rank's flags per source
        (0: arrived) and for its own step. The owners' blocks stay until ``release``."""
        ops = torch.ops.torchrec_pgas
        for r, (grad, state) in enumerate(zip(grads, self._state_args())):
            ops.grad_dist(grad.to(self.out_dtype).contiguous(), *state, self.epoch, grad.size(0), divisor, False)
        flags = [torch.zeros(self.world + 1, dtype=torch.int64, device=self._peers.device) for _ in range(self.world)]
        for f, state in zip(flags, self._state_args()):
            ops.await_grads(*state, f, self.epoch)
        return [f.tolist() for f in flags]

    def gradient_rows(self, owner: int, src: int, batch: int) -> torch.Tensor:
        """The gradient block ``src`` stored into ``owner`` in the last step, ``[batch, D]``."""
        lay = self.layout
        block = lay.grad_block(self.epoch % lay.num_slots, src)
        nbytes = batch * lay.dim_sum * self.out_dtype.itemsize
        return self._ranks[owner]["buf"][block:block + nbytes].view(self.out_dtype).view(batch, lay.dim_sum)

    def release(self) -> None:
        """Every owner done with the last step's blocks (release_sources)."""
        for state in self._state_args():
            torch.ops.torchrec_pgas.release_sources(*state, self.epoch)

    def stage_args(self, rank: int) -> Tuple[torch.Tensor, ...]:
        """What every stage op of ``rank`` takes after its own inputs (as ``DeviceStep``'s ops do)."""
        s = self._ranks[rank]
        return s["buf"], s["pad"], self._peers, s["features"], s["state"], s["bag_div"], s["status"], s["config"]

    def _state_args(self) -> List[Tuple[torch.Tensor, ...]]:
        return [self.stage_args(r) for r in range(self.world)]

    def errors(self) -> List[Tuple[int, int, int, int]]:
        """Every rank's latest device error record of the finished steps (code, a, b, c; code 0: none),
        after a sync; reading clears them."""
        torch.cuda.current_stream().synchronize()
        out = []
        for s in self._ranks:
            records = [r for r in s["status"].tolist() if r[1] != 0]
            _, code, a, b, c = max(records) if records else (0, 0, 0, 0, 0)
            out.append((code, a, b, c))
            s["status"].zero_()
        return out

    def check(self) -> None:
        bad = [(r, e) for r, e in enumerate(self.errors()) if e[0] != 0]
        if bad:
            raise PgasError(f"virtual ranks: device error records (rank, (code, a, b, c)): {bad}")

    def stage_times(self, inputs: Sequence[Sequence[RankInput]], steps: int, warmup: int = 3) -> Dict[str, List[List[float]]]:
        """Per stage and rank, the ms of each of ``steps`` steps (cycling over the input sets)."""
        for i in range(warmup):
            self.step(inputs[i % len(inputs)])
        times: Dict[str, List[List[float]]] = {st: [[] for _ in range(self.world)] for st in STAGES}
        for i in range(steps):
            events = {st: [torch.cuda.Event(enable_timing=True) for _ in range(self.world + 1)] for st in STAGES}
            self.step(inputs[i % len(inputs)], events)
            torch.cuda.current_stream().synchronize()
            for st, ev in events.items():
                for r, (a, b) in enumerate(itertools.pairwise(ev)):
                    times[st][r].append(a.elapsed_time(b))
        self.check()
        return times


def reference_pool(tables: Sequence[torch.Tensor], inp: RankInput, is_mean: Sequence[bool],
                   table_wise: bool) -> torch.Tensor:
    """One rank's pooled output from the whole tables, in float64: the sum of each bag's (weighted) rows;
    MEAN as the sharding defines it (row-wise: / (length or weight sum + 1e-6), TorchRec RW; table-wise:
    * (1 / L), the TBE's, 1 for an empty bag)."""
    values, offsets, weights, batch = inp
    cols = []
    for f, (t, mean) in enumerate(zip(tables, is_mean)):
        off = offsets[f * batch:(f + 1) * batch + 1]
        ids = values[off[0]:off[-1]].long()
        w = weights[off[0]:off[-1]].double() if weights is not None else None
        starts = off[:-1] - off[0]
        pooled = torch.nn.functional.embedding_bag(ids, t.double(), starts, mode="sum", per_sample_weights=w)
        if mean:
            lengths = (off[1:] - off[:-1]).double()
            if table_wise:
                pooled = pooled * torch.where(lengths > 0, 1.0 / lengths.clamp(min=1), 1.0)[:, None]
            else:  # the bag's length, or its weight sum: the same pool over a column of ones
                ones = torch.ones(t.size(0), 1, dtype=torch.float64, device=ids.device)
                div = torch.nn.functional.embedding_bag(ids, ones, starts, mode="sum", per_sample_weights=w)[:, 0]
                pooled = pooled / (div + 1e-6)[:, None]
        cols.append(pooled)
    return torch.cat(cols, dim=1)
