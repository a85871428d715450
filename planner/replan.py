"""Re-planning after failures or additions: change the cluster, adapt the old plan, search warm-started from it.

The old strategy is shrunk to the new cluster (`shrink`): every pipeline family keeps its stages, TP degrees and layer
split and lowers its replica count until its groups have the devices (the batch split over the replicas in whole
micro-batches); several families then split the batch again by their speeds. If that fits memory it seeds the
search's incumbent, so the bounds prune from the first candidate and the result is never worse than the shrunk plan
(and still the optimum of the search space); if not, Replan.not_adapted says why in one line. The search tries every
uneven batch split (after a failure the cluster rarely divides the batch) and families where the cluster has them.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.engine_space import engine_lost, engine_search, engine_training, vendors_note
from planner.families import _block_context, _block_plans, combine, split_batch_across
from planner.plan import Plan
from planner.planning import check_spec_arguments, compute_bounds, groups_with_dtype
from planner.search import merge_results, search
from predictor.cost_model import CostContext, Evaluation, evaluate
from predictor.predictor import Predictor, default_predictor
from specs.cluster import ClusterSpec
from specs.engines import Engine, get_engine
from specs.errors import DoesNotFitError, HetplanError, SpecError, expect_argument, expect_list
from specs.layout import PipelineStrategy, Strategy, devices_per_group, pack_stages, split_batch, split_pipeline
from specs.model import ModelSpec
from specs.training import TrainingSpec

if TYPE_CHECKING:
    from profiler.profile import DeviceProfile

CHANGE = re.compile(
    r"^(?:node:(?P<node_group>[\w.-]+)/(?:node)?(?P<node>-?\d+)|group:(?P<group>[\w.-]+):(?P<count>-?\d+))$"
)


def node_ranges(numbers: list[int]) -> str:
    """Node numbers as runs: 0..16, 18..77."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


CHANGE_FLAGS = ("--without", "--add")  # `hetplan replan`'s names of changed_cluster's lists, as its errors say them


def changed_cluster(
    cluster: ClusterSpec,
    without: Sequence[str],
    add: Sequence[str],
    earlier: Sequence[tuple[Sequence[str], Sequence[str]]] = (),
    names: tuple[str, str] = ("changed_cluster(): without", "changed_cluster(): add"),
) -> ClusterSpec:
    """Remove nodes (`node:GROUP/NUMBER`, the cluster file's number of the node, or `group:NAME:COUNT`, the last
    ones) and add nodes (`group:NAME:COUNT`, numbered after the highest left or lost by number: a node lost by number
    keeps it, a count taken from the tail is given back by adding as many); each group keeps the numbers of its
    nodes (DeviceGroup.node_ids), so a launch runs on the nodes that are left. `earlier`: the (without, add) changes a
    re-planned plan records (LoadedPlan.cluster_changes), applied first to `cluster`, the cluster file's: a node lost
    by number in any of them keeps its number. `names`: what errors call `without` and `add` (the CLI: its flags)."""
    expect_argument(cluster, ClusterSpec, "changed_cluster()", "cluster", "a ClusterSpec: specs.load_cluster(path)")
    for argument, given in (("without", without), ("add", add)):
        expect_list(given, "changed_cluster()", argument, "a list of node:GROUP/NUMBER or group:NAME:COUNT")
        for item in given:
            expect_argument(item, str, "changed_cluster()", argument, "node:GROUP/NUMBER or group:NAME:COUNT items")
    numbers = {group.name: group.node_numbers for group in cluster.groups}
    lost: dict[str, list[int]] = {group.name: [] for group in cluster.groups}
    for earlier_without, earlier_add in earlier:
        _change_nodes(numbers, lost, earlier_without, earlier_add, names)
    _change_nodes(numbers, lost, without, add, names)
    groups = tuple(group.with_node_numbers(numbers[group.name]) for group in cluster.groups if numbers[group.name])
    if not groups:
        raise SpecError(names[0], "", "no nodes would be left")
    return dataclasses.replace(cluster, groups=groups)


