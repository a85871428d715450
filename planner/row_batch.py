"""A batch of candidate rows (one group subset, replica count, micro-batch, recompute mode and interleaving depth;
one row per TP choice of the groups) with its bounds as arrays, and what a row works out when it comes up in the
search: its pipeline orders that may fit memory and their bounds (TpRowBatch.possible_orders_of,
order_bound_increase_s, least_order_increase_s), its bound tightened by whole layers and its root bound (RowBound).
planner.tp_rows builds the batches."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from planner.candidates import OuterConfig, group_orders
from planner.lower_bounds import (
    MixedTail,
    least_bottleneck_and_stage_sum_s,
    least_bottleneck_and_tail_s,
    least_stage_sum_s,
    memory_bottleneck_s,
    orders_within_memory,
    per_stage_memory_bottlenecks_s,
    whole_layer_bottleneck_s,
)
from planner.options import DEFAULT_OPTIONS
from predictor.cost_model import in_flight_table
from specs.cluster import DeviceGroup
from specs.model import Recompute


@dataclass(frozen=True, eq=False)
class RowMemory:
    """What the memory bounds of a batch's rows need ((rows, groups) arrays unless said otherwise). The first and last
    stages' fixed bytes cost stage_memory calls, so they are built only for the batches whose rows come up."""

    usable_bytes: np.ndarray
    state_per_layer_bytes: np.ndarray
    activation_bytes: np.ndarray  # per layer and micro-batch in flight, in the batch's mode
    mode_time_s: np.ndarray  # (rows, groups, modes): per-layer time in every recompute mode
    mode_activation_bytes: np.ndarray  # (rows, groups, modes)
    # the subset's fixed bytes of a group's stage if first, if last: (rows' TP positions, micro-batch, mode, replicas)
    # -> two (rows, groups) arrays (SubsetRows.edge_bytes)
    edge_bytes_of: Callable[[np.ndarray, int, Recompute, int], tuple[np.ndarray, np.ndarray]]
    positions: np.ndarray  # the rows' TP positions in the subset's options
    shape: tuple[int, Recompute, int]  # (micro-batch, mode, replicas)
    modes: Sequence[Recompute]  # the training's recompute modes

    @cached_property
    def edge_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Fixed bytes of each group's stage if first, if last (a lower bound: one micro-batch in flight)."""
        return self.edge_bytes_of(self.positions, *self.shape)

    @cached_property
    def least_first_bytes(self) -> np.ndarray:
        """The first stage's fixed bytes in the recompute mode that needs least (for per-stage recompute plans)."""
        b, _, d = self.shape
        return np.minimum.reduce([self.edge_bytes_of(self.positions, b, rc, d)[0] for rc in self.modes])


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
        known to be reached (lower_bounds.per_stage_memory_bottlenecks_s)."""
        return float(self.per_stage_recompute_bottlenecks_s(row, known_s, steps).min())

    def per_stage_recompute_bottlenecks_s(self, row: int, known_s: float, steps: int) -> np.ndarray:
        """per_stage_recompute_bottleneck_s of each pipeline order apart (candidates.group_orders' order)."""
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
        return per_stage_memory_bottlenecks_s(a, edge, caps, self.num_layers, self.virtual_stages, known_s, steps)


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

    def per_stage_order_bottlenecks_s(self, steps: int = DEFAULT_OPTIONS.root_bound_steps) -> np.ndarray:
        """Per pipeline order of the row's groups (candidates.group_orders), the least bottleneck a plan with a
        recompute mode per stage reaches there (inf: it cannot hold the model)."""
        self()
        return self.batch.per_stage_recompute_bottlenecks_s(self.row, self._bottleneck_s, steps)

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
