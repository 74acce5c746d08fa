"""Latency-aware cost model of one sharded embedding-bag step, per backend: the forward, and for training
its backward.

TorchRec's estimator prices communication by bandwidth alone, which cannot tell NCCL from PGAS on the small
messages where they differ most. Here a step of a backend costs::

    t = alpha                        fixed: launches, host syncs, signal round trips, Python per step
      + hbm_bytes   * k_hbm          rows gathered by the busiest owner (the lookup)
      + wire_bytes  * k_wire         ids in and partial pools out that cross to other ranks
      + local_bytes * k_local        outputs written and unpacked/finalized on this rank

with one coefficient set per backend and timing mode, fitted from ``benchmarks.embedding`` results
(``python -m torchrec_pgas.planner.calibrate``). Byte counts come from the table config, the per-rank
batch, the mean pooling factors and the world size; they are the same formulas the benchmark's roofline
uses. Intra-node NVLink only (PGAS needs load/store-reachable peers).

Four backends: row-wise (every rank holds a block of each table and pays for it every step) and
table-wise (one owner gathers every rank's bags of the table), each over NCCL (stock TorchRec) or PGAS.
A table-wise table's bytes are its owner's; a step of table-wise tables costs its busiest rank, with the
tables placed largest first on the least-loaded rank (what TorchRec's greedy partitioner does).

Training (``CostModel(..., training=True)``) prices forward + backward, stock and PGAS alike, so that they
compare fairly. The backward is a bytes model (``backward_bytes``: the pooled-output gradient crossing
back, and the owner's fused TBE backward + optimizer; PGAS also replays the lookup) mapped to ms with the
backend's backward coefficients where a training benchmark fitted them (``<backend>_bwd`` next to the
forward's in a profile), else with its forward per-byte coefficients and no fixed cost. The bytes model
prices PGAS's backward as FBGEMM's owner path (``owner_backward="fbgemm"``: a replayed lookup); the default owner
update skips the replay and the host sync (2.3-2.5x faster at W = 2 on s004, ``benchmarks/archive/NOTES-2026-11.md.gz``
§40). The backward terms of ``h100x2_nvlink.json`` and ``h200x2_nvlink.json`` are fitted on the owner update, whose
fixed cost and per-byte price absorb the difference; ``h200x8_nvlink.json`` has none (forward prices, no fixed cost).
"""

import dataclasses
import json
import os
import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

NCCL_RW = "nccl_rw"
PGAS_RW = "pgas_rw"
NCCL_TW = "nccl_tw"
PGAS_TW = "pgas_tw"
BACKENDS = (NCCL_RW, PGAS_RW, NCCL_TW, PGAS_TW)
TABLE_WISE = (NCCL_TW, PGAS_TW)
STOCK = (NCCL_RW, NCCL_TW)  # ties go to the stock path
BWD = "_bwd"  # a profile's backward coefficients of backend b are its entry b + BWD
# Bytes of one id on the wire: TorchRec's values all-to-all sends int64; PGAS sends int32 local rows.
ID_BYTES = {NCCL_RW: 8, PGAS_RW: 4, NCCL_TW: 8, PGAS_TW: 4}
PROFILES = os.path.join(os.path.dirname(__file__), "profiles")
# Shipped profiles by GPU (in its CUDA device name) and world size (the fixed costs grow with both); a
# GPU's other world sizes get its 2-GPU profile, other GPUs (or none named) DEFAULT_GPU's.
SHIPPED_PROFILES = {
    ("H200", 2): os.path.join(PROFILES, "h200x2_nvlink.json"),
    ("H200", 8): os.path.join(PROFILES, "h200x8_nvlink.json"),
    ("H100", 2): os.path.join(PROFILES, "h100x2_nvlink.json"),
}
DEFAULT_GPU = "H200"


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """One backend in one timing mode: alpha in ms, the others in ms per byte."""

    alpha_ms: float
    k_hbm: float
    k_wire: float
    k_local: float


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Fitted coefficients per backend and mode ("eager", "graph"), with where they came from; optionally
    a backend's backward ones, under ``<backend>_bwd`` (see ``backward``)."""

    name: str
    device: str
    world_size: int
    source: str  # the command, commit and date that produced the fit
    coefficients: Dict[str, Dict[str, Coefficients]]  # mode -> backend -> coefficients
    # The link between nodes as one GPU sees it (``inter_node.InterNodeLink``'s fields); None: not measured
    inter_host: Optional[Dict[str, float]] = None

    def has(self, backend: str, mode: str = "eager") -> bool:
        return backend in self.coefficients.get(mode, {})

    def get(self, backend: str, mode: str) -> Coefficients:
        if mode not in self.coefficients or backend not in self.coefficients[mode]:
            raise KeyError(f"profile '{self.name}' has no {backend} coefficients for mode '{mode}'")
        return self.coefficients[mode][backend]

    def has_backward(self, backend: str, mode: str = "eager") -> bool:
        return backend + BWD in self.coefficients.get(mode, {})

    def backward(self, backend: str, mode: str) -> Coefficients:
        """The backward's coefficients: fitted ones when the profile has them, else the forward's per-byte
        coefficients with no fixed cost (which of the forward's launches and syncs a backward repeats is
        what a training benchmark has to measure; until then it is not guessed)."""
        if self.has_backward(backend, mode):
            return self.coefficients[mode][backend + BWD]
        return dataclasses.replace(self.get(backend, mode), alpha_ms=0.0)

    def to_json(self) -> Dict[str, object]:
        out: Dict[str, object] = {
            "name": self.name, "device": self.device, "world_size": self.world_size, "source": self.source,
            "coefficients": {m: {b: dataclasses.asdict(c) for b, c in bs.items()}
                             for m, bs in self.coefficients.items()},
        }
        if self.inter_host is not None:
            out["inter_host"] = dict(self.inter_host)
        return out

    @staticmethod
    def from_json(d: Dict[str, object]) -> "HardwareProfile":
        coeffs = {m: {b: Coefficients(**c) for b, c in bs.items()}  # type: ignore[union-attr]
                  for m, bs in d["coefficients"].items()}  # type: ignore[union-attr]
        inter_host = d.get("inter_host")
        return HardwareProfile(str(d["name"]), str(d["device"]), int(d["world_size"]),  # type: ignore[arg-type]
                               str(d["source"]), coeffs, dict(inter_host) if inter_host else None)  # type: ignore


