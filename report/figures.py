"""Pictures of a plan with matplotlib: the explain figure (Gantt of one iteration over memory per stage) and the
per-pair traffic heatmap. matplotlib is imported inside the drawing functions: it costs a large part of a second
and only the commands that draw need it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from predictor.schedule import stage_label
from specs.outputs import write_atomic

if TYPE_CHECKING:
    from predictor.cost_model import Evaluation
    from predictor.schedule import Block
    from predictor.traffic import Traffic

GIB = 2**30
KIND_COLORS = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "mixed": "#b279a2",
    "dp_sync": "#e45756",
    "optimizer": "#54a24b",
}
KIND_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "mixed": "forward + backward (dense)",
    "dp_sync": "DP sync",
    "optimizer": "optimizer",
}
IDLE_COLOR = "#dddddd"
MEMORY_PARTS = (
    ("weights", "weights_bytes", "#4c78a8"),
    ("grads", "grads_bytes", "#72b7b2"),
    ("optimizer", "optimizer_bytes", "#54a24b"),
    ("activations", "activation_bytes", "#f58518"),
)
# above this many devices the heatmap sums device pairs into node pairs (a pixel per device pair is unreadable)
HEATMAP_MAX_DEVICES = 512
MAX_LABELS = 40  # stage labels per axis; beyond, every n-th
MAX_FIGURE_HEIGHT_IN = 30.0
GANTT_PIXELS = 1000  # about the Gantt's width in pixels: blocks closer than span / this are one bar when dense
DENSE_BLOCKS = 200  # blocks in one stage's row above which the Gantt is summarised (about 5 pixels each)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed on a cluster's login node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def explain_figure(evaluation: Evaluation, blocks: Sequence[Block], title: str, path: Path) -> None:
    """Gantt of one iteration (top) and memory per stage against capacity (bottom), written as a PNG. Legends sit
    right of the charts (never over a title); labels are thinned past MAX_LABELS stages."""
    plt = _pyplot()
    stages = evaluation.stages
    height = min(MAX_FIGURE_HEIGHT_IN, 3 + 0.45 * len(stages) * 2)
    figure, (gantt, memory) = plt.subplots(
        2, 1, figsize=(13, height), dpi=110, gridspec_kw={"height_ratios": [3, 2]}, layout="constrained"
    )
    _draw_gantt(gantt, evaluation, blocks, title)
    _draw_memory(memory, evaluation)
    save_figure(figure, path)
    plt.close(figure)


def save_figure(figure: Any, path: Path) -> None:
    """The figure as a PNG, through a temporary file in the same directory and a rename: a reader never sees half
    a picture, and a failed write (a full disk) names the file."""
    write_atomic(path, lambda temporary: figure.savefig(temporary, format="png"), suffix=".png")


def _every(count: int) -> int:
    """Label every n-th of `count` items so at most MAX_LABELS are labelled."""
    return max(1, -(-count // MAX_LABELS))


def merged_runs(blocks: Sequence[Block], span_s: float) -> list[tuple[float, float, str]]:
    """One stage's forward and backward blocks as drawable runs when the schedule is denser than the picture:
    blocks closer than a pixel (`span_s` / GANTT_PIXELS) merge; a run of one kind keeps it, a run of both is
    'mixed' (interleaved 1F1B's steady state, chunk by chunk). Sorted by start."""
    gap = span_s / GANTT_PIXELS
    runs: list[tuple[float, float, str]] = []
    for block in sorted(blocks, key=lambda b: b.start_s):
        if runs and block.start_s - runs[-1][1] <= gap:
            start, end, kind = runs[-1]
            runs[-1] = (start, max(end, block.end_s), kind if kind == block.kind else "mixed")
        else:
            runs.append((block.start_s, block.end_s, block.kind))
    return runs


def _draw_gantt(axes: Any, evaluation: Evaluation, blocks: Sequence[Block], title: str) -> None:
    """The blocks of the schedule on their stages' rows (one bar collection per row and kind); grey behind them is
    idle time (bubble, p2p waits). A schedule denser than the picture (more blocks in a row than DENSE_BLOCKS) is
    summarised: blocks closer than a pixel merge into runs, and runs of forwards and backwards together are drawn
    as 'forward + backward'."""
    from matplotlib.patches import Patch

    stages = evaluation.stages
    end = max(block.end_s for block in blocks)
    rows: dict[int, list[Block]] = {}
    for block in blocks:
        rows.setdefault(block.stage, []).append(block)
    dense = max(len(row) for row in rows.values()) > DENSE_BLOCKS
    kinds_used = set()
    for stage, row in rows.items():
        axes.broken_barh([(0, end)], (stage - 0.35, 0.7), facecolors=IDLE_COLOR, zorder=0)
        compute = [b for b in row if b.kind in ("forward", "backward")]
        runs = merged_runs(compute, end) if dense else [(b.start_s, b.end_s, b.kind) for b in compute]
        runs += [(b.start_s, b.end_s, b.kind) for b in row if b.kind not in ("forward", "backward")]
        for kind in {kind for _, _, kind in runs}:
            spans = [(start, stop - start) for start, stop, k in runs if k == kind]
            edge = {} if dense else {"edgecolor": "white", "linewidth": 0.3}
            axes.broken_barh(spans, (stage - 0.35, 0.7), facecolors=KIND_COLORS[kind], **edge)
            kinds_used.add(kind)
    every = _every(len(stages))
    labels = [
        f"{stage_label(evaluation, i)}: {s.stage.group} L{s.stage.layer_start}-{s.stage.layer_end - 1} tp{s.stage.tp}"
        for i, s in enumerate(stages)
    ]
    axes.set_yticks(range(0, len(stages), every), labels[::every], fontsize=8)
    axes.set_ylim(len(stages) - 0.5, -0.5)
    axes.set_xlim(0, end * 1.01)
    axes.set_xlabel("time in the iteration (s)")
    axes.set_title(title + ("\n(dense schedule: blocks closer than a pixel drawn as one bar)" if dense else ""))
    legend = [Patch(color=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS if k in kinds_used]
    legend.append(Patch(color=IDLE_COLOR, label="idle (bubble, p2p wait)"))
    axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _draw_memory(axes: Any, evaluation: Evaluation) -> None:
    """Stacked memory parts per stage, with the device's capacity (solid) and usable memory (dashed) over them;
    runs of stages on one group of one family are named above the bars and separated by dotted lines."""
    stages = evaluation.stages
    bottom = [0.0] * len(stages)
    for name, field, color in MEMORY_PARTS:
        values = [getattr(s.memory, field) / GIB for s in stages]
        axes.bar(range(len(stages)), values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left = [i - 0.4 for i in range(len(stages))]
    right = [i + 0.4 for i in range(len(stages))]
    axes.hlines([s.memory_capacity_bytes / GIB for s in stages], left, right, colors="black", label="capacity")
    usable = [s.memory_usable_bytes / GIB for s in stages]
    axes.hlines(usable, left, right, colors="black", linestyles="dashed", label="usable")
    several = len(evaluation.strategy.pipelines) > 1
    runs: list[tuple[int, int, str]] = []  # first stage, last stage, name
    for i, s in enumerate(stages):
        name = f"family {s.family}: {s.stage.group}" if several else s.stage.group
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], i, name)
        else:
            runs.append((i, i, name))
    if len(runs) > 1:
        top = max(s.memory_capacity_bytes for s in stages) / GIB * 1.12
        for first, last, name in runs:
            axes.text((first + last) / 2, top, name, ha="center", va="bottom", fontsize=8)
            if first:
                axes.axvline(first - 0.5, color="grey", linestyle="dotted", linewidth=0.8)
        axes.set_ylim(0, top * 1.1)
    every = _every(len(stages))
    ticks = range(0, len(stages), every)
    rotation = 90 if len(ticks) > 16 else 0
    axes.set_xticks(ticks, [stage_label(evaluation, i) for i in ticks], fontsize=8, rotation=rotation)
    axes.set_xlim(-0.6, len(stages) - 0.4)
    axes.set_xlabel("stage")
    axes.set_ylabel("GiB per device")
    axes.set_title("memory per stage")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def traffic_matrix(traffic: Traffic) -> tuple[list[str], Any]:
    """Labels and the matrix of bytes per iteration from row to column: per device, or per node when there are
    more than HEATMAP_MAX_DEVICES devices."""
    import numpy as np

    by_node = len(traffic.device_names) > HEATMAP_MAX_DEVICES
    labels = sorted(set(traffic.node_of), key=traffic.node_of.index) if by_node else traffic.device_names
    index = {label: i for i, label in enumerate(labels)}
    matrix = np.zeros((len(labels), len(labels)))
    for pairs in traffic.pairs.values():
        for (src, dst), size in pairs.items():
            a = index[traffic.node_of[src]] if by_node else src
            b = index[traffic.node_of[dst]] if by_node else dst
            matrix[a, b] += size
    return labels, matrix


def traffic_heatmap(traffic: Traffic, title: str, path: Path) -> None:
    """Per-pair bytes as a heatmap on a log scale (devices, or nodes on large clusters), written as a PNG."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    labels, matrix = traffic_matrix(traffic)
    unit = "node" if len(traffic.device_names) > HEATMAP_MAX_DEVICES else "device"
    figure, axes = plt.subplots(figsize=(8, 7), dpi=110)
    positive = matrix[matrix > 0]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    image = axes.imshow(np.where(matrix > 0, matrix, np.nan), cmap="viridis", norm=norm, interpolation="nearest")
    axes.set_title(title)
    axes.set_xlabel(f"destination {unit}")
    axes.set_ylabel(f"source {unit}")
    step = max(1, len(labels) // 16)
    ticks = range(0, len(labels), step)
    axes.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=6)
    axes.set_yticks(ticks, [labels[i] for i in ticks], fontsize=6)
    figure.colorbar(image, ax=axes, label="bytes per iteration")
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
