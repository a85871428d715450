"""hetplan command line: parses flags, calls the Python API (planner/, report/, ...), prints tables or JSON.

Heavy imports are lazy (inside the commands) so that `hetplan --help` and `import cli` stay fast."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import click
import typer

if TYPE_CHECKING:
    from planner.plan import LoadedPlan, Plan
    from predictor.cost_model import CostContext
    from predictor.predictor import Predictor
    from profiler.profile import DeviceProfile
    from specs.cluster import ClusterSpec
    from specs.model import ModelSpec
    from specs.training import TrainingSpec

app = typer.Typer(
    name="hetplan",
    help="Plan large-model training on clusters that mix accelerator types and vendors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ClusterOpt = Annotated[Path, typer.Option("--cluster", "-c", help="Cluster YAML/JSON file.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Catalog name, model YAML/JSON, or HF config.json.")]
TrainingOpt = Annotated[Optional[Path], typer.Option("--training", help="Training YAML/JSON file (flags override).")]
GlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per iteration.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Sequence length (default: the model's).")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32.")]
ZeroOpt = Annotated[Optional[int], typer.Option("--zero-stage", help="0, or 1 (distributed optimizer).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
PredictorOpt = Annotated[
    Optional[Path], typer.Option("--predictor", help="Predictor file from `hetplan fit` (default: the shipped one).")
]
PlanArg = Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")]
PlanClusterOpt = Annotated[Path, typer.Option("--cluster", "-c", help="Cluster file of the plan.")]
MicroBatchesOpt = Annotated[str, typer.Option(help="Micro-batch sizes.")]


# ---- parsing and loading ----------------------------------------------------------------------------------------
def _int_list(text: str | None, flag: str) -> list[int] | None:
    """'1,2,4' -> [1, 2, 4]; None stays None (the flag was not given)."""
    from specs.errors import SpecError

    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecError(flag, "", f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _size_bytes(text: str, flag: str) -> int:
    """'4KiB' -> 4096, '1MB' -> 1000000: binary and decimal units, case-insensitive."""
    from specs.errors import SpecError

    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    stripped = text.strip().lower()
    number = stripped.rstrip("kmgib")
    try:
        return int(float(number) * units[stripped[len(number) :]])
    except (ValueError, KeyError):
        raise SpecError(flag, "", f"expected a size like 4KiB or 256MiB, got {text!r}") from None


def _training(path: Path | None, **overrides: Any) -> TrainingSpec:
    """The training file (or defaults) with the flags that were given on top."""
    from specs.training import load_training

    return load_training(path, overrides)


def _predictor(path: Path | None) -> Predictor:
    """The predictor from `hetplan fit`, or the shipped one."""
    from predictor.predictor import default_predictor, load_predictor

    return load_predictor(path) if path is not None else default_predictor()


def _load_profiles(directory: Path | None, model: ModelSpec) -> dict[str, DeviceProfile]:
    """--profiles: the directory's profiles by device, checked against the model (none without the flag)."""
    from profiler.profiles import load_profiles

    return load_profiles(directory, model)


def _plan_and_cluster(plan_file: Path, cluster: Path) -> tuple[LoadedPlan, ClusterSpec]:
    """A plan file and the cluster file it was made for (refused when the cluster's name differs)."""
    from planner import load_plan
    from specs.cluster import load_cluster
    from specs.errors import SpecError

    loaded = load_plan(plan_file)
    cluster_spec = load_cluster(cluster)
    if loaded.cluster_name and cluster_spec.name != loaded.cluster_name:
        raise SpecError(
            str(cluster), "name", f"the plan is for cluster {loaded.cluster_name!r}, got {cluster_spec.name!r}"
        )
    return loaded, cluster_spec


def _require_torch(command: str) -> None:
    """Commands that measure need torch: say so in one line when it is missing."""
    from specs.errors import TorchMissingError

    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissingError(f"`hetplan {command}`") from None


# ---- printing ---------------------------------------------------------------------------------------------------
def _console() -> Any:
    """A rich console at least 100 columns wide (tables stay readable when piped)."""
    from rich.console import Console

    return Console(width=max(100, Console().width))


def _print(*renderables: Any) -> None:
    """Each table or line (rich markup) on the console, in order."""
    console = _console()
    for renderable in renderables:
        console.print(renderable)


