"""Measurements for the terminal: collective timings and their alpha-beta fits (`profile-comm`), a fitted predictor
(`fit`), a run record (`run`) and the cross-vendor all-reduce bench (`comm-bench`). Each function returns what the
CLI prints, rich tables or lines, from the JSON body the command also writes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from profiler.machine import OTHER_WORK_LIMIT_CORES
from report.elastic import says_losses
from report.tables import titled_table
from specs.units import GIB

Renderable = Table | str


def link_profile_tables(profile: Mapping[str, Any], link_class: str) -> list[Table]:
    """Every timed point (nccl-tests convention: algbw and busbw), then the alpha-beta fit per collective and size."""
    columns = (
        "collective",
        "ranks",
        "per core",
        "size",
        "time us",
        "mean us",
        "cpu us",
        "algbw GB/s",
        "busbw GB/s",
        "ok",
    )
    title = "Collectives (nccl-tests convention; sizes are whole buffers; mean: a rank's average wait; cpu: its CPU)"
    table = titled_table(title, columns, left=("collective",))
    for p in profile["points"]:
        table.add_row(
            p["collective"],
            str(p["ranks"]),
            f"{p.get('processes_per_core', 1.0):g}",
            f"{p['size_bytes'] / 2**10:,.0f} KiB",
            f"{p['time_s'] * 1e6:,.0f}",
            f"{p.get('mean_time_s', 0.0) * 1e6:,.0f}",
            f"{p['mean_cpu_time_s'] * 1e6:,.0f}" if p.get("mean_cpu_time_s") else "-",
            f"{p['algbw_bytes_per_s'] / 1e9:.2f}",
            f"{p['busbw_bytes_per_s'] / 1e9:.2f}",
            "yes" if p["correct"] else "NO",
        )
    columns = ("collective", "ranks", "per core", "alpha us", "busbw GB/s", "median err", "max err")
    fits = titled_table(f"Alpha-beta fits of the median times ({link_class})", columns, left=("collective",))
    for f in profile["links"]:
        fits.add_row(
            f["collective"],
            str(f["ranks"]),
            f"{f.get('processes_per_core', 1.0):g}",
            f"{f['alpha_s'] * 1e6:.1f}",
            f"{f['busbw_bytes_per_s'] / 1e9:.2f}" if f["busbw_bytes_per_s"] else "- (latency-bound)",
            f"{f['fit_median_rel_error']:.1%}",
            f"{f['fit_max_rel_error']:.1%}",
        )
    return [table, fits]


def fit_renderables(body: Mapping[str, Any]) -> list[Renderable]:
    """A fitted predictor (`Predictor.describe()`): layer models and their cross-validated error, links, and how
    calibration moved each run's prediction toward its measurement."""
    out: list[Renderable] = []
    if body["layer_models"]:
        table = titled_table("Layer models (cross-validated)", ("device", "profiles", "rms error of log time"))
        for key, info in body["layer_models"].items():
            table.add_row(key, str(len(info["trained_on"])), f"{info['cv_log_error_rms']:.1%}")
        out.append(table)
    for key, info in body["links"].items():
        out.append(
            f"link {key}: busbw {info['busbw_bytes_per_s'] / 1e9:.2f} GB/s, alpha {info['alpha_s'] * 1e6:.1f} us, "
            f"+{info['slowdown_per_doubling']:.1%} per doubling of ranks (median fit error "
            f"{info['fit_median_rel_error']:.1%})"
        )
    table = titled_table("Calibration runs", ("run", "measured s", "uncalibrated s", "calibrated s"))
    for run in body["calibration"]["runs"]:
        table.add_row(
            run["name"],
            f"{run['measured_iteration_time_s']:.3f}",
            f"{run['uncalibrated_iteration_time_s']:.3f}",
            f"{run['calibrated_iteration_time_s']:.3f}",
        )
    out.append(table)
    terms = ", ".join(f"{k} {v['value']:+.3f} (sd {v['sd']:.3f})" for k, v in body["calibration"]["parameters"].items())
    out.append(f"fitted terms: {terms or 'none (no runs)'}")
    return out


