"""A plan for the terminal: rich tables of an evaluation (summary and stages), of the catalogs and of a plan's
traffic. The CLI prints what these return; units are converted here, at the edge (GiB, GB, tokens/s)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from planner.export import Export
    from planner.what_if import LocalRun
    from predictor.calibration import Interval
    from predictor.cost_model import CostContext, Evaluation
    from report.network import TrafficReport
    from specs.device import DeviceSpec
    from specs.engines import Engine
    from specs.model import ModelSpec

Row = tuple[str, str]
STAGE_COLUMNS = ("stage", "group", "device", "layers", "n", "tp", "recompute", "devices", "fwd+bwd/mb ms", "memory GiB")


def titled_table(title: str, columns: Iterable[str], left: Collection[str] | None = None) -> Table:
    """A table with these columns, all left-aligned, or only those in `left` with the rest (numbers) right-aligned.
    The first column names the row (a key, a stage) and is never wrapped or cut; the others give way."""
    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if left is None or column in left else "right", no_wrap=index == 0)
    return table


def gib(value: float) -> str:
    """Bytes as GiB with one decimal."""
    return f"{value / 2**30:.1f}"


def params(number: float) -> str:
    """A parameter count a reader can compare: '4.2M', '1.7B', '1.2T' (never '0.0B')."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if number >= scale:
            return f"{number / scale:.1f}{suffix}"
    return f"{number:.0f}"


def count(number: int, noun: str) -> str:
    """'1 stage', '3 stages'."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def interval_row(interval: Interval) -> Row:
    """The prediction's 90% interval and what it was estimated from."""
    return ("90% interval", f"{interval.low_s:.3f} - {interval.high_s:.3f} s (from {interval.basis})")


def strategy_summary(evaluation: Evaluation) -> str:
    """Families, micro-batching, recompute, ZeRO and schedule of the evaluated strategy in one line."""
    strategy = evaluation.strategy
    families = strategy.pipelines
    return (
        " + ".join(
            f"{count(p.replicas, 'replica')} x {count(len(p.stages), 'stage')}, micro-batch {p.micro_batch_size} x "
            + (f"{p.num_microbatches - 1}-{p.num_microbatches} (uneven)" if p.uneven else f"{p.num_microbatches}")
            + (f" ({p.micro_batch_size * p.microbatch_total} samples)" if len(families) > 1 else "")
            for p in families
        )
        + (f", context parallel {strategy.context_parallel}" if strategy.context_parallel > 1 else "")
        + f", recompute {strategy.recompute_summary}, "
        f"{strategy.zero_summary}{' per node (hybrid)' if strategy.zero_shard == 'node' else ''}, "
        f"{'1F1B' if strategy.virtual_stages == 1 else 'interleaved 1F1B'}"
        f"{'' if strategy.virtual_stages == 1 else f' (v={strategy.virtual_stages})'}"
    )


def _hidden_sync(evaluation: Evaluation) -> str:
    """Of the tail, a tied model's embedding matrix summed between the first and last stage (Evaluation.tied_sync_s:
    most of GPT-3 1.7B's on a100-v100-32, unsaid), and the DP sync overlapped (Evaluation.dp_sync_overlapped_s): a
    longer backward (a longer sequence, a larger micro-batch) hides more, and the tail shrank without a word (0.171 s
    to 0.031 s at 8192 tokens)."""
    hidden_s, tied_s = evaluation.dp_sync_overlapped_s, evaluation.tied_sync_s
    tied = f", {tied_s:.3f} of it the tied embedding's sum" if tied_s >= 0.0005 else ""
    return tied + (f"; {hidden_s:.3f} s of DP sync overlapped" if hidden_s >= 0.0005 else "")


