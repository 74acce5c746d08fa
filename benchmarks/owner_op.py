"""The owner backward alone: the extension's ``owner_update`` op against FBGEMM's fused backward + optimizer on
the same TBE, ids and gradient, at one device.

    python -m benchmarks.owner_op --preset s000-weak --steps 20 [--min-timed-ms 30] [--optimizer rowwise_adagrad]
        [--side pgas] [--counted]

What the training benchmark (``benchmarks.embedding --mode train``) measures inside a whole DMP step, without the
step: two TBEs of a preset's tables at W = 1 (the owner of every row), initialised alike. Per step, FBGEMM's
backward (``out.backward(grad)`` after an untimed forward, which its autograd needs: its sort and fused update) and
ours (``owner_backward``: the keys laid out by ``owner_keys`` and their sort, ``owner_sort``; the walk,
``owner_update``), each timed with CUDA events. The states are compared after the first step, within the training
benchmark's tolerance (the sums' order differs): a step past it, or an op that does not take the tables, stops
the run. The floor is the training benchmark's backward floor (a gradient row read per id, the key sort, one read
and write of each distinct row and its state) at the measured HBM copy rate.

It holds the tables twice and nothing else (s000-weak: 2 x 16.4 GB fp32), where the DMP benchmark holds three
models and the symmetric heap; ``--side pgas`` builds ours alone (ncu's kernel replay saves and restores the
device memory a kernel may write: ``scripts/gpu_check.sh owner-op``). On CPU both sides run their CPU paths
(FBGEMM's CPU TBE takes SGD and the Adagrads).

An eager step's ids are counted on the host; a captured step's count is a device word, which the same sort
(CUB's onesweep agents, ``csrc/counted_sort.cuh``) reads (``--counted``: our side as a replayed step runs it).
"""

import argparse
import contextlib
import datetime
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torch import nn

from benchmarks.embedding import (
    ATOL,
    OPTIMIZERS,
    PRESETS,
    RTOL,
    Workload,
    backward_hbm_bytes,
    device_tag,
    distinct_rows,
    git_commit,
    make_inputs,
    measure_bandwidths,
    p50,
    p90,
    timed_ms,
    traffic,
    write_results,
)
from torchrec_pgas import profiling
from torchrec_pgas.sharding.owner_backward import op_available, owner_backward

SIDES = ("fbgemm", "pgas")
INPUT_SEED = 7  # make_inputs' seed: one input set per workload
MAX_TIMED_STEPS = 500  # --min-timed-ms's bound


def make_tbe(w: Workload, optimizer: str, precision: SparseType, lr: float, device: torch.device) -> nn.Module:
    """The preset's tables in one TBE, one feature each, weights set from their positions (both sides alike)."""
    cpu = device.type == "cpu"
    spec = (w.rows, w.dim, EmbeddingLocation.HOST if cpu else EmbeddingLocation.DEVICE,
            ComputeDevice.CPU if cpu else ComputeDevice.CUDA)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [spec] * w.tables, optimizer=OPTIMIZERS[optimizer][0], learning_rate=lr, eps=1e-3,
        weights_precision=precision, stochastic_rounding=False, device=device)
    for t, weights in enumerate(tbe.split_embedding_weights()):
        rows = torch.arange(weights.shape[0], dtype=torch.float32, device=device)[:, None]
        cols = torch.arange(weights.shape[1], dtype=torch.float32, device=device)[None, :]
        weights.copy_(torch.sin(rows * 0.37 + cols * 1.3 + t) * 0.5)
    return tbe


def state(tbe: nn.Module) -> List[torch.Tensor]:
    """The TBE's weights and optimizer states, as ``state_dict`` and ``fused_optimizer`` hold them."""
    out = list(tbe.split_embedding_weights())
    return out + [s for states in tbe.split_optimizer_states() for s in states]


def state_error(ours: nn.Module, ref: nn.Module) -> float:
    """The largest |ours - ref| over every weight and state element in units of the training benchmark's
    tolerance (atol 1e-4 + rtol 1e-5, plus one ulp for fp16 weights): at most 1 when they agree; NaN counts as
    infinitely far."""
    worst = 0.0
    for x, y in zip(state(ours), state(ref)):
        if x.numel() == 0:
            continue
        tol = ATOL + RTOL * y.float().abs()
        if y.dtype == torch.float16:
            tol = tol + torch.finfo(torch.float16).eps * y.float().abs().clamp(min=2.0 ** -14)
        ratio = ((x.float() - y.float()).abs() / tol).nan_to_num(nan=float("inf"))
        worst = max(worst, float(ratio.max()))
    return worst


