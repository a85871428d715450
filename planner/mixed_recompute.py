"""Layers and recompute mode per stage, jointly, with OR-Tools CP-SAT (level 1 inner problem with per-stage
recompute).

Early stages of a 1F1B pipeline hold the most micro-batches in flight, so memory binds there first; recomputing
only there and running the later stages without recompute beats one mode everywhere. For each stage i and mode r:
per-layer time a[i][r], memory cap[i][r] in layers; fixed time e[i]. Choose one mode and l_i layers per stage
(v <= l_i <= cap[i][r_i], sum l_i = L) minimising (m - 1/v) * max_i T_i + sum_i T_i / v with
T_i = a[i][r_i] * l_i + e[i]. Times are scaled to integers (TIME_UNITS for the largest possible stage time) and the
objective multiplied by v to stay integral; the solution is re-scored in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

TIME_UNITS = 1_000_000  # integer resolution of the largest stage time
SOLVER_SECONDS = 2.0
RELATIVE_GAP = 1e-4  # stop once proven within 0.01% of the optimum


@dataclass(frozen=True)
class MixedSplit:
    layers: tuple[int, ...]
    modes: tuple[int, ...]  # index into the modes given, per stage
    bottleneck_s: float
    objective_s: float
    optimal: bool  # CP-SAT proved it within RELATIVE_GAP of the optimum (else: best found within the time limit)


def split_layers_and_modes(
    num_layers: int,
    per_layer_s: np.ndarray,  # (stages, modes)
    fixed_s: np.ndarray,  # (stages,)
    caps: np.ndarray,  # (stages, modes) layers that fit per mode
    num_microbatches: int,
    virtual_stages: int = 1,
    workers: int = 2,
) -> MixedSplit | None:
    stages, modes = per_layer_s.shape
    least = virtual_stages
    caps = np.minimum(caps, num_layers - least * (stages - 1)).astype(np.int64)
    usable = caps >= least
    if (
        stages * least > num_layers
        or not usable.any(axis=1).all()
        or np.where(usable, caps, 0).max(axis=1).sum() < (num_layers)
    ):
        return None
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
    model.minimize((num_microbatches * virtual_stages - 1) * bottleneck + sum(times))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.max_time_in_seconds = SOLVER_SECONDS
    solver.parameters.random_seed = 0
    solver.parameters.relative_gap_limit = RELATIVE_GAP
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    layers = np.array([sum(solver.value(x) for x in row) for row in taken], dtype=np.int64)
    picked = np.array([next(r for r in range(modes) if solver.value(chosen[i][r])) for i in range(stages)])
    stage_times = per_layer_s[np.arange(stages), picked] * layers + fixed_s
    slowest = float(stage_times.max())
    objective = (num_microbatches - 1 / virtual_stages) * slowest + float(stage_times.sum()) / virtual_stages
    return MixedSplit(
        tuple(int(x) for x in layers), tuple(int(r) for r in picked), slowest, objective, status == cp_model.OPTIMAL
    )
