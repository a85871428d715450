"""Several pipeline families (level 2 of the tree across device mixes): the groups are split into blocks, each
block trains its own pipeline replicas, and the global batch is split unevenly across the families.

One family makes every replica the same device mix, so each group must give every replica the same share of its
devices; where the groups' sizes and speeds do not line up, devices idle or the slowest type sets every replica's
pace. With families, each block runs the pipeline that suits it (its own depth, TP, micro-batch) and gets a share
of the batch its speed earns; gradients meet across families after each family's own reduce-scatter
(`cost_model.cross_family_sync_time_s`), and each replica's gradients are weighted by its share of the samples.

For each partition of the groups into blocks: the best few plans of every block at about its share of the batch
(the ordinary search on the block alone, memoised), then an exact split picks one plan per block and the
micro-batches of each family (integers, sum of samples = global batch) minimising the slowest family's pipeline +
tail. A family's pipeline time is affine in its micro-batches per replica, q * bottleneck + fill/drain (an interleaved
plan's from as many as fill its loop through the stages on, the fewest it is offered at), so the split
is exact for the offered plans (`split_batch_across`: a subset-sum table and a search over the times; a CP-SAT model
of the same problem timed out at 2 s with worse splits); memory holds when q grows only where q already reaches the
pipeline depth (1F1B keeps at most depth micro-batches in flight; interleaved plans are checked per count where the
split breaks memory). The best partitions' blocks are searched again near the shares the split chose, and the split
solved again over both rounds' plans. Every result is re-evaluated by the full
cost model, cross-family sync included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planner.options import ProgressCallback, SearchOptions
from predictor.cost_model import (
    CostContext,
    Evaluation,
    evaluate,
    interleaved_group_size,
    stage_memory,
    usable_memory_bytes,
)
from predictor.evaluation import pipeline_makespan_s
from specs.cluster import DeviceGroup
from specs.layout import Strategy, split_pipeline
from specs.model import Recompute

# the best plans of a block alone: (the block's context, the search options) -> evaluations, best first
BlockSearch = Callable[[CostContext, SearchOptions], Sequence[Evaluation]]


@dataclass(frozen=True)
class _BlockPlan:
    """One plan of a block, as an affine function of its micro-batches per replica."""

    evaluation: Evaluation
    replicas: int
    micro_batch_size: int
    per_microbatch_s: float  # the bottleneck stage's time per micro-batch
    fixed_s: float  # fill, drain, p2p and the block's own tail
    max_microbatches: int  # memory: at most this many per replica (large where depth is reached)
    virtual_stages: int  # 0: a single stage, compatible with any interleaving
    # interleaved plans: whether memory holds at q = 0, 1, ... micro-batches per replica (a stage holds activations
    # for 2(p - i - 1) + (v - 1) N + 1 chunks, and Megatron's group size N is not monotone in q); None: any q
    fits_microbatches: tuple[bool, ...] | None = None
    # interleaved plans: the fewest micro-batches per replica at which the time is affine in them (fewer wait for the
    # loop through the stages: pipeline_makespan_s), so the fewest offered; 0: any
    least_microbatches: int = 0


@dataclass
class FamilySearchResult:
    evaluations: list[Evaluation]
    partitions: int
    block_searches: int


def partitions(items: Sequence[DeviceGroup]) -> Iterator[list[list[DeviceGroup]]]:
    """Every partition of the groups into non-empty blocks, in a fixed order (the first group starts block 0)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        yield [[first], *smaller]
        for index in range(len(smaller)):
            yield [*smaller[:index], [first, *smaller[index]], *smaller[index + 1 :]]


def _block_context(
    ctx: CostContext, block: Sequence[DeviceGroup], samples: int, zero_stage: int | None = None
) -> CostContext:
    """The context of a block alone with `samples` of the batch (one family), at its own ZeRO stage if given."""
    cluster = dataclasses.replace(ctx.cluster, groups=tuple(block))
    update: dict[str, object] = {"global_batch_size": samples, "families": "off"}
    if zero_stage is not None:
        update["zero_stage"] = zero_stage
    return dataclasses.replace(ctx, cluster=cluster, training=ctx.training.model_copy(update=update))


