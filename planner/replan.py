"""Re-planning after failures or additions: change the cluster, adapt the old plan, search warm-started from it.

The old strategy is adapted to the new cluster by keeping its stages, TP degrees and layer split and lowering the
replica count until every group has the devices (the batch split over the replicas in whole micro-batches); if that
fits memory it seeds the search's incumbent, so the bounds prune from the first candidate and the result is still the
exact optimum. The search tries every uneven batch split: after a failure the cluster rarely divides the batch.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

from planner.plan import Plan
from planner.planning import compute_bounds
from planner.search import search
from predictor.cost_model import CostContext, Evaluation, evaluate
from predictor.predictor import Predictor, default_predictor
from specs.cluster import ClusterSpec
from specs.errors import DoesNotFitError, HetplanError, SpecError
from specs.layout import Strategy, devices_per_group, pack_stages, split_batch, split_pipeline
from specs.model import ModelSpec
from specs.training import TrainingSpec

CHANGE = re.compile(
    r"^(?:node:(?P<node_group>[\w.-]+)/(?:node)?(?P<node>\d+)|group:(?P<group>[\w.-]+):(?P<count>\d+))$"
)


def changed_cluster(cluster: ClusterSpec, without: list[str], add: list[str]) -> ClusterSpec:
    """Remove nodes (`node:GROUP/INDEX` or `group:NAME:COUNT`) and add nodes (`group:NAME:COUNT`)."""
    nodes = {group.name: group.nodes for group in cluster.groups}
    for flag, items, sign in (("--without", without, -1), ("--add", add, 1)):
        for item in items:
            match = CHANGE.match(item)
            if match is None or (sign > 0 and match["node_group"]):
                form = "node:GROUP/INDEX or group:NAME:COUNT" if sign < 0 else "group:NAME:COUNT"
                raise SpecError(flag, item, f"expected {form}")
            name = match["node_group"] or match["group"]
            group = cluster.group(name) if name in nodes else None
            if group is None:
                raise SpecError(flag, item, f"no group {name!r}; groups: {', '.join(nodes)}")
            if match["node"] is not None and int(match["node"]) >= group.nodes:
                raise SpecError(flag, item, f"group {name!r} has nodes 0..{group.nodes - 1}")
            nodes[name] += sign * (1 if match["node"] is not None else int(match["count"]))
            if nodes[name] < 0:
                raise SpecError(flag, item, f"group {name!r} has only {group.nodes} nodes")
    groups = tuple(group.with_nodes(nodes[group.name]) for group in cluster.groups if nodes[group.name] > 0)
    if not groups:
        raise SpecError("--without", "", "no nodes would be left")
    return dataclasses.replace(cluster, groups=groups)


def adapt_strategy(ctx: CostContext, strategy: Strategy) -> Evaluation | None:
    """The old stages with as many replicas as the new cluster holds (and the batch divides), if that fits."""
    if len(strategy.pipelines) != 1:
        return None  # several families: the search starts cold
    pipeline = strategy.pipelines[0]
    if any(stage.group not in {g.name for g in ctx.cluster.groups} for stage in pipeline.stages):
        return None
    batch = ctx.training.global_batch_size
    for replicas in range(pipeline.replicas, 0, -1):
        split = split_batch(batch, replicas, pipeline.micro_batch_size)
        if split is None:
            continue
        microbatches, total = split
        stages = pack_stages(pipeline.stages, replicas)
        adapted = dataclasses.replace(
            strategy, pipelines=(split_pipeline(replicas, pipeline.micro_batch_size, stages, microbatches, total),)
        )
        if any(end > ctx.cluster.group(name).num_devices for name, end in devices_per_group(adapted).items()):
            continue
        try:
            ctx.check_strategy(adapted)
        except HetplanError:
            continue
        evaluation = evaluate(ctx, adapted)
        if evaluation.fits:
            return evaluation
    return None


@dataclass(frozen=True)
class Replan:
    plan: Plan
    adapted: Evaluation | None  # the old plan on the new cluster, if it could run there
    replan_time_s: float


def replan(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    old: Strategy,
    predictor: Predictor | None = None,
) -> Replan:
    """Plan again on a changed cluster, warm-started from the old strategy, over every uneven batch split
    (`uneven_batch: exhaustive`): after a failure the cluster rarely divides the batch evenly."""
    predictor = predictor or default_predictor()
    training = training.model_copy(update={"uneven_batch": "exhaustive"})
    started = time.perf_counter()
    ctx = predictor.context(cluster, model, training)
    adapted = adapt_strategy(ctx, old)
    result = search(ctx, warm_start=(adapted,) if adapted else ())
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
        "warm_started": adapted is not None,
    }
    base = predictor.base_context(cluster, model, training)
    interval = predictor.interval(base, best.strategy)
    plan = Plan(ctx, best, compute_bounds(ctx), elapsed, stats, (), interval)
    return Replan(plan, adapted, elapsed)
