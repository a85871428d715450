"""hetplan command line: parses flags, calls the Python API, renders tables or JSON. Heavy imports are lazy."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import click
import typer

if TYPE_CHECKING:
    from planner.plan import LoadedPlan
    from predictor.calibration import Interval
    from predictor.cost_model import CostContext, Evaluation
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


def _int_list(text: str | None, flag: str) -> list[int] | None:
    from specs.errors import SpecError

    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecError(flag, "", f"expected comma-separated integers, got {text!r}") from None


def _training(path: Path | None, **overrides: Any) -> TrainingSpec:
    from specs.training import load_training

    return load_training(path, overrides)


def _predictor(path: Path | None) -> Predictor:
    from predictor.predictor import default_predictor, load_predictor

    return load_predictor(path) if path is not None else default_predictor()


def _load_profiles(directory: Path | None, model: ModelSpec) -> dict[str, DeviceProfile]:
    """Measured (or saved simulated) profiles by device key; each must describe this model's layer shape."""
    from profiler.profile import load_profile
    from specs.errors import SpecError

    if directory is None:
        return {}
    if not directory.is_dir():
        raise SpecError(str(directory), "", "expected a directory of profile JSON files")
    shape_fields = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "vocab_size", "mlp")
    profiles: dict[str, DeviceProfile] = {}
    for path in sorted(directory.glob("*.json")):
        profile = load_profile(path)
        for field in shape_fields:
            if profile.model.get(field) != getattr(model, field):
                raise SpecError(
                    str(path),
                    f"model.{field}",
                    f"profiled {profile.model.get(field)!r}, the model to plan has {getattr(model, field)!r}",
                )
        key = str(profile.device.get("key", ""))
        if key in profiles:
            raise SpecError(str(path), "device.key", f"a second profile for device {key!r} in {directory}")
        profiles[key] = profile
    return profiles


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


def _console() -> Any:
    from rich.console import Console

    return Console(width=max(100, Console().width))


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f}"


