"""The cost model: compose layer costs and communication into iteration time and memory per stage.

1F1B with stage times T_i (forward + backward per micro-batch, TP communication included) and boundary p2p c_i
over m micro-batches takes sum_i(T_i + 2*c_i) + (m-1)*max_i T_i (DESIGN.md); interleaving with v chunks divides the
bubble, (sum_i T_i - max_i T_i), by v. DP gradient sync overlaps the last micro-batch's backward when the engine
overlaps it; whatever sticks out, plus the optimizer step, follows the pipeline flush.
Memory per device: bf16 weights (2 B/param), fp32 main grads (4), Adam fp32 master + m + v (12, divided by the
DP degree under ZeRO-1), activations of in-flight micro-batches under 1F1B (min(p - i, m) on stage i).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from predictor.comm_model import (
    Link,
    all_reduce_time_s,
    cross_group_link,
    hierarchical_all_reduce_time_s,
    hierarchical_reduce_scatter_time_s,
    in_node_link,
    rail_link,
)
from profiler.profile import DeviceProfile, LayerCostSource, ScaledLayerCosts
from profiler.simulated import SimulatedDevice
from specs.cluster import ClusterSpec, DeviceGroup
from specs.errors import SpecError
from specs.layout import PipelineStrategy, StageStrategy, Strategy, check_strategy, dp_layout, same_node
from specs.model import ModelSpec, Recompute
from specs.training import TrainingSpec

GRAD_BYTES_PER_PARAM = 4  # fp32 main gradients (Megatron's default for bf16 training)
OPTIMIZER_BYTES_PER_PARAM_MIXED = 12  # fp32 master weights + Adam m + v
OPTIMIZER_BYTES_PER_PARAM_FP32 = 8  # Adam m + v when the weights already are fp32
ADAM_BYTES_MOVED_PER_PARAM = 30  # read grad, master, m, v (16) + write master, m, v (12) + write 16-bit weight (2)
OPTIMIZER_BW_EFFICIENCY = 0.7


@dataclass(frozen=True)
class EndToEndTerms:
    """Whole-iteration effects per-layer profiles cannot see; `hetplan fit --runs` learns them from measured runs.

    The scales multiply the modelled times of TP collectives, network transfers (p2p and DP sync) and the optimizer
    step; `dp_overlap` is the fraction of the last backward that DP sync hides behind (1: all of it, as Megatron's
    overlapped grad reduce aims for); `iteration_overhead_s` is a fixed cost per iteration (launch, data, logging).
    """

    tp_comm_scale: float = 1.0
    network_scale: float = 1.0
    optimizer_scale: float = 1.0
    dp_overlap: float = 1.0
    iteration_overhead_s: float = 0.0


@dataclass(frozen=True)
class CostContext:
    """Everything the cost model needs besides the strategy."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    sources: Mapping[str, LayerCostSource]  # by group name
    terms: EndToEndTerms = EndToEndTerms()
    links: Mapping[str, Link] = field(default_factory=dict)  # fitted, by "device key/link class"; else datasheet
    identity: str = ""  # the predictor's, when one made this context

    @property
    def seq_length(self) -> int:
        return self.training.seq_length or self.model.seq_length

    def source(self, group: str) -> LayerCostSource:
        return self.sources[group]

    @property
    def predictor_identity(self) -> str:
        names = sorted({source.identity for source in self.sources.values()})
        base = "analytic cost model over " + "; ".join(names)
        return f"{self.identity}: {base}" if self.identity else base

    def check_strategy(self, strategy: Strategy, source: str = "strategy") -> None:
        """The layout's structural checks against this context's cluster, model and global batch."""
        check_strategy(strategy, self.cluster, self.model, self.training.global_batch_size, source)

    def in_node_link(self, group: DeviceGroup) -> Link:
        return self.links.get(f"{group.device.key}/in_node") or in_node_link(group)

    def rail_link(self, group: DeviceGroup) -> Link:
        return self.links.get(f"{group.device.key}/rail") or rail_link(group)

    def cross_group_link(self, a: DeviceGroup, b: DeviceGroup) -> Link:
        fitted = self.links.get(f"{a.device.key}/cross_group") or self.links.get(f"{b.device.key}/cross_group")
        return fitted or cross_group_link(self.cluster, a, b)


