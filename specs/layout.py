"""The parallel layout: what a plan is made of (pipeline families, stages, replicas, TP) and which devices and global
ranks each part occupies. Torch-free and predictor-free: the cost model, the planner, the communicator, the runtime
and the exports all read layouts from here, and a new parallel dimension starts here as one axis and one field.

Device numbering: groups in cluster order, node-major inside a group. A stage occupies `tp * cp * replicas` devices of
its group from `device_offset` on (cp: its family's context-parallel degree, 1 without), TP ranks innermost, then
context-parallel ranks, then replicas (Megatron's order): (replica r, CP rank c, TP rank k) is device
`device_offset + (r * cp + c) * tp + k` of the group.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specs.cluster import ClusterSpec, DeviceGroup
from specs.errors import SpecError
from specs.loading import StrictInt
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute
from specs.training import TrainingSpec


class Axis(str, Enum):
    """The parallel dimensions a plan lays devices out along (expert parallelism comes next as ep)."""

    TP = "tp"  # tensor parallel, inside a node
    CP = "cp"  # context parallel: the sequence split over ranks that pass K/V around a ring
    PP = "pp"  # pipeline stages
    DP = "dp"  # data-parallel replicas of one pipeline family
    CROSS_FAMILY = "xf"  # gradient sync between pipeline families

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StageStrategy:
    """One pipeline stage: a contiguous layer range on a homogeneous device block of one group.

    `recompute`, when set, overrides the strategy's mode for this stage (per-stage recompute). The devices it
    occupies: see the module docstring (`PipelineStrategy.stage_devices`, `stage_device`).
    """

    group: str
    layer_start: int
    layer_end: int
    tp: int
    device_offset: int = 0
    recompute: Recompute | None = None  # this stage's own mode; None: the strategy's

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class PipelineStrategy:
    """Pipeline replicas sharing one stage layout. The global batch is split as evenly as whole micro-batches allow:
    `num_microbatches` is the most any replica runs; with `total_microbatches` set (uneven split), the first
    total - replicas*(num_microbatches-1) replicas run num_microbatches and the rest one fewer, and each replica's
    gradients are weighted by its share of the samples so the update equals the even-batch one."""

    replicas: int
    micro_batch_size: int
    num_microbatches: int
    stages: tuple[StageStrategy, ...]
    total_microbatches: int = 0  # 0: every replica runs num_microbatches
    context_parallel: int = 1  # ranks each replica's sequences are split over (ring attention); 1: none
    zero_stage: int | None = None  # this family's own ZeRO stage; None: the strategy's

    @property
    def samples_per_replica(self) -> int:
        """The most samples any replica processes."""
        return self.micro_batch_size * self.num_microbatches

    @property
    def microbatch_total(self) -> int:
        return self.total_microbatches or self.replicas * self.num_microbatches

    @property
    def samples(self) -> int:
        """The family's share of the global batch."""
        return self.micro_batch_size * self.microbatch_total

    @property
    def uneven(self) -> bool:
        return self.microbatch_total != self.replicas * self.num_microbatches

    def replica_microbatches(self) -> list[int]:
        """Micro-batches of each replica, in replica order."""
        full = self.microbatch_total - self.replicas * (self.num_microbatches - 1)
        return [self.num_microbatches if r < full else self.num_microbatches - 1 for r in range(self.replicas)]

    def stage_devices(self, stage: StageStrategy) -> int:
        """Devices one stage occupies over all replicas of the family."""
        return stage.tp * self.context_parallel * self.replicas

    @property
    def gradient_ranks(self) -> int:
        """Ranks holding each parameter shard of a stage inside the family: its replicas and their CP ranks (their
        gradients are summed together, and ZeRO shards the optimizer over all of them, as Megatron's dp-cp group)."""
        return self.replicas * self.context_parallel

    @property
    def devices(self) -> int:
        return sum(self.stage_devices(stage) for stage in self.stages)


