"""Candidates best bound first: rows (TP choices of a batch) come up in the order of their bound; each row's pipeline
orders get their own bounds (whole layers, memory caps at each depth) and wait in a queue until no row left can go
below them. The search stops the generator once the next bound cannot beat its incumbent (Pruning)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planner.candidates import PER_STAGE, OuterConfig, group_order_array, group_orders, group_subsets
from planner.options import DEFAULT_OPTIONS, SearchOptions
from planner.row_batch import RowBound, TpRowBatch
from planner.tp_rows import ReplicaRows, SubsetRows, row_tables
from predictor.cost_model import CostContext
from specs.cluster import DeviceGroup
from specs.layout import split_batch
from specs.model import RECOMPUTE_MODES


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


# a row waiting in the queue: (its batch's position among the batches built, the row)
_Row = tuple[int, int]


@dataclass(frozen=True, eq=False)
class _Orders:
    """A row's pipeline orders that may fit, in the order they come up: by bound, then by enumeration."""

    batch: TpRowBatch
    row: int
    orders: Sequence[tuple[int, ...]]
    numbers: np.ndarray  # the orders that may fit (their places in `orders`)
    keys: np.ndarray  # their bounds
    sequence: np.ndarray  # positions in numbers / keys, best first
    base: int  # the row's first place in the queue's tie order


