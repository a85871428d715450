"""Measured runs against predictions over a grid: three model sizes x five plan shapes x two CPU clusters, each run
three times on local processes (`hetplan run`'s runtime) and predicted exactly as `hetplan run` predicts it (the
profiles and link profile measured here first, uncalibrated), then predicted again after calibrating the predictor
on every other case (`fit --runs`, leave-one-out); table + bench/results/runtime_vs_prediction.json.

Every run also times the profile's decoder layer before and after itself (runtime/launch.py speed_check): the
machine's slowdown against when it was profiled. The table gives each error twice: against the measured time, and
against the time at the profile's speed (measured / slowdown), which is what the costs, measured then, describe
(calibration learns from the measured time: the second column shows whether the check would earn its place there).

Models: tiny (hidden 128), small (hidden 256, the layer of issue 24's 8-layer case) and 10x (hidden 512: its layer
takes ~10x the tiny one's time), 6 layers each, sequence 128, fp32, ZeRO-1. Shapes: one stage (one rank, the others
idle), PP 2 with an uneven layer split, TP 2, 2 replicas of PP 2 sharing an odd batch unevenly, and two pipeline
families (2 x TP 1 on the first group, 1 x TP 2 on the second). Clusters: examples/cpu-hetero.yaml (its second group
emulates a device at half speed) and examples/cpu-even.yaml (no emulation).

A case whose runs spread by more than --spread-limit (max / min - 1, default 15%) gets more runs, a round at a time,
up to --max-repeats (default 5): one slow run of three moves a median of three as much as the model's largest terms.
So does a case with a run the machine checks read as disturbed (one process or every core computing at once more
than DISTURBED_LIMIT slower than profiled, or other work taking more than OTHER_WORK_LIMIT_CORES of the cores during
the run); such runs are left out of the case's median unless all its runs are.

Before it profiles, the bench times the tiny model's layer ten times over 20 s and stops when the slowest took more
than STEADINESS_LIMIT longer than the fastest (a shared host's neighbours moving its speed) or when other work took
more than OTHER_WORK_LIMIT_CORES of the cores meanwhile (/proc/stat), and after each round
when more than DISTURBED_ROUND_LIMIT of its runs were disturbed (a host that slowed later): --anyway runs on.

Run: python bench/runtime_vs_prediction.py [--steps 6] [--repeats 3] [--max-repeats 5] [--work DIR] [--reuse]
[--anyway] (--work keeps the profiles and run records; --reuse predicts the records already there again without
running)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.cost_source import plan_costs  # noqa: E402
from planner.plan import LoadedPlan, describe_strategy  # noqa: E402
from planner.what_if import run_context  # noqa: E402
from predictor.cost_model import CostContext, Evaluation, evaluate  # noqa: E402
from predictor.predictor import Predictor, fit_predictor  # noqa: E402
from predictor.run_terms import predicted_stage_terms, side_by_side  # noqa: E402
from profiler.machine import MIN_OTHER_WORK_S, OTHER_WORK_LIMIT_CORES, host_times, other_work  # noqa: E402
from profiler.profile import load_profile  # noqa: E402
from runtime.execute import RunSettings  # noqa: E402
from runtime.launch import (  # noqa: E402
    execute,
    predicted_timeline,
    prediction_context,
    reference_entry,
    reference_time_s,
)
from specs import load_cluster, load_training  # noqa: E402
from specs.layout import PipelineStrategy, StageStrategy, Strategy  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

CLUSTERS = {name: ROOT / "examples" / f"{name}.yaml" for name in ("cpu-hetero", "cpu-even")}
TRAINING = ROOT / "examples" / "training" / "cpu-run.yaml"
SEQ_LENGTH = 128
NUM_LAYERS = 6
# hidden, ffn, attention heads, kv heads, vocabulary
MODELS = {"tiny": (128, 352, 4, 2, 2048), "small": (256, 704, 4, 2, 4096), "10x": (512, 1408, 8, 4, 4096)}
SHAPES = ("one stage", "PP 2 uneven", "TP 2", "2 replicas, uneven batch", "two families")
GLOBAL_BATCH = 8
LOO_WORKERS = 2
# a run whose machine-speed check reads the machine this much slower than profiled is left out of its case's median
# (when the case has undisturbed runs) and earns the case another run: in grid 22 a tiny PP 2 plan ran 50% slower in
# all three runs, its ranks' CPU time per step 50% higher, while the one-process check read 1.00-1.11
DISTURBED_LIMIT = 1.15
CHILD_STOP_S = 30.0  # an interrupted hetplan command's time to stop its own processes
LOO_TIMEOUT_S = 3600.0  # every leave-one-out fit together (about 5 minutes here)
# before anything runs, the tiny model's layer is timed STEADINESS_SAMPLES times STEADINESS_GAP_S apart; slowest over
# fastest beyond STEADINESS_LIMIT stops the bench (--anyway runs it): in grid 25, on a quiet machine, the runs' own
# one-process checks read 0.90-1.08 over the whole grid; on a shared host whose layer read 1.12-1.89x its profiled
# time within 30 s, two grids were stopped in their first two rounds: 25 of the first round's 30 runs measured
# 11-52% above their predictions, and 10 of them read past DISTURBED_LIMIT
STEADINESS_SAMPLES = 10
STEADINESS_GAP_S = 2.0
STEADINESS_LIMIT = 0.3
# a host can slow after the steadiness check: grid 28 read 8% there, then 12 of its first round's 30 runs and 20 of the
# second's were disturbed (grid 25: none). A round with more than this share of disturbed runs stops the bench.
DISTURBED_ROUND_LIMIT = 0.25
# a profile taken while the machine ran faster or slower than it runs later moves every prediction of its model
# together: grid 36's small profile was taken at a slow moment, and all ten small runs then timed its layer at
# 0.71-0.80x its profiled time (predicted 5-31% above their measured steps). Right after profiling, the bench times the
# profile's reference layer PROFILE_CHECKS times and profiles again (up to PROFILE_ATTEMPTS times in all) when the
# fastest timing differs from the profiled time by more than PROFILE_CHECK_LIMIT.
PROFILE_CHECKS = 3
PROFILE_CHECK_LIMIT = 0.15
PROFILE_ATTEMPTS = 3


@dataclass(frozen=True)
class Case:
    cluster: str
    size: str
    shape: str
    strategy: Strategy
    global_batch: int

    @property
    def name(self) -> str:
        return f"{self.cluster} / {self.size} / {self.shape}"

    @property
    def slug(self) -> str:
        return "-".join(part.replace(" ", "_").replace(",", "") for part in (self.cluster, self.size, self.shape))


def model_spec(size: str) -> ModelSpec:
    hidden, ffn, heads, kv_heads, vocab = MODELS[size]
    return ModelSpec(
        key=f"grid-{size}",
        num_layers=NUM_LAYERS,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        seq_length=SEQ_LENGTH,
        mlp="swiglu",
    )


def shape_strategy(shape: str, first: str, second: str) -> tuple[Strategy, int]:
    """The plan of one shape on a cluster of two groups (`first`, `second`, two devices each) and its global batch."""
    layers, split = NUM_LAYERS, 4  # PP 2: 4 layers on the first group, 2 on the second

    def stage(group: str, start: int, end: int, tp: int = 1) -> StageStrategy:
        return StageStrategy(group, start, end, tp)

    pipelines: tuple[PipelineStrategy, ...]
    batch = GLOBAL_BATCH
    if shape == "one stage":
        pipelines = (PipelineStrategy(1, 2, batch // 2, (stage(first, 0, layers),)),)
    elif shape == "PP 2 uneven":
        pipelines = (PipelineStrategy(1, 1, batch, (stage(first, 0, split), stage(second, split, layers))),)
    elif shape == "TP 2":
        pipelines = (PipelineStrategy(1, 2, batch // 2, (stage(first, 0, layers, 2),)),)
    elif shape == "2 replicas, uneven batch":
        batch -= 1  # 7 samples: the replicas run 4 and 3 micro-batches
        stages = (stage(first, 0, split), stage(second, split, layers))
        pipelines = (PipelineStrategy(2, 1, (batch + 1) // 2, stages, batch),)
    else:  # two families: 2 x TP 1 on the first group (6 samples), 1 x TP 2 on the second (2 samples)
        pipelines = (
            PipelineStrategy(2, 1, 3, (stage(first, 0, layers),)),
            PipelineStrategy(1, 1, 2, (stage(second, 0, layers, 2),)),
        )
    return Strategy(pipelines, "none", 1), batch


def grid() -> list[Case]:
    cases = []
    for cluster_name, path in CLUSTERS.items():
        cluster = load_cluster(path)
        first, second = (group.name for group in cluster.groups)
        for size in MODELS:
            for shape in SHAPES:
                strategy, batch = shape_strategy(shape, first, second)
                cases.append(Case(cluster_name, size, shape, strategy, batch))
    return cases


def training_for(batch: int) -> TrainingSpec:
    return load_training(TRAINING, {"global_batch_size": batch, "seq_length": SEQ_LENGTH})


def hetplan(*arguments: str) -> None:
    """A hetplan command, as a user would run it (output kept out of the bench's table). Interrupted, the bench
    interrupts it as Ctrl-C would, so it stops the processes it started (profile helpers, timed ranks)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "cli", *arguments, "--quiet"]
    child = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL)
    try:
        code = child.wait()
    except BaseException:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=CHILD_STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()
        raise
    if code:
        raise subprocess.CalledProcessError(code, command)


