"""A parallel strategy: what the cost model evaluates and what a plan records (no metrics here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from specs.cluster import ClusterSpec
from specs.errors import SpecError
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute
from specs.training import TrainingSpec


@dataclass(frozen=True)
class StageStrategy:
    """One pipeline stage: a contiguous layer range on a homogeneous device block of one group.

    `recompute`, when set, overrides the strategy's mode for this stage (per-stage recompute).
    Across the pipeline's replicas the stage occupies `tp * replicas` devices of `group`, starting at
    `device_offset` in the group's node-major device numbering; TP ranks are innermost, then replicas.
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

    @property
    def samples_per_replica(self) -> int:
        """The most samples any replica processes."""
        return self.micro_batch_size * self.num_microbatches

    @property
    def microbatch_total(self) -> int:
        return self.total_microbatches or self.replicas * self.num_microbatches

    @property
    def uneven(self) -> bool:
        return self.microbatch_total != self.replicas * self.num_microbatches

    def replica_microbatches(self) -> list[int]:
        """Micro-batches of each replica, in replica order."""
        full = self.microbatch_total - self.replicas * (self.num_microbatches - 1)
        return [self.num_microbatches if r < full else self.num_microbatches - 1 for r in range(self.replicas)]


def split_batch(global_batch: int, replicas: int, micro_batch_size: int) -> tuple[int, int] | None:
    """(most micro-batches per replica, total micro-batches) of the most even split of the batch over the
    replicas in whole micro-batches, or None when the batch is not whole micro-batches or too small."""
    if global_batch % micro_batch_size:
        return None
    total = global_batch // micro_batch_size
    if total < replicas:
        return None
    return -(-total // replicas), total


@dataclass(frozen=True)
class Strategy:
    pipelines: tuple[PipelineStrategy, ...]
    recompute: Recompute  # for stages that do not set their own
    zero_stage: int
    virtual_stages: int = 1
    sequence_parallel: bool = True

    def stage_recompute(self, stage: StageStrategy) -> Recompute:
        return stage.recompute or self.recompute

    @property
    def recompute_summary(self) -> str:
        """The mode, or 'per-stage (none x3, selective x2)' when stages differ."""
        modes = [self.stage_recompute(s) for p in self.pipelines for s in p.stages]
        distinct = sorted(set(modes), key=modes.index)
        if len(distinct) == 1:
            return distinct[0]
        return "per-stage (" + ", ".join(f"{m} x{modes.count(m)}" for m in distinct) + ")"


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
    source: str = "flags",
) -> Strategy:
    """A Megatron-style strategy on one group: even layer split over `pp` stages, `dp` identical replicas."""
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
    if tp * pp * dp > target.num_devices:
        raise SpecError(
            source, "tp x pp x dp", f"{tp * pp * dp} exceeds the {target.num_devices} devices of group {target.name!r}"
        )
    batch = training.global_batch_size
    if batch % (dp * micro_batch_size):
        raise SpecError(
            source, "global batch", f"{batch} is not a multiple of dp x micro-batch = {dp * micro_batch_size}"
        )
    if recompute not in RECOMPUTE_MODES:
        raise SpecError(source, "recompute", f"expected none, selective or full, got {recompute!r}")
    per_stage = model.num_layers // pp
    stages = tuple(StageStrategy(target.name, i * per_stage, (i + 1) * per_stage, tp, i * tp * dp) for i in range(pp))
    return Strategy(
        (PipelineStrategy(dp, micro_batch_size, batch // (dp * micro_batch_size), stages),),
        recompute,  # type: ignore[arg-type]
        training.zero_stage,
        virtual_stages,
        training.sequence_parallel,
    )


# ---- the strategy part of plan files (and of run records that carry a whole plan's layout) --------------------
class StageFile(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group: str
    layers: tuple[int, int]
    tp: int = Field(ge=1)
    device_offset: int = Field(default=0, ge=0)
    recompute: Recompute | None = None


class PipelineFile(BaseModel):
    model_config = ConfigDict(extra="ignore")
    replicas: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    total_microbatches: int = Field(default=0, ge=0)
    stages: list[StageFile] = Field(min_length=1)


def pipelines_from_files(pipelines: Sequence[PipelineFile], recompute: Recompute) -> tuple[PipelineStrategy, ...]:
    """Pipelines as a plan file writes them; a stage's recompute equal to the plan's is kept as None (the plan's)."""
    return tuple(
        PipelineStrategy(
            replicas=p.replicas,
            micro_batch_size=p.micro_batch_size,
            num_microbatches=p.num_microbatches,
            total_microbatches=p.total_microbatches if p.total_microbatches != p.replicas * p.num_microbatches else 0,
            stages=tuple(
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
        )
        for p in pipelines
    )
