"""One rank of a plan: its stage shard, 1F1B over its replica's micro-batches, weighted DP sync, (ZeRO-1) Adam.

Ranks are numbered as the planner numbers devices (comm.plan_groups): groups in cluster order, node-major; a stage's
rank for (replica r, TP rank k) is group offset + stage offset + r * tp + k. Every rank creates every group of the plan
in one order. Activations are replicated over a stage's TP ranks, so between stages of different TP widths receiving
rank k takes its input from sending rank k mod tp_sender (and gradients flow back the same way).

The schedule is 1F1B (what the cost model times) written out here rather than taken from torch.distributed.pipelining,
because stages of one pipeline may have different TP widths (a PipelineStage has one rank per stage) and because the
run record needs each stage's compute and wait time. Each micro-batch's loss is scaled by its share of the global
batch (micro-batch size / global batch) and DP gradients are summed, so replicas with uneven batch shares give exactly
the full-batch gradient. A plan of several pipeline families runs each family as above on its own devices and share
of the batch; then each model segment's gradient (the pieces between any family's stage boundaries) is summed across
the families: replica 0 of each family puts its family's sum in the segment's whole-model positions (a TP shard's
elements where the shard cut them from, a replicated parameter once), the segment's cross-family group all-reduces
that, and every rank takes its own elements back.

Speed emulation (`emulate_speed` s < 1 on a CPU group): after each forward and backward, the rank keeps repeating its
stage's layer math (no gradients, no collectives) until the pass has taken 1/s of its real time; no sleeping.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import cycle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from comm.communicator import CommGroup, Communicator
from comm.plan_groups import PlannedGroup, plan_groups, rank_islands
from runtime.model import StageModule, piece_offsets, seeded_pieces, shard_positions
from runtime.tensor_parallel import TensorParallel
from specs.cluster import ClusterSpec
from specs.errors import SpecError
from specs.layout import Axis, PipelineStrategy, StageStrategy, Strategy, group_offsets, stage_rank
from specs.model import ModelSpec

TORCH_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunSettings:
    steps: int = 5
    seed: int = 0
    dtype: str = "fp32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    timeout_s: float = 120.0
    capture_gradients: bool = False  # write step 0's synced gradients (parity tests)


@dataclass(frozen=True)
class RunJob:
    """What every rank of a run needs (pickled to the spawned processes)."""

    cluster: ClusterSpec
    model: ModelSpec
    strategy: Strategy
    global_batch: int
    seq_length: int
    settings: RunSettings
    out_dir: str


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

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == len(self.pipeline.stages) - 1


def rank_roles(cluster: ClusterSpec, strategy: Strategy) -> dict[int, Role]:
    """Every active rank's role; the global batch is laid out family by family, replica by replica."""
    offsets = group_offsets(cluster)
    roles = {}
    family_start = 0
    for family, pipeline in enumerate(strategy.pipelines):
        counts = pipeline.replica_microbatches()
        starts = [family_start + sum(counts[:r]) * pipeline.micro_batch_size for r in range(pipeline.replicas)]
        for index, stage in enumerate(pipeline.stages):
            for replica in range(pipeline.replicas):
                for k in range(stage.tp):
                    roles[stage_rank(offsets, stage, replica, k)] = Role(
                        family, pipeline, index, replica, k, stage, counts[replica], starts[replica]
                    )
        family_start += pipeline.microbatch_total * pipeline.micro_batch_size
    return roles


