"""One rank's pipeline work for an iteration: Megatron's (interleaved) 1F1B over its replica's micro-batches, timed
for the run record, with a slower device's speed emulated.

The schedule is the order predictor/schedule.py draws and the cost model times, written out here rather than taken
from torch.distributed.pipelining, because stages of one pipeline may have different TP widths (a PipelineStage has
one rank per stage) and because the run record needs each stage's compute and wait time. With v virtual stages a rank
holds v model chunks (comm.plan_groups.stage_chunks): chunk k of stage i is model chunk k * p + i, so activations wrap
from the last stage to the first between chunks; activations and gradients travel under their own point-to-point
tags, so two streams between one pair of ranks never cross. Between stages of different TP widths receiving rank k
takes its input from sending rank k mod tp_sender (and gradients flow back the same way).

Speed emulation (`emulate_speed` s < 1 on a CPU group): after each forward and backward, the rank keeps repeating its
stage's layer math (no gradients, no collectives) until the pass has taken 1/s of its real time; no sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import cycle
from typing import Any

import torch
import torch.distributed as dist

from comm.communicator import Communicator
from predictor.schedule import stage_order
from runtime.context_parallel import ContextParallel
from runtime.model import StageModule
from runtime.tensor_parallel import TensorParallel
from runtime.zero import ShardedParameters
from specs.errors import SpecError
from specs.layout import PipelineStrategy, StageStrategy, stage_rank


@dataclass(frozen=True)
class Role:
    family: int
    pipeline: PipelineStrategy
    stage_index: int
    replica: int
    tp_rank: int
    stage: StageStrategy
    microbatches: int
    sample_start: int  # this replica's first sample in the global batch
    cp_rank: int = 0  # which of the replica's context-parallel ranks (runtime/context_parallel.py)

    @property
    def dp_index(self) -> int:
        """Its place in the stage's DP group (replicas x CP ranks, comm.plan_groups)."""
        return self.replica * self.pipeline.context_parallel + self.cp_rank

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == len(self.pipeline.stages) - 1


@dataclass
class StageTimes:
    compute_s: float = 0.0
    emulation_s: float = 0.0
    wait_s: float = 0.0
    wait_cpu_s: float = 0.0  # the process's CPU time (every thread) while waiting for a pipeline neighbour
    forward_s: float = 0.0  # forward passes, emulation included, TP collectives not (predictor/run_terms.py's terms)
    backward_s: float = 0.0
    tp_comm_s: float = 0.0
    gather_s: float = 0.0  # ZeRO-3: waiting for weight pieces inside the passes (counted as DP sync)
    sync_s: float = 0.0
    optimizer_s: float = 0.0
    per_step: list[dict[str, Any]] = field(default_factory=list)
    # this step's passes and waits: (kind, start, end on time.perf_counter, CPU seconds of the process meanwhile)
    events: list[tuple[str, float, float, float]] = field(default_factory=list)


class Emulator:
    """Makes a pass take 1/speed of its real time by repeating the stage's layer math (no TP or CP collectives), then
    spinning for the rest that is shorter than a layer."""

    def __init__(
        self,
        speed: float,
        layers: list[torch.nn.Module],
        tp: TensorParallel,
        cp: ContextParallel,
        sample: torch.Tensor,
    ) -> None:
        if speed < 1.0 and not layers:
            raise SpecError("cluster", "emulate_speed", "a stage without decoder layers has no layer math to repeat")
        self.speed, self.layers, self.tp, self.cp = speed, layers, tp, cp
        self.sample = sample  # an activation of the stage's shape for the repeated layer math
        self.layer_s = 0.0  # how long the last repeated layer took (0 until one ran)

    def extend(self, real_s: float) -> float:
        """Compute for (1/speed - 1) x `real_s`: repeated layers while a whole one fits before the deadline, then a
        spin to it. (Starting a layer whenever the deadline was not yet passed overshot by half a layer on average:
        the runtime benchmark's emulated passes took 1.07-1.13 times their target with a core per rank, up to 1.22
        with two ranks per core.)"""
        if self.speed >= 1.0:
            return 0.0
        started = time.perf_counter()
        deadline = started + real_s * (1.0 / self.speed - 1.0)
        with torch.no_grad(), self.tp.suppress(), self.cp.suppress():
            for layer in cycle(self.layers):
                before = time.perf_counter()
                if before + self.layer_s >= deadline:
                    break
                layer(self.sample)
                self.layer_s = time.perf_counter() - before
        while time.perf_counter() < deadline:  # the core stays busy, as the slower device's would
            pass
        return time.perf_counter() - started


def _targets(rank_from: int, tp_from: int, tp_to: int) -> list[int]:
    """TP ranks of the next stage that take their input from TP rank `rank_from` (receiver k <- sender k % tp)."""
    return [k for k in range(tp_to) if k % tp_from == rank_from]


ACTIVATION_TAG, GRADIENT_TAG = 0, 1


