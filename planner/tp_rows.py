"""Candidates in batches, with their bounds as arrays: for one group subset, replica count, micro-batch, recompute mode
and interleaving depth, every TP choice of the groups is a row (TpRowBatch).

Rows that fail the structural checks or the memory lower bound (the devices' usable memory must hold the model's
state) are dropped; the rest get a lower bound on their iteration time and on any per-stage recompute plan of their
shape (planner.lower_bounds). What a row works out when it comes up in the search (its pipeline orders that may fit
memory and their bounds, its bound tightened by whole layers) is planner.row_batch's.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planner.candidates import (
    divisors,
    group_parts,
    part_devices,
    replica_counts,
    tp_options,
)
from planner.lower_bounds import (
    MixedTail,
    PipelineBound,
    row_min,
    row_sum,
    whole_layer_bottlenecks_s,
)
from planner.options import SearchOptions
from planner.row_batch import RowMemory, TpRowBatch
from predictor.comm_model import Link
from predictor.cost_model import (
    GRAD_BYTES_PER_PARAM,
    CostContext,
    decoder_layer_time_s,
    edge_time_s,
    fill_and_drain_time_s,
    least_sync_and_step_per_layer_s,
    stage_memory,
    state_bytes_per_param,
    tail_per_layer_lower_bound_s,
    usable_memory_bytes,
)
from specs.cluster import DeviceGroup
from specs.model import RECOMPUTE_MODES, Recompute

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
        """Bytes the first (or last) stage holds besides its layers; a lower bound: one micro-batch in flight, and not
        a tied model's copy of the embedding matrix (a last stage apart from the first holds one; a one-stage pipeline,
        whose stage holds both edges, does not). The last stage's do not depend on the recompute mode."""
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
            copy = 0.0
            if not first and self.ctx.model.tied_embeddings:
                matrix = self.ctx.model.vocab_size * self.ctx.model.hidden_size
                copy = matrix / t * state_bytes_per_param(self.ctx, d)
            self._edge_bytes[key] = memory.total_bytes - copy
        return self._edge_bytes[key]


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

    def tied_sync_least_s(self, tps: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per row: the least time a tied model's first and last stages spend summing the embedding matrix's gradient
        after the pipeline (cost_model.tied_embedding_sync_time_s), which the tail of either waits: none in one stage.
        Over several groups the two stages sit in two of them (a group's stages sit together), the larger shard being
        the narrower TP's: at least the row's second widest TP over the fastest link between groups; in one group
        (equal groups merged, too) over its fastest link."""
        ctx = self.costs.ctx
        if not ctx.model.tied_embeddings:
            return np.zeros(len(tps))
        matrix_bytes = ctx.model.vocab_size * ctx.model.hidden_size * GRAD_BYTES_PER_PARAM
        if len(self.subset) > 1:
            shard_bytes, links = matrix_bytes / np.sort(tps, axis=1)[:, -2], self.across
        else:
            group = self.subset[0]
            shard_bytes, links = matrix_bytes / tps[:, 0], [*self.inside[0], ctx.cross_group_link(group, group)]
        # an all-reduce over 2 ranks (comm_model.all_reduce_time_s): the shard once, two latencies
        least_s = np.min([shard_bytes * link.seconds_per_byte(2) + 2 * link.alpha_s for link in links], axis=0)
        return np.where(row_sum(counts) > 1, least_s * ctx.terms.network_scale, 0.0)

    def least_bounds_s(
        self, replica_rows: Sequence[ReplicaRows], b: int, microbatches: Sequence[int], whole_layer_steps: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per replica count: the least bound of its rows at micro-batch b over recompute modes and interleaving
        depths (inf: none), as `batches` computes them but vectorised over the replica counts, so the search can
        build a count's batches only when its rows' candidates can come up; tightened as RowBound tightens a row
        when it comes up (the key its candidates wait with) by a whole-layer bisection of `whole_layer_steps`
        (0: not tightened). Second, the same for their root bounds (TpRowBatch.root_s, RowBound.root_s), which hold
        for plans with a recompute mode per stage: the fastest mode's bound without the fullest stage's DP tail (such
        a plan may hide more of it)."""
        ctx = self.costs.ctx
        modes, num_layers, columns = list(ctx.training.recompute), ctx.model.num_layers, self.columns
        sizes = [len(rows.tps) for rows in replica_rows]
        tps = np.concatenate([rows.tps for rows in replica_rows])
        counts = np.concatenate([rows.counts for rows in replica_rows])
        positions = np.concatenate([rows.positions for rows in replica_rows])
        owner = np.repeat(np.arange(len(replica_rows)), sizes)
        m = np.repeat(np.asarray(microbatches, dtype=float), sizes)
        stages = row_sum(counts)
        boundaries_s = self._boundaries_s(b, tps, counts)
        tied_s = self.tied_sync_least_s(tps, counts)
        fullest = (-(-num_layers // stages))[:, None]
        least, least_root = np.full(len(replica_rows), np.inf), np.full(len(replica_rows), np.inf)
        fastest = min(modes, key=RECOMPUTE_MODES.index)
        # the tables' entries of every row as one flat gather (np.take): 3x faster than t[columns, positions]
        flat = columns * self.tables(b, modes[0])[0].shape[1] + positions
        starts = np.cumsum([0, *sizes])
        for rc in modes:
            a, _, e_first, e_last = (np.take(t, flat) for t in self.tables(b, rc))
            rates = np.concatenate(
                [
                    np.take(self.tail_rates(b, rc, rows.replicas), flat[start:end])
                    for rows, start, end in zip(replica_rows, starts[:-1], starts[1:])
                ]
            )
            tail_no_overhead = np.maximum(row_min(fullest * rates), tied_s)
            tail_s = tail_no_overhead + ctx.terms.iteration_overhead_s
            pipeline = PipelineBound.of(num_layers, a, e_first, e_last, counts)
            whole = np.zeros(len(counts))
            # past WHOLE_LAYER_ROWS rows the bisection costs more than it saves
            if whole_layer_steps and len(counts) <= WHOLE_LAYER_ROWS:
                whole = whole_layer_bottlenecks_s(a, counts, num_layers, whole_layer_steps)
            for virtual in ctx.training.virtual_stages:
                found = pipeline.bound_s(m, virtual, tail_s, fill_and_drain_time_s(virtual, boundaries_s))  # type: ignore[arg-type]
                if found is not None:
                    bound, bottleneck = found
                    raised = np.maximum(0.0, whole - bottleneck) * (m - 1 / virtual)
                    np.minimum.at(least, owner, bound + raised)
                    if rc == fastest:
                        np.minimum.at(least_root, owner, bound + raised - tail_no_overhead)
        return least, least_root

    def batches(
        self, rows: ReplicaRows, b: int, microbatches: int, memory_bounds: bool, groups_of_stages: bool = False
    ) -> Iterator[TpRowBatch]:
        """The batches of these rows at micro-batch b, one per recompute mode and interleaving depth (interleaved rows
        of fewer micro-batches than stages left out where `groups_of_stages`: PipelineBound.bound_s)."""
        ctx = self.costs.ctx
        training, model, num_layers = ctx.training, ctx.model, ctx.model.num_layers
        modes = list(training.recompute)
        columns, positions, tps, d = self.columns, rows.positions, rows.tps, rows.replicas
        stages = rows.counts.sum(axis=1)
        boundaries_s = self._boundaries_s(b, tps, rows.counts)
        tied_s = self.tied_sync_least_s(tps, rows.counts)
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
            tail_no_overhead = np.maximum(fullest_tail[:, :, modes.index(rc)].min(axis=1), tied_s)
            tail_s = tail_no_overhead + ctx.terms.iteration_overhead_s
            tail = MixedTail(tail_no_overhead, fullest_time.reshape(len(tps), -1), fullest_tail.reshape(len(tps), -1))
            memory = None
            if memory_bounds:
                memory = RowMemory(
                    usable_rows,
                    state_per_layer,
                    activation,
                    mode_time,
                    mode_activation,
                    self.edge_bytes,
                    positions,
                    (b, rc, d),
                    modes,
                )
            pipeline = PipelineBound.of(num_layers, a, e_first, e_last, rows.counts)
            for virtual in training.virtual_stages:
                fill_and_drain = fill_and_drain_time_s(virtual, boundaries_s)
                found = pipeline.bound_s(microbatches, virtual, tail_s, fill_and_drain, groups_of_stages)
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