def validation_renderables(body: Mapping[str, Any]) -> list[Renderable]:
    """`hetplan validate` (and the end of `fit`): every run predicted against its measurement, the error per device
    family, the worst runs with the term that dominates them, and leave-one-source-out where computed."""
    columns = ("run", "family", "measured s", "predicted s", "error", "largest term")
    table = titled_table(f"Runs predicted by {body['predictor']}", columns, left=("run", "family", "largest term"))
    by_name = {}
    for run in body["runs"]:
        by_name[run["name"]] = run
        table.add_row(
            run["name"],
            run["family"],
            f"{run['measured_s']:.3f}",
            f"{run['predicted_s']:.3f}",
            f"{run['error']:+.1%}",
            f"{run['dominant_term']} {run['dominant_share']:.0%}",
        )
    out: list[Renderable] = [table, _family_table("Error per device family", body["families"])]
    worst = [by_name[name] for name in body["worst"]]
    out.append("worst: " + "; ".join(f"{r['name']} {r['error']:+.1%} ({r['dominant_term']})" for r in worst))
    if body.get("in_sample_runs"):
        count, every = body["in_sample_runs"], len(body["runs"])
        which = "these runs" if count == every else f"{count} of these {every} runs"
        out.append(f"note: the predictor was calibrated on {which}: their errors are in-sample "
                   "(--leave-one-source-out predicts each source from the others)")  # fmt: skip
    if "leave_one_source_out" in body:
        held = body["leave_one_source_out"]
        if "not_computed" in held:
            out.append(f"leave one source out: not computed: {held['not_computed']}")
        else:
            out.append(_family_table("Leave one source out (each source predicted from the others)", held["families"]))
    return out


def _family_table(title: str, families: Sequence[Mapping[str, Any]]) -> Table:
    columns = ("family", "runs", "sources", "MAPE", "mean error", "worst run")
    table = titled_table(title, columns, left=("family", "worst run"))
    for row in families:
        table.add_row(
            row["family"],
            str(row["runs"]),
            str(row["sources"]),
            f"{row['mape']:.1%}",
            f"{row['mean_error']:+.1%}",
            f"{row['worst_run']} ({row['worst_error']:+.1%})",
        )
    return table


def run_table(record: Mapping[str, Any]) -> Table:
    """Per stage of a run record: the layers, the emulated speed, and where the time went."""
    details = record["measurements"]
    columns = ("stage", "group", "layers", "speed", "compute s", "emulation s", "wait s")
    table = titled_table(f"hetplan run: {record['name']}", columns, left=("stage", "group", "layers"))
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
    return table


def run_terms_table(record: Mapping[str, Any]) -> Table | None:
    """Per stage, the step split into the cost model's terms, measured (the stage's slowest rank, median step) beside
    predicted, and the difference: where a run and its prediction disagree. None for records without terms."""
    stages = record["measurements"].get("terms")
    if not stages:
        return None
    columns = ("stage", "term", "measured s", "predicted s", "difference s", "of the step", "cpu s: run (simulated)")
    table = titled_table("Where the step goes: measured vs predicted per stage", columns, left=("stage", "term"))
    families = len({stage["family"] for stage in stages})
    for stage in stages:
        name = f"{stage['family']}.{stage['stage']}" if families > 1 else str(stage["stage"])
        step = stage["step"]["measured_s"]
        cpu = stage.get("cpu_s") or {}  # the process's CPU time in the term: near its wall time, a busy core
        simulated = stage.get("predicted_cpu_s") or {}  # a process's in the step simulation of the cores' sharing
        rows = [*stage["terms"].items(), ("step", stage["step"])]
        for index, (term, values) in enumerate(rows):
            measured, predicted = values["measured_s"], values["predicted_s"]
            difference = measured - predicted
            table.add_row(
                f"{name} {stage['group']} (rank {stage['rank']})" if index == 0 else "",
                f"[bold]{term}[/bold]" if term == "step" else term,
                f"{measured:.3f}",
                f"{predicted:.3f}",
                f"{difference:+.3f}",
                f"{difference / step:+.0%}" if step > 0 else "",
                cpu_cell(cpu.get(term), simulated.get(term)),
                end_section=term == "step",
            )
    return table


