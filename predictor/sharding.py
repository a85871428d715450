"""Data parallelism and ZeRO sharding: what each device holds, what its DP group sends, and how much of it the
engine hides behind compute.

Per parameter and device (mixed precision, Adam): 16-bit weights 2 B, fp32 main gradients 4 B, fp32 master weights
+ m + v 12 B (8 when training in fp32). ZeRO stage 1 (Megatron's distributed optimizer) divides the optimizer state
by the DP degree; 2 the gradients too; 3 (FSDP) the weights too, which are then all-gathered layer by layer before
each forward and again before each backward (two layers' full weights in flight: the one computing and the one
prefetched).

Traffic per iteration of one stage's DP group (each rank's shard, nccl-tests ring volumes, two-level over the node):
  ZeRO 0  all-reduce of the gradients after the last backward;
  ZeRO 1  reduce-scatter of the gradients after the last backward, all-gather of the 16-bit weights after the step;
  ZeRO 2  reduce-scatter of the gradients after every micro-batch's backward (no full gradient buffer, DeepSpeed),
          all-gather of the weights after the step;
  ZeRO 3  every micro-batch: all-gather of the weights before the forward and before the backward, reduce-scatter of
          the gradients after the backward; nothing after the step.
What hides: with `overlap_grad_reduce` the gradient reduction overlaps the backward it follows (`dp_overlap` of it);
with `overlap_param_gather` the weight all-gather overlaps the forward (the next iteration's first one for ZeRO 1/2,
prefetched layer by layer for ZeRO 3). Per-micro-batch traffic that sticks out lengthens that stage's time per
micro-batch; per-iteration traffic that sticks out follows the pipeline flush with the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from predictor.comm_model import (
    all_gather_time_s,
    all_reduce_time_s,
    hierarchical_all_reduce_time_s,
    hierarchical_reduce_scatter_time_s,
    reduce_scatter_time_s,
)
from predictor.context import CostContext
from specs.cluster import DeviceGroup
from specs.layout import dp_layout

GRAD_BYTES_PER_PARAM = 4  # fp32 main gradients (Megatron's default for bf16 training)
OPTIMIZER_BYTES_PER_PARAM_MIXED = 12  # fp32 master weights + Adam m + v
OPTIMIZER_BYTES_PER_PARAM_FP32 = 8  # Adam m + v when the weights already are fp32
ADAM_BYTES_MOVED_PER_PARAM = 30  # read grad, master, m, v (16) + write master, m, v (12) + write 16-bit weight (2)
OPTIMIZER_BW_EFFICIENCY = 0.7
GATHERED_LAYERS = 2  # ZeRO 3: the layer computing and the one being prefetched hold their full weights
FP8_WEIGHT_COPY_BYTES = 1  # fp8 training keeps an fp8 cast of each weight for its GEMMs beside the bf16 one


@dataclass(frozen=True)
class DpSync:
    """One reduction of a stage's gradients and one gather of its weights over its DP group, seconds (each 0 with one
    replica). ZeRO 0 reduces with an all-reduce and gathers nothing; the others reduce-scatter and all-gather."""

    grads_s: float
    params_s: float

    def __add__(self, other: DpSync) -> DpSync:
        return DpSync(self.grads_s + other.grads_s, self.params_s + other.params_s)

    def scaled(self, factor: float) -> DpSync:
        return DpSync(self.grads_s * factor, self.params_s * factor)

    @property
    def total_s(self) -> float:
        return self.grads_s + self.params_s


NO_SYNC = DpSync(0.0, 0.0)


def hybrid(ctx: CostContext) -> bool:
    """ZeRO shards inside each node and replicates across nodes (TrainingSpec.zero_shard: node)."""
    return ctx.training.zero_shard == "node" and ctx.training.zero_stage >= 1


def shard_ranks(ctx: CostContext, group: DeviceGroup, tp: int, replicas: int) -> int:
    """The ranks ZeRO shards a stage's state over: its replicas and their CP ranks, or under hybrid sharding those of
    them inside one node."""
    ranks = ctx.gradient_ranks(replicas)
    return dp_layout(group, tp, ranks)[0] if hybrid(ctx) else ranks


def state_bytes_per_param(ctx: CostContext, dp: int) -> float:
    """Weights + grads + optimizer bytes per parameter on one device, as the ZeRO stage shards them over `dp` replicas
    and their CP ranks (a lower figure under hybrid sharding, which shards over fewer: the planner's bounds)."""
    weights, grads, optimizer = _state_bytes(ctx, ctx.gradient_ranks(dp))
    return weights + grads + optimizer


def _state_bytes(ctx: CostContext, dp: int) -> tuple[float, float, float]:
    training = ctx.training
    stage = training.zero_stage
    optimizer = OPTIMIZER_BYTES_PER_PARAM_FP32 if training.dtype == "fp32" else OPTIMIZER_BYTES_PER_PARAM_MIXED
    weights, grads = float(training.dtype_bytes), float(GRAD_BYTES_PER_PARAM)
    return (
        weights / dp if stage >= 3 else weights,
        grads / dp if stage >= 2 else grads,
        optimizer / dp if stage else optimizer,
    )


def state_bytes(
    ctx: CostContext, params_per_device: float, group: DeviceGroup, tp: int, dp: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of `params_per_device` parameters of a stage of TP `tp` with `dp`
    replicas, as the ZeRO stage shards them (shard_ranks)."""
    weights, grads, optimizer = _state_bytes(ctx, shard_ranks(ctx, group, tp, dp))
    return params_per_device * weights, params_per_device * grads, params_per_device * optimizer


def fp8_weight_copy_bytes(ctx: CostContext, group: DeviceGroup, params_per_device: float) -> float:
    """fp8 training on a device with FP8: the fp8 copies of the stage's weights its GEMMs read (unsharded: ZeRO 3
    gathers them per layer too, but Transformer Engine caches the cast for the weights it holds)."""
    if group.device.runs_dtype(ctx.training.dtype) != "fp8":
        return 0.0
    return params_per_device * FP8_WEIGHT_COPY_BYTES


def gathered_weights_bytes(ctx: CostContext, layer_params_per_device: float, num_layers: int, dp: int) -> float:
    """ZeRO 3: the full weights of the layers in flight (the one computing and the one prefetched)."""
    if ctx.training.zero_stage < 3 or ctx.gradient_ranks(dp) <= 1 or num_layers <= 0:
        return 0.0
    return min(num_layers, GATHERED_LAYERS) * layer_params_per_device * ctx.training.dtype_bytes


def dp_sync_time_s(ctx: CostContext, group: DeviceGroup, params_per_device: float, tp: int, replicas: int) -> DpSync:
    """One gradient reduction and one weight gather of `params_per_device` over the stage's DP group (two-level
    over the node, or a flat ring when faster). Under context parallelism the replicas' CP ranks join the group."""
    ranks = ctx.gradient_ranks(replicas)
    if ranks <= 1:
        return NO_SYNC
    per_node, nodes = dp_layout(group, tp, ranks)
    inner, outer = ctx.in_node_link(group), ctx.rail_link(group)
    grads = params_per_device * GRAD_BYTES_PER_PARAM
    scale = ctx.terms.network_scale
    if ctx.training.zero_stage == 0:
        return DpSync(hierarchical_all_reduce_time_s(grads, per_node, nodes, inner, outer) * scale, 0.0)
    weights = params_per_device * ctx.training.dtype_bytes
    if hybrid(ctx) and nodes > 1:  # reduce-scatter in the node, all-reduce each shard across; gathers stay inside
        across = all_reduce_time_s(grads / per_node, nodes, outer)
        return DpSync(
            (reduce_scatter_time_s(grads, per_node, inner) + across) * scale,
            all_gather_time_s(weights, per_node, inner) * scale,
        )
    return DpSync(
        hierarchical_reduce_scatter_time_s(grads, per_node, nodes, inner, outer) * scale,
        hierarchical_reduce_scatter_time_s(weights, per_node, nodes, inner, outer, "all_gather") * scale,
    )


