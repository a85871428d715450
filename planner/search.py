"""Search the three-level tree: pipeline order and stages per group, DP replicas, TP per group, micro-batch,
recompute; the exact layer split inside (planner.layer_split).

Best-first branch and bound: every outer configuration gets a lower bound on its iteration time (vectorised over
TP choices: planner.tp_rows), tightened by whole layers and then, per pipeline order, by memory as it comes up
(planner.best_first); configurations are evaluated best bound first (planner.solve), and the search stops once the
next bound cannot beat the k-th best plan found. Groups with identical devices and node shapes are interchangeable,
so orders that only swap them are skipped. On request it also proves a lower bound over the whole space (the root
bound, valid for per-stage recompute plans too: lower_bounds.MixedTail). After the scan, the best candidates are
tried again at uneven replica counts (`uneven_batch: refine`) and with a recompute mode per stage, and so are the
shapes with the best bound for per-stage plans (best_first.per_stage_configs): the scan's per-mode bounds pass by a
shape whose every uniform plan loses.

The ZeRO stage is not branched on: under the cost model stage 1 weakly dominates stage 0 (optimizer state divided by
the DP degree; DP traffic of a reduce-scatter of 4-byte gradients plus an all-gather of 16-bit weights, 6 bytes per
parameter against the all-reduce's 8, equal for fp32 weights; the optimizer step on 1/dp of the parameters), so the
training's stage (1 unless pinned) is the best choice for every candidate. Several pipeline families of different
device mixes: planner.families (`families: search`, or `auto` on two groups).

Many groups: batches of rows are built only when the best-first order reaches their least bound, and a row's pipeline
orders only when it comes up, one at a time; where identical groups make the space too large they plan as one group
(_merged_search); more than MAX_KINDS kinds are refused in one line; the scan stops after options.max_candidates
candidates and says how far the plan can be from the best (SearchResult.note).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.best_first import BatchSource, Pruning, outer_configs, per_stage_configs, tp_row_sources
from planner.candidates import (
    PER_STAGE,
    OuterConfig,
    group_subsets,
    identical_classes,
    merged_parts,
    part_devices,
    search_size,
    stage_count,
)
from planner.families import family_bound_s, family_search
from planner.layer_split import LayerSplitter
from planner.lower_bounds import work_bound_s
from planner.options import DEFAULT_OPTIONS, ProgressCallback, SearchOptions
from planner.solve import StageTerms, candidate_strategy, closest_misfit
from planner.yardsticks import compute_bound_tokens_per_s
from predictor.cost_model import CostContext, Evaluation, evaluate
from specs.cluster import DeviceGroup
from specs.errors import SpecError
from specs.layout import Strategy, pack_stages, split_batch

__all__ = ["BlockScans", "ProgressCallback", "SearchOptions", "SearchResult", "fastest", "search", "searches_families"]


@dataclass
class SearchResult:
    evaluations: list[Evaluation]  # best first
    configurations: int
    evaluated: int
    memory_infeasible: int
    # where nothing fits: finds the candidate needing the least extra memory per device (bytes, its description),
    # asked for only when the whole plan fails: a search over every ZeRO stage, CP degree and family partition has
    # many sub-searches where nothing fits, and finding their closest misfits took a third of its time
    find_misfit: Callable[[], tuple[float, str]] | None
    # smallest lower bound over the whole search space (the root relaxation; only when asked: options.root_bound)
    lower_bound_s: float | None = None
    per_stage_recompute_solved: int = 0  # candidates re-solved with a recompute mode per stage
    family_partitions: int = 0  # partitions of the groups into pipeline families tried (`families: search`)
    note: str = ""  # one line on what the search did not cover (merged groups, a candidate budget), if anything

    @functools.cached_property
    def closest_misfit(self) -> tuple[float, str]:
        """(extra bytes per device, description) of the closest misfit; (0, "") when there is none to name."""
        return self.find_misfit() if self.find_misfit is not None else (0.0, "")

    @property
    def smallest_shortfall_bytes(self) -> float:
        return self.closest_misfit[0]

    @property
    def smallest_shortfall_where(self) -> str:
        return self.closest_misfit[1]


def merge_results(
    results: Sequence[SearchResult], top_k: int, keep: Callable[[Evaluation], bool] = lambda _: True
) -> SearchResult:
    """Several searches of one problem as one (per TP degree, per ZeRO stage): the kept plans best first (earlier
    searches win ties), the counts summed, the closest misfit, a root bound only when every search proved one."""
    plans = {id(e): e for result in results for e in result.evaluations if keep(e)}
    ranked = sorted(plans.values(), key=lambda e: e.iteration_time_s)  # stable: ties keep the searches' order

    def closest() -> tuple[float, str]:
        misfits = [r.closest_misfit for r in results if r.find_misfit is not None]
        named = [misfit for misfit in misfits if misfit[1]]
        return min(named, key=lambda misfit: misfit[0]) if named else (0.0, "")

    bounds = [r.lower_bound_s for r in results if r.lower_bound_s is not None]
    return SearchResult(
        ranked[:top_k],
        sum(r.configurations for r in results),
        sum(r.evaluated for r in results),
        sum(r.memory_infeasible for r in results),
        closest,
        min(bounds) if bounds and len(bounds) == len(results) else None,
        sum(r.per_stage_recompute_solved for r in results),
        sum(r.family_partitions for r in results),
        "; ".join(dict.fromkeys(r.note for r in results if r.note)),
    )


class _Best:
    """The k fastest fitting evaluations so far: a max-heap on iteration time (earlier candidates win ties)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._heap: list[tuple[float, int, int, Evaluation]] = []
        self._kept = 0  # entries so far: the last tie-break (a refined candidate shares its source's place)

    def keep(self, evaluation: Evaluation, order: int) -> None:
        """Keep an evaluation if it is among the k fastest; `order`: its place in the enumeration (for ties)."""
        self._kept += 1
        entry = (-evaluation.iteration_time_s, -order, -self._kept, evaluation)
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, entry)
        elif entry[0] > self._heap[0][0]:
            heapq.heapreplace(self._heap, entry)

    def copy(self) -> _Best:
        """Another incumbent set holding the same evaluations (to go on from the same point)."""
        other = _Best(self.k)
        other._heap, other._kept = list(self._heap), self._kept
        return other

    def kth_s(self, gap: float = 0.0) -> float:
        """The k-th best iteration time, less the gap a candidate must beat it by (inf until k plans are kept)."""
        return -self._heap[0][0] * (1 - gap) if len(self._heap) == self.k else math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def ranked(self) -> list[Evaluation]:
        """The evaluations kept, fastest first."""
        return [e for *_, e in sorted(self._heap, key=lambda item: (-item[0], -item[1], -item[2]))]