def _with_memory(ctx: CostContext, plan: _BlockPlan, global_batch: int) -> _BlockPlan:
    """The plan with the micro-batch counts at which it fits memory, if it interleaves (1F1B plans fit at any count
    up to max_microbatches)."""
    pipeline = plan.evaluation.strategy.pipelines[0]
    if plan.virtual_stages <= 1 or plan.fits_microbatches is not None:
        return plan
    most = global_batch // (pipeline.micro_batch_size * pipeline.replicas)
    return dataclasses.replace(plan, fits_microbatches=_interleaved_fits(ctx, plan.evaluation, most))


def _interleaved_fits(ctx: CostContext, evaluation: Evaluation, most: int) -> tuple[bool, ...]:
    """Whether every stage of an interleaved one-family plan fits memory at q = 0..most micro-batches per replica
    (a stage's memory is affine in the micro-batches it holds in flight)."""
    strategy = evaluation.strategy
    pipeline = strategy.pipelines[0]
    if strategy.zero_stage != ctx.training.zero_stage:  # the block's plan at its own ZeRO stage
        ctx = dataclasses.replace(ctx, training=ctx.training.model_copy(update={"zero_stage": strategy.zero_stage}))
    p, v, b = len(pipeline.stages), strategy.virtual_stages, pipeline.micro_batch_size
    sizes = np.array([interleaved_group_size(q, p) for q in range(1, most + 1)])
    q = np.arange(1, most + 1)
    fits = np.ones(most, dtype=bool)
    for index, stage in enumerate(pipeline.stages):
        group = ctx.cluster.group(stage.group)
        shape = dict(
            num_layers=stage.num_layers,
            micro_batch_size=b,
            tp=stage.tp,
            recompute=strategy.stage_recompute(stage),
            dp=pipeline.replicas,
            first=index == 0,
            last=index == p - 1,
            pipeline_stages=p,
        )
        empty = stage_memory(ctx, group, in_flight=0, **shape).total_bytes  # type: ignore[arg-type]
        per_microbatch = stage_memory(ctx, group, in_flight=1, **shape).total_bytes - empty  # type: ignore[arg-type]
        in_flight = np.minimum(2 * (p - index - 1) + (v - 1) * sizes + 1, q * v) / v
        fits &= empty + per_microbatch * in_flight <= usable_memory_bytes(ctx, group)
    return (True, *(bool(x) for x in fits))


def _block_plans(evaluations: Sequence[Evaluation]) -> list[_BlockPlan]:
    """A block's plans as affine functions of their micro-batches per replica."""
    plans = []
    for evaluation in evaluations:
        pipeline = evaluation.strategy.pipelines[0]
        times = [stage.step_time_s for stage in evaluation.stages]
        bottleneck, total = max(times), sum(times)
        q, v = pipeline.num_microbatches, evaluation.strategy.virtual_stages
        stages = len(pipeline.stages)
        # the affine (steady) form's fixed part, also where the evaluated count waits for the interleaved loop
        loop_s = pipeline_makespan_s(q, v, bottleneck, total) - (q * bottleneck + (total - bottleneck) / v)
        interleaved = v > 1 and stages > 1
        plans.append(
            _BlockPlan(
                evaluation=evaluation,
                replicas=pipeline.replicas,
                micro_batch_size=pipeline.micro_batch_size,
                per_microbatch_s=bottleneck,
                fixed_s=evaluation.pipeline_time_s - loop_s - q * bottleneck + evaluation.tail_time_s,
                max_microbatches=q if q < stages else 1 << 30,
                virtual_stages=v if stages > 1 else 0,
                least_microbatches=math.ceil(total / bottleneck * (1 - 1e-12)) if interleaved else 0,
            )
        )
    return plans


