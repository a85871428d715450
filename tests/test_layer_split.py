"""The exact layer split equals brute force over every integer split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.layer_split import continuous_bottleneck_s, split_layers


def brute_force(layers, per_layer, fixed, caps, microbatches, virtual):
    best = None
    for split in itertools.product(*[range(virtual, int(c) + 1) for c in caps]):
        if sum(split) != layers:
            continue
        times = [a * n + e for a, n, e in zip(per_layer, split, fixed)]
        # the steady state, or the loop through every stage when too few micro-batches fill it (m * max < sum)
        steady = microbatches * max(times) + (sum(times) - max(times)) / virtual
        loop = sum(times) + (microbatches - 1) * max(times) / virtual
        objective = max(steady, loop)
        if best is None or objective < best - 1e-12:
            best = objective
    return best


@pytest.mark.parametrize("seed", range(6))
def test_split_is_optimal(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        stages = int(rng.integers(1, 5))
        virtual = int(rng.choice([1, 1, 2]))
        layers = int(rng.integers(stages * virtual, 14))
        per_layer = rng.uniform(0.5, 3.0, stages).round(2)
        fixed = rng.uniform(0.0, 3.0, stages).round(2)
        caps = rng.integers(1, 12, stages)
        microbatches = int(rng.integers(1, 9))
        result = split_layers(layers, per_layer, fixed, caps, microbatches, virtual)
        expected = brute_force(layers, per_layer, fixed, caps, microbatches, virtual)
        if expected is None:
            assert result is None
        else:
            assert result is not None and sum(result.layers) == layers
            assert all(virtual <= n <= c for n, c in zip(result.layers, caps))
            assert result.objective_s == pytest.approx(expected, rel=1e-12)


def test_faster_stages_get_more_layers_and_bound_holds():
    per_layer = np.array([2.0, 1.0, 1.0])
    result = split_layers(40, per_layer, np.zeros(3), np.array([40, 40, 40]), 32)
    assert result is not None
    assert result.layers[1] >= 2 * result.layers[0] - 1
    assert result.bottleneck_s >= continuous_bottleneck_s(40, per_layer, np.zeros(3))


def brute_force_modes(layers, per_layer, fixed, caps, microbatches, virtual):
    """Every mode per stage, then every split that fits the chosen modes' caps."""
    best = None
    stages, modes = per_layer.shape
    for chosen in itertools.product(range(modes), repeat=stages):
        a = [per_layer[i, r] for i, r in enumerate(chosen)]
        cap = [caps[i, r] for i, r in enumerate(chosen)]
        if min(cap) < virtual:
            continue
        value = brute_force(layers, a, fixed, cap, microbatches, virtual)
        if value is not None and (best is None or value < best):
            best = value
    return best


@pytest.mark.parametrize("seed", range(6))
def test_per_stage_modes_are_optimal_and_the_bounds_hold(seed):
    """The exact split with a mode per stage equals brute force over modes and splits; the relaxed bound never
    exceeds it; with a limit the program answers exactly below it and with a bound that is not below it above."""
    from planner.mixed_recompute import (
        least_per_stage_mode_objective,
        per_stage_mode_lower_bound_s,
        split_layers_and_modes,
    )

    rng = np.random.default_rng(100 + seed)
    checked = 0
    for _ in range(25):
        stages = int(rng.integers(1, 5))
        virtual = int(rng.choice([1, 2]))
        layers = int(rng.integers(stages * virtual, 14))
        # modes: fast with little memory room, slower with more room (as none / selective / full)
        base = rng.uniform(0.5, 2.0, stages)
        per_layer = np.stack([base, base * rng.uniform(1.0, 1.1), base * 1.33], axis=1)
        room = rng.integers(0, layers + 1, stages)
        caps = np.stack([room, room + rng.integers(0, 4, stages), room + rng.integers(2, 8, stages)], axis=1)
        fixed = rng.uniform(0, 1.0, stages)
        microbatches = int(rng.integers(1, 9))
        expected = brute_force_modes(layers, per_layer, fixed, caps, microbatches, virtual)
        got = split_layers_and_modes(layers, per_layer, fixed, caps, microbatches, virtual)
        bound = per_stage_mode_lower_bound_s(layers, per_layer, fixed, caps, microbatches, virtual)
        if expected is None:
            assert got is None and bound is None
            continue
        checked += 1
        assert got is not None and got.objective_s == pytest.approx(expected, rel=1e-12)
        assert sum(got.layers) == layers
        assert all(virtual <= n <= caps[i, r] for i, (n, r) in enumerate(zip(got.layers, got.modes)))
        assert bound <= expected * (1 + 1e-12)
        args = (layers, per_layer, fixed, caps, microbatches, virtual)
        at_limit = least_per_stage_mode_objective(*args, below_s=expected)
        assert at_limit is not None and at_limit[0] <= expected * (1 + 1e-12)  # a bound: it prunes
        below = least_per_stage_mode_objective(*args, below_s=expected * 1.01)
        assert below is not None and below[0] == pytest.approx(expected, rel=1e-12)
    assert checked >= 10