@contextlib.contextmanager
def nvtx_range(name: str, cuda: bool) -> Iterator[None]:
    """An NVTX start/end range around a timed step (nothing on CPU), so a profiler can pick one side of one
    workload (``ncu --nvtx --nvtx-include <name>``). Not push/pop: FBGEMM's backward kernels are launched by
    autograd's device thread, outside a push/pop range of this thread."""
    handle = torch.cuda.nvtx.range_start(name) if cuda else None
    try:
        yield
    finally:
        if handle is not None:
            torch.cuda.nvtx.range_end(handle)


def timed_steps(args: argparse.Namespace, warmup_ms: Dict[str, List[float]]) -> int:
    """--steps, or more where the warmup's last step says they would time less than --min-timed-ms on either side:
    a step of a small workload (0.3-0.8 ms) moves by tens of percent between runs, and 6 of them decide nothing."""
    last = min(ms[-1] for ms in warmup_ms.values())
    wanted = int(args.min_timed_ms / max(last, 1e-3)) + 1
    return max(args.steps, min(wanted, MAX_TIMED_STEPS))


def run_workload(w: Workload, args: argparse.Namespace, device: torch.device,
                 hbm_gbps: Optional[float]) -> Dict[str, Any]:
    """One preset workload: both backwards timed on the same ids and gradient."""
    precision = SparseType.FP16 if args.weights == "fp16" else SparseType.FP32
    tbes = {side: make_tbe(w, args.optimizer, precision, args.lr, device) for side in args.side}
    x = make_inputs(w, w.tables, w.batch_per_gpu, 1, seed=INPUT_SEED, device=device)[0]
    values, offsets = x.values(), x.offsets()
    gen = torch.Generator(device=device).manual_seed(4242)
    grad = torch.randn(w.batch_per_gpu, w.tables * w.dim, generator=gen, device=device) * 0.01
    cuda = device.type == "cuda"

    def fbgemm(tbe: nn.Module) -> Callable[[], None]:
        out = tbe(values, offsets)  # untimed: FBGEMM's backward needs its autograd forward
        return lambda: out.backward(grad)

    def pgas(tbe: nn.Module) -> Callable[[], None]:
        iteration = int(tbe.iter.add_(1))  # what its forward would count (Adam's bias correction reads it)
        return lambda: owner_backward([tbe], x, grad, [iteration], counted=args.counted)

    prepare = {"fbgemm": fbgemm, "pgas": pgas}
    times: Dict[str, List[float]] = {side: [] for side in args.side}
    stages: List[Dict[str, float]] = []
    error = None
    total, i = args.warmup + args.steps, 0
    while i < total:
        for side in args.side:
            backward = prepare[side](tbes[side])
            if i < args.warmup:
                times[side].append(timed_ms(backward, cuda))
                continue
            with nvtx_range(f"{side}:{w.name}", cuda):
                if side == "pgas":  # the op's two stages
                    with profiling.stage_timer(device) as timer:
                        profiling.mark("start")
                        times[side].append(timed_ms(backward, cuda))
                    stages.append(timer.stages())
                else:
                    times[side].append(timed_ms(backward, cuda))
        if i == 0 and len(args.side) == 2:
            error = state_error(tbes["pgas"], tbes["fbgemm"])
            if error > 1:
                raise RuntimeError(f"{w.name}: the op's states are {error:.1f}x the tolerance off FBGEMM's after "
                                   "one step")
        if i == args.warmup - 1:
            total = args.warmup + timed_steps(args, times)
        i += 1
    row: Dict[str, Any] = {"preset": w.preset, "name": w.name, "tables": w.tables, "rows": w.rows, "dim": w.dim,
                           "batch_per_gpu": w.batch_per_gpu, "ids": int(values.numel()),
                           "optimizer": args.optimizer, "weights": args.weights, "state_error": error,
                           "steps": total - args.warmup}
    for side in args.side:
        timed = times[side][args.warmup:]
        row[f"{side}_p50_ms"], row[f"{side}_p90_ms"] = p50(timed), p90(timed)
    if stages:
        if "owner_update" not in stages[0]:  # owner_backward fell back to its torch-ops reference
            raise RuntimeError(f"{w.name}: the owner_update op did not take these tables")
        row["pgas_stages_ms"] = {k: p50([s.get(k, 0.0) for s in stages]) for k in stages[0]}
    if len(args.side) == 2:
        row["speedup"] = row["fbgemm_p50_ms"] / row["pgas_p50_ms"]
    distinct = distinct_rows(w, [x], 1, "rw")
    row["distinct_rows"] = float(distinct[0])
    weight_bytes = 2 if args.weights == "fp16" else 4
    row["hbm_bytes"] = int(backward_hbm_bytes(w, traffic(w, [x], 1, "rw"), distinct, args.optimizer, weight_bytes)[0])
    row["floor_ms"] = 1e3 * row["hbm_bytes"] / (hbm_gbps * 1e9) if hbm_gbps else None
    for side in args.side:
        row[f"roof_{side}"] = row["floor_ms"] / row[f"{side}_p50_ms"] if row["floor_ms"] else None
    return row