def summary_rows(
    ctx: CostContext, evaluation: Evaluation, extra_rows: list[Row], local: LocalRun | None = None
) -> list[Row]:
    """The summary of an evaluation, with the command's own rows (interval, bounds, search) before the predictor."""
    return [
        (
            "cluster",
            f"{ctx.cluster.name} ({ctx.cluster.num_devices} device{'s' if ctx.cluster.num_devices > 1 else ''}, "
            f"{evaluation.devices_used} used)",
        ),
        ("model", f"{ctx.model.key} ({params(ctx.model.total_params())} params, {ctx.model.num_layers} layers)"),
        ("batch", f"{ctx.training.global_batch_size} x {ctx.seq_length} tokens, {ctx.training.dtype}"),
        ("strategy", strategy_summary(evaluation)),
        (
            "iteration",
            f"{evaluation.iteration_time_s:.3f} s (pipeline {evaluation.pipeline_time_s:.3f}, bubble "
            f"{evaluation.bubble_time_s:.3f}, DP sync + optimizer {evaluation.tail_time_s:.3f}"
            f"{_hidden_sync(evaluation)})",
        ),
        (
            "throughput",
            f"{evaluation.tokens_per_s:,.0f} tokens/s, {evaluation.samples_per_s:.2f} samples/s, "
            f"MFU {evaluation.mfu:.1%}",
        ),
        *local_run_rows(local),
        *extra_rows,
        ("predictor", escape(ctx.predictor_identity)),
        ("fits", "yes" if evaluation.fits else f"NO: short by {gib(evaluation.shortfall_bytes)} GiB per device"),
    ]


def local_run_rows(local: LocalRun | None) -> list[Row]:
    """On a cluster of CPU devices, what `hetplan run` predicts for the plan here where it differs from the plan's
    time, and why (planner.what_if.local_run)."""
    if local is None:
        return []
    return [("on this machine", f"`hetplan run` predicts {local.time_s:.3f} s: {'; '.join(local.reasons)}")]


def stage_table(ctx: CostContext, evaluation: Evaluation) -> Table:
    """One row per stage of each family (stages numbered family.stage when there are several): its devices over all
    replicas, its time and memory per device (in red where it does not fit)."""
    strategy = evaluation.strategy
    families = strategy.pipelines
    width = "TP x CP x replicas" if strategy.context_parallel > 1 else "TP x replicas"
    title = f"Stages (devices: {width}; time per micro-batch and memory per device)"
    table = titled_table(title, STAGE_COLUMNS, left=("group", "device", "recompute"))
    stage_numbers: dict[int, int] = {}
    for stage_eval in evaluation.stages:
        stage = stage_eval.stage
        pipeline = families[stage_eval.family]
        index = stage_numbers[stage_eval.family] = stage_numbers.get(stage_eval.family, -1) + 1
        memory = f"{gib(stage_eval.memory.total_bytes)} / {gib(stage_eval.memory_capacity_bytes)}"
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
    return table