class _Queue:
    """The best-first order over the rows of some batch sources and the pipeline orders of the rows that came up.
    A source's batches are built when the next row's bound reaches the source's own bound (rows come up in the order
    they would if every batch were built first; a source whose bound reaches the incumbent is never built)."""

    def __init__(
        self, sources: list[BatchSource], options: SearchOptions, pruning: Pruning, memory_bounds: bool
    ) -> None:
        self.sources, self.options, self.pruning, self.memory_bounds = sources, options, pruning, memory_bounds
        self.batches: list[TpRowBatch] = []
        self.rank: list[tuple[int, int]] = []  # per batch built: (its source, its place there): today's tie order
        self.unbuilt = [(source.least_s, index) for index, source in enumerate(sources)]
        heapq.heapify(self.unbuilt)
        # per batch built, its next row in bound order: (bound, rank, row, batch, position in the order)
        self.cursors: list[tuple[float, tuple[int, int], int, int, int]] = []
        self.row_orders: list[np.ndarray] = []
        # (bound, arrival, a candidate or a row to expand into its orders): a row waits with its whole-layer bound,
        # then again with the least memory bound over its orders (its orders' bounds are at least both), so rows that
        # cannot beat the final incumbent are never expanded
        self.queue: list[tuple[float, int, tuple[_Orders, int] | _Row]] = []
        self.arrival = 0  # the tie order of queued items (each row reserves one place per order)
        self.popped_roots: dict[_Row, float] = {}  # rows that came up: their root bound with whole layers
        self.raised_rows: set[_Row] = set()  # rows queued again with the least memory bound over their orders
        if pruning.root_bound:  # the root bound needs every row
            self.unbuilt.clear()
            for index in range(len(sources)):
                self.build(index)

    def build(self, source: int) -> None:
        """Build a source's batches and put each batch's best row in line."""
        for place, batch in enumerate(self.sources[source].build(self.memory_bounds)):
            index = len(self.batches)
            self.batches.append(batch)
            self.rank.append((source, place))
            order = np.argsort(batch.bound_s, kind="stable")
            self.row_orders.append(order)
            self.advance(index, 0)

    def advance(self, index: int, position: int) -> None:
        """Put the batch's row at this position of its bound order in line (none past its last finite bound)."""
        order = self.row_orders[index]
        if position < len(order):
            row = int(order[position])
            bound = float(self.batches[index].bound_s[row])
            if math.isfinite(bound):
                heapq.heappush(self.cursors, (bound, self.rank[index], row, index, position))

    def next_row(self) -> tuple[float, int, int] | None:
        """The next row in bound order (bound, batch, row), building the sources that may hold one before it."""
        while self.unbuilt:
            least_s = self.unbuilt[0][0]
            if least_s >= self.pruning.limit_s:
                self.unbuilt.clear()  # no row of these can beat the incumbent, now or later
                break
            if self.cursors and self.cursors[0][0] < least_s:
                break
            self.build(heapq.heappop(self.unbuilt)[1])
        if not self.cursors:
            return None
        bound, _, row, index, position = heapq.heappop(self.cursors)
        self.advance(index, position + 1)
        return bound, index, row

    def row_bound(self, item: _Row) -> RowBound:
        """The whole-layer bound of a row."""
        return RowBound(self.batches[item[0]], item[1])

    def run(self) -> Iterator[OuterConfig]:
        """Every candidate that can beat the incumbent, best bound first (ties keep enumeration order)."""
        pruning = self.pruning
        while (found := self.next_row()) is not None:
            bound, index, row = found
            yield from self.ready(bound)
            if bound >= pruning.limit_s:
                break  # every later row, and every queued item, is bounded by this
            whole = self.row_bound((index, row))
            if pruning.root_bound:
                self.popped_roots[(index, row)] = whole.root_s()
            if whole() < pruning.limit_s:
                # memory-free candidates (the misfit search) go in the order of their plain bound
                key = whole() if self.memory_bounds else bound
                heapq.heappush(self.queue, (key, self.arrival, (index, row)))
                self.arrival += 1
        else:
            yield from self.ready(math.inf)
        if pruning.root_bound:
            self.settle_root()

    def ready(self, below_s: float) -> Iterator[OuterConfig]:
        """The queued candidates whose bound is below `below_s`, best first, while they can beat the incumbent."""
        while self.queue and self.queue[0][0] <= below_s:
            key_s, arrival, item = heapq.heappop(self.queue)
            if key_s >= self.pruning.limit_s:
                self.queue.clear()  # the rest are no better
                return
            if isinstance(item[0], _Orders):
                line, position = item
                at = int(line.sequence[position])
                self.push_next(line, position + 1)
                yield line.batch.candidate(line.row, line.orders[int(line.numbers[at])], key_s)
            elif self.memory_bounds and item not in self.raised_rows:
                # first up: the row waits again with the least memory bound over its orders, if that is higher (on
                # many device kinds most rows are raised past the final incumbent by it and never expand into k!
                # orders)
                self.raised_rows.add(item)  # type: ignore[arg-type]
                batch, row = self.batches[item[0]], item[1]  # type: ignore[index]
                memory_s = float(batch.bound_s[row]) + batch.least_order_increase_s(row, self.options.order_bound_steps)
                if memory_s < self.pruning.limit_s:  # else no order of it fits, or none can beat the incumbent
                    heapq.heappush(self.queue, (max(key_s, memory_s), arrival, item))
            else:
                self.expand(item, key_s)  # type: ignore[arg-type]

    def expand(self, item: _Row, floor_s: float) -> None:
        """Queue a row's pipeline orders that may fit memory, each with its own bound (at least `floor_s`, the key
        the row came up with): the best first, each next one when the one before comes up (the queue never holds a
        row's k! orders at once)."""
        batch, row = self.batches[item[0]], item[1]
        bound = float(batch.bound_s[row])
        orders = group_orders(batch.subset)
        base = self.arrival
        self.arrival += len(orders)  # the orders' places in the tie order, as if all were queued now
        if batch.memory is None:
            keys = np.full(len(orders), bound)
            numbers = np.arange(len(orders))
        else:  # per-order bounds only for the orders whose layer capacity may hold the model
            order_array = group_order_array(batch.subset)
            numbers = np.flatnonzero(batch.possible_orders_of(row, order_array))
            if not len(numbers):
                return
            increase = batch.order_bound_increase_s(row, order_array[numbers], self.options.order_bound_steps)
            keys = np.maximum(bound + increase, floor_s)
        line = _Orders(batch, row, orders, numbers, keys, np.lexsort((numbers, keys)), base)
        self.push_next(line, 0)

    def push_next(self, line: _Orders, position: int) -> None:
        """Queue the order at this position of a row's line (none past the incumbent)."""
        if position < len(line.sequence):
            at = int(line.sequence[position])
            key_s = float(line.keys[at])
            if key_s < self.pruning.limit_s:
                heapq.heappush(self.queue, (key_s, line.base + int(line.numbers[at]), (line, position)))

    def settle_root(self) -> None:
        """The least root bound over every row: least first, each tightened by whole layers and then by the memory
        a per-stage recompute plan needs, until the least is one that cannot rise further."""
        heap = [
            (
                self.popped_roots.get((index, row), float(batch.root_s[row])),
                index,
                row,
                int((index, row) in self.popped_roots),
            )
            for index, batch in enumerate(self.batches)
            for row in np.flatnonzero(np.isfinite(batch.root_s)).tolist()
        ]
        heapq.heapify(heap)
        while heap:
            value, index, row, tightened = heapq.heappop(heap)
            if tightened == 2:
                self.pruning.least_root_s = min(self.pruning.least_root_s, value)
                return
            raised = self.row_bound((index, row)).root_s(memory=tightened == 1, steps=self.options.root_bound_steps)
            if math.isfinite(raised):
                heapq.heappush(heap, (max(value, raised), index, row, tightened + 1))