def _print_json(body: Any) -> None:
    """The command's body as indented JSON on stdout (nothing else goes there with --json)."""
    sys.stdout.write(json.dumps(body, indent=2) + "\n")


def _written(what: str, path: Path | None) -> list[str]:
    """'<what> written to <path>' when a file was asked for."""
    return [] if path is None else [f"{what} written to {path}"]


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
    recompute: Annotated[Optional[str], typer.Option(help="Allowed modes, e.g. none,selective,full.")] = None,
    micro_batch_sizes: Annotated[Optional[str], typer.Option(help="Candidates, e.g. 1,2,4,8.")] = None,
    virtual_stages: Annotated[Optional[str], typer.Option(help="Interleaving chunks to try, e.g. 1,2,4.")] = None,
    uneven_batch: Annotated[
        Optional[str],
        typer.Option(
            help="Replica counts that do not divide the batch: off (default), refine, or exhaustive (slower).",
        ),
    ] = None,
    families: Annotated[
        Optional[str],
        typer.Option(
            help="Pipeline families of different device mixes, each with its share of the batch: auto (default: "
            "on clusters of two groups), search (any cluster; longer) or off.",
        ),
    ] = None,
    profiles: Annotated[Optional[Path], typer.Option(help="Directory of profile JSON files (by device).")] = None,
    top_k: Annotated[int, typer.Option(min=1, help="Also list the next best alternatives.")] = 1,
    predictor: PredictorOpt = None,
    lower_bound: Annotated[
        bool,
        typer.Option(
            "--lower-bound",
            help="Also bound how fast any plan of the search space could be (the gap; about a second search).",
        ),
    ] = False,
    out: Annotated[Optional[Path], typer.Option(help="Write the plan JSON here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Search for the fastest plan that fits memory."""
    from specs.cluster import load_cluster
    from specs.model import load_model

    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model)
    training_spec = _training(
        training,
        global_batch_size=global_batch,
        seq_length=seq_len,
        dtype=dtype,
        zero_stage=zero_stage,
        recompute=recompute.split(",") if recompute else None,
        micro_batch_sizes=_int_list(micro_batch_sizes, "--micro-batch-sizes"),
        virtual_stages=_int_list(virtual_stages, "--virtual-stages"),
        uneven_batch=uneven_batch,
        families=families,
    )
    inputs = (cluster_spec, model_spec, training_spec, _load_profiles(profiles, model_spec))
    options = {"top_k": top_k, "predictor": _predictor(predictor), "lower_bound": lower_bound}
    result = _search(inputs, options, show_progress=not as_json and sys.stderr.isatty())
    if out is not None:
        result.save(out)
    body = result.to_dict()
    if as_json:
        _print_json(body)
        return
    from report.tables import alternatives_lines, evaluation_tables, plan_rows

    rows = plan_rows(body, result.interval)
    _print(*evaluation_tables(result.context, result.evaluation, "hetplan plan", rows), *alternatives_lines(body))
    _print(*_written("plan", out))


def _search(inputs: tuple[Any, ...], options: dict[str, Any], show_progress: bool) -> Plan:
    """Run the planner, with a transient progress bar on a terminal."""
    from planner import plan as make_plan

    if not show_progress:
        return make_plan(*inputs, **options)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("searching", total=None)
        progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        return make_plan(*inputs, progress=progress, **options)


@app.command()
def predict(
    cluster: ClusterOpt,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model (default: the plan's).")] = None,
    strategy: Annotated[Optional[Path], typer.Option(help="Evaluate this plan JSON (any plan in the schema).")] = None,
    group: Annotated[Optional[str], typer.Option(help="Group to use with Megatron-style flags.")] = None,
    tp: Annotated[int, typer.Option(min=1)] = 1,
    pp: Annotated[int, typer.Option(min=1)] = 1,
    dp: Annotated[int, typer.Option(min=1)] = 1,
    micro_batch: Annotated[int, typer.Option(min=1)] = 1,
    recompute: Annotated[str, typer.Option(help="none, selective or full.")] = "none",
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel/--no-sequence-parallel")] = True,
    virtual_stages: Annotated[int, typer.Option(min=1)] = 1,
    training: TrainingOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    dtype: DtypeOpt = None,
    zero_stage: ZeroOpt = None,
    attention: Annotated[
        Optional[str], typer.Option(help="flash, or materialized (pre-flash Megatron: scores in memory).")
    ] = None,
    profiles: Annotated[Optional[Path], typer.Option(help="Directory of profile JSON files.")] = None,
    predictor: PredictorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a given strategy (no search): Megatron-style --tp/--pp/--dp, or --strategy plan.json."""
    from planner import load_plan
    from planner import predict as run_predict
    from planner.plan import evaluation_dict, header_dict, interval_dict
    from specs.cluster import load_cluster
    from specs.errors import SpecError
    from specs.layout import megatron_strategy
    from specs.model import load_model

    cluster_spec = load_cluster(cluster)
    overrides = dict(
        global_batch_size=global_batch, seq_length=seq_len, dtype=dtype, zero_stage=zero_stage, attention=attention
    )
    if strategy is not None:
        loaded = load_plan(strategy)
        model_spec = load_model(model) if model else loaded.model
        base = loaded.training.model_dump()
        base.update({k: v for k, v in overrides.items() if v is not None})
        training_spec = _training(training, **base)
        chosen, source = loaded.strategy, str(strategy)
    else:
        if model is None:
            raise SpecError("--model", "", "required with Megatron-style flags (or pass --strategy plan.json)")
        model_spec = load_model(model)
        training_spec = _training(training, sequence_parallel=sequence_parallel, **overrides)
        chosen = megatron_strategy(
            cluster_spec,
            model_spec,
            training_spec,
            group=group,
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batch_size=micro_batch,
            recompute=recompute,
            virtual_stages=virtual_stages,
            source="--tp/--pp/--dp flags",
        )
        source = "flags"
    chosen_predictor = _predictor(predictor)
    measured = _load_profiles(profiles, model_spec)
    ctx = chosen_predictor.context(cluster_spec, model_spec, training_spec, measured)
    evaluation = run_predict(ctx, chosen, source)
    base_ctx = chosen_predictor.base_context(cluster_spec, model_spec, training_spec, measured)
    interval = chosen_predictor.interval(base_ctx, chosen)
    if as_json:
        body = header_dict(ctx)
        body.update(evaluation_dict(ctx, evaluation))
        body["iteration_time_interval_s"] = interval_dict(interval)
        _print_json(body)
        return
    from report.tables import evaluation_tables, interval_row

    _print(*evaluation_tables(ctx, evaluation, "hetplan predict", [interval_row(interval)]))


@app.command()
def devices(as_json: JsonOpt = False) -> None:
    """List the accelerator catalog."""
    from specs.device import device_catalog

    catalog = device_catalog()
    if as_json:
        _print_json([d.model_dump() for d in catalog.values()])
        return
    from report.tables import devices_table

    _print(devices_table(catalog))


@app.command()
def models(as_json: JsonOpt = False) -> None:
    """List the model catalog."""
    from specs.model import model_catalog

    catalog = model_catalog()
    if as_json:
        _print_json([dict(m.model_dump(), total_params=m.total_params()) for m in catalog.values()])
        return
    from report.tables import models_table

    _print(models_table(catalog))


# ---- measuring and fitting --------------------------------------------------------------------------------------
@app.command()
def profile(
    model: ModelOpt,
    out: Annotated[Path, typer.Option(help="Profile JSON to write.")],
    device: Annotated[str, typer.Option(help="auto, cpu, cuda:N (also ROCm), xpu:N or npu:N.")] = "auto",
    as_device: Annotated[
        Optional[str], typer.Option(help="Catalog key the profile stands for (default: cpu, or the GPU's name).")
    ] = None,
    micro_batches: MicroBatchesOpt = "1,2,4,8",
    tp: Annotated[str, typer.Option(help="TP degrees to time (the shard one rank computes).")] = "1,2,4",
    recompute: Annotated[str, typer.Option(help="Recompute modes to time.")] = "none,selective,full",
    seq_len: SeqLenOpt = None,
    dtype: Annotated[str, typer.Option(help="auto (fp32 on CPU, bf16 elsewhere), bf16, fp16 or fp32.")] = "auto",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per entry (at least).")] = 8,
    threads: Annotated[
        Optional[int], typer.Option(min=1, help="CPU threads torch may use (default: torch's choice).")
    ] = None,
) -> None:
    """Measure per-layer forward/backward time and activation memory on the local accelerator."""
    from specs.errors import SpecError

    _require_torch("profile")
    import torch
    from rich.progress import Progress

    from profiler.measure import profile_model, resolve_device
    from specs.device import get_device
    from specs.model import RECOMPUTE_MODES, load_model

    model_spec = load_model(model)
    torch_device = resolve_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    chosen_dtype = ("fp32" if torch_device.type == "cpu" else "bf16") if dtype == "auto" else dtype
    training_spec = _training(None, dtype=chosen_dtype, seq_length=seq_len)
    modes = _names(recompute)
    for mode in modes:
        if mode not in RECOMPUTE_MODES:
            raise SpecError("--recompute", "", f"expected none, selective or full, got {mode!r}")
    key = as_device or ("cpu" if torch_device.type == "cpu" else torch_device.type)
    if as_device:
        key = get_device(as_device, "--as-device", "").key
    with Progress(transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("profiling", total=None)

        def report(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        result = profile_model(
            model_spec,
            device=torch_device,
            device_key=key,
            dtype=training_spec.dtype,
            seq_length=seq_len or model_spec.seq_length,
            micro_batch_sizes=_int_list(micro_batches, "--micro-batches") or [],
            tp_degrees=_int_list(tp, "--tp") or [],
            recompute_modes=modes,  # type: ignore[arg-type]
            repeats=repeats,
            progress=report,
        )
    result.save(out)
    skipped = sum(not entry.fits for entry in result.entries)
    note = " (interrupted: partial profile)" if result.environment.get("interrupted") else ""
    _print(f"{len(result.entries)} entries ({skipped} did not fit) written to {out}{note}")


def _message_sizes(min_size: str, max_size: str) -> list[int]:
    """Message sizes from --min-size to --max-size in steps of 4x."""
    from specs.errors import SpecError

    low, high = _size_bytes(min_size, "--min-size"), _size_bytes(max_size, "--max-size")
    if not 4 <= low <= high:
        raise SpecError("--min-size/--max-size", "", "expected 4 bytes <= min-size <= max-size")
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= 4
    return sizes


def _choices(text: str, known: Iterable[str], flag: str) -> list[str]:
    """The comma-separated names of `text`, each one of `known`."""
    from specs.errors import SpecError

    known = tuple(known)
    chosen = _names(text)
    for name in chosen:
        if name not in known:
            raise SpecError(flag, "", f"expected some of {', '.join(known)}, got {name!r}")
    return chosen


@app.command("profile-comm")
def profile_comm(
    out: Annotated[Path, typer.Option(help="Link profile JSON to write.")],
    world: Annotated[str, typer.Option(help="Local process counts to launch, e.g. 2,4.")] = "2,4",
    min_size: Annotated[str, typer.Option(help="Smallest message.")] = "4KiB",
    max_size: Annotated[str, typer.Option(help="Largest message (sizes step by 4x).")] = "256MiB",
    ops: Annotated[str, typer.Option(help="Collectives.")] = "all_reduce,all_gather,reduce_scatter,send_recv",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per point.")] = 3,
    link_class: Annotated[
        str, typer.Option(help="What the processes share: in_node, rail or cross_group.")
    ] = "in_node",
    timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds any one operation may take.")] = 120.0,
    as_device: Annotated[
        str, typer.Option(help="Catalog key of the devices measured (the predictor applies the link to them).")
    ] = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Time real collectives (local processes, Gloo over loopback; under torchrun, this process is one rank of the
    job and --world is ignored) and fit alpha-beta per collective and group size, nccl-tests style."""
    import tempfile

    from specs.device import get_device
    from specs.errors import SpecError

    _require_torch("profile-comm")
    from profiler.comm_bench import COLLECTIVES, launched_by_torchrun, link_profile, run_in_job, run_local

    if link_class not in ("in_node", "rail", "cross_group"):
        raise SpecError("--link-class", "", f"expected in_node, rail or cross_group, got {link_class!r}")
    chosen = _choices(ops, COLLECTIVES, "--ops")
    sizes = _message_sizes(min_size, max_size)
    worlds = _int_list(world, "--world") or []
    if any(n < 2 for n in worlds):
        raise SpecError("--world", "", "expected process counts >= 2")
    points = []
    if launched_by_torchrun():  # one rank of a real job: measure the job's own links; rank 0 reports
        rank, points = run_in_job(sizes, chosen, repeats, timeout_s)
        if rank != 0:
            return
    else:
        with tempfile.TemporaryDirectory() as scratch:
            for ranks in worlds:
                points += run_local(ranks, sizes, chosen, repeats, Path(scratch), timeout_s)
    profile = link_profile(points, link_class, "gloo", get_device(as_device, "--as-device", "").key)
    out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    if as_json:
        _print_json(profile)
        return
    from report.measurements import link_profile_tables

    _print(*link_profile_tables(profile, link_class), *_written("link profile", out))


@app.command()
def fit(
    out: Annotated[Path, typer.Option(help="Write the predictor (joblib) here.")],
    profiles: Annotated[Optional[Path], typer.Option(help="Directory of profile JSON files (any devices).")] = None,
    links: Annotated[
        Optional[list[Path]], typer.Option(help="Link profile from `hetplan profile-comm` (repeat).")
    ] = None,
    runs: Annotated[Optional[list[Path]], typer.Option(help="Run record(s) of measured iterations (repeat).")] = None,
    published_runs: Annotated[
        bool, typer.Option("--published-runs/--no-published-runs", help="Also calibrate on the bundled published run.")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Fit a predictor: layer models from profiles, links from link profiles, calibration from runs."""
    from predictor.predictor import fit_predictor, save_predictor
    from profiler.profiles import profile_files

    profile_paths = profile_files(profiles) if profiles is not None else []
    fitted = fit_predictor(profile_paths, links or [], runs or [], published_runs=published_runs, name=out.name)
    save_predictor(fitted, out)
    body = fitted.describe()
    if as_json:
        _print_json(body)
        return
    from report.measurements import fit_renderables

    _print(*fit_renderables(body), *_written("predictor", out))


@app.command()
def run(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    out: Annotated[Path, typer.Option(help="Run record to write (hetplan.run/1; `hetplan fit --runs` reads it).")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps (the first is a warm-up).")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the weights and the synthetic tokens.")] = 0,
    profiles: Annotated[
        Optional[Path], typer.Option(help="Predict from these profiles (this machine's), uncalibrated.")
    ] = None,
    predictor: PredictorOpt = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds any one wait may take.")] = 120.0,
    as_json: JsonOpt = False,
) -> None:
    """Train a plan for a few steps on local processes (one per device, Gloo) and write the measurement, with the
    prediction, the loss curve and a single-process loss check beside it."""
    from runtime.execute import RunSettings
    from runtime.launch import execute
    from specs.errors import SpecError

    loaded, cluster_spec = _plan_and_cluster(plan_file, cluster)
    not_cpu = sorted({g.device.key for g in cluster_spec.groups} - {"cpu"})
    if not_cpu:
        raise SpecError(
            str(cluster),
            "groups",
            f"local runs use this machine's CPU; the cluster has {', '.join(not_cpu)} (run one rank per device "
            "under torchrun on the real cluster)",
        )
    context = _run_context(loaded, _predictor(predictor), _load_profiles(profiles, loaded.model))
    settings = RunSettings(steps=steps, seed=seed, dtype=loaded.training.dtype, timeout_s=timeout)
    record = execute(loaded, cluster_spec, str(cluster), context, settings, progress=_console().print)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if as_json:
        _print_json(record)
        return
    from report.measurements import run_lines, run_table

    _print(run_table(record), *run_lines(record, steps), *_written("run record", out))


def _run_context(
    loaded: LoadedPlan, chosen: Predictor, measured: dict[str, DeviceProfile]
) -> Callable[[ClusterSpec], CostContext]:
    """The cost context a run's prediction comes from, for the cluster as the local ranks see it: this machine's
    profiles as they are (uncalibrated) when given, else the predictor's calibrated context."""

    def context(seen: ClusterSpec) -> CostContext:
        if measured:
            return chosen.base_context(seen, loaded.model, loaded.training, measured)
        return chosen.context(seen, loaded.model, loaded.training)

    return context


# ---- using a plan -----------------------------------------------------------------------------------------------
@app.command()
def export(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    format: Annotated[
        str, typer.Option("--format", "-f", help="megatron, flagscale, deepspeed, torchtitan, torchrun.")
    ],
    out: Annotated[Path, typer.Option(help="Directory to write the files into.")] = Path("export"),
    predictor: PredictorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the plan as an engine's arguments/config plus one torchrun command per node; when the engine cannot
    express the plan, say what is lost and write the closest plan it can run, with that plan's predicted time."""
    from planner.export import export_plan
    from planner.plan import describe_strategy

    loaded, cluster_spec = _plan_and_cluster(plan_file, cluster)
    ctx = _predictor(predictor).context(cluster_spec, loaded.model, loaded.training)
    exported = export_plan(ctx, loaded.strategy, format)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in exported.files.items():
        (out / name).write_text(content, encoding="utf-8")
    (out / "launch.sh").chmod(0o755)
    summary = exported.summary()
    summary["exported_strategy"] = describe_strategy(exported.strategy)
    (out / "export.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if as_json:
        _print_json(summary)
        return
    from report.tables import export_lines

    _print(*export_lines(format, exported, summary, out))


@app.command()
def explain(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    predictor: PredictorOpt = None,
    png: Annotated[Optional[Path], typer.Option(help="Write the schedule and memory picture here.")] = None,
    html: Annotated[Optional[Path], typer.Option(help="Write a self-contained HTML report here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The plan's pipeline schedule (Gantt), memory per stage against capacity, and its bottleneck in words."""
    from report import explain as explain_plan

    loaded, cluster_spec = _plan_and_cluster(plan_file, cluster)
    result = explain_plan(loaded, cluster_spec, _predictor(predictor), png=png, html=html)
    if as_json:
        _print_json(result.to_dict())
        return
    words = [f"  - {line}" for line in result.bottleneck]
    _print(f"[bold]{result.title}[/bold]", *words, *_written("picture", png), *_written("report", html))


@app.command()
def replan(
    plan_file: Annotated[Path, typer.Argument(help="The current plan JSON.", metavar="PLAN")],
    cluster: Annotated[Path, typer.Option("--cluster", "-c", help="Cluster file the plan was made for.")],
    without: Annotated[
        Optional[list[str]], typer.Option(help="Lost capacity: node:GROUP/INDEX or group:NAME:COUNT (repeat).")
    ] = None,
    add: Annotated[Optional[list[str]], typer.Option(help="New capacity: group:NAME:COUNT nodes (repeat).")] = None,
    predictor: PredictorOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Write the new plan JSON here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-plan after failures or additions, warm-started from the current plan; show what changed."""
    from planner import predict as run_predict
    from planner.replan import changed_cluster
    from planner.replan import replan as run_replan
    from report.replanning import replan_lines, replan_summary
    from specs.errors import SpecError

    loaded, original = _plan_and_cluster(plan_file, cluster)
    if not without and not add:
        raise SpecError("--without/--add", "", "say what changed, e.g. --without node:ascend/17")
    new_cluster = changed_cluster(original, without or [], add or [])
    chosen = _predictor(predictor)
    old = run_predict(chosen.context(original, loaded.model, loaded.training), loaded.strategy, str(plan_file))
    result = run_replan(new_cluster, loaded.model, loaded.training, loaded.strategy, chosen)
    if out is not None:
        result.plan.save(out)
    body = replan_summary(original, new_cluster, old, result)
    if as_json:
        _print_json(body)
        return
    _print(*replan_lines(body, result.replan_time_s), *_written("plan", out))


@app.command()
def traffic(
    plan_file: PlanArg,
    cluster: Annotated[Optional[Path], typer.Option("--cluster", "-c", help="Cluster file of the plan.")] = None,
    tokens: Annotated[Optional[float], typer.Option(help="Dataset tokens per epoch (for per-epoch totals).")] = None,
    epochs: Annotated[float, typer.Option(help="Epochs (with --tokens).")] = 1.0,
    png: Annotated[Optional[Path], typer.Option(help="Write the per-pair traffic heatmap here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Bytes per iteration (and epoch) by parallel dimension and link class; rail-only check."""
    from report import traffic as plan_traffic
    from specs.errors import SpecError

    if cluster is None:
        raise SpecError("--cluster", "", "required: the cluster file the plan was made for")
    loaded, cluster_spec = _plan_and_cluster(plan_file, cluster)
    result = plan_traffic(loaded, cluster_spec, tokens=tokens, epochs=epochs, png=png)
    if as_json:
        _print_json(result.to_dict())
        return
    from report.tables import traffic_table

    _print(traffic_table(result), result.rail.sentence(), *_written("heatmap", png))


@app.command("traffic-calc")
def traffic_calc(
    model: ModelOpt,
    tokens: Annotated[float, typer.Option(help="Training tokens (e.g. one epoch of the dataset).")],
    global_batch: Annotated[int, typer.Option(help="Sequences per step.")],
    gpus: Annotated[int, typer.Option(min=2, help="Ranks in the one parallel dimension.")],
    seq_len: SeqLenOpt = None,
    grad_bytes: Annotated[int, typer.Option(help="Bytes per gradient value in the DP all-reduce.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Textbook per-rank traffic of DP, FSDP, TP and PP over a training run (standard ring volumes)."""
    from report import traffic_calc as textbook
    from specs.model import load_model

    spec = load_model(model)
    body = textbook(spec, tokens, global_batch, gpus, seq_length=seq_len, grad_bytes=grad_bytes)
    if as_json:
        _print_json(body)
        return
    from report.tables import traffic_calc_lines

    _print(*traffic_calc_lines(body, global_batch, seq_len or spec.seq_length))


# ---- communicator and simulated profiles -------------------------------------------------------------------------
@app.command("comm-bench")
def comm_bench(
    world: Annotated[int, typer.Option(min=2, help="Local processes to launch.")] = 4,
    islands: Annotated[str, typer.Option(help="Island (vendor) of each rank, e.g. nvidia,nvidia,amd,amd.")] = (
        "nvidia,nvidia,amd,amd"
    ),
    sizes: Annotated[str, typer.Option(help="Message sizes, e.g. 4KiB,1MiB,16MiB.")] = "4KiB,64KiB,1MiB,16MiB",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per point.")] = 5,
    timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds any one operation may take.")] = 60.0,
    links_out: Annotated[
        Optional[Path], typer.Option(help="Write the bridged path as a cross-group link profile (for `fit --links`).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """All-reduce over simulated vendor islands: direct vs bridged vs hierarchical, checked and timed."""
    import tempfile

    from specs.errors import SpecError

    _require_torch("comm-bench")
    from comm.bench import links_from_bench, run_comm_bench
    from comm.vendors import VENDORS

    names = _names(islands)
    if len(names) != world:
        raise SpecError("--islands", "", f"expected {world} islands (one per rank), got {len(names)}")
    unknown = sorted(set(names) - set(VENDORS))
    if unknown:
        raise SpecError("--islands", "", f"unknown vendor(s) {unknown}; known: {', '.join(VENDORS)}")
    size_list = [_size_bytes(part, "--sizes") for part in _names(sizes)]
    with tempfile.TemporaryDirectory() as scratch:
        result = run_comm_bench(names, size_list, repeats, Path(scratch), timeout_s)
    if links_out is not None:
        links_out.write_text(json.dumps(links_from_bench(result), indent=2) + "\n", encoding="utf-8")
    if as_json:
        _print_json(result)
        return
    from report.measurements import comm_bench_table

    _print(comm_bench_table(result, names), *_written("link profile", links_out))


@app.command("simulate-profile")
def simulate_profile(
    device: Annotated[str, typer.Option(help="Catalog device key.")],
    model: ModelOpt,
    out: Annotated[Path, typer.Option(help="Profile JSON to write.")],
    micro_batches: MicroBatchesOpt = "1,2,4,8",
    tp: Annotated[str, typer.Option(help="TP degrees.")] = "1,2,4,8",
    seq_len: SeqLenOpt = None,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32.")] = "bf16",
    noise: Annotated[float, typer.Option(min=0.0, help="Log-normal sigma of seeded timing noise.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Noise seed.")] = 0,
) -> None:
    """Write a simulated device profile (datasheet roofline) in the profile JSON format."""
    from profiler.simulated import SimulatedDevice
    from specs.device import get_device
    from specs.model import load_model

    model_spec = load_model(model)
    training_spec = _training(None, dtype=dtype, seq_length=seq_len)
    simulated = SimulatedDevice(
        get_device(device, "--device"),
        model_spec,
        seq_len or model_spec.seq_length,
        training_spec.dtype,
        noise=noise,
        seed=seed,
    )
    profile = simulated.to_profile(
        tuple(_int_list(micro_batches, "--micro-batches") or ()), tuple(_int_list(tp, "--tp") or ())
    )
    profile.save(out)
    _print(f"{len(profile.entries)} entries written to {out}")


def main() -> None:
    """Console entry point: user errors print one line and exit 2, never a traceback."""
    from specs.errors import HetplanError

    try:
        app(standalone_mode=False)
    except HetplanError as err:
        print(f"hetplan: error: {err}", file=sys.stderr)
        sys.exit(2)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except (click.Abort, KeyboardInterrupt):
        print("hetplan: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as err:
        print(f"hetplan: error: {err.filename or ''}: {err.strerror}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
