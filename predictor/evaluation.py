"""What the cost model says of a strategy (predictor/cost_model.py evaluates it): per stage, its times per micro-batch,
its sync, optimizer step and memory; for the whole strategy, the iteration and its parts. Also the pipeline arithmetic
the schedule and the memory model share (Megatron's interleaved micro-batch groups). The step simulation and the
schedule read these without the cost model itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from specs.layout import StageStrategy, Strategy

if TYPE_CHECKING:
    from predictor.context import CostContext

Seconds = TypeVar("Seconds", float, np.ndarray)


def pipeline_makespan_s(num_microbatches: int, virtual_stages: int, bottleneck_s: Seconds, sum_s: Seconds) -> Seconds:
    """Stage-time part of a pipeline's flush: m micro-batches over stages of time T_i per micro-batch (bottleneck
    M = max T_i, sum S), v interleaved chunks per stage (a float, or arrays of them). The steady state, m*M + (S - M)/v,
    holds while a stage has a micro-batch to start when its chunk's loop comes back (m*M >= S: m >= p for even stages).
    With fewer, each of the first v - 1 rounds waits for the loop through every stage, S/v: S + (m - 1)*M/v (at m = 1
    that is S, plain 1F1B's: interleaving buys nothing). The makespan is the larger of the two; v = 1 makes them
    equal. Exact for stages of one time (Megatron's order, drawn chunk by chunk: predictor.schedule); for uneven stages
    an estimate, as the steady form was before it."""
    m, v = num_microbatches, virtual_stages
    steady = m * bottleneck_s + (sum_s - bottleneck_s) / v
    loop = sum_s + (m - 1) * bottleneck_s / v
    if isinstance(steady, np.ndarray):
        return np.maximum(steady, loop)
    return max(steady, loop)


def interleaved_group_size(num_microbatches: int, pipeline_stages: int) -> int:
    """Megatron's contiguous micro-batches per virtual stage (`--microbatch-group-size-per-virtual-pipeline-stage`):
    the pipeline size when it divides m, else the smallest N > p with m % N == 0 or m % N >= p (Megatron refuses a
    last group smaller than p: it would stall the pipeline); m at most."""
    m, p = num_microbatches, pipeline_stages
    for size in range(p, m + 1):
        if m % size == 0 or m % size >= p:
            return size
    return max(m, 1)


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class StageEvaluation:
    stage: StageStrategy
    compute_time_s: float  # per micro-batch: forward + backward, exposed TP collectives and ZeRO 2/3 traffic
    backward_time_s: float  # per micro-batch, the window gradient reduction can hide behind
    p2p_time_s: float  # to the next stage, one direction, per micro-batch
    dp_sync_time_s: float  # one reduction + one gather over the DP group (and across families)
    dp_exposed_time_s: float  # of that, what follows the pipeline flush
    optimizer_time_s: float
    memory: StageMemory
    memory_capacity_bytes: float
    memory_usable_bytes: float
    family: int = 0  # index of the stage's pipeline family in the strategy
    tp_comm_time_s: float = 0.0  # per micro-batch, the exposed TP collectives inside compute_time_s
    sharded_exposed_time_s: float = 0.0  # per micro-batch, ZeRO 2/3 traffic inside compute_time_s
    p2p_exposed_time_s: float = 0.0  # per micro-batch, waiting for its sends and receives (plain 1F1B)
    overhead_time_s: float = 0.0  # per micro-batch, a local run's framework overhead inside compute_time_s
    sync_host_time_s: float = 0.0  # of dp_exposed_time_s, a local run's host work (indexing, copies): a busy core
    gather_exposed_time_s: float = 0.0  # of dp_exposed_time_s, ZeRO 1/2's weight gather after the optimizer step
    tied_sync_time_s: float = 0.0  # of dp_exposed_time_s, a tied model's matrix summed between first and last stage

    @property
    def step_time_s(self) -> float:
        """The stage's time per micro-batch in the pipeline: compute and the point-to-point it waits for."""
        return self.compute_time_s + self.p2p_exposed_time_s

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.memory_usable_bytes

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.memory.total_bytes - self.memory_usable_bytes)

    @property
    def tail_time_s(self) -> float:
        """What the stage waits after the pipeline flush: its exposed DP sync, then its optimizer step."""
        return self.dp_exposed_time_s + self.optimizer_time_s


@dataclass(frozen=True)
class Evaluation:
    strategy: Strategy
    stages: tuple[StageEvaluation, ...]
    iteration_time_s: float
    pipeline_time_s: float
    bubble_time_s: float
    tail_time_s: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    devices_used: int
    family_pipeline_s: tuple[float, ...] = ()  # each family's pipeline time (the iteration waits for the slowest)
    # the context it was evaluated in (on a profiled host: with the cores' sharing, predictor/host.py)
    context: CostContext | None = field(default=None, compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    @property
    def shortfall_bytes(self) -> float:
        return max((stage.shortfall_bytes for stage in self.stages), default=0.0)

    @property
    def dp_sync_overlapped_s(self) -> float:
        """Of the DP sync (ZeRO 0/1: one reduction and, ZeRO-1, one gather) of the stage that waits longest after the
        flush, what overlaps its backward (or, the gather, the next forward): a longer backward hides more of it, and
        the tail shrinks. 0 under ZeRO 2/3, whose per-micro-batch traffic is in the passes' time."""
        tail = max(self.stages, key=lambda s: s.tail_time_s)
        if self.strategy.family_zero_stage(self.strategy.pipelines[tail.family]) >= 2:
            return 0.0
        return max(0.0, tail.dp_sync_time_s - tail.dp_exposed_time_s)

    @property
    def tied_sync_s(self) -> float:
        """Of the exposed DP sync of the stage that waits longest after the flush, a tied model's embedding matrix
        summed between the first and last stage (cost_model.tied_embedding_sync_time_s): most of GPT-3 1.7B's tail on
        a100-v100-32, 0.108 of 0.134 s, unsaid."""
        return max(self.stages, key=lambda s: s.tail_time_s).tied_sync_time_s

    def breakdown(self) -> dict[str, float]:
        """The iteration time split into the cost model's terms, seconds (they add up to the iteration): the
        steady state of the slowest family's slowest stage (compute, exposed TP collectives, exposed ZeRO 2/3 traffic,
        waiting for point-to-point), the bubble, the fill and drain, the exposed DP sync, the optimizer step and the
        fixed overhead after the flush."""
        family = max(range(len(self.family_pipeline_s)), key=self.family_pipeline_s.__getitem__)
        members = [s for s in self.stages if s.family == family]
        slowest = max(members, key=lambda s: s.step_time_s)
        m = self.strategy.pipelines[family].num_microbatches
        tail = max(self.stages, key=lambda s: s.tail_time_s)
        terms = {
            "compute": m * (slowest.compute_time_s - slowest.tp_comm_time_s - slowest.sharded_exposed_time_s),
            "tp_comm": m * slowest.tp_comm_time_s,
            "zero_comm": m * slowest.sharded_exposed_time_s,
            "p2p_wait": m * slowest.p2p_exposed_time_s,
            "bubble": self.bubble_time_s,
            "dp_sync": tail.dp_exposed_time_s,
            "optimizer": tail.optimizer_time_s,
        }
        terms["fill_and_drain"] = self.pipeline_time_s - m * slowest.step_time_s - self.bubble_time_s
        terms["overhead"] = self.iteration_time_s - self.pipeline_time_s - tail.tail_time_s
        return terms
