"""hetplan command line: parses flags, calls the Python API (planner/, report/, ...), prints tables or JSON.

Heavy imports are lazy (inside the commands) so that `hetplan --help` and `import cli` stay fast. Flags are checked
by specs/flags.py and outputs before any work starts; every failure a user can cause ends as one line on stderr and
exit 2 (see `main`); long commands report progress on stderr (report/progress.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from planner.cost_source import PlanCosts
    from planner.plan import LoadedPlan
    from predictor.predictor import Predictor
    from report.progress import Progress
    from specs.cluster import ClusterSpec
    from specs.training import TrainingSpec

app = typer.Typer(
    name="hetplan",
    help="Plan large-model training on clusters that mix accelerator types and vendors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# ---- flags ------------------------------------------------------------------------------------------------------
def _finite(low: float = 0.0, inclusive: bool = False) -> Callable[..., float | None]:
    """A float flag's callback: finite and above `low` (typer's own `min` lets inf and nan through)."""

    def check(param: typer.CallbackParam, value: float | None) -> float | None:
        from specs.flags import finite

        return finite(value, param.opts[0] if param.opts else str(param.name), low, inclusive)

    return check


def _opt(*names: str, help: str, **kwargs: Any) -> Any:
    """typer.Option with the help text required (every flag says what it means in --help)."""
    return typer.Option(*names, help=help, **kwargs)


ClusterOpt = Annotated[Path, _opt("--cluster", "-c", help="Cluster YAML/JSON file.")]
ModelOpt = Annotated[str, _opt("--model", "-m", help="Catalog name, model YAML/JSON, or HF config.json.")]
TrainingOpt = Annotated[Optional[Path], _opt("--training", help="Training YAML/JSON file (flags override).")]
GlobalBatchOpt = Annotated[Optional[int], _opt("--global-batch", min=1, help="Sequences per iteration.")]
SeqLenOpt = Annotated[Optional[int], _opt("--seq-len", min=1, help="Sequence length (default: the model's).")]
DtypeOpt = Annotated[Optional[str], _opt("--dtype", help="bf16, fp16, fp32, or fp8 (where devices have it).")]
ENGINES = "megatron, flagscale, deepspeed, torchtitan, torchrun"  # specs/catalog/engines.yaml, listed in the help
ZERO = "0, 1 (distributed optimizer), 2 (gradients sharded too) or 3 (FSDP: weights too)."
ZeroOpt = Annotated[Optional[int], _opt("--zero-stage", help=ZERO)]
JsonOpt = Annotated[bool, _opt("--json", help="Print JSON instead of tables.")]
QuietOpt = Annotated[bool, _opt("--quiet", "-q", help="No progress lines on stderr.")]
PredictorOpt = Annotated[
    Optional[Path], _opt("--predictor", help="Predictor file from `hetplan fit` (default: shipped).")
]
ProfilesOpt = Annotated[Optional[Path], _opt("--profiles", help="Directory of profile JSON files (by device).")]
PlanPredictorOpt = Annotated[
    Optional[Path], _opt("--predictor", help="Predictor file from `hetplan fit` (default: the one the plan records).")
]
PlanProfilesOpt = Annotated[
    Optional[Path], _opt("--profiles", help="Directory of profile JSON files (default: the ones the plan records).")
]
PlanArg = Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")]
PlanClusterOpt = Annotated[Path, _opt("--cluster", "-c", help="Cluster file the plan was made for.")]
MicroBatchesOpt = Annotated[str, _opt("--micro-batches", help="Micro-batch sizes, e.g. 1,2,4,8.")]
TpListOpt = Annotated[str, _opt("--tp", help="TP degrees (the shard one rank computes).")]
TimeoutOpt = Annotated[float, _opt("--timeout", callback=_finite(), help="Seconds any one operation may take.")]
RepeatsOpt = Annotated[int, _opt("--repeats", min=1, help="Timed runs per point.")]
PlanOutOpt = Annotated[Optional[Path], _opt("--out", help="Write the plan JSON here.")]
ProfileOutOpt = Annotated[Path, _opt("--out", help="Profile JSON to write.")]
PngOpt = Annotated[Optional[Path], _opt("--png", help="Write the picture here (.png).")]
CHOICES = "Replica counts that do not divide the batch: off (default), refine, or exhaustive (slower)."
UnevenOpt = Annotated[Optional[str], _opt("--uneven-batch", help=CHOICES)]
FAMILIES = "Pipeline families of different device mixes: auto (default: clusters of two groups), search or off."
FamiliesOpt = Annotated[Optional[str], _opt("--families", help=FAMILIES)]
LOWER = "Also bound how fast any plan of the search space could be (the gap; about a second search)."
LowerBoundOpt = Annotated[bool, _opt("--lower-bound", help=LOWER)]
SequenceParallelOpt = Annotated[bool, _opt("--sequence-parallel/--no-sequence-parallel", help="Megatron's SP.")]
MEGATRON_FLAGS = ("group", "tp", "pp", "dp", "micro_batch_size", "recompute", "virtual_stages", "sequence_parallel")


def _predictor(path: Path | None) -> Predictor:
    """The predictor from `hetplan fit`, or the shipped one."""
    from predictor.predictor import default_predictor, load_predictor

    return load_predictor(path) if path is not None else default_predictor()


def _plan_costs(loaded: LoadedPlan, predictor: Path | None, profiles: Path | None, model: Any = None) -> PlanCosts:
    """The costs to evaluate a saved plan with (the ones it records unless a flag names others), said on stderr in
    one line, plus a line per recorded file that changed since the plan was made."""
    from planner.cost_source import plan_costs

    costs = plan_costs(loaded, predictor, profiles, model)
    for line in costs.lines:
        sys.stderr.write(line + "\n")
    return costs


def _on_cluster(training: TrainingSpec, cluster: ClusterSpec) -> TrainingSpec:
    """The training on this cluster: fp32 on CPU devices unless a dtype was chosen (a note on stderr says so)."""
    from specs.training import on_devices

    chosen, note = on_devices(training, {group.device.vendor for group in cluster.groups})
    if note:
        sys.stderr.write(note + "\n")
    return chosen


def _require_torch(command: str) -> None:
    """Commands that measure need torch: say so in one line when it is missing."""
    from specs.errors import TorchMissingError

    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissingError(f"`hetplan {command}`") from None


# ---- printing ---------------------------------------------------------------------------------------------------
def _show(as_json: bool, body: Any, *renderables: Any) -> None:
    """What a command found: its JSON body (indented, alone on stdout) with --json, else its tables and lines (rich
    markup) at least 100 columns wide (readable when piped)."""
    from rich.console import Console

    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    console = Console(width=max(100, Console().width))
    for renderable in renderables:
        console.print(renderable)


def _written(what: str, path: Path | None) -> list[str]:
    """'<what> written to <path>' when a file was asked for."""
    return [] if path is None else [f"{what} written to {path}"]


def _progress(task: str, quiet: bool, unit: str = "") -> Progress:
    """Progress of a long command on stderr (see report.progress)."""
    from report.progress import Progress

    return Progress(task, quiet=quiet, unit=unit)


# ---- planning ---------------------------------------------------------------------------------------------------
@app.command()
def plan(
    cluster: ClusterOpt,
    model: ModelOpt,
    training: TrainingOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    dtype: DtypeOpt = None,
    zero_stage: ZeroOpt = None,
    recompute: Annotated[Optional[str], _opt(help="Allowed modes, e.g. none,selective,full.")] = None,
    micro_batch_sizes: Annotated[Optional[str], _opt(help="Candidates, e.g. 1,2,4,8.")] = None,
    virtual_stages: Annotated[Optional[str], _opt(help="Interleaving chunks to try, e.g. 1,2,4.")] = None,
    uneven_batch: UnevenOpt = None,
    families: FamiliesOpt = None,
    profiles: ProfilesOpt = None,
    top_k: Annotated[int, _opt(min=1, help="Also list the next best alternatives.")] = 1,
    predictor: PredictorOpt = None,
    lower_bound: LowerBoundOpt = False,
    engine: Annotated[Optional[str], _opt(help="Only plans this engine runs as planned: " + ENGINES + ".")] = None,
    zero_stages: Annotated[Optional[str], _opt(help="ZeRO stages to search, e.g. 1,2,3 (fastest wins).")] = None,
    out: PlanOutOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Search for the fastest plan that fits memory."""
    from planner import plan as make_plan
    from profiler.profiles import load_profiles
    from report.tables import alternatives_lines, evaluation_tables, fit_advice, hint_lines, plan_rows
    from specs import flags
    from specs.cluster import load_cluster
    from specs.engines import get_engine
    from specs.errors import DoesNotFitError
    from specs.model import load_model

    flags.output_file(out, "--out")
    cluster_spec, model_spec = load_cluster(cluster), load_model(model)
    given = {"global_batch_size": global_batch, "seq_length": seq_len, "dtype": dtype, "zero_stage": zero_stage}
    given |= {"recompute": flags.names(recompute) if recompute else None, "uneven_batch": uneven_batch}
    given |= {"micro_batch_sizes": flags.int_list(micro_batch_sizes, "--micro-batch-sizes"), "families": families}
    given |= {"virtual_stages": flags.int_list(virtual_stages, "--virtual-stages")}
    training_spec = _on_cluster(flags.training(training, **given), cluster_spec)
    inputs = (cluster_spec, model_spec, training_spec, load_profiles(profiles, model_spec))
    chosen_engine = get_engine(engine, "--engine") if engine else None
    options = {"top_k": top_k, "predictor": _predictor(predictor), "lower_bound": lower_bound, "engine": chosen_engine}
    options["zero_stages"] = flags.zero_stages(zero_stages)
    try:
        with _progress("plan", quiet, unit="candidates") as progress:
            result = make_plan(*inputs, progress=progress.counter("searched"), **options)
    except DoesNotFitError as err:
        raise DoesNotFitError(fit_advice(str(err), training_spec), err.shortfall_bytes) from None
    if out is not None:
        result.save(out)
    body = result.to_dict()
    tables = evaluation_tables(result.context, result.evaluation, "hetplan plan", plan_rows(body, result.interval))
    hints = hint_lines(result.context, result.evaluation)
    _show(as_json, body, *tables, *alternatives_lines(body), *hints, *_written("plan", out))


