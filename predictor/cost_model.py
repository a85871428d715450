"""The cost model: compose layer costs and communication into iteration time and memory per stage.

1F1B with stage times T_i (forward + backward per micro-batch, TP communication included) and boundary p2p c_i
over m micro-batches takes sum_i(T_i + 2*c_i) + (m-1)*max_i T_i (DESIGN.md); interleaving with v chunks divides the
bubble, (sum_i T_i - max_i T_i), by v while there are micro-batches enough to fill the loop through the stages
(evaluation.pipeline_makespan_s: with m < p, the rounds wait for that loop instead). DP gradient sync overlaps the
last micro-batch's backward when the engine overlaps it; whatever sticks out, plus the optimizer step, follows the
pipeline flush; a tied model's first and last stages then all-reduce the embedding matrix's gradient between them
(Megatron's embedding group: tied_embedding_sync_time_s).
Memory per device: bf16 weights (2 B/param), fp32 main grads (4), Adam fp32 master + m + v (12, divided by the
DP degree under ZeRO-1), activations of in-flight micro-batches under 1F1B (min(p - i, m) on stage i).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from predictor.comm_model import Link, all_reduce_time_s
from predictor.context import CostContext, EndToEndTerms, build_context, emulated
from predictor.context_parallel import RING_BUFFERS, ring_block_bytes
from predictor.evaluation import (
    Evaluation,
    Seconds,
    StageEvaluation,
    StageMemory,
    interleaved_group_size,
    pipeline_makespan_s,
)
from predictor.host import (
    busy_processes,
    evaluate_on_host,
    family_sync_overhead_s,
    simulate_on_host,
    stage_overhead_s,
    step_overhead_s,
)
from predictor.sharding import (
    GRAD_BYTES_PER_PARAM,
    DpSync,
    dp_sync_time_s,
    exposed_dp_sync_time_s,
    fp8_weight_copy_bytes,
    gathered_weights_bytes,
    optimizer_time_s,
    shard_ranks,
    sharded_exposed_time_s,
    state_bytes,
    state_bytes_per_param,
)
from predictor.sharing import StepSimulation
from specs.cluster import DeviceGroup
from specs.layout import PipelineStrategy, StageStrategy, Strategy, same_node
from specs.model import ModelSpec, Recompute

# Re-exported: the cost model's inputs and the sharding rules the planner's bounds share.
__all__ = [
    "GRAD_BYTES_PER_PARAM",
    "CostContext",
    "DpSync",
    "EndToEndTerms",
    "Evaluation",
    "StageEvaluation",
    "StageMemory",
    "build_context",
    "decoder_layer_time_s",
    "dp_sync_time_s",
    "edge_time_s",
    "emulated",
    "evaluate",
    "exposed_dp_sync_time_s",
    "interleaved_group_size",
    "optimizer_time_s",
    "state_bytes_per_param",
]

# With Transformer Engine's TP communication overlap (`tp_comm_overlap`), a layer's TP collectives run under its
# GEMMs in chunks: hidden up to this share of the layer's compute (the GEMMs' share of a decoder layer's time).
TP_OVERLAP_SHARE = 0.8
LOSS_STAT_BYTES = 4  # the vocabulary-parallel loss reduces fp32 statistics per token


# ---- per-stage pieces (also used by the planner's inner solvers) ---------------------------------------------
def tp_collective_time_s(ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int) -> float:
    """One all-reduce-sized TP collective of b*s*h activations inside the node (s/cp tokens per CP rank)."""
    size = micro_batch_size * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes / ctx.context_parallel
    return all_reduce_time_s(size, tp, ctx.tp_link(group)) * ctx.terms.tp_comm_scale


def decoder_layer_time_s(
    ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int, recompute: Recompute
) -> float:
    """Forward + backward of one decoder layer shard for one micro-batch, with its 4 TP collectives
    (2 forward, 2 backward; full recompute repeats the 2 forward ones), less what TP overlap hides under the GEMMs."""
    cost = ctx.source(group).layer_cost("decoder", micro_batch_size, tp, recompute)
    collectives_s = (6 if recompute == "full" else 4) * tp_collective_time_s(ctx, group, micro_batch_size, tp)
    if ctx.training.tp_comm_overlap:
        collectives_s = max(0.0, collectives_s - TP_OVERLAP_SHARE * cost.time_s)
    return cost.time_s + collectives_s


def loss_collectives_time_s(ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int) -> float:
    """The vocabulary-parallel loss's 3 all-reduces of one fp32 number per token (the logits' maximum, the sum of
    their exponentials, the target's logit), as Megatron's and the runtime's: small, so mostly their latency."""
    size = micro_batch_size * ctx.seq_length * LOSS_STAT_BYTES / ctx.context_parallel
    return 3 * all_reduce_time_s(size, tp, ctx.tp_link(group)) * ctx.terms.tp_comm_scale