def test_baseline_rules_are_what_they_say_and_never_beat_the_exact_split():
    from planner.baselines import SPLITTERS

    class Device:
        def __init__(self, peak_tflops):
            self.peak_tflops = peak_tflops

    class Group:
        def __init__(self, peak_tflops):
            self.device = Device(peak_tflops)

    stages = [(Group(100.0), 1), (Group(300.0), 1), (Group(300.0), 2)]
    per_layer = np.array([3.0, 1.0, 0.5])
    fixed = np.array([0.5, 0.0, 0.7])
    caps = np.array([40, 40, 40])
    uniform = SPLITTERS["uniform"](stages, 31, per_layer, fixed, caps, 8, 1)
    assert uniform.layers == (11, 10, 10)
    flops = SPLITTERS["datasheet-flops"](stages, 30, per_layer, fixed, caps, 8, 1)
    assert flops.layers == (3, 9, 18)  # 100 : 300 : 600 TFLOP/s
    exact = split_layers(30, per_layer, fixed, caps, 8, 1)
    for name, rule in SPLITTERS.items():
        split = rule(stages, 30, per_layer, fixed, caps, 8, 1)
        assert sum(split.layers) == 30, name
        assert split.objective_s >= exact.objective_s * (1 - 1e-12), name
    # a rule whose split breaks a memory cap finds nothing
    assert SPLITTERS["uniform"](stages, 30, per_layer, fixed, np.array([40, 40, 5]), 8, 1) is None


def cp_sat_modes(layers, per_layer, fixed, caps, microbatches, virtual):
    """The same problem as a CP-SAT model solved to optimality (integer times): layers l_ir of stage i in mode r,
    one mode per stage, objective max((m v - 1) max_i T_i + sum_i T_i, v sum_i T_i + (m - 1) max_i T_i) (the
    pipeline's makespan times v: the steady state, or the loop through every stage when too few micro-batches fill
    it)."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    stages, modes = per_layer.shape
    slowest = int(max(per_layer.max() * layers + fixed.max(), 1))
    bottleneck = model.new_int_var(0, slowest, "bottleneck")
    times, held = [], []
    for i in range(stages):
        chosen = [model.new_bool_var(f"mode_{i}_{r}") for r in range(modes)]
        counts = [model.new_int_var(0, max(int(caps[i, r]), 0), f"layers_{i}_{r}") for r in range(modes)]
        model.add_exactly_one(chosen)
        for r in range(modes):
            model.add(counts[r] <= max(int(caps[i, r]), 0) * chosen[r])
            model.add(counts[r] >= virtual * chosen[r])
        time = sum(int(per_layer[i, r]) * counts[r] for r in range(modes)) + int(fixed[i])
        model.add(bottleneck >= time)
        times.append(time)
        held += counts
    model.add(sum(held) == layers)
    makespan = model.new_int_var(0, (microbatches * virtual + stages * virtual) * slowest, "makespan")
    model.add(makespan >= (microbatches * virtual - 1) * bottleneck + sum(times))
    model.add(makespan >= virtual * sum(times) + (microbatches - 1) * bottleneck)
    model.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    assert status in (cp_model.OPTIMAL, cp_model.INFEASIBLE), solver.status_name(status)
    return None if status == cp_model.INFEASIBLE else solver.objective_value / virtual


@pytest.mark.parametrize("seed", range(3))
def test_per_stage_modes_equal_cp_sat_on_instances_too_large_for_brute_force(seed):
    """OR-Tools CP-SAT, solved to optimality, as an independent oracle for the dynamic program at pipeline depths
    and layer counts brute force cannot enumerate (8 stages, 3 modes, up to 96 layers)."""
    from planner.mixed_recompute import split_layers_and_modes

    rng = np.random.default_rng(300 + seed)
    solved = 0
    for _ in range(4):
        stages, virtual = int(rng.integers(4, 9)), int(rng.choice([1, 2]))
        layers = int(rng.integers(stages * virtual * 2, 97))
        base = rng.integers(50, 400, stages)
        per_layer = np.stack([base, base + rng.integers(0, 40, stages), base * 4 // 3], axis=1).astype(float)
        room = rng.integers(0, layers // stages + 4, stages)
        caps = np.stack([room, room + rng.integers(0, 6, stages), room + rng.integers(4, 16, stages)], axis=1)
        fixed = rng.integers(0, 300, stages).astype(float)
        microbatches = int(rng.integers(1, 33))
        expected = cp_sat_modes(layers, per_layer, fixed, caps, microbatches, virtual)
        got = split_layers_and_modes(layers, per_layer, fixed, caps, microbatches, virtual)
        if expected is None:
            assert got is None
            continue
        solved += 1
        assert got is not None and got.objective_s == pytest.approx(expected, rel=1e-9)
    assert solved >= 3
