"""hetplan command line: parses flags, calls the Python API (planner/, report/, ...), prints tables or JSON. The
commands that plan and use a plan live here; those that measure, fit and run in report/measuring.py, registered on
the same app; the flags and printing they share in report/cli_flags.py.

Heavy imports are lazy (inside the commands) so that `hetplan --help` and `import cli` stay fast. Flags are checked
by specs/flags.py and outputs before any work starts; every failure a user can cause ends as one line on stderr and
exit 2 (see `main`); long commands report progress on stderr (report/progress.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from predictor.context import CostContext
    from specs.model import ModelSpec
    from specs.training import TrainingSpec

from report import measuring, said
from report.cli_flags import (
    ENGINES,
    MEGATRON_FLAGS,
    ClusterOpt,
    DtypeOpt,
    FamiliesOpt,
    GlobalBatchOpt,
    JsonOpt,
    LowerBoundOpt,
    ModelOpt,
    OnceEachCommand,
    PlanArg,
    PlanClusterOpt,
    PlanOutOpt,
    PlanPredictorOpt,
    PlanProfilesOpt,
    PngOpt,
    PredictorOpt,
    ProfilesOpt,
    QuietOpt,
    SeqLenOpt,
    TrainingOpt,
    UnevenOpt,
    ZeroOpt,
    finite,
    on_cluster,
    opt,
    plan_costs_said,
    predictor_from,
    profiles_said,
    progress_on_stderr,
    show,
    written,
)

PIPED_HELP_WIDTH_COLUMNS = 120  # rich's 80 columns cut --help's long flag names ("--sequence-par…") when piped

app = typer.Typer(
    name="hetplan",
    help="Plan large-model training on clusters that mix accelerator types and vendors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def installed_version() -> str:
    """hetplan's version as installed (pyproject.toml's); 'unknown' when the source tree runs uninstalled."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetplan")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"hetplan {installed_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Plan large-model training on clusters that mix accelerator types and vendors."""


# ---- planning ---------------------------------------------------------------------------------------------------
def _check_search_choices(
    training_spec: TrainingSpec, model_spec: ModelSpec, training: Path | None, given: dict[str, object]
) -> None:
    """The micro-batch sizes and context-parallel degrees `plan` searches, against the batch and the sequence, each
    named by the flag that set it (`given`: the flags' values, None where not given), else the training file's
    field."""
    file = str(training) if training is not None else "training"
    by_flag = "--micro-batch-sizes" if given["micro_batch_sizes"] is not None else "--global-batch"
    if given["micro_batch_sizes"] is None and given["global_batch_size"] is None:
        by_flag = ""
    training_spec.check_micro_batches(*((by_flag, "") if by_flag else (file, "micro_batch_sizes")))
    cp_named = ("--cp", "") if given["context_parallel"] is not None else (file, "context_parallel")
    training_spec.check_context_parallel(training_spec.seq_length or model_spec.seq_length, *cp_named)


