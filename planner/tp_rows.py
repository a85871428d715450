"""Candidates in batches, with their bounds as arrays: for one group subset, replica count, micro-batch, recompute mode
and interleaving depth, every TP choice of the groups is a row (TpRowBatch).

Rows that fail the structural checks or the memory lower bound (the devices' usable memory must hold the model's
state) are dropped; the rest get a lower bound on their iteration time and on any per-stage recompute plan of their
shape (planner.lower_bounds). When a row comes up in the search, its pipeline orders that may fit memory and their own
bounds are worked out (TpRowBatch.possible_orders, order_bound_increase_s), and its bound tightened by whole layers
(RowBound).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from planner.candidates import (
    OuterConfig,
    divisors,
    group_orders,
    group_parts,
    part_devices,
    replica_counts,
    tp_options,
)
from planner.lower_bounds import (
    MixedTail,
    PipelineBound,
    least_bottleneck_and_stage_sum_s,
    least_bottleneck_and_tail_s,
    least_stage_sum_s,
    memory_bottleneck_s,
    orders_within_memory,
    per_stage_memory_bottleneck_s,
    whole_layer_bottleneck_s,
    whole_layer_bottlenecks_s,
)
from planner.options import DEFAULT_OPTIONS, SearchOptions
from predictor.comm_model import Link
from predictor.cost_model import (
    CostContext,
    decoder_layer_time_s,
    edge_time_s,
    fill_and_drain_time_s,
    in_flight_table,
    least_sync_and_step_per_layer_s,
    stage_memory,
    state_bytes_per_param,
    tail_per_layer_lower_bound_s,
    usable_memory_bytes,
)
from specs.cluster import DeviceGroup
from specs.model import Recompute

WHOLE_LAYER_ROWS = 50_000  # rows of a subset and micro-batch whose sources wait with their whole-layer bound


class TailPerLayer:
    """cost_model.tail_per_layer_lower_bound_s of a stage shape, memoised (many candidates share stage shapes)."""

    def __init__(self, ctx: CostContext) -> None:
        self.ctx = ctx
        self._sync_and_step: dict[tuple[str, int, int], tuple[float, float]] = {}
        self._tail: dict[tuple[str, int, int, Recompute, int], float] = {}

    def __call__(
        self, group: DeviceGroup, micro_batch_size: int, tp: int, recompute: Recompute, replicas: int
    ) -> float:
        key = (group.name, micro_batch_size, tp, recompute, replicas)
        if key not in self._tail:
            shape = (group.name, tp, replicas)
            if shape not in self._sync_and_step:
                self._sync_and_step[shape] = least_sync_and_step_per_layer_s(self.ctx, group, tp, replicas)
            layer = self.ctx.source(group).layer_cost("decoder", micro_batch_size, tp, recompute)
            self._tail[key] = tail_per_layer_lower_bound_s(self.ctx, layer.backward_time_s, self._sync_and_step[shape])
        return self._tail[key]


class _GroupCosts:
    """Cost-model numbers per group, TP, micro-batch, recompute and replica count that every subset's rows share
    (filled a group at a time, as subsets come up)."""

    def __init__(self, ctx: CostContext) -> None:
        self.ctx = ctx
        self.per_layer_s: dict[tuple[str, int, int, Recompute], float] = {}
        self.activation_bytes: dict[tuple[str, int, int, Recompute], float] = {}
        self.embedding_s: dict[tuple[str, int, int], float] = {}
        self.head_s: dict[tuple[str, int, int], float] = {}
        self.tail_per_layer_s = TailPerLayer(ctx)
        self._edge_bytes: dict[tuple[object, ...], float] = {}
        self._groups: dict[str, DeviceGroup] = {}

    def knows(self, group: DeviceGroup) -> bool:
        """Whether the group's numbers can go here: it is known, or no group of its name is."""
        known = self._groups.get(group.name)
        return known is None or known is group or known == group

    def add(self, group: DeviceGroup) -> None:
        """Fill the group's numbers (once; RowTables puts a group where `knows` says it can go)."""
        if group.name in self._groups:
            return
        ctx, training, g = self.ctx, self.ctx.training, group
        for t in tp_options(ctx, g):
            for b in training.micro_batch_sizes:
                for rc in training.recompute:
                    self.per_layer_s[g.name, b, t, rc] = decoder_layer_time_s(ctx, g, b, t, rc)
                    self.activation_bytes[g.name, b, t, rc] = (
                        ctx.source(g).layer_cost("decoder", b, t, rc).activation_bytes
                    )
                self.embedding_s[g.name, b, t] = edge_time_s(ctx, g, b, t, True, False)
                self.head_s[g.name, b, t] = edge_time_s(ctx, g, b, t, False, True)
        self._groups[g.name] = g

    def edge_bytes(self, group: DeviceGroup, b: int, t: int, rc: Recompute, d: int, first: bool) -> float:
        """Bytes the first (or last) stage holds besides its layers; a lower bound: one micro-batch in flight. The last
        stage's do not depend on the recompute mode."""
        key = (group.name, b, t, rc if first else "none", d, first)
        if key not in self._edge_bytes:
            memory = stage_memory(
                self.ctx,
                group,
                num_layers=0,
                micro_batch_size=b,
                tp=t,
                recompute=rc if first else "none",
                dp=d,
                in_flight=1,
                first=first,
                last=not first,
                pipeline_stages=2,
            )
            self._edge_bytes[key] = memory.total_bytes
        return self._edge_bytes[key]


