"""Pictures of a plan with matplotlib: the explain figure (Gantt of one iteration over memory per stage) and the
per-pair traffic heatmap. matplotlib is imported inside the drawing functions: it costs a large part of a second
and only the commands that draw need it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from predictor.schedule import stage_label

if TYPE_CHECKING:
    from predictor.cost_model import Evaluation
    from predictor.schedule import Block
    from predictor.traffic import Traffic

GIB = 2**30
KIND_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "dp_sync": "#e45756", "optimizer": "#54a24b"}
IDLE_COLOR = "#dddddd"
MEMORY_PARTS = (
    ("weights", "weights_bytes", "#4c78a8"),
    ("grads", "grads_bytes", "#72b7b2"),
    ("optimizer", "optimizer_bytes", "#54a24b"),
    ("activations", "activation_bytes", "#f58518"),
)
# above this many devices the heatmap sums device pairs into node pairs (a pixel per device pair is unreadable)
HEATMAP_MAX_DEVICES = 512


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed on a cluster's login node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def explain_figure(evaluation: Evaluation, blocks: Sequence[Block], title: str, path: Path) -> None:
    """Gantt of one iteration (top) and memory per stage against capacity (bottom), written as a PNG."""
    plt = _pyplot()
    stages = evaluation.stages
    figure, (gantt, memory) = plt.subplots(
        2, 1, figsize=(11, 3 + 0.45 * len(stages) * 2), dpi=110, gridspec_kw={"height_ratios": [3, 2]}
    )
    _draw_gantt(gantt, evaluation, blocks, title)
    _draw_memory(memory, evaluation)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _draw_gantt(axes: Any, evaluation: Evaluation, blocks: Sequence[Block], title: str) -> None:
    """One bar per block of the schedule on its stage's row; grey behind them is idle time (bubble, p2p waits)."""
    from matplotlib.patches import Patch

    stages = evaluation.stages
    for block in blocks:
        axes.barh(
            block.stage,
            block.end_s - block.start_s,
            left=block.start_s,
            height=0.7,
            color=KIND_COLORS[block.kind],
            edgecolor="white",
            linewidth=0.3,
        )
    end = max(block.end_s for block in blocks)
    for i in range(len(stages)):
        axes.barh(i, end, left=0, height=0.7, color=IDLE_COLOR, zorder=0)
    labels = [
        f"{stage_label(evaluation, i)}: {s.stage.group} L{s.stage.layer_start}-{s.stage.layer_end - 1} tp{s.stage.tp}"
        for i, s in enumerate(stages)
    ]
    axes.set_yticks(range(len(stages)), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("time in the iteration (s)")
    axes.set_title(title)
    legend = [Patch(color=c, label=k.replace("_", " ")) for k, c in KIND_COLORS.items()]
    legend.append(Patch(color=IDLE_COLOR, label="idle (bubble, p2p wait)"))
    axes.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, ncols=5)


def _draw_memory(axes: Any, evaluation: Evaluation) -> None:
    """Stacked memory parts per stage, with the device's capacity (solid) and usable memory (dashed) over them."""
    stages = evaluation.stages
    bottom = [0.0] * len(stages)
    for name, field, color in MEMORY_PARTS:
        values = [getattr(s.memory, field) / GIB for s in stages]
        axes.bar(range(len(stages)), values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, s in enumerate(stages):
        axes.hlines(
            s.memory_capacity_bytes / GIB, i - 0.4, i + 0.4, colors="black", label="capacity" if i == 0 else None
        )
        axes.hlines(
            s.memory_usable_bytes / GIB,
            i - 0.4,
            i + 0.4,
            colors="black",
            linestyles="dashed",
            label="usable" if i == 0 else None,
        )
    axes.set_xticks(range(len(stages)), [f"stage {stage_label(evaluation, i)}" for i in range(len(stages))], fontsize=8)
    axes.set_ylabel("GiB per device")
    axes.set_title("memory per stage")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


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
    figure.savefig(path)
    plt.close(figure)