def evaluation_tables(
    ctx: CostContext, evaluation: Evaluation, title: str, extra_rows: list[Row], local: LocalRun | None = None
) -> list[Table]:
    """The summary of an evaluation (titled like the command) and its stage table, for `plan` and `predict`;
    `local`: what `hetplan run` predicts for it on this machine (local_run_rows)."""
    summary = Table(title=title, show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    for name, value in summary_rows(ctx, evaluation, extra_rows, local):
        summary.add_row(name, value)
    return [summary, stage_table(ctx, evaluation)]


def plan_rows(body: Mapping[str, Any], interval: Interval | None) -> list[Row]:
    """What `plan` adds to the summary: the prediction's interval, the bounds, the gap and the search's effort."""
    rows = [interval_row(interval)] if interval else []
    rows.append(
        (
            "groups alone",
            f"{body['upper_bound_tokens_per_s']:,.0f} tokens/s (HETHUB's yardstick: the sum of each group's best "
            f"plan alone, not a bound; mixing groups can beat it): {body['fraction_of_upper_bound']:.1%} of it",
        )
    )
    rows.append(
        (
            "compute bound",
            f"{body['compute_bound_tokens_per_s']:,.0f} tokens/s (no bubble, no comm): "
            f"{body['fraction_of_compute_bound']:.1%} of it",
        )
    )
    if "iteration_time_lower_bound_s" in body:
        rows.append(
            (
                "lower bound",
                f"{body['iteration_time_lower_bound_s']:.3f} s per iteration for any plan searched: "
                f"this one is within {body['gap_to_lower_bound']:.1%}",
            )
        )
    search = body["search"]
    rows.append(
        (
            "search",
            f"{body['search_time_s']:.2f} s, {search['evaluated']} of {search['configurations']} configurations "
            "evaluated",
        )
    )
    if "engine" in search:
        changes = "; ".join([*search["engine_changes"], *([search["engine_note"]] if "engine_note" in search else [])])
        rows.append(
            (
                "engine",
                f"{search['engine']}: only plans it runs as planned (its export loses nothing)"
                + (f"; {changes}" if changes else ""),
            )
        )
    if "zero_stages_s" in search:
        stages = search["zero_stages_s"].items()
        times = [
            f"{'ZeRO-' if k.isdigit() else ''}{k} {'does not fit' if t is None else f'{t:.3f} s'}" for k, t in stages
        ]
        families = [p["zero_stage"] for p in body["pipelines"]]
        chosen = f"ZeRO-{families[0]}" if len(set(families)) == 1 else f"per family {tuple(families)}"
        rows.append(("ZeRO stages", f"{', '.join(times)}: {chosen} chosen"))
    if "zero_shard_s" in search:
        shards = search["zero_shard_s"].items()
        times = [f"{k} {'does not fit' if t is None else f'{t:.3f} s'}" for k, t in shards]
        rows.append(("ZeRO shards over", f"{', '.join(times)}: {body['zero_shard']} chosen"))
    if "context_parallel_s" in search:
        degrees = search["context_parallel_s"].items()
        times = [f"CP {k} {'does not fit' if t is None else f'{t:.3f} s'}" for k, t in degrees]
        rows.append(("context parallel", f"{', '.join(times)}: CP {body['context_parallel']} chosen"))
    if "idle_note" in search:
        rows.append(("idle groups", search["idle_note"]))
    if "note" in search:
        rows.append(("search note", search["note"]))
    return rows


def alternatives_lines(body: Mapping[str, Any]) -> list[str]:
    """The next best plans of `plan --top-k`, one line each (empty when there are none)."""
    if not body["alternatives"]:
        return []
    lines = [f"  {alt['iteration_time_s']:.3f} s  {escape(alt['summary'])}" for alt in body["alternatives"]]
    return ["[bold]Alternatives[/bold]", *lines]


def devices_table(catalog: Mapping[str, DeviceSpec]) -> Table:
    """The accelerator catalog, one device a row, in the units of datasheets."""
    columns = ("key", "name", "vendor", "TFLOP/s", "memory GB", "HBM TB/s", "in-node GB/s", "library", "aliases")
    table = titled_table("Accelerators (dense 16-bit peak; override per group in the cluster file)", columns)
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
    return table


def models_table(catalog: Mapping[str, ModelSpec]) -> Table:
    """The model catalog, one model a row: size and shape."""
    columns = ("key", "params", "layers", "hidden", "ffn", "heads", "kv", "vocab", "seq", "mlp", "tied")
    table = titled_table("Models", columns)
    for m in catalog.values():
        table.add_row(
            m.key,
            params(m.total_params()),
            str(m.num_layers),
            str(m.hidden_size),
            str(m.ffn_hidden_size),
            str(m.num_attention_heads) + (f" x {m.head_dim}" if m.head_dim else ""),  # a head_dim of its own
            str(m.num_kv_heads),
            str(m.vocab_size),
            str(m.seq_length),
            m.mlp,
            "yes" if m.tied_embeddings else "no",  # (embedding and output one matrix)
        )
    return table


def traffic_table(report: TrafficReport) -> Table:
    """GB per iteration by dimension (rows) and link class (columns), summed over every sending device, with TB
    over the run when it is known."""
    from predictor.traffic import DIMENSIONS, LINK_CLASSES

    table = report.by_dimension_and_link
    iterations = report.iterations
    over = f" (and over {iterations:,} iteration{'s' if iterations != 1 else ''}, TB)" if iterations else ""
    title = f"Traffic per iteration, GB sent, summed over all {len(report.traffic.device_names):,} devices{over}"
    out = titled_table(title, ("dimension", *LINK_CLASSES), left=("dimension",))
    for d in DIMENSIONS:
        cells = []
        for link in LINK_CLASSES:
            cell = f"{table[d][link] / 1e9:,.1f}"
            if iterations:
                cell += f" ({table[d][link] * iterations / 1e12:,.1f})"
            cells.append(cell)
        out.add_row(d, *cells)
    return out


def bytes_text(value: float) -> str:
    """Bytes in PB, or in the largest unit that shows them (a short run sends far less than a petabyte)."""
    units = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6))
    unit, size = next(((unit, size) for unit, size in units if value >= size), ("kB", 1e3))
    return f"{value / size:,.2f} {unit}"


