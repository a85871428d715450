"""The planner's Python API: plan, predict."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from planner.engine_space import (
    MIXING_ENGINES,
    engine_search,
    engine_training,
    engine_zero_stage,
    vendor_contexts,
    vendors_note,
)
from planner.options import DEFAULT_OPTIONS, ProgressCallback, SearchOptions
from planner.plan import Bounds, Plan
from planner.search import BlockScans, SearchResult, fastest, merge_results, search, searches_families
from planner.yardsticks import compute_bound_tokens_per_s, group_alone_tokens_per_s
from predictor.context import check_dtype
from predictor.cost_model import (
    CostContext,
    Evaluation,
    build_context,
    evaluate,
    state_bytes_per_param,
    usable_memory_bytes,
)
from predictor.predictor import Predictor, default_predictor
from profiler.profile import DeviceProfile
from specs.cluster import ClusterSpec
from specs.engines import Engine, get_engine
from specs.errors import DoesNotFitError, SpecError, expect_argument, expect_list, wrong_argument
from specs.layout import ZERO_SHARDS, ZERO_STAGES, Strategy, split_batch, whole_number
from specs.model import ModelSpec, hf_sequence_note, hf_unmodelled_note
from specs.training import TrainingSpec, on_groups
from specs.units import GIB


def compute_bounds(ctx: CostContext) -> Bounds:
    """The yardsticks of a plan in this context: HETHUB's upper bound (each group's best plan alone) and the compute
    bound."""
    expect_argument(ctx, CostContext, "compute_bounds()", "ctx", "a CostContext: a plan's .context, or build_context()")
    per_group: dict[str, float] = {}
    scaled: list[str] = []
    for group in ctx.cluster.groups:
        tokens_per_s, was_scaled = group_alone_tokens_per_s(ctx, group, fastest)
        per_group[group.name] = tokens_per_s
        if was_scaled:
            scaled.append(group.name)
    return Bounds(sum(per_group.values()), compute_bound_tokens_per_s(ctx), per_group, tuple(scaled))


def plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    profiles: Mapping[str, DeviceProfile] | str | Path | None = None,  # a directory of profiles, or what it loads
    top_k: int = 1,
    progress: ProgressCallback | None = None,
    predictor: Predictor | str | Path | None = None,  # or a predictor file's path
    lower_bound: bool = False,
    engine: Engine | str | None = None,
    zero_stages: Sequence[int] = (),
    zero_shards: Sequence[str] = (),
    max_candidates: int = DEFAULT_OPTIONS.max_candidates,
) -> Plan:
    """The fastest strategy that fits memory, with its metrics, yardsticks and a 90% interval on its iteration
    time; raises DoesNotFitError. `predictor` defaults to the shipped one (`default_predictor()`). `lower_bound`:
    also the least iteration time any plan of the search space could reach (planner.search's root bound; about a
    second search's time on large clusters). `engine`: only plans that engine can run as planned (its export loses
    nothing); the training is restricted to it first (planner.engine_space.engine_training). `zero_stages`: search
    each of these ZeRO stages (the training's own when empty) and keep the fastest plan; the search statistics give
    each stage's best time. `zero_shards` ("dp", "node": hybrid sharding), likewise for every stage that shards.
    Context-parallel degrees come from the training (`context_parallel_degrees`: by sequence
    length unless chosen), one search each, likewise. `max_candidates`: the candidates a search solves before it
    stops and reports the least bound left (SearchOptions.max_candidates)."""
    if isinstance(engine, str):
        engine = get_engine(engine, "plan()", "engine")
    zero_stages, zero_shards = _check_plan_arguments(
        cluster, model, training, engine, top_k, max_candidates, zero_stages, zero_shards, progress
    )
    top_k, max_candidates = int(top_k), int(max_candidates)  # (numpy's integers as Python's: plans serialise them)
    profiles, predictor = _measured_costs(cluster, model, profiles, predictor)
    requested = training
    trainings, training_note, engine_changes = _trainings_to_search(training, cluster, engine)
    started = time.perf_counter()
    options = SearchOptions(top_k=top_k, root_bound=lower_bound, max_candidates=max_candidates)
    choices = _LayoutChoices(zero_stages, zero_shards)
    searches, failed = _search_dtypes(
        predictor, cluster, model, trainings, profiles, choices, options, progress, engine
    )
    found = min(searches, key=lambda s: s.best_time_s)
    search_time_s = time.perf_counter() - started
    training, result, ctx, base = found.context.training, found.result, found.context, found.base
    by_stage, by_cp, by_shard = found.by_stage, found.by_cp, found.by_shard
    if len(trainings) > 1:
        training_note = _dtype_choice_note(found, [s for s in searches if s is not found], failed, engine)
        if training.dtype != trainings[0].dtype:
            engine_changes = [c for c in engine_changes if not c.startswith("fp16 -> fp32")]
    elif found.idle_note:  # said of the devices that train (FP8 chosen: not of idle V100s)
        training_note = on_groups(requested, ctx.cluster.groups)[1]
    if not result.evaluations:
        raise _does_not_fit(model, cluster.name, found, zero_stages, engine)
    stats = {
        "configurations": result.configurations,
        "evaluated": result.evaluated,
        "memory_infeasible": result.memory_infeasible,
        "pruned_by_bound": result.configurations - result.evaluated,
        "family_partitions": result.family_partitions,
    }
    # the cluster file's nodes as planned, no change made since: read with a file whose groups have other nodes, the
    # plan is refused (planner.what_if.check_recorded_changes) rather than launched with nodes left idle; a cluster
    # renumbered by changes made through the API (planner.replan.changed_cluster) records its nodes alone
    if not any(group.node_ids for group in cluster.groups):
        stats["cluster_changes"] = []
    stats["cluster_nodes"] = {group.name: group.node_numbers for group in cluster.groups}
    if result.note:  # what the search did not cover (merged groups, the candidate budget), in one line
        stats["note"] = result.note
    if found.idle_note:  # groups that cannot train in the dtype: the plan leaves them idle
        stats["idle_note"] = found.idle_note
    if training_note:  # the dtype chosen for these devices (`hetplan plan` says it on stderr)
        stats["training_note"] = training_note.removeprefix("note: ")
    model_notes = (hf_sequence_note(model, requested), hf_unmodelled_note(model, requested.seq_length))
    if any(model_notes):  # a config.json's sequence length taken, what it sets and is not modelled (said on stderr)
        stats["model_notes"] = [note.removeprefix("note: ") for note in model_notes if note]
    if engine is not None:
        stats["engine"] = engine.key
        stats["engine_changes"] = engine_changes
    if "engine" in requested.model_fields_set:  # its kernels are the user's: an export keeps them (planner.export)
        stats["training_names_engine"] = True
    if len(by_stage) > 1:
        stats["zero_stages_s"] = by_stage
    if len(by_cp) > 1:
        stats["context_parallel_s"] = by_cp
    if len(by_shard) > 1:
        stats["zero_shard_s"] = by_shard
    best = result.evaluations[0]
    if engine is not None and (note := vendors_note(cluster, best.strategy, engine, training.dtype)):
        stats["engine_note"] = note  # one collective library: other vendors idle; the user's script: their bridge
    ctx = ctx.at_context_parallel(best.strategy.context_parallel)
    chosen = {"zero_stage": best.strategy.zero_stage, "zero_shard": best.strategy.zero_shard}
    if chosen != {"zero_stage": ctx.training.zero_stage, "zero_shard": ctx.training.zero_shard}:
        training = ctx.training.model_copy(update=chosen)  # the plan's training says how it shards
        ctx, base = replace(ctx, training=training), replace(base, training=training)
    interval = predictor.interval(base, best.strategy)
    alternatives = tuple(result.evaluations[1:])
    bounds = compute_bounds(ctx)  # of the groups that train (an idle group's own best plan is no yardstick)
    if found.idle_note:  # the plan's context is the whole cluster's: its idle groups hold no stage
        whole = predictor.context(cluster, model, training, profiles)
        ctx = whole.at_context_parallel(best.strategy.context_parallel)
    least = [s.result.lower_bound_s for s in searches if s.result.lower_bound_s is not None]  # over every dtype
    return Plan(ctx, best, bounds, search_time_s, stats, alternatives, interval, min(least, default=None))


def _does_not_fit(
    model: ModelSpec,
    cluster_name: str,
    found: _DtypeSearch,
    zero_stages: Collection[int],
    engine: Engine | None = None,
) -> DoesNotFitError:
    """Why nothing fit, in one line: the state alone against all the memory there is, else the closest strategy's
    shortfall, else the batch's shape; with the groups the dtype left idle, and an engine's one vendor at a time."""
    result, ctx, training = found.result, found.context, found.context.training
    idle = f" ({found.idle_note})" if found.idle_note else ""
    if engine is not None and len(vendor_contexts(ctx, engine)) > 1:  # (a model that fits the vendors together)
        idle += f"; {engine.key} trains on one vendor's devices at a time: {MIXING_ENGINES}"
    # first what no strategy can change: the state, every parameter once, against all the memory there is (the
    # closest strategy's shortfall then led to sharding remedies that leave it as it was)
    usable_groups = ctx.cluster.groups
    state = model.total_params() * state_bytes_per_param(ctx, dp=1)
    usable = sum(g.num_devices * usable_memory_bytes(ctx, g) for g in usable_groups)
    missing = (state - usable) / sum(g.num_devices for g in usable_groups)
    if missing > 0:
        return DoesNotFitError(
            f"{model.key} does not fit on cluster {cluster_name!r}: its weights, gradients and optimizer state "
            f"alone ({state / GIB:,.0f} GiB) need {missing / GIB:.1f} GiB more per device than the "
            f"{usable / GIB:,.0f} GiB usable in all; add devices{idle}",
            missing,
        )
    if result.smallest_shortfall_where:
        return DoesNotFitError(
            f"{model.key} does not fit on cluster {cluster_name!r}: the closest strategy "
            f"({result.smallest_shortfall_where}) needs {result.smallest_shortfall_bytes / GIB:.1f} GiB more "
            f"per device; {fit_remedies(training, zero_stages, engine)}{idle}",
            result.smallest_shortfall_bytes,
        )
    least = min(training.virtual_stages)
    chunks = f"; at least {least} on a stage of {least} virtual stages, --virtual-stages" if least > 1 else ""
    return DoesNotFitError(
        f"no strategy for {model.key} on cluster {cluster_name!r}: the global batch "
        f"{training.global_batch_size} must split into replicas x micro-batches, and stages need whole layers "
        f"({model.num_layers}{chunks}) and TP degrees dividing a node and the {model.num_kv_heads} kv heads{idle}",
        0.0,
    )


@dataclass(frozen=True)
class _DtypeSearch:
    """The search in one dtype: over the groups that can train in it (`idle_note` names the others)."""

    context: CostContext
    base: CostContext
    result: SearchResult
    by_stage: Times
    by_cp: Times
    by_shard: Times
    idle_note: str

    @property
    def best_time_s(self) -> float:
        return self.result.evaluations[0].iteration_time_s if self.result.evaluations else float("inf")


def groups_with_dtype(
    cluster: ClusterSpec, training: TrainingSpec, every_group: str = "fp16"
) -> tuple[ClusterSpec, str]:
    """The cluster's groups that can train in the training's dtype, and a note naming those left idle and the dtype
    in which every group trains (bf16 where every group has it, else `every_group`, the engine's other dtype; "" when
    every group can); none can: refused in one line (predictor.context.check_dtype)."""
    trains = cluster.trains_in(training.dtype)
    lacking = [group for group in cluster.groups if group not in trains]
    if not lacking:
        return cluster, ""
    if not trains:
        check_dtype(cluster, training)  # raises, naming the first
    devices = sum(group.num_devices for group in lacking)
    names = ", ".join(group.name for group in lacking)
    why = "; ".join(dict.fromkeys(group.device.lacks_dtype(training.dtype) for group in lacking))
    choices = [dtype for dtype in dict.fromkeys(("bf16", every_group)) if dtype != training.dtype]
    everyone = next((d for d in choices if not any(g.device.lacks_dtype(d) for g in cluster.groups)), "")
    note = f"{names} ({devices} devices) left idle: {why}"
    note += f"; in {everyone} every group can train (--dtype {everyone})" if everyone else ""
    return replace(cluster, groups=trains), note


def _search_in_dtype(
    predictor: Predictor,
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    profiles: Mapping[str, DeviceProfile] | None,
    choices: _LayoutChoices,
    options: SearchOptions,
    progress: ProgressCallback | None,
    engine: Engine | None,
) -> _DtypeSearch:
    """The layout search (_search_layout_options) on the groups that can train in the training's dtype."""
    usable, idle_note = groups_with_dtype(cluster, training, "fp16" if engine is None or engine.fp16 else "fp32")
    base = predictor.base_context(usable, model, training, profiles)
    ctx = predictor.context(usable, model, training, profiles)
    result, by_stage, by_cp, by_shard = _search_layout_options(ctx, choices, options, progress, engine)
    return _DtypeSearch(ctx, base, result, by_stage, by_cp, by_shard, idle_note)


def _trainings_to_search(
    training: TrainingSpec, cluster: ClusterSpec, engine: Engine | None
) -> tuple[list[TrainingSpec], str, list[str]]:
    """The trainings to search (the training on these devices, for the engine; where the engine has no fp16 and no
    dtype was chosen, bf16 on the groups that have it too), the note on the dtype and the engine's changes."""
    dtype_chosen = "dtype" in training.model_fields_set
    training, training_note = on_groups(training, cluster.groups)  # as `hetplan plan` trains on these devices
    if engine is None:
        return [training], training_note, []
    planned, engine_changes = engine_training(training, engine)
    trainings = [planned]
    bf16_somewhere = bool(cluster.trains_in("bf16"))
    if not dtype_chosen and training.dtype == "fp16" and planned.dtype == "fp32" and bf16_somewhere:
        trainings.append(planned.model_copy(update={"dtype": "bf16"}))  # no fp16 on the engine: bf16 too
    return trainings, training_note, engine_changes


def _search_dtypes(
    predictor: Predictor,
    cluster: ClusterSpec,
    model: ModelSpec,
    trainings: Sequence[TrainingSpec],
    profiles: Mapping[str, DeviceProfile] | None,
    choices: _LayoutChoices,
    options: SearchOptions,
    progress: ProgressCallback | None,
    engine: Engine | None,
) -> tuple[list[_DtypeSearch], list[tuple[str, SpecError]]]:
    """A search per training (_search_in_dtype), and the dtypes whose costs could not be made (a profile's or a
    device's), with why: the other dtype's plan stands; one training, or none left, raises."""
    searches: list[_DtypeSearch] = []
    failed: list[tuple[str, SpecError]] = []
    for each in trainings:
        try:
            searches.append(_search_in_dtype(predictor, cluster, model, each, profiles, choices, options, progress,
                                             engine))  # fmt: skip
        except SpecError as error:
            if len(trainings) == 1:
                raise
            failed.append((each.dtype, error))
    if not searches:
        raise failed[0][1]
    return searches, failed


def _dtype_choice_note(
    found: _DtypeSearch, others: Sequence[_DtypeSearch], failed: Sequence[tuple[str, SpecError]], engine: Engine | None
) -> str:
    """Why the plan trains in its dtype where the engine has no fp16: the faster of fp32 on every group and bf16 on
    the groups that have it, with the other's time (or why it could not be planned)."""

    def where(search: _DtypeSearch) -> str:
        return (
            f"{search.context.training.dtype} {'on the groups that have it' if search.idle_note else 'on every group'}"
        )

    engine_key = engine.key if engine is not None else "the engine"
    said = [f"{where(s)}: {f'{s.best_time_s:.3f} s' if s.result.evaluations else 'nothing fits'}" for s in others]
    said += [f"{dtype}: cannot be planned ({error})" for dtype, error in failed]
    return (
        f"training in {where(found)} ({engine_key} has no fp16 mixed precision; {'; '.join(said)}); set dtype or "
        "--dtype to choose"
    )


def fit_remedies(training: TrainingSpec, zero_stages: Collection[int] = (), engine: Engine | None = None) -> str:
    """What would let a model fit that the training and the search (`zero_stages`; none: the training's stage) do not
    already allow, as one clause ('add devices, allow full recompute (--recompute none,selective,full) or shorten the
    sequence (--seq-len)'): advice to allow full recompute or ZeRO-1 misleads where both are allowed, as by default;
    ZeRO-3 where a plan's `engine` has none (Megatron's ZeRO-3 runs as its distributed optimizer) too."""
    searched = set(zero_stages) or {training.zero_stage}
    if engine is not None and 3 not in engine.zero_stages:
        searched |= {3}  # (nothing to suggest: the engine shards no weights)
    remedies = ["add devices"]
    if "full" not in training.recompute:
        remedies.append("allow full recompute (--recompute none,selective,full)")
    if searched == {0}:
        remedies.append("use ZeRO-1 (--zero-stage 1)")
    if 3 not in searched:  # ZeRO-3 shards the weights too
        remedies.append("shard gradients and weights too (--zero-stage 3)")
    if training.dtype == "fp32":  # the CPU's default: half the bytes per value
        remedies.append("train in 16 bits (--dtype bf16, or fp16)")
    if min(training.micro_batch_sizes) > 1:
        remedies.append("allow micro-batch 1 (--micro-batch-sizes 1,...)")
    remedies.append("shorten the sequence (--seq-len)")
    return ", ".join(remedies[:-1]) + " or " + remedies[-1]


def check_spec_arguments(function: str, cluster: object, model: object, training: object) -> None:
    """The cluster, model and training a planning function takes, each named in one line where it is not a loaded
    spec (a path or a dict failed deep inside with an AttributeError)."""
    expect_argument(cluster, ClusterSpec, function, "cluster", "a ClusterSpec: specs.load_cluster(path)")
    expect_argument(model, ModelSpec, function, "model", "a ModelSpec: specs.load_model(name or path)")
    taken = "a TrainingSpec: specs.load_training(path or None, overrides)"
    expect_argument(training, TrainingSpec, function, "training", taken)


def _check_plan_arguments(
    cluster: object,
    model: object,
    training: object,
    engine: object,
    top_k: object,
    max_candidates: object,
    zero_stages: Sequence[object],
    zero_shards: Sequence[object],
    progress: object,
) -> tuple[list[int], list[str]]:
    """plan()'s arguments, each named in one line where it is not what plan() takes (a path where a loaded spec is
    expected failed deep inside with an AttributeError; zero_stages=[5] planned a 'zero-5' its own loader refuses);
    the ZeRO stages and shards to search as Python's ints and strings (read once: a generator is taken too)."""
    check_spec_arguments("plan()", cluster, model, training)
    training.check_micro_batches("plan()", "training.micro_batch_sizes")  # type: ignore[attr-defined]
    expect_list(zero_stages, "plan()", "zero_stages", "a list of ZeRO stages among 0, 1, 2, 3 (e.g. [1, 3])")
    expect_list(zero_shards, "plan()", "zero_shards", f"a list of ZeRO shards among {', '.join(ZERO_SHARDS)}")
    if progress is not None and not callable(progress):
        raise wrong_argument(progress, "plan()", "progress", "a function of the search's progress, or None")
    if engine is not None and not isinstance(engine, Engine):
        raise SpecError("plan()", "engine", f"expected an engine name or specs.get_engine(name), got {engine!r:.60}")
    for field, value in (("top_k", top_k), ("max_candidates", max_candidates)):
        if whole_number(value) is None or value < 1:  # type: ignore[operator]
            raise SpecError("plan()", field, f"expected a whole number >= 1, got {value!r}")
    stages, shards = list(zero_stages), list(zero_shards)
    for stage in stages:
        if whole_number(stage) not in ZERO_STAGES:  # (numpy's integers too; 1.0 is not a stage)
            raise SpecError("plan()", "zero_stages", f"expected ZeRO stages among 0, 1, 2, 3, got {stage!r}")
    for shard in shards:
        if shard not in ZERO_SHARDS:
            raise SpecError("plan()", "zero_shards", f"expected some of {', '.join(ZERO_SHARDS)}, got {shard!r}")
    return [int(stage) for stage in stages], [str(shard) for shard in shards]  # type: ignore[call-overload]


def _measured_costs(
    cluster: ClusterSpec, model: ModelSpec, profiles: object, predictor: object
) -> tuple[Mapping[str, DeviceProfile] | None, Predictor]:
    """plan()'s profiles and predictor as loaded: a directory of profiles and a predictor file are read as `hetplan
    plan --profiles DIR --predictor FILE` reads them; anything else but the loaded kinds is named in one line."""
    from predictor.predictor import load_predictor
    from profiler.profiles import load_profiles

    if isinstance(profiles, (str, Path)):
        profiles = load_profiles(Path(profiles), model, {group.device.key for group in cluster.groups})
    if profiles is not None and not (
        isinstance(profiles, Mapping) and all(isinstance(p, DeviceProfile) for p in profiles.values())
    ):
        taken = "a directory of profile files, or profiler.profiles.load_profiles(DIR, model) (key -> DeviceProfile)"
        raise wrong_argument(profiles, "plan()", "profiles", taken)
    if isinstance(predictor, (str, Path)):
        predictor = load_predictor(Path(predictor))
    if predictor is not None:
        expect_argument(predictor, Predictor, "plan()", "predictor", "a predictor file, or load_predictor(path)")
    return profiles, predictor or default_predictor()  # type: ignore[return-value]


@dataclass(frozen=True)
class _LayoutChoices:
    """The ZeRO stages and shard groups a plan searches (the training's own where empty)."""

    zero_stages: Sequence[int]
    zero_shards: Sequence[str]


Times = dict[str, float | None]


def _search_layout_options(
    ctx: CostContext,
    choices: _LayoutChoices,
    options: SearchOptions,
    progress: ProgressCallback | None,
    engine: Engine | None,
) -> tuple[SearchResult, Times, Times, Times]:
    """One search per context-parallel degree, ZeRO stage and shard group, each started from the best plans so far
    regrouped to its degree and run at its stage (a feasible incumbent, so an option that cannot win is pruned early),
    merged best first; and the best time of each stage, degree and shard group (None: nothing fits)."""
    training = ctx.training
    stages = [engine_zero_stage(s, engine) if engine else s for s in choices.zero_stages] or [training.zero_stage]
    shards = list(choices.zero_shards) or [training.zero_shard]
    training.check_context_parallel(ctx.seq_length)
    degrees = training.context_parallel_degrees(ctx.seq_length)
    if engine is not None:
        degrees = degrees if engine.context_parallel else (1,)
        shards = shards if engine.hybrid_shard else ["dp"]
    layouts = [(d, s, h) for d in degrees for s in dict.fromkeys(stages) for h in dict.fromkeys(shards)]
    layouts = [(d, s, h) for d, s, h in layouts if s or h == shards[0]]  # ZeRO-0 shards nothing: one shard group
    results: list[SearchResult] = []
    block_scans = BlockScans()  # the family searches' block scans, shared by every layout's search
    by_stage: Times = {}
    by_cp: Times = {}
    by_shard: Times = {}
    for degree, stage, shard in layouts:
        sharding = {"zero_stage": stage, "zero_shard": shard}
        staged = replace(ctx, training=training.model_copy(update=sharding)).at_context_parallel(degree)
        leaders = [e.strategy for r in results for e in r.evaluations[:1]]
        adapted = [s for s in (at_degree(staged, lead, degree) for lead in leaders) if s is not None]
        warm = [e for s in adapted if (e := evaluate(staged, _at_stage(s, stage, shard))).fits]
        if engine is None:
            found = search(staged, options, progress, warm_start=warm, block_scans=block_scans)
        else:
            found = engine_search(staged, engine, options, progress)
        layout = (stage, shard, degree)
        own = [e.iteration_time_s for e in found.evaluations if _layout(e.strategy) == layout]
        best = own[0] if own else None
        for times, key in ((by_stage, str(stage)), (by_cp, str(degree)), (by_shard, shard)):
            times[key] = _least(times.get(key), best)
        results.append(found)
    if engine is None and len(set(stages)) > 1 and searches_families(ctx):
        # families whose blocks each pick their own stage (a memory-poor device type may want ZeRO-3, a memory-rich
        # one ZeRO-1): one more search per degree and shard group, started from the best plan so far
        for degree, shard in dict.fromkeys((d, h) for d, _, h in layouts):
            sharding = {"zero_stage": stages[0], "zero_shard": shard}
            staged = replace(ctx, training=training.model_copy(update=sharding)).at_context_parallel(degree)
            ranked = merge_results(results, 1).evaluations
            warm = [e for e in ranked if _layout(e.strategy)[1:] == (shard, degree)]
            per_family = replace(options, family_zero_stages=tuple(dict.fromkeys(stages)))
            found = search(staged, per_family, progress, warm_start=warm, block_scans=block_scans)
            mixed = [e.iteration_time_s for e in found.evaluations if _layout(e.strategy)[0] < 0]
            if mixed:
                by_stage["per family"] = _least(by_stage.get("per family"), mixed[0])
            results.append(found)
    if len(results) == 1:
        return results[0], by_stage, by_cp, by_shard
    return merge_results(results, options.top_k), by_stage, by_cp, by_shard


def _at_stage(strategy: Strategy, stage: int, shard: str) -> Strategy:
    """The strategy with every family at one ZeRO stage and shard group."""
    pipelines = tuple(replace(p, zero_stage=None) for p in strategy.pipelines)
    return replace(strategy, pipelines=pipelines, zero_stage=stage, zero_shard=shard)


def _layout(strategy: Strategy) -> tuple[int, str, int]:
    """(ZeRO stage, or -1 where families run their own, shard group, CP degree)."""
    stages = {strategy.family_zero_stage(p) for p in strategy.pipelines}
    stage = stages.pop() if len(stages) == 1 else -1
    return stage, strategy.zero_shard, strategy.context_parallel


def at_degree(ctx: CostContext, strategy: Strategy, degree: int) -> Strategy | None:
    """The strategy on the same devices at another context-parallel degree: each family's replicas x CP ranks
    regrouped into replicas of `degree` ranks (same stages, micro-batch and device offsets), when they divide, the
    batch still splits evenly and the layout is valid; else None. The search's incumbent from a neighbouring degree."""
    pipelines = []
    for pipeline in strategy.pipelines:
        ranks = pipeline.gradient_ranks
        if ranks % degree or pipeline.uneven:
            return None
        replicas = ranks // degree
        split = split_batch(pipeline.samples, replicas, pipeline.micro_batch_size)
        if split is None or split[0] * replicas != split[1]:
            return None
        pipelines.append(replace(pipeline, replicas=replicas, num_microbatches=split[0], context_parallel=degree))
    adapted = replace(strategy, pipelines=tuple(pipelines))
    try:
        ctx.check_strategy(adapted)
    except SpecError:
        return None
    return adapted


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def predict(ctx: CostContext, strategy: Strategy, source: str = "strategy") -> Evaluation:
    """Evaluate a given strategy without searching (what-if)."""
    expect_argument(ctx, CostContext, "predict()", "ctx", "a CostContext: planner.build_context(cluster, model, "
                    "training), or a Plan's .context")  # fmt: skip
    taken = "a Strategy (a loaded plan's or a Plan's .strategy)"
    expect_argument(strategy, Strategy, "predict()", "strategy", taken)
    ctx.check_strategy(strategy, source)
    return evaluate(ctx, strategy)


__all__ = ["build_context", "compute_bounds", "plan", "predict"]
