"""What a candidate of the search is (OuterConfig: everything but the layer split) and the structural choices it is
built from: TP degrees per group, replica counts, pipeline orders of the groups."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictor.cost_model import CostContext
from specs.cluster import DeviceGroup
from specs.layout import split_batch

PER_STAGE = "per-stage"  # pseudo recompute mode of candidates whose stages each pick their own mode


@dataclass(frozen=True)
class OuterConfig:
    """Everything but the layer split: groups along the pipe (in order), their TP degrees and stage counts."""

    groups: tuple[DeviceGroup, ...]
    tps: tuple[int, ...]
    stage_counts: tuple[int, ...]
    replicas: int
    micro_batch_size: int
    recompute: str  # a Recompute mode, or PER_STAGE (set only by the refinement step of the search)
    virtual_stages: int
    lower_bound_s: float  # of every order of these groups
    # of this order: whole layers, memory caps at each stage's pipeline depth (>= lower_bound_s; candidates come in
    # this bound's order)
    order_bound_s: float = 0.0
    fill_and_drain_bound_s: float = 0.0  # the point-to-point part of those bounds (the exact one replaces it)

    def stage_groups(self) -> list[tuple[DeviceGroup, int]]:
        """(group, TP) of every stage along the pipe."""
        return [(g, t) for g, t, c in zip(self.groups, self.tps, self.stage_counts) for _ in range(c)]

    def describe(self) -> str:
        """One line for messages, e.g. 'a100(tp2x3)+v100(tp1x1), dp 4, micro-batch 1, ...'."""
        names = "+".join(f"{g.name}(tp{t}x{c})" for g, t, c in zip(self.groups, self.tps, self.stage_counts))
        return (
            f"{names}, dp {self.replicas}, micro-batch {self.micro_batch_size}, "
            f"recompute {self.recompute}, virtual stages {self.virtual_stages}"
        )


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def config_microbatches(ctx: CostContext, config: OuterConfig) -> tuple[int, int]:
    """(most micro-batches per replica, total micro-batches) of a candidate."""
    split = split_batch(ctx.training.global_batch_size, config.replicas, config.micro_batch_size)
    assert split is not None, "candidates are generated with a valid batch split"
    return split


def replica_counts(
    global_batch: int, subset: Sequence[DeviceGroup], tp_rows: np.ndarray, max_stages: int, context_parallel: int = 1
) -> list[int]:
    """Replica counts worth trying for a set of groups: the divisors of the batch (even splits), and the counts at
    which some group fits one more stage (floor(devices / (replicas * tp)) steps up), where an uneven split of the
    batch keeps devices busy that an even split would leave idle. Between two such counts fewer replicas only
    lengthen every replica's share."""
    counts = set(divisors(global_batch))
    for column, group in enumerate(subset):
        for tp in sorted(set(int(t) for t in tp_rows[:, column])):
            for stages in range(1, max_stages + 1):
                replicas = part_devices(group) // (stages * tp * context_parallel)
                if replicas < 1:
                    break
                counts.add(replicas)
    return sorted(c for c in counts if c <= global_batch)


def tp_options(ctx: CostContext, group: DeviceGroup) -> list[int]:
    """TP degrees inside one node that divide the kv heads (and that the group's profile covers); under context
    parallelism, those whose tp x cp ring fills nodes evenly (divides a node or is whole nodes)."""
    per_node, cp = group.devices_per_node, ctx.context_parallel
    options = [
        t
        for t in divisors(per_node)
        if ctx.model.num_kv_heads % t == 0 and (per_node % (t * cp) == 0 or (t * cp) % per_node == 0)
    ]
    profiled = getattr(ctx.source(group), "tp_degrees", None)
    covered = profiled() if callable(profiled) else None  # None: the source answers any degree
    if covered is not None:
        options = [t for t in options if t in covered]
    return options


def group_subsets(groups: Sequence[DeviceGroup], sizes: range) -> list[tuple[DeviceGroup, ...]]:
    """The subsets of the groups with these many groups, smaller first, each in the cluster's order."""
    return [s for size in sizes for s in itertools.combinations(groups, size)]


