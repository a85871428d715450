"""The planner's Python API: plan, predict."""

from __future__ import annotations

import time
from collections.abc import Mapping

from planner.engine_space import engine_search, engine_training
from planner.options import ProgressCallback, SearchOptions
from planner.plan import Bounds, Plan
from planner.search import fastest, search
from planner.yardsticks import compute_bound_tokens_per_s, group_alone_tokens_per_s
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
from specs.engines import Engine
from specs.errors import DoesNotFitError
from specs.layout import Strategy
from specs.model import ModelSpec
from specs.training import TrainingSpec
from specs.units import GIB


def compute_bounds(ctx: CostContext) -> Bounds:
    """The yardsticks of a plan in this context: HETHUB's upper bound (each group's best plan alone) and the compute
    bound."""
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
    profiles: Mapping[str, DeviceProfile] | None = None,
    top_k: int = 1,
    progress: ProgressCallback | None = None,
    predictor: Predictor | None = None,
    lower_bound: bool = False,
    engine: Engine | None = None,
) -> Plan:
    """The fastest strategy that fits memory, with its metrics, yardsticks and a 90% interval on its iteration
    time; raises DoesNotFitError. `predictor` defaults to the shipped one (`default_predictor()`). `lower_bound`:
    also the least iteration time any plan of the search space could reach (planner.search's root bound; about a
    second search's time on large clusters). `engine`: only plans that engine can run as planned (its export loses
    nothing); the training is restricted to it first (planner.engine_space.engine_training)."""
    predictor = predictor or default_predictor()
    engine_changes: list[str] = []
    if engine is not None:
        training, engine_changes = engine_training(training, engine)
    base = predictor.base_context(cluster, model, training, profiles)
    ctx = predictor.context(cluster, model, training, profiles)
    started = time.perf_counter()
    options = SearchOptions(top_k=max(1, top_k), root_bound=lower_bound)
    result = search(ctx, options, progress) if engine is None else engine_search(ctx, engine, options, progress)
    search_time_s = time.perf_counter() - started
    if not result.evaluations:
        if result.smallest_shortfall_where:
            raise DoesNotFitError(
                f"{model.key} does not fit on cluster {cluster.name!r}: the closest strategy "
                f"({result.smallest_shortfall_where}) needs {result.smallest_shortfall_bytes / GIB:.1f} GiB more "
                "per device; add devices, allow full recompute or ZeRO-1, or shorten the sequence",
                result.smallest_shortfall_bytes,
            )
        state = model.total_params() * state_bytes_per_param(ctx, dp=1)
        usable = sum(g.num_devices * usable_memory_bytes(ctx, g) for g in cluster.groups)
        missing = (state - usable) / cluster.num_devices
        if missing > 0:
            raise DoesNotFitError(
                f"{model.key} does not fit on cluster {cluster.name!r}: its weights, gradients and optimizer state "
                f"alone ({state / GIB:,.0f} GiB) need {missing / GIB:.1f} GiB more per device than the "
                f"{usable / GIB:,.0f} GiB usable; add devices",
                missing,
            )
        raise DoesNotFitError(
            f"no strategy for {model.key} on cluster {cluster.name!r}: the global batch "
            f"{training.global_batch_size} must split into replicas x micro-batches, and stages need whole layers "
            f"({model.num_layers}) and TP degrees dividing a node and the {model.num_kv_heads} kv heads",
            0.0,
        )
    stats = {
        "configurations": result.configurations,
        "evaluated": result.evaluated,
        "memory_infeasible": result.memory_infeasible,
        "pruned_by_bound": result.configurations - result.evaluated,
        "family_partitions": result.family_partitions,
    }
    if result.note:  # what the search did not cover (merged groups, the candidate budget), in one line
        stats["note"] = result.note
    if engine is not None:
        stats["engine"] = engine.key
        stats["engine_changes"] = engine_changes
    best = result.evaluations[0]
    interval = predictor.interval(base, best.strategy)
    alternatives = tuple(result.evaluations[1:])
    return Plan(ctx, best, compute_bounds(ctx), search_time_s, stats, alternatives, interval, result.lower_bound_s)


def predict(ctx: CostContext, strategy: Strategy, source: str = "strategy") -> Evaluation:
    """Evaluate a given strategy without searching (what-if)."""
    ctx.check_strategy(strategy, source)
    return evaluate(ctx, strategy)


__all__ = ["build_context", "compute_bounds", "plan", "predict"]