def synthetic_batch(model: ModelSpec, global_batch: int, seq_length: int, seed: int, step: int) -> torch.Tensor:
    """Token sequences (global_batch, seq_length + 1) following a fixed rule next = (7 * token + 3) mod V with
    random starts and 10% random tokens: learnable, so the loss falls as training works."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    vocab = model.vocab_size
    tokens = torch.empty(global_batch, seq_length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (global_batch,), generator=generator)
    for t in range(seq_length):
        tokens[:, t + 1] = (7 * tokens[:, t] + 3) % vocab
    noise = torch.rand(global_batch, seq_length + 1, generator=generator) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
    return tokens


class FlatAdam:
    """AdamW (torch's update, decoupled weight decay) over the flattened parameters; with ZeRO-1 this rank keeps
    moments for and updates only its 1/dp slice, then the slices are all-gathered."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        settings: RunSettings,
        shard: tuple[CommGroup, int, int] | None,
        comm: Communicator,
    ) -> None:
        self.params = params
        self.settings = settings
        self.comm = comm
        self.numel = sum(p.numel() for p in params)
        self.shard = shard
        if shard is not None:
            _, index, count = shard
            self.chunk = -(-self.numel // count)
            self.lo, self.hi = index * self.chunk, min(self.numel, (index + 1) * self.chunk)
        else:
            self.lo, self.hi = 0, self.numel
        size = max(0, self.hi - self.lo)
        dtype = params[0].dtype if params else torch.float32
        self.exp_avg = torch.zeros(size, dtype=dtype)
        self.exp_avg_sq = torch.zeros(size, dtype=dtype)
        self.steps = 0

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)

    def step(self, grads: torch.Tensor) -> None:
        self.steps += 1
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        lr, wd = self.settings.learning_rate, self.settings.weight_decay
        with torch.no_grad():
            flat = self.flat([p.data for p in self.params])
            mine, grad = flat[self.lo : self.hi], grads[self.lo : self.hi]
            mine.mul_(1 - lr * wd)
            self.exp_avg.lerp_(grad, 1 - beta1)
            self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (self.exp_avg_sq.sqrt() / math.sqrt(1 - beta2**self.steps)).add_(eps)
            mine.addcdiv_(self.exp_avg, denom, value=-lr / (1 - beta1**self.steps))
            if self.shard is not None:
                group = self.shard[0]
                padded = torch.zeros(self.chunk, dtype=flat.dtype)
                padded[: mine.numel()] = mine
                pieces = self.comm.all_gather(padded, group)
                flat = torch.cat(pieces)[: self.numel]
            offset = 0
            for p in self.params:
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


@dataclass
class StageTimes:
    compute_s: float = 0.0
    emulation_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    optimizer_s: float = 0.0
    per_step: list[dict[str, float]] = field(default_factory=list)


class Emulator:
    """Makes a pass take 1/speed of its real time by repeating the stage's layer math."""

    def __init__(self, speed: float, stage: StageModule, tp: TensorParallel, sample: torch.Tensor) -> None:
        if speed < 1.0 and not len(stage.layers):
            raise SpecError("cluster", "emulate_speed", "a stage without decoder layers has no layer math to repeat")
        self.speed, self.stage, self.tp = speed, stage, tp
        self.sample = sample  # an activation of the stage's shape for the repeated layer math

    def extend(self, real_s: float) -> float:
        if self.speed >= 1.0:
            return 0.0
        started = time.perf_counter()
        deadline = started + real_s * (1.0 / self.speed - 1.0)
        with torch.no_grad(), self.tp.suppress():
            for layer in cycle(self.stage.layers):
                if time.perf_counter() >= deadline:
                    break
                layer(self.sample)
        return time.perf_counter() - started


class CrossFamilySync:
    """Sums this rank's gradients with the other families' for every model segment it holds (see the module text)."""

    def __init__(
        self,
        model: ModelSpec,
        role: Role,
        recompute: str,
        segments: list[tuple[PlannedGroup, CommGroup]],
        comm: Communicator,
    ) -> None:
        stage, tp = role.stage, role.stage.tp
        positions = [
            shard_positions(
                model, stage.layer_start, stage.layer_end, role.first, role.last, TensorParallel(None, tp, k), recompute
            )
            for k in range(role.tp_rank + 1)
        ]
        self.positions = positions[-1]
        owned = (
            ~torch.isin(self.positions, torch.cat(positions[:-1]))
            if role.tp_rank
            else torch.ones_like(self.positions, dtype=torch.bool)
        )
        self.contributes = owned & (role.replica == 0)  # replica 0 holds its family's DP sum
        offsets = piece_offsets(model)
        self.segments = [(group, offsets[planned.pieces[0]], offsets[planned.pieces[1]]) for planned, group in segments]
        self.comm = comm

    def sync(self, grads: torch.Tensor) -> None:
        for group, lo, hi in self.segments:
            inside = (self.positions >= lo) & (self.positions < hi)
            give = inside & self.contributes
            whole = torch.zeros(hi - lo, dtype=grads.dtype)
            whole[self.positions[give] - lo] = grads[give]
            self.comm.all_reduce(whole, group)
            grads[inside] = whole[self.positions[inside] - lo]


