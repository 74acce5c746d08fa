"""PNG figures of one ``benchmarks/embedding.py`` result file.

    python -m benchmarks.plots benchmarks/results/<run>

Reads ``<run>/results.json`` or ``results.json.gz`` (and ``planner_validation.csv`` if the planner was
validated on the run) and writes the figures next to it, so a result
folder carries its own pictures. A figure whose data the run did not produce
(a preset left out, no single-GPU reference) is skipped, not drawn empty.
"""

import argparse
import csv
import glob
import itertools
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FuncFormatter

from torchrec_pgas.planner.calibrate import read_results

Row = Dict[str, Any]

# One color per timed variant, the same in every figure.
COLORS = {"1-GPU TBE": "tab:gray", "stock eager": "tab:blue", "pgas eager": "tab:orange",
          "pgas graph": "tab:green"}
P50 = {"stock eager": "stock_p50_ms", "pgas eager": "pgas_p50_ms", "pgas graph": "pgas_graph_p50_ms"}
ROOFLINE = {"stock eager": "roofline_stock", "pgas eager": "roofline_pgas", "pgas graph": "roofline_graph"}
# Training steps' floor fractions, eager (a CUDA graph cannot capture FBGEMM's backward).
TRAIN_ROOFLINE = {"stock eager": "roofline_train_stock", "pgas eager": "roofline_train_pgas"}
# PGAS over NCCL on 2 GPUs, as the paper reports it for its weak- and strong-scaling runs.
PAPER_SPEEDUP = {"s000-weak": 2.10, "s000-strong": 2.95}
# The same at 2, 3 and 4 GPUs (its 4x V100 runs).
PAPER_SPEEDUP_BY_WORLD = {"s000-weak": {2: 2.10, 3: 1.95, 4: 1.87}, "s000-strong": {2: 2.95, 3: 2.55, 4: 2.44}}
PAIR_STYLE = {"rw": "-", "tw": "--"}
RESULTS = ("results.json", "results.json.gz")  # a run's results file: large old ones are kept gzipped


def _times(x: float) -> str:
    """7.9x, 56x, 0.85x: about two significant digits, never scientific notation."""
    return f"{x:.0f}x" if x >= 10 else f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _label(row: Row) -> str:
    # Presets may reuse config names (quick vs s004), so the preset is part of the label.
    return f"{row['preset']}: {row['name']}"


def _pooling_label(row: Row) -> str:
    return f"L={row['pooling']}" if row["pooling_dist"] == "fixed" else f"L~U[1,{row['pooling']}]"


