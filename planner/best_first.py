"""Candidates best bound first: rows (TP choices of a batch) come up in the order of their bound; each row's pipeline
orders get their own bounds (whole layers, memory caps at each depth) and wait in a queue until no row left can go
below them. The search stops the generator once the next bound cannot beat its incumbent (Pruning)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planner.candidates import OuterConfig, group_orders, permutation_index
from planner.options import DEFAULT_OPTIONS, SearchOptions
from planner.tp_rows import RowBound, TpRowBatch, tp_row_batches
from predictor.cost_model import CostContext
from specs.cluster import DeviceGroup


@dataclass
class Pruning:
    """Shared by the search and the candidate generator: candidates whose bound reaches `limit_s` (the incumbent)
    are not generated. With `root_bound`, once the generator has run to its end `least_root_s` holds the least bound
    over all its candidates (bounds that hold for per-stage recompute plans too: see lower_bounds.MixedTail and
    TpRowBatch.per_stage_recompute_bottleneck_s); it costs about as much as the search on large clusters, so it is
    computed only when asked for."""

    limit_s: float = math.inf
    root_bound: bool = False
    least_root_s: float = math.inf


class _Queue:
    """The best-first order over the rows of some batches and the pipeline orders of the rows that came up."""

    def __init__(
        self, batches: list[TpRowBatch], options: SearchOptions, pruning: Pruning, memory_bounds: bool
    ) -> None:
        self.batches, self.options, self.pruning, self.memory_bounds = batches, options, pruning, memory_bounds
        sizes = [len(batch.bound_s) for batch in batches]
        self.bounds = np.concatenate([batch.bound_s for batch in batches])
        self.roots = np.concatenate([batch.root_s for batch in batches])
        self.batch_of = np.repeat(np.arange(len(batches)), sizes)
        self.row_of = np.concatenate([np.arange(n) for n in sizes])
        # (bound, arrival, a candidate or a row to expand into its orders): a row waits with its whole-layer bound
        # (its orders' bounds are at least that), so rows that cannot beat the final incumbent are never expanded
        self.queue: list[tuple[float, int, OuterConfig | int]] = []
        self.arrival = itertools.count()
        self.popped_roots: dict[int, float] = {}  # rows that came up: their root bound with whole layers

    def row_bound(self, index: int) -> RowBound:
        """The whole-layer bound of a row, by its position in the flattened rows."""
        return RowBound(self.batches[self.batch_of[index]], int(self.row_of[index]))

    def run(self) -> Iterator[OuterConfig]:
        """Every candidate that can beat the incumbent, best bound first (ties keep enumeration order)."""
        pruning = self.pruning
        for index in np.argsort(self.bounds, kind="stable"):
            bound = float(self.bounds[index])
            yield from self.ready(bound)
            if not math.isfinite(bound) or bound >= pruning.limit_s:
                break  # every later row, and every queued item, is bounded by this
            whole = self.row_bound(index)
            if pruning.root_bound:
                self.popped_roots[int(index)] = whole.root_s()
            if whole() < pruning.limit_s:
                # memory-free candidates (the misfit search) go in the order of their plain bound
                heapq.heappush(self.queue, (whole() if self.memory_bounds else bound, next(self.arrival), int(index)))
        else:
            yield from self.ready(math.inf)
        if pruning.root_bound:
            self.settle_root()

    def ready(self, below_s: float) -> Iterator[OuterConfig]:
        """The queued candidates whose bound is below `below_s`, best first, while they can beat the incumbent."""
        while self.queue and self.queue[0][0] <= below_s:
            key_s, _, item = heapq.heappop(self.queue)
            if key_s >= self.pruning.limit_s:
                self.queue.clear()  # the rest are no better
                return
            if isinstance(item, OuterConfig):
                yield item
            else:
                self.expand(item, key_s)

    def expand(self, index: int, whole_s: float) -> None:
        """Queue a row's pipeline orders that may fit memory, each with its own bound."""
        batch, row = self.batches[self.batch_of[index]], int(self.row_of[index])
        bound = float(self.bounds[index])
        possible = batch.possible_orders
        orders = group_orders(batch.subset)
        increase = None
        if possible is not None:  # per-order bounds only for the orders whose layer capacity may hold the model
            orders = [order for order in orders if possible[row, permutation_index(order)]]
            if not orders:
                return
            increase = batch.order_bound_increase_s(row, orders, self.options.order_bound_steps)
        for number, order in enumerate(orders):
            order_bound_s = max(bound + float(increase[number]), whole_s) if increase is not None else bound
            if order_bound_s < self.pruning.limit_s:
                config = batch.candidate(row, order, order_bound_s)
                heapq.heappush(self.queue, (order_bound_s, next(self.arrival), config))

    def settle_root(self) -> None:
        """The least root bound over every row: least first, each tightened by whole layers and then by the memory
        a per-stage recompute plan needs, until the least is one that cannot rise further."""
        values = self.roots.copy()
        for index, value in self.popped_roots.items():
            values[index] = value
        finite = np.flatnonzero(np.isfinite(values))
        heap = [(float(values[i]), int(i), 1 if int(i) in self.popped_roots else 0) for i in finite]
        heapq.heapify(heap)
        while heap:
            value, index, tightened = heapq.heappop(heap)
            if tightened == 2:
                self.pruning.least_root_s = min(self.pruning.least_root_s, value)
                return
            raised = self.row_bound(index).root_s(memory=tightened == 1, steps=self.options.root_bound_steps)
            if math.isfinite(raised):
                heapq.heappush(heap, (max(value, raised), index, tightened + 1))


def outer_configs(
    ctx: CostContext,
    options: SearchOptions = DEFAULT_OPTIONS,
    counter: list[int] | None = None,
    memory_bounds: bool = True,
    subsets: Sequence[tuple[DeviceGroup, ...]] | None = None,
    pruning: Pruning | None = None,
) -> Iterator[OuterConfig]:
    """Every candidate (all pipeline orders that may fit) on the given group subsets (default: all), best bound
    first. `counter`, when given, receives the number of candidates (rows that pass the memory lower bound, times
    their pipeline orders)."""
    batches = tp_row_batches(ctx, options, memory_bounds, subsets)
    if counter is not None:
        counter.append(int(sum(np.isfinite(b.bound_s).sum() * len(group_orders(b.subset)) for b in batches)))
    if batches:
        yield from _Queue(batches, options, pruning if pruning is not None else Pruning(), memory_bounds).run()
