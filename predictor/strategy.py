"""A parallel strategy: what the cost model evaluates and what a plan records (no metrics here)."""

from __future__ import annotations

from dataclasses import dataclass

from specs.model import Recompute


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
    """Identical pipeline replicas sharing one stage layout and an even share of the global batch."""

    replicas: int
    micro_batch_size: int
    num_microbatches: int
    stages: tuple[StageStrategy, ...]

    @property
    def samples_per_replica(self) -> int:
        return self.micro_batch_size * self.num_microbatches


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