def _change_nodes(
    numbers: dict[str, list[int]],
    lost: dict[str, list[int]],
    without: Sequence[str],
    add: Sequence[str],
    names: tuple[str, str],
) -> None:
    """changed_cluster's changes to each group's node numbers (`numbers`), the numbers lost so far kept in `lost`;
    `names`: what errors call `without` and `add`."""
    for flag, items, sign in ((names[0], without, -1), (names[1], add, 1)):
        for item in items:
            match = CHANGE.match(item)
            if match is None or (sign > 0 and match["node_group"]):
                form = "node:GROUP/NUMBER or group:NAME:COUNT" if sign < 0 else "group:NAME:COUNT"
                raise SpecError(flag, item, f"expected {form}")
            name = match["node_group"] or match["group"]
            if name not in numbers:
                raise SpecError(flag, item, f"no group {name!r}; groups: {', '.join(numbers)}")
            nodes = len(numbers[name])
            if match["node"] is not None and int(match["node"]) not in numbers[name]:
                raise SpecError(flag, item, f"group {name!r} has nodes {node_ranges(numbers[name]) or '(none left)'}")
            if match["node"] is None and int(match["count"]) < 1:  # a sign or a zero is a slip, not a change
                counts = f"from 1 to {nodes} (the nodes group {name!r} has)" if sign < 0 else "of at least 1"
                raise SpecError(flag, item, f"expected a count of nodes {counts}, got {match['count']}")
            if sign < 0 and match["node"] is None and int(match["count"]) > nodes:
                raise SpecError(flag, item, f"group {name!r} has only {nodes} node{'s' if nodes != 1 else ''}")
            if match["node"] is not None:
                numbers[name].remove(int(match["node"]))
                lost[name].append(int(match["node"]))
            elif sign < 0:  # the last ones, by count (not by number: adding as many back cancels it out)
                del numbers[name][nodes - int(match["count"]) :]
            else:
                highest = max([*numbers[name], *lost[name]], default=-1)
                numbers[name] += range(highest + 1, highest + 1 + int(match["count"]))


def cancelled_changes(cluster: ClusterSpec, changed: ClusterSpec, without: list[str], add: list[str]) -> list[str]:
    """The groups that both --without and --add change and that keep their nodes, one phrase each ("--without
    group:v100:1 and --add group:v100:1 cancel out (group v100 keeps its 2 nodes)"); changes that leave every group
    as it was are refused: the cluster is the one the plan was made for, so there is nothing to re-plan."""
    numbers_after = {group.name: group.node_numbers for group in changed.groups}
    phrases = []
    for group in cluster.groups:
        removed = [f"--without {item}" for item in without if _group_named(item) == group.name]
        added = [f"--add {item}" for item in add if _group_named(item) == group.name]
        if removed and added and numbers_after.get(group.name) == group.node_numbers:  # (not a node replaced)
            phrases.append(f"{' and '.join(removed + added)} cancel out (group {group.name} keeps its {group.nodes} "
                           f"node{'s' if group.nodes > 1 else ''})")  # fmt: skip
    if changed == cluster and all(numbers_after.get(g.name) == g.node_numbers for g in cluster.groups):
        raise SpecError("--without/--add", "", f"{'; '.join(phrases)}: the cluster is unchanged (nothing to re-plan)")
    return phrases


def _group_named(change: str) -> str:
    """The group a change (`node:GROUP/NUMBER` or `group:NAME:COUNT`, checked by changed_cluster) names."""
    match = CHANGE.match(change)
    return (match["node_group"] or match["group"]) if match is not None else ""


@dataclass(frozen=True)
class Shrunk:
    """The old plan on the changed cluster: its evaluation if it can run there, else why not (one line)."""

    evaluation: Evaluation | None
    reason: str = ""


def _shrunk_pipelines(
    ctx: CostContext, strategy: Strategy, index: int, samples: int, reasons: list[str]
) -> Iterator[PipelineStrategy]:
    """Family `index` with its stages and fewer and fewer replicas (from the old count) that its groups hold, with
    `samples` of the batch in whole micro-batches; why the others fail goes to `reasons`."""
    pipeline = strategy.pipelines[index]
    groups = {g.name: g for g in ctx.cluster.groups}
    gone = sorted({s.group for s in pipeline.stages if s.group not in groups})
    if gone:
        reasons.append(f"group {gone[0]} has no nodes left and the old plan has stages there")
        return
    b = pipeline.micro_batch_size
    for replicas in range(pipeline.replicas, 0, -1):
        split = split_batch(samples, replicas, b)
        if split is None:
            reasons.append(f"{samples} samples do not split over {replicas} replicas of micro-batch {b}")
            continue
        cp = pipeline.context_parallel
        shrunk = split_pipeline(replicas, b, pack_stages(pipeline.stages, replicas, cp), *split, cp)
        used = devices_per_group(dataclasses.replace(strategy, pipelines=(shrunk,)))
        short = [name for name, end in used.items() if end > groups[name].num_devices]
        if short:
            name = short[0]
            reasons.append(
                f"group {name} keeps {groups[name].num_devices} devices, fewer than the old stages need for "
                f"{replicas} replica{'s' if replicas > 1 else ''} ({used[name]})"
            )
            continue
        yield shrunk