@dataclass(frozen=True, eq=False)
class RowMemory:
    """What the memory bounds of a batch's rows need ((rows, groups) arrays unless said otherwise). The first and last
    stages' fixed bytes cost stage_memory calls, so they are built only for the batches whose rows come up."""

    usable_bytes: np.ndarray
    state_per_layer_bytes: np.ndarray
    activation_bytes: np.ndarray  # per layer and micro-batch in flight, in the batch's mode
    mode_time_s: np.ndarray  # (rows, groups, modes): per-layer time in every recompute mode
    mode_activation_bytes: np.ndarray  # (rows, groups, modes)
    source: SubsetRows
    positions: np.ndarray  # the rows' TP positions in the subset's options
    shape: tuple[int, Recompute, int]  # (micro-batch, mode, replicas)

    @cached_property
    def edge_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Fixed bytes of each group's stage if first, if last (a lower bound: one micro-batch in flight)."""
        return self.source.edge_bytes(self.positions, *self.shape)

    @cached_property
    def least_first_bytes(self) -> np.ndarray:
        """The first stage's fixed bytes in the recompute mode that needs least (for per-stage recompute plans)."""
        b, _, d = self.shape
        modes = self.source.costs.ctx.training.recompute
        return np.minimum.reduce([self.source.edge_bytes(self.positions, b, rc, d)[0] for rc in modes])


