"""hetplan's commands that measure, fit and run (profile, profile-comm, fit, validate, run, launch, comm-bench,
simulate-profile); cli.py registers them on its app beside the planning commands. Heavy imports are lazy."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from report import said

if TYPE_CHECKING:
    from planner.plan import LoadedPlan
    from predictor.runs import Run
    from runtime.execute import RunSettings

from report.cli_flags import (
    JsonOpt,
    MicroBatchesOpt,
    ModelOpt,
    PlanArg,
    PlanClusterOpt,
    PlanPredictorOpt,
    ProfileOutOpt,
    QuietOpt,
    RepeatsOpt,
    SeqLenOpt,
    TimeoutOpt,
    finite,
    opt,
    plan_costs_said,
    progress_on_stderr,
    require_torch,
    show,
    written,
)

# a profile whose slowest pass over the layers took this much longer than its fastest says so (on a shared host whose
# one-process speed read 1.12-1.89x a profile's within minutes, a tiny model's four passes read 0.78-1.10: 41%)
DRIFT_WARNING = 0.15


PROFILE_DTYPES = ("auto", "bf16", "fp16", "fp32")  # what `hetplan profile` times layers in
# `profile-comm --world` launches at most this many local processes per core (each loads torch; its runs with shared
# cores use two per core): a thousand on two cores held the load average above 100 and measured the scheduler
LOCAL_RANKS_PER_CORE = 4


# ---- measuring and fitting --------------------------------------------------------------------------------------
def profile(
    model: ModelOpt,
    out: ProfileOutOpt,
    device: Annotated[str, opt(help="auto, cpu, cuda:N (also ROCm), xpu:N or npu:N.")] = "auto",
    as_device: Annotated[Optional[str], opt(help="Catalog key the profile stands for (default: the device).")] = None,
    micro_batches: MicroBatchesOpt = "1,2,4,8",
    tp: Annotated[
        Optional[str],
        opt(help="TP degrees (the shard one rank computes) [default: those of 1,2,4 that split the model]."),
    ] = None,
    recompute: Annotated[str, opt(help="Recompute modes to time.")] = "none,selective,full",
    seq_len: SeqLenOpt = None,
    dtype: Annotated[str, opt(help="auto (fp32 on CPU, bf16 elsewhere), bf16, fp16 or fp32.")] = "auto",
    repeats: Annotated[int, opt(min=1, help="Timed runs per entry (at least).")] = 8,
    threads: Annotated[Optional[int], opt(min=1, help="CPU threads torch may use (default: torch's).")] = None,
    host: Annotated[
        bool,
        opt(
            "--host/--no-host",
            help="On the CPU, also measure the host's step costs besides the layers (processes computing at once, "
            "TP collectives between layers, optimizer step, stage and batch overheads), which local runs are predicted "
            "with; it launches processes to time them: 1-3 minutes on a 2-core machine.",
        ),
    ] = True,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure per-layer forward/backward time and activation memory on the local accelerator; Ctrl-C writes what
    was measured and exits 130."""
    from specs import flags
    from specs.model import RECOMPUTE_MODES, load_model

    flags.output_file(out, "--out", reads={"--model": model}, writes="a device profile")
    sizes = flags.int_list(micro_batches, "--micro-batches")
    modes = flags.choices(recompute, RECOMPUTE_MODES, "--recompute")
    flags.choice(dtype, PROFILE_DTYPES, "--dtype")  # fp8 runs in Transformer Engine's GEMMs, which this does not time
    model_spec = load_model(model, "--model")
    degrees = flags.tp_degrees(tp, model_spec, (1, 2, 4))
    require_torch("profile")
    from profiler.measure import check_layer_fits_host, pass_drift, profile_model, profile_target

    torch_device, chosen_dtype, key = profile_target(device, dtype, as_device, threads)
    training_spec = flags.training(None, dtype=chosen_dtype, seq_length=seq_len)
    if torch_device.type == "cpu":
        least = next(mode for mode in RECOMPUTE_MODES if mode in modes)  # none, selective, full: most memory first
        check_layer_fits_host(
            model_spec, seq_len or model_spec.seq_length, chosen_dtype, max(sizes), min(degrees), least
        )
    with progress_on_stderr("profile", quiet, unit="timings") as progress:
        shape = {"seq_length": seq_len or model_spec.seq_length, "micro_batch_sizes": sizes, "tp_degrees": degrees}
        measure = {"device": torch_device, "device_key": key, "dtype": training_spec.dtype, "repeats": repeats}
        result = profile_model(model_spec, recompute_modes=modes, progress=progress, **shape, **measure)  # type: ignore[arg-type]
        if host and torch_device.type == "cpu" and not result.environment.get("interrupted"):
            from profiler.host import measure_host
            from profiler.measure import TORCH_DTYPES

            try:
                result.host = measure_host(  # the bar counts its parts now (the layers' timings are done)
                    model_spec, result.seq_length, TORCH_DTYPES[result.dtype], min(sizes or [1]), progress
                )
            except KeyboardInterrupt:  # the layers are measured: keep them, without the host section
                result.environment["interrupted"] = True
    result.save(out)
    drift = pass_drift(result.environment.get("pass_speeds", []))
    if drift > DRIFT_WARNING and not quiet:
        print(
            f"note: the slowest pass over the layers took {drift:.0%} longer than the fastest: the machine's speed "
            "moved while it was profiled (a shared or busy host); each entry keeps its median over the passes, and "
            "a profile made on a quiet machine gives costs to trust closer than that",
            file=sys.stderr,
        )
    interrupted = bool(result.environment.get("interrupted"))
    skipped = sum(not entry.fits for entry in result.entries)
    body = {"out": str(out), "entries": len(result.entries), "did_not_fit": skipped, "interrupted": interrupted,
            "pass_drift": round(drift, 3)}  # fmt: skip
    note = " (interrupted: partial profile)" if interrupted else ""
    show(as_json, body, f"{len(result.entries)} entries ({skipped} did not fit) written to {out}{note}")
    if interrupted:
        raise KeyboardInterrupt  # what was measured is written; the exit status still says it was cut short