class StageRunner:
    """One rank's pipeline work for an iteration: Megatron's (interleaved) 1F1B over its replica's micro-batches.
    `batch_shape`: the global batch, sequence length and hidden size; `offsets`: each group's first rank."""

    def __init__(
        self,
        role: Role,
        offsets: dict[str, int],
        batch_shape: tuple[int, int, int],
        modules: list[StageModule],
        comm: Communicator,
        emulator: Emulator,
        dtype: torch.dtype,
        sharded: ShardedParameters | None = None,
    ) -> None:
        pipeline = role.pipeline
        self.stages = pipeline.stages
        self.role, self.modules, self.comm, self.emulator, self.dtype = role, modules, comm, emulator, dtype
        self.sharded = sharded
        self.index, self.p, self.v = role.stage_index, len(pipeline.stages), len(modules)
        self.mbs, self.cp = pipeline.micro_batch_size, emulator.cp
        # this micro-batch's share of the global batch's tokens (a CP rank's mean loss is over 1/cp of them)
        global_batch, seq_length, hidden_size = batch_shape
        self.loss_scale = self.mbs / (global_batch * self.cp.size)
        self.shape = (self.mbs, seq_length // self.cp.size, hidden_size)
        self.offsets = offsets  # each group's first rank (specs.layout.group_offsets)
        self.times = StageTimes()
        self.sends: list[dist.Work] = []
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.local: dict[tuple[int, int, int], torch.Tensor] = {}  # messages to itself (one stage, v chunks)
        self.loss_sum = 0.0

    def peer(self, stage_index: int, tp_rank: int) -> int:
        """The rank of `stage_index` with this rank's replica and CP rank (its tokens) at TP rank `tp_rank`."""
        stage = self.stages[stage_index % self.p]
        return stage_rank(self.offsets, stage, self.role.replica, tp_rank, self.role.cp_rank, self.cp.size)

    def receive(self, stage_index: int, tag: int, key: tuple[int, int, int]) -> torch.Tensor:
        """The tensor stage `stage_index` sends this TP rank (k <- k mod its TP width)."""
        src = self.peer(stage_index, self.role.tp_rank % self.stages[stage_index % self.p].tp)
        if src == dist.get_rank():
            return self.local.pop(key)
        buffer = torch.empty(self.shape, dtype=self.dtype)
        waited, cpu = time.perf_counter(), time.process_time()
        self.comm.irecv(buffer, src, tag).wait()
        ended, cpu_s = time.perf_counter(), time.process_time() - cpu
        self.times.wait_s += ended - waited
        self.times.wait_cpu_s += cpu_s
        self.times.events.append(("wait", waited, ended, cpu_s))
        return buffer

    def send(self, tensor: torch.Tensor, stage_index: int, tag: int, key: tuple[int, int, int]) -> None:
        """To every TP rank of stage `stage_index` that takes its input from this one."""
        tp_to = self.stages[stage_index % self.p].tp
        for k in _targets(self.role.tp_rank, self.stages[self.index].tp, tp_to):
            dst = self.peer(stage_index, k)
            if dst == dist.get_rank():
                self.local[key] = tensor.detach()
            else:
                self.sends.append(self.comm.isend(tensor.detach(), dst, tag))

    def gather_s(self) -> float:
        return self.sharded.gather_s if self.sharded is not None else 0.0

    def timed(self, work: Callable[[], torch.Tensor | None], kind: str) -> torch.Tensor | None:
        """Run a forward or backward pass; emulation stretches its compute, not its TP collectives, its ZeRO-3
        gathers nor its CP ring's waits (the cost model scales an emulated device's layer costs only; the ring's
        exposed time stays in the pass, as the cost model counts it)."""
        tp = self.emulator.tp
        t0, comm0, gather0, ring0 = time.perf_counter(), tp.comm_s, self.gather_s(), self.cp.comm_s
        cpu0 = time.process_time()
        out = work()
        real, comm, gather = time.perf_counter() - t0, tp.comm_s - comm0, self.gather_s() - gather0
        extended = self.emulator.extend(real - comm - gather - (self.cp.comm_s - ring0))
        self.times.events.append((kind, t0, time.perf_counter(), time.process_time() - cpu0))
        self.times.compute_s += real
        self.times.emulation_s += extended
        self.times.tp_comm_s += comm
        self.times.gather_s += gather
        if kind == "forward":
            self.times.forward_s += real - comm - gather + extended
        else:
            self.times.backward_s += real - comm - gather + extended
        return out

    def forward(self, j: int, k: int, tokens: torch.Tensor) -> None:
        chunk = k * self.p + self.index
        batch = tokens[j * self.mbs : (j + 1) * self.mbs]
        last = chunk == self.p * self.v - 1
        inputs, targets = self.cp.local_tokens(batch)
        x = inputs if chunk == 0 else self.receive(self.index - 1, ACTIVATION_TAG, (0, j, chunk)).requires_grad_()
        module = self.modules[k]
        out = self.timed(lambda: module(x, targets if last else None), "forward")
        assert out is not None
        if last:
            self.loss_sum += float(out.detach())
        else:
            self.send(out, self.index + 1, ACTIVATION_TAG, (0, j, chunk + 1))
        self.saved[j, k] = (x, out)

    def backward(self, j: int, k: int) -> None:
        chunk = k * self.p + self.index
        x, out = self.saved.pop((j, k))
        if chunk == self.p * self.v - 1:
            self.timed(lambda: (out * self.loss_scale).backward(), "backward")
        else:
            grad = self.receive(self.index + 1, GRADIENT_TAG, (1, j, chunk))
            self.timed(lambda: out.backward(grad), "backward")
        if self.sharded is not None:
            self.sharded.after_backward()
        if chunk > 0:
            self.send(x.grad, self.index - 1, GRADIENT_TAG, (1, j, chunk - 1))

    def run(self, tokens: torch.Tensor) -> float:
        """Run this replica's micro-batches through the stage's chunks in Megatron's order; returns the sum of
        micro-batch losses (last stage)."""
        self.loss_sum = 0.0
        for kind, j, k in stage_order(self.p, self.role.microbatches, self.v, self.index):
            if kind == "forward":
                self.forward(j, k, tokens)
            else:
                self.backward(j, k)
        for work in self.sends:
            work.wait()
        self.sends.clear()
        return self.loss_sum