@dataclass(frozen=True, eq=False)
class TpRowBatch:
    """Candidates sharing a group subset, replica count, micro-batch, recompute mode and interleaving depth; one row
    per TP choice of the groups. Arrays are (rows, groups) unless said otherwise."""

    subset: tuple[DeviceGroup, ...]
    replicas: int
    micro_batch_size: int
    recompute: Recompute
    virtual_stages: int
    microbatches: int  # the most micro-batches a replica runs
    num_layers: int
    tps: np.ndarray
    counts: np.ndarray  # stages per group
    per_layer_s: np.ndarray
    first_edge_s: np.ndarray  # embedding time, if the group's stage comes first
    last_edge_s: np.ndarray  # LM head time, if it comes last
    bound_s: np.ndarray  # (rows,) of every pipeline order; inf where the row cannot interleave this deep
    least_bottleneck_s: np.ndarray  # (rows,) the bottleneck bound_s assumed
    fill_and_drain_s: np.ndarray  # (rows,) the point-to-point part of bound_s
    tail: MixedTail
    tail_per_layer_s: np.ndarray  # a stage's tail bound per layer it holds (cost_model.tail_per_layer_lower_bound_s)
    memory: RowMemory | None  # None: memory bounds off (the search for the closest misfit)

    @cached_property
    def root_s(self) -> np.ndarray:
        """(rows,) bound_s made valid for per-stage recompute plans too (for the root bound only)."""
        weight = self.microbatches - 1 / self.virtual_stages
        least = self.least_bottleneck_s
        return self.tail.root_s(slice(None), self.bound_s, least, least, weight)

    @cached_property
    def possible_orders(self) -> np.ndarray | None:
        """(rows, permutations of the subset): the orders that may fit memory (None: memory bounds off)."""
        if self.memory is None:
            return None
        first_bytes, last_bytes = self.memory.edge_bytes
        return orders_within_memory(
            self.memory.usable_bytes,
            self.memory.state_per_layer_bytes,
            self.memory.activation_bytes,
            first_bytes,
            last_bytes,
            self.counts,
            self.microbatches,
            self.num_layers,
            self.virtual_stages,
        )

    def possible_orders_of(self, row: int, orders: np.ndarray) -> np.ndarray:
        """possible_orders of one row for these orders (the search asks row by row: every permutation of every row
        at once grows as k!)."""
        assert self.memory is not None
        first_bytes, last_bytes = self.memory.edge_bytes
        one = slice(row, row + 1)
        return orders_within_memory(
            self.memory.usable_bytes[one],
            self.memory.state_per_layer_bytes[one],
            self.memory.activation_bytes[one],
            first_bytes[one],
            last_bytes[one],
            self.counts[one],
            self.microbatches,
            self.num_layers,
            self.virtual_stages,
            orders,
        )[0]

    def candidate(self, row: int, order: tuple[int, ...], order_bound_s: float) -> OuterConfig:
        """The candidate of a row with its groups in this order."""
        return OuterConfig(
            groups=tuple(self.subset[i] for i in order),
            tps=tuple(int(self.tps[row, i]) for i in order),
            stage_counts=tuple(int(self.counts[row, i]) for i in order),
            replicas=self.replicas,
            micro_batch_size=self.micro_batch_size,
            recompute=self.recompute,
            virtual_stages=self.virtual_stages,
            lower_bound_s=float(self.bound_s[row]),
            order_bound_s=order_bound_s,
            fill_and_drain_bound_s=float(self.fill_and_drain_s[row]),
        )

    def _stages(
        self, row: int, orders: Sequence[tuple[int, ...]] | np.ndarray, first_bytes: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """Per order (rows) and stage along the pipe (columns): the stage's group, its in-flight micro-batches
        (columns only), its fixed time and its fixed bytes (embedding on the first stage, LM head on the last)."""
        assert self.memory is not None
        order_array = np.asarray(orders)  # (orders, groups)
        ends = np.cumsum(self.counts[row][order_array], axis=1)
        position = (np.arange(int(ends[0, -1]))[None, :, None] >= ends[:, None, :]).sum(axis=2)
        stage_group = np.take_along_axis(order_array, position, axis=1)  # (orders, stages)
        stages = stage_group.shape[1]
        depth = stages - np.arange(stages)  # 1 at the last stage
        in_flight = in_flight_table(depth, self.microbatches, np.array([stages]), self.virtual_stages)[0]
        fixed_bytes = np.zeros(stage_group.shape)
        fixed_bytes[:, 0] += first_bytes[row][stage_group[:, 0]]
        fixed_bytes[:, -1] += self.memory.edge_bytes[1][row][stage_group[:, -1]]
        edge = np.zeros(stage_group.shape)
        edge[:, 0] += self.first_edge_s[row][stage_group[:, 0]]
        edge[:, -1] += self.last_edge_s[row][stage_group[:, -1]]
        return stage_group, in_flight, edge, fixed_bytes

    def order_bound_increase_s(
        self, row: int, orders: Sequence[tuple[int, ...]] | np.ndarray, steps: int
    ) -> np.ndarray:
        """Per order of the row's groups, how much its bound rises when memory is seen (inf: cannot fit): the
        bottleneck becomes the least whole layers allow with each stage's cap taken at its depth in the pipe (1F1B
        keeps min(depth, m) micro-batches in flight), first and last stages also holding the embedding / LM head;
        where it exceeds the bottleneck the row's bound assumed, the bound rises by (m - 1/v) times the difference."""
        assert self.memory is not None
        memory, v = self.memory, self.virtual_stages
        stage_group, in_flight, edge, fixed_bytes = self._stages(row, orders, memory.edge_bytes[0])
        per_layer_bytes = (
            memory.state_per_layer_bytes[row][stage_group] + memory.activation_bytes[row][stage_group] * in_flight
        )
        caps = np.floor((memory.usable_bytes[row][stage_group] - fixed_bytes) / per_layer_bytes)
        a = self.per_layer_s[row][stage_group]
        known = float(self.least_bottleneck_s[row])
        bottleneck, feasible = memory_bottleneck_s(a, edge, caps, self.num_layers, v, steps, known)
        extra = np.maximum(0.0, bottleneck - self.least_bottleneck_s[row]) * (self.microbatches - 1 / v)
        return np.where(feasible, extra, np.inf)

    def least_order_increase_s(self, row: int, steps: int) -> float:
        """A bound on order_bound_increase_s over every pipeline order of the row, from one relaxed order: each
        group's stages at the depths with the most room (1 to its stage count, from the end of the pipe), without the
        embedding, the LM head and their bytes (inf: no order fits). A stage's cap shrinks with its depth and an order
        puts a group's c stages at c distinct depths, so no order's stages hold more layers within any bottleneck.
        Eight device kinds: within 0.01 s of the least over the 40,320 orders on 79 of the 80 rows that have some."""
        assert self.memory is not None
        memory, v, counts = self.memory, self.virtual_stages, self.counts[row]
        stage_group = np.repeat(np.arange(len(counts)), counts)
        depth = np.concatenate([np.arange(1, c + 1) for c in counts.tolist()])
        in_flight = in_flight_table(depth, self.microbatches, np.array([int(counts.sum())]), v)[0]
        per_layer_bytes = (
            memory.state_per_layer_bytes[row][stage_group] + memory.activation_bytes[row][stage_group] * in_flight
        )
        caps = np.floor(memory.usable_bytes[row][stage_group] / per_layer_bytes)[None, :]
        a = self.per_layer_s[row][stage_group][None, :]
        known = float(self.least_bottleneck_s[row])
        bottleneck, feasible = memory_bottleneck_s(a, np.zeros_like(a), caps, self.num_layers, v, steps, known)
        if not feasible[0]:
            return math.inf
        return max(0.0, float(bottleneck[0]) - known) * (self.microbatches - 1 / v)

    def per_stage_recompute_bottleneck_s(self, row: int, known_s: float, steps: int) -> float:
        """The least bottleneck any plan of the row's shape reaches with a recompute mode per stage, over the pipeline
        orders (inf: none fits); as order_bound_increase_s with every stage taking the mode that holds most layers
        within the bottleneck, the first stage's fixed bytes in the mode that needs least. `known_s`: a bottleneck
        known to be reached (lower_bounds.per_stage_memory_bottleneck_s)."""
        assert self.memory is not None
        memory = self.memory
        orders = group_orders(self.subset)
        stage_group, in_flight, edge, fixed_bytes = self._stages(row, orders, memory.least_first_bytes)
        per_layer_bytes = (
            memory.state_per_layer_bytes[row][stage_group][..., None]
            + memory.mode_activation_bytes[row][stage_group] * in_flight[None, :, None]
        )
        caps = np.floor((memory.usable_bytes[row][stage_group] - fixed_bytes)[..., None] / per_layer_bytes)
        a = memory.mode_time_s[row][stage_group]  # (orders, stages, modes)
        return per_stage_memory_bottleneck_s(a, edge, caps, self.num_layers, self.virtual_stages, known_s, steps)


@dataclass
class RowBound:
    """A row's bound tightened by whole layers (computed once, when first asked for), and its root bound."""

    batch: TpRowBatch
    row: int
    _value: float | None = None
    _bottleneck_s: float = 0.0

    def __call__(self) -> float:
        if self._value is None:
            batch, row = self.batch, self.row
            a, counts = batch.per_layer_s[row].tolist(), batch.counts[row].tolist()
            least = float(batch.least_bottleneck_s[row])
            self._bottleneck_s = max(least, whole_layer_bottleneck_s(a, counts, batch.num_layers))
            weight = batch.microbatches - 1 / batch.virtual_stages
            bound, v, num_layers = float(batch.bound_s[row]), batch.virtual_stages, batch.num_layers
            # the bottleneck of one split together with its fullest tail, or with its stage-time sum (each stage
            # holds at least v layers), in place of each at its own least split
            rates = batch.tail_per_layer_s[row].tolist()
            tail = float(batch.tail.tail_s[row])
            least_tail = max(tail, v * max(rates))
            bottleneck = self._bottleneck_s
            with_tail = least_bottleneck_and_tail_s(a, rates, counts, num_layers, weight, bottleneck, least_tail)
            stage_sum = least_stage_sum_s(a, counts, num_layers, v)  # as the row's bound took it
            with_sum = least_bottleneck_and_stage_sum_s(a, counts, num_layers, weight, v, bottleneck)
            raised = max(bottleneck * weight, with_tail - tail, with_sum - stage_sum / v) - least * weight
            self._value = bound + raised
        return self._value

    def root_s(self, memory: bool = False, steps: int = DEFAULT_OPTIONS.root_bound_steps) -> float:
        """The same for per-stage recompute plans too (MixedTail); with `memory`, also the bottleneck memory allows
        when every stage may recompute (TpRowBatch.per_stage_recompute_bottleneck_s, bisected `steps` times)."""
        self()
        batch, row = self.batch, self.row
        weight = batch.microbatches - 1 / batch.virtual_stages
        bottleneck = self._bottleneck_s
        if memory and batch.memory is not None:
            bottleneck = batch.per_stage_recompute_bottleneck_s(row, bottleneck, steps)
            if math.isinf(bottleneck):
                return math.inf
        bound, least = float(batch.bound_s[row]), float(batch.least_bottleneck_s[row])
        plain = float(batch.tail.root_s(row, bound, least, bottleneck, weight))
        # the same with the bottleneck and stage-time sum of one split (the row's per-layer times are the fastest
        # mode's for the plans only it covers): per fullest stage g in mode r, its time T_gr floors the bottleneck
        a, counts, v = batch.per_layer_s[row].tolist(), batch.counts[row].tolist(), batch.virtual_stages
        stage_sum = least_stage_sum_s(a, counts, batch.num_layers, v)
        floors = np.maximum(bottleneck, batch.tail.fullest_time_s[row])
        with_sum = {
            floor: least_bottleneck_and_stage_sum_s(a, counts, batch.num_layers, weight, v, floor)
            for floor in set(floors.tolist())
        }
        coupled = min(with_sum[f] + t for f, t in zip(floors.tolist(), batch.tail.fullest_tail_s[row].tolist()))
        together = bound - float(batch.tail.tail_s[row]) - weight * least - stage_sum / v + coupled
        return max(plain, together)


@dataclass(frozen=True)
class ReplicaRows:
    """The rows of a subset that are valid at one replica count."""

    replicas: int
    tps: np.ndarray
    counts: np.ndarray
    positions: np.ndarray


class SubsetRows:
    """The TP rows of one group subset (every TP choice of each group) and their cost tables, memoised."""

    def __init__(self, costs: _GroupCosts, subset: tuple[DeviceGroup, ...]) -> None:
        ctx = costs.ctx
        self.costs, self.subset = costs, subset
        for group in subset:
            costs.add(group)
        self.tp_lists = [tp_options(ctx, g) for g in subset]
        self.tp_rows = np.array(list(itertools.product(*self.tp_lists)), dtype=np.int64)
        ranges = [range(len(t)) for t in self.tp_lists]
        self.tp_positions = np.array(list(itertools.product(*ranges)), dtype=np.int64)
        self.columns = np.arange(len(subset))[None, :]
        self.devices = np.array([part_devices(g) for g in subset], dtype=np.int64)  # of one part (merged groups)
        self.parts = np.array([group_parts(g) for g in subset], dtype=np.int64)
        self.usable = np.array([usable_memory_bytes(ctx, g) for g in subset])
        # point-to-point links a pipeline over these groups may cross: inside each group (in-node or rail), and
        # between two groups; each crossing sends (micro-batch activations) / (the smaller TP of its two stages) bytes
        self.inside = [[ctx.in_node_link(g), ctx.rail_link(g)] for g in subset]
        self.across = [ctx.cross_group_link(g, h) for g, h in itertools.permutations(subset, 2)]
        self._tables: dict[tuple[int, Recompute], tuple[np.ndarray, ...]] = {}
        self._edge_bytes: dict[tuple[int, Recompute, int], tuple[np.ndarray, np.ndarray]] = {}
        self._tail_rates: dict[tuple[int, Recompute, int], np.ndarray] = {}

    def padded(self, value: Callable[[DeviceGroup, int], float]) -> np.ndarray:
        """(groups, TP options) of a per-group, per-TP value (NaN past a group's options)."""
        table = np.full((len(self.subset), max(len(t) for t in self.tp_lists)), np.nan)
        for j, (group, options) in enumerate(zip(self.subset, self.tp_lists)):
            table[j, : len(options)] = [value(group, t) for t in options]
        return table

    def tables(self, b: int, rc: Recompute) -> tuple[np.ndarray, ...]:
        """Per-layer time, activation bytes, embedding and LM-head time as (groups, TP options)."""
        if (b, rc) not in self._tables:
            costs = self.costs
            self._tables[b, rc] = (
                self.padded(lambda group, tp: costs.per_layer_s[(group.name, b, tp, rc)]),
                self.padded(lambda group, tp: costs.activation_bytes[(group.name, b, tp, rc)]),
                self.padded(lambda group, tp: costs.embedding_s[(group.name, b, tp)]),
                self.padded(lambda group, tp: costs.head_s[(group.name, b, tp)]),
            )
        return self._tables[b, rc]

    def edge_bytes(self, positions: np.ndarray, b: int, rc: Recompute, d: int) -> tuple[np.ndarray, np.ndarray]:
        """First / last stage bytes besides the layers, (rows, groups) for the rows' TP positions (those valid at d
        replicas)."""
        if (b, rc, d) not in self._edge_bytes:
            edge = self.costs.edge_bytes
            first = self.padded(lambda group, tp: edge(group, b, tp, rc, d, True))
            last = self.padded(lambda group, tp: edge(group, b, tp, rc, d, False))
            self._edge_bytes[b, rc, d] = first[self.columns, positions], last[self.columns, positions]
        return self._edge_bytes[b, rc, d]

    def tail_rates(self, b: int, rc: Recompute, d: int) -> np.ndarray:
        """The tail bound per layer (cost_model.tail_per_layer_lower_bound_s) as (groups, TP options)."""
        if (b, rc, d) not in self._tail_rates:
            tail = self.costs.tail_per_layer_s
            self._tail_rates[b, rc, d] = self.padded(lambda group, tp: tail(group, b, tp, rc, d))
        return self._tail_rates[b, rc, d]

    def _fastest_p2p_s(self, links: list[Link], size_bytes: np.ndarray) -> np.ndarray:
        """Per row: one point-to-point transfer of its crossing bytes over the fastest of these links."""
        return np.min([link.p2p_time_s(size_bytes) for link in links], axis=0) * self.costs.ctx.terms.network_scale

    def replica_rows(
        self, ctx: CostContext, options: SearchOptions, memory_bounds: bool, every_count: bool = False
    ) -> Iterator[ReplicaRows]:
        """The replica counts worth trying and the rows valid at each in `ctx` (its global batch): every group holds a
        stage, stages do not outnumber layers, the devices' memory holds the model's state (with memory bounds), and
        an uneven batch split only where one more replica would cost some group a stage. `every_count`: every such count
        the devices allow, whatever the batch (the family bound: a family's share is not known; a row at a count one
        more replica would not cost a stage is slower than that one's in every way: same stages, more micro-batches
        per replica, less optimizer sharding)."""
        training, model = ctx.training, ctx.model
        global_batch = training.global_batch_size
        if self.tp_rows.size == 0:  # a group whose nodes hold no TP degree at this CP degree: no stage, no plan
            return
        if every_count:
            replica_options = list(range(1, int(self.devices.min()) + 1))
        elif training.uneven_batch == "exhaustive":
            replica_options = replica_counts(
                global_batch, self.subset, self.tp_rows, options.uneven_max_stages_per_group, ctx.context_parallel
            )
        else:
            replica_options = divisors(global_batch)
        for replicas in replica_options:
            if self.devices.min() < replicas:
                break
            widths = self.tp_rows * ctx.context_parallel  # devices of one replica of a stage
            counts = self._stage_counts(replicas, widths, model.num_layers)
            total_state = model.total_params() * state_bytes_per_param(ctx, replicas)
            even = not every_count and global_batch % replicas == 0
            fewer = self._stage_counts(replicas + 1, widths, model.num_layers)
            worth = even or (fewer < counts).any(axis=1)
            valid = (
                worth
                & (counts.min(axis=1) >= 1)
                & (counts.sum(axis=1) <= model.num_layers)
                & (((counts * self.tp_rows * self.usable[None, :]).sum(axis=1) >= total_state) | (not memory_bounds))
            )
            if valid.any():
                yield ReplicaRows(replicas, self.tp_rows[valid], counts[valid], self.tp_positions[valid])

    def _stage_counts(self, replicas: int, widths: np.ndarray, num_layers: int) -> np.ndarray:
        """(rows, groups) stages per group: each group's devices in replicas of stages of these widths. A lone group
        with more such stages than the model has layers holds as many as there are layers (whole parts, for merged
        groups), its other devices idle: the only plans on it (33 nodes of 8 at TP 8 for 32 layers, one replica),
        where a pipeline over several groups leaves whole groups idle instead (another subset)."""
        counts = self.parts[None, :] * (self.devices[None, :] // (replicas * widths))
        if len(self.subset) == 1:
            counts = np.minimum(counts, num_layers // self.parts[0] * self.parts[0])
        return counts

    def _boundaries_s(self, b: int, tps: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per row: one direction of the fill and drain point-to-point at its least (every pipeline over the k
        groups crosses k - 1 group boundaries and counts_g - 1 inside each group g)."""
        ctx = self.costs.ctx
        activation_bytes = b * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes
        activation_bytes /= ctx.context_parallel
        # a group's stages sit together along the pipe: counts - 1 crossings between two of its stages, each over its
        # own links at its own TP; the crossings between groups at the row's largest TP over the fastest link
        boundaries_s = np.zeros(len(tps))
        for j, links in enumerate(self.inside):
            inside_s = self._fastest_p2p_s(links, activation_bytes / tps[:, j])
            boundaries_s += (counts[:, j] - 1) * inside_s
        if len(self.subset) > 1:
            across_s = self._fastest_p2p_s(self.across, activation_bytes / tps.max(axis=1))
            boundaries_s += (len(self.subset) - 1) * across_s
        return boundaries_s

    def least_bounds_s(
        self, replica_rows: Sequence[ReplicaRows], b: int, microbatches: Sequence[int], whole_layers: bool = True
    ) -> np.ndarray:
        """Per replica count: the least bound of its rows at micro-batch b over recompute modes and interleaving
        depths (inf: none), as `batches` computes them but vectorised over the replica counts, so the search can
        build a count's batches only when its rows' candidates can come up; `whole_layers`: tightened as RowBound
        tightens a row when it comes up (the key its candidates wait with)."""
        ctx = self.costs.ctx
        modes, num_layers, columns = list(ctx.training.recompute), ctx.model.num_layers, self.columns
        sizes = [len(rows.tps) for rows in replica_rows]
        tps = np.concatenate([rows.tps for rows in replica_rows])
        counts = np.concatenate([rows.counts for rows in replica_rows])
        positions = np.concatenate([rows.positions for rows in replica_rows])
        owner = np.repeat(np.arange(len(replica_rows)), sizes)
        m = np.repeat(np.asarray(microbatches, dtype=float), sizes)
        stages = counts.sum(axis=1)
        boundaries_s = self._boundaries_s(b, tps, counts)
        fullest = (-(-num_layers // stages))[:, None]
        least = np.full(len(replica_rows), np.inf)
        for rc in modes:
            a, _, e_first, e_last = (t[columns, positions] for t in self.tables(b, rc))
            rates = np.concatenate(
                [self.tail_rates(b, rc, rows.replicas)[columns, rows.positions] for rows in replica_rows]
            )
            tail_s = (fullest * rates).min(axis=1) + ctx.terms.iteration_overhead_s
            pipeline = PipelineBound.of(num_layers, a, e_first, e_last, counts)
            whole = np.zeros(len(counts))
            if whole_layers and len(counts) <= WHOLE_LAYER_ROWS:  # past that the bisection costs more than it saves
                whole = whole_layer_bottlenecks_s(a, counts, num_layers)
            for virtual in ctx.training.virtual_stages:
                found = pipeline.bound_s(m, virtual, tail_s, fill_and_drain_time_s(virtual, boundaries_s))  # type: ignore[arg-type]
                if found is not None:
                    bound, bottleneck = found
                    raised = np.maximum(0.0, whole - bottleneck) * (m - 1 / virtual)
                    np.minimum.at(least, owner, bound + raised)
        return least

    def batches(self, rows: ReplicaRows, b: int, microbatches: int, memory_bounds: bool) -> Iterator[TpRowBatch]:
        """The batches of these rows at micro-batch b, one per recompute mode and interleaving depth."""
        ctx = self.costs.ctx
        training, model, num_layers = ctx.training, ctx.model, ctx.model.num_layers
        modes = list(training.recompute)
        columns, positions, tps, d = self.columns, rows.positions, rows.tps, rows.replicas
        stages = rows.counts.sum(axis=1)
        boundaries_s = self._boundaries_s(b, tps, rows.counts)
        # every mode's per-layer time and activation, for the root bound of per-stage recompute plans
        mode_time = np.stack([self.tables(b, r)[0][columns, positions] for r in modes], axis=-1)
        mode_activation = np.stack([self.tables(b, r)[1][columns, positions] for r in modes], axis=-1)
        # the stage with the most layers holds >= ceil(L / p) and waits its tail after the pipeline: (rows, groups,
        # modes) its layer time and tail in every recompute mode (MixedTail)
        fullest = (-(-num_layers // stages))[:, None, None]
        fullest_time = fullest * mode_time
        fullest_tail = fullest * np.stack([self.tail_rates(b, r, d)[columns, positions] for r in modes], axis=-1)
        state_per_layer = model.layer_params() * state_bytes_per_param(ctx, d) / tps
        usable_rows = np.broadcast_to(self.usable[None, :], tps.shape)
        for rc in training.recompute:
            a, activation, e_first, e_last = (t[columns, positions] for t in self.tables(b, rc))
            tail_no_overhead = fullest_tail[:, :, modes.index(rc)].min(axis=1)
            tail_s = tail_no_overhead + ctx.terms.iteration_overhead_s
            tail = MixedTail(tail_no_overhead, fullest_time.reshape(len(tps), -1), fullest_tail.reshape(len(tps), -1))
            memory = None
            if memory_bounds:
                memory = RowMemory(
                    usable_rows, state_per_layer, activation, mode_time, mode_activation, self, positions, (b, rc, d)
                )
            pipeline = PipelineBound.of(num_layers, a, e_first, e_last, rows.counts)
            for virtual in training.virtual_stages:
                fill_and_drain = fill_and_drain_time_s(virtual, boundaries_s)
                found = pipeline.bound_s(microbatches, virtual, tail_s, fill_and_drain)
                if found is None:
                    continue
                bound, least_bottleneck = found
                yield TpRowBatch(
                    subset=self.subset,
                    replicas=d,
                    micro_batch_size=b,
                    recompute=rc,
                    virtual_stages=virtual,
                    microbatches=microbatches,
                    num_layers=num_layers,
                    tps=tps,
                    counts=rows.counts,
                    per_layer_s=a,
                    first_edge_s=e_first,
                    last_edge_s=e_last,
                    bound_s=bound,
                    least_bottleneck_s=least_bottleneck,
                    fill_and_drain_s=fill_and_drain,
                    tail=tail,
                    tail_per_layer_s=self.tail_rates(b, rc, d)[columns, positions],
                    memory=memory,
                )


class RowTables:
    """The TP rows of every group subset a context's searches have met, with their cost tables: what does not depend
    on the global batch, so the family search's blocks (the same groups at other shares of the batch), the yardsticks
    and the outer search share them."""

    def __init__(self, ctx: CostContext) -> None:
        self.ctx = ctx  # kept alive: the reuse key holds ids of its parts
        # group costs by name; another cluster's group of a known name (a re-plan's changed group) goes to the next
        self.costs: list[_GroupCosts] = []
        self.subsets: dict[tuple[DeviceGroup, ...], SubsetRows] = {}

    def subset_rows(self, subset: tuple[DeviceGroup, ...]) -> SubsetRows:
        """The rows of a subset (memoised)."""
        if subset not in self.subsets:
            costs = next((c for c in self.costs if all(c.knows(g) for g in subset)), None)
            if costs is None:
                costs = _GroupCosts(self.ctx)
                self.costs.append(costs)
            self.subsets[subset] = SubsetRows(costs, subset)
        return self.subsets[subset]


_REUSE: OrderedDict[tuple[object, ...], RowTables] = OrderedDict()
_REUSE_SIZE = 2  # contexts whose tables are kept (a plan's search with its families and yardsticks uses one)


def _reuse_key(ctx: CostContext) -> tuple[object, ...]:
    """What a context's row tables depend on besides its groups: the same cost sources, model, settings (all but the
    global batch, the families and the uneven-batch rule) and network."""
    training = ctx.training.model_dump_json(exclude={"global_batch_size", "families", "uneven_batch"})
    cluster = (ctx.cluster.topology, ctx.cluster.inter_group_bw_bytes_per_s)
    return (id(ctx.sources), id(ctx.model), id(ctx.links), ctx.terms, cluster, training, ctx.context_parallel)


def row_tables(ctx: CostContext) -> RowTables:
    """The row tables shared by the searches of contexts like this one (a small LRU kept per process)."""
    key = _reuse_key(ctx)
    if key in _REUSE:
        _REUSE.move_to_end(key)
        return _REUSE[key]
    _REUSE[key] = RowTables(ctx)
    while len(_REUSE) > _REUSE_SIZE:
        _REUSE.popitem(last=False)
    return _REUSE[key]
