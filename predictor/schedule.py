"""The pipeline schedule as a timeline: when each stage runs which forward and backward (1F1B), for pictures.

List scheduling of 1F1B: stage i runs min(p - i - 1, m) warm-up forwards, then alternates one forward and one
backward, then drains its backwards; a forward waits for the previous stage's forward of the same micro-batch plus
the boundary p2p, a backward for the next stage's backward. Where the stages wait for their transfers (plain 1F1B:
blocking sends, `StageEvaluation.p2p_exposed_time_s`), a forward block includes its send to the next stage and a
backward block its send to the previous one. Interleaved 1F1B follows Megatron's order chunk by chunk
(`stage_order`). After the flush every stage syncs its gradients (what the backward did not hide) and steps its
optimizer. Several pipeline families are drawn side by side, one replica each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from predictor.context import CostContext
from predictor.evaluation import Evaluation, interleaved_group_size

Kind = Literal["forward", "backward", "dp_sync", "optimizer"]


@dataclass(frozen=True)
class Block:
    stage: int
    kind: Kind
    micro_batch: int  # -1 for the tail blocks
    start_s: float
    end_s: float
    chunk: int = 0  # the model chunk on this stage (interleaved schedules: 0 .. v-1)


def stage_label(evaluation: Evaluation, index: int) -> str:
    """'3' for stage 3 of a one-family plan, '1.3' for stage 3 of family 1 when there are several."""
    if len(evaluation.strategy.pipelines) == 1:
        return str(index)
    family = evaluation.stages[index].family
    position = sum(1 for s in evaluation.stages[:index] if s.family == family)
    return f"{family}.{position}"


def forward_share(ctx: CostContext, evaluation: Evaluation, stage_index: int) -> float:
    """Forward's share of the stage's fwd+bwd compute time, from its decoder layer costs."""
    stage_eval = evaluation.stages[stage_index]
    pipeline = evaluation.strategy.pipelines[stage_eval.family]
    cost = ctx.source(stage_eval.stage.group).layer_cost(
        "decoder", pipeline.micro_batch_size, stage_eval.stage.tp, evaluation.strategy.stage_recompute(stage_eval.stage)
    )
    return cost.forward_time_s / cost.time_s


def pipeline_timeline(ctx: CostContext, evaluation: Evaluation) -> list[Block]:
    """Blocks of one iteration of one replica of each family (a family's replicas run the same timeline; the
    families run side by side and all wait for the slowest before the DP sync). Stages are numbered as in
    `evaluation.stages`."""
    blocks: list[Block] = []
    for family, pipeline in enumerate(evaluation.strategy.pipelines):
        indices = [i for i, s in enumerate(evaluation.stages) if s.family == family]
        blocks += _family_timeline(
            ctx, evaluation, indices, pipeline.num_microbatches, evaluation.strategy.virtual_stages
        )
    flush = max(block.end_s for block in blocks)
    for i, stage in enumerate(evaluation.stages):
        sync_end = flush + stage.dp_exposed_time_s
        if stage.dp_exposed_time_s > 0:
            blocks.append(Block(i, "dp_sync", -1, flush, sync_end))
        if stage.optimizer_time_s > 0:
            blocks.append(Block(i, "optimizer", -1, sync_end, sync_end + stage.optimizer_time_s))
    return blocks


def stage_order(p: int, m: int, v: int, i: int) -> list[tuple[Kind, int, int]]:
    """What stage i runs, in order: (kind, micro-batch, chunk). Megatron's (interleaved) 1F1B: micro-batches in
    groups of N (interleaved_group_size), each group through chunk 0, 1, ... forward and the reverse backward;
    warm-up forwards (p - i - 1) * 2 + (v - 1) * N (plain 1F1B: p - i - 1), then one forward and one backward,
    then the drain."""
    size = interleaved_group_size(m, p) if v > 1 else p
    starts = range(0, m, size)
    forwards = [(j, k) for begin in starts for k in range(v) for j in range(begin, min(begin + size, m))]
    backwards = [(j, k) for begin in starts for k in reversed(range(v)) for j in range(begin, min(begin + size, m))]
    warmup = min((p - i - 1) * 2 + (v - 1) * size if v > 1 else p - i - 1, m * v)
    order: list[tuple[Kind, int, int]] = [("forward", *forwards[t]) for t in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < m * v:
        if next_forward < m * v:
            order.append(("forward", *forwards[next_forward]))
            next_forward += 1
        order.append(("backward", *backwards[next_backward]))
        next_backward += 1
    return order


def _family_timeline(ctx: CostContext, evaluation: Evaluation, indices: list[int], m: int, v: int) -> list[Block]:
    """List scheduling of (interleaved) 1F1B over one family's stages (`indices` into evaluation.stages, in
    pipeline order). With v chunks, model chunk c = k * p + i lives on stage i as its chunk k and takes 1/v of the
    stage's time; a forward waits for chunk c - 1's forward (plus the boundary p2p; the wrap from the last stage to
    the first is not priced, as in the cost model), a backward for chunk c + 1's backward."""
    stages = [evaluation.stages[i] for i in indices]
    p = len(stages)
    forward = [s.compute_time_s * forward_share(ctx, evaluation, i) / v for i, s in zip(indices, stages, strict=True)]
    backward = [s.compute_time_s / v - f for s, f in zip(stages, forward, strict=True)]
    p2p = [s.p2p_time_s for s in stages]  # to the next stage
    if any(s.p2p_exposed_time_s > 0 for s in stages):  # blocking sends: each block carries its own
        forward = [f + p2p[i] for i, f in enumerate(forward)]
        backward = [b + (p2p[i - 1] if i > 0 else 0.0) for i, b in enumerate(backward)]
        if v == 1:  # the receiver's wait is the sender's block (the cost model's T_i + exposed p2p)
            p2p = [0.0] * p
    last_chunk = p * v - 1
    orders = [stage_order(p, m, v, i) for i in range(p)]
    done: dict[tuple[int, Kind, int, int], float] = {}
    position = [0] * p
    free = [0.0] * p
    blocks: list[Block] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while position[i] < len(orders[i]):
                kind, j, k = orders[i][position[i]]
                chunk = k * p + i
                if kind == "forward":
                    if chunk == 0:
                        dependency, hop = 0.0, 0.0
                    else:
                        before = chunk - 1
                        dependency = done.get((before % p, "forward", j, before // p), -1.0)
                        hop = p2p[i - 1] if i > 0 else 0.0
                    duration = forward[i]
                else:
                    if chunk == last_chunk:
                        dependency, hop = done.get((i, "forward", j, k), -1.0), 0.0
                    else:
                        after = chunk + 1
                        dependency = done.get((after % p, "backward", j, after // p), -1.0)
                        hop = p2p[i] if i < p - 1 else 0.0
                    duration = backward[i]
                if dependency < 0:
                    break
                start = max(free[i], dependency + hop)
                free[i] = start + duration
                done[(i, kind, j, k)] = free[i]
                blocks.append(Block(indices[i], kind, j, start, free[i], k))
                position[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for these orders; guards against an endless loop
            raise RuntimeError("pipeline schedule deadlocked")
    return blocks


def pace_words(evaluation: Evaluation) -> str:
    """The stage that sets the steady-state pace, in a sentence that agrees with the stage table: with several
    families it is the slowest stage of the family that takes longest, and slower stages of other families (which
    run fewer micro-batches) are named as such."""
    stages, families = evaluation.stages, evaluation.strategy.pipelines
    family = max(range(len(families)), key=lambda f: evaluation.family_pipeline_s[f])
    slowest = max((i for i, s in enumerate(stages) if s.family == family), key=lambda i: stages[i].step_time_s)
    stage, ms = stages[slowest].stage, stages[slowest].step_time_s * 1e3
    what = f"Stage {stage_label(evaluation, slowest)} ({stage.group}, {stage.num_layers} layers, TP {stage.tp})"
    if len(families) == 1:
        return f"{what} is the slowest at {ms:.1f} ms per micro-batch: it sets the steady-state pace."
    words = (
        f"{what} sets the pace: at {ms:.1f} ms per micro-batch it is the slowest stage of family {family}, whose "
        f"{families[family].num_microbatches} micro-batches per replica take longest."
    )
    for other in range(len(families)):
        slower = [s.step_time_s for s in stages if s.family == other and s.step_time_s > ms / 1e3]
        if other != family and slower:
            words += (
                f" Family {other}'s stages are slower per micro-batch (up to {max(slower) * 1e3:.1f} ms) but run "
                f"{families[other].num_microbatches}."
            )
    return words


def bottleneck_words(ctx: CostContext, evaluation: Evaluation) -> list[str]:
    """What limits the plan, in sentences."""
    stages = evaluation.stages
    families = evaluation.strategy.pipelines
    slowest_family = max(range(len(families)), key=lambda f: evaluation.family_pipeline_s[f])
    members = [i for i, s in enumerate(stages) if s.family == slowest_family]
    slowest = max(members, key=lambda i: stages[i].step_time_s)
    iteration = evaluation.iteration_time_s
    lines = [
        pace_words(evaluation),
        f"Pipeline bubble {evaluation.bubble_time_s:.3f} s ({evaluation.bubble_time_s / iteration:.1%} of the "
        f"iteration); DP sync and optimizer after the flush {evaluation.tail_time_s:.3f} s "
        f"({evaluation.tail_time_s / iteration:.1%}).",
    ]
    fullest = max(range(len(stages)), key=lambda i: stages[i].memory.total_bytes / stages[i].memory_usable_bytes)
    used = stages[fullest].memory.total_bytes / stages[fullest].memory_usable_bytes
    lines.append(
        f"Memory is tightest on stage {stage_label(evaluation, fullest)} ({stages[fullest].stage.group}): "
        f"{used:.0%} of usable."
    )
    if len(families) > 1:
        shares = "; ".join(
            f"family {f}: {p.replicas} replicas x {len(p.stages)} stage{'s' if len(p.stages) != 1 else ''}, "
            f"{p.micro_batch_size * p.microbatch_total} samples, pipeline {evaluation.family_pipeline_s[f]:.3f} s"
            for f, p in enumerate(families)
        )
        lines.append(
            f"{len(families)} pipeline families run side by side ({shares}); the iteration waits for the slowest, "
            "then gradients are reduced within and across the families."
        )
        return lines
    spread = min(s.step_time_s for s in stages) / stages[slowest].step_time_s
    if spread < 0.9:
        lines.append(f"Stage times are uneven: the fastest stage idles {1 - spread:.0%} of each steady-state slot.")
    return lines


ZERO_SHARDS = {
    0: "every replica keeps the whole optimizer state",
    1: "the optimizer state is sharded",
    2: "gradients and optimizer state are sharded",
    3: "weights, gradients and optimizer state are sharded (weights gathered layer by layer)",
}


def layout_words(ctx: CostContext, evaluation: Evaluation) -> list[str]:
    """The plan's context parallelism and ZeRO sharding in sentences, with what each costs per micro-batch where it
    costs most (the ring's transfers not hidden under attention; ZeRO-2/3 traffic inside the passes)."""
    from predictor.context_parallel import exposed_ring_time_s
    from predictor.sharding import shard_ranks

    strategy, stages = evaluation.strategy, evaluation.stages
    ctx = (evaluation.context or ctx).at_context_parallel(strategy.context_parallel)
    lines = []
    cp = strategy.context_parallel
    if cp > 1:
        ring = []
        for stage in stages:
            pipeline = strategy.pipelines[stage.family]
            b, tp, mode = pipeline.micro_batch_size, stage.stage.tp, strategy.stage_recompute(stage.stage)
            local = ctx.sources[stage.stage.group].layer_cost("decoder", b / cp, tp, mode)
            group = ctx.cluster.group(stage.stage.group)
            forward_s, backward_s = exposed_ring_time_s(ctx, group, b, tp, mode, local)
            ring.append(stage.stage.num_layers * (forward_s + backward_s))
        worst = max(range(len(stages)), key=ring.__getitem__)
        words = (
            f"Context parallel {cp}: each replica's {ctx.seq_length}-token sequences are split over {cp} ranks "
            f"({ctx.seq_length // cp} tokens each) that pass K/V blocks around a ring; "
        )
        if ring[worst] > 0:
            share = ring[worst] / stages[worst].compute_time_s
            words += (
                f"the ring's transfers not hidden under attention add {ring[worst] * 1e3:.1f} ms per micro-batch on "
                f"stage {stage_label(evaluation, worst)} ({stages[worst].stage.group}, {share:.0%} of its compute)."
            )
        else:
            words += "every ring step hides under its attention."
        lines.append(words)
    sentences = []
    for family, pipeline in enumerate(strategy.pipelines):
        zero = strategy.family_zero_stage(pipeline)
        members = [i for i, stage in enumerate(stages) if stage.family == family]
        first = stages[members[0]].stage
        sharded = replace(
            ctx, training=ctx.training.model_copy(update={"zero_stage": zero, "zero_shard": strategy.zero_shard})
        )
        ranks = shard_ranks(sharded, ctx.cluster.group(first.group), first.tp, pipeline.replicas)
        where = " inside each node (hybrid sharding)" if strategy.zero_shard == "node" and zero else ""
        if zero and ranks == 1:  # it read "sharded over 1 ranks"
            words = f"ZeRO-{zero}: one replica, nothing to shard over: every device keeps its stage's whole state"
        else:
            words = f"ZeRO-{zero}: {ZERO_SHARDS[zero]}" + (f" over {ranks} ranks{where}" if zero else "")
        worst = max(members, key=lambda i: stages[i].sharded_exposed_time_s)
        if zero >= 2 and stages[worst].sharded_exposed_time_s > 0:
            exposed = stages[worst].sharded_exposed_time_s
            words += (
                f"; their traffic inside the passes adds {exposed * 1e3:.1f} ms per micro-batch on stage "
                f"{stage_label(evaluation, worst)} ({stages[worst].stage.group}, "
                f"{exposed / stages[worst].compute_time_s:.0%} of its compute)"
            )
        sentences.append(words + ".")
    if len(set(sentences)) == 1:  # every family shards alike: one sentence
        return lines + sentences[:1]
    return lines + [f"Family {family}: {words}" for family, words in enumerate(sentences)]
