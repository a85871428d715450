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
from pathlib import Path
from typing import Any

import torch

from planner.plan import LoadedPlan, evaluation_dict
from predictor.cost_model import CostContext, evaluate
from predictor.runs import RUN_SCHEMA
from profiler.comm_bench import free_port, run_processes
from runtime.execute import TORCH_DTYPES, RunJob, RunSettings, spawned_rank, synthetic_batch
from runtime.model import ReferenceModel, check_tp
from specs.cluster import ClusterSpec
from specs.errors import SpecError
from specs.loading import read_mapping

MAX_LOCAL_RANKS = 16
REFERENCE_MAX_PARAMS = 200_000_000
# relative loss difference allowed between the run and one process (same weights and data, different sum orders)
LOSS_TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}


def run_plan(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    settings: RunSettings,
    out_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Spawn one local process per cluster device and train; returns every rank's result."""
    strategy = plan.strategy
    if strategy.virtual_stages != 1:
        raise SpecError(plan.source, "virtual_stages", "the runtime runs 1F1B; interleaved plans are not run yet")
    for stage in (s for pipeline in strategy.pipelines for s in pipeline.stages):
        check_tp(plan.model, stage.tp, plan.source)
    world = cluster.num_devices
    if world > MAX_LOCAL_RANKS:
        raise SpecError(
            cluster.source or "cluster",
            "devices",
            f"{world} devices: local runs spawn one process per device, at most {MAX_LOCAL_RANKS} (use torchrun)",
        )
    seq_length = plan.training.seq_length or plan.model.seq_length
    scratch = out_dir or tempfile.mkdtemp(prefix="hetplan-run-")
    job = RunJob(cluster, plan.model, strategy, plan.training.global_batch_size, seq_length, settings, scratch)
    run_processes(
        spawned_rank,
        (world, free_port(), job),
        world,
        settings.timeout_s * (settings.steps + 3),
        f"hetplan run with {world} processes",
    )
    results = []
    for rank in range(world):
        path = Path(scratch, f"rank-{rank}.json")
        if not path.exists():
            raise SpecError(plan.source, f"rank {rank}", "wrote no result")
        results.append(json.loads(path.read_text(encoding="utf-8")))
    return results


def summarize(results: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Iteration time per step = the slowest rank's; the measurement is the median after the first (warm-up) step."""
    active = [r for r in results if not r.get("idle")]
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
    per_stage = []
    for family, index in sorted(stages):
        entry = stages[family, index]
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
            }
        )
    return {
        "measured_iteration_time_s": statistics.median(measured_steps),
        "step_times_s": step_times,
        "losses": losses,
        "stages": per_stage,
        "memory_max_rss_bytes": {str(r["rank"]): r["max_rss_bytes"] for r in active},
        "idle_ranks": [r["rank"] for r in results if r.get("idle")],
    }


def reference_check(plan: LoadedPlan, settings: RunSettings, measured_loss: float) -> dict[str, Any]:
    """Step 0's loss of the whole model in this one process, on the same batch and weights."""
    model = plan.model
    if model.total_params() > REFERENCE_MAX_PARAMS:
        return {"checked": False, "why": f"the model has {model.total_params():,} parameters: too big for one process"}
    seq_length = plan.training.seq_length or model.seq_length
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
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


def run_record(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    ctx: CostContext,
    settings: RunSettings,
    summary: dict[str, Any],
    reference: dict[str, Any],
    cpu_share: float,
) -> dict[str, Any]:
    """A `hetplan.run/1` record; `ctx` is the prediction's context (its cluster already at the cores' share)."""
    evaluation = evaluate(ctx, plan.strategy)
    predicted = evaluation.iteration_time_s
    written = evaluation_dict(ctx, evaluation)
    layout = {key: written[key] for key in ("recompute", "zero_stage", "virtual_stages", "sequence_parallel")}
    layout["pipelines"] = [
        {key: p[key] for key in ("replicas", "micro_batch_size", "num_microbatches", "total_microbatches", "stages")}
        for p in written["pipelines"]
    ]
    emulated = {g.name: g.emulate_speed for g in cluster.groups if g.emulate_speed != 1.0}
    return {
        "schema": RUN_SCHEMA,
        "name": f"{Path(plan.source).stem} on {cluster.name}",
        "source": f"hetplan run on {platform.node()} ({platform.machine()}, {len(os.sched_getaffinity(0))} cores)",
        "cluster": read_mapping(Path(cluster_path)),
        "model": plan.model.model_dump(mode="json"),
        "training": plan.training.model_dump(mode="json"),
        "strategy": layout,
        "measured_iteration_time_s": summary["measured_iteration_time_s"],
        "cpu_share": cpu_share,
        "predicted_iteration_time_s": predicted,
        "losses": summary["losses"],
        "reference_match": reference,
        "measurements": {
            "steps": settings.steps,
            "seed": settings.seed,
            "dtype": settings.dtype,
            "step_times_s": summary["step_times_s"],
            "stages": summary["stages"],
            "memory_max_rss_bytes": summary["memory_max_rss_bytes"],
            "idle_ranks": summary["idle_ranks"],
            "prediction_from": ctx.predictor_identity,
            "prediction_error": summary["measured_iteration_time_s"] / predicted - 1.0,
            "emulated_groups": emulated,
            "emulation": "ranks of emulated groups repeat their stage's layer math until each pass takes 1/speed "
            "of its real time (no sleeping)"
            if emulated
            else "",
        },
    }


def cpu_share(cluster: ClusterSpec) -> float:
    """The share of a core each local rank gets when the ranks outnumber this machine's cores."""
    return min(1.0, len(os.sched_getaffinity(0)) / cluster.num_devices)


def execute(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    cluster_path: str,
    context: Callable[[ClusterSpec], CostContext],
    settings: RunSettings,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the plan locally and return its run record; `context(cluster)` makes the prediction's cost context, asked
    for the cluster as the local ranks see it (sharing the cores)."""
    share = cpu_share(cluster)
    ctx = context(cluster.sharing_cores(share))
    ctx.check_strategy(plan.strategy, plan.source)
    progress(f"running {plan.source} on {cluster.num_devices} local processes for {settings.steps} steps ...")
    results = run_plan(plan, cluster, settings)
    summary = summarize(results, settings.steps)
    reference = reference_check(plan, settings, summary["losses"][0])
    return run_record(plan, cluster, cluster_path, ctx, settings, summary, reference, share)
