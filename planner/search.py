"""Search the three-level tree: pipeline order and stages per group, DP replicas, TP per group, micro-batch,
recompute; the exact layer split inside (planner.layer_split).

Branch and bound: every outer configuration gets a lower bound on its iteration time (m micro-batches times the
fractional water-filling bottleneck, which no integer split, bubble or communication can beat); configurations are
evaluated best bound first, and the search stops once the next bound cannot beat the k-th best plan found. Groups
with identical devices and node shapes are interchangeable, so orders that only swap them are skipped.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.layer_split import split_layers
from predictor.cost_model import (
    CostContext,
    Evaluation,
    decoder_layer_time_s,
    edge_time_s,
    evaluate,
    in_flight_microbatches,
    stage_memory,
    state_bytes_per_param,
    usable_memory_bytes,
)
from predictor.strategy import PipelineStrategy, StageStrategy, Strategy
from specs.cluster import DeviceGroup
from specs.model import Recompute

ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class OuterConfig:
    """Everything but the layer split: groups along the pipe (in order), their TP degrees and stage counts."""

    groups: tuple[DeviceGroup, ...]
    tps: tuple[int, ...]
    stage_counts: tuple[int, ...]
    replicas: int
    micro_batch_size: int
    recompute: Recompute
    virtual_stages: int
    lower_bound_s: float


@dataclass
class SearchResult:
    evaluations: list[Evaluation]  # best first
    configurations: int
    evaluated: int
    memory_infeasible: int
    smallest_shortfall_bytes: float
    smallest_shortfall_where: str


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_options(ctx: CostContext, group: DeviceGroup) -> list[int]:
    """TP degrees inside one node that divide the kv heads (and that the group's profile covers)."""
    options = [t for t in divisors(group.devices_per_node) if ctx.model.num_kv_heads % t == 0]
    source = ctx.source(group.name)
    profiled = getattr(source, "tp_degrees", None)
    if callable(profiled):
        options = [t for t in options if t in profiled()]
    return options


def _signature(group: DeviceGroup) -> tuple[object, ...]:
    return (group.device, group.nodes, group.devices_per_node, group.nics_per_node, group.nic_bw_bytes_per_s)


def _orders(groups: tuple[DeviceGroup, ...]) -> list[tuple[int, ...]]:
    """Permutations of group indices, skipping those that only swap interchangeable groups."""
    seen: set[tuple[object, ...]] = set()
    orders = []
    for order in itertools.permutations(range(len(groups))):
        key = tuple(_signature(groups[i]) for i in order)
        if key not in seen:
            seen.add(key)
            orders.append(order)
    return orders


def outer_configs(ctx: CostContext) -> list[OuterConfig]:
    """All outer choices that are structurally valid and pass the memory lower bound, best bound first."""
    training, model = ctx.training, ctx.model
    global_batch = training.global_batch_size
    groups = ctx.cluster.groups
    configs: list[OuterConfig] = []
    for size in range(1, len(groups) + 1):
        for subset in itertools.combinations(groups, size):
            tp_choices = [tp_options(ctx, g) for g in subset]
            for replicas in divisors(global_batch):
                if any(g.num_devices < replicas for g in subset):
                    break
                total_state = model.total_params() * state_bytes_per_param(ctx, replicas)
                for tps in itertools.product(*tp_choices):
                    counts = tuple(g.num_devices // (replicas * t) for g, t in zip(subset, tps))
                    if min(counts) == 0 or sum(counts) > model.num_layers:
                        continue
                    memory = sum(c * t * usable_memory_bytes(ctx, g) for g, t, c in zip(subset, tps, counts))
                    if total_state > memory:
                        continue
                    for micro_batch_size in training.micro_batch_sizes:
                        if global_batch % (replicas * micro_batch_size):
                            continue
                        microbatches = global_batch // (replicas * micro_batch_size)
                        for recompute in training.recompute:
                            speed = sum(
                                c / decoder_layer_time_s(ctx, g, micro_batch_size, t, recompute)
                                for g, t, c in zip(subset, tps, counts)
                            )
                            bound = microbatches * model.num_layers / speed
                            for virtual in training.virtual_stages:
                                if virtual > 1 and (sum(counts) == 1 or sum(counts) * virtual > model.num_layers):
                                    continue
                                for order in _orders(subset):
                                    configs.append(
                                        OuterConfig(
                                            groups=tuple(subset[i] for i in order),
                                            tps=tuple(tps[i] for i in order),
                                            stage_counts=tuple(counts[i] for i in order),
                                            replicas=replicas,
                                            micro_batch_size=micro_batch_size,
                                            recompute=recompute,
                                            virtual_stages=virtual,
                                            lower_bound_s=bound,
                                        )
                                    )
    configs.sort(key=lambda c: c.lower_bound_s)  # stable: ties keep enumeration order
    return configs


def _stage_arrays(
    ctx: CostContext, config: OuterConfig
) -> tuple[list[tuple[DeviceGroup, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per stage along the pipe: (group, tp), per-layer time, fixed time, memory cap in layers, memory excess
    with zero layers."""
    stages = [(g, t) for g, t, c in zip(config.groups, config.tps, config.stage_counts) for _ in range(c)]
    p = len(stages)
    microbatches = ctx.training.global_batch_size // (config.replicas * config.micro_batch_size)
    per_layer, fixed, caps, per_layer_bytes, fixed_bytes = [], [], [], [], []
    for index, (group, tp) in enumerate(stages):
        first, last = index == 0, index == p - 1
        per_layer.append(decoder_layer_time_s(ctx, group, config.micro_batch_size, tp, config.recompute))
        fixed.append(edge_time_s(ctx, group, config.micro_batch_size, tp, first, last))
        common = dict(
            micro_batch_size=config.micro_batch_size,
            tp=tp,
            recompute=config.recompute,
            dp=config.replicas,
            in_flight=in_flight_microbatches(index, p, microbatches, config.virtual_stages),
            first=first,
            last=last,
            pipeline_stages=p,
        )
        empty = stage_memory(ctx, group, num_layers=0, **common).total_bytes
        one = stage_memory(ctx, group, num_layers=1, **common).total_bytes
        usable = usable_memory_bytes(ctx, group)
        per_layer_bytes.append(one - empty)
        fixed_bytes.append(empty - usable)
        caps.append(math.floor((usable - empty) / (one - empty)) if usable >= empty else 0)
    return (
        stages,
        np.array(per_layer),
        np.array(fixed),
        np.array(caps),
        np.array(per_layer_bytes),
        np.array(fixed_bytes),
    )


def _shortfall_bytes(num_layers: int, per_layer_bytes: np.ndarray, excess_empty: np.ndarray, least: int) -> float:
    """Smallest X such that the stages could hold the model if every device had X more bytes."""
    low, high = 0.0, float(num_layers * per_layer_bytes.max() + max(0.0, excess_empty.max()))
    for _ in range(60):
        mid = (low + high) / 2
        caps = np.floor((mid - excess_empty) / per_layer_bytes)
        if np.all(caps >= least) and caps.sum() >= num_layers:
            high = mid
        else:
            low = mid
    return high


def build_strategy(ctx: CostContext, config: OuterConfig, layers: tuple[int, ...]) -> Strategy:
    stages = []
    start = 0
    offsets: dict[str, int] = {}
    stage_groups = [(g, t) for g, t, c in zip(config.groups, config.tps, config.stage_counts) for _ in range(c)]
    for (group, tp), count in zip(stage_groups, layers):
        offset = offsets.get(group.name, 0)
        stages.append(StageStrategy(group.name, start, start + count, tp, offset))
        offsets[group.name] = offset + tp * config.replicas
        start += count
    microbatches = ctx.training.global_batch_size // (config.replicas * config.micro_batch_size)
    pipeline = PipelineStrategy(config.replicas, config.micro_batch_size, microbatches, tuple(stages))
    return Strategy(
        (pipeline,), config.recompute, ctx.training.zero_stage, config.virtual_stages, ctx.training.sequence_parallel
    )


def search(ctx: CostContext, top_k: int = 1, progress: ProgressCallback | None = None) -> SearchResult:
    """The k fastest strategies that fit memory (fewer if fewer fit)."""
    configs = outer_configs(ctx)
    best: list[tuple[float, int, Evaluation]] = []  # max-heap on iteration time via negation
    evaluated = infeasible = 0
    shortfall, shortfall_where = math.inf, ""
    num_layers = ctx.model.num_layers
    for index, config in enumerate(configs):
        if progress is not None and index % 64 == 0:
            progress(index, len(configs))
        if len(best) == top_k and config.lower_bound_s >= -best[0][0]:
            break
        stages, per_layer, fixed, caps, per_layer_bytes, excess_empty = _stage_arrays(ctx, config)
        microbatches = ctx.training.global_batch_size // (config.replicas * config.micro_batch_size)
        split = split_layers(num_layers, per_layer, fixed, caps, microbatches, config.virtual_stages)
        evaluated += 1
        if split is None:
            infeasible += 1
            if len(stages) * config.virtual_stages <= num_layers:
                missing = _shortfall_bytes(num_layers, per_layer_bytes, excess_empty, config.virtual_stages)
                if missing < shortfall:
                    shortfall = missing
                    names = "+".join(
                        f"{g.name}(tp{t}x{c})" for g, t, c in zip(config.groups, config.tps, config.stage_counts)
                    )
                    shortfall_where = (
                        f"{names}, dp {config.replicas}, micro-batch {config.micro_batch_size}, "
                        f"recompute {config.recompute}, virtual stages {config.virtual_stages}"
                    )
            continue
        evaluation = evaluate(ctx, build_strategy(ctx, config, split.layers))
        if not evaluation.fits:
            infeasible += 1
            continue
        entry = (-evaluation.iteration_time_s, -index, evaluation)
        if len(best) < top_k:
            heapq.heappush(best, entry)
        elif entry[0] > best[0][0]:
            heapq.heapreplace(best, entry)
    if progress is not None:
        progress(len(configs), len(configs))
    ranked = [e for _, _, e in sorted(best, key=lambda item: (-item[0], -item[1]))]
    return SearchResult(ranked, len(configs), evaluated, infeasible, shortfall, shortfall_where)