def cpu_cell(measured_s: float | None, simulated_s: float | None) -> str:
    """A term's measured CPU seconds and, in brackets, the simulated ones (either may be missing)."""
    parts = [
        f"{measured_s:.3f}" if measured_s is not None else "",
        f"({simulated_s:.3f})" if simulated_s is not None else "",
    ]
    return " ".join(part for part in parts if part)


def measured_steps_words(steps: int, trained: int) -> str:
    """Which steps the measurement is the median of (runtime.launch.summarize: the lower one of an even count): a run
    of `steps` steps that trained the last `trained` of them (fewer when it resumed from a checkpoint), the first of
    those its warm-up."""
    first = steps - trained + 1
    if trained == 3:
        return f"the faster of steps {first + 1} and {steps}"
    if trained > 3:
        return f"{'lower ' if trained % 2 else ''}median of steps {first + 1}-{steps}"
    if trained == 2:
        return f"step {steps}"
    return f"step {steps}, with its warm-up"


def run_lines(record: Mapping[str, Any]) -> list[str]:
    """A run record's verdict: measured against predicted, the losses, the check against one process, emulation."""
    details = record["measurements"]
    reference = record["reference_match"]
    which = measured_steps_words(details["steps"], len(details["step_times_s"]))
    first_step = details["steps"] - len(record["losses"])  # a resumed run trained the steps after its checkpoint's
    losses = ", ".join(f"{loss:.4f}" for loss in record["losses"])
    lines = [
        f"iteration: measured {record['measured_iteration_time_s']:.3f} s ({which}), predicted "
        f"{record['predicted_iteration_time_s']:.3f} s ({against_prediction(details['prediction_error'])})",
        *speed_lines(record),
        f"prediction from: {details['prediction_from']}",
    ]
    if not says_losses(record):  # (else report.elastic says every step's loss, across the restarts)
        lines.append(
            f"loss per step from step {first_step + 1} (resumed from step {first_step}'s checkpoint): {losses}"
            if first_step
            else f"loss per step: {losses}"
        )
    if reference.get("checked"):
        verdict = "matches" if reference["match"] else "DOES NOT MATCH"
        lines.append(
            f"step 1 loss {verdict} one process: {reference['run_loss']:.6f} vs {reference['reference_loss']:.6f}"
        )
    elif reference.get("why"):
        lines.append(f"loss not checked against one process: {reference['why']}")
    lines.extend(memory_lines(details))
    sharing = details.get("core_sharing") or {}
    if "busy_processes_per_core" in sharing:
        lines.append(
            f"cores shared as measured: {sharing['busy_processes_per_core']:.2f} busy processes per core on average, "
            f"compute x{sharing['compute_stretch']:.2f}"
        )
    elif "cpu_share" in sharing and sharing["cpu_share"] < 1:
        lines.append(f"cores shared as assumed: each rank computes at {sharing['cpu_share']:g} of a core")
    lines.extend(host_costs_lines(details))
    if details["emulation"]:
        speeds = ", ".join(f"{name} at {speed:g}x" for name, speed in details["emulated_groups"].items())
        lines.append(f"emulated: {speeds}: {details['emulation']}")
    return lines


def host_costs_lines(details: Mapping[str, Any]) -> list[str]:
    """A run predicted from profiles without the host's step costs (`profile --no-host`, or simulated) is predicted
    without the work around its layers (making batches, the cores' sharing, the sync's copies): a run's DP sync read
    0.000 s predicted against 0.007 s measured, with no word of why."""
    if details.get("predicted_timeline") is not None or not (details.get("cost_source") or {}).get("profiles"):
        return []
    return [
        "note: the profiles have no host costs (profiled with --no-host, or simulated): the work around the layers "
        "(batches, cores shared, the sync's copies) is predicted as none; `hetplan profile` measures it by default"
    ]