def emulated(group: DeviceGroup, source: LayerCostSource) -> LayerCostSource:
    """A CPU group emulating a slower device (`emulate_speed` < 1) computes 1/speed times as long."""
    return ScaledLayerCosts(source, 1.0 / group.emulate_speed) if group.emulate_speed != 1.0 else source


def build_context(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    profiles: Mapping[str, DeviceProfile] | None = None,
    noise: float = 0.0,
    seed: int = 0,
) -> CostContext:
    """Use a measured profile for each device type that has one (by device key), simulated ones elsewhere."""
    seq_length = training.seq_length or model.seq_length
    for group in cluster.groups:
        if training.dtype == "bf16" and not group.device.supports_bf16:
            raise SpecError(
                cluster.source or "cluster",
                f"group {group.name}",
                f"{group.device.key} has no bf16: train in fp16 (--dtype fp16)",
            )
    sources: dict[str, LayerCostSource] = {}
    for group in cluster.groups:
        profile = (profiles or {}).get(group.device.key)
        if profile is not None:
            if profile.seq_length != seq_length:
                raise SpecError(
                    profile.path, "seq_length", f"profiled at {profile.seq_length}, training uses {seq_length}"
                )
            if profile.dtype != training.dtype:
                raise SpecError(profile.path, "dtype", f"profiled in {profile.dtype}, training uses {training.dtype}")
            sources[group.name] = emulated(group, profile)
        else:
            simulated = SimulatedDevice(
                group.device,
                model,
                seq_length,
                training.dtype,
                noise=noise,
                seed=seed,
                sequence_parallel=training.sequence_parallel,
                flash_attention=training.attention == "flash",
            )
            sources[group.name] = emulated(group, simulated)
    return CostContext(cluster, model, training, sources)


# ---- per-stage pieces (also used by the planner's inner solvers) ---------------------------------------------
def tp_collective_time_s(ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int) -> float:
    """One all-reduce-sized TP collective of b*s*h activations inside the node."""
    size = micro_batch_size * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes
    return all_reduce_time_s(size, tp, ctx.in_node_link(group)) * ctx.terms.tp_comm_scale


def decoder_layer_time_s(
    ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int, recompute: Recompute
) -> float:
    """Forward + backward of one decoder layer shard for one micro-batch, with its 4 TP collectives
    (2 forward, 2 backward; full recompute repeats the 2 forward ones)."""
    cost = ctx.source(group.name).layer_cost("decoder", micro_batch_size, tp, recompute)
    collectives = 6 if recompute == "full" else 4
    return cost.time_s + collectives * tp_collective_time_s(ctx, group, micro_batch_size, tp)


def edge_time_s(ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int, first: bool, last: bool) -> float:
    """Embedding (first stage) and final norm + LM head + loss (last stage) per micro-batch, with one TP
    collective each."""
    source = ctx.source(group.name)
    time_s = 0.0
    if first:
        time_s += source.layer_cost("embedding", micro_batch_size, tp, "none").time_s
        time_s += tp_collective_time_s(ctx, group, micro_batch_size, tp)
    if last:
        time_s += source.layer_cost("lm_head", micro_batch_size, tp, "none").time_s
        time_s += tp_collective_time_s(ctx, group, micro_batch_size, tp)
    return time_s


def stage_params(model: ModelSpec, num_layers: int, first: bool, last: bool, pipeline_stages: int) -> int:
    """Parameters held by one stage (before TP sharding). A tied output layer keeps its own copy on the last
    stage when the pipeline has several stages (as Megatron does)."""
    params = num_layers * model.layer_params()
    if first:
        params += model.embedding_params()
    if last:
        params += model.lm_head_params()
        if model.tied_embeddings and (pipeline_stages > 1 or not first):
            params += model.vocab_size * model.hidden_size
    return params


def interleaved_group_size(num_microbatches: int, pipeline_stages: int) -> int:
    """Megatron's contiguous micro-batches per virtual stage (`--microbatch-group-size-per-virtual-pipeline-stage`):
    the pipeline size when it divides m, else the smallest N > p with m % N == 0 or m % N >= p (Megatron refuses a
    last group smaller than p: it would stall the pipeline); m at most."""
    m, p = num_microbatches, pipeline_stages
    for size in range(p, m + 1):
        if m % size == 0 or m % size >= p:
            return size
    return max(m, 1)


