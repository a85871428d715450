"""Plan the tiny Llama on this machine (examples/cpu-2x2.yaml) from the measured CPU profile and from the simulated
(datasheet) one, and show where the two disagree and why: the layer costs side by side, then both plans.

Run: python bench/measured_vs_simulated.py [--profile bench/results/profile-cpu-tiny-llama.json]
(the profile is written by bench/profile_repeatability.py); table + bench/results/measured_vs_simulated.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import plan  # noqa: E402
from planner.plan import describe_strategy  # noqa: E402
from profiler import load_profile  # noqa: E402
from profiler.simulated import SimulatedDevice  # noqa: E402
from specs import load_cluster, load_model, load_training  # noqa: E402
from specs.device import get_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default=str(ROOT / "bench" / "results" / "profile-cpu-tiny-llama.json"))
    args = parser.parse_args()
    measured = load_profile(Path(args.profile))
    model = load_model(str(ROOT / "examples" / "models" / "tiny-llama.yaml"))
    simulated = SimulatedDevice(get_device("cpu"), model, measured.seq_length, measured.dtype)
    cluster = load_cluster(ROOT / "examples" / "cpu-2x2.yaml")
    training = load_training(
        None,
        {
            "dtype": measured.dtype,
            "seq_length": measured.seq_length,
            "global_batch_size": 16,
            "micro_batch_sizes": [1, 2, 4, 8],
        },
    )

    print("decoder layer fwd+bwd per sample (ms): measured vs simulated, and the ratio")
    header = f"{'tp':>3} {'recompute':<10} " + " ".join(f"{'b=' + str(b):>22}" for b in (1, 2, 4, 8))
    print(header)
    print("-" * len(header))
    costs = []
    for tp in measured.tp_degrees():
        for mode in ("none", "selective", "full"):
            cells = []
            for b in (1, 2, 4, 8):
                got = measured.layer_cost("decoder", b, tp, mode).time_s / b
                want = simulated.layer_cost("decoder", b, tp, mode).time_s / b
                costs.append(
                    {"tp": tp, "recompute": mode, "micro_batch_size": b, "measured_s": got, "simulated_s": want}
                )
                cells.append(f"{got * 1e3:7.2f} {want * 1e3:7.2f} {got / want:5.2f}x")
            print(f"{tp:>3} {mode:<10} " + " ".join(f"{c:>22}" for c in cells))

    plans = {}
    for name, profiles in (("measured", {"cpu": measured}), ("simulated", None)):
        result = plan(cluster, model, training, profiles)
        evaluation = result.evaluation
        plans[name] = {
            "strategy": describe_strategy(result.strategy),
            "iteration_time_s": evaluation.iteration_time_s,
            "micro_batch_size": result.strategy.pipelines[0].micro_batch_size,
            "recompute": result.strategy.recompute,
            "tp": [stage.tp for stage in result.strategy.pipelines[0].stages],
        }
    print()
    for name, row in plans.items():
        print(f"{name:>9}: {row['strategy']}  ->  {row['iteration_time_s']:.3f} s/iteration")
    out = ROOT / "bench" / "results" / "measured_vs_simulated.json"
    out.write_text(json.dumps({"profile": measured.environment, "layer_costs": costs, "plans": plans}, indent=2) + "\n")
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