def _fits(ctx: CostContext, candidate: Strategy, reasons: list[str]) -> Evaluation | None:
    """The candidate's evaluation if it is valid and fits memory (else why not goes to `reasons`)."""
    try:
        ctx.check_strategy(candidate)
    except HetplanError as error:
        reasons.append(f"the shrunk plan is not valid: {error}")
        return None
    evaluation = evaluate(ctx, candidate)
    if evaluation.fits:
        return evaluation
    worst = max(evaluation.stages, key=lambda stage: stage.shortfall_bytes)
    reasons.append(
        f"with {worst.stage.group}'s replicas left, a stage there needs {worst.shortfall_bytes / 2**30:.1f} GiB more "
        "per device (its optimizer state is sharded over fewer replicas)"
    )
    return None


def _family_models(ctx: CostContext, strategy: Strategy) -> list[Evaluation]:
    """Each family of a strategy evaluated alone on its groups with its samples (for the batch split)."""
    alone = []
    for pipeline in strategy.pipelines:
        samples = pipeline.samples
        block = [ctx.cluster.group(name) for name in dict.fromkeys(s.group for s in pipeline.stages)]
        alone.append(
            evaluate(_block_context(ctx, block, samples), dataclasses.replace(strategy, pipelines=(pipeline,)))
        )
    return alone


def shrink(ctx: CostContext, strategy: Strategy) -> Shrunk:
    """The old plan on the changed cluster: each family keeps its stages, TP degrees and layer split and runs as many
    replicas as its groups keep (one family: the most that fit, memory included); several families then split the
    batch again by their speeds with the replicas they keep (planner.families)."""
    reasons: list[str] = []
    batch = ctx.training.global_batch_size
    if len(strategy.pipelines) == 1:
        for pipeline in _shrunk_pipelines(ctx, strategy, 0, batch, reasons):
            evaluation = _fits(ctx, dataclasses.replace(strategy, pipelines=(pipeline,)), reasons)
            if evaluation is not None:
                return Shrunk(evaluation)
        return Shrunk(None, reasons[-1] if reasons else "the old plan has no replica left")
    pipelines = []
    for index, pipeline in enumerate(strategy.pipelines):
        samples = pipeline.samples
        shrunk = next(_shrunk_pipelines(ctx, strategy, index, samples, reasons), None)
        if shrunk is None:
            return Shrunk(None, f"family {index}: {reasons[-1]}")  # numbered from 0, as plan and explain do
        pipelines.append(shrunk)
    plans = _block_plans(_family_models(ctx, dataclasses.replace(strategy, pipelines=tuple(pipelines))))
    split = split_batch_across(batch, [[plan] for plan in plans])
    if split is None:
        return Shrunk(None, "the batch no longer splits across the families in whole micro-batches")
    evaluation = _fits(ctx, combine(ctx, plans, split[1]), reasons)
    return Shrunk(evaluation, "" if evaluation is not None else reasons[-1])


def adapt_strategy(ctx: CostContext, strategy: Strategy) -> Evaluation | None:
    """The old stages with as many replicas as the new cluster holds (and the batch divides), if that fits."""
    return shrink(ctx, strategy).evaluation


@dataclass(frozen=True)
class Replan:
    plan: Plan
    adapted: Evaluation | None  # the old plan on the new cluster, if it could run there
    replan_time_s: float
    not_adapted: str = ""  # why the old plan cannot run on the new cluster (one line; empty when it can)
    adapted_engine_lost: tuple[str, ...] = ()  # what of the shrunk old plan the plan's engine cannot run


def _check_replan_arguments(
    cluster: object, model: object, training: object, old: object, predictor: object, previous: object, engine: object
) -> None:
    """replan()'s arguments, each named in one line where it is not what replan() takes (a path or a loaded plan
    where a spec or a strategy is expected failed deep inside with an AttributeError)."""
    check_spec_arguments("replan()", cluster, model, training)
    expect_argument(old, Strategy, "replan()", "old", "a Strategy: the old Plan's .strategy, or load_plan(p).strategy")
    optional = (
        ("predictor", predictor, Predictor, "a Predictor: predictor.load_predictor(path), or None for the shipped one"),
        ("previous", previous, CostContext, "the old Plan's .context (a CostContext), or None"),
        ("engine", engine, Engine, "an engine name or specs.get_engine(name), or None"),
    )
    for field, value, kind, what in optional:
        if value is not None:
            expect_argument(value, kind, "replan()", field, what)