def split_batch_across(
    global_batch: int,
    blocks: Sequence[Sequence[_BlockPlan]],
) -> tuple[list[int], list[int]] | None:
    """One plan per block and its total micro-batches, samples adding up to the global batch exactly, every replica
    running q or q - 1 (>= 1) micro-batches, minimising the slowest family's time; plans of several stages share one
    interleaving depth. Returns (plan index per block, micro-batches per block), or None when no split exists.

    Exact: within a time T, plan p of a block can take any n in [replicas, replicas * q_max(T)] micro-batches of
    its size b, so the sample totals reachable by the blocks together are a sum of sets (a subset-sum table over
    0..global batch); reaching the global batch is monotone in T and changes only where some plan runs one more
    micro-batch per replica, so a binary search over those times finds the least T, and walking the tables back
    gives the split."""
    best: tuple[float, list[int], list[int]] | None = None
    depths = sorted({p.virtual_stages for plans in blocks for p in plans if p.virtual_stages}) or [0]
    for depth in depths:
        allowed = [[i for i, p in enumerate(plans) if p.virtual_stages in (0, depth)] for plans in blocks]
        if any(not indices for indices in allowed):
            continue
        found = _least_time_split(global_batch, blocks, allowed)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else (best[1], best[2])


def _ranges(global_batch: int, plan: _BlockPlan, time_s: float) -> list[tuple[int, int]]:
    """The runs (fewest, most), ascending, of the micro-batch totals the plan's family can run within `time_s` and
    memory (every replica runs q or q - 1 of them, at least one)."""
    most_samples = global_batch // plan.micro_batch_size
    q = math.floor((time_s - plan.fixed_s) / plan.per_microbatch_s) if time_s >= plan.fixed_s else 0
    q = min(q, plan.max_microbatches, most_samples)
    if q < 1 or plan.replicas > most_samples:
        return []
    d, most = plan.replicas, min(plan.replicas * q, most_samples)
    fits, least = plan.fits_microbatches, max(plan.least_microbatches, 1)
    if least == 1 and (fits is None or all(fits[1 : q + 1])):
        return [(d, most)]
    runs: list[tuple[int, int]] = []
    top = q if fits is None else min(q, len(fits) - 1)
    for k in range(least, top + 1):  # totals in ((k - 1) d, k d] run k per replica at most
        if fits is None or fits[k]:
            low, high = max(d, (k - 1) * d + 1), min(k * d, most)
            if runs and runs[-1][1] + 1 == low:
                runs[-1] = (runs[-1][0], high)
            elif low <= high:
                runs.append((low, high))
    return runs


def _add_range(reachable: np.ndarray, step: int, low: int, high: int) -> np.ndarray:
    """{x + step * n : x reachable, low <= n <= high} as a table over 0..len-1 (sliding window per residue)."""
    out = np.zeros_like(reachable)
    for residue in range(step):
        column = reachable[residue::step].astype(np.int64)
        running = np.concatenate([[0], np.cumsum(column)])
        j = np.arange(len(column))
        upper = np.clip(j - low + 1, 0, len(column))
        lower = np.clip(j - high, 0, len(column))
        out[residue::step] = (running[upper] - running[lower]) > 0
    return out


def _add_runs(reachable: np.ndarray, step: int, runs: Sequence[tuple[int, int]]) -> np.ndarray:
    """_add_range over several runs at once: the table convolved with the runs' sample totals (FFT; the counts are
    whole numbers, so > 0.5 is exact)."""
    shifts = np.zeros(len(reachable))
    for low, high in runs:
        shifts[step * low : step * high + 1 : step] = 1.0
    size = 2 * len(reachable)
    counts = np.fft.irfft(np.fft.rfft(reachable.astype(float), size) * np.fft.rfft(shifts, size), size)
    return counts[: len(reachable)] > 0.5


