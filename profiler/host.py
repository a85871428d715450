"""Measure what a training step costs on this host besides its layers and collectives (`hetplan profile` on the CPU):
how processes computing at once slow each other (timed by profiler/layer_timing.py), the optimizer step per
parameter, what running a stage's layers as one module adds per micro-batch and per layer, what a tensor-parallel rank
computes around each of its collectives (profiler/host_tp.py), the work around the collectives of a sync across
pipeline families, and making the step's batch. The numbers go into the profile's `host` section
(profiler.profile.HostCosts); the cost model uses them for local runs on CPU processes.

Everything is timed with one thread per process, as the runtime's ranks run. The optimizer step mirrors the runtime's
(runtime/execute.py FlatAdam): flatten the parameters, AdamW in place on the rank's shard, copy back.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event

try:
    import torch
    import torch.multiprocessing as mp
    from torch import nn
except ImportError as err:  # pragma: no cover - exercised only without torch
    from specs.errors import TorchMissingError

    raise TorchMissingError("`hetplan profile`") from err

from profiler.data import synthetic_batch
from profiler.host_tp import TP_TIMINGS, fit_tp_collective_costs, time_tp_collectives, time_tp_under_load
from profiler.layer_timing import (
    HELPER_START_S,
    MAX_CONCURRENT_PROCESSES,
    BusyHelpers,
    concurrency,
    concurrency_levels,
    median_points,
    median_time_s,
)
from profiler.layers import (
    DecoderLayer,
    Embedding,
    LMHead,
    adamw_update,
)
from profiler.machine import host_cores
from profiler.measure import build_layer, keep_freed_host_memory, layer_clock, profile_layer
from profiler.profile import ConcurrencyPoint, HostCosts
from specs.errors import HetplanError
from specs.model import ModelSpec

PASSES = 3  # interleaved passes over the chain timings (a drifting machine spreads over all of them)
CONCURRENCY_MOMENTS = 3  # busy-stretch timings at the start, middle and end of the host section (median per level)
STAGE_LAYERS = 4  # the longer chain of the stage overhead measurement (at most the model's layers)
BATCHES = (8, 32)  # global batch sizes the batch making is timed at
OPTIMIZER_WARMUP_STEPS = 2  # untimed optimizer steps first (the allocator and the moments settle)
OPTIMIZER_STEPS = 7  # optimizer steps timed after a pass each (at least; more while under min_time_s)
MAX_OPTIMIZER_STEPS = 40
FAMILY_SYNC_MIN_S = 0.1  # of each of the three family sync timings
HOST_PARTS = 13  # the host section's timings, the TP collectives under load besides (progress lines)
COLD_ROUNDS = 15  # at least, of the cold pass measurement (each: a pass back to back and one after the partner's)


def _stage_pass_parts(
    model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype, layers: int
) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    """(forward, backward) of a stage of `layers` decoder layers with the embedding and the head, as a runtime stage
    runs them: the forward returns the loss the backward starts from."""
    module = _stage_parts(model, dtype, layers)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (micro_batch_size, seq_length), generator=generator)
    targets = torch.randint(0, model.vocab_size, (micro_batch_size, seq_length), generator=generator)

    def forward() -> torch.Tensor:  # gradients accumulate, as over a step's micro-batches
        return module(tokens, targets)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    return forward, backward


def _core_partner(
    model: ModelSpec,
    micro_batch_size: int,
    seq_length: int,
    dtype: str,
    core: int,
    go: Event,
    done: Event,
    stop: Event,
    ready: Event,
) -> None:
    """A process pinned to `core` that runs a stage pass of its own each time `go` is set, then sets `done`."""
    torch.set_num_threads(1)
    keep_freed_host_memory()
    os.sched_setaffinity(0, {core})
    forward, backward = _stage_pass_parts(
        model, micro_batch_size, seq_length, getattr(torch, dtype), _cold_layers(model)
    )
    backward(forward())
    ready.set()
    while not stop.is_set():
        if go.wait(timeout=0.1):
            go.clear()
            backward(forward())
            done.set()


def _cold_layers(model: ModelSpec) -> int:
    """The decoder layers of the stage the cold start is timed on."""
    return max(1, min(STAGE_LAYERS, model.num_layers))


def cold_pass_costs(
    model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype, min_time_s: float = 0.5
) -> tuple[float, float]:
    """(forward, backward) busy seconds a stage pass takes beyond back to back when another process has used its
    core just before: with more ranks than cores, a rank's pass starts after others computed on its core (it waited
    for a neighbour or was preempted), with their data in its caches. This process and a partner, both pinned to one
    core, take turns: the partner runs a stage pass of its own, then this process times a forward (or a backward) on
    its CPU clock; against the same passes back to back, in interleaved rounds. (0, 0) where processes cannot be
    pinned to a core (no os.sched_setaffinity)."""
    if not hasattr(os, "sched_setaffinity"):
        return 0.0, 0.0
    allowed = os.sched_getaffinity(0)
    core = min(allowed)
    threads = torch.get_num_threads()
    context = mp.get_context("spawn")
    go, done, stop, ready = context.Event(), context.Event(), context.Event(), context.Event()
    args = (model, micro_batch_size, seq_length, str(dtype).removeprefix("torch."), core, go, done, stop, ready)
    partner = context.Process(target=_core_partner, args=args, daemon=True)
    partner.start()
    try:
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {core})
        deadline = time.monotonic() + HELPER_START_S
        while not ready.wait(timeout=0.2):
            if not partner.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the core partner process did not start (exit code {partner.exitcode})")
        forward, backward = _stage_pass_parts(model, micro_batch_size, seq_length, dtype, _cold_layers(model))
        backward(forward())

        def partner_pass() -> None:
            go.set()
            while not done.wait(timeout=0.2):
                if not partner.is_alive():
                    raise RuntimeError(f"the core partner process stopped (exit code {partner.exitcode})")
            done.clear()

        def timed_round(cold: bool) -> tuple[float, float]:
            if cold:
                partner_pass()
            started = time.process_time()
            loss = forward()
            forward_s = time.process_time() - started
            if cold:
                partner_pass()
            started = time.process_time()
            backward(loss)
            return forward_s, time.process_time() - started

        measured: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        while len(measured[True]) < COLD_ROUNDS or sum(f + b for f, b in measured[True]) < min_time_s:
            for cold in (False, True):
                measured[cold].append(timed_round(cold))
        medians = {
            cold: [statistics.median(times[i] for times in rounds) for i in (0, 1)] for cold, rounds in measured.items()
        }
        return max(0.0, medians[True][0] - medians[False][0]), max(0.0, medians[True][1] - medians[False][1])
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
        stop.set()
        partner.join(timeout=10)
        if partner.is_alive():
            partner.kill()


def _stage_parts(model: ModelSpec, dtype: torch.dtype, layers: int) -> nn.Module:
    """Embedding, `layers` decoder layers and the LM head with its loss, run as one module (as a runtime stage)."""
    torch.manual_seed(0)

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = Embedding(model, 1)
            self.layers = nn.ModuleList(DecoderLayer(model, 1, "none") for _ in range(layers))
            self.head = LMHead(model, 1)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.embedding(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x, targets)

    return Stage().to(dtype)


def stage_overheads(
    model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype, min_time_s: float = 0.3
) -> tuple[float, float]:
    """(per micro-batch, per decoder layer) seconds a stage run as one module takes beyond its parts timed alone
    (the layer profile's way): stages of 1 and STAGE_LAYERS layers against the embedding, a layer and the head,
    in interleaved passes. Neither zeroes its gradients inside the timing: the runtime drops them once per step.
    (Zeroing them in every timed stage pass, as this did before, added 0.6, 2.5 and 7.5 ms to a 4-layer stage of the
    runtime benchmark's tiny, small and 10x models, which the overheads then charged to every micro-batch.)"""
    longer = max(2, min(STAGE_LAYERS, model.num_layers))
    stages = {count: _stage_pass_parts(model, micro_batch_size, seq_length, dtype, count) for count in (1, longer)}

    def stage_pass(count: int) -> Callable[[], None]:
        forward, backward = stages[count]
        return lambda: backward(forward())

    measured: dict[str, list[float]] = {}
    for _ in range(PASSES):
        for count in stages:
            measured.setdefault(f"stage{count}", []).append(median_time_s(stage_pass(count), min_time_s / PASSES))
        for layer in ("embedding", "decoder", "lm_head"):
            module, inputs = build_layer(
                model, layer, micro_batch_size, seq_length, 1, "none", torch.device("cpu"), dtype
            )
            timed = profile_layer(module, inputs, warmup=1, repeats=3, min_time_s=min_time_s / PASSES)
            measured.setdefault(layer, []).append(timed.forward_time_s + timed.backward_time_s)
    time_s = {key: statistics.median(values) for key, values in measured.items()}
    per_layer = (time_s[f"stage{longer}"] - time_s["stage1"]) / (longer - 1) - time_s["decoder"]
    per_microbatch = time_s["stage1"] - time_s["embedding"] - time_s["decoder"] - time_s["lm_head"] - per_layer
    return per_microbatch, per_layer


def optimizer_costs(
    model: ModelSpec,
    micro_batch_size: int,
    seq_length: int,
    dtype: torch.dtype,
    min_time_s: float = 0.3,
    clock: Callable[[], float] | None = None,
) -> tuple[float, float, float]:
    """(seconds per parameter of the optimizer shard, per parameter held, per parameter held when the state is
    sharded) of the runtime's optimizer step on a stage holding the whole model (embedding, every decoder layer, the
    head), timed as a run does it: right after a forward and backward pass of the stage, the parts one after the
    other, each on its own clock reading: flattening the gradients and the parameters, AdamW over them, copying the
    parameters back; then, under ZeRO-1, putting the shard in a padded buffer and joining the gathered pieces (two
    replicas; the all-gather itself is the collective's). Medians over at least OPTIMIZER_STEPS steps and
    `min_time_s` of updates (at most MAX_OPTIMIZER_STEPS), after OPTIMIZER_WARMUP_STEPS.

    Timed apart and hot, each part over the decoder layers' parameters alone (as the profile did before), the update
    with the gradient flattening read 5.6, 23.8 and 133 ms for the runtime benchmark's tiny, small and 10x models,
    where their one-stage runs (grid 6) took 8.4, 37 and 130 ms for the same (optimizer term plus the flattening
    the run times in its sync): a part timed again and again finds its tensors in the caches that a pass in between
    evicts, and timed alone it misses what the previous part left in them. Timed this way: 9.0, 41 and 141 ms
    against 8.9-9.3, 38 and 132-135 ms in grid 9's runs."""
    clock = clock or layer_clock(torch.device("cpu"))
    stage = _stage_parts(model, dtype, model.num_layers)
    params = list(stage.parameters())
    numel = sum(p.numel() for p in params)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (micro_batch_size, seq_length), generator=generator)
    targets = torch.randint(0, model.vocab_size, (micro_batch_size, seq_length), generator=generator)
    exp_avg, exp_avg_sq = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
    shard = -(-numel // 2)
    adam_s: list[float] = []
    flatten_s: list[float] = []
    join_s: list[float] = []
    step = 0
    while len(adam_s) < OPTIMIZER_STEPS or sum(adam_s) + sum(flatten_s) < min_time_s:
        step += 1
        stage.zero_grad(set_to_none=True)
        stage(tokens, targets).backward()
        with torch.no_grad():
            started = clock()
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            weights = torch.cat([p.reshape(-1) for p in params])
            flattened = clock()
            adamw_update(weights, grads, exp_avg, exp_avg_sq, step, learning_rate=1e-3, weight_decay=0.01)
            updated = clock()
            offset = 0
            for p in params:
                p.copy_(weights[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            copied = clock()
            padded = torch.zeros(shard, dtype=dtype)
            padded[:shard] = weights[:shard]
            torch.cat([padded, torch.empty_like(padded)])[:numel]
            joined = clock()
        if step > OPTIMIZER_WARMUP_STEPS:
            adam_s.append(updated - flattened)
            flatten_s.append(flattened - started + copied - updated)
            join_s.append(joined - copied)
        if step >= OPTIMIZER_WARMUP_STEPS + MAX_OPTIMIZER_STEPS:
            break
    return tuple(statistics.median(times) / numel for times in (adam_s, flatten_s, join_s))  # type: ignore[return-value]


def family_sync_cost(model: ModelSpec, dtype: torch.dtype, min_time_s: float = 0.3) -> float:
    """Seconds per parameter held of the host work around the collectives when gradients meet across pipeline
    families, as the runtime does it (runtime/sync.py, two replicas and one other family holding every layer): pad the
    flat gradient, take the chunk the reduce-scatter leaves, gather what goes to the other family, add what comes
    back by index, spread the chunk into a full-size vector."""
    numel = model.num_layers * model.layer_params()
    grads = torch.randn(numel, dtype=dtype)
    half = numel // 2
    indices = torch.arange(half)

    def sync() -> None:
        padded = torch.zeros(2 * half + 2, dtype=dtype)
        padded[:numel] = grads
        mine = padded[:half].clone()
        sent = mine[indices].contiguous()
        total = mine.clone()
        total[indices] += sent
        out = torch.zeros_like(grads)
        out[:half] = total

    return median_time_s(sync, min_time_s) / numel


def batch_costs(model: ModelSpec, seq_length: int, min_time_s: float = 0.2) -> tuple[float, float]:
    """(seconds per step, seconds per sample) of making the step's synthetic batch, from two batch sizes."""
    small, large = BATCHES
    times = [median_time_s(lambda b=b: synthetic_batch(model, b, seq_length, 0, 0), min_time_s) for b in BATCHES]
    per_sample = max(0.0, (times[1] - times[0]) / (large - small))
    return max(0.0, times[0] - small * per_sample), per_sample


class HostParts:
    """The host section's progress, counted in parts (they take minutes; the layers' count is done by then):
    `progress(parts done, parts, what)`."""

    def __init__(self, total: int, progress: Callable[[int, int, str], None]) -> None:
        self.total, self.progress = total, progress
        self.started = 0  # the parts started so far (skipped ones too)

    def start(self, part: str) -> None:
        """The next part starts."""
        self.started = min(self.started + 1, self.total)
        self.progress(self.started - 1, self.total, f"host: {part}")

    def skip(self) -> None:
        """The next part is not measured (the count goes on)."""
        self.started = min(self.started + 1, self.total)

    def note(self, line: str) -> None:
        """A part failed: why, and what stands instead."""
        self.progress(max(self.started - 1, 0), self.total, line)

    def end(self) -> None:
        self.progress(self.total, self.total, "host: done")


class TpCollectiveTimings:
    """The TP collectives between layers, timed at the host section's moments (they differ more from one launch to
    the next than within one): the timings so far, and why they stopped where one failed (not tried again: the
    layers and the other host costs stay measured, local runs' TP collectives use the link profile's)."""

    def __init__(self, model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype, parts: HostParts):
        self._args = (model, micro_batch_size, seq_length, dtype)
        self._parts = parts
        self.timings: list[dict] = []
        self.failure = ""

    def time(self, moment: int) -> None:
        if self.failure:
            self._parts.skip()  # the count goes on
            return
        self._parts.start(f"TP collectives between layers ({moment} of {TP_TIMINGS})")
        try:
            timing = time_tp_collectives(*self._args)
        except HetplanError as err:
            self._parts.note(f"host: {err}; local runs' TP collectives will use the link profile's")
            self.failure = str(err)
            return
        if timing is not None:
            self.timings.append(timing)


def measure_host(
    model: ModelSpec,
    seq_length: int,
    dtype: torch.dtype,
    micro_batch_size: int,
    progress: Callable[[int, int, str], None],
) -> HostCosts:
    """Every host cost of a CPU profile (on this 2-core machine the runtime benchmark's tiny and 10x models took 81 s
    and 193 s to profile with them, most of it here). `progress(parts done, parts, what)`: each part as it starts
    (its name, "host: optimizer step"), a part that fails (why, and what stands instead), and the end."""
    cores = host_cores()
    # two processes per core with the two TP ranks, as a 2-family run on two cores (one core: the unloaded timings
    # already ran at two per core)
    beside = 2 * cores - 2
    loaded_tp = 0 < beside <= MAX_CONCURRENT_PROCESSES - 2
    parts = HostParts(HOST_PARTS + (1 if loaded_tp else 0), progress)
    say = parts.start

    # the family sync's memory-bound copies, timed at three moments of the measurement (median): timed once, the
    # runtime benchmark's tiny model read 7.3 ns per parameter in one profile, 4.4-5.0 ns in seven others and in eight
    # repeats on a quiet machine. The TP collectives too (profiler/host_tp.py: they differ more from one launch to
    # the next than within one), processes computing at once (`median_points`), and a stage as one module (six
    # readings in a row on a shared host: per layer -0.72 to +0.03 ms, per micro-batch -0.33 to +0.87 ms, where the
    # tiny model's layer takes 5.5 ms)
    family_sync_s = [family_sync_cost(model, dtype, FAMILY_SYNC_MIN_S)]
    tp_collectives = TpCollectiveTimings(model, micro_batch_size, seq_length, dtype, parts)

    concurrency_readings: list[list[ConcurrencyPoint]] = []
    stage_readings: list[tuple[float, float]] = []

    def time_concurrency_and_stage(moment: int, helpers: BusyHelpers) -> None:
        say(f"processes computing at once ({moment} of {CONCURRENCY_MOMENTS})")
        concurrency_readings.append(concurrency(model, micro_batch_size, seq_length, dtype, cores, helpers=helpers))
        say(f"a stage as one module ({moment} of {CONCURRENCY_MOMENTS})")
        stage_readings.append(stage_overheads(model, micro_batch_size, seq_length, dtype))

    # the concurrency helpers start at the first moment and stay until the last (idle in between)
    helpers_needed = max(concurrency_levels(cores), default=1) - 1
    with BusyHelpers(model, micro_batch_size, seq_length, dtype, helpers_needed) as helpers:
        tp_collectives.time(1)
        time_concurrency_and_stage(1, helpers)
        family_sync_s.append(family_sync_cost(model, dtype, FAMILY_SYNC_MIN_S))
        tp_collectives.time(2)
        time_concurrency_and_stage(2, helpers)
        say("passes after another process used the core")
        cold_forward_s, cold_backward_s = cold_pass_costs(model, micro_batch_size, seq_length, dtype)
        say("optimizer step")
        per_shard_param, per_held_param, per_gathered_param = optimizer_costs(
            model, micro_batch_size, seq_length, dtype
        )
        say("syncing gradients across families")
        family_sync_s.append(family_sync_cost(model, dtype, FAMILY_SYNC_MIN_S))
        tp_collectives.time(3)
        time_concurrency_and_stage(3, helpers)
    tp_loaded: list[dict] = []
    tp_timings = tp_collectives.timings if not tp_collectives.failure else []
    if tp_timings and loaded_tp:
        say("TP collectives between layers with processes computing beside them")
        tp_loaded = time_tp_under_load(model, micro_batch_size, seq_length, dtype, beside, parts.note)
    elif loaded_tp:
        parts.skip()  # not timed without unloaded timings to set it against: the count goes on
    say("making batches")
    batch_s, batch_s_per_sample = batch_costs(model, seq_length)
    tp = fit_tp_collective_costs(tp_timings, tp_loaded) if tp_timings else None
    per_microbatch, per_layer = (statistics.median(parts) for parts in zip(*stage_readings, strict=True))
    parts.end()
    return HostCosts(
        cores=cores,
        concurrency=median_points(concurrency_readings),
        optimizer_s_per_param=per_shard_param,
        flatten_s_per_param=per_held_param,
        gather_s_per_param=per_gathered_param,
        microbatch_overhead_s=per_microbatch,
        layer_overhead_s=per_layer,
        tp_collective_overhead_s=tp.overhead_s if tp else 0.0,
        tp_collective_overhead_s_per_byte=tp.overhead_s_per_byte if tp else 0.0,
        tp_all_reduce_alpha_s=tp.all_reduce_alpha_s if tp else None,
        tp_all_reduce_bw_bytes_per_s=tp.all_reduce_bw_bytes_per_s if tp else None,
        tp_all_reduce_load_alpha_s=tp.all_reduce_load_alpha_s if tp else None,
        tp_all_reduce_load_s_per_byte=tp.all_reduce_load_s_per_byte if tp else None,
        family_sync_s_per_param=statistics.median(family_sync_s),
        cold_forward_s=cold_forward_s,
        cold_backward_s=cold_backward_s,
        batch_s=batch_s,
        batch_s_per_sample=batch_s_per_sample,
    )