def _targets(rank_from: int, tp_from: int, tp_to: int) -> list[int]:
    """TP ranks of the next stage that take their input from TP rank `rank_from` (receiver k <- sender k % tp)."""
    return [k for k in range(tp_to) if k % tp_from == rank_from]


def run_rank(rank: int, job: RunJob) -> None:
    """Train `settings.steps` steps as one rank (torch.distributed already initialised) and write rank-R.json."""
    cluster, model, strategy, settings = job.cluster, job.model, job.strategy, job.settings
    global_batch, seq_length, out_dir = job.global_batch, job.seq_length, job.out_dir
    torch.set_num_threads(1)
    comm = Communicator(rank_islands(cluster), timeout_s=settings.timeout_s)
    planned = plan_groups(cluster, strategy, global_batch)
    made = comm.create_groups([g.ranks for g in planned])
    roles = rank_roles(cluster, strategy)
    role = roles.get(rank)
    result: dict[str, Any] = {"rank": rank}
    if role is None:  # a device the plan leaves idle: it only keeps step with the others
        for _ in range(settings.steps):
            dist.barrier()
        result["idle"] = True
        _finish(rank, result, out_dir)
        return
    pipeline = role.pipeline
    index, stage = role.stage_index, role.stage
    tp_group = next(g for p, g in zip(planned, made, strict=True) if p.kind is Axis.TP and rank in p.ranks)
    dp_group = next(g for p, g in zip(planned, made, strict=True) if p.kind is Axis.DP and rank in p.ranks)
    segments = [(p, g) for p, g in zip(planned, made, strict=True) if p.kind is Axis.CROSS_FAMILY and rank in p.ranks]
    tp = TensorParallel(tp_group.process_group, stage.tp, role.tp_rank)
    first, last = role.first, role.last
    pieces = seeded_pieces(model, stage.layer_start, stage.layer_end, first, last, settings.seed)
    module = StageModule(model, pieces, tp, strategy.stage_recompute(stage))
    dtype = TORCH_DTYPES[settings.dtype]
    module.to(dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    dp_size = len(dp_group.ranks)
    shard = (dp_group, dp_group.ranks.index(rank), dp_size) if strategy.zero_stage >= 1 and dp_size > 1 else None
    optimizer = FlatAdam(params, settings, shard, comm)
    speed = cluster.group(stage.group).emulate_speed
    mbs = pipeline.micro_batch_size
    across = CrossFamilySync(model, role, strategy.stage_recompute(stage), segments, comm) if segments else None
    emulator = Emulator(speed, module, tp, torch.randn(mbs, seq_length, model.hidden_size, dtype=dtype))

    runner = _StageRunner(job, role, module, comm, emulator, dtype)
    times = runner.times
    losses: list[float] = []
    for step in range(settings.steps):
        dist.barrier()
        started = time.perf_counter()
        before = (times.compute_s, times.emulation_s, times.wait_s)
        tokens = synthetic_batch(model, global_batch, seq_length, settings.seed, step)
        loss_sum = runner.one_f_one_b(tokens[role.sample_start : role.sample_start + role.microbatches * mbs])
        t0 = time.perf_counter()
        grads = optimizer.flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        comm.all_reduce(grads, dp_group)
        if across is not None:
            across.sync(grads)
        times.sync_s += time.perf_counter() - t0
        if settings.capture_gradients and step == 0:
            torch.save(_unflatten(module, params, grads), Path(out_dir, f"grads-{rank}.pt"))
        t0 = time.perf_counter()
        optimizer.step(grads)
        for p in params:
            p.grad = None
        times.optimizer_s += time.perf_counter() - t0
        elapsed = time.perf_counter() - started
        times.per_step.append(
            {
                "time_s": elapsed,
                "compute_s": times.compute_s - before[0],
                "emulation_s": times.emulation_s - before[1],
                "wait_s": times.wait_s - before[2],
            }
        )
        losses.append(loss_sum * mbs / global_batch if last and role.tp_rank == 0 else 0.0)

    result.update(
        family=role.family,
        stage=index,
        replica=role.replica,
        tp_rank=role.tp_rank,
        group=stage.group,
        layers=[stage.layer_start, stage.layer_end],
        microbatches=role.microbatches,
        emulate_speed=speed,
        loss_contributions=losses,
        last_stage=last,
        steps=times.per_step,
        sync_s=times.sync_s,
        optimizer_s=times.optimizer_s,
        parameters=sum(p.numel() for p in params),
        max_rss_bytes=_max_rss_bytes(),
    )
    _finish(rank, result, out_dir)


class _StageRunner:
    """One rank's pipeline work for an iteration: 1F1B over its replica's micro-batches."""

    def __init__(
        self,
        job: RunJob,
        role: Role,
        module: StageModule,
        comm: Communicator,
        emulator: Emulator,
        dtype: torch.dtype,
    ) -> None:
        pipeline = role.pipeline
        self.stages = pipeline.stages
        self.role, self.module, self.comm, self.emulator, self.dtype = role, module, comm, emulator, dtype
        self.index = role.stage_index
        self.first, self.last = self.index == 0, self.index == len(self.stages) - 1
        self.mbs = pipeline.micro_batch_size
        self.loss_scale = self.mbs / job.global_batch  # this micro-batch's share of the global batch
        self.shape = (self.mbs, job.seq_length, job.model.hidden_size)
        self.offsets = group_offsets(job.cluster)
        self.times = StageTimes()
        self.sends: list[dist.Work] = []
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_sum = 0.0

    def peer(self, stage_index: int, tp_rank: int) -> int:
        return stage_rank(self.offsets, self.stages[stage_index], self.role.replica, tp_rank)

    def receive(self, src: int) -> torch.Tensor:
        buffer = torch.empty(self.shape, dtype=self.dtype)
        waited = time.perf_counter()
        self.comm.irecv(buffer, src).wait()
        self.times.wait_s += time.perf_counter() - waited
        return buffer

    def forward(self, j: int, tokens: torch.Tensor) -> None:
        index, tp_rank = self.index, self.role.tp_rank
        batch = tokens[j * self.mbs : (j + 1) * self.mbs]
        if self.first:
            x = batch[:, :-1]
        else:
            x = self.receive(self.peer(index - 1, tp_rank % self.stages[index - 1].tp)).requires_grad_()
        t0 = time.perf_counter()
        out = self.module(x, batch[:, 1:] if self.last else None)
        real = time.perf_counter() - t0
        self.times.compute_s += real
        self.times.emulation_s += self.emulator.extend(real)
        if self.last:
            self.loss_sum += float(out.detach())
        else:
            for k in _targets(tp_rank, self.stages[index].tp, self.stages[index + 1].tp):
                self.sends.append(self.comm.isend(out.detach(), self.peer(index + 1, k)))
        self.saved[j] = (x, out)

    def backward(self, j: int) -> None:
        index, tp_rank = self.index, self.role.tp_rank
        x, out = self.saved.pop(j)
        grad = None
        if not self.last:
            grad = self.receive(self.peer(index + 1, tp_rank % self.stages[index + 1].tp))
        t0 = time.perf_counter()
        if self.last:
            (out * self.loss_scale).backward()
        else:
            out.backward(grad)
        real = time.perf_counter() - t0
        self.times.compute_s += real
        self.times.emulation_s += self.emulator.extend(real)
        if not self.first:
            for k in _targets(tp_rank, self.stages[index].tp, self.stages[index - 1].tp):
                self.sends.append(self.comm.isend(x.grad, self.peer(index - 1, k)))

    def one_f_one_b(self, tokens: torch.Tensor) -> float:
        """Run this replica's micro-batches through the stage; returns the sum of micro-batch losses (last stage)."""
        self.loss_sum = 0.0
        count = self.role.microbatches
        warmup = min(len(self.stages) - self.index - 1, count)
        for j in range(warmup):
            self.forward(j, tokens)
        for j in range(count - warmup):
            self.forward(warmup + j, tokens)
            self.backward(j)
        for j in range(count - warmup, count):
            self.backward(j)
        for work in self.sends:
            work.wait()
        self.sends.clear()
        return self.loss_sum


def _unflatten(module: StageModule, params: list[torch.nn.Parameter], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in module.named_parameters()}
    out, offset = {}, 0
    for p in params:
        out[names[id(p)]] = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return out


def _max_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _finish(rank: int, result: dict[str, Any], out_dir: str) -> None:
    dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result), encoding="utf-8")


def spawned_rank(rank: int, world_size: int, port: int, job: RunJob) -> None:
    """Entry point of a locally spawned rank (Gloo over loopback)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=job.settings.timeout_s),
    )
    try:
        run_rank(rank, job)
    finally:
        dist.destroy_process_group()