def in_flight_microbatches(stage_index: int, pipeline_stages: int, num_microbatches: int, virtual_stages: int) -> float:
    """Micro-batches' worth of activations stage i holds at peak. 1F1B: its warm-up forwards plus one,
    min(p - i, m). Interleaved (Megatron; v chunks of 1/v of the stage each): warm-up 2(p-i-1) + (v-1)N chunks plus
    one, at most all m*v, N = interleaved_group_size. On the first stage with N = p that is p + (p-1)/v, Korthikanti
    et al.'s factor 1 + (p-1)/(p*v) on p; later stages hold more than that factor on p - i says."""
    p, m, v = pipeline_stages, num_microbatches, virtual_stages
    if v > 1 and p > 1:  # the scalar form of in_flight_table (the cost model's hot path; a test keeps them equal)
        return min(2 * (p - stage_index - 1) + (v - 1) * interleaved_group_size(m, p) + 1, m * v) / v
    return float(min(p - stage_index, m))


def in_flight_table(depths: np.ndarray, num_microbatches: int, stages: np.ndarray, virtual_stages: int) -> np.ndarray:
    """in_flight_microbatches for pipelines of `stages` (rows) at depths from the end (1 = last stage): (rows,
    depths); vectorised for the planner's bounds."""
    m, v = num_microbatches, virtual_stages
    one_f_one_b = np.minimum(depths, m)[None, :].astype(float)
    if v == 1:
        return np.broadcast_to(one_f_one_b, (len(stages), len(depths)))
    sizes = {int(p): interleaved_group_size(m, int(p)) for p in np.unique(stages)}
    group = np.array([sizes[int(p)] for p in stages])
    chunks = np.minimum(2 * (depths[None, :] - 1) + (v - 1) * group[:, None] + 1, m * v)
    return np.where((stages <= 1)[:, None], one_f_one_b, chunks / v)


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes


def state_bytes_per_param(ctx: CostContext, dp: int) -> float:
    """Weights + grads + optimizer bytes per parameter on one device."""
    training = ctx.training
    optimizer = OPTIMIZER_BYTES_PER_PARAM_FP32 if training.dtype == "fp32" else OPTIMIZER_BYTES_PER_PARAM_MIXED
    if training.zero_stage >= 1:
        optimizer /= dp
    return training.dtype_bytes + GRAD_BYTES_PER_PARAM + optimizer


def stage_memory(
    ctx: CostContext,
    group: DeviceGroup,
    *,
    num_layers: int,
    micro_batch_size: int,
    tp: int,
    recompute: Recompute,
    dp: int,
    in_flight: float,
    first: bool,
    last: bool,
    pipeline_stages: int,
) -> StageMemory:
    training = ctx.training
    params = stage_params(ctx.model, num_layers, first, last, pipeline_stages) / tp
    optimizer_per_param = state_bytes_per_param(ctx, dp) - training.dtype_bytes - GRAD_BYTES_PER_PARAM
    source = ctx.source(group.name)
    per_microbatch = num_layers * source.layer_cost("decoder", micro_batch_size, tp, recompute).activation_bytes
    if first:
        per_microbatch += source.layer_cost("embedding", micro_batch_size, tp, "none").activation_bytes
    activations = per_microbatch * in_flight
    if last:  # logits live for one micro-batch: 1F1B runs its backward right after its forward
        activations += source.layer_cost("lm_head", micro_batch_size, tp, "none").activation_bytes
    return StageMemory(
        weights_bytes=params * training.dtype_bytes,
        grads_bytes=params * GRAD_BYTES_PER_PARAM,
        optimizer_bytes=params * optimizer_per_param,
        activation_bytes=activations,
    )


def usable_memory_bytes(ctx: CostContext, group: DeviceGroup) -> float:
    return group.device.memory_bytes * (1 - ctx.training.memory_reserve_fraction)


