"""Exact integer split of layers over pipeline stages (level 1 inner problem).

Stage i runs l_i layers at a_i seconds each plus a fixed e_i (embedding / LM head), holds at most cap_i layers
(memory) and at least one per virtual chunk. 1F1B over m micro-batches costs m*max_i T_i + (sum_i T_i - max_i T_i)/v
with T_i = a_i*l_i + e_i and v interleaved chunks per stage, i.e. (m - 1/v)*M + S/v for bottleneck M and sum S, or
S + (m - 1)*M/v when that is more (too few micro-batches to fill the interleaved loop: pipeline_makespan_s).
For a candidate bottleneck M, every stage may take u_i(M) = min(cap_i, floor((M - e_i)/a_i)) layers; the cost grows
with S at fixed M, so the sum term is minimised by giving the extra layers to the stages with the smallest a_i (a
linear cost with box constraints: greedy is exact). Evaluating every distinct candidate M = a_i*l + e_i
(vectorised) gives the exact optimum; tests compare it with brute force.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from predictor.evaluation import pipeline_makespan_s


@dataclass(frozen=True)
class LayerSplit:
    layers: tuple[int, ...]
    bottleneck_s: float
    objective_s: float


# (stages as (group, tp), num_layers, per-layer s, fixed s, caps in layers, micro-batches, virtual stages) -> split
LayerSplitter = Callable[
    [Sequence[tuple[Any, int]], int, np.ndarray, np.ndarray, np.ndarray, int, int], "LayerSplit | None"
]


def continuous_bottleneck_s(num_layers: int, per_layer_s: np.ndarray, fixed_s: np.ndarray) -> float:
    """Lower bound on max_i T_i: water-filling with fractional layers and no memory limit."""
    return float((num_layers + np.sum(fixed_s / per_layer_s)) / np.sum(1.0 / per_layer_s))


def split_layers(
    num_layers: int,
    per_layer_s: np.ndarray,
    fixed_s: np.ndarray,
    max_layers: np.ndarray,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> LayerSplit | None:
    """The optimal integer split, or None when memory caps make the stages unable to hold the model."""
    stages = len(per_layer_s)
    least = virtual_stages
    caps = np.minimum(max_layers, num_layers - least * (stages - 1)).astype(np.int64)
    if stages * least > num_layers or np.any(caps < least) or caps.sum() < num_layers:
        return None
    order = np.argsort(per_layer_s, kind="stable")
    a, e, cap = per_layer_s[order], fixed_s[order], caps[order]

    # Candidate bottlenecks: every reachable stage time, deduplicated over identical (a, e, cap) stages.
    # Below the fractional water-filling level (or a stage's least work) no bottleneck is feasible.
    keys = sorted(set(zip(a.tolist(), e.tolist(), cap.tolist())))
    candidates = np.unique(np.concatenate([ak * np.arange(least, ck + 1) + ek for ak, ek, ck in keys]))
    floor_s = max(continuous_bottleneck_s(num_layers, a, e), float(np.max(a * least + e)))
    candidates = candidates[candidates >= floor_s * (1 - 1e-9)]
    extra = num_layers - stages * least

    def fill(bound: np.ndarray) -> np.ndarray:
        """Layers per stage (rows: candidate bounds) after greedy filling of the cheapest stages."""
        room = bound - least
        before = np.cumsum(room, axis=-1) - room
        return least + np.clip(extra - before, 0, room)

    upper = np.minimum(cap[None, :], np.floor((candidates[:, None] - e[None, :]) / a[None, :] + 1e-9))
    feasible = np.all(upper >= least, axis=1) & (upper.sum(axis=1) >= num_layers)
    candidates, upper = candidates[feasible], upper[feasible].astype(np.int64)
    if len(candidates) == 0:
        return None
    layers = fill(upper)
    times = a[None, :] * layers + e[None, :]
    bottleneck = times.max(axis=1)
    objective = pipeline_makespan_s(num_microbatches, virtual_stages, bottleneck, times.sum(axis=1))
    best = int(np.argmin(objective))  # first minimum: the smallest bottleneck wins ties (stable)
    result = np.empty(stages, dtype=np.int64)
    result[order] = layers[best]
    return LayerSplit(tuple(int(x) for x in result), float(bottleneck[best]), float(objective[best]))


def per_mode_caps(num_layers: int, max_layers: np.ndarray, least: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(stages, modes) caps clipped to what the other stages leave, and which modes can hold a stage's least
    layers; None when no choice of modes can hold the model."""
    stages = max_layers.shape[0]
    caps = np.minimum(max_layers, num_layers - least * (stages - 1)).astype(np.int64)
    usable = caps >= least
    if stages * least > num_layers or not usable.any(axis=1).all():
        return None
    if np.where(usable, caps, 0).max(axis=1).sum() < num_layers:
        return None
    return caps, usable
