"""Elastic local runs: when ranks die, stop the survivors, re-plan for what is left, reshard the last checkpoint, go on.

The supervisor spawns one process per device (Gloo on loopback, as runtime.launch.run_plan) and waits on their
sentinels, so it learns of a death within milliseconds. A rank that ends by a signal (SIGKILL, the OOM killer, a
vanished node's process) is a lost device; a rank that raises is a failure of the run itself and is not retried.
Survivors are terminated at once (SIGTERM, SIGKILL after GRACE_S for a rank stuck in C++): blocked on the dead
rank, they cannot finish a step, and nothing in their memory is needed (the state comes from the checkpoint), so
nothing waits for Gloo's timeout. The cluster loses the dead ranks' devices (a group of one node shrinks by those
devices, a group of several nodes loses the whole node, as a scheduler would drain it), planner.replan plans the rest
warm-started from the old plan, and the new ranks load the latest complete checkpoint resharded to the new plan
(runtime/checkpoint.py). Each interruption is recorded: lost ranks and devices, time to detect, to stop the
survivors, to re-plan, to reload, the steps lost, and throughput before and after.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing.connection
import pickle
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from planner.plan import LoadedPlan
from predictor.predictor import Predictor

# the local spawner's pieces (stderr captured per rank, peers stopped with a grace): the supervisor differs from
# run_processes only in telling a rank killed by a signal from one that failed
from profiler.comm_bench import captured_rank, free_port, last_words, stop_processes
from profiler.profile import DeviceProfile
from runtime import checkpoint
from runtime.execute import RunJob, RunSettings, spawned_rank, tell_steps
from specs.cluster import ClusterSpec
from specs.errors import HetplanError, SpecError
from specs.layout import group_offsets


@dataclass(frozen=True)
class Lost:
    """Ranks that died by a signal, when the supervisor saw it, and how the survivors stopped."""

    ranks: tuple[int, ...]
    signals: dict[int, int]
    noticed_unix_s: float
    stopped_unix_s: float
    stopped_by_themselves: int  # survivors that had exited (their collectives with the dead rank failed) when seen
    terminated: int


def supervise(
    job: RunJob, world: int, deadline_s: float, what: str, meanwhile: Callable[[], None] | None = None
) -> Lost | None:
    """Run the job's ranks; None when every rank finishes, a Lost when some die by a signal; a HetplanError (one
    line) when a rank fails by itself or the deadline passes. `meanwhile()` is called about every second."""
    with tempfile.TemporaryDirectory(prefix="hetplan-logs-") as log_dir:
        context = mp.start_processes(
            captured_rank, args=(spawned_rank, log_dir, world, free_port(), job), nprocs=world, join=False,
            start_method="spawn",
        )  # fmt: skip
        processes = context.processes
        deadline = time.monotonic() + deadline_s
        try:
            while True:
                running = [p.sentinel for p in processes if p.exitcode is None]
                failed = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
                if failed:
                    return _stopped(processes, failed, _why(context, failed[0], log_dir), what)
                if not running:
                    return None
                if time.monotonic() > deadline:
                    raise HetplanError(f"{what} did not finish in {deadline_s:g} s")
                multiprocessing.connection.wait(running, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                if meanwhile is not None:
                    meanwhile()
        finally:
            stop_processes(processes)


def _why(context: Any, rank: int, log_dir: str) -> str:
    """A failed rank's last words: the last line of the exception torch's spawn wrapper pickled, else of its stderr."""
    path = Path(context.error_files[rank])
    if path.exists() and path.stat().st_size:
        with path.open("rb") as source:
            lines = [line for line in str(pickle.load(source)).splitlines() if line.strip()]
        return f" (rank {rank}: {lines[-1].strip()[:200]})" if lines else ""
    return last_words(log_dir, rank)


def _stopped(processes: list[Any], failed: list[int], why: str, what: str) -> Lost:
    noticed = time.time()
    lost = [i for i in failed if processes[i].exitcode < 0]
    if not lost:
        first = failed[0]
        raise HetplanError(f"{what} failed: rank {first} exited with status {processes[first].exitcode}{why}")
    alive = [p for p in processes if p.is_alive()]  # blocked on the dead rank: no step can finish without it
    stop_processes(processes)  # SIGTERM now, SIGKILL after GRACE_S for a rank stuck in C++
    survivors = len(processes) - len(lost)
    return Lost(
        tuple(lost), {i: -processes[i].exitcode for i in lost}, noticed, time.time(), survivors - len(alive), len(alive)
    )


def without_ranks(cluster: ClusterSpec, ranks: tuple[int, ...]) -> tuple[ClusterSpec, list[str]]:
    """The cluster without the devices of `ranks` (runtime rank order: groups in order, node-major), and what went:
    a group of one node loses those devices, a group of several nodes loses each node that had one."""
    offsets = group_offsets(cluster)
    gone: dict[str, set[int]] = {}
    for rank in ranks:
        group = next(g for g in cluster.groups if offsets[g.name] <= rank < offsets[g.name] + g.num_devices)
        gone.setdefault(group.name, set()).add(rank - offsets[group.name])
    groups, lost = [], []
    for group in cluster.groups:
        devices = gone.get(group.name, set())
        if not devices:
            groups.append(group)
        elif group.nodes == 1:
            lost.append(f"{group.name}: device {', '.join(map(str, sorted(devices)))} of its node")
            if group.devices_per_node > len(devices):
                groups.append(dataclasses.replace(group, devices_per_node=group.devices_per_node - len(devices)))
        else:
            nodes = {d // group.devices_per_node for d in devices}
            lost.append(f"{group.name}: node {', '.join(map(str, sorted(nodes)))}")
            if group.nodes > len(nodes):
                groups.append(group.with_nodes(group.nodes - len(nodes)))
    if not groups:
        raise HetplanError("every device of the cluster is lost: nothing to resume on")
    return dataclasses.replace(cluster, groups=tuple(groups)), lost


def _progress_lines(out_dir: Path) -> list[dict[str, Any]]:
    lines = []
    for path in sorted(out_dir.glob("progress-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        text = path.read_text(encoding="utf-8")
        for line in text[: text.rfind("\n") + 1].splitlines():  # a rank killed while writing leaves half a line
            lines.append({**json.loads(line), "rank": rank})
        path.unlink()
    return lines


def _throughput(global_batch: int, step_times: dict[int, float]) -> float | None:
    """Samples per second over the steps after the first of an attempt (its warm-up), or all when only one."""
    times = [step_times[s] for s in sorted(step_times)]
    kept = times[1:] if len(times) > 1 else times
    return global_batch * len(kept) / sum(kept) if kept and sum(kept) > 0 else None


@dataclass
class ElasticRun:
    """The last attempt's plan, cluster and every rank's results, and the interruptions on the way."""

    plan: LoadedPlan
    cluster: ClusterSpec
    results: list[dict[str, Any]]
    interruptions: list[dict[str, Any]]
    losses: dict[int, float]  # step -> loss over every attempt (the last word for a step re-run after a resume)


def run_elastic(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    settings: RunSettings,
    max_restarts: int,
    predictor: Predictor | None = None,
    out_dir: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
    profiles: Mapping[str, DeviceProfile] | None = None,
    steps_done: Callable[[int, int], None] | None = None,
) -> ElasticRun:
    """Train `plan` on local processes, checkpointing to settings.checkpoint_dir; after each lost device (at most
    `max_restarts` times) re-plan (with the plan's own costs: `predictor` and measured `profiles`) and resume from the
    latest complete checkpoint. `steps_done(done, steps)` is told every second how many steps the ranks finished."""
    from planner.replan import replan
    from runtime.launch import _job, check_runnable

    if not settings.checkpoint_dir or settings.checkpoint_every < 1:
        raise SpecError("--checkpoint-dir", "", "an elastic run needs a checkpoint directory and --checkpoint-every")
    interruptions: list[dict[str, Any]] = []
    losses: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="hetplan-elastic-") as scratch:
        out = Path(out_dir or scratch)
        out.mkdir(parents=True, exist_ok=True)
        current, where, now = plan, cluster, dataclasses.replace(settings, progress_dir=str(out))
        while True:
            check_runnable(current, where, now.dtype)
            job = _job(current, where, now, str(out))
            world = where.num_devices
            attempt_started = time.time()
            watch = (lambda: tell_steps(out, settings.steps, steps_done)) if steps_done else None
            lost = supervise(job, world, now.timeout_s * (now.steps + 3), f"hetplan run with {world} processes", watch)
            lines = _progress_lines(out)
            fresh: dict[int, float] = {}
            for line in lines:  # the loss of a step is the sum of the last stages' contributions
                fresh[line["step"] - 1] = fresh.get(line["step"] - 1, 0.0) + line["loss"]
            losses.update(fresh)
            if interruptions:
                interruptions[-1]["throughput_after_samples_per_s"] = _throughput(
                    job.global_batch, _step_times(lines)
                )  # fmt: skip
            if lost is None:
                results = json.loads((out / "results.json").read_text(encoding="utf-8"))
                if interruptions:
                    loads = [c for r in results for c in r.get("checkpoints", []) if "load_s" in c]
                    interruptions[-1]["reload_s"] = max(c["load_s"] for c in loads) if loads else None
                    interruptions[-1]["respawn_to_loaded_s"] = (
                        max(c["loaded_unix_time_s"] for c in loads) - attempt_started if loads else None
                    )
                return ElasticRun(current, where, results, interruptions, losses)
            if len(interruptions) >= max_restarts:
                raise HetplanError(f"rank(s) {', '.join(map(str, lost.ranks))} died and the run has used its "
                                   f"{max_restarts} restart(s)")  # fmt: skip
            died = out / "died.json"
            death = json.loads(died.read_text(encoding="utf-8")) if died.exists() else None
            died.unlink(missing_ok=True)
            last_seen = max((line["unix_time_s"] for line in lines), default=lost.noticed_unix_s)
            smaller, gone = without_ranks(where, lost.ranks)
            progress(f"lost rank(s) {', '.join(map(str, lost.ranks))} ({'; '.join(gone)}): re-planning ...")
            started = time.perf_counter()
            replanned = replan(smaller, current.model, current.training, current.strategy, predictor, profiles=profiles)
            replan_s = time.perf_counter() - started
            latest = _restart_point(now.checkpoint_dir, settings.resume_from)
            resumed_at = int(checkpoint.read_info(latest)["step"]) if latest else 0
            done = max((line["step"] for line in lines), default=resumed_at)
            interruptions.append(
                {
                    "lost_ranks": list(lost.ranks),
                    "lost_devices": gone,
                    "signals": {str(k): v for k, v in lost.signals.items()},
                    "died_at_step": death["step"] if death else None,
                    "detect_s": lost.noticed_unix_s - (death["time"] if death else last_seen),
                    "detect_from": "the injected death's time" if death else "the last step any rank finished",
                    "stop_survivors_s": lost.stopped_unix_s - lost.noticed_unix_s,
                    "survivors_stopped_by_themselves": lost.stopped_by_themselves,
                    "survivors_terminated": lost.terminated,
                    "replan_s": replan_s,
                    "replan_warm_started": replanned.plan.search_stats.get("warm_started", False),
                    "resumed_from_step": resumed_at,
                    "steps_lost": done - resumed_at,
                    "checkpoint": str(latest) if latest else None,
                    "devices_before": world,
                    "devices_after": smaller.num_devices,
                    "plan_after": _layout(replanned.plan.strategy),
                    "throughput_before_samples_per_s": _throughput(job.global_batch, _step_times(lines)),
                }
            )
            progress(
                f"re-planned for {smaller.num_devices} devices in {replan_s:.2f} s; resuming from step {resumed_at}"
            )
            source = f"{plan.source} re-planned without {'; '.join(gone)}"
            current = LoadedPlan(replanned.plan.strategy, current.model, current.training, source, current.cluster_name)
            where = smaller
            now = dataclasses.replace(now, resume_from=str(latest) if latest else "", fail_at=None)


def _restart_point(checkpoint_dir: str, resumed_from: str) -> Path | None:
    """The latest complete checkpoint the run saved; else the one it started from; else None (train from the
    seed's weights: a run that dies before its first checkpoint is committed, as a background save can be)."""
    found = checkpoint.complete_checkpoints(Path(checkpoint_dir)) if Path(checkpoint_dir).is_dir() else []
    if found:
        return found[-1]
    return Path(resumed_from) if resumed_from else None


def _step_times(lines: list[dict[str, Any]]) -> dict[int, float]:
    """Each step's time: the slowest rank's."""
    times: dict[int, float] = {}
    for line in lines:
        times[line["step"]] = max(times.get(line["step"], 0.0), line["time_s"])
    return times


def _layout(strategy: Any) -> str:
    from planner.plan import describe_strategy

    return describe_strategy(strategy)


def resumed_settings(settings: RunSettings, model: Any) -> RunSettings:
    """Settings that resume from settings.resume_from (resolved to the latest complete checkpoint and checked), with
    the checkpoint's seed: the data order and weights continue as they were."""
    if not settings.resume_from:
        return settings
    found, info = checkpoint.check_resume(settings.resume_from, model, settings.steps)
    return dataclasses.replace(settings, resume_from=str(found), seed=int(info["seed"]))


def execute_elastic(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    context: Callable[[ClusterSpec], Any],
    settings: RunSettings,
    max_restarts: int,
    predictor: Predictor | None = None,
    progress: Callable[[str], None] = print,
    profiles: Mapping[str, DeviceProfile] | None = None,
    steps_done: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """`hetplan run` with checkpoints and restarts: the run record of the last attempt (its cluster is what was left,
    its prediction for that cluster and plan) with `elastic`: every interruption and the loss of every step."""
    from runtime.launch import _recorded, cpu_share, prediction_context, with_speed_check

    ctx = prediction_context(cluster, context)
    ctx.check_strategy(plan.strategy, plan.source)
    settings = resumed_settings(settings, plan.model)
    progress(f"running {plan.source} on {cluster.num_devices} local processes for {settings.steps} steps, "
             f"checkpoints in {settings.checkpoint_dir} every {settings.checkpoint_every} ...")  # fmt: skip
    run, speed = with_speed_check(
        ctx,
        lambda: run_elastic(
            plan, cluster, settings, max_restarts, predictor, None, progress, profiles, steps_done=steps_done
        ),
    )
    share = cpu_share(run.cluster)
    record = _recorded(run.plan, run.cluster, cluster_path, prediction_context(run.cluster, context), settings,
                       run.results, share, speed)  # fmt: skip
    if run.interruptions:  # (the record's cluster is the one the run ended on: launch.cluster_mapping)
        record["name"] = f"{record['name']} (after {len(run.interruptions)} interruption(s))"
    saved = sorted({c["step"] for r in run.results for c in r.get("checkpoints", []) if "saved" in c})
    root = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
    # what is left to resume from: a save keeps the newest RunSettings.checkpoint_keep (the summary listed all)
    on_disk = [int(p.name.removeprefix("step-")) for p in checkpoint.complete_checkpoints(root)] if root else []
    record["elastic"] = {
        "checkpoint_dir": settings.checkpoint_dir,
        "checkpoint_every": settings.checkpoint_every,
        "checkpoint_async": settings.checkpoint_async,
        "write_s": max(
            (c["write_s"] for r in run.results for c in r.get("checkpoints", []) if "write_s" in c), default=None
        ),
        "resumed_from": settings.resume_from,
        "checkpoints_saved_last_attempt": saved,
        "checkpoints_on_disk": on_disk,
        "save_s": max(
            (c["save_s"] for r in run.results for c in r.get("checkpoints", []) if "save_s" in c), default=None
        ),
        "losses_by_step": [run.losses[s] for s in sorted(run.losses)],
        "first_step": min(run.losses, default=0),
        "interruptions": run.interruptions,
    }
    return record