def dp_sync_time_s(ctx: CostContext, group: DeviceGroup, params_per_device: float, tp: int, replicas: int) -> float:
    """Gradient all-reduce (ZeRO-0) or reduce-scatter of grads + all-gather of 16-bit weights (ZeRO-1)."""
    if replicas <= 1:
        return 0.0
    per_node, nodes = dp_layout(group, tp, replicas)
    inner, outer = ctx.in_node_link(group), ctx.rail_link(group)
    grads = params_per_device * GRAD_BYTES_PER_PARAM
    if ctx.training.zero_stage >= 1:
        weights = params_per_device * ctx.training.dtype_bytes
        time_s = hierarchical_reduce_scatter_time_s(grads, per_node, nodes, inner, outer) + (
            hierarchical_reduce_scatter_time_s(weights, per_node, nodes, inner, outer)
        )
    else:
        time_s = hierarchical_all_reduce_time_s(grads, per_node, nodes, inner, outer)
    return time_s * ctx.terms.network_scale


def optimizer_time_s(ctx: CostContext, group: DeviceGroup, params_per_device: float, replicas: int) -> float:
    local = params_per_device / replicas if ctx.training.zero_stage >= 1 else params_per_device
    bw = group.device.hbm_bw_bytes_per_s * OPTIMIZER_BW_EFFICIENCY
    return local * ADAM_BYTES_MOVED_PER_PARAM / bw * ctx.terms.optimizer_scale


def exposed_dp_sync_time_s(ctx: CostContext, dp_sync_s: float, backward_s: float) -> float:
    """The DP sync that sticks out past the last micro-batch's backward (`dp_overlap` of it hides there when the
    engine overlaps grad reduce; none otherwise): it and the optimizer step follow the pipeline flush."""
    hidden_s = ctx.terms.dp_overlap * backward_s if ctx.training.overlap_grad_reduce else 0.0
    return max(0.0, dp_sync_s - hidden_s)


def least_sync_and_step_per_layer_s(
    ctx: CostContext, group: DeviceGroup, tp: int, replicas: int
) -> tuple[float, float]:
    """(DP sync, optimizer step) per decoder layer of a stage at their least, for the planner's bounds: DP time is
    concave in the bytes with no time at zero, so per layer it is least with all L layers on the stage; the optimizer
    step is linear in the layers."""
    num_layers = ctx.model.num_layers
    params = ctx.model.layer_params() / tp
    dp_s = dp_sync_time_s(ctx, group, num_layers * params, tp, replicas) / num_layers
    return dp_s, optimizer_time_s(ctx, group, params, replicas)


def tail_per_layer_lower_bound_s(ctx: CostContext, backward_s: float, sync_and_step_s: tuple[float, float]) -> float:
    """A lower bound on a stage's tail (exposed DP sync + optimizer step, as `evaluate` charges it) per decoder layer
    it holds, from one layer's backward time and least_sync_and_step_per_layer_s: the backward hiding the sync is
    linear in the layers too; embedding / LM-head parameters and the sync across families only add."""
    dp_s, optimizer_s = sync_and_step_s
    return exposed_dp_sync_time_s(ctx, dp_s, backward_s) + optimizer_s


Seconds = TypeVar("Seconds", float, np.ndarray)


def fill_and_drain_time_s(virtual_stages: int, one_way_p2p_s: Seconds) -> Seconds:
    """Point-to-point time of a pipeline's fill and drain, given one direction across every boundary (a float, or an
    array of them): every boundary is crossed once per chunk, each way."""
    return 2 * virtual_stages * one_way_p2p_s


def p2p_link(ctx: CostContext, a: StageStrategy, b: StageStrategy) -> Link:
    group_a, group_b = ctx.cluster.group(a.group), ctx.cluster.group(b.group)
    if a.group != b.group:
        return ctx.cross_group_link(group_a, group_b)
    if same_node(group_a, a, b):
        return ctx.in_node_link(group_a)
    return ctx.rail_link(group_a)


def p2p_time_s(ctx: CostContext, a: StageStrategy, b: StageStrategy, micro_batch_size: int) -> float:
    """Activations (or their gradients) across one stage boundary, one direction, split over the TP ranks."""
    size = micro_batch_size * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes
    return p2p_link(ctx, a, b).p2p_time_s(size / min(a.tp, b.tp)) * ctx.terms.network_scale