def edge_time_s(ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int, first: bool, last: bool) -> float:
    """Embedding (first stage) and final norm + LM head + loss (last stage) per micro-batch, with their TP
    collectives (edge_collectives_time_s)."""
    source = ctx.source(group)
    time_s = edge_collectives_time_s(ctx, group, micro_batch_size, tp, first, last)
    if first:
        time_s += source.layer_cost("embedding", micro_batch_size, tp, "none").time_s
    if last:
        time_s += source.layer_cost("lm_head", micro_batch_size, tp, "none").time_s
    return time_s


def edge_collectives_time_s(
    ctx: CostContext, group: DeviceGroup, micro_batch_size: int, tp: int, first: bool, last: bool
) -> float:
    """The embedding's and the head's TP collectives per micro-batch: the embedding's partial lookups (first
    stage); the head's input gradient and the loss's (last stage). 0 at TP 1."""
    if tp <= 1:
        return 0.0
    time_s = tp_collective_time_s(ctx, group, micro_batch_size, tp) if first else 0.0
    if last:
        time_s += tp_collective_time_s(ctx, group, micro_batch_size, tp)
        time_s += loss_collectives_time_s(ctx, group, micro_batch_size, tp)
    return time_s


def tp_collectives(
    ctx: CostContext, micro_batch_size: int, num_layers: int, tp: int, recompute: Recompute, first: bool, last: bool
) -> tuple[int, float]:
    """The TP collectives one rank of a stage makes per micro-batch and the bytes they reduce: 4 activations per
    decoder layer (full recompute repeats the forward's 2), 1 for the embedding, 1 for the head and the loss's 3
    per-token statistics; none at TP 1."""
    if tp <= 1:
        return 0, 0.0
    activations = num_layers * (6 if recompute == "full" else 4) + (1 if first else 0) + (1 if last else 0)
    tokens = micro_batch_size * ctx.seq_length / ctx.context_parallel
    activation_bytes = tokens * ctx.model.hidden_size * ctx.training.dtype_bytes
    loss_statistics = 3 if last else 0
    return (
        activations + loss_statistics,
        activations * activation_bytes + loss_statistics * tokens * LOSS_STAT_BYTES,
    )


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
    """Peak bytes of one device of a stage: its (sharded) state, ZeRO 3's gathered layers, in-flight activations."""
    params = stage_params(ctx.model, num_layers, first, last, pipeline_stages) / tp
    weights, grads, optimizer = state_bytes(ctx, params, group, tp, dp)
    weights += gathered_weights_bytes(ctx, ctx.model.layer_params() / tp, num_layers, dp)
    weights += fp8_weight_copy_bytes(ctx, group, params)
    source = ctx.source(group)
    per_microbatch = num_layers * source.layer_cost("decoder", micro_batch_size, tp, recompute).activation_bytes
    if first:
        per_microbatch += source.layer_cost("embedding", micro_batch_size, tp, "none").activation_bytes
    activations = per_microbatch * in_flight
    if last:  # logits live for one micro-batch: 1F1B runs its backward right after its forward
        activations += source.layer_cost("lm_head", micro_batch_size, tp, "none").activation_bytes
    if ctx.context_parallel > 1 and num_layers:  # the computing layer's ring buffers
        activations += RING_BUFFERS * ring_block_bytes(ctx, micro_batch_size, tp)
    return StageMemory(
        weights_bytes=weights, grads_bytes=grads, optimizer_bytes=optimizer, activation_bytes=activations
    )


def usable_memory_bytes(ctx: CostContext, group: DeviceGroup) -> float:
    return group.device.memory_bytes * (1 - ctx.training.memory_reserve_fraction)


def least_sync_and_step_per_layer_s(
    ctx: CostContext, group: DeviceGroup, tp: int, replicas: int
) -> tuple[DpSync, float]:
    """(DP sync, optimizer step) per decoder layer of a stage at their least, for the planner's bounds: DP time is
    concave in the bytes with no time at zero, so per layer it is least with all L layers on the stage; the optimizer
    step is linear in the layers."""
    num_layers = ctx.model.num_layers
    params = ctx.model.layer_params() / tp
    sync = dp_sync_time_s(ctx, group, num_layers * params, tp, replicas).scaled(1 / num_layers)
    return sync, optimizer_time_s(ctx, group, params, replicas)