def load_profile(path: Optional[str] = None, device_name: Optional[str] = None,
                 world_size: Optional[int] = None) -> HardwareProfile:
    """The profile at ``path``, else the shipped NVLink profile of the GPU that ``device_name`` (a CUDA
    device name) names, fitted at ``world_size`` GPUs (``SHIPPED_PROFILES``), warning if no profile was
    fitted on that GPU: the numbers then only rank the options roughly."""
    gpu = next((g for g, _ in SHIPPED_PROFILES if device_name and g in device_name), None)
    shipped = SHIPPED_PROFILES.get((gpu or DEFAULT_GPU, world_size), SHIPPED_PROFILES[(gpu or DEFAULT_GPU, 2)])
    with open(path or shipped) as f:
        profile = HardwareProfile.from_json(json.load(f))
    if path is None and device_name is not None and gpu is None:
        warnings.warn(f"torchrec_pgas.planner: no hardware profile for '{device_name}'; using "
                      f"'{profile.name}' ({profile.device}). Calibrate with python -m torchrec_pgas.planner.calibrate")
    return profile


@dataclasses.dataclass(frozen=True)
class TableLoad:
    """What one table asks of a step, per rank."""

    name: str
    rows: int
    dim: int
    pooling: Sequence[float]  # mean ids per bag, one per feature the table serves
    weight_bytes: int = 4  # bytes per element of the table


@dataclasses.dataclass(frozen=True)
class StepBytes:
    hbm: float
    wire: float
    local: float


def table_bytes(t: TableLoad, batch_per_rank: int, world_size: int, backend: str) -> StepBytes:
    """Per-rank bytes of one table. RW: every rank gathers its 1/W of all W ranks' ids, sends the others'
    ids and its partial pools. TW: the owner's, which gathers all W ranks' bags, receives the others' ids
    and sends their pooled rows."""
    ids = batch_per_rank * sum(t.pooling)
    bags = batch_per_rank * len(t.pooling)
    remote = (world_size - 1) / world_size
    out_row = 4 * t.dim  # pooled rows are fp32
    if backend in TABLE_WISE:
        return StepBytes(
            hbm=world_size * ids * t.dim * t.weight_bytes,
            wire=(world_size - 1) * (ids * ID_BYTES[backend] + bags * out_row),
            local=world_size * bags * out_row,
        )
    return StepBytes(
        hbm=ids * t.dim * t.weight_bytes,
        wire=ids * ID_BYTES[backend] * remote + bags * out_row * (world_size - 1),
        local=bags * out_row * world_size,
    )