# a fitting candidate: (iteration time, enumeration order, the candidate, its pipeline objective)
_Tried = tuple[float, int, OuterConfig, float]


class _Search:
    """One search's state: the incumbents, the candidates tried and the counts SearchResult reports."""

    def __init__(
        self,
        ctx: CostContext,
        options: SearchOptions,
        progress: ProgressCallback | None,
        splitter: LayerSplitter | None,
        warm_start: Sequence[Evaluation],
        block_scans: BlockScans | None = None,
    ) -> None:
        self.ctx, self.options, self.progress, self.splitter = ctx, options, progress, splitter
        self.block_scans = block_scans
        self.best = _Best(options.top_k)
        for position, evaluation in enumerate(warm_start):
            if evaluation.fits:
                self.best.keep(evaluation, -1 - position)
        self.terms = StageTerms(ctx)
        self.pruning = Pruning(self.best.kth_s(options.gap), options.root_bound)
        self.tried: list[_Tried] = []
        self.candidates: list[int] = []  # per scan: candidates generated
        self.scanned = self.evaluated = self.infeasible = 0
        self.stopped_s = math.inf  # the least bound left where options.max_candidates stopped the scan over every group
        # the subsets that leave a group idle, searched after it with a budget of their own: the candidates they took
        # (None: no such subset could beat the incumbent), the least bound left among them (inf: searched to the end)
        self.idle_candidates: int | None = None
        self.idle_bound_s = math.inf
        self.sources: list[BatchSource] = []  # of the group subsets scanned (the others cannot beat the plan)

    def run(self) -> SearchResult:
        """The scans, then the refinement steps and the family search, then the closest misfit if nothing fits."""
        ctx, options = self.ctx, self.options
        root_bound_s = self.scan_all()
        if self.progress is not None:
            self.progress(self.scanned, self.scanned)
        if self.splitter is None and ctx.training.uneven_batch == "refine":
            self.evaluated += self.refine_uneven()
        refined = 0
        if self.splitter is None and options.per_stage_candidates and len(ctx.training.recompute) > 1:
            refined = self.refine_per_stage()
        partitions = 0
        if self.splitter is None and searches_families(ctx):
            partitions, families_bound_s = self.add_families()
            root_bound_s = min(root_bound_s, families_bound_s)
        find_misfit = None if self.best else functools.partial(closest_misfit, ctx, options, self.terms)
        note = ""
        # a bound left that reaches the incumbent (a later scan, the refinements or the families found a plan at
        # least as fast) leaves nothing unproven there
        incumbent_s = self.best.kth_s(options.gap)
        ranked = self.best.ranked()
        # a scan its budget stopped has no root bound over what it left: the bound where it stopped stands in (for
        # the uniform plans), and no bound is above the best plan found (a refinement's may be below where it stopped)
        root_bound_s = min(root_bound_s, self.stopped_s, self.idle_bound_s, *(e.iteration_time_s for e in ranked[:1]))
        every_group_s = self.stopped_s if self.stopped_s < incumbent_s else math.inf
        idle_s = self.idle_bound_s if self.idle_bound_s < incumbent_s else math.inf
        if math.isfinite(min(every_group_s, idle_s)):
            least_s = min(every_group_s, idle_s)
            note = (
                f"stopped after {options.max_candidates:,} candidates: no plan left is faster than "
                f"{_bound_text(least_s, ranked)}"
            )
            if self.idle_candidates is not None:  # the two scans stop apart: say where each did
                every_group = _bound_text(every_group_s, ranked, "") if math.isfinite(every_group_s) else _TO_THE_END
                idle = _TO_THE_END
                if math.isfinite(idle_s):
                    idle = f"stopped after {self.idle_candidates:,} more at {_bound_text(idle_s, ranked, '')}"
                note += f" (pipelines over every group: {every_group}; plans leaving a group idle: {idle})"
            note += " (a larger --max-candidates searches on)"
        return SearchResult(
            self.best.ranked(),
            sum(self.candidates),
            self.evaluated,
            self.infeasible,
            find_misfit,
            root_bound_s if options.root_bound or note else None,
            refined,
            partitions,
            note,
        )

    def scan_all(self) -> float:
        """Pipelines over every group first; then the smaller subsets whose work bound can still beat the incumbent
        (most cannot: fewer devices do the same work), each in best-bound order. Returns the root bound: the least
        over the candidates generated and the work bounds of the subsets skipped."""
        groups = tuple(self.ctx.cluster.groups)
        self.scan([groups])
        root_bound_s = math.inf
        if not self.options.every_group:
            smaller = group_subsets(groups, range(1, len(groups)))
            incumbent_s = self.best.kth_s(self.options.gap)
            bounds = {s: work_bound_s(self.ctx, s) for s in smaller}
            idle = [s for s in smaller if bounds[s] < incumbent_s]
            if idle:  # with a budget of their own, whether or not the scan over every group used up its
                every_group_s, self.stopped_s, before = self.stopped_s, math.inf, self.evaluated
                self.scan(idle, before + self.options.max_candidates)
                self.idle_bound_s, self.stopped_s = self.stopped_s, every_group_s
                self.idle_candidates = self.evaluated - before
            root_bound_s = min([root_bound_s, *(b for b in bounds.values() if b >= incumbent_s)])
        return min(root_bound_s, self.pruning.least_root_s)

    def scan(self, subsets: list[tuple[DeviceGroup, ...]], budget: int | None = None) -> None:
        """Branch and bound over the candidates on these group subsets (best bound first; the generator stops
        once no candidate left can beat the incumbent, or when `budget` candidates have been solved in all:
        default options.max_candidates)."""
        ctx, gap = self.ctx, self.options.gap
        budget = self.options.max_candidates if budget is None else budget
        sources = tp_row_sources(ctx, self.options, True, subsets)
        self.sources += sources  # the per-stage step's too
        configs = outer_configs(ctx, self.options, self.candidates, pruning=self.pruning, sources=sources)
        for index, config in enumerate(configs, self.scanned):
            if self.evaluated >= budget:
                self.stopped_s = min(self.stopped_s, config.order_bound_s)  # best first: no candidate left is below
                break
            self.scanned = index + 1
            if self.progress is not None and index % 64 == 0:
                self.progress(index, index + 64)
            self.evaluated += 1
            strategy, memory_bound, objective_s = candidate_strategy(
                ctx, self.terms, config, self.best.kth_s(gap), self.splitter
            )
            if strategy is None:
                self.infeasible += memory_bound
                continue
            evaluation = evaluate(ctx, strategy, self.terms.evaluations)
            if not evaluation.fits:
                self.infeasible += 1
                continue
            self.tried.append((evaluation.iteration_time_s, index, config, objective_s))
            self.best.keep(evaluation, index)
            self.pruning.limit_s = self.best.kth_s(gap)

    def solve(self, config: OuterConfig, incumbent_s: float, order: int) -> tuple[Evaluation | None, float] | None:
        """Solve and evaluate a candidate of a refinement step, keeping it if it fits: (its evaluation if it fits,
        its pipeline objective), or None when it was not solved (cannot beat `incumbent_s`, or does not fit)."""
        strategy, _, objective_s = candidate_strategy(self.ctx, self.terms, config, incumbent_s, None)
        if strategy is None:
            return None
        evaluation = evaluate(self.ctx, strategy, self.terms.evaluations)
        if not evaluation.fits:
            return None, objective_s
        self.best.keep(evaluation, order)
        return evaluation, objective_s

    def refine_uneven(self) -> int:
        """The best even candidates again at nearby replica counts that do not divide the batch (each group keeping
        as many stages as it then fits); returns how many were solved."""
        global_batch, num_layers = self.ctx.training.global_batch_size, self.ctx.model.num_layers
        cp = self.ctx.context_parallel
        seen: set[OuterConfig] = set()
        solved = 0
        best_first = sorted(self.tried, key=lambda item: (item[0], item[1]))
        for _, order, config, _ in best_first[: self.options.uneven_candidates]:
            for replicas in _nearby_replica_counts(config, cp):
                if global_batch % replicas == 0 or split_batch(global_batch, replicas, config.micro_batch_size) is None:
                    continue  # even splits were searched already
                lone = num_layers if len(config.groups) == 1 else None
                counts = tuple(stage_count(g, replicas, t * cp, lone) for g, t in zip(config.groups, config.tps))
                stages = sum(counts)
                v = config.virtual_stages if stages > 1 else 1  # a single stage cannot interleave
                if min(counts) < 1 or stages * v > num_layers:
                    continue
                candidate = dataclasses.replace(
                    config,
                    replicas=replicas,
                    stage_counts=counts,
                    virtual_stages=v,
                    lower_bound_s=0.0,
                    order_bound_s=0.0,
                )
                if candidate in seen:
                    continue
                seen.add(candidate)
                found = self.solve(candidate, self.best.kth_s(), order)
                if found is not None:
                    solved += 1
                    if found[0] is not None:
                        self.tried.append((found[0].iteration_time_s, order, candidate, found[1]))
        return solved

    def refine_per_stage(self) -> int:
        """Per-stage recompute: the best candidates again, each stage free to pick its mode (CP-SAT), where the
        bound says that can beat the candidate's best single mode and the k-th best plan; then as many shapes again,
        best bound for such plans first (best_first.per_stage_configs), that the scan passed by because no single
        mode both fit and won; returns how many were solved."""
        uniform_objective: dict[OuterConfig, float] = {}
        for _, _, config, objective_s in self.tried:
            key = _per_stage_key(config)
            uniform_objective[key] = min(uniform_objective.get(key, math.inf), objective_s)
        seen: set[OuterConfig] = set()
        refined = 0
        for _, order, config, _ in sorted(self.tried, key=lambda item: (item[0], item[1])):
            key = _per_stage_key(config)
            if key in seen:
                continue
            if len(seen) == self.options.per_stage_candidates:
                break
            seen.add(key)
            if self.solve(key, min(uniform_objective[key], self.best.kth_s()), order) is not None:
                refined += 1
        pruning = Pruning(self.best.kth_s())
        shapes = per_stage_configs(self.ctx, self.options, pruning, self.sources)
        for candidates in itertools.islice(shapes, self.options.per_stage_candidates):
            for config in candidates:
                key = _per_stage_key(config)
                if key not in seen:
                    seen.add(key)
                    if self.solve(key, self.best.kth_s(), self.scanned + len(seen)) is not None:
                        refined += 1
            pruning.limit_s = self.best.kth_s()
        return refined

    def add_families(self) -> tuple[int, float]:
        """Plans of several pipeline families (planner.families) join the incumbents; returns the partitions tried
        and, with the root bound, a bound on every plan of two or more families (families.family_bound_s)."""
        ctx = self.ctx
        rates = {
            g.name: compute_bound_tokens_per_s(dataclasses.replace(ctx, cluster=ctx.cluster.only(g)))
            for g in ctx.cluster.groups
        }
        block_scans = self.block_scans if self.block_scans is not None else BlockScans()
        families = family_search(ctx, self.options, rates, block_scans, self.progress)
        for position, evaluation in enumerate(families.evaluations):
            self.best.keep(evaluation, self.scanned + position)
        if not self.options.root_bound:
            return families.partitions, math.inf
        stages = self.options.family_zero_stages or (ctx.training.zero_stage,)  # a bound for each family's stage
        staged = [dataclasses.replace(ctx, training=ctx.training.model_copy(update={"zero_stage": s})) for s in stages]
        return families.partitions, min(family_bound_s(c, self.options) for c in staged)


