"""Lower bounds on the iteration time the search prunes with, as array math over candidates (planner.tp_rows feeds
them the cost model's numbers).

Pipeline (1F1B over m micro-batches, v interleaved chunks): (m - 1/v) * M + S / v for bottleneck stage time M and
stage-time sum S, the steady form of the layer split's objective (predictor.evaluation.pipeline_makespan_s, which is
never less: with too few micro-batches to fill the interleaved loop it is S + (m - 1) * M / v), then the fill and drain
point-to-point and the tail of the fullest stage (exposed DP sync + optimizer step:
cost_model.tail_per_layer_lower_bound_s). The bounds, each at least the one before: a row's (water-filling, no memory;
PipelineBound), with whole layers (whole_layer_bottleneck_s), per pipeline order with memory caps at each stage's depth
(memory_bottleneck_s); the root bound also covers plans with a recompute mode per stage (MixedTail,
per_stage_memory_bottlenecks_s); the work bound covers every plan of a group subset.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.candidates import tp_options
from predictor.cost_model import CostContext, decoder_layer_time_s, in_flight_table
from specs.cluster import DeviceGroup


def row_min(rows: np.ndarray) -> np.ndarray:
    """rows.min(axis=1) of a (rows, groups) array, a column at a time: numpy reduces a short last axis slowly (a
    (138,845, 8) array: 6.8 ms against 1.3 ms; eight device kinds reduce millions of rows per search). Exact."""
    out = rows[:, 0].copy()
    for column in range(1, rows.shape[1]):
        np.minimum(out, rows[:, column], out=out)
    return out


def row_max(rows: np.ndarray) -> np.ndarray:
    """rows.max(axis=1), as row_min."""
    out = rows[:, 0].copy()
    for column in range(1, rows.shape[1]):
        np.maximum(out, rows[:, column], out=out)
    return out


def row_sum(rows: np.ndarray) -> np.ndarray:
    """rows.sum(axis=1), as row_min (3.3 ms against 1.1 ms on (138,845, 8)); added in column order, which for eight or
    more columns may differ from numpy's pairwise sum in the last bit."""
    out = rows[:, 0].copy()
    for column in range(1, rows.shape[1]):
        out += rows[:, column]
    return out