def replan(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    old: Strategy,
    predictor: Predictor | None = None,
    previous: CostContext | None = None,
    profiles: Mapping[str, DeviceProfile] | None = None,
    engine: Engine | str | None = None,
    training_names_engine: bool = False,
    cluster_changes: Sequence[tuple[Sequence[str], Sequence[str]]] | None = None,
) -> Replan:
    """Plan again on a changed cluster, warm-started from the old strategy, at the training's context-parallel degrees
    and the old plan's, over every uneven batch split
    (`uneven_batch: exhaustive`): after a failure the cluster rarely divides the batch evenly. `previous`: the old
    plan's context (Plan.context, for a caller that keeps the planner running, as a scheduler would): the new context
    shares its cost sources (the change only moves nodes), so the search reuses the row tables of the groups the
    change did not touch (tp_rows.row_tables). `profiles`: measured profiles by device key (the old plan's, as it
    records them: planner.cost_source). `engine`: the engine the old plan was made for (`plan --engine`, its
    `search.engine`): the new plan stays within what that engine runs as planned (planner.engine_space.engine_search,
    without the warm start, which is the unrestricted search's). `training_names_engine`: the old plan's training named
    its kernels (LoadedPlan.training_names_engine): the new plan records it, so an export keeps them.
    `cluster_changes`: the (without, add) changes from the cluster file to `cluster`, in order (the old plan's and
    this one's): the new plan records them and the nodes they leave by number, so the commands reading it with the
    cluster file run it on those nodes (planner.what_if.recorded_cluster); None (the default): the changes from the
    file are not known (a caller's own cluster, or a torchrun export's plan.json made before plans recorded them): the
    new plan records its nodes alone."""
    if isinstance(engine, str):  # by name, as plan() takes it
        engine = get_engine(engine, "replan()", "engine")
    _check_replan_arguments(cluster, model, training, old, predictor, previous, engine)
    predictor = predictor or default_predictor()
    training = training.model_copy(update={"uneven_batch": "exhaustive"})
    if engine is not None:  # what the engine can run (uneven batches only where it has them), as the plan records it
        training = engine_training(training, engine)[0]
    every_group = "fp16" if engine is None or engine.fp16 else "fp32"
    nodes = {group.name: group.node_numbers for group in cluster.groups}  # by the file's numbers (idle groups too)
    cluster, idle_note = groups_with_dtype(cluster, training, every_group)  # a bf16 plan leaves V100s idle
    started = time.perf_counter()
    same_costs = previous is not None and previous.model.shape == model.shape  # (a loaded plan's model: no source)
    if same_costs and {g.name for g in cluster.groups} <= set(previous.sources):  # type: ignore[union-attr]
        ctx = dataclasses.replace(previous, cluster=cluster, training=training)
    else:
        ctx = predictor.context(cluster, model, training, profiles)
    shrunk = shrink(ctx, old)
    adapted = shrunk.evaluation
    warm = (adapted,) if adapted else ()
    degrees = dict.fromkeys((*training.context_parallel_degrees(ctx.seq_length), old.context_parallel))
    if engine is not None:
        found = [engine_search(ctx.at_context_parallel(degree), engine) for degree in sorted(degrees)]
    else:
        found = [search(ctx.at_context_parallel(degree), warm_start=warm) for degree in sorted(degrees)]
    result = found[0] if len(found) == 1 else merge_results(found, 1)
    elapsed = time.perf_counter() - started
    if not result.evaluations:
        raise DoesNotFitError(
            f"{model.key} no longer fits on the changed cluster: the closest strategy "
            f"({result.smallest_shortfall_where}) needs {result.smallest_shortfall_bytes / 2**30:.1f} GiB more "
            "per device",
            result.smallest_shortfall_bytes,
        )
    best = result.evaluations[0]
    stats = {
        "configurations": result.configurations,
        "evaluated": result.evaluated,
        "memory_infeasible": result.memory_infeasible,
        "pruned_by_bound": result.configurations - result.evaluated,
        "warm_started": adapted is not None and engine is None,
    }
    if engine is not None:
        stats["engine"] = engine.key
        if note := vendors_note(cluster, best.strategy, engine, training.dtype):  # the other vendors' groups idle
            stats["engine_note"] = note
    if training_names_engine:  # as the old plan records it (a loaded training sets every field)
        stats["training_names_engine"] = True
    if cluster_changes is None:  # the changes from the cluster file are not known: the nodes they left are
        stats["cluster_nodes"] = nodes
    elif cluster_changes:
        stats["cluster_changes"] = [{"without": list(w), "add": list(a)} for w, a in cluster_changes]
        stats["cluster_nodes"] = nodes
    if result.note:
        stats["note"] = result.note
    if idle_note:
        stats["idle_note"] = idle_note
    base = predictor.base_context(cluster, model, training, profiles)
    interval = predictor.interval(base, best.strategy)
    ctx = ctx.at_context_parallel(best.strategy.context_parallel)
    plan = Plan(ctx, best, compute_bounds(ctx), elapsed, stats, (), interval)
    lost = tuple(engine_lost(adapted.strategy, engine, cluster=cluster)) if engine and adapted is not None else ()
    return Replan(plan, adapted, elapsed, shrunk.reason, lost)
