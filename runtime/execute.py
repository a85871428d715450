"""One rank of a plan: its stage shard, 1F1B over its replica's micro-batches, weighted DP sync, (ZeRO) Adam.

Ranks are numbered as the planner numbers devices (comm.plan_groups): groups in cluster order, node-major; a stage's
rank for (replica r, CP rank c, TP rank k) is group offset + stage offset + (r * cp + c) * tp + k. Every rank creates
every group of the plan in one order. Activations are replicated over a stage's TP ranks, so between stages of
different TP widths receiving rank k takes its input from sending rank k mod tp_sender (and gradients flow back the
same way). With context parallelism each CP rank holds its chunks of every sequence (runtime/context_parallel.py) and
exchanges activations with the same CP rank of the neighbouring stages.

The schedule is Megatron's (interleaved) 1F1B, run and timed by runtime/pipeline.py (with a slower device's speed
emulated). Each micro-batch's loss is scaled by its share of the global batch (micro-batch size / global batch) and DP
gradients are summed, so replicas with uneven batch shares give exactly the full-batch gradient. A plan of several
pipeline families runs each family as above on its own devices and share of the batch; then gradients meet across
families as shards (runtime/sync.py).
With context parallelism a CP rank's loss is the mean over its 1/cp of the tokens, scaled by 1/cp more, and the DP sum
runs over the replicas and their CP ranks together (the dp-cp group, which ZeRO-1 shards over).

ZeRO, over a stage's replicas (a stage without replicas runs unsharded), after the flush (nothing overlaps the
backward): ZeRO-1 reduce-scatters the gradients and each replica updates its 1/dp chunk of the rank's flat parameter
vector, with Adam moments for that chunk only, then the chunks are all-gathered; ZeRO-2 runs the same (a rank holds
only its chunk of the summed gradient; the local gradients exist until the flush, whole); ZeRO-3 also
keeps only that chunk of the weights, gathering each layer's in turn while it computes (runtime/zero.py), and
skips the all-gather after the update.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from comm.communicator import CommGroup, Communicator
from comm.plan_groups import plan_groups, rank_islands, stage_chunks
from profiler.data import synthetic_batch
from profiler.layers import DecoderLayer, adamw_update
from profiler.measure import keep_freed_host_memory
from runtime.context_parallel import ContextParallel
from runtime.model import StageModule, seeded_pieces, tie_output, trainable_parameters
from runtime.pipeline import Emulator, Role, StageRunner
from runtime.sync import ShardedSync, all_gathered, chunk_bounds, needs_swaps, reduce_scattered
from runtime.tensor_parallel import TensorParallel
from runtime.zero import ShardedParameters
from specs.cluster import ClusterSpec
from specs.layout import Axis, Strategy, group_offsets, stage_rank
from specs.model import ModelSpec, Recompute

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
    checkpoint_dir: str = ""  # save the training state here (runtime/checkpoint.py) every `checkpoint_every` steps
    checkpoint_every: int = 0
    checkpoint_keep: int = 2  # complete checkpoints left after each save (0: all)
    checkpoint_async: bool = False  # write in a background thread (DCP async_save), committed at the next save
    resume_from: str = ""  # a complete checkpoint to continue from (any plan's: it is resharded to this one)
    progress_dir: str = ""  # each training rank appends every step to progress-RANK.jsonl here (completed_steps)
    fail_at: tuple[int, int] | None = None  # (rank, step): that rank dies by SIGKILL as the step starts (elastic tests)
    dump_state: bool = False  # write each rank's parameters and moments with their positions (checkpoint tests)


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


def rank_roles(cluster: ClusterSpec, strategy: Strategy) -> dict[int, Role]:
    """Every active rank's role; the global batch is laid out family by family, replica by replica (a replica's CP
    ranks share its samples, each holding its chunks of every sequence)."""
    offsets = group_offsets(cluster)
    roles = {}
    family_start = 0
    for family, pipeline in enumerate(strategy.pipelines):
        counts = pipeline.replica_microbatches()
        starts = [family_start + sum(counts[:r]) * pipeline.micro_batch_size for r in range(pipeline.replicas)]
        cp = pipeline.context_parallel
        for index, stage in enumerate(pipeline.stages):
            for replica in range(pipeline.replicas):
                for c in range(cp):
                    for k in range(stage.tp):
                        roles[stage_rank(offsets, stage, replica, k, c, cp)] = Role(
                            family, pipeline, index, replica, k, stage, counts[replica], starts[replica], c
                        )
        family_start += pipeline.microbatch_total * pipeline.micro_batch_size
    return roles


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


class FlatAdam:
    """AdamW (torch's update, decoupled weight decay) over elements [lo, hi) of the rank's flat parameter vector:
    all of it, or under ZeRO its 1/dp shard, for which alone it keeps moments."""

    def __init__(self, bounds: tuple[int, int], dtype: torch.dtype, settings: RunSettings) -> None:
        self.lo, self.hi = bounds
        self.settings = settings
        self.exp_avg = torch.zeros(self.hi - self.lo, dtype=dtype)
        self.exp_avg_sq = torch.zeros(self.hi - self.lo, dtype=dtype)
        self.steps = 0

    def step(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        """Update `weights` (elements [lo, hi)) in place from their gradient `grads`."""
        self.steps += 1
        settings = self.settings
        adamw_update(weights, grads, self.exp_avg, self.exp_avg_sq, self.steps, settings.learning_rate,
                     settings.weight_decay)  # fmt: skip


@dataclass
class RankState:
    """What one rank trains with: its chunks' modules, their parameters, the optimizer and the gradient sync.
    `zero_stage` is the plan's, or 0 for a stage without replicas to shard over; under ZeRO-3 `sharded` holds the
    parameters (runtime/zero.py)."""

    modules: list[StageModule]
    params: list[torch.nn.Parameter]
    optimizer: FlatAdam
    dp_group: CommGroup
    across: ShardedSync | None
    runner: StageRunner
    zero_stage: int
    sharded: ShardedParameters | None

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def held_weights(self) -> list[torch.Tensor]:
        """The weights this rank keeps between steps, as the checkpoints and the optimizer see them: its parameters,
        or under ZeRO-3 its shard of their flat vector."""
        return [self.sharded.shard] if self.sharded is not None else list(self.params)


def _build(rank: int, job: RunJob, role: Role, comm: Communicator) -> RankState:
    """This rank's modules (one per model chunk), groups, optimizer and schedule runner."""
    cluster, model, strategy, settings = job.cluster, job.model, job.strategy, job.settings
    planned = [g for g in plan_groups(cluster, strategy, job.global_batch) if g.kind is not Axis.CROSS_FAMILY]
    made = comm.create_groups([g.ranks for g in planned])
    tp_group = next(g for p, g in zip(planned, made, strict=True) if p.kind is Axis.TP and rank in p.ranks)
    dp_group = next(g for p, g in zip(planned, made, strict=True) if p.kind is Axis.DP and rank in p.ranks)
    cp_group = next((g for p, g in zip(planned, made, strict=True) if p.kind is Axis.CP and rank in p.ranks), None)
    stage, cp_size = role.stage, role.pipeline.context_parallel
    tp = TensorParallel(tp_group.process_group, stage.tp, role.tp_rank)
    process_group = cp_group.process_group if cp_group is not None else None
    cp = ContextParallel(process_group, cp_size, role.cp_rank, job.seq_length, settings.timeout_s)
    recompute = strategy.stage_recompute(stage)
    dtype = TORCH_DTYPES[settings.dtype]
    modules = []
    for chunk in stage_chunks(role.pipeline, role.stage_index, strategy.virtual_stages):
        pieces = seeded_pieces(model, chunk.layer_start, chunk.layer_end, chunk.first, chunk.last, settings.seed)
        modules.append(StageModule(model, pieces, tp, recompute, cp).to(dtype))
    tie_output(model, modules)
    params = trainable_parameters(modules)
    numel = sum(p.numel() for p in params)
    dp_size = len(dp_group.ranks)
    zero_stage = strategy.zero_stage if dp_size > 1 else 0
    bounds = chunk_bounds(numel, dp_group.ranks.index(rank), dp_size) if zero_stage else (0, numel)
    optimizer = FlatAdam(bounds, dtype, settings)
    across = None
    if needs_swaps(model, strategy):
        across = ShardedSync(model, strategy, group_offsets(cluster), rank, dp_group)
    sample = torch.randn(role.pipeline.micro_batch_size, job.seq_length // cp_size, model.hidden_size, dtype=dtype)
    layers = [layer for module in modules for layer in module.layers]
    speed = cluster.group(stage.group).emulate_speed
    sharded = None
    if zero_stage == 3:
        roles = rank_roles(cluster, strategy)
        microbatches = {peer: roles[peer].microbatches for peer in dp_group.ranks}
        schedule = (len(role.pipeline.stages), len(modules), role.stage_index)
        sharded = ShardedParameters(modules, rank, dp_group, comm, microbatches, schedule)
        # the stage's own layers hold no weights between uses: speed emulation repeats a layer of its own
        layers = [_scratch_layer(model, tp, recompute, dtype)] if layers and speed < 1.0 else []
    emulator = Emulator(speed, layers, tp, cp, sample)
    shape = (job.global_batch, job.seq_length, job.model.hidden_size)
    runner = StageRunner(role, group_offsets(job.cluster), shape, modules, comm, emulator, dtype, sharded)
    return RankState(modules, params, optimizer, dp_group, across, runner, zero_stage, sharded)


def _scratch_layer(model: ModelSpec, tp: TensorParallel, recompute: Recompute, dtype: torch.dtype) -> DecoderLayer:
    """A decoder layer of the stage's TP shape (random weights) for speed emulation's repeated layer math."""
    layer = DecoderLayer(model, tp.size, recompute).to(dtype)
    layer.enter_tp, layer.leave_tp = tp.enter, tp.leave
    return layer


def run_rank(rank: int, job: RunJob) -> dict[str, Any]:
    """Train `settings.steps` steps as one rank (torch.distributed already initialised); returns its result."""
    torch.set_num_threads(1)
    comm = Communicator(rank_islands(job.cluster), timeout_s=job.settings.timeout_s)
    role = rank_roles(job.cluster, job.strategy).get(rank)
    if role is None:  # a device the plan leaves idle: it creates the groups and keeps step with the others
        comm.create_groups([g.ranks for g in plan_groups(job.cluster, job.strategy, job.global_batch)
                            if g.kind is not Axis.CROSS_FAMILY])  # fmt: skip
        keeper = _Keeper(rank, job, None, None)
        for step in range(keeper.first_step, job.settings.steps):
            _maybe_die(rank, job, step)
            dist.barrier()
            keeper.after(step + 1)
        return {"rank": rank, "idle": True, "first_step": keeper.first_step, "checkpoints": keeper.record}
    state = _build(rank, job, role, comm)
    keeper = _Keeper(rank, job, role, state)
    losses = []
    for step in range(keeper.first_step, job.settings.steps):
        _maybe_die(rank, job, step)
        losses.append(_step(rank, job, role, state, comm, step))
        keeper.after(step + 1, losses[-1])
    times, stage = state.runner.times, role.stage
    return {
        "rank": rank,
        "first_step": keeper.first_step,
        "checkpoints": keeper.record,
        "family": role.family,
        "stage": role.stage_index,
        "replica": role.replica,
        "tp_rank": role.tp_rank,
        "cp_rank": role.cp_rank,
        "group": stage.group,
        "layers": [stage.layer_start, stage.layer_end],
        "microbatches": role.microbatches,
        "emulate_speed": job.cluster.group(stage.group).emulate_speed,
        "loss_contributions": losses,
        "last_stage": role.last,
        "steps": times.per_step,
        "sync_s": times.sync_s,
        "zero3_gather_s": times.gather_s,
        "optimizer_s": times.optimizer_s,
        "parameters": state.numel,
        "zero_stage": state.zero_stage,
        "held_parameter_elements": held_parameter_elements(state),  # after the last step
        "peak_gathered_elements": state.sharded.peak_gathered_elements if state.sharded is not None else None,
        "max_rss_bytes": _max_rss_bytes(),
    }


def _maybe_die(rank: int, job: RunJob, step: int) -> None:
    """Fault injection for elastic tests: the chosen rank notes the time and kills itself, as a lost node would
    vanish (no cleanup, no goodbye to its peers)."""
    if job.settings.fail_at == (rank, step):
        Path(job.out_dir, "died.json").write_text(json.dumps({"rank": rank, "step": step, "time": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)


def _checkpoint_module() -> ModuleType:
    """runtime/checkpoint.py, imported by the ranks of runs that save or resume only: DCP's import (DTensor, sympy)
    costs a rank about a second of CPU at start, four of them on two cores two seconds of a run's wall time."""
    from runtime import checkpoint

    return checkpoint


class _Keeper:
    """A rank's checkpoints: resume from `settings.resume_from` at the start, save every `checkpoint_every` steps
    and after the last one (runtime/checkpoint.py); `state` None for an idle rank, which takes part in DCP's
    collectives with nothing to write."""

    def __init__(self, rank: int, job: RunJob, role: Role | None, state: RankState | None) -> None:
        self.rank, self.job, self.role, self.state = rank, job, role, state
        self.record: list[dict[str, Any]] = []
        self.table = self.holdings = None
        settings = job.settings
        if state is not None and role is not None and (settings.checkpoint_dir or settings.resume_from or
                                                       settings.dump_state):  # fmt: skip
            optimizer, checkpoint = state.optimizer, _checkpoint_module()
            self.table = checkpoint.global_tensors(job.model)
            self.holdings = checkpoint.rank_holdings(
                job.model, job.strategy, role.family, role.stage_index, role.dp_index, role.tp_rank,
                (optimizer.lo, optimizer.hi), state.zero_stage >= 1, state.sharded is not None,
            )  # fmt: skip
        self.saver = _checkpoint_module().Saver(settings.checkpoint_async) if settings.checkpoint_dir else None
        self.first_step = self.resumed_optimizer_steps = 0
        if settings.resume_from:
            started = time.perf_counter()
            load = _checkpoint_module().load_rank
            resumed = load(Path(settings.resume_from), self.table, self.holdings, *self._tensors())
            if state is not None:
                state.optimizer.steps = resumed.optimizer_steps
            self.first_step, self.resumed_optimizer_steps = resumed.step, resumed.optimizer_steps
            self.record.append({"loaded": resumed.checkpoint, "step": resumed.step, "load_s": resumed.load_s,
                                "setup_s": time.perf_counter() - started - resumed.load_s,
                                "loaded_unix_time_s": time.time()})  # fmt: skip
            self.dump("loaded")
        if settings.progress_dir and state is not None:  # set up: counted, at 0 steps, until it finishes one
            Path(settings.progress_dir, f"progress-{rank}.jsonl").touch()

    def _tensors(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        if self.state is None:
            return [], torch.zeros(0), torch.zeros(0)
        optimizer = self.state.optimizer
        return self.state.held_weights(), optimizer.exp_avg, optimizer.exp_avg_sq

    def after(self, done: int, loss: float = 0.0) -> None:
        """Note the step in progress-RANK.jsonl (what a supervisor reads of a run that dies before its results) and
        save after `done` completed steps when it is time."""
        settings, job = self.job.settings, self.job
        if settings.progress_dir and self.state is not None:
            line = {"step": done, "time_s": self.state.runner.times.per_step[-1]["time_s"], "loss": loss,
                    "unix_time_s": time.time()}  # fmt: skip
            with open(Path(settings.progress_dir, f"progress-{self.rank}.jsonl"), "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")
        if self.saver is None or not settings.checkpoint_every:
            return
        if done % settings.checkpoint_every and done != settings.steps:
            return
        samples, checkpoint = done * job.global_batch, _checkpoint_module()
        info = checkpoint.describe(done, samples, job.model, job.strategy, job.global_batch, job.seq_length,
                                   settings.seed, settings.dtype, dist.get_world_size(), job.cluster.name)  # fmt: skip
        params, exp_avg, exp_avg_sq = self._tensors()
        # every rank writes the plan's optimizer steps (one entry: DCP keeps any rank's, an idle one's too, which wrote
        # 0 and restarted Adam's bias correction on resume): an idle rank counts the updates the others made
        if self.state is not None:
            steps = self.state.optimizer.steps
        else:
            steps = self.resumed_optimizer_steps + done - self.first_step
        path, seconds = checkpoint.save_rank(
            self.saver, settings.checkpoint_dir, done, samples, info, self.table, self.holdings, params, exp_avg,
            exp_avg_sq, steps, settings.checkpoint_keep,
        )  # fmt: skip
        self.record.append({"saved": str(path), "step": done, "save_s": seconds})
        self.dump(f"step{done}")
        if done == settings.steps:
            self.close()

    def close(self) -> None:
        """Commit a pending background save (the last one)."""
        if self.saver is not None:
            self.saver.close()
            for written in self.saver.written:
                self.record.append(written)
            self.saver.written.clear()

    def dump(self, tag: str) -> None:
        """Parameters and moments with their positions in the whole model, as state-RANK-TAG.pt in the run's out_dir
        (checkpoint parity tests)."""
        if not self.job.settings.dump_state or self.state is None or self.holdings is None:
            return
        params, exp_avg, exp_avg_sq = self._tensors()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        lo, hi = self.holdings.moments
        torch.save(
            {"positions": torch.from_numpy(self.holdings.positions), "params": flat, "moments": (lo, hi),
             "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone(), "optimizer_steps":
             self.state.optimizer.steps},
            Path(self.job.out_dir, f"state-{self.rank}-{tag}.pt"),
        )  # fmt: skip


def _step(rank: int, job: RunJob, role: Role, state: RankState, comm: Communicator, step: int) -> float:
    """One training step: the schedule, the gradient sync, the update; returns this rank's loss contribution."""
    settings, mbs, times = job.settings, role.pipeline.micro_batch_size, state.runner.times
    dist.barrier()
    started, started_cpu, tp = time.perf_counter(), time.process_time(), state.runner.emulator.tp
    before = (times.compute_s, times.emulation_s, times.wait_s, times.forward_s, times.backward_s, times.tp_comm_s,
              times.gather_s, times.wait_cpu_s, tp.comm_cpu_s)  # fmt: skip
    times.events.clear()
    tokens = synthetic_batch(job.model, job.global_batch, job.seq_length, settings.seed, step)
    times.events.append(("batch", started, time.perf_counter(), time.process_time() - started_cpu))
    if state.sharded is not None:
        state.sharded.post_sends()
    loss_sum = state.runner.run(tokens[role.sample_start : role.sample_start + role.microbatches * mbs])
    t0, cpu0 = time.perf_counter(), time.process_time()
    if state.sharded is not None:
        state.sharded.wait_sends()
    capture = settings.capture_gradients and step == 0
    grads, whole = _synced_gradients(state, comm, capture)
    sync_s, sync_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    times.sync_s += sync_s
    times.events.append(("dp_sync", t0, t0 + sync_s, sync_cpu_s))
    if whole is not None:
        torch.save(_unflatten(state.modules, state.params, whole), Path(job.out_dir, f"grads-{rank}.pt"))
    t0, cpu0 = time.perf_counter(), time.process_time()
    _update(state, comm, grads)
    optimizer_s, optimizer_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    times.optimizer_s += optimizer_s
    times.events.append(("optimizer", t0, t0 + optimizer_s, optimizer_cpu_s))
    times.per_step.append(
        {
            "time_s": time.perf_counter() - started,
            "compute_s": times.compute_s - before[0],
            "emulation_s": times.emulation_s - before[1],
            "wait_s": times.wait_s - before[2],
            "forward_s": times.forward_s - before[3],
            "backward_s": times.backward_s - before[4],
            "tp_comm_s": times.tp_comm_s - before[5],
            "sync_s": sync_s + times.gather_s - before[6],
            "optimizer_s": optimizer_s,
            # the process's CPU time (every thread) in the step and while it waited, synced and stepped: what a
            # rank takes from the cores it shares (predictor/sharing.py counts waits and syncs as asleep)
            "cpu_s": time.process_time() - started_cpu,
            "wait_cpu_s": times.wait_cpu_s - before[7],
            "tp_comm_cpu_s": tp.comm_cpu_s - before[8],
            "sync_cpu_s": sync_cpu_s,
            "optimizer_cpu_s": optimizer_cpu_s,
            # when each pass, wait, sync and update ran, from the step's start (after its barrier), and its CPU time
            "timeline": [
                [kind, round(start - started, 6), round(end - started, 6), round(cpu_s, 6)]
                for kind, start, end, cpu_s in times.events
            ],
        }
    )
    return loss_sum * state.runner.loss_scale if role.last and role.tp_rank == 0 else 0.0


def _synced_gradients(state: RankState, comm: Communicator, capture: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient summed over the replicas (and families) for the elements [lo, hi) the optimizer updates, and
    the whole summed vector when `capture` (parity tests). The local gradients are dropped once flattened; under
    ZeRO they are reduce-scattered, so only the shard of the sum is ever held (ZeRO-1 as Megatron's distributed
    optimizer and the cost model have it: an all-reduce would move twice the bytes on NCCL)."""
    params, dp, optimizer = state.params, state.dp_group, state.optimizer
    grads = flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    for p in params:
        p.grad = None
    if state.zero_stage >= 1:
        if state.across is not None:
            shard = state.across.summed_chunk(grads, comm)
        else:
            shard = reduce_scattered(grads, comm, dp, dp.ranks.index(dist.get_rank()))
        return shard, all_gathered(shard, grads.numel(), comm, dp) if capture else None
    if state.across is None:
        comm.all_reduce(grads, dp)
    else:
        grads = state.across.sync(grads, comm)
    return grads[optimizer.lo : optimizer.hi], grads if capture else None


def _update(state: RankState, comm: Communicator, grads: torch.Tensor) -> None:
    """The optimizer step on the rank's elements [lo, hi); under ZeRO-1/2 the updated shards are then all-gathered
    into every replica's parameters, under ZeRO-3 the shard is all the rank keeps."""
    optimizer = state.optimizer
    if state.sharded is not None:
        optimizer.step(state.sharded.shard, grads)
        return
    with torch.no_grad():
        weights = flat([p.data for p in state.params])
        optimizer.step(weights[optimizer.lo : optimizer.hi], grads)
        if state.zero_stage:
            weights = all_gathered(weights[optimizer.lo : optimizer.hi], weights.numel(), comm, state.dp_group)
        offset = 0
        for p in state.params:
            p.data.copy_(weights[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def held_parameter_elements(state: RankState) -> int:
    """Parameter elements this rank's memory holds now: the storages behind its parameters (a ZeRO-3 unit's are
    empty between uses) and its ZeRO-3 shard."""
    held = {s.data_ptr(): s.nbytes() // p.element_size() for p in state.params if (s := p.untyped_storage()).nbytes()}
    return sum(held.values()) + (state.sharded.shard.numel() if state.sharded is not None else 0)


def _unflatten(
    modules: list[StageModule], params: list[torch.nn.Parameter], flat: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A flat gradient as named tensors (`chunk{k}.` before each name when the rank holds several chunks; a tied
    matrix by its first name, the embedding's)."""
    names: dict[int, str] = {}
    for k, module in enumerate(modules):
        for name, p in module.named_parameters():
            names.setdefault(id(p), (f"chunk{k}." if len(modules) > 1 else "") + name)
    out, offset = {}, 0
    for p in params:
        out[names[id(p)]] = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return out


def _max_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def gathered_results(rank: int, job: RunJob) -> list[dict[str, Any]] | None:
    """Run this rank and gather every rank's result on rank 0 over the process group (no shared disk); None
    elsewhere."""
    result = run_rank(rank, job)
    everyone: list[dict[str, Any]] | None = [{} for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather_object(result, everyone, dst=0)
    return everyone


def completed_steps(progress_dir: Path) -> tuple[int, int] | None:
    """The step the ranks' progress lines began after (a resumed checkpoint's; 0 from the start) and the steps every
    training rank has finished since (the fewest of the ranks set up: each makes its file before its first step);
    None before any finished one. A line being written is not counted."""
    began, counts = None, []
    for path in progress_dir.glob("progress-*.jsonl"):
        ends = _first_and_last_lines(path)
        if ends is None:
            counts.append(0)
            continue
        began = json.loads(ends[0])["step"] - 1 if began is None else began
        counts.append(json.loads(ends[1])["step"] - began)
    return None if began is None else (began, min(counts))


PROGRESS_TAIL_BYTES = 4096  # far more than a progress line (a longer one widens the window)


def _first_and_last_lines(path: Path) -> tuple[str, str] | None:
    """The first and the last whole line of a file being appended to (None: no whole line yet), reading its two
    ends only (a long run's file is read every second)."""
    with open(path, "rb") as file:
        head = file.readline()
        if not head.endswith(b"\n"):
            return None
        size, window = file.seek(0, os.SEEK_END), PROGRESS_TAIL_BYTES
        while True:
            start = max(0, size - window)
            file.seek(start)
            tail = file.read(size - start)
            whole = tail[: tail.rfind(b"\n")]  # up to the last line's end (what follows is being written)
            if start == 0 or b"\n" in whole:  # the last whole line starts inside the window
                break
            window *= 2
    return head.decode("utf-8"), whole.rsplit(b"\n", 1)[-1].decode("utf-8")


def tell_steps(progress_dir: Path, steps: int, steps_done: Callable[[int, int], None]) -> None:
    """steps_done(steps finished, steps to run) of this run (or attempt: after a resume, from its checkpoint on), once
    a rank has finished one."""
    found = completed_steps(progress_dir)
    if found is not None:
        began, done = found
        steps_done(done, steps - began)


def spawned_rank(rank: int, world_size: int, port: int, job: RunJob) -> None:
    """Entry point of a locally spawned rank (Gloo over loopback); rank 0 writes every rank's result to results.json."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    keep_freed_host_memory()  # as the profile measured its layers and host costs
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=job.settings.timeout_s),
    )
    try:
        results = gathered_results(rank, job)
        if results is not None:
            Path(job.out_dir, "results.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        dist.destroy_process_group()