@app.command()
def predict(
    cluster: ClusterOpt,
    model: Annotated[Optional[str], _opt("--model", "-m", help="Model (default: the plan's).")] = None,
    strategy: Annotated[Optional[Path], _opt(help="Evaluate this plan JSON (any plan in the schema).")] = None,
    group: Annotated[Optional[str], _opt(help="Group to use with Megatron-style flags.")] = None,
    tp: Annotated[int, _opt(min=1, help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, _opt(min=1, help="Pipeline stages (even layer split).")] = 1,
    dp: Annotated[int, _opt(min=1, help="Data-parallel replicas.")] = 1,
    micro_batch: Annotated[int, _opt(min=1, help="Micro-batch size.")] = 1,
    recompute: Annotated[str, _opt(help="none, selective or full.")] = "none",
    sequence_parallel: SequenceParallelOpt = True,
    virtual_stages: Annotated[int, _opt(min=1, help="Interleaving chunks per stage.")] = 1,
    training: TrainingOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    dtype: DtypeOpt = None,
    zero_stage: ZeroOpt = None,
    attention: Annotated[Optional[str], _opt(help="flash, or materialized (pre-flash Megatron).")] = None,
    profiles: Annotated[
        Optional[Path], _opt("--profiles", help="Directory of profile JSON files (default: --strategy's).")
    ] = None,
    predictor: Annotated[Optional[Path], _opt("--predictor", help="Predictor file (default: --strategy's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a given strategy (no search): Megatron-style --tp/--pp/--dp, or --strategy plan.json (with the
    costs the plan records unless --profiles/--predictor name others)."""
    from dataclasses import replace

    from planner.plan import evaluation_dict, header_dict, interval_dict, load_plan
    from planner.what_if import predicted, what_if
    from profiler.profiles import load_profiles
    from report.tables import evaluation_tables, interval_row
    from specs import flags
    from specs.cluster import load_cluster

    cluster_spec = load_cluster(cluster)
    overrides = dict(
        global_batch_size=global_batch, seq_length=seq_len, dtype=dtype, zero_stage=zero_stage, attention=attention
    )
    given = (group, tp, pp, dp, micro_batch, recompute, virtual_stages, sequence_parallel)
    flags.training(None, **overrides)  # a bad flag is named as the flag, before a plan's training is read
    chosen = what_if(cluster_spec, cluster, strategy, model, training, overrides, dict(zip(MEGATRON_FLAGS, given)))
    chosen = replace(chosen, training=_on_cluster(chosen.training, cluster_spec))
    if strategy is not None:
        costs = _plan_costs(load_plan(strategy), predictor, profiles, chosen.model)
        chosen_predictor, measured = costs.predictor, costs.profiles
    else:
        chosen_predictor, measured = _predictor(predictor), load_profiles(profiles, chosen.model)
    ctx, evaluation, interval = predicted(chosen, cluster_spec, chosen_predictor, measured)
    body = {
        **header_dict(ctx),
        **evaluation_dict(ctx, evaluation),
        "iteration_time_interval_s": interval_dict(interval),
    }
    _show(as_json, body, *evaluation_tables(ctx, evaluation, "hetplan predict", [interval_row(interval)]))


@app.command()
def devices(as_json: JsonOpt = False) -> None:
    """List the accelerator catalog."""
    from report.tables import devices_table
    from specs.device import device_catalog

    catalog = device_catalog()
    _show(as_json, [d.model_dump() for d in catalog.values()], devices_table(catalog))


@app.command()
def models(as_json: JsonOpt = False) -> None:
    """List the model catalog."""
    from report.tables import models_table
    from specs.model import model_catalog

    catalog = model_catalog()
    _show(
        as_json, [dict(m.model_dump(), total_params=m.total_params()) for m in catalog.values()], models_table(catalog)
    )


# ---- measuring and fitting --------------------------------------------------------------------------------------
@app.command()
def profile(
    model: ModelOpt,
    out: ProfileOutOpt,
    device: Annotated[str, _opt(help="auto, cpu, cuda:N (also ROCm), xpu:N or npu:N.")] = "auto",
    as_device: Annotated[Optional[str], _opt(help="Catalog key the profile stands for (default: the device).")] = None,
    micro_batches: MicroBatchesOpt = "1,2,4,8",
    tp: TpListOpt = "1,2,4",
    recompute: Annotated[str, _opt(help="Recompute modes to time.")] = "none,selective,full",
    seq_len: SeqLenOpt = None,
    dtype: Annotated[str, _opt(help="auto (fp32 on CPU, bf16 elsewhere), bf16, fp16 or fp32.")] = "auto",
    repeats: Annotated[int, _opt(min=1, help="Timed runs per entry (at least).")] = 8,
    threads: Annotated[Optional[int], _opt(min=1, help="CPU threads torch may use (default: torch's).")] = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure per-layer forward/backward time and activation memory on the local accelerator; Ctrl-C writes what
    was measured and exits 130."""
    from specs import flags
    from specs.model import RECOMPUTE_MODES, load_model

    flags.output_file(out, "--out")
    sizes, degrees = flags.int_list(micro_batches, "--micro-batches"), flags.int_list(tp, "--tp")
    modes = flags.choices(recompute, RECOMPUTE_MODES, "--recompute")
    model_spec = load_model(model)
    _require_torch("profile")
    from profiler.measure import profile_model, profile_target

    torch_device, chosen_dtype, key = profile_target(device, dtype, as_device, threads)
    training_spec = flags.training(None, dtype=chosen_dtype, seq_length=seq_len)
    with _progress("profile", quiet, unit="entries") as progress:
        shape = {"seq_length": seq_len or model_spec.seq_length, "micro_batch_sizes": sizes, "tp_degrees": degrees}
        measure = {"device": torch_device, "device_key": key, "dtype": training_spec.dtype, "repeats": repeats}
        result = profile_model(model_spec, recompute_modes=modes, progress=progress, **shape, **measure)  # type: ignore[arg-type]
    result.save(out)
    interrupted = bool(result.environment.get("interrupted"))
    skipped = sum(not entry.fits for entry in result.entries)
    body = {"out": str(out), "entries": len(result.entries), "did_not_fit": skipped, "interrupted": interrupted}
    note = " (interrupted: partial profile)" if interrupted else ""
    _show(as_json, body, f"{len(result.entries)} entries ({skipped} did not fit) written to {out}{note}")
    if interrupted:
        raise KeyboardInterrupt  # what was measured is written; the exit status still says it was cut short


@app.command("profile-comm")
def profile_comm(
    out: Annotated[Path, _opt(help="Link profile JSON to write.")],
    world: Annotated[str, _opt(help="Local process counts to launch, e.g. 2,4.")] = "2,4",
    min_size: Annotated[str, _opt(help="Smallest message.")] = "4KiB",
    max_size: Annotated[str, _opt(help="Largest message (sizes step by 4x, at most 16GiB).")] = "256MiB",
    ops: Annotated[str, _opt(help="Collectives.")] = "all_reduce,all_gather,reduce_scatter,send_recv",
    repeats: RepeatsOpt = 3,
    link_class: Annotated[str, _opt(help="What the processes share: in_node, rail or cross_group.")] = "in_node",
    timeout_s: TimeoutOpt = 120.0,
    as_device: Annotated[str, _opt(help="Catalog key of the devices measured.")] = "cpu",
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

    flags.output_file(out, "--out")
    flags.choice(link_class, ("in_node", "rail", "cross_group"), "--link-class")
    sizes, worlds = flags.message_sizes(min_size, max_size), flags.int_list(world, "--world", 2, "process counts") or []
    device_key = get_device(as_device, "--as-device", "").key
    _require_torch("profile-comm")
    from profiler.comm_bench import COLLECTIVES, launched_by_torchrun, link_profile, run_in_job, run_local

    chosen = flags.choices(ops, COLLECTIVES, "--ops")
    points = []
    with _progress("profile-comm", quiet, unit="process counts") as progress:
        if launched_by_torchrun():  # one rank of a real job: measure the job's own links; rank 0 reports
            rank, points = run_in_job(sizes, chosen, repeats, timeout_s)
            if rank != 0:
                return
        else:
            with tempfile.TemporaryDirectory() as scratch:
                for index, ranks in enumerate(worlds):
                    progress.update(index, len(worlds), f"({ranks} processes)")
                    points += run_local(ranks, sizes, chosen, repeats, Path(scratch), timeout_s)
    profile = link_profile(points, link_class, "gloo", device_key)
    write_json(out, profile)
    _show(as_json, profile, *link_profile_tables(profile, link_class), *_written("link profile", out))


@app.command()
def fit(
    out: Annotated[Path, _opt(help="Write the predictor (joblib) here.")],
    profiles: Annotated[Optional[Path], _opt(help="Directory of profile JSON files (any devices).")] = None,
    links: Annotated[Optional[list[Path]], _opt(help="Link profile from `hetplan profile-comm` (repeat).")] = None,
    runs: Annotated[Optional[list[Path]], _opt(help="Run record(s) of measured iterations (repeat).")] = None,
    published_runs: Annotated[bool, _opt("--published-runs/--no-published-runs", help="Also the bundled run.")] = True,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Fit a predictor: layer models from profiles, links from link profiles, calibration from runs."""
    from predictor.predictor import calibration_runs, fit_predictor, save_predictor
    from predictor.validation import validation_report
    from profiler.profiles import checked_profile_files
    from report.measurements import fit_renderables, validation_renderables
    from specs.flags import output_file

    output_file(out, "--out")
    with _progress("fit", quiet, unit="steps") as progress:
        progress.step("checking the profiles", 2)
        paths = checked_profile_files(profiles) if profiles is not None else []
        progress.step("fitting", 3)
        fitted = fit_predictor(paths, links or [], runs or [], published_runs=published_runs, name=out.name)
        progress.step("leaving one source out at a time", 3)
        body = fitted.describe()
        body["validation"] = validation_report(fitted, calibration_runs(runs or [], published_runs), held_out=True)
    save_predictor(fitted, out)
    renderables = validation_renderables(body["validation"]) if body["validation"]["runs"] else []
    _show(as_json, body, *fit_renderables(body), *renderables, *_written("predictor", out))


@app.command()
def validate(
    runs: Annotated[list[Path], typer.Argument(help="Run records (hetplan.run/1, runs/1, or calibration-runs/1).")],
    predictor: PredictorOpt = None,
    held_out: Annotated[
        bool, _opt("--leave-one-source-out", help="Also refit without each source and predict its runs.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Predict measured runs: per run the prediction, the signed error and the term that dominates its time; the
    error per device family; the worst runs."""
    from predictor.runs import load_runs
    from predictor.validation import validation_report
    from report.measurements import validation_renderables

    loaded = [run for path in runs for run in load_runs(path)]
    body = validation_report(_predictor(predictor), loaded, held_out)
    _show(as_json, body, *validation_renderables(body))


@app.command()
def run(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    out: Annotated[Path, _opt(help="Run record to write (hetplan.run/1; `hetplan fit --runs` reads it).")],
    steps: Annotated[int, _opt(min=1, help="Training steps (the first is a warm-up).")] = 5,
    seed: Annotated[int, _opt(help="Seed of the weights and the synthetic tokens.")] = 0,
    profiles: Annotated[
        Optional[Path], _opt(help="Predict from these profiles, uncalibrated (default: the ones the plan records).")
    ] = None,
    predictor: PlanPredictorOpt = None,
    timeout: TimeoutOpt = 120.0,
    checkpoint_dir: Annotated[
        Optional[Path], _opt("--checkpoint-dir", help="Save the training state here (DCP; any plan can load it).")
    ] = None,
    checkpoint_every: Annotated[
        int, _opt("--checkpoint-every", min=0, help="Save every N steps (and after the last; 0: only the last).")
    ] = 0,
    async_save: Annotated[
        bool, _opt("--async-save", help="Write checkpoints in the background (DCP async_save); committed when done.")
    ] = False,
    resume: Annotated[
        Optional[Path],
        _opt("--resume", help="Continue from this checkpoint, or the latest complete one under this directory."),
    ] = None,
    max_restarts: Annotated[
        int,
        _opt("--max-restarts", min=0, help="Local runs: when ranks die, re-plan for the rest and resume (this often)."),
    ] = 0,
    inject_failure: Annotated[
        Optional[str], _opt("--inject-failure", help="Testing: RANK:STEP, that rank kills itself as the step starts.")
    ] = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Train a plan for a few steps on local processes (one per device, Gloo), or as the ranks of a torchrun job
    (`hetplan launch` writes the commands), and write the measurement beside the prediction, the loss curve and a
    single-process loss check. With --checkpoint-dir the state is saved as it trains; with --max-restarts a local
    run survives lost ranks (re-plan, reshard the last checkpoint, continue) and its record says what it cost."""
    from planner.what_if import check_local_run, plan_on_cluster, run_context
    from specs.flags import output_file

    output_file(out, "--out")
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    check_local_run(cluster_spec, cluster)
    _require_torch("run")
    from profiler.comm_bench import launched_by_torchrun
    from report.files import write_json
    from report.measurements import run_lines, run_table, run_terms_table
    from runtime.execute import RunSettings
    from runtime.launch import execute, execute_in_job
    from specs.errors import SpecError

    failure = None
    if inject_failure is not None:
        rank_text, _, step_text = inject_failure.partition(":")
        if not (rank_text.isdigit() and step_text.isdigit()):
            raise SpecError("--inject-failure", inject_failure, "expected RANK:STEP, e.g. 3:4")
        failure = (int(rank_text), int(step_text))
    if checkpoint_every and checkpoint_dir is None:
        raise SpecError("--checkpoint-every", str(checkpoint_every), "saves need --checkpoint-dir")
    if (max_restarts or failure) and checkpoint_dir is None:
        raise SpecError("--max-restarts", "", "a run that survives failures needs --checkpoint-dir to resume from")
    under_torchrun = launched_by_torchrun()
    if max_restarts and under_torchrun:
        raise SpecError("--max-restarts", "", "re-planning restarts are for local runs; under torchrun checkpoint "
                        "with --checkpoint-dir and restart the job with --resume on the devices left")  # fmt: skip
    settings = RunSettings(
        steps=steps, seed=seed, dtype=loaded.training.dtype, timeout_s=timeout,
        checkpoint_dir=str(checkpoint_dir or ""), checkpoint_every=checkpoint_every or steps,
        checkpoint_async=async_save, resume_from=str(resume or ""), fail_at=failure,
    )  # fmt: skip
    if resume:  # a checkpoint that cannot be resumed is refused before anything else is said or started
        from runtime.elastic import resumed_settings

        settings = resumed_settings(settings, loaded.model)
    costs = _plan_costs(loaded, predictor, profiles)
    predictor_object = costs.predictor
    context = run_context(loaded, predictor_object, costs.profiles)
    with _progress("run", quiet) as progress:  # under torchrun: this process is one rank, rank 0 writes
        if checkpoint_dir and not under_torchrun:
            from runtime.elastic import execute_elastic

            record = execute_elastic(loaded, cluster_spec, str(cluster), context, settings, max_restarts,
                                     predictor_object, progress=progress.say, profiles=costs.profiles)  # fmt: skip
        else:
            runner = execute_in_job if under_torchrun else execute
            record = runner(loaded, cluster_spec, str(cluster), context, settings, progress=progress.say)
    if record is None:
        return
    from report.elastic import elastic_lines

    write_json(out, record)
    terms = [table for table in [run_terms_table(record)] if table is not None]
    lines = [*run_lines(record, steps), *elastic_lines(record)]
    _show(as_json, record, run_table(record), *terms, *lines, *_written("run record", out))


@app.command()
def launch(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    out: Annotated[Path, _opt(help="Run record the job writes (on the first node).")] = Path("run.json"),
    master_addr: Annotated[str, _opt(help="Address of the first node.")] = "$MASTER_ADDR",
    port: Annotated[int, _opt(min=1, max=65535, help="Rendezvous port.")] = 29500,
) -> None:
    """Print the torchrun command of every node that runs the plan with `hetplan run` (one line per node)."""
    from planner.export import launch_commands
    from planner.what_if import plan_on_cluster

    _, cluster_spec = plan_on_cluster(plan_file, cluster)
    for line in launch_commands(str(plan_file), cluster_spec, str(cluster), str(out), master_addr, port):
        sys.stdout.write(line + "\n")


# ---- using a plan -----------------------------------------------------------------------------------------------
@app.command()
def export(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    format: Annotated[str, _opt("--format", "-f", help=ENGINES + ".")],
    out: Annotated[Path, _opt(help="Directory to write the files into.")] = Path("export"),
    predictor: PlanPredictorOpt = None,
    profiles: PlanProfilesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the plan as an engine's arguments/config plus one torchrun command per node; when the engine cannot
    express the plan, say what is lost and write the closest plan it can run, with that plan's predicted time."""
    from planner.export import export_plan
    from planner.plan import describe_strategy
    from planner.what_if import plan_on_cluster
    from report.files import write_export
    from report.tables import export_lines
    from specs.engines import get_engine
    from specs.flags import output_directory

    output_directory(out, "--out", "export.json")
    get_engine(format)  # an unknown format is named before anything is said about costs
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    costs = _plan_costs(loaded, predictor, profiles)
    ctx = costs.predictor.context(cluster_spec, loaded.model, loaded.training, costs.profiles)
    exported = export_plan(ctx, loaded.strategy, format)
    summary = {**exported.summary(), "exported_strategy": describe_strategy(exported.strategy)}
    write_export(exported, summary, out)
    _show(as_json, summary, *export_lines(format, exported, summary, out))


@app.command()
def explain(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    predictor: PlanPredictorOpt = None,
    profiles: PlanProfilesOpt = None,
    png: PngOpt = None,
    html: Annotated[Optional[Path], _opt(help="Write a self-contained HTML report here (.html).")] = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """The plan's pipeline schedule (Gantt), memory per stage against capacity, and its bottleneck in words."""
    from planner.what_if import plan_on_cluster
    from report import explain as explain_plan
    from specs.flags import output_file

    output_file(png, "--png", (".png",))
    output_file(html, "--html", (".html", ".htm"))
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    costs = _plan_costs(loaded, predictor, profiles)
    with _progress("explain", quiet, unit="steps") as progress:
        outputs = {"png": png, "html": html, "progress": progress.step, "profiles": costs.profiles}
        result = explain_plan(loaded, cluster_spec, costs.predictor, **outputs)
    words = [f"  - {line}" for line in result.bottleneck]
    _show(
        as_json,
        result.to_dict(),
        f"[bold]{result.title}[/bold]",
        *words,
        *_written("picture", png),
        *_written("report", html),
    )


@app.command()
def replan(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    without: Annotated[Optional[list[str]], _opt(help="Lost: node:GROUP/INDEX or group:NAME:COUNT (repeat).")] = None,
    add: Annotated[Optional[list[str]], _opt(help="New capacity: group:NAME:COUNT nodes (repeat).")] = None,
    predictor: PlanPredictorOpt = None,
    profiles: PlanProfilesOpt = None,
    out: PlanOutOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Re-plan after failures or additions, warm-started from the current plan; show what changed."""
    from planner import predict as run_predict
    from planner.replan import changed_cluster
    from planner.replan import replan as run_replan
    from planner.what_if import check_changes, plan_on_cluster
    from report.replanning import replan_lines, replan_summary
    from specs.flags import output_file

    output_file(out, "--out")
    check_changes(without or [], add or [])
    loaded, original = plan_on_cluster(plan_file, cluster)
    new_cluster = changed_cluster(original, without or [], add or [])
    costs = _plan_costs(loaded, predictor, profiles)
    chosen, measured = costs.predictor, costs.profiles
    with _progress("replan", quiet, unit="steps") as progress:
        progress.step("evaluating the old plan", 2)
        old_ctx = chosen.context(original, loaded.model, loaded.training, measured)
        old = run_predict(old_ctx, loaded.strategy, str(plan_file))
        progress.step("searching the changed cluster", 2)
        result = run_replan(new_cluster, loaded.model, loaded.training, loaded.strategy, chosen, profiles=measured)
    if out is not None:
        result.plan.save(out)
    body = replan_summary(original, new_cluster, old, result)
    _show(as_json, body, *replan_lines(body, result.replan_time_s), *_written("plan", out))


@app.command()
def traffic(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    tokens: Annotated[Optional[float], _opt(callback=_finite(), help="Dataset tokens per epoch (for totals).")] = None,
    epochs: Annotated[float, _opt(callback=_finite(), help="Epochs (with --tokens).")] = 1.0,
    png: Annotated[Optional[Path], _opt(help="Write the per-pair traffic heatmap here (.png).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Bytes per iteration (and epoch) by parallel dimension and link class, summed over the devices that send
    them; rail-only check."""
    from planner.what_if import plan_on_cluster
    from report import traffic as plan_traffic
    from report.tables import traffic_table
    from specs.flags import output_file

    output_file(png, "--png", (".png",))
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    result = plan_traffic(loaded, cluster_spec, tokens=tokens, epochs=epochs, png=png)
    _show(as_json, result.to_dict(), traffic_table(result), result.rail.sentence(), *_written("heatmap", png))


@app.command("traffic-calc")
def traffic_calc(
    model: ModelOpt,
    tokens: Annotated[float, _opt(callback=_finite(), help="Training tokens (e.g. one epoch of the dataset).")],
    global_batch: Annotated[int, _opt(min=1, help="Sequences per step.")],
    gpus: Annotated[int, _opt(min=2, help="Ranks in the one parallel dimension.")],
    seq_len: SeqLenOpt = None,
    grad_bytes: Annotated[int, _opt(min=1, max=8, help="Bytes per gradient value in the DP all-reduce.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Textbook per-rank traffic of DP, FSDP, TP and PP over a training run (standard ring volumes)."""
    from report import traffic_calc as textbook
    from report.tables import traffic_calc_lines
    from specs.model import load_model

    spec = load_model(model)
    body = textbook(spec, tokens, global_batch, gpus, seq_length=seq_len, grad_bytes=grad_bytes)
    _show(as_json, body, *traffic_calc_lines(body, global_batch, seq_len or spec.seq_length))


# ---- communicator and simulated profiles -------------------------------------------------------------------------
@app.command("comm-bench")
def comm_bench(
    world: Annotated[int, _opt(min=2, max=256, help="Local processes to launch.")] = 4,
    islands: Annotated[str, _opt(help="Island (vendor) of each rank.")] = "nvidia,nvidia,amd,amd",
    sizes: Annotated[str, _opt(help="Message sizes, e.g. 4KiB,1MiB,16MiB.")] = "4KiB,64KiB,1MiB,16MiB",
    repeats: RepeatsOpt = 5,
    timeout_s: TimeoutOpt = 60.0,
    links_out: Annotated[Optional[Path], _opt(help="Write the bridged path as a link profile (`fit --links`).")] = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """All-reduce over simulated vendor islands: direct vs bridged vs hierarchical, checked and timed."""
    from specs import flags

    flags.output_file(links_out, "--links-out")
    size_list = [flags.size_bytes(part, "--sizes") for part in flags.names(sizes) or [""]]
    _require_torch("comm-bench")
    from comm.bench import check_islands, links_from_bench, run_comm_bench
    from report.files import write_json
    from report.measurements import comm_bench_table

    names = check_islands(flags.names(islands), world)
    with _progress("comm-bench", quiet, unit="points") as progress:
        result = run_comm_bench(names, size_list, repeats, timeout_s, progress=progress)
    if links_out is not None:
        write_json(links_out, links_from_bench(result))
    _show(as_json, result, comm_bench_table(result, names), *_written("link profile", links_out))


@app.command("simulate-profile")
def simulate_profile(
    device: Annotated[str, _opt(help="Catalog device key.")],
    model: ModelOpt,
    out: ProfileOutOpt,
    micro_batches: MicroBatchesOpt = "1,2,4,8",
    tp: TpListOpt = "1,2,4,8",
    seq_len: SeqLenOpt = None,
    dtype: Annotated[str, _opt(help="bf16, fp16 or fp32.")] = "bf16",
    noise: Annotated[float, _opt(callback=_finite(0.0, inclusive=True), help="Log-normal sigma of noise.")] = 0.0,
    seed: Annotated[int, _opt(help="Noise seed.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Write a simulated device profile (datasheet roofline) in the profile JSON format."""
    from profiler.simulated import SimulatedDevice
    from specs import flags
    from specs.device import get_device
    from specs.model import load_model

    flags.output_file(out, "--out")
    sizes, degrees = flags.int_list(micro_batches, "--micro-batches") or [], flags.int_list(tp, "--tp") or []
    model_spec = load_model(model)
    training_spec = flags.training(None, dtype=dtype, seq_length=seq_len)
    spec = get_device(device, "--device")
    seq_length = training_spec.seq_length or model_spec.seq_length
    simulated = SimulatedDevice(spec, model_spec, seq_length, training_spec.dtype, noise=noise, seed=seed)
    profile = simulated.to_profile(tuple(sizes), tuple(degrees))
    profile.save(out)
    _show(
        as_json, {"out": str(out), "entries": len(profile.entries)}, f"{len(profile.entries)} entries written to {out}"
    )


# ---- the entry point ----------------------------------------------------------------------------------------------
def main() -> None:
    """Console entry point: user errors (usage errors included) print one line and exit 2, Ctrl-C prints
    'interrupted' and exits 130, anything else one line and exit 1; never a traceback unless HETPLAN_DEBUG=1."""
    from report.failures import exit_status

    sys.exit(exit_status(app, sys.argv[1:]))


if __name__ == "__main__":
    main()
