"""Layers and recompute mode per stage, jointly, with OR-Tools CP-SAT (level 1 inner problem with per-stage
recompute).

Early stages of a 1F1B pipeline hold the most micro-batches in flight, so memory binds there first; recomputing
only there and running the later stages without recompute beats one mode everywhere. For each stage i and mode r:
per-layer time a[i][r], memory cap[i][r] in layers; fixed time e[i]. Choose one mode and l_i layers per stage
(v <= l_i <= cap[i][r_i], sum l_i = L) minimising (m - 1/v) * max_i T_i + sum_i T_i / v with
T_i = a[i][r_i] * l_i + e[i]. Times are scaled to integers (TIME_UNITS for the largest possible stage time) and the
objective multiplied by v to stay integral; the solution is re-scored in seconds.

The solver starts from the best single-mode split (a hint; without it CP-SAT sometimes ends its time on a
solution 30% worse) and is told the exact-bottleneck lower bound. One worker and a deterministic time limit keep
the result the same on every run (a multi-worker portfolio stopped by a limit is not reproducible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from planner.layer_split import per_mode_caps, per_stage_mode_lower_bound_s, split_layers

TIME_UNITS = 1_000_000  # integer resolution of the largest stage time
DETERMINISTIC_TIME_LIMIT = 0.1  # CP-SAT deterministic time units (0.1-0.4 s of wall time here)
RELATIVE_GAP = 1e-4  # stop once proven within 0.01% of the optimum


@dataclass(frozen=True)
class MixedSplit:
    layers: tuple[int, ...]
    modes: tuple[int, ...]  # index into the modes given, per stage
    bottleneck_s: float
    objective_s: float
    optimal: bool  # CP-SAT proved it within RELATIVE_GAP of the optimum (else: best found within the limit)


def split_layers_and_modes(
    num_layers: int,
    per_layer_s: np.ndarray,  # (stages, modes)
    fixed_s: np.ndarray,  # (stages,)
    caps: np.ndarray,  # (stages, modes) layers that fit per mode
    num_microbatches: int,
    virtual_stages: int = 1,
) -> MixedSplit | None:
    stages, modes = per_layer_s.shape
    least = virtual_stages
    clipped = per_mode_caps(num_layers, caps, least)
    if clipped is None:
        return None
    caps, usable = clipped
    bound_s = per_stage_mode_lower_bound_s(num_layers, per_layer_s, fixed_s, caps, num_microbatches, least)
    single = [
        split_layers(num_layers, per_layer_s[:, r], fixed_s, caps[:, r], num_microbatches, least) for r in range(modes)
    ]
    scale = TIME_UNITS / float(np.max(per_layer_s * np.maximum(caps, 0)) + fixed_s.max())
    a = np.maximum(1, np.round(per_layer_s * scale)).astype(np.int64)
    e = np.round(fixed_s * scale).astype(np.int64)
    horizon = int((a * np.maximum(caps, 0)).max() + e.max())

    model = cp_model.CpModel()
    chosen = [[model.new_bool_var(f"mode_{i}_{r}") for r in range(modes)] for i in range(stages)]
    taken = [
        [model.new_int_var(0, max(0, int(caps[i, r])), f"layers_{i}_{r}") for r in range(modes)] for i in range(stages)
    ]
    times = []
    for i in range(stages):
        model.add_exactly_one(chosen[i])
        for r in range(modes):
            if not usable[i, r]:
                model.add(chosen[i][r] == 0)
            model.add(taken[i][r] >= least).only_enforce_if(chosen[i][r])
            model.add(taken[i][r] == 0).only_enforce_if(~chosen[i][r])
        time_i = model.new_int_var(0, horizon, f"time_{i}")
        model.add(time_i == sum(int(a[i, r]) * taken[i][r] for r in range(modes)) + int(e[i]))
        times.append(time_i)
    model.add(sum(sum(row) for row in taken) == num_layers)
    bottleneck = model.new_int_var(0, horizon, "bottleneck")
    model.add_max_equality(bottleneck, times)
    objective = (num_microbatches * virtual_stages - 1) * bottleneck + sum(times)
    if bound_s is not None:
        # a help for the proof, loosened by more than the integer rounding of the times can move the optimum
        model.add(objective >= math.floor(bound_s * virtual_stages * scale * (1 - 1e-3)))
    splits = [(split.objective_s, r, split) for r, split in enumerate(single) if split is not None]
    if splits:
        _, hinted_mode, hinted = min(splits, key=lambda item: (item[0], item[1]))
        for i in range(stages):
            for r in range(modes):
                model.add_hint(chosen[i][r], r == hinted_mode)
                model.add_hint(taken[i][r], hinted.layers[i] if r == hinted_mode else 0)
    model.minimize(objective)

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = DETERMINISTIC_TIME_LIMIT
    solver.parameters.random_seed = 0
    solver.parameters.relative_gap_limit = RELATIVE_GAP
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    layers = np.array([sum(solver.value(x) for x in row) for row in taken], dtype=np.int64)
    picked = np.array([next(r for r in range(modes) if solver.value(chosen[i][r])) for i in range(stages)])
    stage_times = per_layer_s[np.arange(stages), picked] * layers + fixed_s
    slowest = float(stage_times.max())
    objective_s = (num_microbatches - 1 / virtual_stages) * slowest + float(stage_times.sum()) / virtual_stages
    return MixedSplit(
        tuple(int(x) for x in layers), tuple(int(r) for r in picked), slowest, objective_s, status == cp_model.OPTIMAL
    )