@functools.cache
def _permutation_ranks(k: int) -> dict[tuple[int, ...], int]:
    """The position of every order of k groups among itertools.permutations(range(k)) (built when first asked)."""
    return {order: i for i, order in enumerate(itertools.permutations(range(k)))}


def permutation_index(order: tuple[int, ...]) -> int:
    """The position of an order of k groups among itertools.permutations(range(k)) (its lexicographic rank)."""
    if len(order) <= 8:
        return _permutation_ranks(len(order))[order]
    rank, rest = 0, sorted(order)
    for position, item in enumerate(order):
        smaller = rest.index(item)
        rank += smaller * math.factorial(len(order) - position - 1)
        rest.pop(smaller)
    return rank


def _signature(group: DeviceGroup) -> tuple[object, ...]:
    """What makes two groups interchangeable along a pipe."""
    return (group.device, group.nodes, group.devices_per_node, group.nics_per_node, group.nic_bw_bytes_per_s)


@functools.cache
def group_orders(groups: tuple[DeviceGroup, ...]) -> list[tuple[int, ...]]:
    """Permutations of group indices, skipping those that only swap interchangeable groups (identical devices and
    node shapes). Memoised: callers must not modify the list."""
    kinds: dict[tuple[object, ...], int] = {}
    kind = [kinds.setdefault(_signature(group), len(kinds)) for group in groups]
    seen: set[tuple[int, ...]] = set()
    orders = []
    for order in itertools.permutations(range(len(groups))):
        key = tuple(kind[i] for i in order)
        if key not in seen:
            seen.add(key)
            orders.append(order)
    return orders


@functools.cache
def group_order_array(groups: tuple[DeviceGroup, ...]) -> np.ndarray:
    """group_orders as an (orders, groups) array (memoised; read only)."""
    array = np.array(group_orders(groups), dtype=np.int64).reshape(-1, len(groups))
    array.flags.writeable = False
    return array


def identical_classes(groups: Sequence[DeviceGroup]) -> list[tuple[DeviceGroup, ...]]:
    """The groups gathered by what makes them interchangeable (device, node shape, NICs), in cluster order."""
    classes: dict[tuple[object, ...], list[DeviceGroup]] = {}
    for group in groups:
        classes.setdefault((*_signature(group), group.emulate_speed), []).append(group)
    return [tuple(members) for members in classes.values()]


def search_size(ctx: CostContext, groups: Sequence[DeviceGroup]) -> int:
    """Pipeline orders (interchangeable groups swapped once) times TP choices of a pipeline over every group: how
    the search space of many groups grows."""
    orders = math.factorial(len(groups))
    for members in identical_classes(groups):
        orders //= math.factorial(len(members))
    return orders * math.prod(len(tp_options(ctx, g)) for g in groups)


# merged groups (planner.search._merged_search): the group object -> how many equal groups it stands for
_PARTS: dict[int, tuple[DeviceGroup, int]] = {}


def merged_parts(group: DeviceGroup, parts: int) -> None:
    """Say that `group` stands for `parts` equal groups: a stage (every replica of it) fits in one of them (0: forget
    it, when its search is done)."""
    if parts:
        _PARTS[id(group)] = (group, parts)
    else:
        _PARTS.pop(id(group), None)


def group_parts(group: DeviceGroup) -> int:
    """How many equal groups a group stands for (1 but for merged ones)."""
    found = _PARTS.get(id(group))
    return found[1] if found is not None and found[0] is group else 1


def part_devices(group: DeviceGroup) -> int:
    """The devices of one of the equal groups a group stands for."""
    return group.num_devices // group_parts(group)


def stage_count(group: DeviceGroup, replicas: int, width: int, lone_of_layers: int | None = None) -> int:
    """Stages the group holds with `replicas` replicas of `width` devices each (tp x cp; in whole parts of a merged
    group). `lone_of_layers`: the group is a pipeline's only one, of this many layers: it holds at most as many stages
    (whole parts), its other devices idle (tp_rows.SubsetRows holds its rows to the same)."""
    parts = group_parts(group)
    count = parts * (part_devices(group) // (replicas * width))
    return count if lone_of_layers is None else min(count, lone_of_layers // parts * parts)
