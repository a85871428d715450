"""Plan -> run -> compare on this machine: the searched plan, the uniform layer split of the same layout, and two
replicas sharing an odd batch unevenly, all run on local processes of examples/cpu-hetero.yaml (one group emulating a
device at half speed) and measured against the prediction from this machine's own profile; table +
bench/results/runtime_vs_prediction.json.

Run: python bench/runtime_vs_prediction.py [--profiles DIR] [--steps 4]
(without --profiles it first profiles the tiny Llama here with one thread per process, as the ranks run: ~1 min)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.plan import LoadedPlan, describe_strategy  # noqa: E402
from planner.search import search  # noqa: E402
from predictor.cost_model import CostContext  # noqa: E402
from predictor.predictor import default_predictor  # noqa: E402
from profiler.profile import load_profile  # noqa: E402
from runtime.execute import RunSettings  # noqa: E402
from runtime.launch import cpu_share, execute  # noqa: E402
from specs import load_cluster, load_model, load_training  # noqa: E402
from specs.cluster import ClusterSpec  # noqa: E402
from specs.layout import PipelineStrategy, Strategy  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

CLUSTER = ROOT / "examples" / "cpu-hetero.yaml"
MODEL = ROOT / "examples" / "models" / "tiny-llama.yaml"
TRAINING = ROOT / "examples" / "training" / "cpu-run.yaml"


def uniform(strategy: Strategy, num_layers: int) -> Strategy:
    """The same stages, devices and batches with the layers split as evenly as whole layers allow."""
    pipeline = strategy.pipelines[0]
    count = len(pipeline.stages)
    bounds = [round(i * num_layers / count) for i in range(count + 1)]
    stages = tuple(
        replace(stage, layer_start=bounds[i], layer_end=bounds[i + 1]) for i, stage in enumerate(pipeline.stages)
    )
    return replace(strategy, pipelines=(replace(pipeline, stages=stages),))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profiles", type=Path, help="directory with this machine's cpu profile of the tiny Llama")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "runtime_vs_prediction.json")
    args = parser.parse_args()
    profiles_dir = args.profiles
    if profiles_dir is None:
        profiles_dir = Path(tempfile.mkdtemp(prefix="hetplan-bench-profile-"))
        command = [sys.executable, "-m", "cli", "profile", "--model", str(MODEL), "--device", "cpu"]
        command += ["--micro-batches", "1,2", "--tp", "1,2", "--recompute", "none", "--dtype", "fp32"]
        command += ["--threads", "1", "--repeats", "5", "--out", str(profiles_dir / "cpu.json")]
        subprocess.run(command, cwd=ROOT, check=True)
    profiles = {"cpu": load_profile(next(profiles_dir.glob("*.json")))}
    cluster, model, training = load_cluster(CLUSTER), load_model(str(MODEL)), load_training(TRAINING)
    predictor = default_predictor()

    share = cpu_share(cluster)
    ctx = predictor.base_context(cluster.sharing_cores(share), model, training, profiles)
    searched = search(ctx).evaluations[0].strategy
    # also a layout the search does not pick here but the runtime must run: 2 replicas of (fast TP 1 -> slow TP 1)
    # sharing an odd batch unevenly (6 and 5 micro-batches), the same uneven layer split
    odd_batch = training.model_copy(update={"global_batch_size": training.global_batch_size - 1})
    replicated = tuple(replace(s, tp=1) for s in searched.pipelines[0].stages)
    uneven_batch = Strategy(
        (PipelineStrategy(2, 1, training.global_batch_size // 2, replicated, odd_batch.global_batch_size),), "none", 1
    )
    cases = (
        ("searched", searched, training),
        ("uniform split", uniform(searched, model.num_layers), training),
        ("DP, uneven batch", uneven_batch, odd_batch),
    )
    rows = []
    for name, strategy, run_training in cases:

        def context(seen: ClusterSpec, run_training: TrainingSpec = run_training) -> CostContext:
            return predictor.base_context(seen, model, run_training, profiles)

        plan = LoadedPlan(strategy, model, run_training, name, cluster.name)
        settings = RunSettings(steps=args.steps, dtype=run_training.dtype)
        record = execute(plan, cluster, str(CLUSTER), context, settings, progress=lambda _: None)
        rows.append(
            {
                "plan": name,
                "global_batch_size": run_training.global_batch_size,
                "strategy": describe_strategy(strategy),
                "predicted_iteration_time_s": record["predicted_iteration_time_s"],
                "measured_iteration_time_s": record["measured_iteration_time_s"],
                "error": record["measurements"]["prediction_error"],
                "step_times_s": record["measurements"]["step_times_s"],
                "stages": record["measurements"]["stages"],
                "losses": record["losses"],
                "loss_matches_one_process": record["reference_match"].get("match"),
            }
        )
        print(f"{name}: {rows[-1]['strategy']}", flush=True)
    searched_row, uniform_row = rows[:2]
    result = {
        "cluster": cluster.name,
        "model": model.key,
        "cpu_share": share,
        "steps": args.steps,
        "profile": str(profiles["cpu"].path),
        "rows": rows,
        "predicted_speedup_of_searched": uniform_row["predicted_iteration_time_s"]
        / searched_row["predicted_iteration_time_s"],
        "measured_speedup_of_searched": uniform_row["measured_iteration_time_s"]
        / searched_row["measured_iteration_time_s"],
    }
    header = f"{'plan':<15} {'predicted s':>12} {'measured s':>11} {'error':>8}"
    print(f"\n{header}  stages (group layers compute/emulation/wait s)")
    for row in rows:
        stages = "; ".join(
            f"{s['group']} L{s['layers'][0]}-{s['layers'][1] - 1} {s['compute_s']:.1f}/{s['emulation_s']:.1f}/"
            f"{s['wait_s']:.1f}"
            for s in row["stages"]
        )
        print(
            f"{row['plan']:<15} {row['predicted_iteration_time_s']:>12.2f} {row['measured_iteration_time_s']:>11.2f} "
            f"{row['error']:>+8.1%}  {stages}"
        )
    print(
        f"searched plan faster than the uniform split by {result['predicted_speedup_of_searched']:.2f}x predicted, "
        f"{result['measured_speedup_of_searched']:.2f}x measured (cpu share per rank {share:g})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
