"""Every bound the search prunes with is a lower bound: on small random instances, every plan of the search space
(every pipeline order, TP per group, replica count, micro-batch, interleaving, layer split and recompute mode per
stage), enumerated by brute force and evaluated by the cost model, takes at least as long as each bound that covers
it: the row bound, the whole-layer bound, the per-order memory bound (and a fitting plan's order passes the memory
screen), the candidate's bound with the exact fill and drain, the root bound and the work bound; and the bound on
plans of two families is below the best split of the batch between two families found by brute force. Instances vary
devices, memory, model depth, batch, sequence, uneven batch splits, DP overlap, the end-to-end terms and context
parallelism."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterator

import numpy as np
import pytest

from planner.best_first import outer_configs, tp_row_batches
from planner.candidates import PER_STAGE, OuterConfig, group_order_array, group_orders, permutation_index
from planner.lower_bounds import (
    least_bottleneck_and_stage_sum_s,
    least_bottleneck_and_tail_s,
    least_level,
    row_max,
    row_min,
    row_sum,
    work_bound_s,
)
from planner.options import SearchOptions
from planner.row_batch import RowBound, TpRowBatch
from planner.search import search
from planner.solve import StageTerms, build_strategy, candidate_strategy
from predictor.cost_model import CostContext, EndToEndTerms, StageCache, build_context, evaluate
from specs import load_model, load_training
from specs.cluster import ClusterSpec, DeviceGroup
from specs.device import get_device
from specs.layout import split_batch
from tests.conftest import EXAMPLES

SEEDS = (0, 1, 2, 3, 5, 6, 7, 8, 10, 11)  # instances with plans that fit and plans that do not; 2, 5, 8 split unevenly
# (seed, context-parallel degree): the instances above, and those whose groups' nodes hold CP rings of 2 split with it
INSTANCES = [(seed, 1) for seed in SEEDS] + [(1, 2), (2, 2), (3, 2)]
SLACK = 1 + 1e-9  # bounds and evaluations round differently in the last bits
DEVICES = ["v100", "a100-40gb", "h100", "mi250x", "mi300x", "ascend-910b", "gaudi2", "l40s"]

# (subset names in cluster order, TPs in that order, replicas, micro-batch, recompute, virtual stages)
RowKey = tuple[tuple[str, ...], tuple[int, ...], int, int, str, int]
Shape = tuple[tuple[str, ...], tuple[int, ...], int, int]  # a row key without recompute and interleaving
# (its shape, the group order, the candidate, layers per stage, recompute mode per stage)
SpacePlan = tuple[Shape, tuple[int, ...], OuterConfig, tuple[int, ...], tuple[str, ...]]


def _instance(seed: int, context_parallel: int = 1) -> CostContext:
    """Two one-node groups of different devices with little memory (so that some plans fit and some do not), a
    Llama-shaped model of a few layers, tying its embedding and output at odd seeds (the first and last stages then
    sum the matrix's gradient after the pipeline); its sequences split over `context_parallel` ranks."""
    rng = random.Random(seed)
    model = load_model(str(EXAMPLES / "models" / "small-llama.yaml"))
    model = model.model_copy(update={"num_layers": rng.randint(4, 6), "tied_embeddings": seed % 2 == 1})
    sizes = [rng.choice([2, 3, 4]) for _ in range(2)]
    state_gb = model.total_params() * 18 / sum(sizes) / 2**30  # weights, grads and Adam state spread evenly
    groups = tuple(
        DeviceGroup(
            name=f"g{index}",
            device=get_device(key).model_copy(update={"memory_GB": state_gb * rng.uniform(1.3, 3.5)}),
            nodes=1,
            devices_per_node=size,
            nics_per_node=1,
            nic_bw_bytes_per_s=rng.choice([12.5e9, 50e9]),
        )
        for index, (key, size) in enumerate(zip(rng.sample(DEVICES, 2), sizes))
    )
    cluster = ClusterSpec(f"random-{seed}", groups, "clos", rng.choice([6.25e9, 25e9]))
    training = load_training(
        None,
        {
            "dtype": "fp16",
            "global_batch_size": rng.choice([4, 5, 6, 8]),
            "seq_length": rng.choice([256, 1024]),
            "micro_batch_sizes": [1, 2],
            "recompute": ["none", "full"],
            "virtual_stages": [1, 2],
            "uneven_batch": rng.choice(["off", "exhaustive"]),
            "overlap_grad_reduce": rng.random() < 0.7,
            "families": "off",
        },
    )
    terms = EndToEndTerms(
        tp_comm_scale=rng.uniform(0.5, 2.0),
        network_scale=rng.uniform(0.5, 2.0),
        optimizer_scale=rng.uniform(0.5, 2.0),
        dp_overlap=rng.uniform(0.0, 1.0),
        iteration_overhead_s=rng.uniform(0.0, 0.01),
    )
    return dataclasses.replace(build_context(cluster, model, training), terms=terms).at_context_parallel(
        context_parallel
    )


def _rows(batches: list[TpRowBatch]) -> dict[RowKey, tuple[TpRowBatch, int]]:
    rows = {}
    for batch in batches:
        for row in np.flatnonzero(np.isfinite(batch.bound_s)):
            tps = tuple(int(t) for t in batch.tps[row])
            key = (tuple(g.name for g in batch.subset), tps, batch.replicas, batch.micro_batch_size)
            rows[(*key, batch.recompute, batch.virtual_stages)] = (batch, int(row))
    return rows


def _plans(ctx: CostContext, structural: dict[RowKey, tuple[TpRowBatch, int]]) -> Iterator[SpacePlan]:
    """Every plan of the search space (stages per group: as many as the devices hold, as the search builds them)."""
    groups, training, num_layers = ctx.cluster.groups, ctx.training, ctx.model.num_layers
    batch_size = training.global_batch_size
    for size in (1, 2):
        for subset in itertools.combinations(groups, size):
            names = tuple(g.name for g in subset)
            for order, tps, replicas, b, v in itertools.product(
                itertools.permutations(range(size)),
                itertools.product(*[[1, 2, 4]] * size),
                range(1, batch_size + 1),
                training.micro_batch_sizes,
                training.virtual_stages,
            ):
                shape = (names, tps, replicas, b)
                if (*shape, training.recompute[0], v) not in structural or split_batch(batch_size, replicas, b) is None:
                    continue
                counts = [g.num_devices // (replicas * t * ctx.context_parallel) for g, t in zip(subset, tps)]
                config = OuterConfig(
                    groups=tuple(subset[i] for i in order),
                    tps=tuple(tps[i] for i in order),
                    stage_counts=tuple(counts[i] for i in order),
                    replicas=replicas,
                    micro_batch_size=b,
                    recompute=PER_STAGE,
                    virtual_stages=v,
                    lower_bound_s=0.0,
                )
                p = sum(counts)
                for cuts in itertools.combinations(range(1, num_layers), p - 1):
                    layers = tuple(int(n) for n in np.diff((0, *cuts, num_layers)))
                    if min(layers) < v:
                        continue
                    for modes in itertools.product(training.recompute, repeat=p):
                        yield shape, order, config, layers, modes


def _check_candidates(ctx: CostContext) -> int:
    """The candidate's own bound (its split's pipeline objective, the tail bound of its layers and the exact fill and
    drain) holds for the plan the search evaluates; returns how many plans were checked."""
    terms, checked = StageTerms(ctx), 0
    for config in outer_configs(ctx):
        strategy, _, objective_s = candidate_strategy(ctx, terms, config, math.inf, None)
        if strategy is None:
            continue
        evaluation = evaluate(ctx, strategy, terms.evaluations)
        if not evaluation.fits:
            continue
        stages = [(s, ctx.cluster.group(s.group)) for s in strategy.pipelines[0].stages]
        rates = [
            terms.tail_per_layer_s(g, config.micro_batch_size, s.tp, config.recompute, config.replicas)
            for s, g in stages
        ]
        tail_s = max(s.num_layers * rate for (s, _), rate in zip(stages, rates)) + ctx.terms.iteration_overhead_s
        fill_and_drain_s = terms.fill_and_drain_s(strategy)
        time_s = evaluation.iteration_time_s
        assert objective_s + tail_s + fill_and_drain_s <= time_s * SLACK
        assert config.order_bound_s - config.fill_and_drain_bound_s + fill_and_drain_s <= time_s * SLACK
        checked += 1
    return checked


@pytest.mark.parametrize(("seed", "context_parallel"), INSTANCES)
def test_every_search_bound_is_below_every_plan_it_covers(seed: int, context_parallel: int) -> None:
    ctx = _instance(seed, context_parallel)
    options = SearchOptions()
    modes = ctx.training.recompute
    rows = _rows(tp_row_batches(ctx, options))
    structural = _rows(tp_row_batches(ctx, options, memory_bounds=False))
    cache: StageCache = {}
    root_s: dict[RowKey, float] = {}
    fitting = mixed_fitting = 0
    best_s = np.inf
    for shape, order, config, layers, stage_modes in _plans(ctx, structural):
        uniform = len(set(stage_modes)) == 1
        if uniform:
            strategy = build_strategy(ctx, dataclasses.replace(config, recompute=stage_modes[0]), layers)
        else:
            strategy = build_strategy(ctx, config, layers, stage_modes)
        evaluation = evaluate(ctx, strategy, cache)
        if not evaluation.fits:
            continue
        time_s = evaluation.iteration_time_s
        best_s = min(best_s, time_s)
        fitting += 1
        mixed_fitting += not uniform
        v = config.virtual_stages
        assert work_bound_s(ctx, [ctx.cluster.group(name) for name in shape[0]]) <= time_s * SLACK
        # the root bound: the least over the shape's rows in every mode holds for per-stage recompute plans too
        for mode in modes:
            key = (*shape, mode, v)
            assert key in rows, "the memory lower bound dropped a row with a plan that fits"
            if key not in root_s:
                batch, row = rows[key]
                whole = RowBound(batch, row)
                root_s[key] = max(float(batch.root_s[row]), whole.root_s(), whole.root_s(memory=True))
        assert min(root_s[(*shape, mode, v)] for mode in modes) <= time_s * SLACK
        if not uniform:
            continue
        batch, row = rows[(*shape, stage_modes[0], v)]
        whole_s = RowBound(batch, row)()
        assert batch.bound_s[row] <= whole_s <= time_s * SLACK
        if order in group_orders(batch.subset):
            assert batch.possible_orders[row, permutation_index(order)], "the memory screen dropped an order that fits"
            assert batch.possible_orders_of(row, np.array([order]))[0], "the one-row screen dropped it"
            increase = batch.order_bound_increase_s(row, [order], options.order_bound_steps)[0]
            assert max(float(batch.bound_s[row]) + increase, whole_s) <= time_s * SLACK
            # the row's least memory bound over its orders (the key it waits with before it expands)
            least = batch.least_order_increase_s(row, options.order_bound_steps)
            assert float(batch.bound_s[row]) + least <= time_s * SLACK
    assert fitting > mixed_fitting > 0
    assert _check_candidates(ctx) > 0
    lower_bound_s = search(ctx, SearchOptions(root_bound=True)).lower_bound_s
    assert lower_bound_s is not None and lower_bound_s <= best_s * SLACK


def test_a_rows_least_memory_bound_is_below_each_of_its_orders() -> None:
    """The key a row waits with before it expands (its least memory bound over the pipeline orders, from one relaxed
    order) is at most every order's own memory bound, bisected finely; and it rises on some rows (else the search
    would gain nothing from it)."""
    raised = checked = 0
    for seed, context_parallel in INSTANCES:
        for batch in tp_row_batches(_instance(seed, context_parallel), SearchOptions()):
            orders = group_order_array(batch.subset)
            for row in range(len(batch.tps)):
                least = batch.least_order_increase_s(row, SearchOptions().order_bound_steps)
                each = batch.order_bound_increase_s(row, orders, 40)
                assert least <= each.min() + 1e-9 * float(batch.bound_s[row])
                raised += bool(least > 0)
                checked += 1
    assert checked > 0 and raised > 0


def _least_family_time_s(ctx: CostContext, group: DeviceGroup, share: int) -> float:
    """The fastest plan of one family on one group with `share` samples of the batch, by brute force over every
    replica count, TP, micro-batch, interleaving, layer split and recompute mode per stage (as a family of the
    family search runs it: its pipeline and tail alone; the sync across families only adds)."""
    from planner.candidates import tp_options
    from planner.families import _block_context

    block = _block_context(ctx, [group], share)
    training, num_layers = block.training, block.model.num_layers
    cache: StageCache = {}
    best = math.inf
    for replicas, tp, b, v in itertools.product(
        range(1, group.num_devices + 1), tp_options(block, group), training.micro_batch_sizes, training.virtual_stages
    ):
        stages = group.num_devices // (replicas * tp * block.context_parallel)
        if stages < 1 or stages * v > num_layers or (v > 1 and stages == 1):
            continue
        if split_batch(share, replicas, b) is None:
            continue
        config = OuterConfig((group,), (tp,), (stages,), replicas, b, PER_STAGE, v, 0.0)
        for cuts in itertools.combinations(range(1, num_layers), stages - 1):
            layers = tuple(int(n) for n in np.diff((0, *cuts, num_layers)))
            if min(layers) < v:
                continue
            for modes in itertools.product(training.recompute, repeat=stages):
                evaluation = evaluate(block, build_strategy(block, config, layers, modes), cache)
                if evaluation.fits:
                    best = min(best, evaluation.iteration_time_s)
    return best


@pytest.mark.parametrize("seed", (0, 3, 5, 7))  # 0, 3: two families fit; 5, 7: none does
def test_the_family_bound_is_below_every_plan_of_two_families(seed: int) -> None:
    """families.family_bound_s (each block's bound at its share, least over the shares) is at most the best split
    of the batch between two one-group families, each family at its share as fast as brute force finds, and at
    most the plan the family search returns."""
    from planner.families import family_bound_s

    ctx = _instance(seed)
    ctx = dataclasses.replace(ctx, training=ctx.training.model_copy(update={"families": "search"}))
    first, second = ctx.cluster.groups
    batch = ctx.training.global_batch_size
    bound_s = family_bound_s(ctx, SearchOptions())
    times = {(g.name, s): _least_family_time_s(ctx, g, s) for g in (first, second) for s in range(1, batch)}
    best_split_s = min(max(times[first.name, s], times[second.name, batch - s]) for s in range(1, batch))
    assert bound_s <= best_split_s * SLACK
    found = search(ctx).evaluations
    if any(len(e.strategy.pipelines) > 1 for e in found):
        assert bound_s <= min(e.iteration_time_s for e in found if len(e.strategy.pipelines) > 1) * SLACK


@pytest.mark.parametrize(("seed", "context_parallel"), INSTANCES)
def test_a_batch_source_waits_below_every_candidate_it_holds(seed: int, context_parallel: int) -> None:
    """A batch source's bound (vectorised over replica counts, with whole layers) is at most the whole-layer bound
    of every row it builds, so best-first order holds when sources are built lazily; and the vectorised whole-layer
    bottleneck is at most the exact one."""
    from planner.best_first import tp_row_sources
    from planner.lower_bounds import whole_layer_bottleneck_s, whole_layer_bottlenecks_s

    ctx = _instance(seed, context_parallel)
    checked = 0
    for source in tp_row_sources(ctx, SearchOptions()):
        for batch in source.build(True):
            rows = np.flatnonzero(np.isfinite(batch.bound_s))
            exact = [whole_layer_bottleneck_s(batch.per_layer_s[r], batch.counts[r], batch.num_layers) for r in rows]
            for steps in (1, SearchOptions().whole_layer_steps, 40):  # a bound after any number of steps
                vectorised = whole_layer_bottlenecks_s(
                    batch.per_layer_s[rows], batch.counts[rows], batch.num_layers, steps
                )
                assert (vectorised <= np.array(exact) * SLACK).all()
            for row in rows:
                assert source.least_s <= RowBound(batch, int(row))() * SLACK
                checked += 1
    assert checked > 0


def _least_by_linear_program(
    per_layer_s: list[float], counts: list[int], num_layers: int, objective: str, weight: float, virtual: int,
    least_bottleneck_s: float, tail_per_layer_s: list[float] | None = None, least_tail_s: float = 0.0,
) -> float:  # fmt: skip
    """The same least by scipy's linear program over (M, T, l_g): weight * M + T ("tail") or weight * M + S / v
    ("sum"), a_g l_g <= M, r_g l_g <= T, sum_g c_g l_g = L; l_g >= v for the sum (the tail bound's floors stand in)."""
    from scipy.optimize import linprog

    groups = len(per_layer_s)
    rates = tail_per_layer_s or [0.0] * groups
    if objective == "tail":
        cost = [weight, 1.0, *([0.0] * groups)]
        least_layers = 0.0
    else:
        cost = [weight, 0.0, *(c * a / virtual for a, c in zip(per_layer_s, counts))]
        least_layers = virtual
    upper = []
    for g in range(groups):
        upper.append([-1.0, 0.0, *(per_layer_s[g] if j == g else 0.0 for j in range(groups))])
        upper.append([0.0, -1.0, *(rates[g] if j == g else 0.0 for j in range(groups))])
    bounds = [(least_bottleneck_s, None), (least_tail_s, None), *([(least_layers, None)] * groups)]
    found = linprog(cost, A_ub=upper, b_ub=[0.0] * len(upper), A_eq=[[0.0, 0.0, *counts]], b_eq=[num_layers],
                    bounds=bounds)  # fmt: skip
    assert found.status == 0
    return float(found.fun)


@pytest.mark.parametrize("seed", range(12))
def test_a_row_bounds_bottleneck_with_tail_or_stage_sum_is_the_linear_programs_least(seed: int) -> None:
    """The closed forms RowBound adds (the bottleneck with the fullest tail, or with the stage-time sum, of one
    split) equal the least of their linear program, and stay below it: a bound is only worth the candidates it
    prunes, and one above the least would prune the plan that reaches it. Groups whose tails differ by 100x
    (a DP sync the backward cannot hide on one of them) as on four-vendor-256."""
    rng = random.Random(seed)
    groups = rng.randint(1, 4)
    per_layer_s = [rng.uniform(0.01, 0.05) for _ in range(groups)]
    counts = [rng.randint(1, 3) for _ in range(groups)]
    rates = [rng.choice([0.0, rng.uniform(1e-4, 1e-3), rng.uniform(0.05, 0.15)]) for _ in range(groups)]
    virtual = rng.choice([1, 2])
    num_layers = virtual * sum(counts) + rng.randint(0, 40)
    weight = rng.randint(1, 32) - 1 / virtual
    water_level_s = num_layers / sum(c / a for a, c in zip(per_layer_s, counts))
    least_s = max(water_level_s, virtual * max(per_layer_s)) * rng.choice([1.0, 1.2])
    least_tail_s = virtual * max(rates)
    with_tail = least_bottleneck_and_tail_s(per_layer_s, rates, counts, num_layers, weight, least_s, least_tail_s)
    by_program = _least_by_linear_program(
        per_layer_s, counts, num_layers, "tail", weight, virtual, least_s, rates, least_tail_s
    )
    assert with_tail == pytest.approx(by_program, rel=1e-7) and with_tail <= by_program * SLACK
    with_sum = least_bottleneck_and_stage_sum_s(per_layer_s, counts, num_layers, weight, virtual, least_s)
    by_program = _least_by_linear_program(per_layer_s, counts, num_layers, "sum", weight, virtual, least_s)
    assert with_sum == pytest.approx(by_program, rel=1e-7) and with_sum <= by_program * SLACK


def test_the_least_level_holding_every_layer_is_exact_where_groups_fill_up() -> None:
    """least_level (the tail bound's floors): where the layers are held exactly as a group fills up, the level is that
    group's full level (it read 0 there, a bound too loose to prune); a group with no per-layer cost holds its cap at
    any level; caps short of the layers: inf."""
    assert least_level(6, [(0.1, 2, 1.0), (0.3, 1, 4.0)]) == pytest.approx(1.2)  # 2 + 4 layers as the second fills
    assert least_level(3, [(0.7, 3, 1.0)]) == pytest.approx(0.7)
    assert least_level(3, [(0.1, 1, 1.0), (0.2, 1, 1.0), (0.3, 1, 1.0)]) == pytest.approx(0.3)
    assert least_level(2, [(0.1, 1, 5.0)]) == pytest.approx(0.2)  # below the cap
    assert least_level(2, [(0.0, 1, 1.0), (0.5, 1, 9.0)]) == pytest.approx(0.5)  # one layer held at any level
    assert least_level(7, [(0.1, 2, 1.0), (0.3, 1, 4.0)]) == math.inf


@pytest.mark.parametrize("groups", [1, 3, 8])
def test_row_reductions_are_numpys_a_column_at_a_time(groups):
    """The bounds' row reductions (a short last axis reduced column by column, for speed) give numpy's values: min
    and max exactly, integer sums exactly, float sums to the last bit (numpy adds eight or more pairwise)."""
    generator = np.random.default_rng(groups)
    times = generator.random((1000, groups)) * 10.0 ** generator.integers(-6, 2, (1000, groups))
    counts = generator.integers(0, 40, (1000, groups))
    assert np.array_equal(row_min(times), times.min(axis=1)) and np.array_equal(row_max(times), times.max(axis=1))
    assert np.array_equal(row_sum(counts), counts.sum(axis=1)) and row_sum(counts).dtype == counts.dtype
    np.testing.assert_allclose(row_sum(times), times.sum(axis=1), rtol=4e-16 * groups, atol=0)
    strided = times[:, ::-1]  # a view, as the search's gathers and slices are: the input stays as it was
    before = strided.copy()
    assert np.array_equal(row_min(strided), before.min(axis=1)) and np.array_equal(strided, before)