# ---- whole strategy ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageEvaluation:
    stage: StageStrategy
    compute_time_s: float  # per micro-batch, forward + backward incl. TP collectives
    backward_time_s: float  # per micro-batch, the window DP sync can hide behind
    p2p_time_s: float  # to the next stage, one direction, per micro-batch
    dp_sync_time_s: float
    dp_exposed_time_s: float
    optimizer_time_s: float
    memory: StageMemory
    memory_capacity_bytes: float
    memory_usable_bytes: float
    family: int = 0  # index of the stage's pipeline family in the strategy

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.memory_usable_bytes

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.memory.total_bytes - self.memory_usable_bytes)

    @property
    def tail_time_s(self) -> float:
        """What the stage waits after the pipeline flush: its exposed DP sync, then its optimizer step."""
        return self.dp_exposed_time_s + self.optimizer_time_s


@dataclass(frozen=True)
class Evaluation:
    strategy: Strategy
    stages: tuple[StageEvaluation, ...]
    iteration_time_s: float
    pipeline_time_s: float
    bubble_time_s: float
    tail_time_s: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    devices_used: int

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    @property
    def shortfall_bytes(self) -> float:
        return max((stage.shortfall_bytes for stage in self.stages), default=0.0)


def cross_family_sync_time_s(
    ctx: CostContext, strategy: Strategy, family: int, stage: StageStrategy, params_per_device: float
) -> float:
    """With several pipeline families, a stage's gradients also meet the other families' copies of its layers: after
    the reduce-scatter inside its own family, each device all-reduces its 1/replicas shard across the families (over
    the slowest path to a device holding those layers in another family: rail inside a group, else cross-group).
    Layer boundaries may differ between families; the volume per device is the same."""
    if len(strategy.pipelines) <= 1:
        return 0.0
    own = ctx.cluster.group(stage.group)
    slowest: Link | None = None
    for other_index, other in enumerate(strategy.pipelines):
        if other_index == family:
            continue
        for partner in other.stages:
            if partner.layer_end <= stage.layer_start or partner.layer_start >= stage.layer_end:
                continue
            if partner.group == stage.group:
                link = ctx.rail_link(own)
            else:
                link = ctx.cross_group_link(own, ctx.cluster.group(partner.group))
            if slowest is None or link.seconds_per_byte(2) > slowest.seconds_per_byte(2):
                slowest = link
    if slowest is None:
        return 0.0
    replicas = strategy.pipelines[family].replicas
    shard_bytes = params_per_device * GRAD_BYTES_PER_PARAM / replicas
    families = len(strategy.pipelines)
    return all_reduce_time_s(shard_bytes, families, slowest) * ctx.terms.network_scale


StageCache = dict[tuple[object, ...], StageEvaluation]


def _stage_key(
    ctx: CostContext, strategy: Strategy, pipeline: PipelineStrategy, index: int, recompute: Recompute
) -> tuple[object, ...]:
    """Everything a stage's evaluation depends on within one context (one pipeline family)."""
    stages = pipeline.stages
    stage = stages[index]
    after: tuple[object, ...] = ()
    if index + 1 < len(stages):
        following = stages[index + 1]
        after = (following.group, following.tp, same_node(ctx.cluster.group(stage.group), stage, following))
    return (
        stage.group,
        stage.num_layers,
        stage.tp,
        recompute,
        index,
        len(stages),
        pipeline.micro_batch_size,
        pipeline.num_microbatches,
        pipeline.replicas,
        strategy.virtual_stages,
        strategy.zero_stage,
        after,
    )


