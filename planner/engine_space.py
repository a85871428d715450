"""The plans one engine can run: what of a plan an engine cannot express, the training restricted to its space, the
search within that space (`hetplan plan --engine`), and the closest plan it can run (`hetplan export`).

What each engine can express is data (specs/catalog/engines.yaml, specs.engines.Engine); this module reads it and
never imports the exporters' files, so the planner can plan for an engine and the export of that plan loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from planner.baselines import SPLITTERS
from planner.candidates import tp_options
from planner.options import DEFAULT_OPTIONS, ProgressCallback, SearchOptions
from planner.search import SearchResult, merge_results, search
from predictor.cost_model import CostContext, evaluate
from profiler.profile import LayerCostSource
from specs.cluster import ClusterSpec
from specs.engines import Engine
from specs.errors import SpecError
from specs.layout import PipelineStrategy, Strategy, pack_stages, split_batch
from specs.model import RECOMPUTE_MODES, Recompute
from specs.training import TrainingSpec


class _FixedTp:
    """A layer-cost source that offers the search one TP degree (the planner reads `tp_degrees` as what a profile
    covers), so the same search finds the best plan with every stage at that degree."""

    def __init__(self, source: LayerCostSource, tp: int) -> None:
        self._source, self._tp = source, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def tp_degrees(self) -> tuple[int, ...]:
        profiled = getattr(self._source, "tp_degrees", None)
        covered = profiled() if callable(profiled) else None  # None: the source answers any degree
        return (self._tp,) if covered is None or self._tp in covered else ()


def engine_zero_stage(zero_stage: int, engine: Engine) -> int:
    """The ZeRO stage the engine runs for a requested one: the nearest stage it has that shards at least as much,
    else the most sharding one it has (Megatron's distributed optimizer for ZeRO-3, FSDP's sharding for ZeRO-1)."""
    if zero_stage in engine.zero_stages:
        return zero_stage
    above = [s for s in engine.zero_stages if s > zero_stage]
    return min(above) if above else max(engine.zero_stages)


def _zero_words(stage: int) -> str:
    return "no ZeRO" if stage == 0 else f"ZeRO-{stage}"


def engine_dtype(dtype: str, engine: Engine) -> str:
    """The dtype the engine trains a plan of `dtype` in: bf16 for FP8 without an FP8 switch, fp32 for fp16 without
    fp16 mixed precision."""
    if dtype == "fp8" and not engine.fp8:
        return "bf16"
    if dtype == "fp16" and not engine.fp16:
        return "fp32"
    return dtype


def _short_of_microbatches(strategy: Strategy, engine: Engine) -> tuple[int, int] | None:
    """(micro-batches, stages) of an interleaved pipeline with a replica of fewer micro-batches than stages, which an
    engine that interleaves groups of at least p micro-batches refuses (Megatron: a group size per virtual stage from
    p to m; PyTorch's schedules and hetplan's runtime run it); None when there is none."""
    if strategy.virtual_stages <= 1 or not engine.interleaving_groups_of_stages:
        return None
    for pipeline in strategy.pipelines:
        fewest = min(pipeline.replica_microbatches())
        if len(pipeline.stages) > 1 and fewest < len(pipeline.stages):
            return fewest, len(pipeline.stages)
    return None


def _one_stage(strategy: Strategy, engine: Engine) -> bool:
    """Every pipeline is one stage, of chunks hetplan's runtime runs in turn, which an engine's own script does not
    interleave (Megatron refuses virtual stages without pipeline parallelism; torchtitan pipelines nothing); the
    user's own script (torchrun, e.g. hetplan's runtime) may."""
    return bool(engine.script) and all(len(pipeline.stages) == 1 for pipeline in strategy.pipelines)


def plan_vendors(cluster: ClusterSpec, strategy: Strategy) -> list[str]:
    """The vendors whose devices the plan trains on, sorted."""
    return sorted({cluster.group(s.group).device.vendor for p in strategy.pipelines for s in p.stages})


def engine_lost(
    strategy: Strategy,
    engine: Engine,
    training: TrainingSpec | None = None,
    predicted_as_run: bool = False,
    cluster: ClusterSpec | None = None,
) -> list[str]:
    """What of the plan the engine cannot express, one line each (empty: it runs the plan as planned). `training`:
    the plan's training, for its dtype (FP8 on an engine without an FP8 switch); `predicted_as_run`: the export's
    time is predicted in the dtype the engine trains in (else in the plan's, and the line says so); `cluster`: the
    plan's, for its vendors (an engine of one collective library runs one vendor's devices)."""
    lost: list[str] = []
    pipelines, stages = strategy.pipelines, [s for p in strategy.pipelines for s in p.stages]
    if cluster is not None and not engine.mixed_vendors and len(vendors := plan_vendors(cluster, strategy)) > 1:
        lost.append(
            f"vendors {', '.join(vendors)} in one job -> one vendor's devices: {engine.key} builds every process group "
            "with one collective library (NCCL, RCCL or HCCL), which does not reach another vendor's devices"
        )
    if len(pipelines) > 1 and not engine.pipeline_families:
        lost.append(f"{len(pipelines)} pipeline families with their own batch shares -> one family")
    if not engine.interleaving and strategy.virtual_stages > 1:
        lost.append(f"interleaved 1F1B with {strategy.virtual_stages} virtual stages -> plain 1F1B")
    elif strategy.virtual_stages > 1 and _one_stage(strategy, engine):
        lost.append(
            f"{strategy.virtual_stages} chunks of one pipeline stage -> plain 1F1B: {engine.key} interleaves the "
            "chunks of two or more stages"
        )
    elif short := _short_of_microbatches(strategy, engine):
        lost.append(
            f"interleaved 1F1B over {short[0]} micro-batches on {short[1]} stages -> plain 1F1B: {engine.key} "
            "interleaves groups of at least as many micro-batches as stages"
        )
    if not engine.uneven_layers and any(len({s.num_layers for s in p.stages}) > 1 for p in pipelines):
        lost.append("uneven layer split -> the same number of layers on every stage")
    if not engine.tensor_parallel and {s.tp for s in stages} != {1}:
        widths = ", ".join(str(t) for t in sorted({s.tp for s in stages}))
        lost.append(
            f"tensor parallelism (TP {widths}) -> TP 1: {engine.key}'s pipeline engine has no tensor parallelism "
            "(Megatron-DeepSpeed adds it through its own model-parallel unit)"
        )
    elif not engine.per_stage_tp and any(len({s.tp for s in p.stages}) > 1 for p in pipelines):
        tps = next(p for p in pipelines if len({s.tp for s in p.stages}) > 1)
        lost.append(f"per-stage TP ({', '.join(str(s.tp) for s in tps.stages)}) -> one TP degree")
    modes = {strategy.stage_recompute(s) for s in stages}
    if not engine.per_stage_recompute and len(modes) > 1:
        lost.append(f"per-stage recompute ({strategy.recompute_summary}) -> one mode for all stages")
    if unrun := [mode for mode in RECOMPUTE_MODES if mode in modes and mode not in engine.recompute_modes]:
        lost.append(
            f"{' and '.join(unrun)} recompute -> {' or '.join(engine.recompute_modes)}: {engine.key} runs only "
            f"{', '.join(engine.recompute_modes)}"
        )
    uneven = next((p for p in pipelines if p.uneven), None)
    if not engine.uneven_batch and uneven is not None:
        lost.append(
            f"uneven batch shares ({uneven.microbatch_total} micro-batches over {uneven.replicas} replicas) "
            "-> the same number of micro-batches on every replica"
        )
    if not engine.context_parallel and strategy.context_parallel > 1:
        lost.append(
            f"context parallelism (CP {strategy.context_parallel}) -> none: {engine.key} does not split sequences "
            "over ranks"
        )
    if not engine.hybrid_shard and strategy.zero_shard == "node" and strategy.zero_stage >= 1:
        lost.append(f"ZeRO sharding per node (hybrid) -> over the whole DP group: {engine.key} has no hybrid sharding")
    runs_zero = engine_zero_stage(strategy.zero_stage, engine)
    if runs_zero != strategy.zero_stage:
        lost.append(f"{_zero_words(strategy.zero_stage)} -> {_zero_words(runs_zero)}: {engine.zero_note}")
    if training is not None and training.dtype == "fp8" and not engine.fp8:
        predicted = "predicted in bf16" if predicted_as_run else "still predicted in FP8"
        lost.append(
            f"FP8 GEMMs -> bf16: {engine.key} has no FP8 switch (the export's time is {predicted}; "
            f"`hetplan plan --engine {engine.key}` plans in bf16)"
        )
    if training is not None and training.dtype == "fp16" and not engine.fp16:
        predicted = "predicted in fp32" if predicted_as_run else "still predicted in fp16"
        lost.append(
            f"fp16 -> fp32: {engine.key} has no fp16 mixed precision, only bf16 or fp32 (the export's time is "
            f"{predicted}; `hetplan plan --engine {engine.key}` plans within it: fp32 on every group or bf16 on the "
            "groups that have it, the faster)"
        )
    return lost


def engine_recompute(modes: tuple[Recompute, ...], engine: Engine) -> tuple[Recompute, ...]:
    """The recompute modes the engine runs of those allowed; when it runs none of them, those of its modes that
    save at least as much memory as the least the training allowed (selective alone -> full on DeepSpeed), else its
    most saving one."""
    kept = tuple(mode for mode in modes if mode in engine.recompute_modes)
    least = min(RECOMPUTE_MODES.index(mode) for mode in modes)
    saving = tuple(mode for mode in engine.recompute_modes if RECOMPUTE_MODES.index(mode) >= least)
    return kept or saving or (max(engine.recompute_modes, key=RECOMPUTE_MODES.index),)


MIXING_ENGINES = (
    "FlagScale's hetero mode and a torchrun script over hetplan's backend (comm/) mix vendors (--engine flagscale, "
    "--engine torchrun)"
)


def vendor_contexts(ctx: CostContext, engine: Engine) -> list[CostContext]:
    """The costs on each vendor's groups alone where the engine runs one collective library and the cluster's
    trainable groups have several vendors (the others are left idle); else `ctx` alone."""
    groups = ctx.cluster.trains_in(ctx.training.dtype) or ctx.cluster.groups
    vendors = sorted({group.device.vendor for group in groups})
    if engine.mixed_vendors or len(vendors) < 2:
        return [ctx]
    return [
        replace(ctx, cluster=replace(ctx.cluster, groups=tuple(g for g in groups if g.device.vendor == vendor)))
        for vendor in vendors
    ]


def vendors_note(cluster: ClusterSpec, strategy: Strategy, engine: Engine, dtype: str) -> str:
    """What a plan for an engine of one collective library leaves idle on a cluster of several vendors (of the groups
    that train in `dtype`: the others are idle by it, as a note of their own says); for the user's own script, how a
    plan over several vendors joins them; else ""."""
    used = plan_vendors(cluster, strategy)
    idle = [g.name for g in cluster.trains_in(dtype) if g.device.vendor not in used]
    if engine.mixed_vendors and not engine.script and len(used) > 1:
        return (
            f"the plan spans vendors {', '.join(used)}: build the process groups that cross them with hetplan's "
            "backend (comm.backend.register_backend(islands, simulated=False), then backend='hetplan'); one vendor's "
            "library (NCCL, RCCL, HCCL) does not reach the other's devices"
        )
    if engine.mixed_vendors or not idle:
        return ""
    return (
        f"{engine.key} trains on one vendor's devices ({', '.join(used)}): groups {', '.join(idle)} of other vendors "
        f"stay idle; {MIXING_ENGINES}"
    )


def _layout_update(training: TrainingSpec, engine: Engine) -> dict[str, object]:
    """The training's layout choices the engine cannot run, replaced: one family, even batches, plain 1F1B, the
    ZeRO stage and the recompute modes it has."""
    update: dict[str, object] = {}
    if (recompute := engine_recompute(training.recompute, engine)) != training.recompute:
        update["recompute"] = recompute
    if not engine.pipeline_families and training.families != "off":
        update["families"] = "off"
    if not engine.uneven_batch and training.uneven_batch != "off":
        update["uneven_batch"] = "off"
    if not engine.interleaving and training.virtual_stages != (1,):
        update["virtual_stages"] = (1,)
    if not engine.context_parallel and training.context_parallel != (1,):
        update["context_parallel"] = (1,)
    if not engine.hybrid_shard and training.zero_shard != "dp":
        update["zero_shard"] = "dp"
    if engine_zero_stage(training.zero_stage, engine) != training.zero_stage:
        update["zero_stage"] = engine_zero_stage(training.zero_stage, engine)
    return update


def engine_training(training: TrainingSpec, engine: Engine) -> tuple[TrainingSpec, list[str]]:
    """The training to plan with for an engine: its layout restricted (`_layout_update`), FP8 -> bf16 where the
    engine has no FP8 switch, the engine's kernels where the training does not name them; and what changed that the
    user chose, one line each (the layout restrictions are the engine's registry entry, not the user's choices);
    fp16 -> fp32 where the engine has no fp16 mixed precision."""
    update = _layout_update(training, engine)
    changed: list[str] = []
    if "zero_stage" in update:
        stage = engine_zero_stage(training.zero_stage, engine)
        changed.append(f"{_zero_words(training.zero_stage)} -> {_zero_words(stage)} ({engine.zero_note})")
    if "recompute" in training.model_fields_set and "recompute" in update:  # the user's choice, not the registry's
        asked, runs = ", ".join(training.recompute), ", ".join(engine.recompute_modes)
        chosen = ", ".join(engine_recompute(training.recompute, engine))
        changed.append(f"recompute {asked} -> {chosen} ({engine.key} runs only {runs})")
    dtype = engine_dtype(training.dtype, engine)
    if dtype != training.dtype:
        update["dtype"] = dtype
        changed.append(
            f"FP8 -> bf16 ({engine.key} has no FP8 switch)"
            if dtype == "bf16"
            else f"fp16 -> fp32 ({engine.key} has no fp16 mixed precision: bf16 or fp32)"
        )
    if engine.kernels and "engine" not in training.model_fields_set and training.engine != engine.kernels:
        update["engine"] = engine.kernels
        changed.append(f"predicted with {engine.kernels}'s kernels (training.engine: set it to keep another's)")
    return training.model_copy(update=update), changed


def _with_tp(pipeline: PipelineStrategy, tp: int) -> PipelineStrategy:
    """Every stage at one TP degree, packed from the start of each group."""
    stages = pack_stages((replace(s, tp=tp) for s in pipeline.stages), pipeline.replicas, pipeline.context_parallel)
    return replace(pipeline, stages=stages)


def _one_recompute(strategy: Strategy, mode: str) -> Strategy:
    pipeline = strategy.pipelines[0]
    stages = tuple(replace(s, recompute=None) for s in pipeline.stages)
    return replace(strategy, recompute=mode, pipelines=(replace(pipeline, stages=stages),))


def _even_batch(strategy: Strategy, global_batch: int) -> Strategy | None:
    """The most replicas (at most the plan's) that split the batch into equal whole micro-batches."""
    pipeline = strategy.pipelines[0]
    for replicas in range(pipeline.replicas, 0, -1):
        split = split_batch(global_batch, replicas, pipeline.micro_batch_size)
        if split and split[0] * replicas == split[1]:
            even = replace(pipeline, replicas=replicas, num_microbatches=split[0], total_microbatches=0)
            stages = pack_stages(pipeline.stages, even.replicas, even.context_parallel)
            return replace(strategy, pipelines=(replace(even, stages=stages),))
    return None


def near_plans(ctx: CostContext, strategy: Strategy, engine: Engine) -> list[Strategy]:
    """The plan itself with each part the engine cannot express replaced (one-family plans; several families are
    left to `engine_plans`)."""
    if len(strategy.pipelines) > 1:
        return []
    pipeline = strategy.pipelines[0]
    shard = strategy.zero_shard if engine.hybrid_shard else "dp"
    candidates = [replace(strategy, zero_stage=engine_zero_stage(strategy.zero_stage, engine), zero_shard=shard)]
    if not engine.interleaving and strategy.virtual_stages > 1:
        candidates = [replace(c, virtual_stages=1) for c in candidates]
    modes = {strategy.stage_recompute(s) for s in pipeline.stages}
    if (not engine.per_stage_recompute and len(modes) > 1) or not modes <= set(engine.recompute_modes):
        runs = engine_recompute(ctx.training.recompute, engine)  # of the modes the training allows
        candidates = [_one_recompute(c, mode) for c in candidates for mode in runs]
    widths = sorted({s.tp for s in pipeline.stages})
    if not engine.tensor_parallel:
        widths = [1]
    if widths != sorted({s.tp for s in pipeline.stages}) or (not engine.per_stage_tp and len(widths) > 1):
        candidates = [replace(c, pipelines=(_with_tp(c.pipelines[0], t),)) for c in candidates for t in widths]
    if not engine.uneven_batch and pipeline.uneven:
        candidates = [even for c in candidates if (even := _even_batch(c, ctx.training.global_batch_size))]
    # (after the batch is evened: 4 + 3 micro-batches on 4 stages become 7 on one replica, which interleave)
    plain = [_short_of_microbatches(c, engine) or _one_stage(c, engine) for c in candidates]
    candidates = [replace(c, virtual_stages=1) if p else c for c, p in zip(candidates, plain, strict=True)]
    return [c for c in candidates if not engine_lost(c, engine, cluster=ctx.cluster)]


def engine_search(
    ctx: CostContext,
    engine: Engine,
    options: SearchOptions = DEFAULT_OPTIONS,
    progress: ProgressCallback | None = None,
) -> SearchResult:
    """The planner's search within the engine's space: one family, even batches, one recompute mode, plain 1F1B,
    even layers and the ZeRO stage as the engine's flags require (`_layout_update`), interleaving only over as many
    micro-batches as stages where the engine's groups need them (SearchOptions.interleaving_groups_of_stages, in the
    candidates: a filter after the search lost the interleaved plans its best had outranked); without per-stage TP
    one search per TP degree any group can use, merged best first; an engine of one collective library searches each
    vendor's groups alone (vendor_contexts)."""
    if len(by_vendor := vendor_contexts(ctx, engine)) > 1:
        found = [engine_search(vendor_ctx, engine, options, progress) for vendor_ctx in by_vendor]
        return merge_results(found, options.top_k, lambda e: True)
    restricted = replace(ctx, training=ctx.training.model_copy(update=_layout_update(ctx.training, engine)))
    options = replace(
        options,
        per_stage_candidates=options.per_stage_candidates if engine.per_stage_recompute else 0,
        interleaving_groups_of_stages=engine.interleaving_groups_of_stages,
    )
    splitter = None if engine.uneven_layers else SPLITTERS["uniform"]
    widths: list[int | None] = [None] if engine.per_stage_tp else [1]
    if engine.tensor_parallel and not engine.per_stage_tp:
        widths = sorted({t for group in ctx.cluster.groups for t in tp_options(restricted, group)})
    results: list[SearchResult] = []
    for tp in widths:
        sources = restricted.sources if tp is None else {k: _FixedTp(v, tp) for k, v in restricted.sources.items()}
        results.append(search(replace(restricted, sources=sources), options, progress, splitter))
    return merge_results(results, options.top_k, lambda e: not engine_lost(e.strategy, engine, cluster=ctx.cluster))


def engine_plans(ctx: CostContext, engine: Engine) -> list[Strategy]:
    """The planner's best plans within the engine's space (engine_search), fastest first."""
    return [e.strategy for e in engine_search(ctx, engine).evaluations]


def _fastest_fitting(ctx: CostContext, candidates: list[Strategy]) -> Strategy | None:
    best, best_time = None, float("inf")
    for candidate in candidates:
        try:
            ctx.check_strategy(candidate, "export")
        except SpecError:
            continue
        evaluation = evaluate(ctx, candidate)
        if evaluation.fits and evaluation.iteration_time_s < best_time:
            best, best_time = candidate, evaluation.iteration_time_s
    return best


@dataclass(frozen=True)
class Closest:
    """What an engine runs of a plan: `strategy`, the fastest fitting plan it can run; `lost`, what of the plan it
    could not express; `near`, the plan with only those parts replaced (the fastest such that fits; None when none
    does). `strategy` is `near`, or the planner's best plan within the engine's space when that is faster."""

    strategy: Strategy
    lost: list[str]
    near: Strategy | None
    no_near: str = ""  # why `near` is None


def _no_near_plan(strategy: Strategy, candidates: list[Strategy], vendors: list[str], engine: Engine) -> str:
    """Why no plan with only the lost parts replaced runs: none can be built, or none fits memory."""
    if len(strategy.pipelines) > 1:
        return "a plan of several families has no one-family counterpart but the engine's own best plan"
    if len(vendors) > 1 and not engine.mixed_vendors:
        return f"a plan over {', '.join(vendors)} has no one-vendor counterpart but the engine's own best plan"
    if not candidates:
        return "no plan with only those parts replaced can be made (the engine has no stand-in for one of them)"
    return "no plan with only those parts replaced fits memory"


def closest(
    ctx: CostContext,
    strategy: Strategy,
    engine: Engine,
    keep_layout: bool = False,
    planned: TrainingSpec | None = None,
) -> Closest:
    """The plan as the engine can run it (Closest), each candidate judged in `ctx` (the plan's costs, or the same
    costs in the dtype and with the kernels the engine runs: planner.export); `planned`: the plan's training when
    ctx's is the engine's;
    `keep_layout`: only the plan with the lost parts replaced, never the engine's own best plan (a layout the user has
    validated stays as it is wherever the engine can express it)."""
    planned = planned or ctx.training
    cluster = ctx.cluster
    lost = engine_lost(strategy, engine, planned, planned.dtype != ctx.training.dtype, cluster)
    same_dtype = planned.dtype == ctx.training.dtype
    runs_as_planned = not engine_lost(strategy, engine, cluster=cluster)
    if runs_as_planned and (same_dtype or _fastest_fitting(ctx, [strategy]) is not None):
        return Closest(strategy, lost, strategy)  # at most the dtype is lost: the layout runs as planned
    candidates = near_plans(ctx, strategy, engine)
    near = _fastest_fitting(ctx, candidates)
    no_near = "" if near is not None else _no_near_plan(strategy, candidates, plan_vendors(cluster, strategy), engine)
    if keep_layout:
        if near is None:
            raise SpecError(
                "export",
                "plan",
                f"{no_near} ({'; '.join(lost)}): drop --keep-layout (keep_layout) for the engine's own plan",
            )
        return Closest(near, lost, near)
    searched = engine_plans(ctx.at_context_parallel(1), engine)
    if engine.context_parallel and strategy.context_parallel > 1:  # the engine's space at the plan's CP degree too
        searched += engine_plans(ctx.at_context_parallel(strategy.context_parallel), engine)
    chosen = _fastest_fitting(ctx, ([near] if near is not None else []) + searched)
    if chosen is None:
        raise SpecError("export", "plan", "no plan within the engine's limits fits memory: " + "; ".join(lost))
    return Closest(chosen, lost, near, no_near)