def _log_log(ax: Any, xlabel: str, ylabel: str) -> None:
    """Log-log axes with labels, a grid and the legend (set formatters after: the scale resets them)."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _figure(meta: Dict[str, Any], what: str, size: Tuple[float, float]) -> Figure:
    """A constrained-layout figure whose title says which machine and commit produced the numbers."""
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # Agg explicitly: no pyplot state, no display needed
    fig.suptitle(f"{what}\n{meta['device']}, world size {meta['world_size']}, commit {meta['commit']}")
    return fig


def speedup_heatmap(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """Stock/PGAS p50 over tables x batch, one column per pooling, eager above CUDA graph."""
    grid = [r for r in rows if r["preset"] == "s004"] or [r for r in rows if r["preset"] == "quick"]
    if not grid:
        return None
    tables = sorted({r["tables"] for r in grid})
    batches = sorted({r["batch_per_gpu"] for r in grid})
    poolings = sorted({_pooling_label(r): (r["pooling"], r["pooling_dist"]) for r in grid}.items(),
                      key=lambda kv: kv[1])
    kinds = [("eager", "speedup_eager")]
    if any(r["speedup_graph"] is not None for r in grid):
        kinds.append(("CUDA graph", "speedup_graph"))
    values = [v for r in grid for _, key in kinds if (v := r[key]) is not None]
    # Symmetric on a log scale so 1x is the neutral color; at least 0.5x..2x so noise stays pale.
    span = max(2.0, *(max(v, 1 / v) for v in values))
    norm = LogNorm(1 / span, span)
    cmap = colormaps["RdBu"].with_extremes(bad="0.92")
    ids = ", ".join(sorted({r["ids"] for r in grid}))
    fig = _figure(meta, f"stock p50 / PGAS p50 ({grid[0]['preset']}, ids {ids})",
                  (3.6 * len(poolings) + 1.2, 3.4 * len(kinds) + 0.8))
    axes = fig.subplots(len(kinds), len(poolings), squeeze=False)
    for (kind, key), ax_row in zip(kinds, axes):
        for (plabel, _), ax in zip(poolings, ax_row):
            cell = {(r["tables"], r["batch_per_gpu"]): r[key] for r in grid if _pooling_label(r) == plabel}
            data = [[cell.get((t, b)) or math.nan for b in batches] for t in tables]
            image = ax.imshow(data, cmap=cmap, norm=norm, origin="lower", aspect="auto")
            for y, line in enumerate(data):
                for x, v in enumerate(line):
                    if not math.isnan(v):
                        red, green, blue, _ = cmap(norm(v))
                        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                        ax.text(x, y, _times(v), ha="center", va="center", fontsize=9,
                                color="white" if dark else "black")
            present = [v for v in cell.values() if v is not None]
            ax.set_title(f"{kind}, {plabel}: geomean {_times(_geomean(present))}" if present else f"{kind}, {plabel}")
            ax.set_xticks(range(len(batches)), [str(b) for b in batches])
            ax.set_yticks(range(len(tables)), [str(t) for t in tables])
            ax.set_xlabel("batch per GPU")
            ax.set_ylabel("tables")
    fig.colorbar(image, ax=axes, label="speedup", format=FuncFormatter(lambda v, _: f"{v:g}x"))
    return fig


def _crossover(rows: List[Row]) -> Optional[Tuple[float, float]]:
    """First place, in bytes order, where stock eager catches up with PGAS eager.

    The (bytes, ms) point is interpolated in log-log between the two configs on
    either side of the sign change of log(stock / pgas)."""
    for a, b in itertools.pairwise(rows):
        da = math.log(a["stock_p50_ms"] / a["pgas_p50_ms"])
        db = math.log(b["stock_p50_ms"] / b["pgas_p50_ms"])
        if da > 0 >= db:
            t = da / (da - db)
            x = math.exp((1 - t) * math.log(a["nvlink_bytes"]) + t * math.log(b["nvlink_bytes"]))
            y = math.exp((1 - t) * math.log(a["stock_p50_ms"]) + t * math.log(b["stock_p50_ms"]))
            return x, y
    return None


def _by_bytes(rows: List[Row]) -> List[Row]:
    return sorted((r for r in rows if r["nvlink_bytes"] > 0), key=lambda r: r["nvlink_bytes"])


def crossovers(rows: List[Row]) -> Dict[int, Optional[float]]:
    """Per world size, the NVLink bytes per GPU per step at which stock eager catches up (None: never)."""
    worlds = sorted({r["world_size"] for r in rows})
    found = {w: _crossover(_by_bytes([r for r in rows if r["world_size"] == w])) for w in worlds}
    return {w: c[0] if c else None for w, c in found.items()}


def crossover(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """p50 against NVLink traffic: where (if anywhere) the fixed cost of stock stops dominating."""
    rows = _by_bytes(rows)
    if not rows:
        return None
    cross = _crossover(rows)
    fig = _figure(meta, "p50 vs bytes over NVLink" + ("" if cross else ": no crossover in this sweep"), (8, 5.5))
    ax = fig.subplots()
    for series, key in P50.items():
        pts = [(r["nvlink_bytes"], r[key]) for r in rows if r[key] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=COLORS[series], lw=0.8, alpha=0.5)
            ax.scatter(xs, ys, color=COLORS[series], s=14, label=series)
    floor = [(r["nvlink_bytes"], r["floor_ms"]) for r in rows if r["floor_ms"] is not None]
    if floor:
        ax.plot(*zip(*floor), "k--", lw=1, label="floor")
    if cross:
        ax.annotate(f"stock catches up\nat ~{EngFormatter(unit='B', places=1)(cross[0])}", cross, xytext=(-90, 40),
                    textcoords="offset points", arrowprops={"arrowstyle": "->"})
    _log_log(ax, "bytes over NVLink per GPU per step", "p50 (ms)")
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    return fig


def _stage_rows(rows: List[Row]) -> List[Row]:
    """The configs a stage figure shows: all but the s004 grid's, of which two batch sizes at pooling 8."""
    return [r for r in rows if r["preset"] != "s004" or (r["pooling"] == 8 and r["batch_per_gpu"] in (128, 4096))]


