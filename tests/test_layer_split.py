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
        objective = (microbatches - 1 / virtual) * max(times) + sum(times) / virtual
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