def tail_per_layer_lower_bound_s(ctx: CostContext, backward_s: float, sync_and_step_s: tuple[DpSync, float]) -> float:
    """A lower bound on a stage's tail (exposed DP sync + optimizer step, as `evaluate` charges it) per decoder layer
    it holds, from one layer's backward time and least_sync_and_step_per_layer_s: the windows hiding the sync are
    linear in the layers too (the forward, which hides weight gathers, is at most the backward); embedding / LM-head
    parameters and the sync across families only add."""
    sync, optimizer_s = sync_and_step_s
    return exposed_dp_sync_time_s(ctx, sync, backward_s, backward_s) + optimizer_s


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
    """Activations (or their gradients) across one stage boundary, one direction, split over the TP ranks (and
    the CP ranks, each sending its own tokens)."""
    size = micro_batch_size * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes / ctx.context_parallel
    return p2p_link(ctx, a, b).p2p_time_s(size / min(a.tp, b.tp)) * ctx.terms.network_scale


# ---- whole strategy ------------------------------------------------------------------------------------------
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
    ranks = shard_ranks(ctx, own, stage.tp, strategy.pipelines[family].replicas)
    shard_bytes = params_per_device * GRAD_BYTES_PER_PARAM / ranks
    families = len(strategy.pipelines)
    host_work = family_sync_overhead_s(ctx, own, params_per_device)  # a local run's indexing and copies
    return all_reduce_time_s(shard_bytes, families, slowest) * ctx.terms.network_scale + host_work


def tied_partner(model: ModelSpec, stages: tuple[StageStrategy, ...], index: int) -> StageStrategy | None:
    """The stage a tied model's stage `index` sums the embedding matrix's gradient with: the last stage for the first
    (its LM head's copy of the matrix) and the first for the last, in a pipeline of several stages; else none."""
    if not model.tied_embeddings or len(stages) < 2 or index not in (0, len(stages) - 1):
        return None
    return stages[-1] if index == 0 else stages[0]


def tied_embedding_sync_time_s(ctx: CostContext, stages: tuple[StageStrategy, ...], index: int) -> float:
    """A tied model's embedding matrix sits on the first stage and, as the LM head's copy, on the last: after the DP
    sync each device of the two all-reduces its TP shard's gradient (fp32 main gradients) with its counterpart over
    the link between the stages (Megatron's embedding group, finalize_model_grads), not overlapped with anything."""
    partner = tied_partner(ctx.model, stages, index)
    if partner is None:
        return 0.0
    stage = stages[index]
    shard_bytes = ctx.model.vocab_size * ctx.model.hidden_size / stage.tp * GRAD_BYTES_PER_PARAM
    return all_reduce_time_s(shard_bytes, 2, p2p_link(ctx, stage, partner)) * ctx.terms.network_scale


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
    tied: tuple[object, ...] = ()
    partner = tied_partner(ctx.model, stages, index)
    if partner is not None:
        tied = (partner.group, same_node(ctx.cluster.group(stage.group), stage, partner))
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
        strategy.family_zero_stage(pipeline),
        strategy.zero_shard,
        strategy.context_parallel,
        after,
        ctx.processes_per_core,
        tied,
    )


def p2p_exposed(strategy: Strategy, one_way_s: list[float], index: int, overlap_p2p_comm: bool) -> float:
    """Per micro-batch, what a stage waits for its point-to-point: in plain 1F1B (Megatron's non-interleaved
    schedule) every forward is followed by a blocking send/receive with the next stage and every backward by one with
    the previous stage, so each boundary's transfer sits on the critical path once per micro-batch and chunk. The
    interleaved schedule hides them when the engine overlaps p2p (`overlap_p2p_comm`, Megatron's default)."""
    v = strategy.virtual_stages
    if v > 1 and overlap_p2p_comm:
        return 0.0
    before = one_way_s[index - 1] if index > 0 else 0.0
    return v * (before + one_way_s[index])


