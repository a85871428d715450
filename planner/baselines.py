"""Layer-split rules other planners use, to measure ours against (same search, same cost model, only the rule that
splits layers over stages changes; see bench/search_scaling.py).

- uniform: Megatron's default, L/p layers per stage (the remainder one each to the first stages).
- datasheet FLOPs: layers proportional to each stage's peak FLOP/s (device peak x TP), the simple HETHUB rule.
- greedy (Metis-style): start proportional to the profiled layer speed, then move single layers off the slowest
  stage to the stage that would end soonest, while that lowers the slowest stage's time; memory caps respected.
Each returns the split with its pipeline objective, or None when the rule's split does not fit memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from planner.layer_split import LayerSplit, LayerSplitter
from predictor.evaluation import pipeline_makespan_s
from specs.cluster import DeviceGroup


def _scored(
    layers: np.ndarray, per_layer_s: np.ndarray, fixed_s: np.ndarray, caps: np.ndarray, microbatches: int, v: int
) -> LayerSplit | None:
    if np.any(layers < v) or np.any(layers > caps):
        return None
    times = per_layer_s * layers + fixed_s
    bottleneck = float(times.max())
    objective = pipeline_makespan_s(microbatches, v, bottleneck, float(times.sum()))
    return LayerSplit(tuple(int(x) for x in layers), bottleneck, objective)


def _proportional(num_layers: int, weights: np.ndarray, least: int) -> np.ndarray:
    """Integer layers proportional to weights (largest remainder), then raised to `least` where below, taking
    the layers from the stages that have the most."""
    share = num_layers * weights / weights.sum()
    layers = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - layers), kind="stable")
    layers[order[: num_layers - int(layers.sum())]] += 1
    for index in np.flatnonzero(layers < least):
        while layers[index] < least:
            layers[int(np.argmax(layers))] -= 1
            layers[index] += 1
    return layers


def _proportional_rule(weights: Callable[[Sequence[tuple[DeviceGroup, int]], np.ndarray], np.ndarray]) -> LayerSplitter:
    """A rule giving each stage layers in proportion to a weight (at least one per virtual chunk)."""

    def split(
        stages: Sequence[tuple[DeviceGroup, int]],
        num_layers: int,
        per_layer_s: np.ndarray,
        fixed_s: np.ndarray,
        caps: np.ndarray,
        microbatches: int,
        virtual_stages: int,
    ) -> LayerSplit | None:
        if virtual_stages * len(stages) > num_layers:
            return None
        layers = _proportional(num_layers, weights(stages, per_layer_s), virtual_stages)
        return _scored(layers, per_layer_s, fixed_s, caps, microbatches, virtual_stages)

    return split


uniform_split = _proportional_rule(lambda stages, per_layer_s: np.ones(len(stages)))
datasheet_flops_split = _proportional_rule(
    lambda stages, per_layer_s: np.array([group.device.peak_tflops * tp for group, tp in stages], dtype=float)
)


def greedy_split(
    stages: Sequence[tuple[DeviceGroup, int]],
    num_layers: int,
    per_layer_s: np.ndarray,
    fixed_s: np.ndarray,
    caps: np.ndarray,
    microbatches: int,
    virtual_stages: int,
) -> LayerSplit | None:
    least = virtual_stages
    if least * len(stages) > num_layers:
        return None
    layers = np.minimum(_proportional(num_layers, 1.0 / per_layer_s, least), np.maximum(caps, least))
    # give layers the memory caps took away to the stages with room, fastest first
    for index in np.argsort(per_layer_s, kind="stable"):
        room = int(caps[index] - layers[index])
        missing = num_layers - int(layers.sum())
        if missing <= 0:
            break
        layers[index] += max(0, min(room, missing))
    if layers.sum() != num_layers:
        return None
    stage_index = np.arange(len(layers))
    while True:
        times = per_layer_s * layers + fixed_s
        slowest = int(np.argmax(times))
        if layers[slowest] <= least:
            break
        after = np.where((layers < caps) & (stage_index != slowest), times + per_layer_s, np.inf)
        target = int(np.argmin(after))
        if not after[target] < times[slowest]:
            break
        layers[slowest] -= 1
        layers[target] += 1
    return _scored(layers, per_layer_s, fixed_s, caps, microbatches, virtual_stages)


SPLITTERS: dict[str, LayerSplitter] = {
    "uniform": uniform_split,
    "datasheet-flops": datasheet_flops_split,
    "greedy": greedy_split,
}