def _evaluate_stages(
    ctx: CostContext, strategy: Strategy, family: int, cache: StageCache | None = None
) -> tuple[list[StageEvaluation], float, float]:
    """The stages of one family, its pipeline time and its bubble. `cache`: stage evaluations of earlier strategies
    in the same context (one family only: across families the sync depends on the other families' layers)."""
    pipeline = strategy.pipelines[family]
    stages = pipeline.stages
    p = len(stages)
    b, m, replicas = pipeline.micro_batch_size, pipeline.num_microbatches, pipeline.replicas
    evaluated = []
    if len(strategy.pipelines) > 1:
        cache = None
    for index, stage in enumerate(stages):
        recompute = strategy.stage_recompute(stage)
        key = _stage_key(ctx, strategy, pipeline, index, recompute) if cache is not None else ()
        if cache is not None and key in cache:
            evaluated.append(replace(cache[key], stage=stage))
            continue
        group = ctx.cluster.group(stage.group)
        first, last = index == 0, index == p - 1
        layer_cost = ctx.source(group.name).layer_cost("decoder", b, stage.tp, recompute)
        compute = stage.num_layers * decoder_layer_time_s(ctx, group, b, stage.tp, recompute)
        compute += edge_time_s(ctx, group, b, stage.tp, first, last)
        params_per_device = stage_params(ctx.model, stage.num_layers, first, last, p) / stage.tp
        dp_time = dp_sync_time_s(ctx, group, params_per_device, stage.tp, replicas)
        dp_time += cross_family_sync_time_s(ctx, strategy, family, stage, params_per_device)
        backward = stage.num_layers * layer_cost.backward_time_s
        memory = stage_memory(
            ctx,
            group,
            num_layers=stage.num_layers,
            micro_batch_size=b,
            tp=stage.tp,
            recompute=recompute,
            dp=replicas,
            in_flight=in_flight_microbatches(index, p, m, strategy.virtual_stages),
            first=first,
            last=last,
            pipeline_stages=p,
        )
        evaluated.append(
            StageEvaluation(
                stage=stage,
                compute_time_s=compute,
                backward_time_s=backward,
                p2p_time_s=p2p_time_s(ctx, stage, stages[index + 1], b) if index + 1 < p else 0.0,
                dp_sync_time_s=dp_time,
                dp_exposed_time_s=exposed_dp_sync_time_s(ctx, dp_time, backward),
                optimizer_time_s=optimizer_time_s(ctx, group, params_per_device, replicas),
                memory=memory,
                memory_capacity_bytes=group.device.memory_bytes,
                memory_usable_bytes=usable_memory_bytes(ctx, group),
                family=family,
            )
        )
        if cache is not None:
            cache[key] = evaluated[-1]
    times = [stage.compute_time_s for stage in evaluated]
    slowest = max(times)
    bubble = (sum(times) - slowest) / strategy.virtual_stages
    p2p = fill_and_drain_time_s(strategy.virtual_stages, sum(stage.p2p_time_s for stage in evaluated))
    return evaluated, m * slowest + bubble + p2p, bubble


def evaluate(ctx: CostContext, strategy: Strategy, cache: StageCache | None = None) -> Evaluation:
    """Iteration time, throughput, MFU and memory per stage of a strategy (assumed structurally valid). With several
    pipeline families, the iteration waits for the slowest family's pipeline, then for the DP sync (across families
    too) and the optimizer step. The strategy's ZeRO stage is the one evaluated (a plan may pin its own). `cache`
    (a dict the caller keeps for one context) reuses stage evaluations across strategies, as the search does."""
    if strategy.zero_stage != ctx.training.zero_stage:
        ctx = replace(ctx, training=ctx.training.model_copy(update={"zero_stage": strategy.zero_stage}))
    evaluated: list[StageEvaluation] = []
    pipeline_time = bubble = -1.0
    for family in range(len(strategy.pipelines)):
        stages, family_time, family_bubble = _evaluate_stages(ctx, strategy, family, cache)
        evaluated.extend(stages)
        if family_time > pipeline_time:
            pipeline_time, bubble = family_time, family_bubble
    tail = max(stage.tail_time_s for stage in evaluated) + ctx.terms.iteration_overhead_s
    iteration = pipeline_time + tail
    samples = ctx.training.global_batch_size
    devices = [(ctx.cluster.group(s.group), p.stage_devices(s)) for p in strategy.pipelines for s in p.stages]
    peak = sum(group.device.peak_flops_for_dtype(ctx.training.dtype) * count for group, count in devices)
    model_flops = ctx.model.model_flops_per_sequence(ctx.seq_length) * samples
    return Evaluation(
        strategy=strategy,
        stages=tuple(evaluated),
        iteration_time_s=iteration,
        pipeline_time_s=pipeline_time,
        bubble_time_s=bubble,
        tail_time_s=tail,
        tokens_per_s=samples * ctx.seq_length / iteration,
        samples_per_s=samples / iteration,
        mfu=model_flops / iteration / peak,
        devices_used=sum(count for _, count in devices),
    )
