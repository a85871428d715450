"""Yardsticks every plan is measured against.

Upper bound (HETHUB's): the sum over groups of the tokens/s each group reaches alone with its best homogeneous
plan. A group too small to hold the model alone is planned as if it had enough nodes (doubling until the model
fits) and credited with that plan's tokens/s per device times its real device count; such groups are listed.
Compute bound (the physical limit): every device busy at its profiled layer speed (TP 1, best micro-batch, no
recompute), no bubble, no communication, no memory limit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from predictor.cost_model import CostContext, Evaluation
from specs.cluster import DeviceGroup

MAX_SCALE_DOUBLINGS = 8


def compute_bound_tokens_per_s(ctx: CostContext) -> float:
    """Tokens/s with every device busy at its profiled layer speed (TP 1, best micro-batch, no recompute, whole
    sequences: no context parallelism, whose per-rank costs would count each rank's tokens as a whole sequence)."""
    model, seq = ctx.model, ctx.seq_length
    total = 0.0
    for group in ctx.cluster.groups:
        source = ctx.sources[group.name]
        best = 0.0
        for size in ctx.training.micro_batch_sizes:
            time_s = (
                model.num_layers * source.layer_cost("decoder", size, 1, "none").time_s
                + source.layer_cost("embedding", size, 1, "none").time_s
                + source.layer_cost("lm_head", size, 1, "none").time_s
            )
            best = max(best, size * seq / time_s)
        total += best * group.num_devices
    return total


def group_alone_tokens_per_s(
    ctx: CostContext, group: DeviceGroup, fastest: Callable[[CostContext], Evaluation | None]
) -> tuple[float, bool]:
    """(tokens/s of the group's best homogeneous plan, whether it had to be scaled up to fit the model). `fastest`:
    the fastest plan that fits a context, or None (planner.search.fastest: the bound uses the same search as the
    plan)."""
    for doubling in range(MAX_SCALE_DOUBLINGS + 1):
        scaled = group.with_nodes(group.nodes * 2**doubling)
        alone = replace(ctx, cluster=ctx.cluster.only(scaled), sources={scaled.name: ctx.sources[group.name]})
        best = fastest(alone)
        if best is not None:
            if doubling == 0:
                return best.tokens_per_s, False
            return best.tokens_per_s * group.num_devices / best.devices_used, True
    alone = replace(ctx, cluster=ctx.cluster.only(group), sources={group.name: ctx.sources[group.name]})
    return compute_bound_tokens_per_s(alone), True
