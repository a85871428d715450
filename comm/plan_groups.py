"""The process groups a plan needs, in the one order every rank creates them.

Ranks are numbered across the cluster as the planner numbers devices: groups in cluster order, node-major inside a
group; a stage's rank for (replica r, TP rank k) is group offset + stage offset + r * tp + k. Groups, in order:
TP groups (per stage and replica), pipeline neighbour pairs (per boundary, replica and TP rank they share), DP groups
(per stage and TP rank, over the replicas, with each replica's gradient weight = its share of the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from comm.vendors import CATALOG_VENDORS
from predictor.strategy import StageStrategy, Strategy, one_family
from specs.cluster import ClusterSpec
from specs.errors import SpecError


@dataclass(frozen=True)
class PlannedGroup:
    kind: str  # "tp", "pp" or "dp"
    stage: int
    ranks: tuple[int, ...]
    weights: tuple[float, ...] = ()  # dp: gradient weight of each member's replica (sums to 1 over replicas)


def rank_islands(cluster: ClusterSpec) -> list[str]:
    """The island (vendor) of every global rank."""
    islands = []
    for group in cluster.groups:
        vendor = CATALOG_VENDORS.get(group.device.vendor)
        if vendor is None:
            raise SpecError(
                cluster.source or "cluster", f"group {group.name}", f"no communicator for {group.device.vendor}"
            )
        islands += [vendor] * group.num_devices
    return islands


def group_offsets(cluster: ClusterSpec) -> dict[str, int]:
    """The global rank of each group's first device."""
    offsets, start = {}, 0
    for group in cluster.groups:
        offsets[group.name] = start
        start += group.num_devices
    return offsets


def stage_rank(offsets: dict[str, int], stage: StageStrategy, replica: int, tp_rank: int) -> int:
    """The global rank of (replica, TP rank) of a stage: group offset + stage offset + replica * tp + tp rank."""
    return offsets[stage.group] + stage.device_offset + replica * stage.tp + tp_rank


def plan_groups(cluster: ClusterSpec, strategy: Strategy, global_batch: int) -> list[PlannedGroup]:
    offsets = group_offsets(cluster)
    pipeline = one_family(strategy, "plan", "the runtime")
    stages = pipeline.stages

    def rank(stage_index: int, replica: int, tp_rank: int) -> int:
        return stage_rank(offsets, stages[stage_index], replica, tp_rank)

    groups: list[PlannedGroup] = []
    for index, stage in enumerate(stages):
        for replica in range(pipeline.replicas):
            groups.append(PlannedGroup("tp", index, tuple(rank(index, replica, k) for k in range(stage.tp))))
    for index in range(len(stages) - 1):
        for replica in range(pipeline.replicas):
            for k in range(min(stages[index].tp, stages[index + 1].tp)):
                groups.append(PlannedGroup("pp", index, (rank(index, replica, k), rank(index + 1, replica, k))))
    samples = [m * pipeline.micro_batch_size for m in pipeline.replica_microbatches()]
    weights = tuple(s / global_batch for s in samples)
    for index, stage in enumerate(stages):
        for k in range(stage.tp):
            members = tuple(rank(index, replica, k) for replica in range(pipeline.replicas))
            groups.append(PlannedGroup("dp", index, members, weights))
    return groups
