"""Network traffic of a strategy: bytes per iteration by parallel dimension and link class, per device pair.

The collectives are the ones the cost model schedules (predictor/cost_model.py), as rings in the nccl-tests
convention (shared/reference/collectives.md): in a ring all-reduce of S bytes over n ranks every rank sends
2(n-1)/n * S to its successor; reduce-scatter and all-gather (n-1)/n * S.
  TP   per micro-batch and layer 4 collectives of b*s*h values (6 with full recompute), one more for the embedding
       and one for the LM head, ring over the stage's TP ranks (inside a node).
  PP   per micro-batch and stage boundary b*s*h values forward and the same backward, split over the TP ranks
       (rank k talks to rank k); interleaving with v chunks crosses every boundary v times and wraps from the last
       stage to the first v-1 times.
  DP   per stage and TP rank, over the replicas: fp32 gradient all-reduce (ZeRO-0) or gradient reduce-scatter +
       16-bit weight all-gather (ZeRO-1); two-level (ring inside the node, ring across nodes on each rail with 1/r of
       the data) or one flat ring, whichever the cost model picked for its time.
  DP of a tied model's embedding matrix (several stages): after the DP sync, each device of the first stage and its
       counterparts on the last (same replica and CP rank, the TP ranks holding the same vocabulary rows) all-reduce
       their fp32 gradient shard of the matrix, sending it once each way (Megatron's embedding group,
       cost_model.tied_embedding_sync_time_s).
  DP across pipeline families (several families): after its family's reduce-scatter, every device all-reduces its
       1/replicas gradient shard across the F families (2(F-1)/F of it sent), as the cost model has it.
  CP   context parallelism (predictor/context_parallel.py): per micro-batch and layer, each rank passes its K/V block
       around the ring of its replica's CP ranks (same TP rank) cp-1 times forward, K/V and their gradients backward,
       again forward under recompute; TP, PP carry 1/cp of the tokens and DP runs over the replicas' CP ranks too.
ZeRO 2/3's per-micro-batch traffic is counted as ZeRO-1's per-iteration arrays (a lower figure).
Link classes: in_node (same node), rail (other node, same local rank: a rail-only fabric carries it), spine (other
node, other local rank: needs the spine), cross_group (between device groups: the inter-vendor path).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from predictor.comm_model import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from predictor.context_parallel import ring_bytes_per_microbatch
from predictor.cost_model import GRAD_BYTES_PER_PARAM, CostContext, stage_params
from specs.layout import Axis, PipelineStrategy, Strategy, dp_layout, group_offsets, stage_rank

DIMENSIONS = (Axis.TP, Axis.CP, Axis.PP, Axis.DP)
DP_PARTS = ("tied embedding", "across families")
LINK_CLASSES = ("in_node", "rail", "spine", "cross_group")


@dataclass
class Traffic:
    """Bytes sent per iteration, by (dimension, source device, destination device); devices are numbered
    across the cluster in group order, node-major inside a group."""

    device_names: list[str]
    node_of: list[str]
    local_rank_of: list[int]
    group_of: list[str]
    pairs: dict[str, dict[tuple[int, int], float]] = field(
        default_factory=lambda: {d: defaultdict(float) for d in DIMENSIONS}
    )
    # the DP bytes that are not the replicas' sync (DP is every gradient sync: one replica may still send these)
    dp_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DP_PARTS, 0.0))

    def add_ring(self, dimension: str, ranks: list[int], bytes_per_rank: float) -> None:
        if len(ranks) < 2 or bytes_per_rank <= 0:
            return
        for i, rank in enumerate(ranks):
            self.pairs[dimension][(rank, ranks[(i + 1) % len(ranks)])] += bytes_per_rank

    def link_class(self, src: int, dst: int) -> str:
        if self.group_of[src] != self.group_of[dst]:
            return "cross_group"
        if self.node_of[src] == self.node_of[dst]:
            return "in_node"
        return "rail" if self.local_rank_of[src] == self.local_rank_of[dst] else "spine"

    def by_dimension_and_link(self) -> dict[str, dict[str, float]]:
        table = {d: dict.fromkeys(LINK_CLASSES, 0.0) for d in DIMENSIONS}
        for dimension, pairs in self.pairs.items():
            for (src, dst), size in pairs.items():
                table[dimension][self.link_class(src, dst)] += size
        return table

    def total_bytes(self, dimension: str | None = None) -> float:
        dimensions: Iterable[str] = (dimension,) if dimension else DIMENSIONS
        return sum(sum(self.pairs[d].values()) for d in dimensions)

    def spine_pairs(self) -> dict[str, float]:
        """Bytes that cross nodes off-rail, by dimension: what a rail-only fabric cannot carry directly."""
        return {
            d: sum(size for (src, dst), size in self.pairs[d].items() if self.link_class(src, dst) == "spine")
            for d in DIMENSIONS
        }


def _device_tables(ctx: CostContext) -> tuple[list[str], list[str], list[int], list[str]]:
    """Name, node, local rank and group of every device, in global rank order."""
    names: list[str] = []
    nodes: list[str] = []
    local: list[int] = []
    groups: list[str] = []
    for group in ctx.cluster.groups:
        for index in range(group.num_devices):
            names.append(f"{group.name}:{index}")
            nodes.append(f"{group.name}/node{index // group.devices_per_node}")
            local.append(index % group.devices_per_node)
            groups.append(group.name)
    return names, nodes, local, groups


def strategy_traffic(ctx: CostContext, strategy: Strategy) -> Traffic:
    """Per-pair bytes of one iteration of `strategy`: each family's own TP, PP and DP traffic, and with several
    families the all-reduce of each device's gradient shard across the families."""
    offsets = group_offsets(ctx.cluster)
    ctx = ctx.at_context_parallel(strategy.context_parallel)
    traffic = Traffic(*_device_tables(ctx))
    for pipeline in strategy.pipelines:
        _family_traffic(ctx, strategy, pipeline, offsets, traffic)
    _cross_family_traffic(ctx, strategy, offsets, traffic)
    return traffic