def _evaluate_stage(
    ctx: CostContext, strategy: Strategy, family: int, index: int, recompute: Recompute
) -> StageEvaluation:
    """One stage of one family, without its p2p exposure (which needs its neighbours)."""
    pipeline = strategy.pipelines[family]
    stages, stage = pipeline.stages, pipeline.stages[index]
    p, b, replicas = len(stages), pipeline.micro_batch_size, pipeline.replicas
    group = ctx.cluster.group(stage.group)
    first, last = index == 0, index == p - 1
    layer_cost = ctx.source(group).layer_cost("decoder", b, stage.tp, recompute)
    layer_time_s = decoder_layer_time_s(ctx, group, b, stage.tp, recompute)
    collectives = tp_collectives(ctx, b, stage.num_layers, stage.tp, recompute, first, last)
    overhead = stage_overhead_s(ctx, group, stage.num_layers, stage.tp, collectives)
    compute = stage.num_layers * layer_time_s + edge_time_s(ctx, group, b, stage.tp, first, last) + overhead
    params_per_device = stage_params(ctx.model, stage.num_layers, first, last, p) / stage.tp
    sync = dp_sync_time_s(ctx, group, params_per_device, stage.tp, replicas)
    backward, forward = stage.num_layers * layer_cost.backward_time_s, stage.num_layers * layer_cost.forward_time_s
    sharded = sharded_exposed_time_s(ctx, sync, backward, forward)
    across = cross_family_sync_time_s(ctx, strategy, family, stage, params_per_device)
    tied = tied_embedding_sync_time_s(ctx, stages, index)
    # a local run's indexing and copies of the sharded sync (runtime.sync), across families or between tied copies
    host_work = family_sync_overhead_s(ctx, group, params_per_device) if across > 0 or tied > 0 else 0.0
    if ctx.training.zero_stage <= 1:  # the shards cross families after the family's own reduction, overlapped alike
        exposed = exposed_dp_sync_time_s(ctx, sync + DpSync(across, 0.0), backward, forward)
    else:  # ZeRO 2/3 reduce per micro-batch: the shards cross families once, after the last
        exposed = exposed_dp_sync_time_s(ctx, sync, backward, forward) + across
    exposed += tied
    memory = stage_memory(
        ctx,
        group,
        num_layers=stage.num_layers,
        micro_batch_size=b,
        tp=stage.tp,
        recompute=recompute,
        dp=replicas,
        in_flight=in_flight_microbatches(index, p, pipeline.num_microbatches, strategy.virtual_stages),
        first=first,
        last=last,
        pipeline_stages=p,
    )
    return StageEvaluation(
        stage=stage,
        compute_time_s=compute + sharded,
        backward_time_s=backward,
        p2p_time_s=p2p_time_s(ctx, stage, stages[index + 1], b) if index + 1 < p else 0.0,
        dp_sync_time_s=sync.total_s + across + tied,
        dp_exposed_time_s=exposed,
        optimizer_time_s=optimizer_time_s(ctx, group, params_per_device, replicas, stage.tp),
        memory=memory,
        memory_capacity_bytes=group.device.memory_bytes,
        memory_usable_bytes=usable_memory_bytes(ctx, group),
        family=family,
        # the decoder layers' TP collectives and the edges' (the runtime times them all as TP collectives; a rank
        # waits in them, which predictor/sharing.py counts as asleep rather than computing)
        tp_comm_time_s=stage.num_layers * (layer_time_s - layer_cost.time_s)
        + edge_collectives_time_s(ctx, group, b, stage.tp, first, last),
        sharded_exposed_time_s=sharded,
        overhead_time_s=overhead,
        sync_host_time_s=min(host_work, exposed),
        gather_exposed_time_s=exposed_dp_sync_time_s(ctx, DpSync(0.0, sync.params_s), backward, forward),
        tied_sync_time_s=tied,
    )