def measure_links(work: Path, reuse: bool) -> Path:
    """This machine's Gloo collectives between local processes (2 and 4 ranks, and 2 ranks with two more processes
    computing beside them), the `host` link profile every profile directory gets a copy of."""
    out = work / "links-cpu.json"
    if not (reuse and out.exists()):
        print("profiling the collectives ...", flush=True)
        hetplan("profile-comm", "--world", "2,4", "--max-size", "16MiB", "--out", str(out))
    return out


def measure_profiles(work: Path, reuse: bool, links: Path, anyway: bool) -> tuple[dict[str, Path], dict[str, Any]]:
    """Per model size, a directory with this machine's cpu profile of it (one thread per process, as the ranks
    run; with the host costs) and the link profile; and per size, the profile checks (`profile_check`) of each
    attempt. A profile whose check differs by more than PROFILE_CHECK_LIMIT is taken again, up to PROFILE_ATTEMPTS
    times; then the bench stops (--anyway keeps the last)."""
    directories, checks = {}, {}
    for size in MODELS:
        directory = work / f"profiles-{size}"
        directory.mkdir(parents=True, exist_ok=True)
        model_file = work / f"model-{size}.json"
        model_file.write_text(model_spec(size).model_dump_json(exclude={"aliases", "source"}), encoding="utf-8")
        out = directory / "cpu.json"
        checks[size] = []
        while not (reuse and out.exists()):
            print(f"profiling the {size} model ...", flush=True)
            hetplan("profile", "--model", str(model_file), "--device", "cpu", "--threads", "1", "--tp", "1,2",
                    "--micro-batches", "1,2", "--recompute", "none", "--dtype", "fp32", "--out", str(out))  # fmt: skip
            checks[size].append(profile_check(size, out))
            if abs(checks[size][-1] - 1.0) <= PROFILE_CHECK_LIMIT:
                break
            read = ", ".join(f"{check:.2f}" for check in checks[size])
            if len(checks[size]) == PROFILE_ATTEMPTS:
                if anyway:
                    break
                sys.exit(f"runtime_vs_prediction: the {size} model's profile and its layer timed right after it "
                         f"disagree in {PROFILE_ATTEMPTS} attempts (now / profiled: {read}; limit "
                         f"{PROFILE_CHECK_LIMIT:.0%}): the machine's speed moves; run on a quiet machine, or pass "
                         "--anyway")  # fmt: skip
            print(f"the {size} model's layer, timed right after profiling, took {read} x its profiled time: "
                  "profiling again", flush=True)  # fmt: skip
        (directory / links.name).write_bytes(links.read_bytes())
        directories[size] = directory
    return directories, checks