def memory_lines(details: Mapping[str, Any]) -> list[str]:
    """The ranks' peak resident memory beside the plan's memory per device: the process holds torch, Gloo's buffers
    and the emulation beside the model's state, which is all the plan counts (records from before: none)."""
    peaks = [float(value) for value in (details.get("memory_max_rss_bytes") or {}).values()]
    planned = details.get("predicted_memory_bytes")
    if not peaks or planned is None:
        return []
    # a tiny model's state in MiB (it read "the plan's 0.00 GiB per device")
    state = f"{planned / GIB:.2f} GiB" if planned >= 0.1 * GIB else f"{planned / 2**20:.1f} MiB"
    return [
        f"memory: peak resident {min(peaks) / GIB:.2f}-{max(peaks) / GIB:.2f} GiB per rank; the plan's "
        f"{state} per device is the model's weights, gradients, optimizer state and activations, "
        "not the process's own (torch, Gloo's buffers, the emulation)"
    ]


def against_prediction(error: float) -> str:
    """A run record's prediction error (measured / predicted - 1) in words: a bare "-12.0%" beside a prediction reads
    as a prediction 12% low, the opposite of a run that took 12% less."""
    return f"the run took {abs(error):.1%} {'less' if error < 0 else 'more'} than predicted"


def speed_lines(record: Mapping[str, Any]) -> list[str]:
    """The machine-speed check of a run record (records from before it: none)."""
    speed = record["measurements"].get("machine_speed")
    if not speed:
        return []
    others = other_work_lines(speed.get("other_work"))
    if not speed["checked"]:
        return [f"machine speed not checked: {speed['why']}", *others]
    around_s = min(speed["before_run_s"], speed["after_run_s"])
    at_speed, error = record["predicted_at_run_speed_s"], record["measurements"]["prediction_error_at_run_speed"]
    layer = f"the profile's reference layer ({speed['layer']})"
    timings = f"{speed['profiled_s'] * 1e3:.1f} ms when profiled, {around_s * 1e3:.1f} ms around the run"
    verdict = f"x{speed['slowdown']:.2f}): predicted at this speed {at_speed:.3f} s ({against_prediction(error)})"
    lines = [f"machine speed: {layer} took {timings} ({verdict}"]
    if "cores_slowdown" in speed:  # records from before the all-cores check have none
        lines.append(
            f"all {speed['cores']} cores computing it at once: each {speed['busy_stretch_now']:.2f}x its time alone, "
            f"{speed['busy_stretch_profiled']:.2f}x when profiled (x{speed['cores_slowdown']:.2f})"
        )
    return [*lines, *others]


def other_work_lines(others: Mapping[str, Any] | None) -> list[str]:
    """What else used the host's cores during a run (runtime.launch.with_other_work; records before it: none)."""
    if not others or not others["checked"]:
        return []
    used = others["other_processes_cores"] + others["stolen_cores"]
    parts = f"other processes {others['other_processes_cores']:.2f}, the hypervisor {others['stolen_cores']:.2f}"
    line = f"other work on this host during {others['over']}: {used:.2f} of its {others['cores']} cores ({parts})"
    if used > OTHER_WORK_LIMIT_CORES:
        line += (
            "; the ranks shared the cores with it, which the prediction does not know of: "
            "run again on a quiet host to compare"
        )
    return [line]


def comm_bench_table(result: Mapping[str, Any], islands: Sequence[str]) -> Table:
    """All-reduce time and bandwidth per message size and path (direct, bridged, hierarchical), checked."""
    title = f"all-reduce over {len(islands)} ranks, islands {', '.join(islands)} (simulated on CPU, Gloo)"
    table = titled_table(title, ("size", "path", "time ms", "algbw GB/s", "busbw GB/s", "correct"), left=())
    for row in result["rows"]:
        table.add_row(
            f"{row['size_bytes']:,}",
            row["path"],
            f"{row['time_s'] * 1e3:.2f}",
            f"{row['algbw_bytes_per_s'] / 1e9:.3f}",
            f"{row['busbw_bytes_per_s'] / 1e9:.3f}",
            "yes" if row["correct"] else "[red]NO[/red]",
        )
    return table