@dataclass(frozen=True, eq=False)
class BatchSource:
    """The batches of one group subset, replica count and micro-batch (every recompute mode and interleaving depth),
    not built until the search reaches `least_s`: a bound on every row's bound_s in them (not on their root bounds:
    a plan with a recompute mode per stage may hide more DP sync; `least_root_s` bounds those), so the search builds
    only the batches that can hold a candidate beating its incumbent."""

    rows: SubsetRows
    replica_rows: ReplicaRows
    micro_batch_size: int
    microbatches: int
    least_s: float
    candidates: int  # rows times their pipeline orders, over the batches (SearchResult.configurations)
    least_root_s: float = 0.0  # a bound on the root bounds of its fastest mode's rows (SubsetRows.least_bounds_s)
    groups_of_stages: bool = False  # SearchOptions.interleaving_groups_of_stages

    def build(self, memory_bounds: bool) -> list[TpRowBatch]:
        """The batches, one per recompute mode and interleaving depth that some row allows."""
        rows, b, m = self.replica_rows, self.micro_batch_size, self.microbatches
        return list(self.rows.batches(rows, b, m, memory_bounds, self.groups_of_stages))


def _candidate_count(ctx: CostContext, replica_rows: ReplicaRows, orders: int) -> int:
    """Candidates of these rows over recompute modes and interleaving depths (rows whose stages can hold v chunks)."""
    stages = replica_rows.counts.sum(axis=1)
    layers = ctx.model.num_layers
    allowed = sum(int(((stages * v <= layers) & ((v == 1) | (stages > 1))).sum()) for v in ctx.training.virtual_stages)
    return allowed * len(ctx.training.recompute) * orders


def tp_row_sources(
    ctx: CostContext,
    options: SearchOptions,
    memory_bounds: bool = True,
    subsets: Sequence[tuple[DeviceGroup, ...]] | None = None,
) -> list[BatchSource]:
    """The structurally valid candidates on the given group subsets (default: every subset) that pass the memory
    lower bound (unless `memory_bounds` is off), as batch sources in enumeration order."""
    tables = row_tables(ctx)
    training = ctx.training
    groups = ctx.cluster.groups
    if subsets is None:
        subsets = group_subsets(groups, range(1, len(groups) + 1))
    sources: list[BatchSource] = []
    for subset in subsets:
        source = tables.subset_rows(subset)
        if source.tp_rows.size == 0:
            continue
        orders = len(group_orders(subset))
        replica_rows = list(source.replica_rows(ctx, options, memory_bounds))
        found: list[tuple[int, int, int, int]] = []  # (replica rows, micro-batch, micro-batches, position)
        least: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per micro-batch: (bounds, root bounds)
        for b in training.micro_batch_sizes:
            splits = [
                (i, split_batch(training.global_batch_size, rows.replicas, b)) for i, rows in enumerate(replica_rows)
            ]
            valid = [(i, split[0]) for i, split in splits if split is not None]
            if valid:
                chosen = [replica_rows[i] for i, _ in valid]
                steps = options.whole_layer_steps if memory_bounds else 0
                least[b] = source.least_bounds_s(chosen, b, [q for _, q in valid], steps)
                found += [(i, b, q, position) for position, (i, q) in enumerate(valid)]
        found.sort(key=lambda item: (item[0], training.micro_batch_sizes.index(item[1])))  # enumeration order
        for i, b, q, position in found:
            rows = replica_rows[i]
            # a hair below: the vectorised bound may round above the batch's own
            least_s, least_root_s = (float(bounds[position]) * (1 - 1e-9) for bounds in least[b])
            count = _candidate_count(ctx, rows, orders)
            groups_of_stages = options.interleaving_groups_of_stages
            sources.append(BatchSource(source, rows, b, q, least_s, count, least_root_s, groups_of_stages))
    return sources