def _stage_names(rows: List[Row], kind: str) -> List[str]:
    """Every stage of ``{side}_{kind}`` over both sides, in their order."""
    return list(dict.fromkeys(s for r in rows for side in ("stock", "pgas") for s in r[f"{side}_{kind}"]))


def _stage_bars(meta: Dict[str, Any], shown: List[Row], kind: str, color: Dict[str, Any], what: str,
                legend_title: Optional[str] = None) -> Figure:
    """Stacked ``{side}_{kind}`` bars, stock above PGAS, per config.

    Bars are scaled to the config's stock total so small and large configs stay
    equally legible; the end labels give the totals in ms."""
    fig = _figure(meta, f"{what} (bars scaled to the stock total)", (10, 0.5 * len(shown) + 1.8))
    ax = fig.subplots()
    longest = 1.0  # a PGAS bar longer than stock's
    for i, r in enumerate(shown):
        scale = sum(r[f"stock_{kind}"].values())
        for offset, side in ((-0.2, "stock"), (0.2, "pgas")):
            left = 0.0
            for s, ms in r[f"{side}_{kind}"].items():
                ax.barh(i + offset, ms / scale, left=left, height=0.38, color=color[s])
                left += ms / scale
            longest = max(longest, left)
            total = sum(r[f"{side}_{kind}"].values())
            ax.text(left + 0.01, i + offset, f"{side} {total:.3g} ms", va="center", fontsize=7)
    ax.set_yticks(range(len(shown)), [_label(r) for r in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.22 * longest)  # room for the end labels
    ax.set_xlabel("fraction of the stock stage total")
    fig.legend([Patch(color=color[s]) for s in color], list(color), loc="outside right upper", title=legend_title)
    return fig


def stages(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """Where each forward's time goes: stacked stage bars per config."""
    shown = _stage_rows(rows)
    if not shown:
        return None
    names = _stage_names(shown, "stages_ms")
    palette = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return _stage_bars(meta, shown, "stages_ms", {s: palette(i) for i, s in enumerate(names)}, "stage breakdown")


def _train_rows(rows: List[Row]) -> List[Row]:
    """The rows of a ``--mode train`` run (they carry the forward's fields too)."""
    return [r for r in rows if r.get("mode") == "train"]


def _shades(names: List[str], family: str) -> Dict[str, Any]:
    """One color per name from a sequential colormap, light to dark (none too pale to see)."""
    cmap = colormaps[family]
    return {s: cmap(0.35 + 0.55 * i / max(1, len(names) - 1)) for i, s in enumerate(names)}


def train_stages(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """Where each training step's time goes: the forward's stages (those the forward breakdown names) in
    greens, the backward's in purples, so the backward's share reads at a glance."""
    shown = _stage_rows(_train_rows(rows))
    if not shown:
        return None
    forward = set(_stage_names(shown, "stages_ms"))
    names = _stage_names(shown, "train_stages_ms")
    color = {**_shades([s for s in names if s in forward], "Greens"),
             **_shades([s for s in names if s not in forward], "Purples")}
    return _stage_bars(meta, shown, "train_stages_ms", color, "training step stages",
                       legend_title="forward: greens\nbackward: purples")


def train_step(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """Training-step p50 of both sides per config, each over its forward p50 (lighter, hatched): the part
    above the hatch is the backward's and the optimizer's; labels: stock / PGAS training step."""
    rows = _train_rows(rows)
    if not rows:
        return None
    optimizers = ", ".join(sorted({r["optimizer"] for r in rows}))
    fig = _figure(meta, f"training step p50 ({optimizers}; hatched: the forward's p50)",
                  (max(7.0, 1.1 * len(rows) + 3), 5.5))
    ax = fig.subplots()
    handles = []
    for offset, side in ((-0.2, "stock"), (0.2, "pgas")):
        color = COLORS[f"{side} eager"]
        light = tuple(0.5 + 0.5 * c for c in to_rgb(color))
        xs = [i + offset for i in range(len(rows))]
        ax.bar(xs, [r[f"{side}_train_p50_ms"] for r in rows], width=0.38, color=color)
        ax.bar(xs, [r[f"{side}_p50_ms"] for r in rows], width=0.38, color=light, hatch="//", edgecolor=color)
        handles += [(Patch(color=color), f"{side} training step"),
                    (Patch(facecolor=light, hatch="//", edgecolor=color), f"{side} forward")]
    for i, r in enumerate(rows):
        top = max(r["stock_train_p50_ms"], r["pgas_train_p50_ms"])
        ax.text(i, top * 1.08, _times(r["speedup_train"]), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p50 (ms)")
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], rotation=20, ha="right", fontsize=8)
    ax.margins(y=0.15)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(*zip(*handles), fontsize=8)
    return fig


def train_graph(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """The PGAS training step over stock's eager one per config, eager and replayed as one CUDA graph
    (``--train-graph``), each series' geomean per preset dashed: stock cannot capture its step."""
    rows = [r for r in _train_rows(rows) if r.get("speedup_train_graph")]
    if not rows:
        return None
    fig = _figure(meta, "training step: stock eager p50 / PGAS p50 (dashed: geomean per preset)",
                  (max(7.0, 0.22 * len(rows) + 3), 5.0))
    ax = fig.subplots()
    for key, series in (("speedup_train", "pgas eager"), ("speedup_train_graph", "pgas graph")):
        color = COLORS[series]
        ax.plot(range(len(rows)), [r[key] for r in rows], "o", color=color, label=f"{series} step", markersize=4)
        for preset, group in itertools.groupby(range(len(rows)), key=lambda i: rows[i]["preset"]):
            xs = list(group)
            mean = _geomean([rows[i][key] for i in xs])
            ax.hlines(mean, xs[0] - 0.4, xs[-1] + 0.4, color=color, linestyle="--", linewidth=1)
            ax.text(xs[-1] + 0.4, mean, _times(mean), color=color, va="bottom", ha="right", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup over stock's eager step")
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], rotation=90, fontsize=6)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def scaling(meta: Dict[str, Any], rows: List[Row], single: List[Row]) -> Optional[Figure]:
    """Distributed p50 against the 1-GPU TBE doing the whole job, next to the paper's 2-GPU speedups.

    Within a preset, the i-th single-GPU entry is the reference of the i-th
    distributed config, both sorted by (tables, batch); their counts must match."""
    panels = []
    for preset in PAPER_SPEEDUP:
        dist = sorted((r for r in rows if r["preset"] == preset), key=lambda r: (r["tables"], r["batch_per_gpu"]))
        ref = sorted((s for s in single if s["preset"] == preset), key=lambda s: (s["tables"], s["batch"]))
        if dist and ref:
            panels.append((preset, list(zip(dist, ref, strict=True))))
    if not panels:
        return None
    width = max(len(pairs) for _, pairs in panels)
    fig = _figure(meta, "scaling against one GPU (labels: 1-GPU p50 / p50)",
                  (max(7.0, (2 * width + 3) * len(panels)), 5))
    for ax, (preset, pairs) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        ours = ", ".join(_times(r["stock_p50_ms"] / r["pgas_p50_ms"]) for r, _ in pairs)
        ax.set_title(f"{preset}\nPGAS over NCCL: {ours} here, {PAPER_SPEEDUP[preset]:.2f}x in the paper (2 GPUs)",
                     fontsize=10)
        for i, (r, ref) in enumerate(pairs):
            bars = [("1-GPU TBE", ref["p50_ms"])] + [(s, r[k]) for s, k in P50.items() if r[k] is not None]
            for j, (series, ms) in enumerate(bars):
                x = i + (j - 1.5) * 0.2
                ax.bar(x, ms, width=0.18, color=COLORS[series])
                if j:
                    ax.text(x, ms, _times(ref["p50_ms"] / ms), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(pairs)), [r["name"] for r, _ in pairs])
        ax.set_ylabel("p50 (ms)")
        ax.margins(y=0.15)
    fig.legend([Patch(color=c) for c in COLORS.values()], list(COLORS), loc="outside lower center", ncols=len(COLORS))
    return fig


def world_scaling(meta: Dict[str, Any], rows: List[Row], single: List[Row]) -> Optional[Figure]:
    """Weak and strong scaling over world sizes (a merged ``gpu_check.sh scaling`` run): p50 of both
    sides of each pair against the 1-GPU TBE, and PGAS over its stock twin next to the paper's."""
    presets = [p for p in PAPER_SPEEDUP_BY_WORLD if len({r["world_size"] for r in rows if r["preset"] == p}) > 1]
    if not presets:
        return None
    fig = _figure(meta, "scaling with the number of GPUs (eager p50)", (6.5 * len(presets), 9))
    axes = fig.subplots(2, len(presets), squeeze=False)
    for col, preset in enumerate(presets):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in rows if r["preset"] == preset]
        for pair in sorted({"rw" if r["stock"] == "row_wise" else "tw" for r in mine}):
            runs = sorted((r for r in mine if (r["stock"] == "row_wise") == (pair == "rw")), key=lambda r: r["world_size"])
            gpus = [r["world_size"] for r in runs]
            ls = PAIR_STYLE[pair]
            top.plot(gpus, [r["stock_p50_ms"] for r in runs], ls, marker="o", color=COLORS["stock eager"],
                     label=runs[0]["stock"])
            top.plot(gpus, [r["pgas_p50_ms"] for r in runs], ls, marker="o", color=COLORS["pgas eager"],
                     label=runs[0]["pgas"])
            bottom.plot(gpus, [r["stock_p50_ms"] / r["pgas_p50_ms"] for r in runs], ls, marker="o",
                        color=COLORS["pgas eager"], label=f"{runs[0]['pgas']} / {runs[0]['stock']}")
        for s in single:
            if s["preset"] == preset:
                top.axhline(s["p50_ms"], color=COLORS["1-GPU TBE"], lw=1, label="1-GPU TBE (the whole job)")
        paper = PAPER_SPEEDUP_BY_WORLD[preset]
        bottom.plot(list(paper), list(paper.values()), ":", marker="s", color="k", label="paper, 4x V100")
        bottom.axhline(1.0, color="k", lw=0.5)
        top.set_title(preset, fontsize=10)
        top.set_ylabel("p50 (ms)")
        bottom.set_ylabel("PGAS over NCCL")
        for ax in (top, bottom):
            ax.set_xlabel("GPUs")
            ax.set_xticks(sorted({r["world_size"] for r in mine}))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    return fig


def _floor_fraction(meta: Dict[str, Any], rows: List[Row], floor_key: str, series: Dict[str, str],
                    what: str) -> Optional[Figure]:
    """Achieved fraction of the bandwidth floor ``floor_key``, against the floor itself, one point per config
    and series (GPU runs only: a CPU run measures no bandwidths, so its rows have no floor)."""
    rows = [r for r in rows if r.get(floor_key) is not None]
    if not rows:
        return None
    fig = _figure(meta, f"{what} (HBM {meta['hbm_gbps']:g} GB/s, NVLink {meta['p2p_gbps']:g} GB/s)", (8, 5.5))
    ax = fig.subplots()
    for name, key in series.items():
        pts = [(r[floor_key], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.scatter(*zip(*pts), color=COLORS[name], s=14, label=name)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="floor")
    _log_log(ax, "floor (ms)", "achieved fraction of the floor")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g}%"))
    return fig


def roofline(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """How close each forward comes to its bandwidth floor."""
    return _floor_fraction(meta, rows, "floor_ms", ROOFLINE, "fraction of the floor")


def train_roofline(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """The same for the training step: its floor adds the backward's gradient traffic and optimizer update."""
    return _floor_fraction(meta, _train_rows(rows), "train_floor_ms", TRAIN_ROOFLINE,
                           "training step: fraction of the floor")


def planner_scatter(meta: Dict[str, Any], validation: List[Dict[str, str]]) -> Optional[Figure]:
    """The cost model's leave-one-out prediction against the measurement, one point per (config, backend,
    mode) of ``planner_validation.csv`` (``python -m torchrec_pgas.planner.calibrate --validate``)."""
    if not validation:
        return None
    fig = _figure(meta, "planner cost model: leave-one-out predicted vs measured step", (7, 6))
    ax = fig.subplots()
    series = {("nccl", "eager"): "stock eager", ("pgas", "eager"): "pgas eager", ("pgas", "graph"): "pgas graph"}
    for (side, mode), name in series.items():
        for family, marker in (("rw", "o"), ("tw", "x")):  # row-wise and table-wise backends
            pts = [(float(v["measured_ms"]), float(v["predicted_ms"])) for v in validation
                   if v["backend"] == f"{side}_{family}" and v["mode"] == mode]
            if pts:
                ax.scatter(*zip(*pts), color=COLORS[name], marker=marker, s=14, label=f"{name} ({family})")
    lo = min(min(float(v["measured_ms"]), float(v["predicted_ms"])) for v in validation) / 1.5
    hi = max(max(float(v["measured_ms"]), float(v["predicted_ms"])) for v in validation) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="exact")
    ax.fill_between([lo, hi], [lo / 1.2, hi / 1.2], [lo * 1.2, hi * 1.2], color="k", alpha=0.08, label="±20%")
    _log_log(ax, "measured P50 (ms)", "predicted (ms)")
    return fig


def comm_timeline(meta: Dict[str, Any], rows: List[Row]) -> Optional[Figure]:
    """Bytes this rank stored into peers over one step (the paper's Fig. 7 shape): PGAS measured by the
    kernels' counter (``--comm-timeline``), stock drawn from its stage times (flat, then bursts)."""
    traced = [r for r in rows if r.get("comm_timeline")]
    # The paper's weak/strong configs when the run has them, else the two largest steps.
    rows = [r for r in traced if r["preset"] in PAPER_SPEEDUP] or sorted(
        traced, key=lambda r: r["nvlink_bytes"])[-2:]
    if not rows:
        return None
    fig = _figure(meta, "communication over one step: bytes stored into other GPUs", (6 * len(rows), 4.5))
    for ax, r in zip(fig.subplots(1, len(rows), squeeze=False)[0], rows):
        pgas, stock = r["comm_timeline"]["pgas"], r["comm_timeline"]["stock_model"]
        ax.plot(*zip(*pgas), color=COLORS["pgas eager"], label=f"{r['pgas']} (device counter)")
        ax.plot(*zip(*stock), color=COLORS["stock eager"], ls="--", label=f"{r['stock']} (from stage times)")
        ax.set_title(_label(r), fontsize=9)
        ax.set_xlabel("time since the step started (ms)")
        ax.set_ylabel("bytes stored remotely")
        ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _results_file(folder: str) -> Optional[str]:
    """The folder's results file, plain or gzipped; None if it has neither."""
    return next((p for p in (os.path.join(folder, n) for n in RESULTS) if os.path.exists(p)), None)


def _load(path: str) -> Dict[str, Any]:
    """A results file; older files name the world size in their meta only, so rows get it too."""
    results = read_results(path)
    for r in results["rows"]:
        r.setdefault("world_size", results["meta"]["world_size"])
    return results


def make_plots(results_dir: str) -> List[str]:
    """Write every figure the results support into ``results_dir``; returns their paths. A folder of one
    run per pair (``rw/``, ``tw/``, each with its results.json) gets each run's figures in its subfolder
    and the planner's (fitted on both) next to them."""
    path = _results_file(results_dir)
    if path is None:
        found = [f for d in sorted(glob.glob(os.path.join(results_dir, "*"))) if (f := _results_file(d))]
        if not found:
            raise FileNotFoundError(f"no results.json(.gz) in {results_dir} or its subfolders")
        paths = [p for f in found for p in make_plots(os.path.dirname(f))]
        fig = planner_scatter(read_results(found[0])["meta"], _validation(results_dir))
        if fig is not None:
            paths.append(os.path.join(results_dir, "planner_scatter.png"))
            save_png(fig, paths[-1])
        return paths
    results = _load(path)
    meta, rows = results["meta"], results["rows"]
    validation = _validation(results_dir)
    figures = {
        "speedup_heatmap": speedup_heatmap(meta, rows),
        "crossover": crossover(meta, rows),
        "stages": stages(meta, rows),
        "scaling": scaling(meta, rows, results.get("single_gpu", [])) if isinstance(meta["world_size"], int) else None,
        "world_scaling": world_scaling(meta, rows, results.get("single_gpu", [])),
        "roofline": roofline(meta, rows),
        "planner_scatter": planner_scatter(meta, validation),
        "comm_timeline": comm_timeline(meta, rows),
        "train_step": train_step(meta, rows),
        "train_stages": train_stages(meta, rows),
        "train_roofline": train_roofline(meta, rows),
        "train_graph": train_graph(meta, rows),
    }
    paths = []
    for name, fig in figures.items():
        if fig is not None:
            path = os.path.join(results_dir, f"{name}.png")
            save_png(fig, path)
            paths.append(path)
    return paths


def save_png(fig: Figure, path: str) -> None:
    """``fig`` as a PNG of at most 64 colours: results folders are committed, and a plot's flat fills and lines
    lose nothing visible in a palette a third the size of the RGBA image."""
    from PIL import Image  # matplotlib's own dependency

    fig.savefig(path, dpi=120)
    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=64)
    palette.save(path, optimize=True)


def _validation(results_dir: str) -> List[Dict[str, str]]:
    """``planner_validation.csv`` of ``calibrate --validate``, if the folder has one."""
    path = os.path.join(results_dir, "planner_validation.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", help="folder holding results.json(.gz); the PNGs are written there")
    results_dir = parser.parse_args().results_dir
    for path in make_plots(results_dir):
        print(path)
    for path in sorted(p for n in RESULTS for p in glob.glob(os.path.join(results_dir, n))
                       + glob.glob(os.path.join(results_dir, "*", n))):
        for world, at in crossovers(_load(path)["rows"]).items():
            where = f"at {EngFormatter(unit='B', places=1)(at)} over NVLink per GPU" if at else "nowhere in this sweep"
            print(f"{os.path.dirname(path)}: world size {world}, stock eager catches up {where}")


if __name__ == "__main__":
    main()