def summary(rows: List[Dict[str, Any]]) -> str:
    def ms(v: Optional[float]) -> str:
        return f"{v:9.3f}" if v is not None else "        -"

    lines = [f"{'workload':48} {'fbgemm':>9} {'pgas':>9} {'sort':>9} {'walk':>9} {'x':>6} {'floor':>9}  state error"]
    for r in rows:
        st = r.get("pgas_stages_ms", {})
        x = f"{r['speedup']:5.2f}x" if "speedup" in r else "     -"
        diff = f"{r['state_error']:.2g}" if r["state_error"] is not None else "-"
        lines.append(f"{r['preset'] + '/' + r['name']:48} {ms(r.get('fbgemm_p50_ms'))} {ms(r.get('pgas_p50_ms'))} "
                     f"{ms(st.get('owner_sort'))} {ms(st.get('owner_update'))} {x} {ms(r['floor_ms'])}  {diff}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default s000-weak")
    parser.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(OPTIMIZERS))
    parser.add_argument("--weights", default="fp32", choices=["fp32", "fp16"])
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-timed-ms", type=float, default=30.0,
                        help=f"time more steps than --steps (up to {MAX_TIMED_STEPS}) where they would take less "
                        "than this a side (after the warmup's last step)")
    parser.add_argument("--side", action="append", choices=SIDES, help="repeatable; default both")
    parser.add_argument("--counted", action="store_true",
                        help="our side as a captured step runs it: the keys at twice the ids' positions, sorted and "
                        "walked up to a device word counting the ids (the counted sort, not CUB's)")
    parser.add_argument("--only", help="only the presets' workloads whose name contains this (e.g. hzipf1.2)")
    parser.add_argument("--out", help="results folder (default benchmarks/results/<date>-<device>-<commit>-owner-op)")
    args = parser.parse_args(argv)
    if args.min_timed_ms > 0 and args.warmup < 1:
        parser.error("--min-timed-ms counts from the warmup's last step: give --warmup 1 or more, or --min-timed-ms 0")
    args.side = args.side or list(SIDES)
    workloads = [w for p in (args.preset or ["s000-weak"]) for w in PRESETS[p](1)
                 if not args.only or args.only in w.name]
    if not workloads:
        parser.error(f"no workload of the presets has {args.only!r} in its name")
    if "pgas" in args.side and not op_available():
        parser.error("the owner_update op is not built (an install without the extension): build it first")
    # one rank: the training benchmark's helpers all-reduce over a process group
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    hbm_gbps = measure_bandwidths(device)[0] if cuda else None
    rows = []
    for w in workloads:
        rows.append(run_workload(w, args, device, hbm_gbps))
        if cuda:
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "world_size": 1,
            "commit": git_commit(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "benchmark": "owner_op", "sides": args.side, "optimizer": args.optimizer, "weights": args.weights,
            "learning_rate": args.lr, "steps": args.steps, "warmup": args.warmup, "min_timed_ms": args.min_timed_ms,
            "counted": args.counted,
            "hbm_gbps": hbm_gbps, "argv": sys.argv}
    out_dir = args.out or os.path.join(
        "benchmarks", "results", f"{meta['date']}-{device_tag(device, 1)}-{meta['commit']}-owner-op")
    write_results(out_dir, meta, rows, [])
    if hbm_gbps:
        print(f"measured: HBM {hbm_gbps:.0f} GB/s (copy)")
    print(summary(rows))
    print(f"results: {out_dir}/results.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
