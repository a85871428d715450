"""`hetplan run`: execute a plan on local processes, measure it, put the prediction beside it, write a run record.

The record is a `hetplan.run/1` (predictor/runs.py) with the cluster, model and training inline and the plan's whole
layout as the strategy, so `hetplan fit --runs run.json` calibrates on it: plan -> run -> measure -> compare -> refit.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from planner.export import launch_commands
from planner.plan import LoadedPlan, evaluation_dict
from planner.what_if import MAX_LOCAL_RANKS, check_runtime_layout, cpu_share, prediction_context
from predictor.cost_model import CostContext, evaluate, simulated_step
from predictor.host import on_host
from predictor.run_terms import predicted_stage_terms, side_by_side
from predictor.runs import RUN_SCHEMA
from profiler.comm_bench import free_port, run_processes
from profiler.layer_timing import concurrency, layer_time_s
from profiler.machine import MIN_OTHER_WORK_S, HostTimes, host_cores, host_times, other_work
from profiler.profile import DeviceProfile, ProfileEntry, ScaledLayerCosts
from runtime.execute import (
    TORCH_DTYPES,
    RunJob,
    RunSettings,
    gathered_results,
    spawned_rank,
    synthetic_batch,
    tell_steps,
)
from runtime.model import ReferenceModel, check_tp
from specs.cluster import ClusterSpec
from specs.errors import SpecError
from specs.layout import Strategy
from specs.loading import read_mapping
from specs.model import ModelSpec

__all__ = ["execute", "execute_in_job", "launch_commands", "prediction_context", "run_in_job", "run_plan"]
REFERENCE_MAX_PARAMS = 200_000_000
FP8_ACCELERATORS = "H100/H200/MI300X/Gaudi2"
# relative loss difference allowed between the run and one process (same weights and data, different sum orders)
T = TypeVar("T")
LOSS_TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}


def check_runnable(plan: LoadedPlan, cluster: ClusterSpec, dtype: str) -> None:
    """What the runtime cannot run (in `dtype`), as a one-line SpecError before any process starts."""
    check_dtype(dtype, plan.source)
    check_runtime_layout(plan)
    for stage in (s for pipeline in plan.strategy.pipelines for s in pipeline.stages):
        check_tp(plan.model, stage.tp, plan.source)


def check_dtype(dtype: str, source: str, field: str = "training.dtype") -> None:
    """The runtime computes on the CPU in the precisions torch has there; FP8 training is refused, saying where it
    runs and how to run the plan's layout here anyway. `source`, `field`: where the dtype was given (the plan's
    training, or `--dtype` and no field)."""
    if dtype == "fp8":
        raise SpecError(
            source, field, "fp8 training needs FP8 GEMMs, which need an FP8-capable accelerator "
            f"({FP8_ACCELERATORS}); this runtime computes on the CPU: run the plan's layout in bf16 or fp32 with "
            "`hetplan run ... --dtype bf16` (or --dtype fp32)",
        )  # fmt: skip
    if dtype not in TORCH_DTYPES:
        raise SpecError(source, field, f"the runtime runs {', '.join(TORCH_DTYPES)}, not {dtype!r}")


def _job(plan: LoadedPlan, cluster: ClusterSpec, settings: RunSettings, out_dir: str) -> RunJob:
    seq_length = plan.training.seq_length or plan.model.seq_length
    return RunJob(cluster, plan.model, plan.strategy, plan.training.global_batch_size, seq_length, settings, out_dir)


def run_plan(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    settings: RunSettings,
    out_dir: str | None = None,
    steps_done: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Spawn one local process per cluster device and train; returns every rank's result (gathered by rank 0).
    `steps_done(done, steps)` is told every second how many of its steps (after a resume: of those left) every rank
    has finished (execute.tell_steps)."""
    check_runnable(plan, cluster, settings.dtype)
    world = cluster.num_devices
    if world > MAX_LOCAL_RANKS:
        raise SpecError(
            cluster.source or "cluster",
            "devices",
            f"{world} devices: local runs spawn one process per device, at most {MAX_LOCAL_RANKS} (use torchrun)",
        )
    with tempfile.TemporaryDirectory(prefix="hetplan-run-") as scratch:
        watched = replace(settings, progress_dir=scratch) if steps_done else settings
        job = _job(plan, cluster, watched, out_dir or scratch)
        run_processes(
            spawned_rank,
            (world, free_port(), job),
            world,
            settings.timeout_s * (settings.steps + 3),
            f"hetplan run with {world} processes",
            (lambda: tell_steps(Path(scratch), settings.steps, steps_done)) if steps_done else None,
        )
        path = Path(job.out_dir, "results.json")
        if not path.exists():
            raise SpecError(plan.source, "ranks", "rank 0 wrote no results")
        results: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return results


