"""Search the three-level tree: pipeline order and stages per group, DP replicas, TP per group, micro-batch,
recompute; the exact layer split inside (planner.layer_split).

Best-first branch and bound: every outer configuration gets a lower bound on its iteration time (vectorised over
TP choices; see `_families`), tightened by whole layers and then, per pipeline order, by memory as it comes up
(`outer_configs`); configurations are evaluated best bound first, and the search stops once the next bound cannot
beat the k-th best plan found. Groups with identical devices and node shapes are interchangeable, so orders that
only swap them are skipped. On request it also proves a lower bound over the whole space (the root bound, valid
for per-stage recompute plans too: MixedTail, _per_stage_recompute_bottleneck_s).

The ZeRO stage is not branched on: under the cost model stage 1 weakly dominates stage 0 (optimizer state divided by
the DP degree; DP traffic of a reduce-scatter of 4-byte gradients plus an all-gather of 16-bit weights, 6 bytes per
parameter against the all-reduce's 8, equal for fp32 weights; the optimizer step on 1/dp of the parameters), so the
training's stage (1 unless pinned) is the best choice for every candidate. Several pipeline families of different
device mixes: planner.families (`families: search`, or `auto` on two groups).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.layer_split import LayerSplitter, per_stage_mode_lower_bound_s, split_layers
from planner.mixed_recompute import split_layers_and_modes
from predictor.comm_model import Link
from predictor.cost_model import (
    CostContext,
    Evaluation,
    StageCache,
    decoder_layer_time_s,
    dp_sync_time_s,
    edge_time_s,
    evaluate,
    in_flight_microbatches,
    in_flight_table,
    optimizer_time_s,
    p2p_time_s,
    stage_memory,
    state_bytes_per_param,
    usable_memory_bytes,
)
from specs.cluster import DeviceGroup
from specs.layout import StageStrategy, Strategy, pack_stages, split_batch, split_pipeline
from specs.model import Recompute

ProgressCallback = Callable[[int, int], None]
PER_STAGE = "per-stage"  # pseudo recompute mode of candidates whose stages each pick their own mode
PER_STAGE_CANDIDATES = 1  # the best distinct candidates re-solved with per-stage recompute (more: same plans on
# every bench case, up to 0.7 s more each)
# With `uneven_batch: exhaustive`, replica counts that do not divide the batch are tried where a group fits one more of
# up to this many stages (deeper pipelines have long per-replica shares, where whole micro-batches round off little).
UNEVEN_MAX_STAGES_PER_GROUP = 8
# With `uneven_batch: refine`, the best this many even candidates are tried again at nearby uneven replica counts.
UNEVEN_CANDIDATES = 8
# the per-order bounds are bisected, keeping the side known infeasible (valid after any number of steps); they need
# less precision than they cost: 2^-20 of the bracket
ORDER_BOUND_STEPS = 20
ROOT_BOUND_STEPS = 10  # the root bound's memory bisection: to 2^-10 of the bottleneck (it only reports)


@dataclass(frozen=True)
class OuterConfig:
    """Everything but the layer split: groups along the pipe (in order), their TP degrees and stage counts."""

    groups: tuple[DeviceGroup, ...]
    tps: tuple[int, ...]
    stage_counts: tuple[int, ...]
    replicas: int
    micro_batch_size: int
    recompute: str  # a Recompute mode, or PER_STAGE (set only by the refinement step of `search`)
    virtual_stages: int
    lower_bound_s: float  # of every order of these groups
    # of this order: whole layers, memory caps at each stage's pipeline depth (>= lower_bound_s; candidates come in
    # this bound's order)
    order_bound_s: float = 0.0
    fill_and_drain_bound_s: float = 0.0  # the point-to-point part of those bounds (the exact one replaces it)


@dataclass
class SearchResult:
    evaluations: list[Evaluation]  # best first
    configurations: int
    evaluated: int
    memory_infeasible: int
    smallest_shortfall_bytes: float
    smallest_shortfall_where: str
    # smallest lower bound over the whole search space (the root relaxation; only when asked: search(root_bound=True))
    lower_bound_s: float | None = None
    per_stage_recompute_solved: int = 0  # candidates re-solved with a recompute mode per stage
    family_partitions: int = 0  # partitions of the groups into pipeline families tried (`families: search`)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_microbatches(ctx: CostContext, config: OuterConfig | _Family) -> tuple[int, int]:
    """(most micro-batches per replica, total micro-batches) of a candidate (or of a row family's candidates)."""
    split = split_batch(ctx.training.global_batch_size, config.replicas, config.micro_batch_size)
    assert split is not None, "candidates are generated with a valid batch split"
    return split


def replica_counts(global_batch: int, subset: Sequence[DeviceGroup], tp_rows: np.ndarray, max_stages: int) -> list[int]:
    """Replica counts worth trying for a set of groups: the divisors of the batch (even splits), and the counts at
    which some group fits one more stage (floor(devices / (replicas * tp)) steps up), where an uneven split of the
    batch keeps devices busy that an even split would leave idle. Between two such counts fewer replicas only
    lengthen every replica's share."""
    counts = set(divisors(global_batch))
    for column, group in enumerate(subset):
        for tp in sorted(set(int(t) for t in tp_rows[:, column])):
            for stages in range(1, max_stages + 1):
                replicas = group.num_devices // (stages * tp)
                if replicas < 1:
                    break
                counts.add(replicas)
    return sorted(c for c in counts if c <= global_batch)


def tp_options(ctx: CostContext, group: DeviceGroup) -> list[int]:
    """TP degrees inside one node that divide the kv heads (and that the group's profile covers)."""
    options = [t for t in divisors(group.devices_per_node) if ctx.model.num_kv_heads % t == 0]
    source = ctx.source(group.name)
    profiled = getattr(source, "tp_degrees", None)
    if callable(profiled):
        options = [t for t in options if t in profiled()]
    return options


_PERMUTATION_INDEX = {k: {order: i for i, order in enumerate(itertools.permutations(range(k)))} for k in range(1, 9)}


def _signature(group: DeviceGroup) -> tuple[object, ...]:
    return (group.device, group.nodes, group.devices_per_node, group.nics_per_node, group.nic_bw_bytes_per_s)


@functools.cache
def _orders(groups: tuple[DeviceGroup, ...]) -> list[tuple[int, ...]]:
    """Permutations of group indices, skipping those that only swap interchangeable groups (memoised: callers
    must not modify the list)."""
    seen: set[tuple[object, ...]] = set()
    orders = []
    for order in itertools.permutations(range(len(groups))):
        key = tuple(_signature(groups[i]) for i in order)
        if key not in seen:
            seen.add(key)
            orders.append(order)
    return orders


@dataclass(frozen=True)
class MixedTail:
    """The tail bound of a family's rows, and what the root bound needs for per-stage recompute plans.

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


@dataclass(frozen=True)
class _Family:
    """Candidates sharing a group subset, replica count, micro-batch and recompute mode; rows are TP choices."""

    subset: tuple[DeviceGroup, ...]
    replicas: int
    micro_batch_size: int
    recompute: Recompute
    tps: np.ndarray  # (rows, groups)
    counts: np.ndarray  # (rows, groups) stages per group
    memory_bound_inputs: Callable[[], tuple[Any, ...]] | None  # of _layer_capacity (built once asked); None: no bound
    per_layer_s: np.ndarray  # (rows, groups), for the per-order bound
    edge_s: tuple[np.ndarray, np.ndarray]  # (rows, groups) embedding and LM-head time
    least_bottleneck_s: np.ndarray  # (rows,) the bottleneck the row's bound assumed
    tail: MixedTail
    # (per-layer time, activation bytes per layer) as (rows, groups, modes), and first-stage bytes besides the layers
    # in the mode that needs least (rows, groups): a per-stage recompute plan's memory (built once asked)
    mode_tables: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    fill_and_drain_s: np.ndarray  # (rows,) the point-to-point part of the rows' bounds
    _possible: np.ndarray | None = None

    @property
    def memory_bound_args(self) -> tuple[Any, ...] | None:
        return None if self.memory_bound_inputs is None else self.memory_bound_inputs()

    def possible_orders(self) -> np.ndarray | None:
        """(rows, permutations of the subset): orders that may fit memory, computed when first needed."""
        args = self.memory_bound_args
        if args is not None and self._possible is None:
            object.__setattr__(self, "_possible", _layer_capacity(*args))
        return self._possible


def _families(
    ctx: CostContext,
    memory_bounds: bool = True,
    subsets: Sequence[tuple[DeviceGroup, ...]] | None = None,
) -> tuple[list[_Family], list[np.ndarray], list[np.ndarray], list[np.ndarray], list[int]]:
    """Structurally valid candidates that pass the memory lower bound, with their time lower bounds and root
    bounds (MixedTail), and the virtual stages of each row.

    Bound: pipeline time is at least (m - 1/v)*M + S/v with M >= the fractional water-filling bottleneck
    (L + sum_i e_i/a_i) / sum_i(1/a_i) and S >= L * min_i a_i + e_embedding + e_head, where a_i is a stage's
    per-layer time and e_i its embedding / LM-head time (bounded below by the cheapest group in the candidate).
    Memory: even holding one micro-batch in flight, the stages' layer capacity must reach L.
    """
    training, model = ctx.training, ctx.model
    global_batch, num_layers = training.global_batch_size, model.num_layers
    groups = ctx.cluster.groups
    modes = list(training.recompute)
    shapes = [(g, t, b) for g in groups for t in tp_options(ctx, g) for b in training.micro_batch_sizes]
    per_layer = {
        (g.name, b, t, rc): decoder_layer_time_s(ctx, g, b, t, rc) for g, t, b in shapes for rc in training.recompute
    }
    activation = {
        (g.name, b, t, rc): ctx.source(g.name).layer_cost("decoder", b, t, rc).activation_bytes
        for g, t, b in shapes
        for rc in training.recompute
    }
    embedding = {(g.name, b, t): edge_time_s(ctx, g, b, t, True, False) for g, t, b in shapes}

    # Bytes the first / last stage holds besides its layers (lower bounds: one micro-batch in flight).
    def edge_bytes(g: DeviceGroup, b: int, t: int, rc: Recompute, d: int, first: bool) -> float:
        return stage_memory(
            ctx,
            g,
            num_layers=0,
            micro_batch_size=b,
            tp=t,
            recompute=rc,
            dp=d,
            in_flight=1,
            first=first,
            last=not first,
            pipeline_stages=2,
        ).total_bytes

    by_name = {g.name: g for g in groups}

    def edge_rows(
        subset: tuple[DeviceGroup, ...],
        tp_lists: tuple[tuple[int, ...], ...],
        positions: np.ndarray,
        b: int,
        rc: Recompute,
        d: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """First / last stage bytes besides the layers, (rows, groups) for the rows' TP positions."""
        width = max(len(t) for t in tp_lists)
        first, last = np.full((len(subset), width), np.nan), np.full((len(subset), width), np.nan)
        for j, (group, options) in enumerate(zip(subset, tp_lists)):
            first[j, : len(options)] = [first_fixed(group.name, b, t, rc, d) for t in options]
            last[j, : len(options)] = [last_fixed(group.name, b, t, d) for t in options]
        columns = np.arange(len(subset))[None, :]
        return first[columns, positions], last[columns, positions]

    def least_first_rows(
        subset: tuple[DeviceGroup, ...],
        tp_lists: tuple[tuple[int, ...], ...],
        positions: np.ndarray,
        b: int,
        d: int,
    ) -> np.ndarray:
        """First-stage bytes besides the layers in the recompute mode that needs least, (rows, groups)."""
        return np.minimum.reduce([edge_rows(subset, tp_lists, positions, b, rc, d)[0] for rc in modes])

    def with_first_bytes(
        time: np.ndarray, activation: np.ndarray, first: Callable[[], np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return time, activation, first()

    def memory_inputs(
        state_per_layer: np.ndarray,
        activation: np.ndarray,
        edge_bytes_rows: Callable[[], tuple[np.ndarray, np.ndarray]],
        counts: np.ndarray,
        microbatches: int,
        virtual: int,
        usable_rows: np.ndarray,
    ) -> tuple[Any, ...]:
        """The inputs of _layer_capacity (the edge bytes cost stage_memory calls: built for the rows that come up)."""
        first_bytes, last_bytes = edge_bytes_rows()
        return (
            usable_rows,
            state_per_layer,
            activation,
            first_bytes,
            last_bytes,
            counts,
            microbatches,
            num_layers,
            virtual,
        )

    @functools.cache
    def first_fixed(name: str, b: int, t: int, rc: Recompute, d: int) -> float:
        return edge_bytes(by_name[name], b, t, rc, d, first=True)

    @functools.cache
    def last_fixed(name: str, b: int, t: int, d: int) -> float:
        return edge_bytes(by_name[name], b, t, "none", d, first=False)

    head = {(g.name, b, t): edge_time_s(ctx, g, b, t, False, True) for g, t, b in shapes}

    @functools.cache
    def dp_and_optimizer_per_layer(name: str, t: int, d: int) -> tuple[float, float]:
        """DP sync per layer at its least (DP time is concave in the bytes with no time at zero, so per layer it is
        least with all L layers on the stage) and the optimizer step per layer (linear)."""
        group = by_name[name]
        params = model.layer_params() / t
        dp_s = dp_sync_time_s(ctx, group, num_layers * params, t, d) / num_layers
        return dp_s, optimizer_time_s(ctx, group, params, d)

    @functools.cache
    def tail_per_layer(name: str, b: int, t: int, rc: Recompute, d: int) -> float:
        """A lower bound on the iteration tail (exposed DP sync + optimizer step) per layer of the stage holding
        them: the hidden part (the stage's backward) is linear in the layers too; embedding / LM-head parameters
        only add."""
        dp_s, optimizer_s = dp_and_optimizer_per_layer(name, t, d)
        backward_s = ctx.source(name).layer_cost("decoder", b, t, rc).backward_time_s
        exposed_s = max(0.0, dp_s - ctx.terms.dp_overlap * backward_s) if training.overlap_grad_reduce else dp_s
        return exposed_s + optimizer_s

    families: list[_Family] = []
    bounds: list[np.ndarray] = []
    roots: list[np.ndarray] = []  # bounds that hold for per-stage recompute plans too (MixedTail), for the root
    virtuals: list[np.ndarray] = []
    if subsets is None:
        subsets = [s for size in range(1, len(groups) + 1) for s in itertools.combinations(groups, size)]
    for subset in subsets:
        tp_lists = [tp_options(ctx, g) for g in subset]
        tp_rows = np.array(list(itertools.product(*tp_lists)), dtype=np.int64)
        if tp_rows.size == 0:
            continue
        tp_positions = np.array(list(itertools.product(*[range(len(t)) for t in tp_lists])), dtype=np.int64)
        columns = np.arange(len(subset))[None, :]

        def padded(value: Callable[[DeviceGroup, int], float]) -> np.ndarray:
            """(groups, TP options) of a per-group, per-TP value (NaN past a group's options)."""
            table = np.full((len(subset), max(len(t) for t in tp_lists)), np.nan)  # noqa: B023
            for j, (group, options) in enumerate(zip(subset, tp_lists)):  # noqa: B023
                table[j, : len(options)] = [value(group, t) for t in options]
            return table

        @functools.cache
        def tables(b: int, rc: Recompute) -> tuple[np.ndarray, ...]:
            """Per-layer time, activation bytes, embedding and LM-head time as (groups, TP options)."""
            return (
                padded(lambda group, tp: per_layer[(group.name, b, tp, rc)]),
                padded(lambda group, tp: activation[(group.name, b, tp, rc)]),
                padded(lambda group, tp: embedding[(group.name, b, tp)]),
                padded(lambda group, tp: head[(group.name, b, tp)]),
            )

        @functools.cache
        def tail_tables(b: int, rc: Recompute, d: int) -> tuple[np.ndarray, np.ndarray]:
            """Per-layer time and tail per layer as (rows, groups) for the rows at this replica count."""
            time = tables(b, rc)[0][columns, positions]  # noqa: B023
            rate = padded(lambda group, tp: tail_per_layer(group.name, b, tp, rc, d))[columns, positions]  # noqa: B023
            return time, rate

        # point-to-point links a pipeline over these groups may cross: inside a group (in-node or rail), and between
        # two groups; each crossing sends (micro-batch activations) / (the smaller TP of its two stages) bytes
        inside = [link for g in subset for link in (ctx.in_node_link(g), ctx.rail_link(g))]
        across = [ctx.cross_group_link(g, h) for g, h in itertools.permutations(subset, 2)]

        def fastest_p2p_s(links: list[Link], size_bytes: np.ndarray) -> np.ndarray:
            return np.min([link.p2p_time_s(size_bytes) for link in links], axis=0) * ctx.terms.network_scale

        devices = np.array([g.num_devices for g in subset], dtype=np.int64)
        usable = np.array([usable_memory_bytes(ctx, g) for g in subset])
        replica_options = (
            replica_counts(global_batch, subset, tp_rows, UNEVEN_MAX_STAGES_PER_GROUP)
            if training.uneven_batch == "exhaustive"
            else divisors(global_batch)
        )
        for replicas in replica_options:
            if devices.min() < replicas:
                break
            counts = devices[None, :] // (replicas * tp_rows)
            total_state = model.total_params() * state_bytes_per_param(ctx, replicas)
            # an uneven batch split only where one more replica would cost some group a stage
            even = global_batch % replicas == 0
            worth = even or ((devices[None, :] // ((replicas + 1) * tp_rows)) < counts).any(axis=1)
            valid = (
                worth
                & (counts.min(axis=1) >= 1)
                & (counts.sum(axis=1) <= num_layers)
                & (((counts * tp_rows * usable[None, :]).sum(axis=1) >= total_state) | (not memory_bounds))
            )
            if not valid.any():
                continue
            tps, stage_counts, positions = tp_rows[valid], counts[valid], tp_positions[valid]

            stages = stage_counts.sum(axis=1)
            state_per_layer = model.layer_params() * state_bytes_per_param(ctx, replicas) / tps
            usable_rows = np.broadcast_to(usable[None, :], tps.shape)
            for micro_batch_size in training.micro_batch_sizes:
                split = split_batch(global_batch, replicas, micro_batch_size)
                if split is None:
                    continue
                microbatches = split[0]
                # every pipeline over the k groups crosses k - 1 group boundaries and p - k inside groups
                crossing_bytes = micro_batch_size * ctx.seq_length * model.hidden_size * training.dtype_bytes
                crossing_bytes = crossing_bytes / tps.max(axis=1)
                boundaries_s = (stages - len(subset)) * fastest_p2p_s(inside, crossing_bytes)
                if len(subset) > 1:
                    boundaries_s += (len(subset) - 1) * fastest_p2p_s(across, crossing_bytes)
                # every mode's per-layer time and activation, for the root bound of per-stage recompute plans
                mode_time = np.stack([tables(micro_batch_size, r)[0][columns, positions] for r in modes], axis=-1)
                mode_activation = np.stack([tables(micro_batch_size, r)[1][columns, positions] for r in modes], axis=-1)
                first_rows = functools.partial(
                    least_first_rows, subset, tuple(map(tuple, tp_lists)), positions, micro_batch_size, replicas
                )
                mode_tables = functools.cache(
                    functools.partial(with_first_bytes, mode_time, mode_activation, functools.cache(first_rows))
                )
                for recompute in training.recompute:
                    a, act, e_first, e_last = (t[columns, positions] for t in tables(micro_batch_size, recompute))
                    b, rc, d = micro_batch_size, recompute, replicas

                    edge_bytes_rows = functools.cache(
                        functools.partial(edge_rows, subset, tuple(map(tuple, tp_lists)), positions, b, rc, d)
                    )

                    # the stage with the most layers holds >= ceil(L / p) and waits its tail after the pipeline
                    fullest = (-(-num_layers // stages))[:, None, None]
                    # (rows, groups, modes): that stage's layer time and tail in every recompute mode, for the root
                    # bound over per-stage recompute plans (MixedTail)
                    fullest_time = fullest * np.stack([tail_tables(b, r, d)[0] for r in modes], axis=-1)
                    fullest_tail = fullest * np.stack([tail_tables(b, r, d)[1] for r in modes], axis=-1)
                    tail_no_overhead = fullest_tail[:, :, modes.index(rc)].min(axis=1)
                    tail = tail_no_overhead + ctx.terms.iteration_overhead_s
                    fixed_ratio = (e_first / a).min(axis=1) + (e_last / a).min(axis=1)
                    bottleneck = (num_layers + fixed_ratio) / (stage_counts / a).sum(axis=1)
                    cheapest_sum = num_layers * a.min(axis=1) + e_first.min(axis=1) + e_last.min(axis=1)
                    for virtual in training.virtual_stages:
                        allowed = (stages * virtual <= num_layers) & ((virtual == 1) | (stages > 1))
                        if not allowed.any():
                            continue
                        # every stage holds >= v layers, and layers are whole
                        least_sum = virtual * (stage_counts * a).sum(axis=1) + (num_layers - virtual * stages) * a.min(
                            axis=1
                        )
                        # whole layers and memory caps tighten this per pipeline order when a candidate comes up
                        # (_order_bound_increase_s): cheaper there than for every row here
                        least_bottleneck = np.maximum(bottleneck, virtual * a.max(axis=1))
                        bound = (
                            (microbatches - 1 / virtual) * least_bottleneck
                            + (np.maximum(cheapest_sum, least_sum + e_first.min(axis=1) + e_last.min(axis=1))) / virtual
                            + tail
                            + 2 * virtual * boundaries_s  # fill and drain cross every boundary once per chunk each way
                        )
                        bound = np.where(allowed, bound, np.inf)
                        memory = functools.partial(
                            memory_inputs,
                            state_per_layer,
                            act,
                            edge_bytes_rows,
                            stage_counts,
                            microbatches,
                            virtual,
                            usable_rows,
                        )
                        families.append(
                            _Family(
                                subset,
                                replicas,
                                micro_batch_size,
                                recompute,
                                tps,
                                stage_counts,
                                functools.cache(memory) if memory_bounds else None,
                                a,
                                (e_first, e_last),
                                least_bottleneck,
                                MixedTail(
                                    tail_no_overhead,
                                    fullest_time.reshape(len(tps), -1),
                                    fullest_tail.reshape(len(tps), -1),
                                ),
                                mode_tables if memory_bounds else None,
                                2 * virtual * boundaries_s,
                            )
                        )
                        bounds.append(bound)
                        weight = microbatches - 1 / virtual
                        tail_bounds = families[-1].tail
                        roots.append(tail_bounds.root_s(slice(None), bound, least_bottleneck, least_bottleneck, weight))
                        virtuals.append(np.full(len(tps), virtual))
    return families, bounds, roots, virtuals, [len(b) for b in bounds]


def _whole_layer_bottleneck(per_layer_s: Sequence[float], counts: Sequence[int], num_layers: int) -> float:
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


@dataclass
class _WholeLayerBound:
    """A candidate row's bound with the whole-layer bottleneck, computed once when first asked for."""

    family: _Family
    row: int
    bound_s: float
    microbatches: int
    virtual: int
    num_layers: int
    _value: float | None = None

    _bottleneck_s: float = 0.0

    def __call__(self) -> float:
        if self._value is None:
            a, counts = self.family.per_layer_s[self.row].tolist(), self.family.counts[self.row].tolist()
            least = float(self.family.least_bottleneck_s[self.row])
            self._bottleneck_s = max(least, _whole_layer_bottleneck(a, counts, self.num_layers))
            self._value = self.bound_s + (self._bottleneck_s - least) * (self.microbatches - 1 / self.virtual)
        return self._value

    def root_s(self, memory: bool = False) -> float:
        """The same for per-stage recompute plans too (MixedTail); with `memory`, also the bottleneck memory allows
        when every stage may recompute (_per_stage_recompute_bottleneck_s)."""
        self()
        least = self.family.least_bottleneck_s[self.row]
        weight = self.microbatches - 1 / self.virtual
        bottleneck = self._bottleneck_s
        if memory and self.family.mode_tables is not None:
            bottleneck = _per_stage_recompute_bottleneck_s(self.family, self.row, self.virtual, bottleneck)
            if math.isinf(bottleneck):
                return math.inf
        return float(self.family.tail.root_s(self.row, self.bound_s, least, bottleneck, weight))


def _work_bound_s(ctx: CostContext, subset: Sequence[DeviceGroup]) -> float:
    """A lower bound on any plan over these groups: B samples x L layers of work, each layer of one sample costing a
    device of group g at least c_g = min over TP t, micro-batch b and recompute of t * (layer time) / b
    device-seconds, and every device busy at most the whole iteration: T >= B * L / sum_g(devices_g / c_g)."""
    training = ctx.training
    rate = 0.0
    for group in subset:
        least = min(
            decoder_layer_time_s(ctx, group, b, t, rc) * t / b
            for t in tp_options(ctx, group)
            for b in training.micro_batch_sizes
            for rc in training.recompute
        )
        rate += group.num_devices / least
    return training.global_batch_size * ctx.model.num_layers / rate if rate > 0 else math.inf


def _layer_capacity(
    usable: np.ndarray,
    state_per_layer: np.ndarray,
    activation: np.ndarray,
    first_bytes: np.ndarray,
    last_bytes: np.ndarray,
    counts: np.ndarray,
    microbatches: int,
    num_layers: int,
    virtual: int,
) -> np.ndarray:
    """Which pipeline orders of each candidate could hold the model: (rows, permutations of the groups).

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
    orders = np.array(list(itertools.permutations(range(counts.shape[1]))))  # (orders, groups)
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


def _order_bound_increase_s(family: _Family, row: int, orders: list[tuple[int, ...]], virtual: int) -> np.ndarray:
    """Per order of the family's groups, how much the row's bound rises when memory is seen (inf: cannot fit). The
    bottleneck becomes the smallest
    bottleneck M with sum over stages of min(cap_s, floor((M - e_s) / a_s)) >= L, each stage's cap taken at its
    depth in the pipe (1F1B keeps min(depth, m) micro-batches in flight), first and last stages also holding the
    embedding / LM head; where it exceeds the bottleneck the row's bound assumed, the bound rises by
    (m - 1/v) times the difference."""
    assert family.memory_bound_args is not None
    usable, state_per_layer, activation, first_bytes, last_bytes, counts, microbatches, num_layers, _ = (
        family.memory_bound_args
    )
    a_row, counts_row = family.per_layer_s[row], counts[row]
    order_array = np.array(orders)  # (orders, groups)
    ends = np.cumsum(counts_row[order_array], axis=1)
    position = (np.arange(int(ends[0, -1]))[None, :, None] >= ends[:, None, :]).sum(axis=2)
    stage_group = np.take_along_axis(order_array, position, axis=1)  # (orders, stages): each stage's group
    stages = stage_group.shape[1]
    depth = stages - np.arange(stages)  # 1 at the last stage
    in_flight = in_flight_table(depth, microbatches, np.array([stages]), virtual)[0]
    fixed_bytes = np.zeros(stage_group.shape)
    fixed_bytes[:, 0] += first_bytes[row][stage_group[:, 0]]
    fixed_bytes[:, -1] += last_bytes[row][stage_group[:, -1]]
    per_layer_bytes = state_per_layer[row][stage_group] + activation[row][stage_group] * in_flight[None, :]
    caps = np.floor((usable[row][stage_group] - fixed_bytes) / per_layer_bytes)
    a = a_row[stage_group]
    edge = np.zeros(stage_group.shape)
    edge[:, 0] += family.edge_s[0][row][stage_group[:, 0]]
    edge[:, -1] += family.edge_s[1][row][stage_group[:, -1]]
    feasible = (caps >= virtual).all(axis=1) & (caps.sum(axis=1) >= num_layers)
    low = (a * virtual + edge).max(axis=1)
    high = low + a.max(axis=1) * num_layers
    for _ in range(ORDER_BOUND_STEPS):
        middle = (low + high) / 2
        layers = np.minimum(caps, np.floor((middle[:, None] - edge) / a))
        enough = layers.sum(axis=1) >= num_layers
        high = np.where(enough, middle, high)
        low = np.where(enough, low, middle)
    bottleneck = low * (1 - 1e-9)
    extra = np.maximum(0.0, bottleneck - family.least_bottleneck_s[row]) * (microbatches - 1 / virtual)
    return np.where(feasible, extra, np.inf)


def _per_stage_recompute_bottleneck_s(family: _Family, row: int, virtual: int, known_s: float) -> float:
    """The least bottleneck any plan of a row's shape reaches with a recompute mode per stage (inf: none fits):
    over the pipeline orders, the smallest M with sum over stages of max over modes r of
    min(cap_sr, floor((M - e_s) / a_sr)) >= L, cap_sr the layers stage s holds in mode r at its depth (as
    _order_bound_increase_s for one mode; the first stage's fixed bytes in the mode that needs least). `known_s`: a
    bottleneck known to be reached (the answer is at least that); the bisection starts from it and keeps the side
    known too small, to 1/2^ROOT_BOUND_STEPS of it."""
    assert family.memory_bound_args is not None and family.mode_tables is not None
    usable, state_per_layer, _, _, last_bytes, counts, microbatches, num_layers, _ = family.memory_bound_args
    mode_time, mode_activation, least_first = family.mode_tables()
    order_array = np.array(_orders(family.subset))
    ends = np.cumsum(counts[row][order_array], axis=1)
    position = (np.arange(int(ends[0, -1]))[None, :, None] >= ends[:, None, :]).sum(axis=2)
    stage_group = np.take_along_axis(order_array, position, axis=1)  # (orders, stages)
    stages = stage_group.shape[1]
    in_flight = in_flight_table(stages - np.arange(stages), microbatches, np.array([stages]), virtual)[0]
    fixed_bytes = np.zeros(stage_group.shape)
    fixed_bytes[:, 0] += least_first[row][stage_group[:, 0]]
    fixed_bytes[:, -1] += last_bytes[row][stage_group[:, -1]]
    per_layer_bytes = (
        state_per_layer[row][stage_group][..., None] + mode_activation[row][stage_group] * in_flight[None, :, None]
    )
    caps = np.floor((usable[row][stage_group] - fixed_bytes)[..., None] / per_layer_bytes)  # (orders, stages, modes)
    a = mode_time[row][stage_group]
    edge = np.zeros(stage_group.shape)
    edge[:, 0] += family.edge_s[0][row][stage_group[:, 0]]
    edge[:, -1] += family.edge_s[1][row][stage_group[:, -1]]
    most = caps.max(axis=2)
    feasible = (most >= virtual).all(axis=1) & (most.sum(axis=1) >= num_layers)
    if not feasible.any():
        return math.inf
    caps, a, edge = caps[feasible], a[feasible], edge[feasible]

    def enough(bottleneck_s: np.ndarray) -> np.ndarray:
        layers = np.minimum(caps, np.floor((bottleneck_s[:, None, None] - edge[..., None]) / a)).max(axis=2)
        return layers.sum(axis=1) >= num_layers

    low = np.maximum(known_s, (a.min(axis=2) * virtual + edge).max(axis=1))  # orders that fit there keep it
    high = low + a.max(axis=(1, 2)) * num_layers  # every layer on the slowest stage: enough where caps allow
    width = low.max() * 2.0**-ROOT_BOUND_STEPS
    while (high - low).max() > width:
        middle = (low + high) / 2
        fits = enough(middle)
        high = np.where(fits, middle, high)
        low = np.where(fits, low, middle)
    return float(low.min())


@dataclass
class Pruning:
    """Shared by the search and the candidate generator: candidates whose bound reaches `limit_s` (the incumbent)
    are not generated. With `root_bound`, once the generator has run to its end `least_root_s` holds the least bound
    over all its candidates (bounds that hold for per-stage recompute plans too: see MixedTail and
    _per_stage_recompute_bottleneck_s); it costs about as much as the search on large clusters, so it is computed
    only when asked for."""

    limit_s: float = math.inf
    root_bound: bool = False
    least_root_s: float = math.inf


def outer_configs(
    ctx: CostContext,
    counter: list[int] | None = None,
    memory_bounds: bool = True,
    subsets: Sequence[tuple[DeviceGroup, ...]] | None = None,
    pruning: Pruning | None = None,
) -> Iterator[OuterConfig]:
    """Every candidate (all pipeline orders that may fit) on the given group subsets (default: all), best bound
    first: rows (TP choices of a family) come up in the order of their bound; each row's orders get their own
    bounds (whole layers, memory caps at each depth) and wait in a queue until no row left can go below them.
    Ties keep enumeration order. `counter`, when given, receives the number of candidates (rows that pass the memory
    lower bound, times their pipeline orders)."""
    pruning = pruning if pruning is not None else Pruning()
    families, bounds, roots, virtuals, sizes = _families(ctx, memory_bounds, subsets)
    if counter is not None:
        counter.append(int(sum(np.isfinite(b).sum() * len(_orders(f.subset)) for f, b in zip(families, bounds))))
    if not families:
        return
    flat_bounds = np.concatenate(bounds)
    flat_virtual = np.concatenate(virtuals)
    flat_roots = np.concatenate(roots)
    family_of = np.repeat(np.arange(len(families)), sizes)
    row_of = np.concatenate([np.arange(n) for n in sizes])
    ranked = np.argsort(flat_bounds, kind="stable")
    # (bound, arrival, a candidate or a row to expand into its orders): a row waits with its whole-layer bound
    # (its orders' bounds are at least that), so rows that cannot beat the final incumbent are never expanded
    queue: list[tuple[float, int, OuterConfig | int]] = []
    arrival = itertools.count()

    def whole_layer_bound(index: int) -> _WholeLayerBound:
        family, row = families[family_of[index]], row_of[index]
        microbatches = config_microbatches(ctx, family)[0]
        bound = float(flat_bounds[index])
        return _WholeLayerBound(family, row, bound, microbatches, int(flat_virtual[index]), ctx.model.num_layers)

    popped_roots: dict[int, float] = {}  # rows that came up: their root bound with whole layers

    def settle_root() -> None:
        """The least root bound over every row: least first, each tightened by whole layers and then by the memory
        a per-stage recompute plan needs, until the least is one that cannot rise further."""
        values = flat_roots.copy()
        for index, value in popped_roots.items():
            values[index] = value
        finite = np.flatnonzero(np.isfinite(values))
        heap = [(float(values[i]), int(i), 1 if int(i) in popped_roots else 0) for i in finite]
        heapq.heapify(heap)
        while heap:
            value, index, tightened = heapq.heappop(heap)
            if tightened == 2:
                pruning.least_root_s = min(pruning.least_root_s, value)
                return
            raised = whole_layer_bound(index).root_s(memory=tightened == 1)
            if math.isfinite(raised):
                heapq.heappush(heap, (max(value, raised), index, tightened + 1))

    def expand(index: int, whole_s: float) -> None:
        """Queue a row's pipeline orders that may fit memory, each with its own bound."""
        family, row = families[family_of[index]], row_of[index]
        bound, virtual = float(flat_bounds[index]), int(flat_virtual[index])
        possible = family.possible_orders()
        orders = _orders(family.subset)
        if possible is not None:  # per-order bounds only for the orders whose layer capacity may hold the model
            orders = [order for order in orders if possible[row, _PERMUTATION_INDEX[len(order)][order]]]
            if not orders:
                return
        increase = _order_bound_increase_s(family, row, orders, virtual) if possible is not None else None
        for number, order in enumerate(orders):
            order_bound_s = max(bound + float(increase[number]), whole_s) if increase is not None else bound
            if order_bound_s >= pruning.limit_s:
                continue
            config = OuterConfig(
                groups=tuple(family.subset[i] for i in order),
                tps=tuple(int(family.tps[row, i]) for i in order),
                stage_counts=tuple(int(family.counts[row, i]) for i in order),
                replicas=family.replicas,
                micro_batch_size=family.micro_batch_size,
                recompute=family.recompute,
                virtual_stages=virtual,
                lower_bound_s=bound,
                order_bound_s=order_bound_s,
                fill_and_drain_bound_s=float(family.fill_and_drain_s[row]),
            )
            heapq.heappush(queue, (order_bound_s, next(arrival), config))

    def ready(below_s: float) -> Iterator[OuterConfig]:
        """The queued candidates whose bound is below `below_s`, best first, while they can beat the incumbent."""
        while queue and queue[0][0] <= below_s:
            key_s, _, item = heapq.heappop(queue)
            if key_s >= pruning.limit_s:
                queue.clear()  # the rest are no better
                return
            if isinstance(item, OuterConfig):
                yield item
            else:
                expand(item, key_s)

    for index in ranked:
        bound = float(flat_bounds[index])
        yield from ready(bound)
        if not math.isfinite(bound) or bound >= pruning.limit_s:
            break  # every later row, and every queued item, is bounded by this
        whole = whole_layer_bound(index)
        if pruning.root_bound:
            popped_roots[int(index)] = whole.root_s()
        if whole() < pruning.limit_s:
            # memory-free candidates (the misfit search) go in the order of their plain bound
            heapq.heappush(queue, (whole() if memory_bounds else bound, next(arrival), int(index)))
    else:
        yield from ready(math.inf)
    if pruning.root_bound:
        settle_root()


class _StageTerms:
    """Per-stage cost-model terms, memoised for one search (many candidates share stage shapes)."""

    def __init__(self, ctx: CostContext) -> None:
        self.ctx = ctx
        self._time: dict[tuple[object, ...], tuple[float, float]] = {}
        self._memory: dict[tuple[object, ...], tuple[float, float, float]] = {}
        self._tail: dict[tuple[object, ...], float] = {}
        self.evaluations: StageCache = {}  # stage evaluations (cost_model.evaluate's cache)

    def fill_and_drain_s(self, strategy: Strategy) -> float:
        """The point-to-point time of a one-family strategy's fill and drain (as cost_model.evaluate counts it)."""
        pipeline = strategy.pipelines[0]
        stages, b = pipeline.stages, pipeline.micro_batch_size
        one_way = sum(p2p_time_s(self.ctx, stages[i], stages[i + 1], b) for i in range(len(stages) - 1))
        return 2 * strategy.virtual_stages * one_way

    def tail_per_layer_s(self, group: DeviceGroup, config: OuterConfig, tp: int) -> float:
        """A lower bound on a stage's tail (exposed DP sync + optimizer step) per layer it holds: DP time is concave
        in the bytes with no time at zero, so per layer it is least with all L layers; the backward hiding it and
        the optimizer step are linear in the layers; embedding / LM-head parameters only add."""
        key = (group.name, config.micro_batch_size, tp, config.recompute, config.replicas)
        if key not in self._tail:
            ctx, num_layers = self.ctx, self.ctx.model.num_layers
            params = ctx.model.layer_params() / tp
            dp_s = dp_sync_time_s(ctx, group, num_layers * params, tp, config.replicas) / num_layers
            backward_s = ctx.source(group.name).layer_cost("decoder", config.micro_batch_size, tp, config.recompute)
            hidden_s = ctx.terms.dp_overlap * backward_s.backward_time_s if ctx.training.overlap_grad_reduce else 0.0
            self._tail[key] = max(0.0, dp_s - hidden_s) + optimizer_time_s(ctx, group, params, config.replicas)
        return self._tail[key]

    def time_s(
        self, group: DeviceGroup, config: OuterConfig, tp: int, mode: Recompute, first: bool, last: bool
    ) -> tuple[float, float]:
        """(per-layer time, embedding/LM-head time) per micro-batch."""
        key = (group.name, config.micro_batch_size, tp, mode, first, last)
        if key not in self._time:
            b = config.micro_batch_size
            self._time[key] = (
                decoder_layer_time_s(self.ctx, group, b, tp, mode),
                edge_time_s(self.ctx, group, b, tp, first, last),
            )
        return self._time[key]

    def memory_bytes(
        self,
        group: DeviceGroup,
        config: OuterConfig,
        tp: int,
        mode: Recompute,
        in_flight: float,
        first: bool,
        last: bool,
        stages: int,
    ) -> tuple[float, float, float]:
        """(bytes per layer, bytes with no layer, usable bytes): stage memory is linear in its layers."""
        key = (group.name, config.micro_batch_size, tp, mode, config.replicas, in_flight, first, last, stages)
        if key not in self._memory:
            common = dict(
                micro_batch_size=config.micro_batch_size,
                tp=tp,
                recompute=mode,
                dp=config.replicas,
                in_flight=in_flight,
                first=first,
                last=last,
                pipeline_stages=stages,
            )
            empty = stage_memory(self.ctx, group, num_layers=0, **common).total_bytes
            one = stage_memory(self.ctx, group, num_layers=1, **common).total_bytes
            self._memory[key] = (one - empty, empty, usable_memory_bytes(self.ctx, group))
        return self._memory[key]

    def arrays(
        self, config: OuterConfig, mode: Recompute | None = None
    ) -> tuple[list[tuple[DeviceGroup, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per stage along the pipe, with every stage in `mode` (default: the config's): (group, tp), per-layer
        time, fixed time, memory cap in layers, bytes per layer, memory excess with zero layers."""
        mode = mode or config.recompute  # type: ignore[assignment]
        stages = [(g, t) for g, t, c in zip(config.groups, config.tps, config.stage_counts) for _ in range(c)]
        p = len(stages)
        microbatches = config_microbatches(self.ctx, config)[0]
        rows = []
        for index, (group, tp) in enumerate(stages):
            first, last = index == 0, index == p - 1
            per_layer, fixed = self.time_s(group, config, tp, mode, first, last)
            in_flight = in_flight_microbatches(index, p, microbatches, config.virtual_stages)
            layer_bytes, empty, usable = self.memory_bytes(group, config, tp, mode, in_flight, first, last, p)
            cap = math.floor((usable - empty) / layer_bytes) if usable >= empty else 0
            rows.append((per_layer, fixed, cap, layer_bytes, empty - usable))
        per_layer_s, fixed_s, caps, per_layer_bytes, excess = (np.array(column) for column in zip(*rows))
        return stages, per_layer_s, fixed_s, caps, per_layer_bytes, excess


def _shortfall_bytes(num_layers: int, per_layer_bytes: np.ndarray, excess_empty: np.ndarray, least: int) -> float:
    """Smallest X such that the stages could hold the model if every device had X more bytes."""
    low, high = 0.0, float(num_layers * per_layer_bytes.max() + max(0.0, excess_empty.max()))
    for _ in range(60):
        mid = (low + high) / 2
        caps = np.floor((mid - excess_empty) / per_layer_bytes)
        if np.all(caps >= least) and caps.sum() >= num_layers:
            high = mid
        else:
            low = mid
    return high


def build_strategy(
    ctx: CostContext, config: OuterConfig, layers: tuple[int, ...], modes: tuple[Recompute, ...] | None = None
) -> Strategy:
    """The strategy of a candidate and its layer split; `modes` gives each stage its own recompute mode."""
    stages = []
    start = 0
    stage_groups = [(g, t) for g, t, c in zip(config.groups, config.tps, config.stage_counts) for _ in range(c)]
    for index, ((group, tp), count) in enumerate(zip(stage_groups, layers)):
        stages.append(StageStrategy(group.name, start, start + count, tp, 0, modes[index] if modes else None))
        start += count
    microbatches, total = config_microbatches(ctx, config)
    placed = pack_stages(stages, config.replicas)
    pipeline = split_pipeline(config.replicas, config.micro_batch_size, placed, microbatches, total)
    default: Recompute = max(modes, key=modes.count) if modes else config.recompute  # type: ignore[assignment]
    return Strategy(
        (pipeline,), default, ctx.training.zero_stage, config.virtual_stages, ctx.training.sequence_parallel
    )


MISFIT_CANDIDATES = 20_000


def _closest_misfit(ctx: CostContext, terms: _StageTerms) -> tuple[float, str]:
    """When nothing fits: the candidate needing the least extra memory per device (among the first
    MISFIT_CANDIDATES by time bound, memory bounds off), and a description of it."""
    num_layers = ctx.model.num_layers
    shortfall, where = math.inf, ""
    for config in itertools.islice(outer_configs(ctx, memory_bounds=False), MISFIT_CANDIDATES):
        _, _, _, _, per_layer_bytes, excess_empty = terms.arrays(config)
        missing = _shortfall_bytes(num_layers, per_layer_bytes, excess_empty, config.virtual_stages)
        if missing < shortfall:
            shortfall = missing
            names = "+".join(f"{g.name}(tp{t}x{c})" for g, t, c in zip(config.groups, config.tps, config.stage_counts))
            where = (
                f"{names}, dp {config.replicas}, micro-batch {config.micro_batch_size}, "
                f"recompute {config.recompute}, virtual stages {config.virtual_stages}"
            )
    return shortfall, where


def _candidate_strategy(
    ctx: CostContext, terms: _StageTerms, config: OuterConfig, incumbent_s: float, splitter: LayerSplitter | None
) -> tuple[Strategy | None, bool, float]:
    """(the candidate's best strategy, or None; whether memory made it infeasible; its pipeline objective).
    None without infeasibility: the candidate cannot beat `incumbent_s`, a bound on the pipeline objective
    (the objective is a lower bound on the iteration time). Per-stage candidates (the refinement step, which runs
    without a baseline `splitter`) are solved by CP-SAT."""
    num_layers = ctx.model.num_layers
    microbatches = config_microbatches(ctx, config)[0]
    v = config.virtual_stages
    if config.recompute != PER_STAGE:
        # the pipeline's fill and drain point-to-point does not depend on the layer split: the exact one first
        p = sum(config.stage_counts)
        fill_and_drain_s = terms.fill_and_drain_s(
            build_strategy(ctx, config, (v,) * (p - 1) + (num_layers - v * (p - 1),))
        )
        if config.order_bound_s - config.fill_and_drain_bound_s + fill_and_drain_s >= incumbent_s:
            return None, False, math.inf
        stages, per_layer, fixed, caps, _, _ = terms.arrays(config)
        if splitter is None:
            split = split_layers(num_layers, per_layer, fixed, caps, microbatches, v)
        else:
            split = splitter(stages, num_layers, per_layer, fixed, caps, microbatches, v)
        if split is None:
            return None, True, math.inf
        # the iteration is at least the pipeline objective plus the fullest tail and the fill / drain point-to-point
        # (checked before evaluating)
        tail_rates = np.array([terms.tail_per_layer_s(group, config, tp) for group, tp in stages])
        tail_s = float((np.array(split.layers) * tail_rates).max()) + ctx.terms.iteration_overhead_s
        if split.objective_s + tail_s >= incumbent_s:
            return None, False, split.objective_s
        if split.objective_s + tail_s + fill_and_drain_s >= incumbent_s:
            return None, False, split.objective_s
        return build_strategy(ctx, config, split.layers), False, split.objective_s
    modes = ctx.training.recompute
    per_mode = [terms.arrays(config, mode) for mode in modes]
    per_layer = np.stack([arrays[1] for arrays in per_mode], axis=1)
    caps = np.stack([arrays[3] for arrays in per_mode], axis=1)
    fixed = per_mode[0][2]
    bound = per_stage_mode_lower_bound_s(num_layers, per_layer, fixed, caps, microbatches, v)
    if bound is None:
        return None, True, math.inf
    if bound >= incumbent_s * (1 - 1e-9):
        return None, False, bound
    mixed = split_layers_and_modes(num_layers, per_layer, fixed, caps, microbatches, v)
    if mixed is None:
        return None, True, math.inf
    if len(set(mixed.modes)) == 1 or mixed.objective_s >= incumbent_s:
        return None, False, mixed.objective_s  # one mode everywhere: that candidate is searched on its own
    strategy = build_strategy(ctx, config, mixed.layers, tuple(modes[r] for r in mixed.modes))
    return strategy, False, mixed.objective_s


def searches_families(ctx: CostContext) -> bool:
    """Whether the search also plans several pipeline families (TrainingSpec.families)."""
    groups = len(ctx.cluster.groups)
    return groups > 1 and (ctx.training.families == "search" or (ctx.training.families == "auto" and groups == 2))


def search(
    ctx: CostContext,
    top_k: int = 1,
    progress: ProgressCallback | None = None,
    splitter: LayerSplitter | None = None,
    gap: float = 0.0,
    warm_start: Sequence[Evaluation] = (),
    per_stage_candidates: int = PER_STAGE_CANDIDATES,
    every_group: bool = False,
    root_bound: bool = False,
) -> SearchResult:
    """The k fastest strategies that fit memory (fewer if fewer fit). `splitter` replaces the exact layer split
    by another rule (planner.baselines); the candidates' bounds hold for any split, so the search stays exact
    for the rule it is given. `warm_start`: feasible evaluations (e.g. the previous plan adapted to a changed
    cluster) that seed the incumbent, so the bounds prune from the first candidate on. `per_stage_candidates`:
    how many of the best candidates are re-solved with a recompute mode per stage (0: none).
    `root_bound`: also compute SearchResult.lower_bound_s, the least bound over the whole space (for the gap).
    `every_group`: only pipelines that use every group (the family search's blocks: a block that leaves a group
    idle is another partition's business)."""
    best: list[tuple[float, int, Evaluation]] = []  # max-heap on iteration time via negation
    for position, evaluation in enumerate(warm_start):
        if evaluation.fits:
            _keep(best, top_k, evaluation, -1 - position)
    evaluated = infeasible = 0
    shortfall, shortfall_where = math.inf, ""
    terms = _StageTerms(ctx)
    index = -1
    root_bound_s = math.inf
    candidates: list[int] = []
    tried: list[tuple[float, int, OuterConfig, float]] = []
    pruning = Pruning(-best[0][0] * (1 - gap) if len(best) == top_k else math.inf, root_bound)
    scanned = 0

    def scan(subsets: list[tuple[DeviceGroup, ...]]) -> None:
        """Branch and bound over the candidates on these group subsets (best bound first; the generator stops
        once no candidate left can beat the incumbent)."""
        nonlocal root_bound_s, evaluated, infeasible, scanned
        for index, config in enumerate(outer_configs(ctx, candidates, subsets=subsets, pruning=pruning), scanned):
            scanned = index + 1
            if progress is not None and index % 64 == 0:
                progress(index, index + 64)
            incumbent_s = -best[0][0] * (1 - gap) if len(best) == top_k else math.inf
            evaluated += 1
            strategy, memory_bound, objective_s = _candidate_strategy(ctx, terms, config, incumbent_s, splitter)
            if strategy is None:
                infeasible += memory_bound
                continue
            evaluation = evaluate(ctx, strategy, terms.evaluations)
            if not evaluation.fits:
                infeasible += 1
                continue
            tried.append((evaluation.iteration_time_s, index, config, objective_s))
            _keep(best, top_k, evaluation, index)
            if len(best) == top_k:
                pruning.limit_s = -best[0][0] * (1 - gap)

    # Pipelines over every group first; then the smaller subsets whose work bound can still beat the incumbent
    # (most cannot: fewer devices do the same work), each in best-bound order.
    groups = tuple(ctx.cluster.groups)
    scan([groups])
    if not every_group:
        smaller = [s for size in range(1, len(groups)) for s in itertools.combinations(groups, size)]
        incumbent_s = -best[0][0] * (1 - gap) if len(best) == top_k else math.inf
        bounds = {s: _work_bound_s(ctx, s) for s in smaller}
        scan([s for s in smaller if bounds[s] < incumbent_s])
        root_bound_s = min([root_bound_s, *(b for b in bounds.values() if b >= incumbent_s)])
    root_bound_s = min(root_bound_s, pruning.least_root_s)
    index = scanned - 1
    if progress is not None:
        progress(index + 1, index + 1)
    if splitter is None and ctx.training.uneven_batch == "refine":
        evaluated += _uneven_refinement(ctx, terms, tried, best, top_k)
    refined = 0
    if splitter is None and per_stage_candidates and len(ctx.training.recompute) > 1:
        # Per-stage recompute: the best candidates again, each stage free to pick its mode (CP-SAT), where the
        # bound says that can beat the candidate's best single mode.
        uniform_objective: dict[OuterConfig, float] = {}
        for _, _, config, objective_s in tried:
            key = dataclasses.replace(config, recompute=PER_STAGE, lower_bound_s=0.0, order_bound_s=0.0)
            uniform_objective[key] = min(uniform_objective.get(key, math.inf), objective_s)
        seen: set[OuterConfig] = set()
        for _, order, config, _ in sorted(tried, key=lambda item: (item[0], item[1])):
            key = dataclasses.replace(config, recompute=PER_STAGE, lower_bound_s=0.0, order_bound_s=0.0)
            if key in seen:
                continue
            seen.add(key)
            if len(seen) > per_stage_candidates:
                break
            # worth solving only where it could beat both the candidate's best single mode and the k-th best plan
            kth_best_s = -best[0][0] if len(best) == top_k else math.inf
            strategy, _, _ = _candidate_strategy(ctx, terms, key, min(uniform_objective[key], kth_best_s), None)
            if strategy is None:
                continue
            refined += 1
            evaluation = evaluate(ctx, strategy, terms.evaluations)
            if evaluation.fits:
                _keep(best, top_k, evaluation, order)
    partitions_tried = 0
    if splitter is None and searches_families(ctx):
        from planner.bounds import compute_bound_tokens_per_s
        from planner.families import family_search

        rates = {
            g.name: compute_bound_tokens_per_s(dataclasses.replace(ctx, cluster=ctx.cluster.only(g)))
            for g in ctx.cluster.groups
        }
        families = family_search(ctx, top_k, rates, progress)
        partitions_tried = families.partitions
        for position, evaluation in enumerate(families.evaluations):
            _keep(best, top_k, evaluation, index + 1 + position)
        # every plan, of any family structure, is bounded by all devices busy at their best speed
        root_bound_s = min(root_bound_s, ctx.training.global_batch_size * ctx.seq_length / sum(rates.values()))
    if not best:
        shortfall, shortfall_where = _closest_misfit(ctx, terms)
    ranked = [e for _, _, e in sorted(best, key=lambda item: (-item[0], -item[1]))]
    return SearchResult(
        ranked,
        sum(candidates),
        evaluated,
        infeasible,
        shortfall,
        shortfall_where,
        root_bound_s if root_bound else None,
        refined,
        partitions_tried,
    )


def _nearby_replica_counts(config: OuterConfig) -> list[int]:
    """Replica counts at which some group of a candidate holds fewer stages, or up to two more (and one replica
    fewer than the candidate's)."""
    counts = {config.replicas - 1}
    for group, tp, stages in zip(config.groups, config.tps, config.stage_counts):
        for k in range(1, stages + 3):
            counts.add(group.num_devices // (k * tp))
    return sorted((c for c in counts if c >= 1), reverse=True)


def _uneven_refinement(
    ctx: CostContext,
    terms: _StageTerms,
    tried: list[tuple[float, int, OuterConfig, float]],
    best: list[tuple[float, int, Evaluation]],
    top_k: int,
) -> int:
    """The best even candidates again at nearby replica counts that do not divide the batch (each group keeping as
    many stages as it then fits); returns how many were solved. Adds what it finds to `tried` and `best`."""
    global_batch, num_layers = ctx.training.global_batch_size, ctx.model.num_layers
    seen: set[OuterConfig] = set()
    solved = 0
    for _, order, config, _ in sorted(tried, key=lambda item: (item[0], item[1]))[:UNEVEN_CANDIDATES]:
        for replicas in _nearby_replica_counts(config):
            if global_batch % replicas == 0 or split_batch(global_batch, replicas, config.micro_batch_size) is None:
                continue  # even splits were searched already
            counts = tuple(g.num_devices // (replicas * t) for g, t in zip(config.groups, config.tps))
            stages = sum(counts)
            v = config.virtual_stages if stages > 1 else 1  # a single stage cannot interleave
            if min(counts) < 1 or stages * v > num_layers:
                continue
            candidate = dataclasses.replace(
                config, replicas=replicas, stage_counts=counts, virtual_stages=v, lower_bound_s=0.0, order_bound_s=0.0
            )
            if candidate in seen:
                continue
            seen.add(candidate)
            incumbent_s = -best[0][0] if len(best) == top_k else math.inf
            strategy, _, objective_s = _candidate_strategy(ctx, terms, candidate, incumbent_s, None)
            if strategy is None:
                continue
            solved += 1
            evaluation = evaluate(ctx, strategy, terms.evaluations)
            if evaluation.fits:
                tried.append((evaluation.iteration_time_s, order, candidate, objective_s))
                _keep(best, top_k, evaluation, order)
    return solved


def _keep(best: list[tuple[float, int, Evaluation]], top_k: int, evaluation: Evaluation, order: int) -> None:
    """Keep the k fastest (a max-heap on iteration time; earlier candidates win ties)."""
    entry = (-evaluation.iteration_time_s, -order, evaluation)
    if len(best) < top_k:
        heapq.heappush(best, entry)
    elif entry[0] > best[0][0]:
        heapq.heapreplace(best, entry)