def tp_row_batches(
    ctx: CostContext,
    options: SearchOptions,
    memory_bounds: bool = True,
    subsets: Sequence[tuple[DeviceGroup, ...]] | None = None,
) -> list[TpRowBatch]:
    """Every batch of tp_row_sources, built."""
    return [
        batch
        for source in tp_row_sources(ctx, options, memory_bounds, subsets)
        for batch in source.build(memory_bounds)
    ]


def outer_configs(
    ctx: CostContext,
    options: SearchOptions = DEFAULT_OPTIONS,
    counter: list[int] | None = None,
    memory_bounds: bool = True,
    subsets: Sequence[tuple[DeviceGroup, ...]] | None = None,
    pruning: Pruning | None = None,
    sources: list[BatchSource] | None = None,
) -> Iterator[OuterConfig]:
    """Every candidate (all pipeline orders that may fit) on the given group subsets (default: all), best bound
    first. `counter`, when given, receives the number of candidates (rows that pass the memory lower bound, times
    their pipeline orders). `sources`: tp_row_sources of these subsets, when the caller has them."""
    if sources is None:
        sources = tp_row_sources(ctx, options, memory_bounds, subsets)
    if counter is not None:
        counter.append(sum(source.candidates for source in sources))
    if sources:
        yield from _Queue(sources, options, pruning if pruning is not None else Pruning(), memory_bounds).run()


def per_stage_configs(
    ctx: CostContext, options: SearchOptions, pruning: Pruning, sources: Sequence[BatchSource]
) -> Iterator[list[OuterConfig]]:
    """Shapes whose stages each pick their recompute mode (recompute PER_STAGE), best bound first while it can beat
    `pruning.limit_s`, each as its candidates: the pipeline orders that can hold the model, least bottleneck first
    (at most options.per_stage_orders). The bound holds for such plans (the fastest mode's TpRowBatch.root_s,
    tightened by whole layers and then by the memory a per-stage plan needs), so the shapes include those whose
    every uniform plan the scan's per-mode bounds put past the incumbent (no single mode both fits and wins). Stops
    after options.per_stage_tightenings bounds tightened. `sources`: the scan's (a source is built when the heap
    reaches its least root bound)."""
    fastest = min(ctx.training.recompute, key=RECOMPUTE_MODES.index)  # recompute never makes a layer faster
    unbuilt = [(source.least_root_s, index) for index, source in enumerate(sources)]
    heapq.heapify(unbuilt)
    heap: list[tuple[float, int, int, RowBound]] = []  # (bound, times tightened, arrival, row)
    arrivals = itertools.count()
    tightenings = 0
    while True:
        while unbuilt and unbuilt[0][0] < pruning.limit_s and (not heap or unbuilt[0][0] <= heap[0][0]):
            for batch in sources[heapq.heappop(unbuilt)[1]].build(True):
                if batch.recompute == fastest:
                    for row in np.flatnonzero(batch.root_s < pruning.limit_s).tolist():
                        heapq.heappush(heap, (float(batch.root_s[row]), 0, next(arrivals), RowBound(batch, row)))
        if not heap or heap[0][0] >= pruning.limit_s:
            return
        bound, tightened, arrival, row_bound = heapq.heappop(heap)
        if tightened < 2:
            if tightenings == options.per_stage_tightenings:
                continue  # the budget is spent: only the shapes tightened already are left to yield
            tightenings += 1
            raised = row_bound.root_s(memory=tightened == 1, steps=options.root_bound_steps)
            if raised < pruning.limit_s:
                heapq.heappush(heap, (max(bound, raised), tightened + 1, arrival, row_bound))
            continue
        batch, row = row_bound.batch, row_bound.row
        bottlenecks = row_bound.per_stage_order_bottlenecks_s(options.root_bound_steps)
        orders = group_orders(batch.subset)
        fitting = [i for i in np.argsort(bottlenecks, kind="stable").tolist() if math.isfinite(bottlenecks[i])]
        yield [
            dataclasses.replace(batch.candidate(row, orders[i], bound), recompute=PER_STAGE)
            for i in fitting[: options.per_stage_orders]
        ]