def _hidden_s(ctx: CostContext, overlapped: bool, window_s: float) -> float:
    return ctx.terms.dp_overlap * window_s if overlapped else 0.0


def exposed_dp_sync_time_s(ctx: CostContext, sync: DpSync, backward_s: float, forward_s: float) -> float:
    """The per-iteration DP traffic that sticks out past the pipeline flush (it and the optimizer step follow it):
    ZeRO 0/1 the gradient reduction past the last micro-batch's backward `backward_s`; ZeRO 1/2 the weight gather,
    hidden by the next iteration's first forward `forward_s` when the engine overlaps it; ZeRO 3 nothing (its
    traffic is per micro-batch: sharded_exposed_time_s)."""
    training = ctx.training
    exposed = 0.0
    if training.zero_stage <= 1:
        exposed += max(0.0, sync.grads_s - _hidden_s(ctx, training.overlap_grad_reduce, backward_s))
    if training.zero_stage in (1, 2):
        exposed += max(0.0, sync.params_s - _hidden_s(ctx, training.overlap_param_gather, forward_s))
    return exposed


def sharded_exposed_time_s(ctx: CostContext, sync: DpSync, backward_s: float, forward_s: float) -> float:
    """What ZeRO 2/3's per-micro-batch traffic adds to a stage's time per micro-batch (`backward_s`, `forward_s`:
    one micro-batch's): ZeRO 2 the gradient reduce-scatter past the backward; ZeRO 3 also the weight all-gathers
    past the forward and the backward (prefetched when the engine overlaps them)."""
    training = ctx.training
    if training.zero_stage < 2:
        return 0.0
    gathers_s = sync.params_s if training.zero_stage == 3 else 0.0
    forward_exposed = max(0.0, gathers_s - _hidden_s(ctx, training.overlap_param_gather, forward_s))
    backward_traffic = sync.grads_s + gathers_s
    hidden = _hidden_s(ctx, training.overlap_grad_reduce or training.overlap_param_gather, backward_s)
    return forward_exposed + max(0.0, backward_traffic - hidden)