def traffic_calc_lines(body: Mapping[str, Any], global_batch: int, seq_length: int) -> list[str]:
    """`traffic-calc` for the terminal: the run in a line, then PB sent per rank and in all per parallel style."""
    gpus, steps = body["ranks"], body["steps"]
    tokens = f"{body['tokens']:,.0f}" if body["tokens"] >= 1 else f"{body['tokens']:.2g}"
    rounded = " (rounded up: training takes whole steps)" if steps * global_batch * seq_length != body["tokens"] else ""
    lines = [
        f"{body['model']}: {params(body['params'])} params, {tokens} tokens = {steps:,} "
        f"step{'s' if steps != 1 else ''} of {global_batch} x {seq_length} tokens{rounded}, {gpus} ranks"
    ]
    for name, value in body["bytes_per_rank"].items():
        if value is None:
            lines.append(f"  {name:<5} n/a: {body['not_applicable'][name]}")
        else:
            lines.append(f"  {name:<5} {bytes_text(value)} sent per rank ({bytes_text(value * gpus)} in all)")
    return lines


def export_lines(format: str, exported: Export, summary: Mapping[str, Any], out: Path) -> list[str]:
    """What `export` wrote, what the engine could not express (and the closest plan it runs instead), notes, the
    predicted cost of the difference and how to launch."""
    lines = [f"{format}: {', '.join(sorted(exported.files))} and export.json written to {out}/"]
    if exported.lost:
        lines.append(f"{format} cannot express all of the plan; the files describe the closest plan it can run:")
        lines += [f"  lost: {escape(item)}" for item in exported.lost]
        lines.append(f"  exported: {escape(summary['exported_strategy'])}")
    lines += [f"note: {escape(note)}" for note in exported.notes]
    lines.append(
        f"predicted iteration: plan {exported.plan_iteration_time_s:.3f} s, exported "
        f"{exported.predicted_iteration_time_s:.3f} s ({summary['slowdown']:+.1%})"
    )
    lines.append(f"{len(exported.nodes)} nodes: run launch.sh on each with NODE_RANK and MASTER_ADDR set")
    return lines


def hint_lines(ctx: CostContext, evaluation: Evaluation, engine: Engine | None = None) -> list[str]:
    """What the user could allow for a faster plan, when the plan shows it: a prime global batch (or idle devices)
    under `--uneven-batch off`, where every replica count must divide the batch; none for a plan made for an engine
    that runs no uneven batches (`engine`: the flag would not help: its idle devices are another vendor's, say)."""
    training, cluster = ctx.training, ctx.cluster
    if training.uneven_batch != "off" or (engine is not None and not engine.uneven_batch):
        return []
    batch = training.global_batch_size
    trainable = sum(g.num_devices for g in cluster.trains_in(training.dtype))
    idle = trainable - evaluation.devices_used  # (groups without the dtype are idle by it: the idle groups row)
    flag = "`--uneven-batch exhaustive` lets replicas take uneven shares (whole micro-batches; a longer search)"
    prime = batch > 3 and all(batch % d for d in range(2, math.isqrt(batch) + 1))
    if prime and max(p.replicas for p in evaluation.strategy.pipelines) == 1:
        return [f"hint: the global batch {batch} is prime, so no replica count above 1 divides it; {flag}"]
    if prime and len(evaluation.strategy.pipelines) > 1:  # families split it, each family's replicas their share
        return [f"hint: the global batch {batch} is prime: only the families' shares of it split evenly; {flag}"]
    replicas = sum(p.replicas for p in evaluation.strategy.pipelines)
    if idle > 0 and replicas < batch:  # (a replica takes at least one sample: a batch of 1 has no more to share)
        return [f"hint: {idle:,} of {trainable:,} devices are idle; {flag}, which may use them"]
    return []