def _cross_family_traffic(ctx: CostContext, strategy: Strategy, offsets: dict[str, int], traffic: Traffic) -> None:
    """As the cost model has it (cost_model.cross_family_sync_time_s): after the reduce-scatter inside its family,
    every device all-reduces its 1/replicas gradient shard across the F families, sending 2(F-1)/F of it; the ring
    goes to the next family's device holding this stage's first layer (same replica and TP rank, modulo)."""
    pipelines = strategy.pipelines
    families = len(pipelines)
    if families < 2:
        return
    for f, pipeline in enumerate(pipelines):
        following = pipelines[(f + 1) % families]
        for index, stage in enumerate(pipeline.stages):
            first, last = index == 0, index == len(pipeline.stages) - 1
            params = stage_params(ctx.model, stage.num_layers, first, last, len(pipeline.stages)) / stage.tp
            shard = params * GRAD_BYTES_PER_PARAM / pipeline.gradient_ranks
            partner = next(p for p in following.stages if p.layer_start <= stage.layer_start < p.layer_end)
            cp = pipeline.context_parallel
            for replica in range(pipeline.replicas):
                for cp_rank in range(cp):
                    for tp_rank in range(stage.tp):
                        src = stage_rank(offsets, stage, replica, tp_rank, cp_rank, cp)
                        to_replica, to_tp = replica % following.replicas, tp_rank % partner.tp
                        dst = stage_rank(offsets, partner, to_replica, to_tp, cp_rank, cp)
                        traffic.pairs[Axis.DP][(src, dst)] += 2 * (families - 1) / families * shard
                        traffic.dp_parts["across families"] += 2 * (families - 1) / families * shard