def optimizer_time_s(
    ctx: CostContext, group: DeviceGroup, params_per_device: float, replicas: int, tp: int | None = None
) -> float:
    """The Adam step over this device's parameters (its shard under ZeRO: 1/replicas, 1/(replicas * cp) under
    context parallelism, 1/(those in its node) under hybrid sharding: `tp` places them; without it, the shard over
    all of them, a lower figure for the planner's bounds), memory-bound. On a profiled host, as measured there per
    parameter of the shard and per parameter held (flattened and copied back; under ZeRO, the shard padded and the
    gathered pieces joined), stretched by the cores' sharing (predictor/host.py)."""
    ranks = shard_ranks(ctx, group, tp, replicas) if tp is not None else ctx.gradient_ranks(replicas)
    local = params_per_device / ranks if ctx.training.zero_stage >= 1 else params_per_device
    host = ctx.host.get(group.device.key)
    if host is not None:
        held_s_per_param = host.flatten_s_per_param
        if ctx.training.zero_stage >= 1 and ranks > 1:  # the shard padded, the gathered pieces joined
            held_s_per_param += host.gather_s_per_param
        measured = local * host.optimizer_s_per_param + params_per_device * held_s_per_param
        return measured * ctx.compute_stretch * ctx.terms.optimizer_scale
    bw = group.device.hbm_bw_bytes_per_s * OPTIMIZER_BW_EFFICIENCY
    return local * ADAM_BYTES_MOVED_PER_PARAM / bw * ctx.terms.optimizer_scale