@dataclass(frozen=True)
class PipelineBound:
    """The pipeline part of a batch of rows' bounds (arrays: (rows, groups), one recompute mode).

    (m - 1/v) * M + S / v with M >= the fractional water-filling bottleneck (L + sum_i e_i / a_i) / sum_i(1 / a_i) and
    S >= L * min_i a_i + e_embedding + e_head, where a_i is a stage's per-layer time and e_i its embedding / LM-head
    time (bounded below by the cheapest group of the row)."""

    num_layers: int
    water_level_s: np.ndarray  # (rows,)
    cheapest_sum_s: np.ndarray  # (rows,)
    stages: np.ndarray  # (rows,) and the rest: row sums and extremes the depths share
    stage_time_sum_s: np.ndarray  # sum over groups of counts * a
    fastest_s: np.ndarray
    slowest_s: np.ndarray
    least_first_s: np.ndarray
    least_last_s: np.ndarray

    @classmethod
    def of(
        cls, num_layers: int, per_layer_s: np.ndarray, first_edge_s: np.ndarray, last_edge_s: np.ndarray, counts: Any
    ) -> PipelineBound:
        """The bound's parts that do not depend on the interleaving depth."""
        a = per_layer_s
        fixed_ratio = row_min(first_edge_s / a) + row_min(last_edge_s / a)
        level = (num_layers + fixed_ratio) / row_sum(counts / a)
        fastest, least_first, least_last = row_min(a), row_min(first_edge_s), row_min(last_edge_s)
        cheapest = num_layers * fastest + least_first + least_last
        stage_time_sum = row_sum(counts * a)
        return cls(
            num_layers,
            level,
            cheapest,
            row_sum(counts),
            stage_time_sum,
            fastest,
            row_max(a),
            least_first,
            least_last,
        )

    def bound_s(
        self,
        microbatches: int,
        virtual: int,
        tail_s: np.ndarray,
        fill_and_drain_s: np.ndarray,
        groups_of_stages: bool = False,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(each row's bound on the iteration time, inf where v chunks do not fit; the bottleneck it assumed), given the
        rows' tail and fill / drain bounds; None when no row allows v chunks. `groups_of_stages`: interleaving also
        needs at least as many micro-batches as stages (Engine.interleaving_groups_of_stages)."""
        num_layers, stages = self.num_layers, self.stages
        allowed = (stages * virtual <= num_layers) & ((virtual == 1) | (stages > 1))
        if groups_of_stages and virtual > 1:
            allowed &= microbatches >= stages
        if not allowed.any():
            return None
        # every stage holds >= v layers, and layers are whole
        least_sum = virtual * self.stage_time_sum_s + (num_layers - virtual * stages) * self.fastest_s
        # whole layers and memory caps tighten this per pipeline order when a candidate comes up
        # (memory_bottleneck_s): cheaper there than for every row here
        least_bottleneck = np.maximum(self.water_level_s, virtual * self.slowest_s)
        least_sum = least_sum + self.least_first_s + self.least_last_s
        bound = (
            (microbatches - 1 / virtual) * least_bottleneck
            + (np.maximum(self.cheapest_sum_s, least_sum)) / virtual
            + tail_s
            + fill_and_drain_s
        )
        return np.where(allowed, bound, np.inf), least_bottleneck


@dataclass(frozen=True)
class MixedTail:
    """The tail bound of a batch's rows, and what the root bound needs for per-stage recompute plans.

    The stage with the most layers holds at least ceil(L / p); after the pipeline it waits its tail (exposed DP
    sync + optimizer step). A row's own bound adds the least such tail over its groups in its mode. A per-stage
    recompute plan may put that stage in another mode, hiding more DP sync behind a longer backward, but then
    that stage's time also bounds the pipeline's bottleneck: for those plans the bound is the fastest mode's row
    (recompute never makes a layer faster) with min over group g and mode r of (m - 1/v) * max(M, T_gr) + tail_gr
    in place of (m - 1/v) * M + its own tail, T_gr the time of ceil(L / p) layers of group g in mode r."""

    tail_s: np.ndarray  # (rows,) the row's own tail bound (fixed overhead apart)
    fullest_time_s: np.ndarray  # (rows, groups x modes): T_gr per micro-batch
    fullest_tail_s: np.ndarray  # (rows, groups x modes): tail_gr

    def root_s(self, rows: Any, bound_s: Any, least_bottleneck_s: Any, bottleneck_s: Any, weight: float) -> Any:
        """The bound over uniform and per-stage recompute plans of these rows (an index or a slice), given their own
        bound (computed with `least_bottleneck_s`) and a bottleneck `bottleneck_s` >= that which all their plans
        reach; `weight` is m - 1/v."""
        bottleneck = np.asarray(bottleneck_s, dtype=float)[..., None]
        coupled = weight * np.maximum(bottleneck, self.fullest_time_s[rows]) + self.fullest_tail_s[rows]
        return bound_s - self.tail_s[rows] - weight * least_bottleneck_s + coupled.min(axis=-1)


def least_bottleneck_and_tail_s(
    per_layer_s: Sequence[float],
    tail_per_layer_s: Sequence[float],
    counts: Sequence[int],
    num_layers: int,
    weight: float,
    least_bottleneck_s: float,
    least_tail_s: float,
) -> float:
    """The least weight * M + T over the (fractional) layer splits of a row: every stage of group g holds l_g layers
    with l_g * a_g <= M (the bottleneck, at least `least_bottleneck_s`) and l_g * r_g <= T (the fullest tail, at
    least `least_tail_s`), sum_g counts_g * l_g = L. The pipeline bound takes the two apart, each at its own least
    split: a group whose DP sync the backward cannot hide (r_g hundreds of times the others') then costs nothing,
    where a split that gives it fewer layers raises the bottleneck instead. The region
    {h(M, T) = sum_g counts_g * min(M / a_g, T / r_g) >= L} is convex with straight edges between the rays
    T = (r_g / a_g) M, so the least lies on such a ray or where the region meets a floor; inf when no split fits."""
    groups = list(zip(per_layer_s, tail_per_layer_s, counts, strict=True))

    def layers(bottleneck_s: float, tail_s: float) -> float:
        return sum(c * min(bottleneck_s / a, tail_s / r if r > 0 else math.inf) for a, r, c in groups)

    # at the least tail, the least bottleneck holding every layer, and the other way round
    at_least_tail = least_level(num_layers, [(a, c, least_tail_s / r if r > 0 else math.inf) for a, r, c in groups])
    at_least_bottleneck = least_level(num_layers, [(r, c, least_bottleneck_s / a) for a, r, c in groups])
    found = []
    if math.isfinite(at_least_tail):
        found.append(weight * max(least_bottleneck_s, at_least_tail) + least_tail_s)
    if math.isfinite(at_least_bottleneck):
        found.append(weight * least_bottleneck_s + max(least_tail_s, at_least_bottleneck))
    for ratio in {0.0, *(r / a for a, r, _ in groups)}:
        per_bottleneck = layers(1.0, ratio)
        if per_bottleneck > 0:
            bottleneck_s = num_layers / per_bottleneck
            if bottleneck_s >= least_bottleneck_s and ratio * bottleneck_s >= least_tail_s:
                found.append(weight * bottleneck_s + ratio * bottleneck_s)
    return min(found, default=math.inf) * (1 - 1e-9)


def least_level(num_layers: int, groups: Sequence[tuple[float, int, float]]) -> float:
    """The least level x at which stages hold every layer, when each of a group's `count` stages holds
    min(x / per_layer, cap) layers ((per_layer, count, cap) per group; per_layer 0: the cap at any level); inf when
    the caps do not add up to the layers. Exact: the layers held grow linearly between the levels where a group
    reaches its cap."""
    need = float(num_layers)
    rate = 0.0  # layers per unit of level, over the groups below their cap
    saturating: list[tuple[float, float, float]] = []  # (level where the group is full, its layers, its rate)
    for per_layer, count, cap in groups:
        if per_layer <= 0:
            need -= count * cap
        else:
            rate += count / per_layer
            saturating.append((cap * per_layer, count * cap, count / per_layer))
    if need <= 0:
        return 0.0
    saturating.sort()
    for full_at, full_layers, group_rate in saturating:
        if need <= rate * full_at:  # the groups below their cap take the rest before this one fills
            return min(need / rate, full_at)
        need, rate = need - full_layers, rate - group_rate
        if need <= 1e-9 * num_layers:  # held exactly as this group fills (rounding apart: a level can only be lower)
            return full_at
    return math.inf


def least_stage_sum_s(per_layer_s: Sequence[float], counts: Sequence[int], num_layers: int, virtual: int) -> float:
    """The stage-time sum PipelineBound takes for a row (edges apart): v layers on every stage, the spare layers on
    the fastest group."""
    spare = num_layers - virtual * sum(counts)
    return virtual * sum(a * c for a, c in zip(per_layer_s, counts, strict=True)) + spare * min(per_layer_s)


def least_bottleneck_and_stage_sum_s(
    per_layer_s: Sequence[float],
    counts: Sequence[int],
    num_layers: int,
    weight: float,
    virtual: int,
    least_bottleneck_s: float,
) -> float:
    """The least weight * M + S / v over the (fractional) layer splits of a row whose stages hold at least v layers
    each, l_g * a_g <= M (at least `least_bottleneck_s`), S = sum_g counts_g * l_g * a_g the stage-time sum (edges
    apart). The pipeline bound takes S at its least over every split (the spare layers on the fastest group), which a
    balanced split is far from: with M balanced every stage takes about M, and S about p * M, where the fastest
    group's per-layer time times L may be half that. At a given M the least S fills the fastest groups first up to M;
    weight * M + S / v is convex and piecewise linear in M, with corners where one more group fills up, so its least
    is at M's floor or at a corner."""
    order = sorted(zip(per_layer_s, counts, strict=True))
    spare = num_layers - virtual * sum(counts)  # layers above the v every stage holds
    base_s = virtual * sum(a * c for a, c in order)

    def stage_sum_s(bottleneck_s: float) -> float:
        """The least S within the bottleneck (inf: the stages cannot hold the layers)."""
        left, total = spare, base_s
        for a, c in order:
            taken = min(left, c * max(0.0, bottleneck_s / a - virtual))
            total, left = total + taken * a, left - taken
        return total if left <= 1e-9 * num_layers else math.inf  # short by rounding only: S stays a bound

    corners = [least_bottleneck_s]
    filled_layers = filled_rate = 0.0
    for a, c in order:
        filled_layers, filled_rate = filled_layers + virtual * c, filled_rate + c / a
        corners.append((spare + filled_layers) / filled_rate)
    least = min(weight * m + stage_sum_s(m) / virtual for m in corners if m >= least_bottleneck_s)
    return least * (1 - 1e-9)


def whole_layer_bottleneck_s(per_layer_s: Sequence[float], counts: Sequence[int], num_layers: int) -> float:
    """The smallest M with sum_g counts_g * floor(M / a_g) >= L: the bottleneck whole layers allow (no fixed costs,
    no memory limit). Exact: from the fractional level, step through the multiples of the a_g in order (each step
    adds counts_g layers, so at most sum(counts) steps); rounded down slightly to stay a bound."""
    level = num_layers / sum(c / a for a, c in zip(per_layer_s, counts, strict=True))
    layers = sum(c * math.floor(level / a) for a, c in zip(per_layer_s, counts, strict=True))
    steps = [((math.floor(level / a) + 1) * a, a, c) for a, c in zip(per_layer_s, counts, strict=True)]
    heapq.heapify(steps)
    while layers < num_layers:
        level, a, c = heapq.heappop(steps)
        layers += c
        heapq.heappush(steps, (level + a, a, c))
    return level * (1 - 1e-9)


def whole_layer_bottlenecks_s(per_layer_s: np.ndarray, counts: np.ndarray, num_layers: int, steps: int) -> np.ndarray:
    """whole_layer_bottleneck_s of every row of (rows, groups) arrays, bisected `steps` times keeping the side known
    too small (so a bound after any number; at most the exact one, which it rounds down the same way)."""
    low = num_layers / row_sum(counts / per_layer_s)  # the fractional level: whole layers cannot go below it
    high = low + row_max(per_layer_s)  # every group one more layer per stage than the level: enough
    for _ in range(steps):
        middle = (low + high) / 2
        enough = row_sum(counts * np.floor(middle[:, None] / per_layer_s)) >= num_layers
        high, low = np.where(enough, middle, high), np.where(enough, low, middle)
    return low * (1 - 1e-9)


def orders_within_memory(
    usable: np.ndarray,
    state_per_layer: np.ndarray,
    activation: np.ndarray,
    first_bytes: np.ndarray,
    last_bytes: np.ndarray,
    counts: np.ndarray,
    microbatches: int,
    num_layers: int,
    virtual: int,
    orders: np.ndarray | None = None,
) -> np.ndarray:
    """Which pipeline orders of each candidate could hold the model: (rows, orders), `orders` (orders, groups)
    defaulting to every permutation of the groups.

    Under 1F1B the stage at depth d from the end of the pipe keeps min(d, m) micro-batches in flight (interleaved:
    cost_model.in_flight_table). For each order of the groups (each a contiguous block), sum the layers every stage
    could hold at its depth, the first stage also holding the embedding and the last the LM head, and require the total
    to reach L and every stage to hold `virtual` layers. An order that fails cannot fit; one that passes may.
    Arrays are (rows, groups).
    """
    least_layers = virtual
    stages = counts.sum(axis=1)
    depth = np.arange(1, int(stages.max()) + 1)
    in_flight = in_flight_table(depth, microbatches, stages, virtual)[:, None, :]
    per_layer = state_per_layer[..., None] + activation[..., None] * in_flight
    room = np.floor(usable[..., None] / per_layer)
    cumulative = np.concatenate([np.zeros((*room.shape[:-1], 1)), np.cumsum(room, axis=-1)], axis=-1)
    rows = np.arange(len(counts))[:, None]
    deepest = (np.minimum(stages, depth[-1]) - 1)[:, None]
    if orders is None:
        orders = np.array(list(itertools.permutations(range(counts.shape[1]))))  # (orders, groups)
    # no order holds more than every group's stages at the depths with the most room: where that falls short, the
    # k! orders need no look (on eight device kinds, 141 of 221 rows the search expanded)
    most_room = np.cumsum(-np.sort(-room, axis=-1), axis=-1)
    most = np.take_along_axis(most_room, (counts - 1)[..., None].astype(np.int64), axis=-1)[..., 0].sum(axis=1)
    if (most < num_layers).all():
        return np.zeros((len(counts), len(orders)), dtype=bool)
    # per row, order and position along the order: the stages behind that group (its depth offset) and its end
    ordered_counts = counts[:, orders]  # (rows, orders, groups)
    end = np.cumsum(ordered_counts[..., ::-1], axis=-1)[..., ::-1]
    behind = end - ordered_counts
    r, o = rows[..., None], orders[None, ...]
    total = (cumulative[r, o, end] - cumulative[r, o, behind]).sum(axis=-1)  # (rows, orders)
    fewest = room[r, o, np.minimum(end, depth[-1]) - 1].min(axis=-1)  # rooms shrink with depth
    head, tail = orders[None, :, 0], orders[None, :, -1]
    single = (stages == 1)[:, None]
    first_room = usable[rows, head] - first_bytes[rows, head] - np.where(single, last_bytes[rows, head], 0.0)
    first_layers = np.floor(first_room / per_layer[rows, head, deepest])
    total += first_layers - room[rows, head, deepest]
    last_layers = np.floor((usable[rows, tail] - last_bytes[rows, tail]) / per_layer[rows, tail, 0])
    total += np.where(single, 0.0, last_layers - room[rows, tail, 0])
    fewest = np.minimum(np.minimum(fewest, first_layers), np.where(single, np.inf, last_layers))
    return (total >= num_layers) & (fewest >= least_layers)


def memory_bottleneck_s(
    per_layer_s: np.ndarray,
    fixed_s: np.ndarray,
    caps: np.ndarray,
    num_layers: int,
    least_layers: int,
    steps: int,
    known_s: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per pipeline order (rows of the (orders, stages) arrays): the smallest bottleneck M with sum over stages of
    min(cap_s, floor((M - e_s) / a_s)) >= L, bisected `steps` times keeping the side known too small (so a bound after
    any number of steps), and whether the caps can hold the model at all. `known_s`: a bottleneck every order
    reaches (the row's without memory): the bisection starts there, and ends at once where the caps do not bind;
    above, every stage at its cap holds the model, so the range is up to the slowest stage at its cap."""
    a, edge = per_layer_s, fixed_s
    feasible = (caps >= least_layers).all(axis=1) & (caps.sum(axis=1) >= num_layers)
    low = np.maximum((a * least_layers + edge).max(axis=1), known_s)
    at_caps = np.where(feasible, (a * caps + edge).max(axis=1), low + a.max(axis=1) * num_layers)
    high = np.maximum(low, at_caps)
    binding = np.flatnonzero(np.minimum(caps, np.floor((low[:, None] - edge) / a)).sum(axis=1) < num_layers)
    low_binding, high_binding = low[binding], high[binding]
    caps, a, edge = caps[binding], a[binding], edge[binding]
    for _ in range(steps):
        middle = (low_binding + high_binding) / 2
        enough = np.minimum(caps, np.floor((middle[:, None] - edge) / a)).sum(axis=1) >= num_layers
        high_binding = np.where(enough, middle, high_binding)
        low_binding = np.where(enough, low_binding, middle)
    low[binding] = low_binding
    return low * (1 - 1e-9), feasible


def per_stage_memory_bottlenecks_s(
    per_layer_s: np.ndarray,
    fixed_s: np.ndarray,
    caps: np.ndarray,
    num_layers: int,
    least_layers: int,
    known_s: float,
    steps: int,
) -> np.ndarray:
    """Per pipeline order, the least bottleneck when every stage picks its recompute mode: the smallest M with sum
    over stages of max over modes r of min(cap_sr, floor((M - e_s) / a_sr)) >= L ((orders, stages, modes) arrays but
    `fixed_s`, (orders, stages)); inf where the order cannot hold the model. `known_s`: a bottleneck known to be
    reached (each answer is at least that); the bisection starts from it and keeps the side known too small, to
    1/2^steps of the largest."""
    most = caps.max(axis=2)
    feasible = (most >= least_layers).all(axis=1) & (most.sum(axis=1) >= num_layers)
    found = np.full(len(caps), math.inf)
    if not feasible.any():
        return found
    caps, a, edge = caps[feasible], per_layer_s[feasible], fixed_s[feasible]

    def enough(bottleneck_s: np.ndarray) -> np.ndarray:
        """Per order: whether the stages, each in its best mode, hold L layers within the bottleneck."""
        layers = np.minimum(caps, np.floor((bottleneck_s[:, None, None] - edge[..., None]) / a)).max(axis=2)
        return layers.sum(axis=1) >= num_layers

    low = np.maximum(known_s, (a.min(axis=2) * least_layers + edge).max(axis=1))  # orders that fit there keep it
    high = low + a.max(axis=(1, 2)) * num_layers  # every layer on the slowest stage: enough where caps allow
    width = low.max() * 2.0**-steps
    while (high - low).max() > width:
        middle = (low + high) / 2
        fits = enough(middle)
        high = np.where(fits, middle, high)
        low = np.where(fits, low, middle)
    found[feasible] = low
    return found


def work_bound_s(ctx: CostContext, subset: Sequence[DeviceGroup]) -> float:
    """A lower bound on any plan over these groups: B samples x L layers of work, each layer of one sample costing a
    device of group g at least c_g = min over TP t, micro-batch b and recompute of t * (layer time) / b
    device-seconds (t * cp under context parallelism), and every device busy at most the whole iteration:
    T >= B * L / sum_g(devices_g / c_g)."""
    training = ctx.training
    rate = 0.0
    for group in subset:
        options = tp_options(ctx, group)
        if not options:  # its nodes hold no CP ring at this degree: no plan uses the subset
            return math.inf
        least = min(
            decoder_layer_time_s(ctx, group, b, t, rc) * t * ctx.context_parallel / b
            for t in options
            for b in training.micro_batch_sizes
            for rc in training.recompute
        )
        rate += group.num_devices / least
    return training.global_batch_size * ctx.model.num_layers / rate if rate > 0 else math.inf