def profile_check(size: str, path: Path) -> float:
    """A run's one-process check (runtime/launch.py speed_check), made right after profiling: the fastest of
    PROFILE_CHECKS timings of the profile's reference layer over its profiled time (1.2: the machine runs it 20%
    slower now than while profiling)."""
    profile = load_profile(path)
    entry = reference_entry(profile)
    if entry is None:
        raise SystemExit(f"runtime_vs_prediction: {path} has no decoder entry at tp 1 without recompute")
    profiled_s = (entry.forward_time_s or 0.0) + (entry.backward_time_s or 0.0)
    return min(reference_time_s(model_spec(size), profile, entry) for _ in range(PROFILE_CHECKS)) / profiled_s


def loaded_plan(case: Case) -> LoadedPlan:
    return LoadedPlan(case.strategy, model_spec(case.size), training_for(case.global_batch), case.slug, case.cluster)


def run_case(case: Case, profiles: Path, settings: RunSettings, out: Path) -> dict[str, Any]:
    """One run of a case, predicted as `hetplan run --profiles DIR` predicts it."""
    plan = loaded_plan(case)
    costs = plan_costs(plan, None, profiles)
    context = run_context(plan, costs.predictor, costs.profiles)
    record = execute(plan, load_cluster(CLUSTERS[case.cluster]), str(CLUSTERS[case.cluster]), context, settings,
                     progress=lambda _: None)  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return record