def check_fits(profile: dict, flag: str, given: str, example: str) -> None:
    """A link profile that `fit`, `plan --profiles` and `run` would refuse is not written: say why, now, naming the
    flag whose `given` value chose the sizes and an `example` that measures larger ones."""
    from predictor.link_model import fit_link, link_points
    from specs.errors import SpecError

    try:
        _, link_class, points = link_points(profile, "the link profile")
        fit_link(link_class, points, "the link profile")
    except SpecError as err:
        raise SpecError(flag, "", f"{given}: {err.expectation}, e.g. {example} (nothing was written)") from None


def profile_comm(
    out: Annotated[Path, opt(help="Link profile JSON to write.")],
    world: Annotated[str, opt(help="Local process counts to launch, e.g. 2,4.")] = "2,4",
    min_size: Annotated[str, opt(help="Smallest message.")] = "4KiB",
    max_size: Annotated[str, opt(help="Largest message (sizes step by 4x, at most 16GiB).")] = "256MiB",
    ops: Annotated[str, opt(help="Collectives.")] = "all_reduce,all_gather,reduce_scatter,send_recv",
    repeats: RepeatsOpt = 3,
    link_class: Annotated[
        str,
        opt(
            help="What the processes share: in_node, rail, cross_group, or host (every link between processes of "
            "this machine: what local runs use). auto: host for local processes, in_node under torchrun."
        ),
    ] = "auto",
    gap_ms: Annotated[
        float,
        opt(
            callback=finite(0.0, inclusive=True),
            help="Computing between operations, ms (as layers between TP collectives: no barrier lines the ranks up).",
        ),
    ] = 1.0,
    shared_cores: Annotated[
        bool,
        opt(
            "--shared-cores/--no-shared-cores",
            help="Local processes: also measure with background processes computing beside the ranks, two "
            "processes per core, as runs with more ranks than cores share them.",
        ),
    ] = True,
    timeout_s: TimeoutOpt = 120.0,
    as_device: Annotated[str, opt(help="Catalog key of the devices measured.")] = "cpu",
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Time real collectives (local processes, Gloo over loopback; under torchrun, this process is one rank of the
    job and --world is ignored) and fit alpha-beta per collective and group size, nccl-tests style."""
    import tempfile

    from report.files import write_json
    from report.measurements import link_profile_tables
    from specs import flags
    from specs.device import get_device

    flags.output_file(out, "--out", writes="a link profile")
    flags.choice(link_class, ("auto", "in_node", "rail", "cross_group", "host"), "--link-class")
    from profiler.machine import host_cores

    sizes = flags.message_sizes(min_size, max_size)
    most = LOCAL_RANKS_PER_CORE * host_cores()
    why = f"; at most {LOCAL_RANKS_PER_CORE} local processes per core: more time the scheduler, not the links"
    worlds = flags.int_list(world, "--world", 2, "process counts", high=most, why=why) or []
    device_key = get_device(as_device, "--as-device", "").key
    require_torch("profile-comm")
    from profiler.comm_bench import COLLECTIVES, link_profile, run_in_job, run_local
    from profiler.machine import launched_by_torchrun, quiet_torchrun_rank

    chosen = flags.choices(ops, COLLECTIVES, "--ops")
    gap_s = gap_ms / 1000
    points = []
    under_torchrun = launched_by_torchrun()
    quiet = quiet or quiet_torchrun_rank()
    if link_class == "auto":
        link_class = "in_node" if under_torchrun else "host"
    with progress_on_stderr("profile-comm", quiet, unit="process counts") as progress:
        if under_torchrun:  # one rank of a real job: measure the job's own links; rank 0 reports
            rank, points = run_in_job(sizes, chosen, repeats, timeout_s, gap_s=gap_s)
            if rank != 0:
                said.drop()
                return
        else:
            cores = host_cores()
            loads = [(ranks, 0) for ranks in worlds]
            if shared_cores:  # the same with every core running two processes (where the ranks alone do not)
                loads += [(ranks, 2 * cores - ranks) for ranks in worlds if ranks < 2 * cores]
            with tempfile.TemporaryDirectory() as scratch:
                for index, (ranks, busy) in enumerate(loads):
                    progress.update(index, len(loads), f"({ranks} processes, {busy} computing beside them)")
                    points += run_local(ranks, sizes, chosen, repeats, Path(scratch), timeout_s, gap_s, busy)
    profile = link_profile(points, link_class, "gloo", device_key, gap_s)
    check_fits(profile, "--max-size", max_size, "--max-size 16MiB")
    write_json(out, profile)
    show(as_json, profile, *link_profile_tables(profile, link_class), *written("link profile", out))


def fit(
    out: Annotated[Path, opt(help="Write the predictor (joblib) here.")],
    profiles: Annotated[
        Optional[Path], opt(help="Directory of profile JSON files (any devices; link profiles in it are fitted too).")
    ] = None,
    links: Annotated[Optional[list[Path]], opt(help="Link profile from `hetplan profile-comm` (repeat).")] = None,
    runs: Annotated[Optional[list[Path]], opt(help="Run record(s) of measured iterations (repeat).")] = None,
    published_runs: Annotated[bool, opt("--published-runs/--no-published-runs", help="Also the bundled run.")] = True,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Fit a predictor: layer models from profiles, links from link profiles, calibration from runs."""
    from predictor.predictor import calibration_runs, fit_predictor, save_predictor
    from predictor.validation import validation_report
    from profiler.profiles import checked_profile_files, link_profile_files
    from report.measurements import fit_renderables, validation_renderables
    from specs.errors import SpecError
    from specs.flags import output_file

    output_file(
        out, "--out", reads={"--profiles": profiles, "--links": links or [], "--runs": runs or []}, writes="a predictor"
    )
    if out.suffix.lower() in (".json", ".yaml", ".yml"):  # a joblib file named as a document every reader refuses
        raise SpecError("--out", str(out), "expected a predictor file name such as predictor.joblib (fit writes "
                        f"joblib, not {out.suffix.lower()[1:].upper()})")  # fmt: skip
    if profiles is None and not links and not runs and not published_runs:  # it wrote a predictor of nothing
        raise SpecError("--no-published-runs", "", "leaves nothing to fit: give --profiles, --links or --runs (or "
                        "keep the published runs)")  # fmt: skip
    with progress_on_stderr("fit", quiet, unit="steps") as progress:
        progress.step("checking the profiles", 2)
        paths = checked_profile_files(profiles) if profiles is not None else []
        link_paths = [*(links or []), *(link_profile_files(profiles) if profiles is not None else [])]
        progress.step("fitting", 3)
        fitted = fit_predictor(paths, link_paths, runs or [], published_runs=published_runs, name=out.name)
        progress.step("leaving one source out at a time", 3)
        body = fitted.describe()
        fitted_runs = calibration_runs(runs or [], published_runs)
        body["validation"] = validation_report(fitted, fitted_runs, held_out=True)
    save_predictor(fitted, out)
    body["notes"] = slow_machine_notes(fitted_runs)
    renderables = validation_renderables(body["validation"]) if body["validation"]["runs"] else []
    show(as_json, body, *fit_renderables(body), *renderables, *body["notes"], *written("predictor", out))


SLOW_MACHINE = 1.15  # a run whose machine ran its profiled layer this much slower than profiled is named by `fit`


def slow_machine_notes(runs: Sequence[Run]) -> list[str]:
    """One line per run measured on a machine markedly slower than when its profile was taken (its record's
    machine_slowdown): calibration learns that time as it is, so the user should know which runs carry it."""
    return [
        f"note: run {run.name!r} ({run.path}) ran on a machine {run.machine_slowdown:.2f}x slower than when profiled "
        "(its record's machine_slowdown): calibration learns its time as measured; rerun it on a quiet machine or "
        "leave it out"
        for run in runs
        if run.machine_slowdown >= SLOW_MACHINE
    ]


def validate(
    runs: Annotated[list[Path], typer.Argument(help="Run records (hetplan.run/1, runs/1, or calibration-runs/1).")],
    predictor: Annotated[
        Optional[Path],
        opt("--predictor", help="Predictor file from `hetplan fit` (default: the one the records name, else shipped)."),
    ] = None,
    profiles: Annotated[
        Optional[Path],
        opt("--profiles", help="Directory of profile JSON files (default: the ones the records name, if any)."),
    ] = None,
    held_out: Annotated[
        bool, opt("--leave-one-source-out", help="Also refit without each source and predict its runs.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Predict measured runs: per run the prediction, the signed error and the term that dominates its time; the
    error per device family; the worst runs. Runs `hetplan run` recorded are predicted from the costs it used."""
    from planner.cost_source import run_costs
    from predictor.runs import check_runs_once, load_runs
    from predictor.validation import validation_report
    from report.measurements import validation_renderables

    loaded = [run for path in runs for run in load_runs(path)]
    check_runs_once(loaded)
    costs = run_costs(loaded, predictor, profiles)
    body = validation_report(costs.predictor, loaded, held_out, costs.profiles)
    body["costs"] = list(costs.lines)
    show(as_json, body, *costs.lines, *validation_renderables(body))


def _run_settings(
    loaded: LoadedPlan,
    steps: int,
    seed: int,
    timeout: float,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    async_save: bool,
    resume: Path | None,
    max_restarts: int,
    inject_failure: str | None,
    under_torchrun: bool,
    world: int,
) -> RunSettings:
    """`hetplan run`'s flags as the runtime's settings, each combination it cannot honour refused in one line; a
    checkpoint to resume that cannot be resumed is refused before anything else is said or started."""
    from runtime.execute import RunSettings
    from specs.errors import SpecError

    failure = None
    if inject_failure is not None:
        rank_text, _, step_text = inject_failure.partition(":")
        if not (rank_text.isdigit() and step_text.isdigit() and int(step_text) >= 1):
            raise SpecError("--inject-failure", inject_failure, "expected RANK:STEP (steps counted from 1), e.g. 3:4")
        failure = (int(rank_text), int(step_text) - 1)  # the runtime counts steps from 0
        if failure[0] >= world or failure[1] >= steps:  # a failure that never happens would test nothing
            raise SpecError("--inject-failure", inject_failure, f"expected a rank below {world} (the cluster's "
                            f"devices) and a step up to --steps, {steps}")  # fmt: skip
    if checkpoint_every and checkpoint_dir is None:
        raise SpecError("--checkpoint-every", str(checkpoint_every), "saves need --checkpoint-dir")
    if (max_restarts or failure) and checkpoint_dir is None:
        flag = "--max-restarts" if max_restarts else "--inject-failure"
        raise SpecError(flag, "", "a run that survives failures needs --checkpoint-dir to resume from (and "
                        "--max-restarts N to restart within the run; else it stops, and --resume goes on)")  # fmt: skip
    if max_restarts and under_torchrun:
        raise SpecError("--max-restarts", "", "re-planning restarts are for local runs; under torchrun checkpoint "
                        "with --checkpoint-dir and restart the job with --resume on the devices left")  # fmt: skip
    if checkpoint_dir is not None:  # a file in its place failed the first save, after the processes had started
        from specs import flags

        flags.output_directory(checkpoint_dir, "--checkpoint-dir", "step")
    settings = RunSettings(
        steps=steps, seed=seed, dtype=loaded.training.dtype, timeout_s=timeout,
        checkpoint_dir=str(checkpoint_dir or ""), checkpoint_every=checkpoint_every or steps,
        checkpoint_async=async_save, resume_from=str(resume or ""), fail_at=failure,
    )  # fmt: skip
    if resume:  # a checkpoint that cannot be resumed is refused before anything else is said or started
        from runtime.elastic import resumed_settings

        settings = resumed_settings(settings, loaded.model)
    return settings


def run(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    out: Annotated[Path, opt(help="Run record to write (hetplan.run/1; `hetplan fit --runs` reads it).")],
    steps: Annotated[int, opt(min=1, help="Training steps (the first is a warm-up).")] = 5,
    seed: Annotated[int, opt(help="Seed of the weights and the synthetic tokens.")] = 0,
    profiles: Annotated[
        Optional[Path], opt(help="Predict from these profiles, uncalibrated (default: the ones the plan records).")
    ] = None,
    predictor: PlanPredictorOpt = None,
    timeout: TimeoutOpt = 120.0,
    checkpoint_dir: Annotated[
        Optional[Path], opt("--checkpoint-dir", help="Save the training state here (DCP; any plan can load it).")
    ] = None,
    checkpoint_every: Annotated[
        int, opt("--checkpoint-every", min=0, help="Save every N steps (and after the last; 0: only the last).")
    ] = 0,
    async_save: Annotated[
        bool, opt("--async-save", help="Write checkpoints in the background (DCP async_save); committed when done.")
    ] = False,
    resume: Annotated[
        Optional[Path],
        opt("--resume", help="Continue from this checkpoint, or the latest complete one under this directory."),
    ] = None,
    max_restarts: Annotated[
        int,
        opt("--max-restarts", min=0, help="Local runs: when ranks die, re-plan for the rest and resume (this often)."),
    ] = 0,
    inject_failure: Annotated[
        Optional[str],
        opt("--inject-failure", help="Testing: RANK:STEP, that rank kills itself as step STEP (from 1) begins."),
    ] = None,
    dtype: Annotated[
        Optional[str],
        opt("--dtype", help="Train the plan's layout in this precision (fp32, bf16, fp16) instead of its training's."),
    ] = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Train a plan for a few steps on local processes (one per device, Gloo), or as the ranks of a torchrun job
    (`hetplan launch` writes the commands), and write the measurement beside the prediction, the loss curve and a
    single-process loss check. With --checkpoint-dir the state is saved as it trains; with --max-restarts a local
    run survives lost ranks (re-plan, reshard the last checkpoint, continue) and its record says what it cost."""
    from planner.what_if import check_local_run, check_runtime_layout, plan_on_cluster, run_context
    from specs.flags import output_file

    output_file(out, "--out", reads={"PLAN": plan_file, "--cluster": cluster}, writes="a run record")
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    if dtype is not None:
        from dataclasses import replace

        from specs import flags

        loaded = replace(loaded, training=flags.training(None, **{**loaded.training.model_dump(), "dtype": dtype}))
    check_local_run(cluster_spec, cluster)
    check_runtime_layout(loaded)
    require_torch("run")
    from profiler.machine import launched_by_torchrun, quiet_torchrun_rank
    from report.files import write_json
    from report.measurements import run_lines, run_table, run_terms_table
    from runtime.launch import check_dtype, execute, execute_in_job

    if dtype is not None:  # the flag named as what was given (the plan's training may say fp32)
        check_dtype(dtype, "--dtype", "")
    check_dtype(loaded.training.dtype, loaded.source)  # before the costs line: a refusal is the only line

    under_torchrun = launched_by_torchrun()
    quiet = quiet or quiet_torchrun_rank()
    settings = _run_settings(
        loaded, steps, seed, timeout, checkpoint_dir, checkpoint_every, async_save, resume, max_restarts,
        inject_failure, under_torchrun, cluster_spec.num_devices,
    )  # fmt: skip
    costs = plan_costs_said(loaded, predictor, profiles, cluster_spec)
    predictor_object = costs.predictor
    context = run_context(loaded, predictor_object, costs.profiles)
    # under torchrun: this process is one rank, rank 0 writes
    with progress_on_stderr("run", quiet, unit="" if under_torchrun else "steps") as progress:
        if checkpoint_dir and not under_torchrun:
            from runtime.elastic import execute_elastic

            record = execute_elastic(loaded, cluster_spec, str(cluster), context, settings, max_restarts,
                                     predictor_object, progress=progress.say, profiles=costs.profiles,
                                     steps_done=progress)  # fmt: skip
        elif under_torchrun:
            record = execute_in_job(loaded, cluster_spec, str(cluster), context, settings, progress=progress.say)
        else:
            record = execute(loaded, cluster_spec, str(cluster), context, settings, progress.say, steps_done=progress)
    if record is None:  # a torchrun rank other than 0
        said.drop()
        return
    from report.elastic import elastic_lines

    write_json(out, record)
    terms = [table for table in [run_terms_table(record)] if table is not None]
    lines = [*run_lines(record), *elastic_lines(record)]
    show(as_json, record, run_table(record), *terms, *lines, *written("run record", out))


def launch(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    out: Annotated[Path, opt(help="Run record the job writes (on the first node).")] = Path("run.json"),
    master_addr: Annotated[str, opt(help="Address of the first node.")] = "$MASTER_ADDR",
    port: Annotated[int, opt(min=1, max=65535, help="Rendezvous port.")] = 29500,
    steps: Annotated[Optional[int], opt(min=1, help="Training steps of the run (default: run's, 5).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the torchrun command of every node that runs the plan with `hetplan run` (one line per node)."""
    from planner.export import launch_commands, runtime_launches
    from planner.what_if import check_runtime_layout, plan_on_cluster
    from specs.errors import SpecError
    from specs.flags import output_file
    from specs.outputs import remove_created_directories

    output_file(out, "--out", reads={"PLAN": plan_file, "--cluster": cluster}, writes="a run record")  # as `run`
    remove_created_directories()  # the job writes the record, and makes its directory; launch writes nothing
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    check_runtime_layout(loaded)
    if loaded.training.dtype == "fp8":  # the ranks would refuse it (runtime.launch.check_dtype): say so before
        raise SpecError(
            str(plan_file), "training.dtype", "hetplan's runtime has no FP8 GEMMs: plan with --dtype bf16 to launch it "
            "here, or export the fp8 plan to Megatron or torchtitan (hetplan export)",
        )  # fmt: skip
    # absolute paths: each node runs its line from wherever its shell is (a shared filesystem at the same place);
    # normalised (it printed /tmp/x/c/../my/plan.json), links left as the user named them
    paths = [os.path.abspath(path) for path in (plan_file, cluster, out)]
    extra = ["--steps", str(steps)] if steps is not None else []
    commands = launch_commands(paths[0], cluster_spec, paths[1], paths[2], master_addr, port, extra)
    if as_json:
        nodes = [
            {"group": launch.group, "node": launch.node, "node_rank": launch.node_rank, "devices": list(launch.devices),
             "command": command}
            for launch, command in zip(runtime_launches(cluster_spec), commands, strict=True)
        ]  # fmt: skip
        show(True, {"plan": paths[0], "cluster": paths[1], "record": paths[2], "nodes": nodes})
        return
    for launch, line in zip(runtime_launches(cluster_spec), commands, strict=True):  # where each runs, as a comment
        sys.stdout.write(f"{line}  # {launch.group} node {launch.node}\n")


# ---- communicator and simulated profiles -------------------------------------------------------------------------
def comm_bench(
    world: Annotated[int, opt(min=2, max=256, help="Local processes to launch.")] = 4,
    islands: Annotated[str, opt(help="Island (vendor) of each rank.")] = "nvidia,nvidia,amd,amd",
    sizes: Annotated[str, opt(help="Message sizes, e.g. 4KiB,1MiB,16MiB.")] = "4KiB,64KiB,1MiB,16MiB",
    repeats: RepeatsOpt = 5,
    timeout_s: TimeoutOpt = 60.0,
    links_out: Annotated[Optional[Path], opt(help="Write the bridged path as a link profile (`fit --links`).")] = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """All-reduce over simulated vendor islands: direct vs bridged vs hierarchical, checked and timed."""
    from specs import flags

    flags.output_file(links_out, "--links-out", writes="a link profile")
    size_list = [flags.size_bytes(part, "--sizes") for part in flags.names(sizes) or [""]]
    require_torch("comm-bench")
    from comm.bench import check_islands, links_from_bench, run_comm_bench
    from report.files import write_json
    from report.measurements import comm_bench_table
    from specs.errors import SpecError

    names = check_islands(flags.names(islands), world)
    with progress_on_stderr("comm-bench", quiet, unit="points") as progress:
        result = run_comm_bench(names, size_list, repeats, timeout_s, progress=progress)
    refused = None  # a link profile `fit` would refuse is not written: said after the measurements are shown
    if links_out is not None:
        links = links_from_bench(result)
        try:
            check_fits(links, "--sizes", sizes, "--sizes 4KiB,1MiB,16MiB")
        except SpecError as error:
            refused = error
        else:
            write_json(links_out, links)
    show(as_json, result, comm_bench_table(result, names), *written("link profile", links_out if not refused else None))
    if refused is not None:
        raise refused


def simulate_profile(
    device: Annotated[str, opt(help="Catalog device key.")],
    model: ModelOpt,
    out: ProfileOutOpt,
    micro_batches: MicroBatchesOpt = "1,2,4,8",
    tp: Annotated[
        Optional[str],
        opt(help="TP degrees (the shard one rank computes) [default: those of 1,2,4,8 that split the model]."),
    ] = None,
    seq_len: SeqLenOpt = None,
    dtype: Annotated[
        Optional[str],
        opt(
            help="bf16, fp16, fp32 or fp8 (bf16 without FP8) [default: plan's on the device: fp32 on cpu, fp16 "
            "without bf16, else bf16]."
        ),
    ] = None,
    noise: Annotated[float, opt(callback=finite(0.0, inclusive=True), help="Log-normal sigma of noise.")] = 0.0,
    seed: Annotated[int, opt(help="Noise seed.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Write a simulated device profile (datasheet roofline) in the profile JSON format."""
    from profiler.simulated import SimulatedDevice
    from report import said
    from specs import flags
    from specs.device import get_device
    from specs.errors import SpecError
    from specs.model import load_model

    flags.output_file(out, "--out", reads={"--model": model}, writes="a device profile")
    sizes = flags.int_list(micro_batches, "--micro-batches") or []
    model_spec = load_model(model, "--model")
    spec = get_device(device, "--device", "")
    if dtype is None:  # as `plan` trains on the device (specs.training.on_devices), so its profile is taken
        dtype = "fp32" if spec.key == "cpu" else "bf16" if spec.supports_bf16 else "fp16"
    training_spec = flags.training(None, dtype=dtype, seq_length=seq_len)
    runs = spec.runs_dtype(training_spec.dtype)  # the profile `plan` asks for: fp8 training runs bf16 without FP8
    lacks = spec.lacks_dtype(training_spec.dtype)
    if lacks:  # `plan` refuses that dtype there: a profile of it would be unused
        first, *rest = spec.trains_dtypes(training_spec.dtype)
        raise SpecError(
            "--dtype", dtype, f"{lacks}: profile it in {first}" + (f" (or {' or '.join(rest)})" if rest else "")
        )
    if runs != training_spec.dtype:
        said.say(f"note: {spec.key} has no FP8: the profile is in {runs}, as fp8 training runs there")
    degrees = flags.tp_degrees(tp, model_spec, (1, 2, 4, 8))  # as `hetplan profile` takes them
    seq_length = training_spec.seq_length or model_spec.seq_length
    simulated = SimulatedDevice(spec, model_spec, seq_length, runs, noise=noise, seed=seed)
    profile = simulated.to_profile(tuple(sizes), tuple(degrees))
    profile.save(out)
    show(
        as_json, {"out": str(out), "entries": len(profile.entries)}, f"{len(profile.entries)} entries written to {out}"
    )