def _tables(
    global_batch: int, blocks: Sequence[Sequence[_BlockPlan]], allowed: Sequence[Sequence[int]], time_s: float
) -> list[np.ndarray] | None:
    """Reachable sample totals after each block within `time_s`; None when the global batch is not reachable."""
    reachable = np.zeros(global_batch + 1, dtype=bool)
    reachable[0] = True
    tables = [reachable]
    for plans, indices in zip(blocks, allowed, strict=True):
        merged = np.zeros_like(reachable)
        for i in indices:
            spans = _ranges(global_batch, plans[i], time_s)
            if len(spans) == 1:
                merged |= _add_range(reachable, plans[i].micro_batch_size, *spans[0])
            elif spans:
                merged |= _add_runs(reachable, plans[i].micro_batch_size, spans)
        reachable = merged
        tables.append(reachable)
    return tables if reachable[global_batch] else None


def _least_time_split(
    global_batch: int, blocks: Sequence[Sequence[_BlockPlan]], allowed: Sequence[Sequence[int]]
) -> tuple[float, list[int], list[int]] | None:
    """split_batch_across for one interleaving depth (`allowed`: the plans of each block with it): (the slowest
    family's time, plan index per block, micro-batches per block)."""
    plans = [blocks[f][i] for f, indices in enumerate(allowed) for i in indices]
    # the family times T at which some plan runs one more micro-batch per replica: the least feasible T is one
    events = np.unique(
        np.concatenate(
            [
                p.per_microbatch_s * np.arange(1, min(p.max_microbatches, global_batch // p.micro_batch_size) + 1)
                + p.fixed_s
                for p in plans
            ]
        )
    )
    events = events + np.abs(events) * 1e-12  # just past each event: its micro-batch counts
    if len(events) == 0 or _tables(global_batch, blocks, allowed, float(events[-1])) is None:
        return None
    low, high_index = -1, len(events) - 1  # events[low] infeasible (-1: none), events[high_index] feasible
    while high_index - low > 1:
        middle = (low + high_index) // 2
        if _tables(global_batch, blocks, allowed, float(events[middle])) is None:
            low = middle
        else:
            high_index = middle
    high = float(events[high_index])
    tables = _tables(global_batch, blocks, allowed, high)
    assert tables is not None
    picked: list[int] = []
    microbatches: list[int] = []
    remaining = global_batch
    for f in range(len(blocks) - 1, -1, -1):
        before = tables[f]
        choice = None
        for i in allowed[f]:
            plan = blocks[f][i]
            totals = (
                n for low, high_n in reversed(_ranges(global_batch, plan, high)) for n in range(high_n, low - 1, -1)
            )
            for n in totals:
                rest = remaining - plan.micro_batch_size * n
                if rest >= 0 and before[rest]:
                    choice = (i, n)
                    break
            if choice is not None:
                break
        assert choice is not None, "the tables say the remainder is reachable"
        picked.append(choice[0])
        microbatches.append(choice[1])
        remaining -= blocks[f][choice[0]].micro_batch_size * choice[1]
    picked.reverse()
    microbatches.reverse()
    slowest = max(
        blocks[f][i].per_microbatch_s * -(-n // blocks[f][i].replicas) + blocks[f][i].fixed_s
        for f, (i, n) in enumerate(zip(picked, microbatches, strict=True))
    )
    return slowest, picked, microbatches


def combine(ctx: CostContext, plans: Sequence[_BlockPlan], microbatches: Sequence[int]) -> Strategy:
    """One strategy of several families: each block's plan with its micro-batch total; stage recompute made
    explicit, the most common mode as the strategy's."""
    pipelines = []
    modes: list[Recompute] = []
    virtual = max([p.virtual_stages for p in plans] + [1])
    training = ctx.training
    for plan, total in zip(plans, microbatches, strict=True):
        strategy = plan.evaluation.strategy
        pipeline = strategy.pipelines[0]
        most = -(-total // pipeline.replicas)
        stages = tuple(dataclasses.replace(s, recompute=strategy.stage_recompute(s)) for s in pipeline.stages)
        modes += [s.recompute for s in stages]  # type: ignore[misc]
        family = split_pipeline(
            pipeline.replicas, pipeline.micro_batch_size, stages, most, total, pipeline.context_parallel
        )
        own = strategy.zero_stage  # the block was searched at its own ZeRO stage (SearchOptions.family_zero_stages)
        pipelines.append(dataclasses.replace(family, zero_stage=None if own == training.zero_stage else own))
    default: Recompute = max(modes, key=modes.count)
    pipelines = [
        dataclasses.replace(
            p,
            stages=tuple(
                dataclasses.replace(s, recompute=None if s.recompute == default else s.recompute) for s in p.stages
            ),
        )
        for p in pipelines
    ]
    return Strategy(
        tuple(pipelines), default, training.zero_stage, virtual, training.sequence_parallel, training.zero_shard
    )


def family_search(
    ctx: CostContext,
    options: SearchOptions,
    block_rate: dict[str, float],
    block_search: BlockSearch,
    progress: ProgressCallback | None = None,
) -> FamilySearchResult:
    """The fastest plans (options.top_k) of two or more families over every partition of the groups. `block_rate`: an
    estimate of each group's throughput (any unit), for the first shares. `block_search`: the best plans of a block
    alone (the ordinary search, planner.search; given by the caller, which is that search). `progress(done, total)`
    counts partitions.

    Every partition: each block's best plans at its share of the batch by `block_rate` (single-mode recompute: the
    per-stage CP-SAT refinement would cost most of the time), then the exact batch split. The best
    options.refined_partitions partitions: blocks searched again near the shares the split chose, now with per-stage
    recompute, and the split solved over both rounds' plans."""
    return _FamilySearch(ctx, options, block_search).run(block_rate, progress)


# a partition's first-round result: (iteration time, position, the partition, each block's plans, each block's share)
_FirstRound = tuple[float, int, list[list[DeviceGroup]], list[list[_BlockPlan]], list[int]]


class _FamilySearch:
    """The block searches of one family search (memoised by block, share and round) and the batch split."""

    def __init__(self, ctx: CostContext, options: SearchOptions, block_search: BlockSearch) -> None:
        self.ctx, self.options, self.block_search = ctx, options, block_search
        self.memo: dict[tuple[tuple[str, ...], int, bool], list[_BlockPlan]] = {}

    def block_plans(self, block: Sequence[DeviceGroup], samples: int, refine: bool) -> list[_BlockPlan]:
        """The best plans of a block alone with `samples` of the batch (`refine`: with per-stage recompute)."""
        key = (tuple(g.name for g in block), samples, refine)
        if key not in self.memo:
            options = dataclasses.replace(
                self.options,
                top_k=self.options.plans_per_block,
                per_stage_candidates=self.options.refined_per_stage_candidates if refine else 0,
                every_group=True,
                root_bound=False,
            )
            found: list[Evaluation] = []
            for stage in self.options.family_zero_stages or (self.ctx.training.zero_stage,):
                block_ctx = _block_context(self.ctx, block, samples, stage)
                found += self.block_search(block_ctx, options)
            self.memo[key] = _block_plans(sorted(found, key=lambda e: e.iteration_time_s))
        return self.memo[key]

    def solve(self, pools: list[list[_BlockPlan]]) -> tuple[Evaluation, list[int]] | None:
        """The best split of the batch over one plan per block, evaluated: (its evaluation, each block's samples),
        or None where no split exists or it does not fit. Where the split does not fit (an interleaved plan holds
        more at its new micro-batch count), it is solved again with each interleaved plan's exact memory."""
        ctx = self.ctx
        global_batch = ctx.training.global_batch_size
        for memory in (False, True):
            if memory:
                pools = [[_with_memory(ctx, plan, global_batch) for plan in pool] for pool in pools]
            split = split_batch_across(global_batch, pools)
            if split is None:
                return None
            picked, microbatches = split
            chosen = [pool[i] for pool, i in zip(pools, picked, strict=True)]
            evaluation = evaluate(ctx, combine(ctx, chosen, microbatches))
            if evaluation.fits:
                return evaluation, [p.micro_batch_size * n for p, n in zip(chosen, microbatches, strict=True)]
        return None

    def run(self, block_rate: dict[str, float], progress: ProgressCallback | None) -> FamilySearchResult:
        """Every partition at first shares by `block_rate`, then the best partitions again near the split's shares."""
        global_batch = self.ctx.training.global_batch_size
        total_rate = sum(block_rate.values())
        found: list[Evaluation] = []
        first_round: list[_FirstRound] = []
        count = 0
        several = [p for p in partitions(list(self.ctx.cluster.groups)) if len(p) >= 2]
        refined = min(self.options.refined_partitions, len(several))
        steps = len(several) + refined
        for partition in several:
            if progress is not None:
                progress(count, steps)
            count += 1
            # a block's first share depends on the block only (its part of the whole cluster's rate), so every block
            # is searched once whatever partition it is in; the split then moves samples freely
            rates = [sum(block_rate[g.name] for g in block) for block in partition]
            shares = [_probe_share(global_batch * rate / total_rate) for rate in rates]
            pools = [self.block_plans(block, share, False) for block, share in zip(partition, shares, strict=True)]
            if any(not pool for pool in pools):
                continue  # a block cannot hold the model (memory barely depends on the share)
            solved = self.solve(pools)
            if solved is not None:
                found.append(solved[0])
                first_round.append((solved[0].iteration_time_s, count, partition, pools, solved[1]))
        best_partitions = sorted(first_round, key=lambda item: item[:2])[: self.options.refined_partitions]
        for step, (_, _, partition, pools, shares) in enumerate(best_partitions, len(several)):
            if progress is not None:
                progress(step, steps)
            blocks = zip(partition, shares, strict=True)
            fresh = [self.block_plans(block, _probe_share(share), True) for block, share in blocks]
            merged = [pool + [p for p in more if p not in pool] for pool, more in zip(pools, fresh, strict=True)]
            solved = self.solve(merged)
            if solved is not None:
                found.append(solved[0])
        unique: dict[str, Evaluation] = {}
        for evaluation in sorted(found, key=lambda e: e.iteration_time_s):
            unique.setdefault(repr(evaluation.strategy), evaluation)
        return FamilySearchResult(list(unique.values())[: self.options.top_k], count, len(self.memo))


def _probe_share(samples: float) -> int:
    """A share near `samples` with many divisors (a multiple of the largest power of two up to a quarter of it): the
    block's search tries replica counts that divide its share, and the split moves samples freely afterwards."""
    if samples < 4:
        return max(1, round(samples))
    step = 1 << int(math.log2(samples / 4))
    return max(step, round(samples / step) * step)


# ---- a bound on every plan of several families --------------------------------------------------------------------
@dataclass(frozen=True)
class _BlockCurve:
    """A bound on the time of any family on a block as a function of its share s of the batch: the least over its
    row shapes (TP per group, any replica count d, micro-batch b, interleaving v) of (m - 1/v) * M(m) + C with
    m = ceil(s / (d b)) micro-batches per replica; arrays over the shapes. M(m) is `early_s` below `saturated` micro
    -batches (memory seen with one in flight) and `bottleneck_s` from there (with as many in flight as 1F1B keeps)."""

    bottleneck_s: np.ndarray
    early_s: np.ndarray
    saturated: np.ndarray  # the pipeline depth of one-group rows (1: the memory bound holds at any m)
    fixed_s: np.ndarray  # C: stage-time sum / v, fill and drain, the fullest stage's optimizer step, overhead
    virtual: np.ndarray
    unit: np.ndarray  # d * b: samples per micro-batch across the replicas

    def most_samples(self, time_s: float, global_batch: int) -> int:
        """The largest share whose bound is within `time_s` (0: none)."""
        late = np.floor((time_s - self.fixed_s) / self.bottleneck_s + 1 / self.virtual)
        early = np.minimum(self.saturated - 1, np.floor((time_s - self.fixed_s) / self.early_s + 1 / self.virtual))
        m = np.where(late >= self.saturated, late, early)
        fits = m >= 1
        if not fits.any():
            return 0
        return int(min(global_batch, (self.unit[fits] * m[fits]).max()))


def _least_bottleneck_s(
    per_layer_s: np.ndarray, caps: np.ndarray, counts: np.ndarray, low_s: np.ndarray, layers: int
) -> np.ndarray:
    """Per row: a bound on the smallest M with sum over stages of max over modes of min(cap, floor(M / a)) >= L
    (whole layers, memory caps, a mode per stage); (rows, stages or groups, modes) arrays, `counts` stages per column.
    Bisected from `low_s` (known too small) keeping the side known too small; inf where the caps cannot hold L."""
    most = (counts * caps.max(axis=2)).sum(axis=1)
    high = low_s + per_layer_s.max(axis=(1, 2)) * layers
    low = low_s.copy()
    for _ in range(24):  # to 2^-24 of L layers of the slowest mode
        middle = (low + high) / 2
        held = np.minimum(caps, np.floor(middle[:, None, None] / per_layer_s)).max(axis=2)
        enough = (counts * held).sum(axis=1) >= layers
        high, low = np.where(enough, middle, high), np.where(enough, low, middle)
    return np.where(most >= layers, low, np.inf)


def block_curve(ctx: CostContext, block: tuple[DeviceGroup, ...], options: SearchOptions) -> _BlockCurve | None:
    """The bound of any family on `block` (every group of it, as the family search's blocks), at any share: every
    replica count the devices allow, each stage in any recompute mode (per-stage recompute plans are covered), its
    memory cap with one micro-batch in flight (one-group blocks: from the pipeline depth on, with as many as 1F1B
    keeps at each stage), its tail at least the fullest stage's optimizer step."""
    from planner.lower_bounds import PipelineBound
    from planner.tp_rows import row_tables
    from predictor.cost_model import fill_and_drain_time_s, optimizer_time_s, state_bytes_per_param

    rows = row_tables(ctx).subset_rows(block)
    found = list(rows.replica_rows(ctx, options, True, every_count=True))
    if not found:
        return None
    layers, modes, model = ctx.model.num_layers, ctx.training.recompute, ctx.model
    tps = np.concatenate([r.tps for r in found])
    counts = np.concatenate([r.counts for r in found])
    positions = np.concatenate([r.positions for r in found])
    replicas = np.repeat([r.replicas for r in found], [len(r.tps) for r in found])
    stages = counts.sum(axis=1)
    step_per_layer = np.stack(
        [optimizer_time_s(ctx, g, model.layer_params() / tps[:, j], replicas) for j, g in enumerate(block)], axis=1
    )
    tail_s = -(-layers // stages) * step_per_layer.min(axis=1) + ctx.terms.iteration_overhead_s
    state = model.layer_params() * np.array([state_bytes_per_param(ctx, int(d)) for d in replicas])[:, None] / tps
    one_group = len(block) == 1
    depth = np.arange(1, int(stages.max()) + 1)  # from the end of the pipe
    parts: list[tuple[np.ndarray, ...]] = []
    for b in ctx.training.micro_batch_sizes:
        a_modes = np.stack([rows.tables(b, rc)[0][rows.columns, positions] for rc in modes], axis=-1)
        activation = np.stack([rows.tables(b, rc)[1][rows.columns, positions] for rc in modes], axis=-1)
        a = a_modes.min(axis=-1)
        e_first, e_last = (rows.tables(b, modes[0])[k][rows.columns, positions] for k in (2, 3))
        pipeline = PipelineBound.of(layers, a, e_first, e_last, counts)
        level = layers / (counts / a).sum(axis=1)
        caps = np.floor(rows.usable[None, :, None] / (state[..., None] + activation))  # one micro-batch in flight
        early = _least_bottleneck_s(a_modes, caps, counts, level * (1 - 1e-9), layers)
        boundaries_s = rows._boundaries_s(b, tps, counts)
        for v in ctx.training.virtual_stages:
            late = early
            saturated = np.ones_like(stages)
            if one_group:  # from m = p on, the stage at depth k holds 1F1B's warm-up: k; interleaved (group size
                # N >= p) from m = p + (p - 1) / v on: (2 (k - 1) + (v - 1) p + 1) / v
                in_flight = (2 * (depth[None, :] - 1) + (v - 1) * stages[:, None] + 1) / v
                saturated = -(-(v * stages + stages - 1) // v)
                if v == 1:
                    in_flight, saturated = np.broadcast_to(depth[None, :].astype(float), in_flight.shape), stages
                per_stage = state[:, 0, None, None] + activation[:, 0, None, :] * in_flight[..., None]
                deep_caps = np.floor(rows.usable[0] / per_stage)  # (rows, depth, modes)
                present = (depth[None, :] <= stages[:, None]).astype(float)
                deep_a = np.broadcast_to(a_modes[:, :1, :], deep_caps.shape)
                late = np.maximum(early, _least_bottleneck_s(deep_a, deep_caps, present, early.copy(), layers))
            fill_s = fill_and_drain_time_s(v, boundaries_s)
            bounded = pipeline.bound_s(1, v, tail_s * 0, fill_s * 0)
            if bounded is None:
                continue
            # bound_s at m = 1 with no tail is (1 - 1/v) * its bottleneck + the stage-time sum / v
            fixed = bounded[0] - (1 - 1 / v) * bounded[1] + fill_s + tail_s
            allowed = np.isfinite(bounded[0]) & np.isfinite(early) & (caps.max(axis=2).min(axis=1) >= v)
            columns = (
                np.maximum(bounded[1], late),
                np.maximum(bounded[1], early),
                saturated,
                fixed,
                np.full(len(stages), v),
                replicas * b,
            )
            parts.append(tuple(column[allowed] for column in columns))
    if not parts:
        return None
    return _BlockCurve(*(np.concatenate(column) for column in zip(*parts)))


def family_bound_s(ctx: CostContext, options: SearchOptions) -> float:
    """A bound on the iteration time of every plan of two or more families the family search covers (every
    partition of the groups): per partition, the least time at which the blocks' curves can take the whole batch
    between them (each family waits its own pipeline and tail; the cross-family sync only adds), bisected keeping the
    side known too small."""
    global_batch = ctx.training.global_batch_size
    curves: dict[tuple[DeviceGroup, ...], _BlockCurve | None] = {}
    best = math.inf
    for partition in partitions(list(ctx.cluster.groups)):
        if len(partition) < 2:
            continue
        blocks = [tuple(block) for block in partition]
        for block in blocks:
            if block not in curves:
                curves[block] = block_curve(ctx, block, options)
        found = [curves[block] for block in blocks]
        if any(curve is None for curve in found):
            continue
        best = min(best, _partition_bound_s([c for c in found if c is not None], global_batch, best))
    return best


def _partition_bound_s(curves: Sequence[_BlockCurve], global_batch: int, below_s: float) -> float:
    """The least time at which every block takes at least one sample and together they take the batch (a bound:
    the side known infeasible); `below_s`: stop early when it cannot be below that."""

    def enough(time_s: float) -> bool:
        """Whether the blocks can take the batch between them within `time_s`."""
        shares = [curve.most_samples(time_s, global_batch) for curve in curves]
        return min(shares) >= 1 and sum(shares) >= global_batch

    high = max(float((c.bottleneck_s * (global_batch / c.unit + 1) + c.fixed_s).min()) for c in curves) + 1.0
    if math.isfinite(below_s) and not enough(min(below_s, high)):
        return below_s  # no better than what is known
    if not enough(high):
        return math.inf
    low = 0.0
    for _ in range(60):
        middle = (low + high) / 2
        if enough(middle):
            high = middle
        else:
            low = middle
    return low