def _interval_row(interval: Interval) -> tuple[str, str]:
    return (
        "90% interval",
        f"{interval.low_s:.3f} - {interval.high_s:.3f} s (from {interval.basis})",
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _render_evaluation(ctx: CostContext, evaluation: Evaluation, title: str, extra_rows: list[tuple[str, str]]) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    strategy = evaluation.strategy
    families = strategy.pipelines
    summary = Table(title=title, show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    rows = [
        ("cluster", f"{ctx.cluster.name} ({ctx.cluster.num_devices} devices, {evaluation.devices_used} used)"),
        ("model", f"{ctx.model.key} ({ctx.model.total_params() / 1e9:.1f}B params, {ctx.model.num_layers} layers)"),
        ("batch", f"{ctx.training.global_batch_size} x {ctx.seq_length} tokens, {ctx.training.dtype}"),
        (
            "strategy",
            " + ".join(
                f"{p.replicas} replicas x {_count(len(p.stages), 'stage')}, micro-batch {p.micro_batch_size} x "
                f"{p.num_microbatches}"
                + (f" ({p.micro_batch_size * p.microbatch_total} samples)" if len(families) > 1 else "")
                for p in families
            )
            + f", recompute {strategy.recompute_summary}, "
            f"ZeRO-{strategy.zero_stage}, {'1F1B' if strategy.virtual_stages == 1 else 'interleaved 1F1B'}"
            f"{'' if strategy.virtual_stages == 1 else f' (v={strategy.virtual_stages})'}",
        ),
        (
            "iteration",
            f"{evaluation.iteration_time_s:.3f} s (pipeline {evaluation.pipeline_time_s:.3f}, bubble "
            f"{evaluation.bubble_time_s:.3f}, DP sync + optimizer {evaluation.tail_time_s:.3f})",
        ),
        (
            "throughput",
            f"{evaluation.tokens_per_s:,.0f} tokens/s, {evaluation.samples_per_s:.2f} samples/s, "
            f"MFU {evaluation.mfu:.1%}",
        ),
        *extra_rows,
        ("predictor", escape(ctx.predictor_identity)),
        ("fits", "yes" if evaluation.fits else f"NO: short by {_gib(evaluation.shortfall_bytes)} GiB per device"),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
    table = Table(title="Stages (per replica)")
    columns = ("stage", "group", "device", "layers", "n", "tp", "recompute", "devices", "fwd+bwd/mb ms", "memory GiB")
    for column in columns:
        table.add_column(column, justify="left" if column in ("group", "device", "recompute") else "right")
    stage_numbers: dict[int, int] = {}
    for stage_eval in evaluation.stages:
        stage = stage_eval.stage
        pipeline = families[stage_eval.family]
        index = stage_numbers[stage_eval.family] = stage_numbers.get(stage_eval.family, -1) + 1
        memory = f"{_gib(stage_eval.memory.total_bytes)} / {_gib(stage_eval.memory_capacity_bytes)}"
        table.add_row(
            f"{stage_eval.family}.{index}" if len(families) > 1 else str(index),
            stage.group,
            ctx.cluster.group(stage.group).device.key,
            f"{stage.layer_start}-{stage.layer_end - 1}",
            str(stage.num_layers),
            str(stage.tp),
            strategy.stage_recompute(stage),
            str(pipeline.stage_devices(stage)),
            f"{stage_eval.compute_time_s * 1e3:.1f}",
            memory if stage_eval.fits else f"[red]{memory}[/red]",
        )
    console.print(table)


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
    from planner import plan as make_plan
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
    loaded = _load_profiles(profiles, model_spec)
    inputs = (cluster_spec, model_spec, training_spec, loaded)
    options = {"top_k": top_k, "predictor": _predictor(predictor), "lower_bound": lower_bound}
    if as_json or not sys.stderr.isatty():
        result = make_plan(*inputs, **options)
    else:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("searching", total=None)
            progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
            result = make_plan(*inputs, progress=progress, **options)
    if out is not None:
        result.save(out)
    body = result.to_dict()
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    _render_evaluation(
        result.context,
        result.evaluation,
        "hetplan plan",
        [
            *([_interval_row(result.interval)] if result.interval else []),
            (
                "upper bound",
                f"{body['upper_bound_tokens_per_s']:,.0f} tokens/s (sum of groups alone): "
                f"{body['fraction_of_upper_bound']:.1%} of it",
            ),
            (
                "compute bound",
                f"{body['compute_bound_tokens_per_s']:,.0f} tokens/s (no bubble, no comm): "
                f"{body['fraction_of_compute_bound']:.1%} of it",
            ),
            *(
                [
                    (
                        "lower bound",
                        f"{body['iteration_time_lower_bound_s']:.3f} s per iteration for any plan searched: "
                        f"this one is within {body['gap_to_lower_bound']:.1%}",
                    )
                ]
                if "iteration_time_lower_bound_s" in body
                else []
            ),
            (
                "search",
                f"{body['search_time_s']:.2f} s, {body['search']['evaluated']} of "
                f"{body['search']['configurations']} configurations evaluated",
            ),
        ],
    )
    if body["alternatives"]:
        from rich.markup import escape

        console = _console()
        console.print("[bold]Alternatives[/bold]")
        for alt in body["alternatives"]:
            console.print(f"  {alt['iteration_time_s']:.3f} s  {escape(alt['summary'])}")
    if out is not None:
        _console().print(f"plan written to {out}")


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
    loaded = _load_profiles(profiles, model_spec)
    ctx = chosen_predictor.context(cluster_spec, model_spec, training_spec, loaded)
    evaluation = run_predict(ctx, chosen, source)
    interval = chosen_predictor.interval(
        chosen_predictor.base_context(cluster_spec, model_spec, training_spec, loaded), chosen
    )
    if as_json:
        body = header_dict(ctx)
        body.update(evaluation_dict(ctx, evaluation))
        body["iteration_time_interval_s"] = interval_dict(interval)
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    _render_evaluation(ctx, evaluation, "hetplan predict", [_interval_row(interval)])


@app.command()
def devices(as_json: JsonOpt = False) -> None:
    """List the accelerator catalog."""
    from rich.table import Table

    from specs.device import device_catalog

    catalog = device_catalog()
    if as_json:
        sys.stdout.write(json.dumps([d.model_dump() for d in catalog.values()], indent=2) + "\n")
        return
    table = Table(title="Accelerators (dense 16-bit peak; override per group in the cluster file)")
    for column in ("key", "name", "vendor", "TFLOP/s", "memory GB", "HBM TB/s", "in-node GB/s", "library", "aliases"):
        table.add_column(column)
    for d in catalog.values():
        table.add_row(
            d.key,
            d.name,
            d.vendor,
            f"{d.peak_tflops:g}",
            f"{d.memory_GB:g}",
            f"{d.hbm_TBps:g}",
            f"{d.intra_node_GBps:g}",
            d.collective_library,
            ", ".join(d.aliases),
        )
    _console().print(table)


@app.command()
def models(as_json: JsonOpt = False) -> None:
    """List the model catalog."""
    from rich.table import Table

    from specs.model import model_catalog

    catalog = model_catalog()
    if as_json:
        body = [dict(m.model_dump(), total_params=m.total_params()) for m in catalog.values()]
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    table = Table(title="Models")
    for column in ("key", "params", "layers", "hidden", "ffn", "heads", "kv", "vocab", "seq", "mlp"):
        table.add_column(column)
    for m in catalog.values():
        table.add_row(
            m.key,
            f"{m.total_params() / 1e9:.1f}B",
            str(m.num_layers),
            str(m.hidden_size),
            str(m.ffn_hidden_size),
            str(m.num_attention_heads),
            str(m.num_kv_heads),
            str(m.vocab_size),
            str(m.seq_length),
            m.mlp,
        )
    _console().print(table)


@app.command()
def profile(
    model: ModelOpt,
    out: Annotated[Path, typer.Option(help="Profile JSON to write.")],
    device: Annotated[str, typer.Option(help="auto, cpu, cuda:N (also ROCm), xpu:N or npu:N.")] = "auto",
    as_device: Annotated[
        Optional[str], typer.Option(help="Catalog key the profile stands for (default: cpu, or the GPU's name).")
    ] = None,
    micro_batches: Annotated[str, typer.Option(help="Micro-batch sizes.")] = "1,2,4,8",
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
    from specs.errors import SpecError, TorchMissingError

    try:
        import torch
    except ImportError:
        raise TorchMissingError("`hetplan profile`") from None
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
    modes = [m.strip() for m in recompute.split(",") if m.strip()]
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
    _console().print(f"{len(result.entries)} entries ({skipped} did not fit) written to {out}{note}")


def _size_bytes(text: str, flag: str) -> int:
    from specs.errors import SpecError

    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    stripped = text.strip().lower()
    number = stripped.rstrip("kmgib")
    try:
        return int(float(number) * units[stripped[len(number) :]])
    except (ValueError, KeyError):
        raise SpecError(flag, "", f"expected a size like 4KiB or 256MiB, got {text!r}") from None


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
    from specs.errors import SpecError, TorchMissingError

    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissingError("`hetplan profile-comm`") from None
    from profiler.comm_bench import COLLECTIVES, launched_by_torchrun, link_profile, run_in_job, run_local

    if link_class not in ("in_node", "rail", "cross_group"):
        raise SpecError("--link-class", "", f"expected in_node, rail or cross_group, got {link_class!r}")
    chosen = [op.strip() for op in ops.split(",") if op.strip()]
    for op in chosen:
        if op not in COLLECTIVES:
            raise SpecError("--ops", "", f"expected some of {', '.join(COLLECTIVES)}, got {op!r}")
    low, high = _size_bytes(min_size, "--min-size"), _size_bytes(max_size, "--max-size")
    if not 4 <= low <= high:
        raise SpecError("--min-size/--max-size", "", "expected 4 bytes <= min-size <= max-size")
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= 4
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
        sys.stdout.write(json.dumps(profile, indent=2) + "\n")
        return
    from rich.table import Table

    table = Table(title="Collectives (nccl-tests convention; sizes are whole buffers)")
    for column in ("collective", "ranks", "size", "time us", "algbw GB/s", "busbw GB/s", "ok"):
        table.add_column(column, justify="left" if column == "collective" else "right")
    for p in profile["points"]:
        table.add_row(
            p["collective"],
            str(p["ranks"]),
            f"{p['size_bytes'] / 2**10:,.0f} KiB",
            f"{p['time_s'] * 1e6:,.0f}",
            f"{p['algbw_bytes_per_s'] / 1e9:.2f}",
            f"{p['busbw_bytes_per_s'] / 1e9:.2f}",
            "yes" if p["correct"] else "NO",
        )
    fits = Table(title=f"Alpha-beta fits ({link_class})")
    for column in ("collective", "ranks", "alpha us", "busbw GB/s", "median err", "max err"):
        fits.add_column(column, justify="left" if column == "collective" else "right")
    for f in profile["links"]:
        fits.add_row(
            f["collective"],
            str(f["ranks"]),
            f"{f['alpha_s'] * 1e6:.1f}",
            f"{f['busbw_bytes_per_s'] / 1e9:.2f}",
            f"{f['fit_median_rel_error']:.1%}",
            f"{f['fit_max_rel_error']:.1%}",
        )
    console = _console()
    console.print(table)
    console.print(fits)
    console.print(f"link profile written to {out}")


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
    from specs.errors import SpecError

    profile_paths: list[Path] = []
    if profiles is not None:
        if not profiles.is_dir():
            raise SpecError(str(profiles), "", "expected a directory of profile JSON files")
        profile_paths = sorted(profiles.glob("*.json"))
        if not profile_paths:
            raise SpecError(str(profiles), "", "no *.json profiles in this directory")
    fitted = fit_predictor(profile_paths, links or [], runs or [], published_runs=published_runs, name=out.name)
    save_predictor(fitted, out)
    body = fitted.describe()
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    from rich.table import Table

    console = _console()
    if body["layer_models"]:
        table = Table(title="Layer models (cross-validated)")
        for column in ("device", "profiles", "rms error of log time"):
            table.add_column(column)
        for key, info in body["layer_models"].items():
            table.add_row(key, str(len(info["trained_on"])), f"{info['cv_log_error_rms']:.1%}")
        console.print(table)
    for key, info in body["links"].items():
        console.print(
            f"link {key}: busbw {info['busbw_bytes_per_s'] / 1e9:.2f} GB/s, alpha {info['alpha_s'] * 1e6:.1f} us, "
            f"+{info['slowdown_per_doubling']:.1%} per doubling of ranks (median fit error "
            f"{info['fit_median_rel_error']:.1%})"
        )
    table = Table(title="Calibration runs")
    for column in ("run", "measured s", "uncalibrated s", "calibrated s"):
        table.add_column(column)
    for run in body["calibration"]["runs"]:
        table.add_row(
            run["name"],
            f"{run['measured_iteration_time_s']:.3f}",
            f"{run['uncalibrated_iteration_time_s']:.3f}",
            f"{run['calibrated_iteration_time_s']:.3f}",
        )
    console.print(table)
    terms = ", ".join(f"{k} {v['value']:+.3f} (sd {v['sd']:.3f})" for k, v in body["calibration"]["parameters"].items())
    console.print(f"fitted terms: {terms or 'none (no runs)'}")
    console.print(f"predictor written to {out}")


def _traffic_heatmap(traffic: Any, title: str, path: Path) -> None:
    """Per-pair bytes as a heatmap (devices, or nodes when there are more than 512 devices)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    by_node = len(traffic.device_names) > 512
    labels = sorted(set(traffic.node_of), key=traffic.node_of.index) if by_node else traffic.device_names
    index = {label: i for i, label in enumerate(labels)}
    matrix = np.zeros((len(labels), len(labels)))
    for pairs in traffic.pairs.values():
        for (src, dst), size in pairs.items():
            a = index[traffic.node_of[src]] if by_node else src
            b = index[traffic.node_of[dst]] if by_node else dst
            matrix[a, b] += size
    figure, axes = plt.subplots(figsize=(8, 7), dpi=110)
    positive = matrix[matrix > 0]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    image = axes.imshow(np.where(matrix > 0, matrix, np.nan), cmap="viridis", norm=norm, interpolation="nearest")
    unit = "node" if by_node else "device"
    axes.set_title(title)
    axes.set_xlabel(f"destination {unit}")
    axes.set_ylabel(f"source {unit}")
    step = max(1, len(labels) // 16)
    axes.set_xticks(
        range(0, len(labels), step), [labels[i] for i in range(0, len(labels), step)], rotation=90, fontsize=6
    )
    axes.set_yticks(range(0, len(labels), step), [labels[i] for i in range(0, len(labels), step)], fontsize=6)
    figure.colorbar(image, ax=axes, label="bytes per iteration")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _explain_figure(ctx: CostContext, evaluation: Evaluation, blocks: list[Any], title: str, path: Path) -> None:
    """Gantt of one iteration (top) and memory per stage against capacity (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from predictor.schedule import stage_label

    colors = {"forward": "#4c78a8", "backward": "#f58518", "dp_sync": "#e45756", "optimizer": "#54a24b"}
    stages = evaluation.stages
    figure, (gantt, memory) = plt.subplots(
        2, 1, figsize=(11, 3 + 0.45 * len(stages) * 2), dpi=110, gridspec_kw={"height_ratios": [3, 2]}
    )
    for block in blocks:
        gantt.barh(
            block.stage,
            block.end_s - block.start_s,
            left=block.start_s,
            height=0.7,
            color=colors[block.kind],
            edgecolor="white",
            linewidth=0.3,
        )
    end = max(block.end_s for block in blocks)
    for i in range(len(stages)):
        gantt.barh(i, end, left=0, height=0.7, color="#dddddd", zorder=0)  # idle: bubble and p2p waits
    labels = [
        f"{stage_label(evaluation, i)}: {s.stage.group} L{s.stage.layer_start}-{s.stage.layer_end - 1} tp{s.stage.tp}"
        for i, s in enumerate(stages)
    ]
    gantt.set_yticks(range(len(stages)), labels, fontsize=8)
    gantt.invert_yaxis()
    gantt.set_xlabel("time in the iteration (s)")
    gantt.set_title(title)
    legend = [Patch(color=c, label=k.replace("_", " ")) for k, c in colors.items()]
    legend.append(Patch(color="#dddddd", label="idle (bubble, p2p wait)"))
    gantt.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, ncols=5)
    gib = 2**30
    parts = (
        ("weights", "weights_bytes", "#4c78a8"),
        ("grads", "grads_bytes", "#72b7b2"),
        ("optimizer", "optimizer_bytes", "#54a24b"),
        ("activations", "activation_bytes", "#f58518"),
    )
    bottom = [0.0] * len(stages)
    for name, field, color in parts:
        values = [getattr(s.memory, field) / gib for s in stages]
        memory.bar(range(len(stages)), values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, s in enumerate(stages):
        memory.hlines(
            s.memory_capacity_bytes / gib, i - 0.4, i + 0.4, colors="black", label="capacity" if i == 0 else None
        )
        memory.hlines(
            s.memory_usable_bytes / gib,
            i - 0.4,
            i + 0.4,
            colors="black",
            linestyles="dashed",
            label="usable" if i == 0 else None,
        )
    memory.set_xticks(
        range(len(stages)), [f"stage {stage_label(evaluation, i)}" for i in range(len(stages))], fontsize=8
    )
    memory.set_ylabel("GiB per device")
    memory.set_title("memory per stage")
    memory.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


@app.command()
def run(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")],
    cluster: Annotated[Path, typer.Option("--cluster", "-c", help="Cluster file of the plan.")],
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
    chosen = _predictor(predictor)
    measured = _load_profiles(profiles, loaded.model)

    def context(seen: ClusterSpec) -> CostContext:
        if measured:  # this machine's profiles as they are: the prediction the run is compared with
            return chosen.base_context(seen, loaded.model, loaded.training, measured)
        return chosen.context(seen, loaded.model, loaded.training)

    settings = RunSettings(steps=steps, seed=seed, dtype=loaded.training.dtype, timeout_s=timeout)
    console = _console()
    record = execute(loaded, cluster_spec, str(cluster), context, settings, progress=console.print)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if as_json:
        sys.stdout.write(json.dumps(record, indent=2) + "\n")
        return
    from rich.table import Table

    details = record["measurements"]
    table = Table(title=f"hetplan run: {record['name']}")
    table.add_column("stage")
    table.add_column("group")
    table.add_column("layers")
    table.add_column("speed", justify="right")
    table.add_column("compute s", justify="right")
    table.add_column("emulation s", justify="right")
    table.add_column("wait s", justify="right")
    families = len({stage.get("family", 0) for stage in details["stages"]})
    for stage in details["stages"]:
        table.add_row(
            f"{stage.get('family', 0)}.{stage['stage']}" if families > 1 else str(stage["stage"]),
            stage["group"],
            f"{stage['layers'][0]}-{stage['layers'][1] - 1}",
            f"{stage['emulate_speed']:g}",
            f"{stage['compute_s']:.3f}",
            f"{stage['emulation_s']:.3f}",
            f"{stage['wait_s']:.3f}",
        )
    console.print(table)
    reference = record["reference_match"]
    console.print(
        f"iteration: measured {record['measured_iteration_time_s']:.3f} s (median of steps 2-{steps}), predicted "
        f"{record['predicted_iteration_time_s']:.3f} s ({details['prediction_error']:+.1%})"
    )
    console.print(f"prediction from: {details['prediction_from']}")
    console.print("loss per step: " + ", ".join(f"{loss:.4f}" for loss in record["losses"]))
    if reference.get("checked"):
        verdict = "matches" if reference["match"] else "DOES NOT MATCH"
        console.print(
            f"step 1 loss {verdict} one process: {reference['run_loss']:.6f} vs {reference['reference_loss']:.6f}"
        )
    if details["emulation"]:
        console.print(f"emulated: {details['emulated_groups']}: {details['emulation']}")
    console.print(f"run record written to {out}")


@app.command()
def export(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")],
    cluster: Annotated[Path, typer.Option("--cluster", "-c", help="Cluster file of the plan.")],
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
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        return
    from rich.markup import escape

    console = _console()
    console.print(f"{format}: {', '.join(sorted(exported.files))} and export.json written to {out}/")
    if exported.lost:
        console.print(f"{format} cannot express all of the plan; the files describe the closest plan it can run:")
        for item in exported.lost:
            console.print(f"  lost: {escape(item)}")
        console.print(f"  exported: {escape(summary['exported_strategy'])}")
    for note in exported.notes:
        console.print(f"note: {escape(note)}")
    console.print(
        f"predicted iteration: plan {exported.plan_iteration_time_s:.3f} s, exported "
        f"{exported.predicted_iteration_time_s:.3f} s ({summary['slowdown']:+.1%})"
    )
    console.print(f"{len(exported.nodes)} nodes: run launch.sh on each with NODE_RANK and MASTER_ADDR set")


@app.command()
def explain(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")],
    cluster: Annotated[Path, typer.Option("--cluster", "-c", help="Cluster file of the plan.")],
    predictor: PredictorOpt = None,
    png: Annotated[Optional[Path], typer.Option(help="Write the schedule and memory picture here.")] = None,
    html: Annotated[Optional[Path], typer.Option(help="Write a self-contained HTML report here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The plan's pipeline schedule (Gantt), memory per stage against capacity, and its bottleneck in words."""
    import base64
    import tempfile

    from planner import predict as run_predict
    from predictor.schedule import bottleneck_words, pipeline_timeline, stage_label

    loaded, cluster_spec = _plan_and_cluster(plan_file, cluster)
    ctx = _predictor(predictor).context(cluster_spec, loaded.model, loaded.training)
    evaluation = run_predict(ctx, loaded.strategy, str(plan_file))
    blocks = pipeline_timeline(ctx, evaluation)
    words = bottleneck_words(ctx, evaluation)
    if evaluation.strategy.virtual_stages > 1:
        drawn = max(b.end_s for b in blocks if b.kind in ("forward", "backward"))
        words.append(
            f"Interleaved 1F1B (v={evaluation.strategy.virtual_stages}, Megatron's order) is drawn chunk by chunk: "
            f"its pipeline ends at {drawn:.3f} s, the cost model's closed form says {evaluation.pipeline_time_s:.3f} s "
            f"({drawn / evaluation.pipeline_time_s - 1:+.1%})."
        )
    title = f"{loaded.model.key} on {cluster_spec.name}: one iteration, {evaluation.iteration_time_s:.3f} s predicted"
    picture = png
    if html is not None and picture is None:
        picture = Path(tempfile.mkdtemp()) / "explain.png"
    if picture is not None:
        _explain_figure(ctx, evaluation, blocks, title, picture)
    if html is not None:
        assert picture is not None
        encoded = base64.b64encode(picture.read_bytes()).decode()
        rows = "".join(
            f"<tr><td>{stage_label(evaluation, i)}</td><td>{s.stage.group}</td>"
            f"<td>{s.stage.layer_start}-{s.stage.layer_end - 1}</td>"
            f"<td>{s.stage.tp}</td><td>{s.compute_time_s * 1e3:.1f}</td><td>{s.memory.total_bytes / 2**30:.1f}</td>"
            f"<td>{s.memory_usable_bytes / 2**30:.1f}</td></tr>"
            for i, s in enumerate(evaluation.stages)
        )
        html.write_text(
            "<!doctype html><html><head><meta charset='utf-8'><title>hetplan explain</title></head><body>"
            f"<h1>{title}</h1><ul>{''.join(f'<li>{w}</li>' for w in words)}</ul>"
            f"<img alt='schedule and memory' src='data:image/png;base64,{encoded}'>"
            "<table border='1'><tr><th>stage</th><th>group</th><th>layers</th><th>tp</th><th>fwd+bwd/mb ms</th>"
            f"<th>memory GiB</th><th>usable GiB</th></tr>{rows}</table></body></html>\n",
            encoding="utf-8",
        )
    body = {
        "iteration_time_s": evaluation.iteration_time_s,
        "flush_s": max(b.end_s for b in blocks if b.kind in ("forward", "backward")),
        "bottleneck": words,
        "png": str(png) if png else None,
        "html": str(html) if html else None,
    }
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    console = _console()
    console.print(f"[bold]{title}[/bold]")
    for line in words:
        console.print(f"  - {line}")
    for name, path in (("picture", png), ("report", html)):
        if path is not None:
            console.print(f"{name} written to {path}")


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
    from planner.plan import describe_strategy
    from planner.replan import changed_cluster
    from planner.replan import replan as run_replan
    from specs.errors import SpecError

    loaded, original = _plan_and_cluster(plan_file, cluster)
    if not without and not add:
        raise SpecError("--without/--add", "", "say what changed, e.g. --without node:ascend/17")
    new_cluster = changed_cluster(original, without or [], add or [])
    chosen = _predictor(predictor)
    old_ctx = chosen.context(original, loaded.model, loaded.training)
    from planner import predict as run_predict

    old = run_predict(old_ctx, loaded.strategy, str(plan_file))
    result = run_replan(new_cluster, loaded.model, loaded.training, loaded.strategy, chosen)
    new = result.plan.evaluation
    if out is not None:
        result.plan.save(out)
    body = {
        "cluster_devices": {"before": original.num_devices, "after": new_cluster.num_devices},
        "old": {
            "summary": describe_strategy(old.strategy),
            "iteration_time_s": old.iteration_time_s,
            "tokens_per_s": old.tokens_per_s,
        },
        "old_adapted": (
            {
                "summary": describe_strategy(result.adapted.strategy),
                "iteration_time_s": result.adapted.iteration_time_s,
                "tokens_per_s": result.adapted.tokens_per_s,
            }
            if result.adapted
            else None
        ),
        "new": {
            "summary": describe_strategy(new.strategy),
            "iteration_time_s": new.iteration_time_s,
            "tokens_per_s": new.tokens_per_s,
        },
        "throughput_change": new.tokens_per_s / old.tokens_per_s - 1,
        "replan_time_s": round(result.replan_time_s, 3),
        "warm_started": result.adapted is not None,
    }
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    from rich.markup import escape

    console = _console()
    console.print(f"cluster: {original.num_devices} -> {new_cluster.num_devices} devices")
    console.print(f"before:  {old.iteration_time_s:.3f} s, {old.tokens_per_s:,.0f} tokens/s")
    console.print(f"         {escape(body['old']['summary'])}")
    if result.adapted is not None:
        console.print(
            f"old plan shrunk to fit: {result.adapted.iteration_time_s:.3f} s, {result.adapted.tokens_per_s:,.0f} "
            f"tokens/s  {escape(body['old_adapted']['summary'])}"
        )
    else:
        console.print("old plan shrunk to fit: cannot run on the changed cluster")
    console.print(f"after:   {new.iteration_time_s:.3f} s, {new.tokens_per_s:,.0f} tokens/s")
    console.print(f"         {escape(body['new']['summary'])}")
    console.print(
        f"throughput {body['throughput_change']:+.1%}; re-planned in {result.replan_time_s:.2f} s"
        f"{' (warm-started from the old plan)' if result.adapted else ''}"
    )
    if out is not None:
        console.print(f"plan written to {out}")


@app.command()
def traffic(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")],
    cluster: Annotated[Optional[Path], typer.Option("--cluster", "-c", help="Cluster file of the plan.")] = None,
    tokens: Annotated[Optional[float], typer.Option(help="Dataset tokens per epoch (for per-epoch totals).")] = None,
    epochs: Annotated[float, typer.Option(help="Epochs (with --tokens).")] = 1.0,
    png: Annotated[Optional[Path], typer.Option(help="Write the per-pair traffic heatmap here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Bytes per iteration (and epoch) by parallel dimension and link class; rail-only check."""
    from predictor.cost_model import build_context
    from predictor.traffic import DIMENSIONS, LINK_CLASSES, strategy_traffic
    from specs.errors import SpecError

    if cluster is None:
        raise SpecError("--cluster", "", "required: the cluster file the plan was made for")
    loaded, cluster_spec = _plan_and_cluster(plan_file, cluster)
    ctx = build_context(cluster_spec, loaded.model, loaded.training)
    result = strategy_traffic(ctx, loaded.strategy)
    table = result.by_dimension_and_link()
    tokens_per_iteration = ctx.training.global_batch_size * ctx.seq_length
    iterations = epochs * tokens / tokens_per_iteration if tokens else None
    spine = result.spine_pairs()
    breaking = sorted(
        {
            result.group_of[src]
            for d in DIMENSIONS
            for (src, dst) in result.pairs[d]
            if result.link_class(src, dst) == "spine"
        }
    )
    relay_bytes = max(
        (
            sum(
                size
                for (src, dst), size in result.pairs[d].items()
                if src == device and result.link_class(src, dst) == "spine"
            )
            for device in range(len(result.device_names))
            for d in DIMENSIONS
        ),
        default=0.0,
    )
    body: dict[str, Any] = {
        "plan": str(plan_file),
        "bytes_per_iteration": {d: {k: round(v) for k, v in table[d].items()} for d in DIMENSIONS},
        "total_bytes_per_iteration": round(result.total_bytes()),
        "iterations": iterations,
        "bytes_total": (
            {d: {k: round(v * iterations) for k, v in table[d].items()} for d in DIMENSIONS} if iterations else None
        ),
        "rail_only": {
            "ok": not any(spine.values()),
            "spine_bytes_per_iteration": {d: round(v) for d, v in spine.items()},
            "groups_breaking_it": breaking,
            "relay_bytes_per_iteration_worst_device": round(relay_bytes),
        },
    }
    if png is not None:
        _traffic_heatmap(result, f"{loaded.model.key} on {cluster_spec.name}: bytes per iteration", png)
        body["png"] = str(png)
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    from rich.table import Table

    console = _console()
    title = "Traffic per iteration, GB" + (f" (and over {iterations:,.0f} iterations, TB)" if iterations else "")
    out = Table(title=title)
    out.add_column("dimension")
    for link in LINK_CLASSES:
        out.add_column(link, justify="right")
    for d in DIMENSIONS:
        cells = []
        for link in LINK_CLASSES:
            cell = f"{table[d][link] / 1e9:,.1f}"
            if iterations:
                cell += f" ({table[d][link] * iterations / 1e12:,.1f})"
            cells.append(cell)
        out.add_row(d, *cells)
    console.print(out)
    if body["rail_only"]["ok"]:
        console.print("rail-only: ok, every cross-node byte stays on one rail (same local rank)")
    else:
        console.print(
            f"rail-only: NO, {sum(spine.values()) / 1e9:,.1f} GB per iteration cross nodes off-rail "
            f"(groups {', '.join(breaking)}); on a rail-only fabric they are relayed through the node "
            f"(worst device relays {relay_bytes / 1e9:,.2f} GB per iteration over its in-node link)"
        )
    if png is not None:
        console.print(f"heatmap written to {png}")


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
    from predictor.traffic import textbook_traffic_per_rank
    from specs.model import load_model

    spec = load_model(model)
    seq = seq_len or spec.seq_length
    per_rank = textbook_traffic_per_rank(
        params=spec.total_params(),
        layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        tokens=tokens,
        global_batch_tokens=global_batch * seq,
        ranks=gpus,
        grad_bytes=grad_bytes,
    )
    body = {
        "model": spec.key,
        "params": spec.total_params(),
        "tokens": tokens,
        "steps": tokens / (global_batch * seq),
        "ranks": gpus,
        "bytes_per_rank": per_rank,
    }
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    console = _console()
    console.print(
        f"{spec.key}: {spec.total_params() / 1e9:.1f}B params, {tokens:,.0f} tokens = {body['steps']:,.0f} steps of "
        f"{global_batch} x {seq} tokens, {gpus} ranks"
    )
    for name, value in per_rank.items():
        console.print(f"  {name:<5} {value / 1e15:,.2f} PB sent per rank ({value * gpus / 1e15:,.2f} PB in all)")


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

    from specs.errors import SpecError, TorchMissingError

    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissingError("`hetplan comm-bench`") from None
    from comm.bench import links_from_bench, run_comm_bench
    from comm.vendors import VENDORS

    names = [name.strip() for name in islands.split(",") if name.strip()]
    if len(names) != world:
        raise SpecError("--islands", "", f"expected {world} islands (one per rank), got {len(names)}")
    unknown = sorted(set(names) - set(VENDORS))
    if unknown:
        raise SpecError("--islands", "", f"unknown vendor(s) {unknown}; known: {', '.join(VENDORS)}")
    size_list = [_size_bytes(part.strip(), "--sizes") for part in sizes.split(",") if part.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        result = run_comm_bench(names, size_list, repeats, Path(scratch), timeout_s)
    if links_out is not None:
        links_out.write_text(json.dumps(links_from_bench(result), indent=2) + "\n", encoding="utf-8")
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    from rich.table import Table

    table = Table(title=f"all-reduce over {world} ranks, islands {', '.join(names)} (simulated on CPU, Gloo)")
    for column in ("size", "path", "time ms", "algbw GB/s", "busbw GB/s", "correct"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(
            f"{row['size_bytes']:,}",
            row["path"],
            f"{row['time_s'] * 1e3:.2f}",
            f"{row['algbw_bytes_per_s'] / 1e9:.3f}",
            f"{row['busbw_bytes_per_s'] / 1e9:.3f}",
            "yes" if row["correct"] else "[red]NO[/red]",
        )
    _console().print(table)
    if links_out is not None:
        _console().print(f"link profile written to {links_out}")


@app.command("simulate-profile")
def simulate_profile(
    device: Annotated[str, typer.Option(help="Catalog device key.")],
    model: ModelOpt,
    out: Annotated[Path, typer.Option(help="Profile JSON to write.")],
    micro_batches: Annotated[str, typer.Option(help="Micro-batch sizes.")] = "1,2,4,8",
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
    _console().print(f"{len(profile.entries)} entries written to {out}")


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
