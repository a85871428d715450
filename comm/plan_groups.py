"""The process groups a plan needs, in the one order every rank creates them.

Ranks are numbered across the cluster as the planner numbers devices: groups in cluster order, node-major inside a
group; a stage's rank for (replica r, CP rank c, TP rank k) is group offset + stage offset + (r * cp + c) * tp + k
(cp: the family's context-parallel degree, 1 without). Groups, in order, for each pipeline family: TP groups (per
stage, replica and CP rank), CP rings (per stage, replica and TP rank; only with context parallelism), pipeline
neighbour pairs (per boundary, replica, CP rank and TP rank they share), DP groups (per stage and TP rank, over the
replicas and their CP ranks, with each member's replica's gradient weight = its share of the global batch). With
several families, then one cross-family group per model segment: the pieces of the model (0: embedding, 1..L:
layers, L+1: LM head) cut at every family's chunk boundaries, each segment's group holding every rank of every
family whose stage covers it (traffic and checks; the runtime exchanges each device's gradient shard
with the devices of the other families that hold the same elements, runtime/sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from specs.cluster import ClusterSpec
from specs.layout import (
    Axis,
    PipelineStrategy,
    Strategy,
    chunk_layer_counts,
    group_offsets,
    stage_rank,
    stage_ranks,
)
from specs.vendors import get_vendor


@dataclass(frozen=True)
class PlannedGroup:
    kind: Axis
    stage: int  # xf: the segment's index
    ranks: tuple[int, ...]
    weights: tuple[float, ...] = ()  # dp: gradient weight of each member's replica (sums to 1 over replicas)
    family: int = 0  # xf: -1
    pieces: tuple[int, int] = (0, 0)  # xf: the segment's model pieces [first, end)


def rank_islands(cluster: ClusterSpec) -> list[str]:
    """The island (vendor registry key, e.g. "ascend" for the catalog's "huawei") of every global rank."""
    islands = []
    for group in cluster.groups:
        vendor = get_vendor(group.device.vendor, cluster.source or "cluster", f"group {group.name}")
        islands += [vendor.key] * group.num_devices
    return islands


@dataclass(frozen=True)
class Chunk:
    """Layers [layer_start, layer_end) of the model on one stage; `first` holds the embedding, `last` the LM head."""

    layer_start: int
    layer_end: int
    first: bool
    last: bool

    def pieces(self, num_layers: int) -> tuple[int, int]:
        """The model pieces [first, end) the chunk holds: 0 the embedding, 1..L its layers, L + 1 the LM head."""
        return (0 if self.first else self.layer_start + 1, num_layers + 2 if self.last else self.layer_end + 1)


def stage_chunks(pipeline: PipelineStrategy, index: int, virtual_stages: int) -> list[Chunk]:
    """The model chunks stage `index` holds, in its chunk order. Interleaved (Megatron's order, as the exports
    write it): model chunk c = k * p + i is stage i's chunk k, each stage's layers spread over its v chunks as evenly
    as whole layers allow, so a stage keeps its layer count, not its layer ids. v = 1: the stage's own layers."""
    p, v = len(pipeline.stages), virtual_stages
    counts = chunk_layer_counts(pipeline, v)
    starts = [sum(counts[:c]) for c in range(p * v)]
    chunks = (k * p + index for k in range(v))
    return [Chunk(starts[c], starts[c] + counts[c], c == 0, c == p * v - 1) for c in chunks]


def family_segments(strategy: Strategy) -> list[tuple[int, int]]:
    """The model pieces cut at every family's chunk boundaries: the units gradients meet in across families."""
    num_layers = strategy.pipelines[0].stages[-1].layer_end
    cuts = {0, num_layers + 2}
    for pipeline in strategy.pipelines:
        for index in range(len(pipeline.stages)):
            for chunk in stage_chunks(pipeline, index, strategy.virtual_stages):
                cuts.update(chunk.pieces(num_layers))
    ordered = sorted(cuts)
    return list(pairwise(ordered))


def plan_groups(cluster: ClusterSpec, strategy: Strategy, global_batch: int) -> list[PlannedGroup]:
    offsets = group_offsets(cluster)
    groups: list[PlannedGroup] = []
    for family, pipeline in enumerate(strategy.pipelines):
        groups += _family_groups(offsets, pipeline, family, global_batch)
    if len(strategy.pipelines) > 1:
        num_layers = strategy.pipelines[0].stages[-1].layer_end
        for segment, (lo, hi) in enumerate(family_segments(strategy)):
            members = []
            for pipeline in strategy.pipelines:
                for index, stage in enumerate(pipeline.stages):
                    chunks = stage_chunks(pipeline, index, strategy.virtual_stages)
                    if any(c.pieces(num_layers)[0] <= lo and hi <= c.pieces(num_layers)[1] for c in chunks):
                        members += stage_ranks(offsets, pipeline, stage)
            groups.append(PlannedGroup(Axis.CROSS_FAMILY, segment, tuple(sorted(members)), family=-1, pieces=(lo, hi)))
    return groups


def _family_groups(
    offsets: dict[str, int], pipeline: PipelineStrategy, family: int, global_batch: int
) -> list[PlannedGroup]:
    stages, cp, replicas = pipeline.stages, pipeline.context_parallel, range(pipeline.replicas)

    def rank(stage_index: int, replica: int, tp_rank: int, cp_rank: int = 0) -> int:
        return stage_rank(offsets, stages[stage_index], replica, tp_rank, cp_rank, cp)

    groups: list[PlannedGroup] = []
    for index, stage in enumerate(stages):
        for replica in replicas:
            for c in range(cp):
                members = tuple(rank(index, replica, k, c) for k in range(stage.tp))
                groups.append(PlannedGroup(Axis.TP, index, members, (), family))
    if cp > 1:
        for index, stage in enumerate(stages):
            for replica in replicas:
                for k in range(stage.tp):
                    ring = tuple(rank(index, replica, k, c) for c in range(cp))
                    groups.append(PlannedGroup(Axis.CP, index, ring, (), family))
    for index in range(len(stages) - 1):
        for replica in replicas:
            for c in range(cp):
                for k in range(min(stages[index].tp, stages[index + 1].tp)):
                    pair = (rank(index, replica, k, c), rank(index + 1, replica, k, c))
                    groups.append(PlannedGroup(Axis.PP, index, pair, (), family))
    samples = [m * pipeline.micro_batch_size for m in pipeline.replica_microbatches()]
    weights = tuple(samples[replica] / global_batch for replica in replicas for _ in range(cp))
    for index, stage in enumerate(stages):
        for k in range(stage.tp):
            members = tuple(rank(index, replica, k, c) for replica in replicas for c in range(cp))
            groups.append(PlannedGroup(Axis.DP, index, members, weights, family))
    return groups
