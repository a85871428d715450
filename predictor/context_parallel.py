"""Context parallelism: each replica's sequences split over `cp` ranks that pass K/V blocks around a ring (Megatron's
CP, ring attention with causal load balancing).

Per CP rank and layer, for a micro-batch of b sequences of s tokens:
- compute: the rank's s/cp tokens through the GEMMs and, with the causal load balance (each rank holds chunks i and
  2cp-1-i), 1/cp of the causal attention: both equal one micro-batch of b/cp whole sequences, so the layer cost is
  the device's at micro-batch b/cp (activations too);
- ring: cp-1 steps forward, each sending the rank's K and V block, 2*b*(s/cp)*kv_size/tp elements; cp-1 steps
  backward sending K/V and their gradients (twice the bytes); a recompute that repeats the attention repeats the
  forward ring;
- overlap: each step's transfer runs under the attention of the block already received, attention being the causal
  share s*q / (s*q + layer GEMM params) of the layer's FLOPs (q: heads x head size, ModelSpec.q_size); what the
  transfer takes beyond it is exposed;
- the ring runs inside the node when tp * cp devices fit in one, else over the rails;
- TP collectives and pipeline p2p carry 1/cp of the tokens; gradients of the stage's parameters are reduced over the
  replicas and their CP ranks together (the dp-cp group), which ZeRO shards over (specs.layout.gradient_ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from predictor.comm_model import Link
from profiler.profile import LayerCost, LayerCostSource, LayerKind
from specs.cluster import DeviceGroup
from specs.model import ModelSpec, Recompute
from specs.training import TrainingSpec

# K/V send and receive buffers, and their gradients' in the backward, held while a layer computes.
RING_BUFFERS = 4


class NetworkTerms(Protocol):
    """What the ring reads of the end-to-end terms (predictor.context.EndToEndTerms)."""

    @property
    def network_scale(self) -> float: ...


class RingContext(Protocol):
    """What the ring's costs read of a cost context (predictor.context.CostContext, which wraps its layer costs in
    ContextParallelCosts under context parallelism)."""

    @property
    def context_parallel(self) -> int: ...

    @property
    def seq_length(self) -> int: ...

    @property
    def model(self) -> ModelSpec: ...

    @property
    def training(self) -> TrainingSpec: ...

    @property
    def terms(self) -> NetworkTerms: ...

    def in_node_link(self, group: DeviceGroup) -> Link: ...

    def rail_link(self, group: DeviceGroup) -> Link: ...


def attention_share(model: ModelSpec, seq_length: int) -> float:
    """The causal attention's share of a decoder layer's forward FLOPs (QK^T and AV vs the GEMMs)."""
    attention = model.layer_attention_flops(1, seq_length, causal_kernel=True)
    return attention / (attention + model.layer_gemm_flops(seq_length))


def ring_block_bytes(ctx: RingContext, micro_batch_size: float, tp: int) -> float:
    """One CP rank's K and V block of one layer: 2 * b * (s/cp) * kv_size/tp elements."""
    cp = ctx.context_parallel
    return 2 * micro_batch_size * ctx.seq_length / cp * ctx.model.kv_size / tp * ctx.training.dtype_bytes


def ring_link(ctx: RingContext, group: DeviceGroup, tp: int) -> Link:
    """Inside the node when the ring's tp * cp devices fit in one, else the rails between nodes."""
    if tp * ctx.context_parallel <= group.devices_per_node:
        return ctx.in_node_link(group)
    return ctx.rail_link(group)


def ring_step_time_s(ctx: RingContext, group: DeviceGroup, size_bytes: float, tp: int) -> float:
    """One ring step: every rank sends a block to the next and receives one from the previous at once."""
    link = ring_link(ctx, group, tp)
    scale = 1.0 if link.link_class == "in_node" else ctx.terms.network_scale
    return link.p2p_time_s(size_bytes) * scale


def ring_passes(recompute: Recompute) -> tuple[int, int]:
    """(forward rings, backward rings in K/V-block units) per layer and micro-batch: the backward sends K/V and
    their gradients; recomputing the attention (selective or full) runs the forward ring again."""
    return 1, (2 if recompute == "none" else 3)


@dataclass
class ContextParallelCosts:
    """One group's layer costs per CP rank: the device's costs at micro-batch b/cp plus the ring's exposed transfers
    (in the decoder's forward and backward times)."""

    ctx: RingContext
    group: DeviceGroup
    inner: LayerCostSource
    _costs: dict[tuple[str, float, int, str], LayerCost] = field(default_factory=dict, repr=False)

    @property
    def identity(self) -> str:
        return self.inner.identity

    def __getattr__(self, name: str) -> Any:  # what else the inner source offers (a profile's TP degrees)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def layer_cost(self, layer: LayerKind, micro_batch_size: float, tp: int, recompute: Recompute) -> LayerCost:
        key = (layer, micro_batch_size, tp, recompute)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = self._cost(layer, micro_batch_size, tp, recompute)
        return cost

    def _cost(self, layer: LayerKind, micro_batch_size: float, tp: int, recompute: Recompute) -> LayerCost:
        ctx, cp = self.ctx, self.ctx.context_parallel
        local = self.inner.layer_cost(layer, micro_batch_size / cp, tp, recompute)  # type: ignore[arg-type]
        if layer != "decoder" or cp <= 1:
            return local
        forward_s, backward_s = exposed_ring_time_s(ctx, self.group, micro_batch_size, tp, recompute, local)
        return LayerCost(local.forward_time_s + forward_s, local.backward_time_s + backward_s, local.activation_bytes)


def exposed_ring_time_s(
    ctx: RingContext, group: DeviceGroup, micro_batch_size: float, tp: int, recompute: Recompute, local: LayerCost
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's ring transfers per micro-batch not hidden under its attention."""
    cp = ctx.context_parallel
    step_s = ring_step_time_s(ctx, group, ring_block_bytes(ctx, micro_batch_size, tp), tp)
    share = attention_share(ctx.model, ctx.seq_length)
    forward_rings, backward_blocks = ring_passes(recompute)
    forward_attention_step_s = share * local.forward_time_s / cp
    # the backward's attention share: its own attention backward (the same share of the backward's work) and, under
    # recompute, the attention forward it repeats, spread over the steps like the forward's
    backward_attention_step_s = share * local.backward_time_s / cp
    forward = forward_rings * (cp - 1) * max(0.0, step_s - forward_attention_step_s)
    backward = (cp - 1) * max(0.0, backward_blocks * step_s - backward_attention_step_s)
    return forward, backward


def ring_bytes_per_microbatch(ctx: RingContext, micro_batch_size: float, tp: int, recompute: Recompute) -> float:
    """Bytes one CP rank sends around its ring per layer and micro-batch (forward, backward, recomputed forward)."""
    forward_rings, backward_blocks = ring_passes(recompute)
    steps = ctx.context_parallel - 1
    return (forward_rings + backward_blocks) * steps * ring_block_bytes(ctx, micro_batch_size, tp)