def run_in_job(
    plan: LoadedPlan, cluster: ClusterSpec, settings: RunSettings, out_dir: str = "."
) -> list[dict[str, Any]] | None:
    """This process is one rank of a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment, any
    number of nodes): train and return every rank's result on rank 0, gathered over the process group; None on the
    other ranks. `out_dir` is written only for captured gradients."""
    check_runnable(plan, cluster, settings.dtype)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    timeout = timedelta(seconds=settings.timeout_s)
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    try:
        world = dist.get_world_size()
        if world != cluster.num_devices:
            raise SpecError(
                cluster.source or "cluster",
                "devices",
                f"the torchrun job has {world} processes, the cluster {cluster.num_devices} devices: start one "
                "process per device (hetplan launch writes the commands)",
            )
        return gathered_results(dist.get_rank(), _job(plan, cluster, settings, out_dir))
    finally:
        dist.destroy_process_group()


def summarize(results: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Iteration time per step = the slowest rank's; the measurement is the median after the first (warm-up) step, the
    lower one of an even count (a step that happened, as each stage's terms take their median step: the mean of two
    steps 35% apart stood beside a terms table of one of them)."""
    active = [r for r in results if not r.get("idle")]
    replica_of = {r["rank"]: r["replica"] for r in active}
    step_times = [max(r["steps"][s]["time_s"] for r in active) for s in range(steps)]
    measured_steps = step_times[1:] if steps > 1 else step_times
    losses = [sum(r["loss_contributions"][s] for r in active if r["last_stage"]) for s in range(steps)]
    stages: dict[tuple[int, int], dict[str, Any]] = {}
    for r in active:
        entry = stages.setdefault(
            (r["family"], r["stage"]),
            {"group": r["group"], "layers": r["layers"], "emulate_speed": r["emulate_speed"], "ranks": []},
        )
        entry["ranks"].append(r["rank"])
        kept = r["steps"][1:] if steps > 1 else r["steps"]
        for key in ("compute_s", "emulation_s", "wait_s"):
            entry.setdefault(key + "_per_rank", []).append(statistics.median(s[key] for s in kept))
        entry.setdefault("terms_per_rank", []).append((r["rank"], _measured_terms(kept)))
        entry.setdefault("microbatches_per_rank", []).append(r["microbatches"])
        entry.setdefault("cpu_per_rank", []).append(_median_step(kept))
    per_stage = []
    for family, index in sorted(stages):
        entry = stages[family, index]
        # the stage's slowest rank among the replicas with the most micro-batches, whose step the predicted terms
        # describe (one with fewer waits for them in its sync)
        most = max(entry["microbatches_per_rank"])
        described = [
            t for t, m in zip(entry["terms_per_rank"], entry["microbatches_per_rank"], strict=True) if m == most
        ]
        rank, (step_s, terms) = max(described, key=lambda item: item[1][0])
        per_stage.append(
            {
                "family": family,
                "stage": index,
                "group": entry["group"],
                "layers": entry["layers"],
                "emulate_speed": entry["emulate_speed"],
                "ranks": entry["ranks"],
                "compute_s": max(entry["compute_s_per_rank"]),
                "emulation_s": max(entry["emulation_s_per_rank"]),
                "wait_s": max(entry["wait_s_per_rank"]),
                "rank": rank,
                "replica": replica_of[rank],
                "step_s": step_s,
                "terms": terms,
                "cpu_s": _measured_cpu(entry["cpu_per_rank"][entry["ranks"].index(rank)]),
            }
        )
    return {
        "measured_iteration_time_s": statistics.median_low(measured_steps),
        "step_times_s": step_times,
        "timeline": _timeline(active, step_times, steps),
        "losses": losses,
        "stages": per_stage,
        "memory_max_rss_bytes": {str(r["rank"]): r["max_rss_bytes"] for r in active},
        "idle_ranks": [r["rank"] for r in results if r.get("idle")],
    }


def predicted_timeline(ctx: CostContext, strategy: Strategy) -> dict[str, Any] | None:
    """The step as the prediction's simulation of the processes sharing the cores lays it out, per (family, stage,
    replica) in the measured timeline's terms ([kind, start s, end s]; a row stands for the stage's TP and CP ranks,
    events that take no time are left out); its step is the simulated one the predicted iteration is stretched
    toward when it is stretched, before the calibrated fixed cost per step. None without measured host costs."""
    simulated = simulated_step(ctx, strategy)
    if simulated is None:
        return None
    return {"step_s": simulated.time_s, "actors": list(simulated.timeline)}


def _timeline(active: list[dict[str, Any]], step_times: list[float], steps: int) -> dict[str, Any]:
    """Every rank's passes, waits, sync and update in one step (the median after the warm-up, the lower of an even
    count; counted from the run's first step, which after a resume is the checkpoint's), each [kind, start s, end s,
    CPU s] from the step's start on that rank: ranks start a step together at its barrier, so the rows line up
    (within the barrier's release) and show who waited for whom."""
    kept = list(range(1, steps)) if steps > 1 else list(range(steps))
    if not kept:
        return {"step": None, "ranks": []}
    step = sorted(kept, key=lambda s: step_times[s])[(len(kept) - 1) // 2]
    rows = []
    for r in sorted(active, key=lambda r: r["rank"]):
        where = {key: r[key] for key in ("rank", "family", "stage", "replica", "tp_rank", "cp_rank", "group")}
        rows.append(where | {"events": r["steps"][step].get("timeline", [])})
    return {"step": step, "ranks": rows}


def _measured_terms(steps: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """One rank's median step (the lower one of an even count: a step that happened) and its terms as the runtime
    timed them (predictor/run_terms.py), the untimed rest as `other`: the terms add up to the step, and `other` is
    what no timer covers (medians taken term by term would not add up)."""
    timed = {"forward": "forward_s", "backward": "backward_s", "tp_comm": "tp_comm_s", "pipeline_wait": "wait_s"}
    timed |= {"dp_sync": "sync_s", "optimizer": "optimizer_s"}
    median = _median_step(steps)
    terms = {term: median.get(key, 0.0) for term, key in timed.items()}
    terms["other"] = median["time_s"] - sum(terms.values())
    return median["time_s"], terms


def _median_step(steps: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(steps, key=lambda s: s["time_s"])[(len(steps) - 1) // 2]


def _measured_cpu(step: dict[str, Any]) -> dict[str, float] | None:
    """The CPU time (every thread of the process) of a rank's median step and of its waiting terms: a term whose CPU
    time nears its wall time kept a core busy (records from before these timers: None)."""
    if "cpu_s" not in step:
        return None
    keys = {"step": "cpu_s", "pipeline_wait": "wait_cpu_s", "tp_comm": "tp_comm_cpu_s", "dp_sync": "sync_cpu_s"}
    return {term: step[key] for term, key in (keys | {"optimizer": "optimizer_cpu_s"}).items()}


def reference_check(plan: LoadedPlan, settings: RunSettings, measured_loss: float) -> dict[str, Any]:
    """Step 0's loss of the whole model in this one process, on the same batch and weights."""
    model = plan.model
    if model.total_params() > REFERENCE_MAX_PARAMS:
        return {"checked": False, "why": f"the model has {model.total_params():,} parameters: too big for one process"}
    seq_length = plan.training.seq_length or model.seq_length
    torch.set_num_threads(host_cores())
    reference = ReferenceModel(model, settings.seed).to(TORCH_DTYPES[settings.dtype])
    tokens = synthetic_batch(model, plan.training.global_batch_size, seq_length, settings.seed, 0)
    with torch.no_grad():
        loss = float(reference(tokens[:, :-1], tokens[:, 1:]))
    difference = abs(loss - measured_loss) / max(abs(loss), 1e-12)
    return {
        "checked": True,
        "step": 0,
        "reference_loss": loss,
        "run_loss": measured_loss,
        "relative_difference": difference,
        "tolerance": LOSS_TOLERANCE[settings.dtype],
        "match": difference < LOSS_TOLERANCE[settings.dtype],
    }


def cluster_mapping(mapping: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """The cluster file's mapping with the groups, nodes and devices per node the run ran on (a re-planned plan's
    nodes, or what an interrupted run ended on), so a record is predicted on the cluster that ran."""
    sizes = {g.name: (g.nodes, g.devices_per_node) for g in cluster.groups}
    groups = []
    for group in mapping.get("groups", []):
        if group.get("name") in sizes:
            nodes, per_node = sizes[group["name"]]
            groups.append({**group, "nodes": nodes, "devices_per_node": per_node})
    return {**mapping, "groups": groups}


def run_record(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    ctx: CostContext,
    settings: RunSettings,
    summary: dict[str, Any],
    reference: dict[str, Any],
    cpu_share: float,
    speed: dict[str, Any],
) -> dict[str, Any]:
    """A `hetplan.run/1` record; `ctx` is the prediction's context (its cluster already at the cores' share);
    `speed` the machine-speed check (`speed_check`)."""
    evaluation = evaluate(ctx, plan.strategy)
    predicted = evaluation.iteration_time_s
    slowdown = speed["slowdown"] if speed["checked"] else 1.0
    # the terms' layer costs at the plan's CP degree, as evaluate() takes them (per CP rank, ring included)
    terms = predicted_stage_terms(ctx, evaluation)
    simulated = predicted_timeline(ctx, plan.strategy)
    written = evaluation_dict(ctx, evaluation)
    layout = {
        key: written[key] for key in ("recompute", "zero_stage", "zero_shard", "virtual_stages", "sequence_parallel")
    }
    kept = ("replicas", "micro_batch_size", "num_microbatches", "total_microbatches", "context_parallel", "stages")
    layout["pipelines"] = [{key: p[key] for key in kept} for p in written["pipelines"]]
    emulated = {g.name: g.emulate_speed for g in cluster.groups if g.emulate_speed != 1.0}
    loaded = on_host(ctx, evaluation)
    if loaded.processes_per_core:
        sharing = {
            "from": "measured host costs (the profile's host section)",
            "busy_processes_per_core": loaded.processes_per_core,
            "compute_stretch": loaded.compute_stretch,
        }
    else:
        sharing = {"from": "assumed: each rank computes at cpu_share of a core", "cpu_share": cpu_share}
    return {
        "schema": RUN_SCHEMA,
        "name": f"{Path(plan.source).stem} on {cluster.name}",
        "source": f"hetplan run on {platform.node()} ({platform.machine()}, {host_cores()} cores)",
        "cluster": cluster_mapping(read_mapping(Path(cluster_path)), cluster),
        "model": plan.model.model_dump(mode="json"),
        "training": ctx.training.model_dump(mode="json"),  # as the runtime ran it (planner.what_if.run_context)
        "strategy": layout,
        "measured_iteration_time_s": summary["measured_iteration_time_s"],
        "cpu_share": cpu_share,
        "machine_slowdown": slowdown,
        "predicted_iteration_time_s": predicted,
        "predicted_at_run_speed_s": predicted * slowdown,
        "losses": summary["losses"],
        "reference_match": reference,
        "measurements": {
            "steps": settings.steps,
            "seed": settings.seed,
            "dtype": settings.dtype,
            "step_times_s": summary["step_times_s"],
            "stages": summary["stages"],
            "memory_max_rss_bytes": summary["memory_max_rss_bytes"],
            # the cost model's memory of the fullest device (weights, gradients, optimizer state, activations)
            "predicted_memory_bytes": max(stage.memory.total_bytes for stage in evaluation.stages),
            "idle_ranks": summary["idle_ranks"],
            "prediction_from": ctx.predictor_identity,
            "cost_source": dict(ctx.cost_source) if ctx.cost_source else None,
            "prediction_error": summary["measured_iteration_time_s"] / predicted - 1.0,
            "prediction_error_at_run_speed": summary["measured_iteration_time_s"] / (predicted * slowdown) - 1.0,
            "machine_speed": speed,
            "terms": side_by_side(summary["stages"], terms, simulated),
            "timeline": summary["timeline"],
            "predicted_timeline": simulated,
            "core_sharing": sharing,
            "emulated_groups": emulated,
            "emulation": "ranks of emulated groups repeat their stage's layer math, then spin, until each pass "
            "takes 1/speed of its real time (no sleeping)"
            if emulated
            else "",
        },
    }


def execute(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    context: Callable[[ClusterSpec], CostContext],
    settings: RunSettings,
    progress: Callable[[str], None] = print,
    steps_done: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the plan locally and return its run record; `context(cluster)` makes the prediction's cost context, asked
    for the cluster as the local ranks see it (sharing the cores); `steps_done(done, steps)`: run_plan's."""
    share = cpu_share(cluster)
    ctx = prediction_context(cluster, context)
    ctx.check_strategy(plan.strategy, plan.source)
    progress(f"running {plan.source} on {cluster.num_devices} local processes for {settings.steps} steps ...")
    readings = StepReadings(steps_done)
    results, speed = with_speed_check(
        ctx, lambda: run_plan(plan, cluster, settings, steps_done=readings.tell), readings
    )
    return _recorded(plan, cluster, cluster_path, ctx, settings, results, share, speed)


class StepReadings:
    """The host's CPU times (profiler.machine.host_times) as a run's ranks finish their steps, read from its
    `steps_done(done, steps)` reports (about every second): when the first step (the warm-up) is done and when every
    step is, so other work on the cores is measured over the steps whose times the run records, not the ranks' start
    or the single-process check. `then`: the reports passed on."""

    def __init__(self, then: Callable[[int, int], None] | None = None) -> None:
        self.then = then
        self.first: HostTimes | None = None
        self.last: HostTimes | None = None

    def tell(self, done: int, steps: int) -> None:
        if done >= 1 and self.first is None:
            self.first = host_times()
        if done >= steps and self.last is None:
            self.last = host_times()
        if self.then is not None:
            self.then(done, steps)

    def steps_window(self) -> tuple[HostTimes, HostTimes] | None:
        """The readings at the warm-up's end and the last step's, when they span MIN_OTHER_WORK_S or more (else the
        whole run is read)."""
        if self.first is None or self.last is None or self.last.wall_s - self.first.wall_s < MIN_OTHER_WORK_S:
            return None
        return self.first, self.last


def with_speed_check(
    ctx: CostContext, run: Callable[[], T], readings: StepReadings | None = None
) -> tuple[T, dict[str, Any]]:
    """`run()` with the machine-speed check around it (`speed_check`), or the reason there is none, and what other
    work used the cores during it (`with_other_work`, under "other_work")."""
    reference = speed_reference(ctx)
    if reference is None:
        result, others = with_other_work(run, readings)
        why = "the prediction's costs are not a measured profile of this host"
        return result, {"checked": False, "why": why, "other_work": others}
    before_s = reference_time_s(ctx.model, *reference)
    cores = cores_check(ctx.model, *reference)
    result, others = with_other_work(run, readings)
    speed = speed_check(reference, before_s, reference_time_s(ctx.model, *reference), cores)
    return result, {**speed, "other_work": others}


def with_other_work(run: Callable[[], T], readings: StepReadings | None = None) -> tuple[T, dict[str, Any]]:
    """`run()` and what else used this host's cores while it ran (profiler.machine.other_work): over its steps after
    the warm-up when `readings` (given to the run's steps_done) read them, else over the whole run; or why unknown."""
    before = host_times()
    result = run()
    after = host_times()
    if before is None or after is None:
        return result, {"checked": False, "why": "this system does not report its cores' busy time (/proc/stat)"}
    window = readings.steps_window() if readings is not None else None
    if window is not None:
        return result, other_work(*window, over="the steps after the first")
    return result, other_work(before, after, over="the whole run (the ranks' start included)")


def speed_reference(ctx: CostContext) -> tuple[DeviceProfile, ProfileEntry] | None:
    """The measured profile the prediction costs a group with (unwrapping a group's speed emulation) and its
    smallest decoder entry at tp 1 without recompute: the layer a run times again before and after, to tell how fast
    this machine runs now against when it was profiled. None when no group's costs are a measured profile."""
    for group in ctx.cluster.groups:
        source = ctx.sources.get(group.name)
        profile = source.inner if isinstance(source, ScaledLayerCosts) else source
        if not isinstance(profile, DeviceProfile) or profile.source != "measured":
            continue
        entry = reference_entry(profile)
        if entry is not None:
            return profile, entry
    return None


def reference_entry(profile: DeviceProfile) -> ProfileEntry | None:
    """A profile's smallest decoder entry at tp 1 without recompute (the layer the machine-speed check times)."""
    entries = [e for e in profile.entries if e.fits and e.layer == "decoder" and e.tp == 1 and e.recompute == "none"]
    return min(entries, key=lambda e: e.micro_batch_size) if entries else None


def reference_time_s(model: ModelSpec, profile: DeviceProfile, entry: ProfileEntry) -> float:
    """The reference layer (`speed_reference`) timed now in this process, as the profile timed it."""
    threads = int(profile.environment.get("threads", 1))
    dtype = TORCH_DTYPES.get(profile.dtype, torch.float32)
    return layer_time_s(model, entry.micro_batch_size, profile.seq_length, dtype, threads)


CORES_CHECK_S = 0.25  # of layer passes timed (with the helpers' start, about 3 s a run on a 2-core machine)


def cores_check(model: ModelSpec, profile: DeviceProfile, entry: ProfileEntry) -> dict[str, Any]:
    """The reference layer's busy stretch with a process per core computing it at once, measured now as the profile
    measured its own (profiler.layer_timing.concurrency), against the profile's (`cores_slowdown`: now over
    profiled); empty off a multi-core host or for a profile without host costs."""
    cores = host_cores()
    if profile.host is None or cores < 2:
        return {}
    dtype = TORCH_DTYPES.get(profile.dtype, torch.float32)
    size, seq_length = entry.micro_batch_size, profile.seq_length
    now = concurrency(model, size, seq_length, dtype, cores, CORES_CHECK_S, only_cores=True)[-1]
    if now.processes != cores:  # more cores than the concurrency measurement starts processes for
        return {}
    profiled = profile.host.busy_stretch(cores)
    return {"cores": cores, "busy_stretch_profiled": profiled, "busy_stretch_now": now.busy_stretch,
            "cores_slowdown": now.busy_stretch / profiled}  # fmt: skip


def speed_check(
    reference: tuple[DeviceProfile, ProfileEntry], before_s: float, after_s: float, cores: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The machine-speed check of a run: the reference layer as profiled, timed before and after the run, and the
    slowdown (the lower of the two over the profiled time; 1.1: the machine ran 10% slower than when profiled). The
    lower, because a check only ever reads slow when disturbed: right after a run, its processes exiting beside it
    made the layer read up to 45% slower than right before. And `cores` (cores_check, before the run): one process
    alone can run at its profiled speed while the cores together do not (this 2-core VM ran a tiny PP 2 plan 50%
    slower than an hour before, its ranks' CPU time per step 50% higher, with the one-process check at 1.00-1.11)."""
    profile, entry = reference
    profiled_s = (entry.forward_time_s or 0.0) + (entry.backward_time_s or 0.0)
    return {
        "checked": True,
        "layer": f"decoder, micro-batch {entry.micro_batch_size}, tp 1, no recompute",
        "profile": profile.path,
        "profiled_s": profiled_s,
        "before_run_s": before_s,
        "after_run_s": after_s,
        "slowdown": min(before_s, after_s) / profiled_s,
        **(cores or {}),
    }


def _recorded(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    ctx: CostContext,
    settings: RunSettings,
    results: list[dict[str, Any]],
    share: float,
    speed: dict[str, Any],
) -> dict[str, Any]:
    """The run record of every rank's results, with the one-process loss check and the machine-speed check beside
    it."""
    first_step = max((r.get("first_step", 0) for r in results), default=0)
    summary = summarize(results, settings.steps - first_step)
    if first_step:
        reference = {"checked": False, "why": f"resumed from a checkpoint at step {first_step}"}
    else:
        reference = reference_check(plan, settings, summary["losses"][0])
    return run_record(plan, cluster, cluster_path, ctx, settings, summary, reference, share, speed)


def execute_in_job(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    context: Callable[[ClusterSpec], CostContext],
    settings: RunSettings,
    progress: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """`hetplan run` as one rank of a torchrun job: the run record on rank 0 (None on the other ranks, which must
    write nothing); the prediction's cluster shares this node's cores among its local ranks."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = min(1.0, host_cores() / local_ranks)
    ctx = prediction_context(cluster, context, share)
    ctx.check_strategy(plan.strategy, plan.source)
    if os.environ.get("RANK") == "0":
        progress(f"running {plan.source} as a torchrun job of {os.environ.get('WORLD_SIZE')} ranks ...")
    results = run_in_job(plan, cluster, settings)
    speed = {"checked": False, "why": "a torchrun job does not time the profile's layer around the run"}
    return None if results is None else _recorded(plan, cluster, cluster_path, ctx, settings, results, share, speed)
