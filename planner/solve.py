"""One candidate solved: its stages' cost-model terms, its exact layer split (planner.layer_split; per-stage recompute:
planner.mixed_recompute), the strategy it makes, and, when nothing fits, how far the closest candidate misses."""

from __future__ import annotations

import itertools
import math

import numpy as np

from planner.best_first import outer_configs
from planner.candidates import PER_STAGE, OuterConfig, config_microbatches
from planner.layer_split import LayerSplitter, split_layers
from planner.mixed_recompute import least_per_stage_mode_objective, split_at_bottleneck
from planner.options import SearchOptions
from planner.tp_rows import TailPerLayer
from predictor.cost_model import (
    CostContext,
    StageCache,
    decoder_layer_time_s,
    edge_time_s,
    fill_and_drain_time_s,
    in_flight_microbatches,
    p2p_time_s,
    stage_memory,
    usable_memory_bytes,
)
from predictor.sharding import GATHERED_LAYERS
from specs.cluster import DeviceGroup
from specs.layout import StageStrategy, Strategy, pack_stages, split_pipeline
from specs.model import Recompute

# per stage along the pipe: (group, tp), per-layer time, fixed time, memory cap in layers, bytes per layer, memory
# excess with zero layers
StageArrays = tuple[list[tuple[DeviceGroup, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class StageTerms:
    """Per-stage cost-model terms, memoised for one search (many candidates share stage shapes)."""

    def __init__(self, ctx: CostContext) -> None:
        self.ctx = ctx
        self._time: dict[tuple[object, ...], tuple[float, float]] = {}
        self._memory: dict[tuple[object, ...], tuple[float, float, float]] = {}
        self.tail_per_layer_s = TailPerLayer(ctx)
        self.evaluations: StageCache = {}  # stage evaluations (cost_model.evaluate's cache)

    def fill_and_drain_s(self, strategy: Strategy) -> float:
        """The point-to-point time of a one-family strategy's fill and drain (as cost_model.evaluate counts it)."""
        pipeline = strategy.pipelines[0]
        stages, b = pipeline.stages, pipeline.micro_batch_size
        one_way = sum(p2p_time_s(self.ctx, stages[i], stages[i + 1], b) for i in range(len(stages) - 1))
        return fill_and_drain_time_s(strategy.virtual_stages, one_way)

    def time_s(
        self, group: DeviceGroup, config: OuterConfig, tp: int, mode: Recompute, first: bool, last: bool
    ) -> tuple[float, float]:
        """(per-layer time, embedding/LM-head time) per micro-batch."""
        key = (group.name, config.micro_batch_size, tp, mode, first, last)
        if key not in self._time:
            b = config.micro_batch_size
            self._time[key] = (
                decoder_layer_time_s(self.ctx, group, b, tp, mode),
                edge_time_s(self.ctx, group, b, tp, first, last),
            )
        return self._time[key]

    def memory_bytes(
        self,
        group: DeviceGroup,
        config: OuterConfig,
        tp: int,
        mode: Recompute,
        in_flight: float,
        first: bool,
        last: bool,
        stages: int,
    ) -> tuple[float, float, float]:
        """(bytes per layer, bytes with no layer, usable bytes): stage memory is linear in its layers, except under
        ZeRO 3, where the gathered weights of up to GATHERED_LAYERS layers are held besides each layer's shard: there
        the line through GATHERED_LAYERS and one more layer, exact from that many layers on and above the memory
        below it (a stage of fewer layers is never let through that does not fit)."""
        key = (group.name, config.micro_batch_size, tp, mode, config.replicas, in_flight, first, last, stages)
        if key not in self._memory:
            common = dict(
                micro_batch_size=config.micro_batch_size,
                tp=tp,
                recompute=mode,
                dp=config.replicas,
                in_flight=in_flight,
                first=first,
                last=last,
                pipeline_stages=stages,
            )
            start = GATHERED_LAYERS if self.ctx.training.zero_stage == 3 else 0
            at_start = stage_memory(self.ctx, group, num_layers=start, **common).total_bytes
            per_layer = stage_memory(self.ctx, group, num_layers=start + 1, **common).total_bytes - at_start
            self._memory[key] = (per_layer, at_start - start * per_layer, usable_memory_bytes(self.ctx, group))
        return self._memory[key]

    def arrays(self, config: OuterConfig, mode: Recompute | None = None) -> StageArrays:
        """Per stage along the pipe, with every stage in `mode` (default: the config's): (group, tp), per-layer
        time, fixed time, memory cap in layers, bytes per layer, memory excess with zero layers."""
        mode = mode or config.recompute  # type: ignore[assignment]
        stages = config.stage_groups()
        p = len(stages)
        microbatches = config_microbatches(self.ctx, config)[0]
        rows = []
        for index, (group, tp) in enumerate(stages):
            first, last = index == 0, index == p - 1
            per_layer, fixed = self.time_s(group, config, tp, mode, first, last)
            in_flight = in_flight_microbatches(index, p, microbatches, config.virtual_stages)
            layer_bytes, empty, usable = self.memory_bytes(group, config, tp, mode, in_flight, first, last, p)
            cap = math.floor((usable - empty) / layer_bytes) if usable >= empty else 0
            rows.append((per_layer, fixed, cap, layer_bytes, empty - usable))
        per_layer_s, fixed_s, caps, per_layer_bytes, excess = (np.array(column) for column in zip(*rows))
        return stages, per_layer_s, fixed_s, caps, per_layer_bytes, excess


def build_strategy(
    ctx: CostContext, config: OuterConfig, layers: tuple[int, ...], modes: tuple[Recompute, ...] | None = None
) -> Strategy:
    """The strategy of a candidate and its layer split; `modes` gives each stage its own recompute mode (the most
    common one is the plan's, and its stages keep None, as a plan file reads back)."""
    default: Recompute = max(modes, key=modes.count) if modes else config.recompute  # type: ignore[assignment]
    stages = []
    start = 0
    for index, ((group, tp), count) in enumerate(zip(config.stage_groups(), layers)):
        own = modes[index] if modes and modes[index] != default else None
        stages.append(StageStrategy(group.name, start, start + count, tp, 0, own))
        start += count
    microbatches, total = config_microbatches(ctx, config)
    cp = ctx.context_parallel
    placed = pack_stages(stages, config.replicas, cp)
    pipeline = split_pipeline(config.replicas, config.micro_batch_size, placed, microbatches, total, cp)
    training = ctx.training
    virtual, shard = config.virtual_stages, training.zero_shard
    return Strategy((pipeline,), default, training.zero_stage, virtual, training.sequence_parallel, shard)


# (the candidate's best strategy, or None; whether memory made it infeasible; its pipeline objective)
Solved = tuple[Strategy | None, bool, float]


def candidate_strategy(
    ctx: CostContext, terms: StageTerms, config: OuterConfig, incumbent_s: float, splitter: LayerSplitter | None
) -> Solved:
    """(the candidate's best strategy, or None; whether memory made it infeasible; its pipeline objective).
    None without infeasibility: the candidate cannot beat `incumbent_s`, a bound on the pipeline objective
    (the objective is a lower bound on the iteration time). Per-stage candidates (the refinement step, which runs
    without a baseline `splitter`) are solved by planner.mixed_recompute."""
    if config.recompute == PER_STAGE:
        return _per_stage_strategy(ctx, terms, config, incumbent_s)
    num_layers = ctx.model.num_layers
    microbatches = config_microbatches(ctx, config)[0]
    v = config.virtual_stages
    # the pipeline's fill and drain point-to-point does not depend on the layer split: the exact one first
    p = sum(config.stage_counts)
    fill_and_drain_s = terms.fill_and_drain_s(build_strategy(ctx, config, (v,) * (p - 1) + (num_layers - v * (p - 1),)))
    if config.order_bound_s - config.fill_and_drain_bound_s + fill_and_drain_s >= incumbent_s:
        return None, False, math.inf
    stages, per_layer, fixed, caps, _, _ = terms.arrays(config)
    if splitter is None:
        split = split_layers(num_layers, per_layer, fixed, caps, microbatches, v)
    else:
        split = splitter(stages, num_layers, per_layer, fixed, caps, microbatches, v)
    if split is None:
        return None, True, math.inf
    # the iteration is at least the pipeline objective plus the fullest tail and the fill / drain point-to-point
    # (checked before evaluating)
    b, d = config.micro_batch_size, config.replicas
    tail_rates = np.array([terms.tail_per_layer_s(group, b, tp, config.recompute, d) for group, tp in stages])
    tail_s = float((np.array(split.layers) * tail_rates).max()) + ctx.terms.iteration_overhead_s
    if split.objective_s + tail_s >= incumbent_s:
        return None, False, split.objective_s
    if split.objective_s + tail_s + fill_and_drain_s >= incumbent_s:
        return None, False, split.objective_s
    return build_strategy(ctx, config, split.layers), False, split.objective_s


def _per_stage_strategy(ctx: CostContext, terms: StageTerms, config: OuterConfig, incumbent_s: float) -> Solved:
    """candidate_strategy of a candidate whose stages each pick their recompute mode (planner.mixed_recompute, exact),
    where that can beat `incumbent_s`; None where one mode everywhere wins (that candidate is searched on its own)."""
    num_layers = ctx.model.num_layers
    microbatches = config_microbatches(ctx, config)[0]
    v = config.virtual_stages
    modes = ctx.training.recompute
    per_mode = [terms.arrays(config, mode) for mode in modes]
    per_layer = np.stack([arrays[1] for arrays in per_mode], axis=1)
    caps = np.stack([arrays[3] for arrays in per_mode], axis=1)
    fixed = per_mode[0][2]
    found = least_per_stage_mode_objective(num_layers, per_layer, fixed, caps, microbatches, v, incumbent_s)
    if found is None:
        return None, True, math.inf
    least_s, bottleneck_s = found
    if least_s >= incumbent_s * (1 - 1e-9):
        return None, False, least_s
    mixed = split_at_bottleneck(num_layers, per_layer, fixed, caps, microbatches, v, bottleneck_s)
    if mixed is None:
        return None, True, math.inf
    if len(set(mixed.modes)) == 1 or mixed.objective_s >= incumbent_s:
        return None, False, mixed.objective_s
    strategy = build_strategy(ctx, config, mixed.layers, tuple(modes[r] for r in mixed.modes))
    return strategy, False, mixed.objective_s


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


def closest_misfit(ctx: CostContext, options: SearchOptions, terms: StageTerms) -> tuple[float, str]:
    """When nothing fits: the candidate needing the least extra memory per device (among the first
    `options.misfit_candidates` by time bound, memory bounds off), and a description of it."""
    num_layers = ctx.model.num_layers
    shortfall, where = math.inf, ""
    for config in itertools.islice(outer_configs(ctx, options, memory_bounds=False), options.misfit_candidates):
        _, _, _, _, per_layer_bytes, excess_empty = terms.arrays(config)
        missing = _shortfall_bytes(num_layers, per_layer_bytes, excess_empty, config.virtual_stages)
        if missing < shortfall:
            shortfall, where = missing, config.describe()
    return shortfall, where