def expected_owners(pooling: float, world_size: int) -> float:
    """Expected number of the W row blocks that a bag of ``pooling`` uniform ids touches: W(1 - (1 - 1/W)^L)
    (1 for L = 1, towards W for large L)."""
    return world_size * (1 - (1 - 1 / world_size) ** pooling)


def backward_bytes(t: TableLoad, batch_per_rank: int, world_size: int, backend: str) -> StepBytes:
    """Per-rank bytes of one table's backward (TW: the owner's), pooled gradient rows in fp32.

    Every owner runs FBGEMM's fused backward + optimizer on the rows its forward gathered (read and write
    them: twice the forward's HBM bytes) and reads the gradient of the W ranks' bags it pooled for. Stock
    RW all-gathers the pooled gradient (every rank receives the other W-1 ranks' bags); PGAS RW sends each
    bag's gradient row only to the owners that hold ids of it (``expected_owners``, (W-1)/W of them
    remote). TW, stock and PGAS: the owner receives the other ranks' bags (PGAS one-sided). PGAS owners
    also replay the lookup under autograd to drive FBGEMM's backward (``owner_backward="fbgemm"``, what the
    shipped profiles were fitted on): one more gather of the rows. The default owner update does not; its
    sort is not priced either (module docstring)."""
    fwd = table_bytes(t, batch_per_rank, world_size, backend)
    bags = batch_per_rank * len(t.pooling)
    grad_row = 4 * t.dim
    hbm = 2 * fwd.hbm + world_size * bags * grad_row + (0 if backend in STOCK else fwd.hbm)
    if backend == PGAS_RW:
        owners = sum(batch_per_rank * expected_owners(p, world_size) for p in t.pooling)  # (bag, owner) pairs
        return StepBytes(hbm=hbm, wire=owners * grad_row * (world_size - 1) / world_size,
                         local=owners * grad_row / world_size)
    return StepBytes(hbm=hbm, wire=(world_size - 1) * bags * grad_row, local=bags * grad_row)


class TablePrice(NamedTuple):
    """A table's price on one rank, split as TorchRec's ``Perf`` (ms)."""

    fwd_compute: float
    fwd_comms: float
    bwd_compute: float
    bwd_comms: float