def _evaluate_stages(
    ctx: CostContext, strategy: Strategy, family: int, cache: StageCache | None = None
) -> tuple[list[StageEvaluation], float, float]:
    """The stages of one family, its pipeline time and its bubble. `cache`: stage evaluations of earlier strategies
    in the same context (one family only: across families the sync depends on the other families' layers).

    Stage i's time per micro-batch is T_i = compute + exposed p2p; over m micro-batches and v chunks the pipeline
    takes m * max T + (sum T - max T) / v (with fewer micro-batches than fill the loop through the stages, sum T +
    (m - 1) * max T / v: pipeline_makespan_s), plus the fill and drain point-to-point when no stage waits for its
    transfers in the steady state (interleaving with overlapped p2p) or when chunks multiply them (v > 1 without
    overlap: counted both ways, an upper estimate). In plain 1F1B the exposed transfers already carry the fill and
    drain: sum T = sum(compute) + 2 * sum(one-way p2p)."""
    pipeline = strategy.pipelines[family]
    stages = pipeline.stages
    own_stage = strategy.family_zero_stage(pipeline)
    if own_stage != ctx.training.zero_stage:  # a family of its own ZeRO stage
        ctx = replace(ctx, training=ctx.training.model_copy(update={"zero_stage": own_stage}))
    if len(strategy.pipelines) > 1:
        cache = None
    evaluated = []
    for index, stage in enumerate(stages):
        recompute = strategy.stage_recompute(stage)
        key = _stage_key(ctx, strategy, pipeline, index, recompute) if cache is not None else ()
        if cache is not None and key in cache:
            evaluated.append(replace(cache[key], stage=stage))
            continue
        evaluated.append(_evaluate_stage(ctx, strategy, family, index, recompute))
        if cache is not None:
            cache[key] = evaluated[-1]
    one_way = [stage.p2p_time_s for stage in evaluated]
    overlap = ctx.training.overlap_p2p_comm
    evaluated = [
        replace(stage, p2p_exposed_time_s=p2p_exposed(strategy, one_way, index, overlap))
        for index, stage in enumerate(evaluated)
    ]
    v = strategy.virtual_stages
    times = [stage.step_time_s for stage in evaluated]
    slowest = max(times)
    m = pipeline.num_microbatches
    bubble = pipeline_makespan_s(m, v, slowest, sum(times)) - m * slowest
    fill_and_drain = fill_and_drain_time_s(v, sum(one_way)) if v > 1 else 0.0
    return evaluated, m * slowest + bubble + fill_and_drain, bubble


def simulated_step(ctx: CostContext, strategy: Strategy) -> StepSimulation | None:
    """The traced step simulation behind `evaluate` of a local run on a profiled host (predictor.sharing: every
    actor's events, for the run record beside the measured timeline); None where no simulation decides the step."""
    ctx = _at_strategy(ctx, strategy)
    if not _on_shared_host(ctx, strategy):
        return None
    return simulate_on_host(ctx, strategy, lambda loaded: evaluate(loaded, strategy), trace=True)


def _on_shared_host(ctx: CostContext, strategy: Strategy) -> bool:
    """Whether the strategy's processes share a profiled host whose core sharing is not yet applied: a simulation
    of the step decides its evaluation (predictor.host.evaluate_on_host)."""
    return bool(ctx.host) and not ctx.processes_per_core and busy_processes(ctx, strategy) > 0


def _at_strategy(ctx: CostContext, strategy: Strategy) -> CostContext:
    """The context at the strategy's ZeRO stage and shard and its CP degree."""
    if (strategy.zero_stage, strategy.zero_shard) != (ctx.training.zero_stage, ctx.training.zero_shard):
        update = {"zero_stage": strategy.zero_stage, "zero_shard": strategy.zero_shard}
        ctx = replace(ctx, training=ctx.training.model_copy(update=update))
    return ctx.at_context_parallel(strategy.context_parallel)


def evaluate(ctx: CostContext, strategy: Strategy, cache: StageCache | None = None) -> Evaluation:
    """Iteration time, throughput, MFU and memory per stage of a strategy (assumed structurally valid). With several
    pipeline families, the iteration waits for the slowest family's pipeline, then for the DP sync (across families
    too) and the optimizer step. The strategy's ZeRO stage is the one evaluated (a plan may pin its own). `cache`
    (a dict the caller keeps for one context) reuses stage evaluations across strategies, as the search does."""
    ctx = _at_strategy(ctx, strategy)
    if _on_shared_host(ctx, strategy):
        return evaluate_on_host(ctx, strategy, lambda loaded: evaluate(loaded, strategy, cache))
    evaluated: list[StageEvaluation] = []
    pipeline_time = bubble = -1.0
    family_times = []
    for family in range(len(strategy.pipelines)):
        stages, family_time, family_bubble = _evaluate_stages(ctx, strategy, family, cache)
        evaluated.extend(stages)
        family_times.append(family_time)
        if family_time > pipeline_time:
            pipeline_time, bubble = family_time, family_bubble
    tail = max(stage.tail_time_s for stage in evaluated) + ctx.terms.iteration_overhead_s
    tail += step_overhead_s(ctx, strategy)
    iteration = pipeline_time + tail
    samples = ctx.training.global_batch_size
    devices = [(ctx.cluster.group(s.group), p.stage_devices(s)) for p in strategy.pipelines for s in p.stages]
    # MFU against the dense 16-bit peak for fp8 training too (the convention of published fp8 runs)
    mfu_dtype = "bf16" if ctx.training.dtype == "fp8" else ctx.training.dtype
    peak = sum(
        group.device.peak_flops_for_dtype(mfu_dtype, ctx.training.fp32_matmul) * count for group, count in devices
    )
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
        family_pipeline_s=tuple(family_times),
        context=ctx,
    )