def predicted_s(case: Case, predictor: Predictor, profiles: dict[str, Any]) -> float:
    """The iteration time `hetplan run` predicts for the case with this predictor and these profiles."""
    return prediction(case, predictor, profiles)[1].iteration_time_s


def prediction(case: Case, predictor: Predictor, profiles: dict[str, Any]) -> tuple[CostContext, Evaluation]:
    plan = loaded_plan(case)
    cluster = load_cluster(CLUSTERS[case.cluster])
    ctx = prediction_context(cluster, run_context(plan, predictor, profiles))
    return ctx, evaluate(ctx, case.strategy)


def median_run(paths: list[Path]) -> Path:
    """The run record whose measurement is the median of a case's counted repeats (`counted`)."""
    runs = {path: json.loads(path.read_text(encoding="utf-8")) for path in paths}
    kept = [path for path in paths if runs[path] in counted(list(runs.values()))]
    return sorted(kept, key=lambda path: median_step(runs[path]))[(len(kept) - 1) // 2]


def cores_slowdown(run: dict[str, Any]) -> float:
    """The run's all-cores check (runtime/launch.py cores_check): 1 when its record has none."""
    return float(run["measurements"].get("machine_speed", {}).get("cores_slowdown", 1.0))


def other_work_cores(run: dict[str, Any]) -> float:
    """The cores other work took during the run (runtime/launch.py with_other_work): 0 when its record has none."""
    others = run["measurements"].get("machine_speed", {}).get("other_work", {})
    return float(others.get("other_processes_cores", 0.0) + others.get("stolen_cores", 0.0))


def was_disturbed(run: dict[str, Any]) -> bool:
    """The machine ran slower than profiled around the run: with one process (machine_slowdown) or with every core
    computing (cores_slowdown), by more than DISTURBED_LIMIT; or other work took more than OTHER_WORK_LIMIT_CORES of
    the cores during it."""
    slower = max(run.get("machine_slowdown", 1.0), cores_slowdown(run)) > DISTURBED_LIMIT
    return slower or other_work_cores(run) > OTHER_WORK_LIMIT_CORES


def disturbed_round(paths: list[Path], label: str) -> str | None:
    """Why the bench stops after a round of runs (more than DISTURBED_ROUND_LIMIT of them disturbed), or None."""
    disturbed = sum(was_disturbed(json.loads(path.read_text(encoding="utf-8"))) for path in paths)
    if disturbed <= DISTURBED_ROUND_LIMIT * len(paths):
        return None
    return (
        f"runtime_vs_prediction: {disturbed} of round {label}'s {len(paths)} runs ran on a machine more than "
        f"{DISTURBED_LIMIT - 1:.0%} slower than profiled or beside other work taking more than "
        f"{OTHER_WORK_LIMIT_CORES:g} cores (limit: {DISTURBED_ROUND_LIMIT:.0%} of a round): the grid "
        "would measure the machine, not the model; run it on a quiet machine, or pass --anyway"
    )


def counted(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs a case's measurement is the median of: those the machine did not disturb, or every run when it
    disturbed all of them."""
    return [run for run in runs if not was_disturbed(run)] or runs


def leave_one_out(
    cases: list[Case], records: dict[str, list[Path]], profile_files: list[Path], links: Path
) -> dict[str, float]:
    """Per case, the prediction of a predictor fitted on the profiles and the link profile and calibrated on the
    median run of every other case (`hetplan fit --profiles ... --links ... --runs ... --no-published-runs`)."""
    medians = {case.slug: median_run(records[case.slug]) for case in cases}
    jobs = [
        (held_out, profile_files, [links], [medians[case.slug] for case in cases if case.slug != held_out.slug])
        for held_out in cases
    ]
    # one fit per case, two at a time (each is a calibration over the other cases' runs)
    pool = multiprocessing.get_context("spawn").Pool(LOO_WORKERS)
    try:
        predicted = pool.map_async(held_out_prediction, jobs).get(timeout=LOO_TIMEOUT_S)  # a dead worker: no hang
    finally:  # interrupted (Ctrl-C, or SIGTERM: see main), the bench leaves no fitting workers behind
        pool.terminate()
        pool.join()
    return dict(zip((case.slug for case in cases), predicted, strict=True))


def held_out_prediction(job: tuple[Case, list[Path], list[Path], list[Path]]) -> float:
    """The prediction of one held-out case by a predictor fitted without its runs."""
    held_out, profile_files, links, others = job
    fitted = fit_predictor(profile_files, links, others, published_runs=False, name=f"without {held_out.slug}")
    return predicted_s(held_out, fitted, {})


def largest_difference(terms: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a run and its prediction differ most: the stage and term of the largest measured - predicted seconds."""
    worst: dict[str, Any] = {"stage": "", "term": "", "measured_minus_predicted_s": 0.0}
    for stage in terms:
        for term, values in stage["terms"].items():
            if values["measured_s"] is None:
                continue
            difference = values["measured_s"] - values["predicted_s"]
            if abs(difference) > abs(worst["measured_minus_predicted_s"]):
                label = f"{stage['family']}.{stage['stage']} {stage['group']}"
                worst = {"stage": label, "term": term, "measured_minus_predicted_s": difference}
    return worst


def spread(measured_s: list[float]) -> float:
    """How far a case's runs lie apart: slowest / fastest - 1."""
    return max(measured_s) / min(measured_s) - 1.0


def run_paths(work: Path, case: Case, count: int) -> list[Path]:
    return [work / "runs" / f"{case.slug}-{r}.json" for r in range(count)]


def steadiness(time_layer: Callable[[], float], samples: int, gap_s: float) -> float:
    """The slowest of `samples` timings of a layer, `gap_s` apart, over the fastest, less 1: how much the machine's
    speed moves over tens of seconds (the scale on which a profile and the runs it predicts follow each other)."""
    times = []
    for index in range(samples):
        if index:
            time.sleep(gap_s)
        times.append(time_layer())
    return max(times) / min(times) - 1.0


def check_machine(anyway: bool) -> None:
    """Before anything is profiled: the machine's speed over 20 s (`steadiness`) and the cores other work takes
    meanwhile (profiler.machine.other_work: a layer timed alone can find a free core while the grid's ranks, sharing
    every core, would not); the bench stops when either is above its limit (STEADINESS_LIMIT, OTHER_WORK_LIMIT_CORES),
    unless `anyway`."""
    before = host_times()
    moved = steadiness(tiny_layer_time_s, STEADINESS_SAMPLES, STEADINESS_GAP_S)
    after = host_times()
    others = None
    if before is not None and after is not None and after.wall_s - before.wall_s >= MIN_OTHER_WORK_S:
        others = other_work(before, after)
    used = others["other_processes_cores"] + others["stolen_cores"] if others else 0.0
    besides = f"; other work took {used:.2f} of the host's cores meanwhile" if others else ""
    print(f"machine steadiness: the slowest of {STEADINESS_SAMPLES} layer timings took {moved:.0%} longer than the "
          f"fastest{besides}", flush=True)  # fmt: skip
    span = f"{STEADINESS_SAMPLES * STEADINESS_GAP_S:.0f} s"
    why = "the grid would measure the machine, not the model; run it on a quiet machine, or pass --anyway"
    if moved > STEADINESS_LIMIT and not anyway:
        sys.exit(
            f"runtime_vs_prediction: the machine's speed moves by {moved:.0%} over {span} (limit "
            f"{STEADINESS_LIMIT:.0%}): {why}"
        )
    if others and used > OTHER_WORK_LIMIT_CORES and not anyway:
        sys.exit(
            f"runtime_vs_prediction: other work took {used:.2f} of the host's {others['cores']} cores over {span} "
            f"(limit {OTHER_WORK_LIMIT_CORES:g}): {why}"
        )


def tiny_layer_time_s() -> float:
    """The tiny model's decoder layer, forward and backward, as a run's machine-speed check times it."""
    import torch

    from profiler.layer_timing import layer_time_s

    return layer_time_s(model_spec("tiny"), 1, SEQ_LENGTH, torch.float32, 1)


def load_average() -> str:
    return Path("/proc/loadavg").read_text(encoding="utf-8").strip() if Path("/proc/loadavg").exists() else "?"


def median_step(record: dict[str, Any]) -> float:
    return float(record["measured_iteration_time_s"])


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` unwinds like Ctrl-C: child pools are stopped
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case")
    parser.add_argument("--max-repeats", type=int, default=5, help="runs of a case whose runs spread (at most)")
    parser.add_argument("--spread-limit", type=float, default=0.15, help="slowest / fastest - 1 that takes more runs")
    parser.add_argument("--work", type=Path, help="keep profiles and run records here (default: a temporary dir)")
    parser.add_argument("--reuse", action="store_true", help="predict the records already in --work, run nothing")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "runtime_vs_prediction.json")
    parser.add_argument("--anyway", action="store_true", help="run on a machine whose speed moves (see STEADINESS_*)")
    args = parser.parse_args()
    if not args.reuse:
        check_machine(args.anyway)
    work = args.work or Path(tempfile.mkdtemp(prefix="hetplan-runtime-grid-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before, started = load_average(), time.monotonic()
    links = measure_links(work, args.reuse)
    profile_dirs, profile_checks = measure_profiles(work, args.reuse, links, args.anyway)
    cases = [case for case in grid() if args.only in case.name]
    settings = RunSettings(steps=args.steps, dtype="fp32", timeout_s=120.0)
    (work / "runs").mkdir(exist_ok=True)
    loads: list[str] = []

    def run_once(case: Case, path: Path, label: str) -> None:
        if not (args.reuse and path.exists()):
            loads.append(load_average())
            print(f"running {case.name} ({label}) ...", flush=True)
            run_case(case, profile_dirs[case.size], settings, path)

    records = {case.slug: run_paths(work, case, args.repeats) for case in cases}
    for repeat in range(args.repeats):  # round by round: a drift of the machine's load spreads over every case
        for case in cases:
            run_once(case, records[case.slug][repeat], f"{repeat + 1}/{args.repeats}")
        stop = disturbed_round([records[case.slug][repeat] for case in cases], f"{repeat + 1}")
        if stop and not args.anyway and not args.reuse:
            sys.exit(f"{stop} (the records so far: {work / 'runs'})")
    for count in range(args.repeats + 1, args.max_repeats + 1):  # the cases whose runs disagree: a round more
        for case in cases:
            runs = [json.loads(path.read_text(encoding="utf-8")) for path in records[case.slug]]
            measured = [median_step(run) for run in runs]
            extra = run_paths(work, case, count)
            disturbed = sum(map(was_disturbed, runs))
            if len(measured) < count - 1 or (spread(measured) <= args.spread_limit and not disturbed):
                continue
            if args.reuse and not extra[-1].exists():  # an earlier grid's records as they are (no run added)
                continue
            records[case.slug] = extra
            why = f"the runs so far spread {spread(measured):.0%}" + (f", {disturbed} disturbed" if disturbed else "")
            run_once(case, extra[-1], f"{count}: {why}")
    metadata = run_metadata(work, loads, load_before, time.monotonic() - started)
    profile_files = [directory / "cpu.json" for directory in profile_dirs.values()]
    loo = leave_one_out(cases, records, profile_files, links)
    rows = []
    for case in cases:
        every = [json.loads(path.read_text(encoding="utf-8")) for path in records[case.slug]]
        runs = counted(every)
        measured = statistics.median(median_step(run) for run in runs)
        slowdowns = [run.get("machine_slowdown", 1.0) for run in runs]
        at_profile_speed = statistics.median(median_step(run) / slowdown for run, slowdown in zip(runs, slowdowns))
        plan = loaded_plan(case)
        costs = plan_costs(plan, None, profile_dirs[case.size])
        ctx, evaluation = prediction(case, costs.predictor, costs.profiles)
        predicted = evaluation.iteration_time_s
        middle = sorted(runs, key=median_step)[(len(runs) - 1) // 2]
        # the median run's terms against this prediction (a record's own were predicted from the profiles of its day)
        simulated = predicted_timeline(ctx, evaluation.strategy)
        terms = side_by_side(middle["measurements"]["stages"], predicted_stage_terms(ctx, evaluation), simulated)
        gap = largest_difference(terms)
        rows.append(
            {
                "cluster": case.cluster,
                "model": case.size,
                "shape": case.shape,
                "strategy": describe_strategy(case.strategy),
                "global_batch_size": case.global_batch,
                "measured_s": measured,
                "measured_repeats_s": [median_step(run) for run in runs],
                "measured_spread": spread([median_step(run) for run in runs]),
                "disturbed_runs_s": [median_step(run) for run in every if run not in runs],
                "cores_slowdowns": [cores_slowdown(run) for run in every],
                "other_work_cores": [other_work_cores(run) for run in every],
                "predicted_s": predicted,
                "error": predicted / measured - 1.0,
                "machine_slowdowns": slowdowns,
                "measured_at_profile_speed_s": at_profile_speed,
                "error_at_profile_speed": predicted / at_profile_speed - 1.0,
                "loo_predicted_s": loo[case.slug],
                "loo_error": loo[case.slug] / measured - 1.0,
                "loo_error_at_profile_speed": loo[case.slug] / at_profile_speed - 1.0,
                "largest_term_difference": gap,
                "terms_of_median_run": terms,
            }
        )
    result = {
        "host": {"machine": platform.machine(), "cores": len(os.sched_getaffinity(0)), "node": platform.node()},
        **metadata,
        "steps": args.steps,
        "repeats": args.repeats,
        "max_repeats": args.max_repeats,
        "spread_limit": args.spread_limit,
        "profile_checks": profile_checks,
        "rows": rows,
    }
    print_table(rows)
    before, after = metadata["load_average_before"], metadata["load_average_after"]
    print(f"machine load (1/5/15 min) before {before}, after {after}; runs took {metadata['runs_s']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def run_metadata(work: Path, loads: list[str], load_before: str, runs_s: float) -> dict[str, Any]:
    """The machine's load around the runs and how long they took: as measured now when this invocation ran cases
    (kept in WORK/runs-metadata.json), else (`--reuse`, nothing run) as the invocation that ran them wrote it."""
    path = work / "runs-metadata.json"
    if not loads and path.exists():
        return dict(json.loads(path.read_text(encoding="utf-8")))
    metadata = {
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "runs_s": runs_s,
        "load_average_at_each_run": loads,
    }
    path.write_text(json.dumps(metadata, indent=1) + "\n", encoding="utf-8")
    return metadata


def print_table(rows: list[dict[str, Any]], write: Callable[[str], None] = print) -> None:
    """Per case: measured and predicted, the error against the measured time and against the time at the profile's
    speed (`@speed`), uncalibrated and leave-one-out, and where the run and the prediction differ most; the machine
    checks' median slowdowns (one process, every core), the cores other work took during the runs (`others`) and the
    disturbed runs left out (`out`)."""
    write(f"{'cluster':<11} {'model':<6} {'shape':<25} {'measured s':>10} {'runs':>4} {'spread':>6} {'slowdown':>8} "
          f"{'cores':>5} {'others':>6} {'out':>3} "
          f"{'predicted s':>11} "
          f"{'error':>7} {'@speed':>7} {'LOO s':>7} {'LOO err':>7} {'@speed':>7}  "
          "largest difference (stage, term, measured - predicted s)")  # fmt: skip
    for row in rows:
        slowdown = statistics.median(row["machine_slowdowns"])
        measured = f"{row['cluster']:<11} {row['model']:<6} {row['shape']:<25} {row['measured_s']:>10.3f}"
        repeats = row["measured_repeats_s"]
        measured += f" {len(repeats):>4} {spread(repeats):>6.0%}"
        cores = statistics.median(row.get("cores_slowdowns") or [1.0])  # grids before the all-cores check: 1
        others = statistics.median(row.get("other_work_cores") or [0.0])  # grids before the check: 0
        predicted = f"{slowdown:>8.2f} {cores:>5.2f} {others:>6.2f} {len(row.get('disturbed_runs_s', [])):>3}"
        predicted += f" {row['predicted_s']:>11.3f} {row['error']:>+7.1%}"
        predicted += f" {row['error_at_profile_speed']:>+7.1%}"
        loo = f"{row['loo_predicted_s']:>7.3f} {row['loo_error']:>+7.1%}"
        loo += f" {row['loo_error_at_profile_speed']:>+7.1%}"
        gap = row["largest_term_difference"]
        where = f"{gap['stage']} {gap['term']} {gap['measured_minus_predicted_s']:+.3f}"
        write(f"{measured} {predicted} {loo}  {where}")
    for label, key in (("", ""), (" at the profile's speed", "_at_profile_speed")):
        errors = [abs(row["error" + key]) for row in rows]
        loo_errors = [abs(row["loo_error" + key]) for row in rows]
        if errors:
            write(f"|error|{label}: median {statistics.median(errors):.1%}, max {max(errors):.1%}; leave-one-out "
                  f"median {statistics.median(loo_errors):.1%}, max {max(loo_errors):.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