class CostModel:
    """Per-table and per-step estimates for one world size, batch and timing mode; with ``training``, of
    forward + backward."""

    def __init__(self, profile: HardwareProfile, world_size: int, batch_per_rank: int, mode: str = "eager",
                 training: bool = False) -> None:
        self.profile = profile
        self.world_size = world_size
        self.batch_per_rank = batch_per_rank
        self.mode = mode
        self.training = training

    def _pass(self, t: TableLoad, backend: str, backward: bool) -> Tuple[float, float, float]:
        """One pass of table ``t``: the backend's fixed cost, the HBM part, the wire + local part (ms);
        zeros for the backward of an inference step."""
        if backward and not self.training:
            return 0.0, 0.0, 0.0
        c = self.profile.backward(backend, self.mode) if backward else self.profile.get(backend, self.mode)
        b = (backward_bytes if backward else table_bytes)(t, self.batch_per_rank, self.world_size, backend)
        return c.alpha_ms, b.hbm * c.k_hbm, b.wire * c.k_wire + b.local * c.k_local

    def fixed_ms(self, backend: str) -> Tuple[float, float]:
        """The fixed cost of a step on ``backend``: (forward's, backward's; 0 for inference)."""
        bwd = self.profile.backward(backend, self.mode).alpha_ms if self.training else 0.0
        return self.profile.get(backend, self.mode).alpha_ms, bwd

    def alpha_ms(self, backend: str) -> float:
        """The fixed cost of a step on ``backend`` (training: forward's + backward's)."""
        return sum(self.fixed_ms(backend))

    def marginal_ms(self, t: TableLoad, backend: str) -> float:
        """What adding table ``t`` to a backend costs a step (no fixed part; training: forward + backward)."""
        return sum(sum(self._pass(t, backend, bwd)[1:]) for bwd in (False, True))

    @property
    def backends(self) -> List[str]:
        """The backends this profile prices (older profiles: row-wise only)."""
        return [b for b in BACKENDS if self.profile.has(b, self.mode)]

    def step_ms(self, tables: Sequence[TableLoad], backend: str) -> float:
        """A step with all of ``tables`` on one backend (0 if there are none); table-wise: its busiest rank."""
        if not tables:
            return 0.0
        costs = [self.marginal_ms(t, backend) for t in tables]
        if backend in TABLE_WISE:
            load = [0.0] * self.world_size
            for c in sorted(costs, reverse=True):  # largest first onto the least-loaded rank
                load[load.index(min(load))] += c
            costs = [max(load)]
        return self.alpha_ms(backend) + sum(costs)

    def table_price(self, t: TableLoad, backend: str, num_tables: int) -> TablePrice:
        """Per-table price for a planner that sums tables per rank: the marginal cost (on every rank for
        RW, on the owner for TW) plus a share of the fixed cost, which every rank pays once per step: 1 /
        ``num_tables`` of it on each rank for RW, W / ``num_tables`` on the owner for TW (so that W
        balanced owners again carry all of it). Per pass: HBM is compute, the rest comms."""
        share = (self.world_size if backend in TABLE_WISE else 1) / max(1, num_tables)
        (fa, fh, fc), (ba, bh, bc) = (self._pass(t, backend, bwd) for bwd in (False, True))
        return TablePrice(fh, fa * share + fc, bh, ba * share + bc)

    def table_ms(self, t: TableLoad, backend: str, num_tables: int) -> float:
        """``table_price`` summed: what the partitioner adds up per rank."""
        return sum(self.table_price(t, backend, num_tables))

    def contribution_parts(self, t: TableLoad, backend: str, num_tables: int) -> Tuple[float, float]:
        """What a table adds to the step when tables balance over the ranks, (forward, backward):
        ``table_price``, with a table-wise owner's cost spread over the W ranks."""
        if backend not in TABLE_WISE:
            p = self.table_price(t, backend, num_tables)
            return p.fwd_compute + p.fwd_comms, p.bwd_compute + p.bwd_comms
        fwd, bwd = (a / max(1, num_tables) + (h + c) / self.world_size
                    for a, h, c in (self._pass(t, backend, b) for b in (False, True)))
        return fwd, bwd

    def contribution_ms(self, t: TableLoad, backend: str, num_tables: int) -> float:
        """``contribution_parts`` summed: the per-table comparison of the four backends."""
        return sum(self.contribution_parts(t, backend, num_tables))

    def choose(self, tables: Sequence[TableLoad]) -> Dict[str, str]:
        """Per table, the backend with the lowest contribution (ties go to the stock path), unless putting
        every table on one backend makes a faster step: contributions assume table-wise tables balance over
        the ranks, which few or uneven tables do not."""
        n = len(tables)
        per_table = {t.name: min(self.backends, key=lambda b: (self.contribution_ms(t, b, n), b not in STOCK))
                     for t in tables}
        uniform = [{t.name: b for t in tables} for b in self.backends]
        return min([per_table] + uniform, key=lambda choice: self.plan_ms(tables, choice))

    def plan_ms(self, tables: Sequence[TableLoad], choice: Dict[str, str]) -> float:
        """The step of an assignment ``choice`` (table name -> backend): each backend's tables run as their
        own sharding, so their steps add up."""
        return sum(self.step_ms([t for t in tables if choice[t.name] == b], b) for b in self.backends)


TERMS = ("hbm", "wire", "local")  # the per-byte terms of a fit's samples, in Coefficients' order after alpha


def fit_coefficients(samples: List[Dict[str, float]], known: Optional[Dict[str, float]] = None) -> Coefficients:
    """Non-negative least squares in relative error over samples with keys
    ``hbm, wire, local, ms`` (an active-set loop over 4 unknowns: small enough to do by hand). A sample's
    error is relative to its ``scale`` (ms) where it has one, else to its ``ms``: a backward sample's ms is
    the difference of two measured steps, and its error counts as a share of the whole step. The per-byte
    terms in ``known`` (term -> ms per byte) keep that price, and terms no sample has bytes of (the wire at
    one GPU) price 0, instead of being fitted: samples that cannot tell a term apart from the others, or
    have none of it, would give it an invented price."""
    import numpy as np

    known = known or {}
    x = np.array([[1.0, s["hbm"], s["wire"], s["local"]] for s in samples])
    y = np.array([s["ms"] for s in samples])
    scale = np.array([s.get("scale", s["ms"]) for s in samples])
    held = np.array([0.0] + [known.get(k, 0.0) for k in TERMS])
    a, rhs = x / scale[:, None], (y - x @ held) / scale  # relative error: small steps count as much as large ones
    active = [0] + [i + 1 for i, k in enumerate(TERMS) if k not in known and x[:, i + 1].any()]
    while True:
        sol = held.copy()
        sol[active] = np.linalg.lstsq(a[:, active], rhs, rcond=None)[0]
        negative = [i for i in active if sol[i] < 0]
        if not negative:
            return Coefficients(*(float(v) for v in sol))
        active.remove(min(negative, key=lambda i: sol[i]))