_TO_THE_END = "searched to the end"


def _bound_text(bound_s: float, ranked: list[Evaluation], below_what: str = " this plan") -> str:
    """A bound on the plans left, with how far below the best plan it lies (when there is one)."""
    below = f", {1 - bound_s / ranked[0].iteration_time_s:.1%} below{below_what}" if ranked else ""
    return f"{bound_s:.3f} s{below}"


def _nearby_replica_counts(config: OuterConfig, context_parallel: int) -> list[int]:
    """Replica counts at which some group of a candidate holds fewer stages, or up to two more (and one replica
    fewer than the candidate's)."""
    counts = {config.replicas - 1}
    for group, tp, stages in zip(config.groups, config.tps, config.stage_counts):
        for k in range(1, stages + 3):
            counts.add(part_devices(group) // (k * tp * context_parallel))
    return sorted((c for c in counts if c >= 1), reverse=True)


def _per_stage_key(config: OuterConfig) -> OuterConfig:
    """A candidate's shape with a recompute mode per stage (bounds cleared: one key per shape and order)."""
    return dataclasses.replace(
        config, recompute=PER_STAGE, lower_bound_s=0.0, order_bound_s=0.0, fill_and_drain_bound_s=0.0
    )


class BlockScans:
    """The family search's block search: this search on the block alone. Each block's scan at a share is kept, so
    the refinement round at the same share only adds the per-stage recompute step (a search with it is that scan
    and then that step). One plan's searches over ZeRO stages, shard groups and CP degrees can share one: a block's
    scan depends on the block, its share, stage, shard group and degree only, and the per-family search of a degree
    scans the blocks at every stage the per-stage searches scanned them at (the all-options plan of Llama-3-70B at 8K
    tokens made 241 block scans with one of these per search, 130 with one shared)."""

    def __init__(self) -> None:
        self.scans: dict[tuple[tuple[DeviceGroup, ...], int, int, str, int, SearchOptions], _Search] = {}

    def __call__(self, ctx: CostContext, options: SearchOptions) -> list[Evaluation]:
        # the block's scan with its families off reads neither the per-stage step's budget nor the families' stages
        plain = dataclasses.replace(options, per_stage_candidates=0, family_zero_stages=())
        groups = ctx.cluster.groups
        if len(identical_classes(groups)) < len(groups) and search_size(ctx, groups) > MERGE_ABOVE:
            return search(ctx, options).evaluations  # merged groups: no state to keep
        training = ctx.training
        key = (tuple(groups), training.global_batch_size, training.zero_stage, training.zero_shard,
               ctx.context_parallel, plain)  # fmt: skip
        if key not in self.scans:
            state = _Search(ctx, plain, None, None, ())
            state.run()
            self.scans[key] = state
        scanned = self.scans[key]
        if not options.per_stage_candidates or len(ctx.training.recompute) < 2:
            return scanned.best.ranked()
        refined = copy.copy(scanned)  # the per-stage step on its own incumbents, the scan's left as they were
        refined.options, refined.best = options, scanned.best.copy()
        refined.refine_per_stage()
        return refined.best.ranked()


def searches_families(ctx: CostContext) -> bool:
    """Whether the search also plans several pipeline families (TrainingSpec.families)."""
    groups = len(ctx.cluster.groups)
    return groups > 1 and (ctx.training.families == "search" or (ctx.training.families == "auto" and groups == 2))


MAX_KINDS = 8  # groups of different devices or node shapes the search plans (pipeline orders grow as k!)
MERGE_ABOVE = 1_000_000  # pipeline orders x TP choices over every group past which identical groups plan as one


def search(
    ctx: CostContext,
    options: SearchOptions = DEFAULT_OPTIONS,
    progress: ProgressCallback | None = None,
    splitter: LayerSplitter | None = None,
    warm_start: Sequence[Evaluation] = (),
    block_scans: BlockScans | None = None,
) -> SearchResult:
    """The k fastest strategies that fit memory (fewer if fewer fit; k = options.top_k). `splitter` replaces the
    exact layer split by another rule (planner.baselines); the candidates' bounds hold for any split, so the search
    stays exact for the rule it is given. `warm_start`: feasible evaluations (e.g. the previous plan adapted to a
    changed cluster) that seed the incumbent, so the bounds prune from the first candidate on. `block_scans`: the
    family search's block scans, shared by the searches of one plan over its layout options (BlockScans). Many
    groups: groups of the same device and node shape plan as one (_merged_search) where the space is too large; more
    than MAX_KINDS kinds are refused in one line. Where some groups' devices cannot train in the dtype (bf16 on V100s)
    those get no stages (planner.planning.groups_with_dtype names them; where none can, plan() refuses first)."""
    groups = ctx.cluster.trains_in(ctx.training.dtype)
    if groups and len(groups) < len(ctx.cluster.groups):
        ctx = dataclasses.replace(ctx, cluster=dataclasses.replace(ctx.cluster, groups=groups))
    groups = ctx.cluster.groups
    kinds = identical_classes(groups)
    if len(kinds) < len(groups) and search_size(ctx, groups) > MERGE_ABOVE:
        return _merged_search(ctx, options, progress, splitter, warm_start)
    if len(kinds) > MAX_KINDS:
        raise SpecError(
            ctx.cluster.source or "cluster",
            "groups",
            f"at most {MAX_KINDS} kinds of group (device and node shape) can be planned: {len(kinds)} give "
            f"{math.factorial(len(kinds)):,} pipeline orders per TP choice; give groups of one kind the same device "
            "and node shape, or plan the kinds in parts",
        )
    return _Search(ctx, options, progress, splitter, warm_start, block_scans).run()


def _merged_search(
    ctx: CostContext,
    options: SearchOptions,
    progress: ProgressCallback | None,
    splitter: LayerSplitter | None,
    warm_start: Sequence[Evaluation],
) -> SearchResult:
    """The search with every kind of group (same device and node shape) merged into one group of all their nodes,
    its plans' stages spread back over the real groups in pipeline order (a stage never spans two groups) and
    evaluated on the real cluster. A narrower space than the groups apart: a kind's groups share one TP degree and
    sit next to each other along the pipe."""
    kinds = identical_classes(ctx.cluster.groups)
    merged = tuple(members[0].with_nodes(sum(g.nodes for g in members)) for members in kinds)
    for group, kind in zip(merged, kinds, strict=True):
        merged_parts(group, len(kind))
    members = {group.name: kind for group, kind in zip(merged, kinds, strict=True)}
    cluster = dataclasses.replace(ctx.cluster, groups=merged)
    merged_ctx = dataclasses.replace(ctx, cluster=cluster, sources={g.name: ctx.sources[g.name] for g in merged})
    wide = dataclasses.replace(options, top_k=max(options.top_k, 8), root_bound=False)
    try:
        result = search(merged_ctx, wide, progress, splitter)
    finally:
        for group in merged:
            merged_parts(group, 0)
    spread = [_spread(ctx, e.strategy, members) for e in result.evaluations]
    evaluations = [evaluate(ctx, strategy) for strategy in spread if strategy is not None]
    ranked = sorted([e for e in (*evaluations, *warm_start) if e.fits], key=lambda e: e.iteration_time_s)
    note = (
        f"{len(ctx.cluster.groups)} groups planned as {len(merged)} (groups of one device and node shape merged, "
        "their stages spread back in pipeline order)" + (f"; {result.note}" if result.note else "")
    )
    return dataclasses.replace(result, evaluations=ranked[: options.top_k], lower_bound_s=None, note=note)


def _spread(ctx: CostContext, strategy: Strategy, members: dict[str, tuple[DeviceGroup, ...]]) -> Strategy | None:
    """A plan over merged groups with each stage moved to the first of the merged group's real groups with room for
    it (every replica of it), or None where they have none."""
    used: dict[str, int] = {}
    pipelines = []
    for pipeline in strategy.pipelines:
        stages = []
        for stage in pipeline.stages:
            need = pipeline.stage_devices(stage)
            room = [g for g in members[stage.group] if used.get(g.name, 0) + need <= g.num_devices]
            if not room:
                return None
            used[room[0].name] = used.get(room[0].name, 0) + need
            stages.append(dataclasses.replace(stage, group=room[0].name))
        pipelines.append(
            dataclasses.replace(pipeline, stages=pack_stages(stages, pipeline.replicas, pipeline.context_parallel))
        )
    return dataclasses.replace(strategy, pipelines=tuple(pipelines))


def fastest(ctx: CostContext) -> Evaluation | None:
    """The fastest plan that fits, or None (the yardsticks plan each group alone with it)."""
    evaluations = search(ctx).evaluations
    return evaluations[0] if evaluations else None