@dataclass(frozen=True)
class Strategy:
    pipelines: tuple[PipelineStrategy, ...]
    recompute: Recompute  # for stages that do not set their own
    zero_stage: int
    virtual_stages: int = 1
    sequence_parallel: bool = True
    zero_shard: str = "dp"  # "node": ZeRO shards inside each node, replicated across nodes (hybrid sharding)

    def stage_recompute(self, stage: StageStrategy) -> Recompute:
        return stage.recompute or self.recompute

    def family_zero_stage(self, pipeline: PipelineStrategy) -> int:
        """The ZeRO stage a family runs: its own, or the strategy's."""
        return self.zero_stage if pipeline.zero_stage is None else pipeline.zero_stage

    @property
    def zero_summary(self) -> str:
        """'ZeRO-1', or 'ZeRO per family (3, 1)' when families differ."""
        stages = [self.family_zero_stage(p) for p in self.pipelines]
        if len(set(stages)) == 1:
            return f"ZeRO-{stages[0]}"
        return "ZeRO per family (" + ", ".join(str(s) for s in stages) + ")"

    @property
    def context_parallel(self) -> int:
        """The families' context-parallel degree (check_strategy keeps it one for the whole plan)."""
        return self.pipelines[0].context_parallel if self.pipelines else 1

    @property
    def devices(self) -> int:
        """Devices the strategy occupies."""
        return sum(pipeline.devices for pipeline in self.pipelines)

    @property
    def recompute_summary(self) -> str:
        """The mode, or 'per-stage (none x3, selective x2)' when stages differ."""
        modes = [self.stage_recompute(s) for p in self.pipelines for s in p.stages]
        distinct = sorted(set(modes), key=modes.index)
        if len(distinct) == 1:
            return distinct[0]
        return "per-stage (" + ", ".join(f"{m} x{modes.count(m)}" for m in distinct) + ")"