def _family_traffic(
    ctx: CostContext, strategy: Strategy, pipeline: PipelineStrategy, offsets: dict[str, int], traffic: Traffic
) -> None:
    stages = pipeline.stages
    replicas, v = pipeline.replicas, strategy.virtual_stages
    replica_microbatches = pipeline.replica_microbatches()  # uneven batch splits: some replicas run one fewer
    b, cp = pipeline.micro_batch_size, pipeline.context_parallel
    activation = b * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes / cp  # per CP rank

    def device(stage_index: int, replica: int, tp_rank: int, cp_rank: int = 0) -> int:
        return stage_rank(offsets, stages[stage_index], replica, tp_rank, cp_rank, cp)

    for index, stage in enumerate(stages):
        first, last = index == 0, index == len(stages) - 1
        group = ctx.cluster.group(stage.group)
        recompute = strategy.stage_recompute(stage)
        collectives = stage.num_layers * (6 if recompute == "full" else 4) + int(first) + int(last)
        ring = stage.num_layers * ring_bytes_per_microbatch(ctx, b, stage.tp, recompute)
        for replica in range(replicas):
            count = replica_microbatches[replica]
            for c in range(cp):
                ranks = [device(index, replica, k, c) for k in range(stage.tp)]
                traffic.add_ring(Axis.TP, ranks, collectives * count * 2 * (stage.tp - 1) / stage.tp * activation)
            for k in range(stage.tp):
                traffic.add_ring(Axis.CP, [device(index, replica, k, c) for c in range(cp)], count * ring)
        # DP over the replicas and their CP ranks (one dp-cp group per TP rank)
        params = stage_params(ctx.model, stage.num_layers, first, last, len(stages)) / stage.tp
        members = replicas * cp
        if members > 1:
            per_node, node_count = dp_layout(group, stage.tp, members)
            inner, outer = ctx.in_node_link(group), ctx.rail_link(group)
            grads = params * GRAD_BYTES_PER_PARAM
            weights = params * ctx.training.dtype_bytes
            # (array bytes, ring volume factor: 2 for all-reduce, 1 for reduce-scatter or all-gather, its time; its
            # two-level form's inner phases move factor x a reduce-scatter's volume, an all-gather's for the weights)
            sharded = strategy.family_zero_stage(pipeline) >= 1
            arrays = (
                [(grads, 1.0, reduce_scatter_time_s), (weights, 1.0, all_gather_time_s)]
                if sharded
                else [(grads, 2.0, all_reduce_time_s)]
            )
            for size, factor, collective in arrays:
                flat_time = collective(size, per_node * node_count, outer)
                inner_collective = all_gather_time_s if collective is all_gather_time_s else reduce_scatter_time_s
                two_level_time = (
                    factor * inner_collective(size, per_node, inner) + collective(size / per_node, node_count, outer)
                    if node_count > 1
                    else 0.0
                )
                for tp_rank in range(stage.tp):
                    ranks = [device(index, r, tp_rank, c) for r in range(replicas) for c in range(cp)]
                    if node_count <= 1 or two_level_time <= flat_time:
                        for start in range(0, members, per_node):
                            inside = ranks[start : start + per_node]
                            traffic.add_ring(Axis.DP, inside, factor * (len(inside) - 1) / len(inside) * size)
                        for slot in range(per_node):
                            rail = ranks[slot::per_node]
                            share = size / per_node
                            traffic.add_ring(Axis.DP, rail, factor * (len(rail) - 1) / len(rail) * share)
                    else:
                        traffic.add_ring(Axis.DP, ranks, factor * (len(ranks) - 1) / len(ranks) * size)
    if ctx.model.tied_embeddings and len(stages) > 1:
        matrix_bytes = ctx.model.vocab_size * ctx.model.hidden_size * GRAD_BYTES_PER_PARAM
        ends = (0, len(stages) - 1)
        for index, partner in (ends, ends[::-1]):
            width, other = stages[index].tp, stages[partner].tp
            for k, j in itertools.product(range(width), range(other)):  # vocabulary rows k/width.. and j/other..
                shared = min((k + 1) / width, (j + 1) / other) - max(k / width, j / other)
                if shared <= 0:
                    continue
                for replica, c in itertools.product(range(replicas), range(cp)):
                    src, dst = device(index, replica, k, c), device(partner, replica, j, c)
                    traffic.pairs[Axis.DP][(src, dst)] += shared * matrix_bytes
                    traffic.dp_parts["tied embedding"] += shared * matrix_bytes
    # PP: boundaries, forward activations and backward gradients, v times each; wrap-around for interleaving
    boundaries = [(i, i + 1, v) for i in range(len(stages) - 1)]
    if v > 1 and len(stages) > 1:
        boundaries.append((len(stages) - 1, 0, v - 1))
    for a, c, crossings in boundaries:
        width = min(stages[a].tp, stages[c].tp)
        for replica in range(replicas):
            m = replica_microbatches[replica]
            for cp_rank in range(cp):
                for k in range(width):
                    src, dst = device(a, replica, k, cp_rank), device(c, replica, k, cp_rank)
                    traffic.pairs[Axis.PP][(src, dst)] += m * crossings * activation / width
                    traffic.pairs[Axis.PP][(dst, src)] += m * crossings * activation / width


def textbook_traffic_per_rank(
    *,
    params: float,
    layers: int,
    hidden_size: int,
    tokens: float,
    global_batch_tokens: float,
    ranks: int,
    dtype_bytes: int = 2,
    grad_bytes: int = 2,
) -> dict[str, float]:
    """Bytes one rank sends over `tokens` of training with all `ranks` in one parallel dimension, standard ring
    volumes (shared/reference/collectives.md). Steps = tokens / global-batch tokens.
      dp    all-reduce of the gradients every step: 2(G-1)/G * params * grad_bytes
      fsdp  all-gather forward + all-gather backward + reduce-scatter: 3(G-1)/G * params * dtype_bytes
      tp    Megatron: 4 all-reduces per layer of the step's activations split over nobody (every TP rank holds the
            whole b*s*h): 4 * layers * 2(G-1)/G * tokens_per_step * h * dtype_bytes
      pp    each of the G-1 boundaries carries tokens*h activations forward and as many gradients back; per rank
            (averaged over G ranks) 2 * (G-1)/G * tokens_per_step * h * dtype_bytes
    """
    steps = tokens / global_batch_tokens
    fraction = (ranks - 1) / ranks
    per_step = {
        "dp": 2 * fraction * params * grad_bytes,
        "fsdp": 3 * fraction * params * dtype_bytes,
        "tp": 4 * layers * 2 * fraction * global_batch_tokens * hidden_size * dtype_bytes,
        "pp": 2 * fraction * global_batch_tokens * hidden_size * dtype_bytes,
    }
    return {name: value * steps for name, value in per_step.items()}