@app.command()
def plan(
    cluster: ClusterOpt,
    model: ModelOpt,
    training: TrainingOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    dtype: DtypeOpt = None,
    zero_stage: ZeroOpt = None,
    recompute: Annotated[Optional[str], opt(help="Allowed modes, e.g. none,selective,full.")] = None,
    micro_batch_sizes: Annotated[Optional[str], opt(help="Candidates, e.g. 1,2,4,8.")] = None,
    virtual_stages: Annotated[Optional[str], opt(help="Interleaving chunks to try, e.g. 1,2,4.")] = None,
    uneven_batch: UnevenOpt = None,
    families: FamiliesOpt = None,
    profiles: ProfilesOpt = None,
    top_k: Annotated[int, opt(min=1, help="Also list the next best alternatives.")] = 1,
    predictor: PredictorOpt = None,
    lower_bound: LowerBoundOpt = False,
    max_candidates: Annotated[
        Optional[int],
        opt(
            "--max-candidates",
            min=1,
            help="Candidates a search solves before it stops and reports how far below the plan the least bound "
            "left lies (default 2,000; exact when it does not stop); stopped over every group, the plans that "
            "leave a group idle get as many again.",
        ),
    ] = None,
    engine: Annotated[Optional[str], opt(help="Only plans this engine runs as planned: " + ENGINES + ".")] = None,
    zero_stages: Annotated[Optional[str], opt(help="ZeRO stages to search, e.g. 1,2,3 (fastest wins).")] = None,
    cp: Annotated[
        Optional[str], opt("--cp", help="Context-parallel degrees to search, e.g. 1,2,4 (default: by sequence length).")
    ] = None,
    zero_shard: Annotated[
        Optional[str],
        opt("--zero-shard", help="Where ZeRO shards, to search: dp (whole group), node (hybrid) or dp,node (both)."),
    ] = None,
    out: PlanOutOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Search for the fastest plan that fits memory."""
    from planner import plan as make_plan
    from planner.plan import LoadedPlan
    from planner.what_if import local_run
    from report.tables import alternatives_lines, evaluation_tables, hint_lines, plan_rows
    from specs import flags
    from specs.cluster import load_cluster
    from specs.engines import get_engine
    from specs.errors import SpecError
    from specs.model import hf_sequence_note, hf_unmodelled_note, load_model
    from specs.training import on_groups

    reads = {"--cluster": cluster, "--model": model, "--training": training, "--predictor": predictor}
    flags.output_file(out, "--out", reads={**reads, "--profiles": profiles}, writes="a plan")
    if zero_stage is not None and zero_stages is not None:  # the search took --zero-stages, dropping --zero-stage
        raise SpecError("--zero-stage", str(zero_stage), "plans with one ZeRO stage, --zero-stages searches several: "
                        "pass one of the two")  # fmt: skip
    cluster_spec, model_spec = load_cluster(cluster), load_model(model, "--model")
    given = {"global_batch_size": global_batch, "seq_length": seq_len, "dtype": dtype, "zero_stage": zero_stage}
    given |= {"recompute": flags.names(recompute) if recompute is not None else None, "uneven_batch": uneven_batch}
    given |= {"micro_batch_sizes": flags.int_list(micro_batch_sizes, "--micro-batch-sizes"), "families": families}
    given |= {"virtual_stages": flags.int_list(virtual_stages, "--virtual-stages")}
    given |= {"context_parallel": flags.int_list(cp, "--cp")}
    training_spec = flags.training(training, **given)  # plan() trains it on the devices (stats' training_note)
    _check_search_choices(training_spec, model_spec, training, given)
    defaulted = engine is None and "dtype" not in training_spec.model_fields_set  # plan() will choose it so
    said_before = on_groups(training_spec, cluster_spec.groups)[1] if defaulted else ""
    if said_before:  # said before the search, so that a plan that does not fit still says its dtype
        said.say(said_before)
    for note in (hf_sequence_note(model_spec, training_spec), hf_unmodelled_note(model_spec, training_spec.seq_length)):
        if note:  # a config.json's longest context taken, what it sets and hetplan does not model
            said.say(note)
    devices = [group.device.key for group in cluster_spec.groups]
    inputs = (cluster_spec, model_spec, training_spec, profiles_said(profiles, model_spec, devices))
    chosen_engine = get_engine(engine, "--engine", "") if engine is not None else None
    plan_predictor = predictor_from(predictor)
    options = {
        "top_k": top_k,
        "predictor": plan_predictor,
        "lower_bound": lower_bound,
        "engine": chosen_engine,
    }
    if max_candidates is not None:
        options["max_candidates"] = max_candidates
    options["zero_stages"] = flags.zero_stages(zero_stages)
    options["zero_shards"] = flags.choices(zero_shard, ("dp", "node"), "--zero-shard") if zero_shard is not None else []
    with progress_on_stderr("plan", quiet, unit="candidates") as progress:
        result = make_plan(*inputs, progress=progress.counter("searched"), **options)
    training_note = result.search_stats.get("training_note")
    if training_note and f"note: {training_note}" != said_before:
        said.say(f"note: {training_note}")
    if out is not None:
        result.save(out)
    made = LoadedPlan(result.strategy, result.context.model, result.context.training, "the plan")
    local = local_run(made, cluster_spec, plan_predictor, inputs[3])
    body = {**result.to_dict(), **({"local_run": local.to_dict()} if local else {})}
    rows = plan_rows(body, result.interval)
    tables = evaluation_tables(result.context, result.evaluation, "hetplan plan", rows, local)
    hints = hint_lines(result.context, result.evaluation, chosen_engine)
    show(as_json, body, *tables, *alternatives_lines(body), *hints, *written("plan", out))


@app.command()
def predict(
    cluster: ClusterOpt,
    model: Annotated[Optional[str], opt("--model", "-m", help="Model (default: the plan's).")] = None,
    strategy: Annotated[Optional[Path], opt(help="Evaluate this plan JSON (any plan in the schema).")] = None,
    group: Annotated[Optional[str], opt(help="Group to use with Megatron-style flags.")] = None,
    tp: Annotated[Optional[int], opt(min=1, help="Tensor-parallel degree [default: 1].")] = None,
    pp: Annotated[Optional[int], opt(min=1, help="Pipeline stages (even layer split) [default: 1].")] = None,
    dp: Annotated[Optional[int], opt(min=1, help="Data-parallel replicas [default: 1].")] = None,
    micro_batch: Annotated[Optional[int], opt(min=1, help="Micro-batch size [default: 1].")] = None,
    recompute: Annotated[Optional[str], opt(help="none, selective or full [default: none].")] = None,
    sequence_parallel: Annotated[
        Optional[bool],
        opt("--sequence-parallel/--no-sequence-parallel", help="Megatron's SP [default: the training's, on]."),
    ] = None,
    virtual_stages: Annotated[Optional[int], opt(min=1, help="Interleaving chunks per stage [default: 1].")] = None,
    cp: Annotated[
        Optional[int], opt("--cp", min=1, help="Context-parallel degree (sequences split over ranks) [default: 1].")
    ] = None,
    training: TrainingOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    dtype: DtypeOpt = None,
    zero_stage: ZeroOpt = None,
    zero_shard: Annotated[Optional[str], opt("--zero-shard", help="dp (whole DP group) or node (hybrid).")] = None,
    attention: Annotated[Optional[str], opt(help="flash, or materialized (pre-flash Megatron).")] = None,
    profiles: Annotated[
        Optional[Path], opt("--profiles", help="Directory of profile JSON files (default: --strategy's).")
    ] = None,
    predictor: Annotated[Optional[Path], opt("--predictor", help="Predictor file (default: --strategy's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a given strategy (no search): Megatron-style --tp/--pp/--dp, or --strategy plan.json (with the
    costs the plan records unless --profiles/--predictor name others)."""
    from dataclasses import replace

    from planner.plan import LoadedPlan, evaluation_dict, header_dict, interval_dict, load_plan
    from planner.what_if import local_run, predicted, recorded_cluster, runs_as_planned, what_if
    from report.tables import evaluation_tables, interval_row
    from specs import flags
    from specs.cluster import load_cluster

    cluster_spec = load_cluster(cluster)
    overrides = dict(
        global_batch_size=global_batch, seq_length=seq_len, dtype=dtype, zero_stage=zero_stage, attention=attention
    )
    overrides["zero_shard"] = (
        flags.choice(zero_shard, ("dp", "node"), "--zero-shard") if zero_shard is not None else None
    )
    layout = dict(
        zip(MEGATRON_FLAGS, (group, tp, pp, dp, micro_batch, recompute, virtual_stages, sequence_parallel, cp))
    )
    if strategy is not None:  # a plan sets its own layout and training: a flag that would change them is refused
        from specs.errors import SpecError

        named = {field: flag for field, (flag, _) in MEGATRON_FLAGS.items()} | {"training": "--training"}
        for field, value in {**layout, "training": training}.items():
            if value is not None:
                raise SpecError(
                    named[field], "", "goes with the Megatron-style flags; a plan (--strategy) sets its own layout "
                    "and training (change its training with --seq-len, --dtype, --zero-stage)"
                )  # fmt: skip
    layout = {field: MEGATRON_FLAGS[field][1] if value is None else value for field, value in layout.items()}
    flags.training(None, **overrides)  # a bad flag is named as the flag, before a plan's training is read
    chosen = what_if(cluster_spec, cluster, strategy, model, training, overrides, layout)
    given_plan = load_plan(strategy) if strategy is not None else None  # (what_if checked it)
    if given_plan is not None:  # a re-planned plan is for the cluster its changes left
        cluster_spec = recorded_cluster(given_plan, cluster_spec, cluster)
    used = {stage.group for pipeline in chosen.strategy.pipelines for stage in pipeline.stages}
    chosen = replace(chosen, training=on_cluster(chosen.training, cluster_spec, used))
    if given_plan is not None:
        costs = plan_costs_said(given_plan, predictor, profiles, cluster_spec, model=chosen.model)
        chosen_predictor, measured = costs.predictor, costs.profiles
    else:
        from specs.model import hf_sequence_note, hf_unmodelled_note

        model_notes = (hf_sequence_note(chosen.model, chosen.training),
                       hf_unmodelled_note(chosen.model, chosen.training.seq_length))  # fmt: skip
        for note in (note for note in model_notes if note):
            said.say(note)
        devices = [group.device.key for group in cluster_spec.groups if group.name in used]  # --group's, not all
        chosen_predictor, measured = predictor_from(predictor), profiles_said(profiles, chosen.model, devices)
    ctx, evaluation, interval = predicted(chosen, cluster_spec, chosen_predictor, measured)
    body = {
        **header_dict(ctx),
        **evaluation_dict(ctx, evaluation),
        "iteration_time_interval_s": interval_dict(interval),
    }
    local = None
    if given_plan is not None and runs_as_planned(given_plan, chosen):
        made = LoadedPlan(chosen.strategy, chosen.model, chosen.training, chosen.source)
        local = local_run(made, cluster_spec, chosen_predictor, measured)
    body |= {"local_run": local.to_dict()} if local else {}
    tables = evaluation_tables(ctx, evaluation, "hetplan predict", [interval_row(interval)], local)
    show(as_json, body, *tables)


@app.command()
def devices(as_json: JsonOpt = False) -> None:
    """List the accelerator catalog."""
    from report.tables import devices_table
    from specs.device import device_catalog

    catalog = device_catalog()
    show(as_json, [d.model_dump() for d in catalog.values()], devices_table(catalog))


@app.command()
def models(
    names: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Catalog names or model files (YAML, config.json) to show; default: the catalog.",
            metavar="MODEL",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the model catalog, or the models given (their parameter counts and shapes, as plan reads them)."""
    from report.tables import models_table
    from specs.model import hf_unmodelled_note, load_model, model_catalog

    if names:
        chosen = {str(i): load_model(name, "MODEL", "") for i, name in enumerate(names)}  # (two config.json: one key)
        for note in (hf_unmodelled_note(m) for m in chosen.values()):
            if note:
                said.say(note)
    else:
        chosen = model_catalog()
    show(as_json, [dict(m.model_dump(), total_params=m.total_params()) for m in chosen.values()], models_table(chosen))


# ---- measuring, fitting and running (report/measuring.py) -------------------------------------------------------
app.command()(measuring.profile)
app.command("profile-comm")(measuring.profile_comm)
app.command()(measuring.fit)
app.command()(measuring.validate)
app.command()(measuring.run)
app.command()(measuring.launch)


# ---- using a plan -----------------------------------------------------------------------------------------------
@app.command()
def export(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    format: Annotated[str, opt("--format", "-f", help=ENGINES + ".")],
    out: Annotated[Path, opt(help="Directory to write the files into.")] = Path("export"),
    keep_layout: Annotated[
        bool,
        opt(
            "--keep-layout",
            help="Where the engine cannot express the plan, replace only those parts, even when the engine's own best "
            "plan is faster.",
        ),
    ] = False,
    predictor: PlanPredictorOpt = None,
    profiles: PlanProfilesOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the plan as an engine's arguments/config plus one torchrun command per node; when the engine cannot
    express the plan, say what is lost and write the closest plan it can run (the plan with those parts replaced,
    or the engine's best plan when faster: a note lists what that changes), with that plan's predicted time."""
    from planner.export import export_plan
    from planner.plan import describe_strategy
    from planner.what_if import plan_on_cluster
    from report.files import write_export
    from report.tables import export_lines
    from specs.engines import get_engine
    from specs.flags import output_directory

    output_directory(out, "--out", "export.json")
    # named as the registry does ('Megatron' is megatron); an unknown one first
    format = get_engine(format, "--format", "").key
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    costs = plan_costs_said(loaded, predictor, profiles, cluster_spec)
    ctx = costs.predictor.context(cluster_spec, loaded.model, loaded.training, costs.profiles)
    notes: list[str] = []

    def context_for(training: TrainingSpec) -> CostContext:  # the engine's dtype, where it trains in another
        engine_ctx, note = costs.context_in(cluster_spec, loaded.model, training)
        notes.extend([note] if note else [])
        return engine_ctx

    keep_kernels = loaded.training_names_engine or loaded.engine == format
    exported = export_plan(
        ctx, loaded.strategy, format, keep_layout, context_for, keep_kernels, cluster_changes=loaded.cluster_changes
    )
    for note in notes:
        said.say(note)
    summary = {**exported.summary(), "exported_strategy": describe_strategy(exported.strategy)}
    removed = write_export(exported, summary, out)
    if removed:  # another engine's files, as hetplan wrote them: they would mix two engines' launch files
        said.say(
            f"note: removed {', '.join(removed)} from {out}: the export there before wrote them, {format}'s does not"
        )
    show(as_json, summary, *export_lines(format, exported, summary, out))


@app.command()
def explain(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    predictor: PlanPredictorOpt = None,
    profiles: PlanProfilesOpt = None,
    png: PngOpt = None,
    html: Annotated[Optional[Path], opt(help="Write a self-contained HTML report here (.html).")] = None,
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
    costs = plan_costs_said(loaded, predictor, profiles, cluster_spec)
    with progress_on_stderr("explain", quiet, unit="steps") as progress:
        outputs = {"png": png, "html": html, "progress": progress.step, "profiles": costs.profiles}
        result = explain_plan(loaded, cluster_spec, costs.predictor, **outputs)
    words = [f"  - {line}" for line in result.bottleneck]
    show(
        as_json,
        result.to_dict(),
        f"[bold]{result.title}[/bold]",
        *words,
        *written("picture", png),
        *written("report", html),
    )


@app.command()
def replan(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    without: Annotated[Optional[list[str]], opt(help="Lost: node:GROUP/NUMBER or group:NAME:COUNT (repeat).")] = None,
    add: Annotated[Optional[list[str]], opt(help="New capacity: group:NAME:COUNT nodes (repeat).")] = None,
    predictor: PlanPredictorOpt = None,
    profiles: PlanProfilesOpt = None,
    out: PlanOutOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Re-plan after failures or additions, warm-started from the current plan; show what changed. A plan made for
    an engine (`plan --engine`) is re-planned within what that engine runs as planned."""
    from planner import predict as run_predict
    from planner.replan import CHANGE_FLAGS, cancelled_changes, changed_cluster
    from planner.replan import replan as run_replan
    from planner.what_if import check_changes, plan_on_cluster
    from report.replanning import replan_lines, replan_summary
    from specs.cluster import load_cluster
    from specs.engines import get_engine
    from specs.flags import output_file

    output_file(out, "--out", reads={"PLAN": plan_file, "--cluster": cluster}, writes="a plan")
    loaded, original = plan_on_cluster(plan_file, cluster)
    check_changes(without or [], add or [], original)
    engine = get_engine(loaded.engine, str(plan_file), "search.engine") if loaded.engine else None
    changes = [*(loaded.cluster_changes or ()), (without or [], add or [])]
    if loaded.cluster_nodes and loaded.cluster_changes is None:  # its nodes, not how they came (an older export's)
        new_cluster, history = changed_cluster(original, without or [], add or [], names=CHANGE_FLAGS), None
    else:  # made from the cluster file with every change since (a node lost in an earlier re-plan keeps its number)
        file_cluster = load_cluster(cluster)
        new_cluster = changed_cluster(file_cluster, without or [], add or [], changes[:-1], CHANGE_FLAGS)
        history = changes
    for cancelled in cancelled_changes(original, new_cluster, without or [], add or []):
        said.say(f"note: {cancelled}")
    costs = plan_costs_said(loaded, predictor, profiles, original, new_cluster)
    chosen, measured = costs.predictor, costs.profiles
    with progress_on_stderr("replan", quiet, unit="steps") as progress:
        progress.step("evaluating the old plan", 2)
        old_ctx = chosen.context(original, loaded.model, loaded.training, measured)
        old = run_predict(old_ctx, loaded.strategy, str(plan_file))
        progress.step("searching the changed cluster", 2)
        result = run_replan(
            new_cluster, loaded.model, loaded.training, loaded.strategy, chosen, profiles=measured, engine=engine,
            training_names_engine=loaded.training_names_engine,
            cluster_changes=history,
        )  # fmt: skip
    if out is not None:
        result.plan.save(out)
    body = replan_summary(original, new_cluster, old, result)
    show(as_json, body, *replan_lines(body, result.replan_time_s), *written("plan", out))


@app.command()
def traffic(
    plan_file: PlanArg,
    cluster: PlanClusterOpt,
    tokens: Annotated[Optional[float], opt(callback=finite(), help="Dataset tokens per epoch (for totals).")] = None,
    epochs: Annotated[Optional[float], opt(callback=finite(), help="Epochs (with --tokens) [default: 1].")] = None,
    png: Annotated[Optional[Path], opt(help="Write the per-pair traffic heatmap here (.png).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Bytes per iteration (and epoch) by parallel dimension and link class, summed over the devices that send
    them; rail-only check."""
    from planner.what_if import plan_on_cluster
    from report import traffic as plan_traffic
    from report.tables import traffic_table
    from specs.errors import SpecError
    from specs.flags import output_file

    if epochs is not None and tokens is None:
        raise SpecError("--epochs", "", "counts epochs of --tokens: give the dataset's tokens per epoch too")
    epochs = 1.0 if epochs is None else epochs
    output_file(png, "--png", (".png",))
    loaded, cluster_spec = plan_on_cluster(plan_file, cluster)
    result = plan_traffic(loaded, cluster_spec, tokens=tokens, epochs=epochs, png=png)
    show(as_json, result.to_dict(), traffic_table(result), *result.dp_parts_lines(), result.rail.sentence(),
         *written("heatmap", png))  # fmt: skip


@app.command("traffic-calc")
def traffic_calc(
    model: ModelOpt,
    tokens: Annotated[float, opt(callback=finite(), help="Training tokens (e.g. one epoch of the dataset).")],
    global_batch: Annotated[int, opt(min=1, help="Sequences per step.")],
    gpus: Annotated[int, opt(min=2, help="Ranks in the one parallel dimension.")],
    seq_len: SeqLenOpt = None,
    grad_bytes: Annotated[
        int, opt(help="Bytes per gradient value in the DP all-reduce: 1 (FP8), 2 (bf16/fp16) or 4 (fp32).")
    ] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Textbook per-rank traffic of DP, FSDP, TP and PP over a training run (standard ring volumes)."""
    from report import traffic_calc as textbook
    from report.network import check_grad_bytes
    from report.tables import traffic_calc_lines
    from specs.model import load_model

    check_grad_bytes(grad_bytes, "--grad-bytes", "")  # named as the flag, before the model is read
    spec = load_model(model, "--model")
    body = textbook(spec, tokens, global_batch, gpus, seq_length=seq_len, grad_bytes=grad_bytes)
    show(as_json, body, *traffic_calc_lines(body, global_batch, seq_len or spec.seq_length))


# ---- communicator and simulated profiles (report/measuring.py) --------------------------------------------------
app.command("comm-bench")(measuring.comm_bench)
app.command("simulate-profile")(measuring.simulate_profile)


def one_line_summaries(commands: list[typer.models.CommandInfo]) -> None:
    """Give each command its docstring's first paragraph as one line for the command list of `hetplan --help`: in
    rich markup mode typer keeps the docstring's line breaks there, so the summaries broke mid-sentence."""
    for command in commands:
        if command.short_help is None and command.callback is not None:
            first_paragraph = (command.callback.__doc__ or "").split("\n\n")[0]
            command.short_help = " ".join(first_paragraph.split())


one_line_summaries(app.registered_commands)


def options_once_each(commands: list[typer.models.CommandInfo]) -> None:
    """Every command refuses an option of one value given twice with different values (report/cli_flags.py)."""
    for command in commands:
        if command.cls in (None, typer.core.TyperCommand):  # typer's default (None in older typers)
            command.cls = OnceEachCommand


options_once_each(app.registered_commands)


# ---- the entry point ----------------------------------------------------------------------------------------------
def main() -> None:
    """Console entry point: user errors (usage errors included) print one line and exit 2, Ctrl-C prints
    'interrupted' and exits 130, anything else one line and exit 1; never a traceback unless HETPLAN_DEBUG=1."""
    import os

    from report.failures import exit_status

    for name in (
        "stdout",
        "stderr",
    ):  # closed by the caller (`2>&-`): Python leaves None, which print() takes as stdout
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 (open for the process's life)
    if not sys.stdout.isatty():  # piped --help: typer reads TERMINAL_WIDTH when it formats help
        os.environ.setdefault("TERMINAL_WIDTH", str(PIPED_HELP_WIDTH_COLUMNS))
    code = exit_status(app, sys.argv[1:])
    if "torch" in sys.modules:  # a rank's torch may abort its teardown (profiler/machine.py)
        from profiler.machine import end_rank_without_teardown, launched_by_torchrun

        if launched_by_torchrun():
            end_rank_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