def split_batch(global_batch: int, replicas: int, micro_batch_size: int) -> tuple[int, int] | None:
    """(most micro-batches per replica, total micro-batches) of the most even split of the batch over the
    replicas in whole micro-batches, or None when the batch is not whole micro-batches or too small."""
    if global_batch % micro_batch_size:
        return None
    total = global_batch // micro_batch_size
    if total < replicas:
        return None
    return -(-total // replicas), total


def split_pipeline(
    replicas: int,
    micro_batch_size: int,
    stages: tuple[StageStrategy, ...],
    most: int,
    total: int,
    context_parallel: int = 1,
) -> PipelineStrategy:
    """A pipeline family running `total` micro-batches over its replicas, at most `most` each (uneven when they
    do not divide)."""
    uneven_total = total if total != replicas * most else 0
    return PipelineStrategy(replicas, micro_batch_size, most, stages, uneven_total, context_parallel)


# ---- devices and ranks ------------------------------------------------------------------------------------------
def chunk_layer_counts(pipeline: PipelineStrategy, virtual_stages: int) -> list[int]:
    """Decoder layers per model chunk in model order, as interleaving engines (and the runtime) deal chunks: model
    chunk c = k * p + i is stage i's chunk k, and each stage's layers are spread over its v chunks as evenly as whole
    layers allow (every rank keeps the plan's layer count; with v > 1 not the plan's layer ids). v = 1: the stages'
    own layers."""
    stages, v = pipeline.stages, virtual_stages
    return [s.num_layers // v + (1 if k < s.num_layers % v else 0) for k in range(v) for s in stages]


def stage_device(stage: StageStrategy, replica: int, tp_rank: int, cp_rank: int = 0, cp: int = 1) -> int:
    """The device index inside the stage's group of (replica, CP rank, TP rank) in a family of CP degree `cp`."""
    return stage.device_offset + (replica * cp + cp_rank) * stage.tp + tp_rank


def group_offsets(cluster: ClusterSpec) -> dict[str, int]:
    """The global rank of each group's first device."""
    offsets, start = {}, 0
    for group in cluster.groups:
        offsets[group.name] = start
        start += group.num_devices
    return offsets


def stage_rank(
    offsets: dict[str, int], stage: StageStrategy, replica: int, tp_rank: int, cp_rank: int = 0, cp: int = 1
) -> int:
    """The global rank of (replica, CP rank, TP rank) of a stage: group offset + stage_device."""
    return offsets[stage.group] + stage_device(stage, replica, tp_rank, cp_rank, cp)


def stage_ranks(offsets: dict[str, int], pipeline: PipelineStrategy, stage: StageStrategy) -> Iterator[int]:
    """Every global rank of a stage, replica-major."""
    cp = pipeline.context_parallel
    for replica in range(pipeline.replicas):
        for cp_rank in range(cp):
            for tp_rank in range(stage.tp):
                yield stage_rank(offsets, stage, replica, tp_rank, cp_rank, cp)


def pack_stages(stages: Iterable[StageStrategy], replicas: int, context_parallel: int = 1) -> tuple[StageStrategy, ...]:
    """Stages placed from the start of each group in pipeline order (device offsets recomputed)."""
    used: dict[str, int] = {}
    placed = []
    for stage in stages:
        placed.append(replace(stage, device_offset=used.get(stage.group, 0)))
        used[stage.group] = used.get(stage.group, 0) + stage.tp * context_parallel * replicas
    return tuple(placed)


def devices_per_group(strategy: Strategy) -> dict[str, int]:
    """The highest device index + 1 the strategy uses in each group."""
    end: dict[str, int] = {}
    for pipeline in strategy.pipelines:
        for stage in pipeline.stages:
            end[stage.group] = max(end.get(stage.group, 0), stage.device_offset + pipeline.stage_devices(stage))
    return end


def same_node(group: DeviceGroup, a: StageStrategy, b: StageStrategy) -> bool:
    """Whether two stages of one group start on the same node."""
    return a.device_offset // group.devices_per_node == b.device_offset // group.devices_per_node


def dp_layout(group: DeviceGroup, tp: int, replicas: int) -> tuple[int, int]:
    """(ranks per node, nodes) of one DP group: TP innermost, replicas next, node-major numbering."""
    per_node = max(1, min(replicas, group.devices_per_node // tp))
    return per_node, math.ceil(replicas / per_node)


# ---- building and checking layouts --------------------------------------------------------------------------------
def megatron_strategy(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    *,
    group: str | None,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_size: int,
    recompute: str,
    virtual_stages: int = 1,
    context_parallel: int = 1,
    source: str = "flags",
) -> Strategy:
    """A Megatron-style strategy on one group: even layer split over `pp` stages, `dp` identical replicas, each
    replica's sequences split over `context_parallel` ranks."""
    if group is None and len(cluster.groups) > 1:
        names = ", ".join(g.name for g in cluster.groups)
        raise SpecError(source, "group", f"the cluster has several groups ({names}); name one")
    target = cluster.group(group) if group else cluster.groups[0]
    if model.num_layers % pp:
        raise SpecError(
            source,
            "pp",
            f"{model.num_layers} layers do not split evenly into {pp} stages (Megatron's default); "
            "use a plan with uneven stages",
        )
    cp = context_parallel
    if target.devices_per_node % tp:
        raise SpecError(
            source,
            "tp",
            f"expected a divisor of the {target.devices_per_node} devices per node of group {target.name!r} (TP stays "
            f"inside a node), got {tp}",
        )
    if tp * cp * pp * dp > target.num_devices:
        what, count = ("tp x cp x pp x dp", tp * cp * pp * dp) if cp > 1 else ("tp x pp x dp", tp * pp * dp)
        raise SpecError(source, what, f"{count} exceeds the {target.num_devices} devices of group {target.name!r}")
    global_batch = training.global_batch_size
    if global_batch % (dp * micro_batch_size):
        raise SpecError(
            source, "global batch", f"{global_batch} is not a multiple of dp x micro-batch = {dp * micro_batch_size}"
        )
    if recompute not in RECOMPUTE_MODES:
        raise SpecError(source, "recompute", f"expected none, selective or full, got {recompute!r}")
    per_stage = model.num_layers // pp
    stages = tuple(
        StageStrategy(target.name, i * per_stage, (i + 1) * per_stage, tp, i * tp * cp * dp) for i in range(pp)
    )
    return Strategy(
        (PipelineStrategy(dp, micro_batch_size, global_batch // (dp * micro_batch_size), stages, 0, cp),),
        recompute,  # type: ignore[arg-type]
        training.zero_stage,
        virtual_stages,
        training.sequence_parallel,
        training.zero_shard,
    )


def check_strategy(
    strategy: Strategy, cluster: ClusterSpec, model: ModelSpec, global_batch: int, source: str = "strategy"
) -> None:
    """Structural checks: every family covers the layers once, TP inside a node and dividing heads, devices used by
    at most one stage of one family, the families' samples add up to the global batch; and, first, the values a
    Strategy built in Python may hold that no plan file can (`_check_values`)."""
    _check_values(strategy, source)
    if not strategy.pipelines:
        raise SpecError(source, "pipelines", "expected at least one pipeline family")
    degrees = sorted({p.context_parallel for p in strategy.pipelines})
    if len(degrees) > 1:
        raise SpecError(source, "pipelines", f"expected one context_parallel degree for every family, got {degrees}")
    used: dict[str, list[tuple[int, int]]] = {}
    for family, pipeline in enumerate(strategy.pipelines):
        _check_pipeline(cluster, model, strategy, pipeline, f"pipelines[{family}]", source, used)
    for name, blocks in used.items():
        group = cluster.group(name)
        needed = sum(size for _, size in blocks)
        if needed > group.num_devices:  # (said before an overlap, which too many devices also make)
            raise SpecError(
                source,
                "pipelines",
                f"group {name!r} has {group.num_devices} devices, the plan's stages on it need {needed} (TP x CP x "
                "replicas each)",
            )
        blocks.sort()
        end = 0
        for offset, size in blocks:
            if offset < end:
                raise SpecError(source, "pipelines", f"stages overlap on devices of group {name!r}")
            end = offset + size
        if end > group.num_devices:
            raise SpecError(
                source, "pipelines", f"group {name!r} has {group.num_devices} devices, the plan uses up to {end}"
            )
    samples = sum(p.samples for p in strategy.pipelines)
    if samples != global_batch:
        field = "pipelines[0]" if len(strategy.pipelines) == 1 else "pipelines"
        raise SpecError(
            source,
            field,
            f"micro-batch x micro-batches over all replicas{' of all families' if field == 'pipelines' else ''} "
            f"= {samples}, expected the global batch {global_batch}",
        )


ZERO_STAGES = (0, 1, 2, 3)


def whole_number(value: object) -> int | None:
    """`value` as an int when it is one (numpy's integers too; not a bool, a float or a numeric string), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


ZERO_SHARDS = ("dp", "node")


def _check_values(strategy: Strategy, source: str) -> None:
    """The kinds and ranges of a strategy's values, as a plan file's schema checks them on load: a Strategy built in
    Python is a plain dataclass (recompute 'bogus' was evaluated as 'none', ZeRO stage 7 as sharded, TP '8' failed
    inside the checks with a TypeError)."""

    def whole(value: object, field: str, least: int) -> None:
        if whole_number(value) is None or value < least:  # type: ignore[operator]
            raise SpecError(source, field, f"expected a whole number >= {least}, got {value!r}")

    def one_of(value: object, field: str, known: Sequence[object], numbers: bool = False) -> None:
        if (whole_number(value) if numbers else value) not in known:  # (1.0 == 1: a float is not a ZeRO stage)
            raise SpecError(source, field, f"expected one of {', '.join(map(str, known))}, got {value!r}")

    # the containers first: Strategy(pipeline) without its tuple was iterated field by field (a TypeError)
    if not isinstance(strategy.pipelines, (tuple, list)) or not all(
        isinstance(p, PipelineStrategy) for p in strategy.pipelines
    ):
        raise SpecError(source, "pipelines", f"expected a tuple of PipelineStrategy, got {strategy.pipelines!r:.80}")
    for family, pipeline in enumerate(strategy.pipelines):
        if not isinstance(pipeline.stages, (tuple, list)) or not all(
            isinstance(s, StageStrategy) for s in pipeline.stages
        ):
            raise SpecError(
                source, f"pipelines[{family}].stages", f"expected a tuple of StageStrategy, got {pipeline.stages!r:.80}"
            )
    one_of(strategy.recompute, "recompute", RECOMPUTE_MODES)
    one_of(strategy.zero_stage, "zero_stage", ZERO_STAGES, numbers=True)
    one_of(strategy.zero_shard, "zero_shard", ZERO_SHARDS)
    whole(strategy.virtual_stages, "virtual_stages", 1)
    for family, pipeline in enumerate(strategy.pipelines):
        where = f"pipelines[{family}]"
        for field in ("replicas", "micro_batch_size", "num_microbatches", "context_parallel"):
            whole(getattr(pipeline, field), f"{where}.{field}", 1)
        whole(pipeline.total_microbatches, f"{where}.total_microbatches", 0)
        if pipeline.zero_stage is not None:
            one_of(pipeline.zero_stage, f"{where}.zero_stage", ZERO_STAGES, numbers=True)
        for index, stage in enumerate(pipeline.stages):
            for field, least in (("layer_start", 0), ("layer_end", 0), ("tp", 1), ("device_offset", 0)):
                whole(getattr(stage, field), f"{where}.stages[{index}].{field}", least)
            if stage.recompute is not None:
                one_of(stage.recompute, f"{where}.stages[{index}].recompute", RECOMPUTE_MODES)


def _check_pipeline(
    cluster: ClusterSpec,
    model: ModelSpec,
    strategy: Strategy,
    pipeline: PipelineStrategy,
    where_pipeline: str,
    source: str,
    used: dict[str, list[tuple[int, int]]],
) -> None:
    if not pipeline.stages:
        raise SpecError(source, f"{where_pipeline}.stages", "expected at least one stage")
    expected_start = 0
    names = [g.name for g in cluster.groups]
    for index, stage in enumerate(pipeline.stages):
        where = f"{where_pipeline}.stages[{index}]"
        if stage.group not in names:  # the strategy's field (cluster.group names the cluster file)
            raise SpecError(
                source, f"{where}.group", f"expected a group of cluster {cluster.name!r} ({', '.join(names)}), got "
                f"{stage.group!r}"
            )  # fmt: skip
        group = cluster.group(stage.group)
        if stage.layer_start != expected_start or stage.layer_end <= stage.layer_start:
            raise SpecError(
                source,
                f"{where}.layers",
                f"expected [{expected_start}, end > {expected_start}) "
                f"(contiguous, non-empty), got [{stage.layer_start}, {stage.layer_end})",
            )
        expected_start = stage.layer_end
        if group.devices_per_node % stage.tp or stage.tp < 1:
            raise SpecError(
                source,
                f"{where}.tp",
                f"expected a divisor of {group.devices_per_node} devices per node "
                f"(TP stays inside a node), got {stage.tp}",
            )
        if model.num_kv_heads % stage.tp:
            raise SpecError(
                source,
                f"{where}.tp",
                f"expected a divisor of the model's {model.num_kv_heads} kv heads, got {stage.tp}",
            )
        ring = stage.tp * pipeline.context_parallel
        if pipeline.context_parallel > 1 and group.devices_per_node % ring and ring % group.devices_per_node:
            raise SpecError(
                source,
                f"{where_pipeline}.context_parallel",
                f"tp x context_parallel = {ring} on group {stage.group!r} must divide its {group.devices_per_node} "
                "devices per node or be a multiple of them (a CP ring fills nodes evenly)",
            )
        used.setdefault(stage.group, []).append((stage.device_offset, pipeline.stage_devices(stage)))
    if strategy.virtual_stages > 1 and any(s.num_layers < strategy.virtual_stages for s in pipeline.stages):
        raise SpecError(
            source,
            "virtual_stages",
            f"every stage needs at least {strategy.virtual_stages} layers (one per interleaved chunk)",
        )
    if expected_start != model.num_layers:
        raise SpecError(
            source,
            f"{where_pipeline}.stages",
            f"layers cover [0, {expected_start}), expected [0, {model.num_layers})",
        )
    balanced = pipeline.replicas * (pipeline.num_microbatches - 1) < pipeline.microbatch_total
    if not balanced or pipeline.microbatch_total > pipeline.replicas * pipeline.num_microbatches:
        raise SpecError(
            source,
            f"{where_pipeline}.total_microbatches",
            f"expected {pipeline.replicas} replicas to run {pipeline.num_microbatches} or "
            f"{pipeline.num_microbatches - 1} micro-batches each, got {pipeline.microbatch_total} in all",
        )


# ---- the strategy part of plan files (and of run records that carry a whole plan's layout) --------------------
# what a plan file writes beside a stage's and a family's layout for its readers (planner/plan.py evaluation_dict):
# read back they are skipped (planner/plan.py checks the ones a reader could mistake for settings against what
# decides them); any other key is an error, since a misspelt setting would otherwise change nothing
STAGE_FIGURES = frozenset(
    {
        "devices",
        "compute_time_s",
        "p2p_time_s",
        "dp_sync_time_s",
        "memory_bytes",
        "memory_capacity_bytes",
        "memory_usable_bytes",
        "memory_breakdown_bytes",
        "fits",
    }
)
PIPELINE_FIGURES = frozenset({"samples_per_replica", "batch_weight", "family_samples", "replica_batches"})


def without_figures(data: object, figures: frozenset[str]) -> object:
    """A written mapping without the figures a plan file writes for its readers."""
    return {key: value for key, value in data.items() if key not in figures} if isinstance(data, dict) else data


class StageFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group: str
    layers: tuple[StrictInt, StrictInt]
    tp: StrictInt = Field(ge=1)
    device_offset: StrictInt = Field(default=0, ge=0)
    recompute: Recompute | None = None  # left out: the plan's
    device: str | None = None  # a figure too, checked against the cluster's group (planner/what_if.py)

    @model_validator(mode="before")
    @classmethod
    def _skip_figures(cls, data: object) -> object:
        return without_figures(data, STAGE_FIGURES)

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_written(cls, value: object) -> object:
        """A written null took the plan's mode, where a hand edit may have meant none: only leaving it out does."""
        if value is None:
            raise ValueError("expected none, selective or full (leave the field out for the plan's mode), got null")
        return value


class PipelineFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: StrictInt = Field(ge=1)
    micro_batch_size: StrictInt = Field(ge=1)
    num_microbatches: StrictInt = Field(ge=1)
    total_microbatches: StrictInt = Field(default=0, ge=0)
    context_parallel: StrictInt = Field(default=1, ge=1)
    zero_stage: StrictInt | None = Field(default=None, ge=0, le=3)  # the family's own; None: the plan's
    stages: list[StageFile] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _skip_figures(cls, data: object) -> object:
        return without_figures(data, PIPELINE_FIGURES)


def pipelines_from_files(
    pipelines: Sequence[PipelineFile], recompute: Recompute, zero_stage: int | None = None
) -> tuple[PipelineStrategy, ...]:
    """Pipelines as a plan file writes them; a stage's recompute (a family's ZeRO stage) equal to the plan's is kept
    as None (the plan's)."""
    return tuple(
        replace(pipeline, zero_stage=None if p.zero_stage == zero_stage else p.zero_stage)
        for p, pipeline in zip(pipelines, _split_files(pipelines, recompute), strict=True)
    )


def _split_files(pipelines: Sequence[PipelineFile], recompute: Recompute) -> tuple[PipelineStrategy, ...]:
    return tuple(
        split_pipeline(
            p.replicas,
            p.micro_batch_size,
            tuple(
                StageStrategy(
                    s.group,
                    s.layers[0],
                    s.layers[1],
                    s.tp,
                    s.device_offset,
                    s.recompute if s.recompute != recompute else None,
                )
                for s in p.stages
            ),
            p.num_microbatches,
            p.total_microbatches or p.replicas * p.num_microbatches,
            p.context_parallel,
        )
        for p in pipelines
    )
