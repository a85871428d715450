"""Plan the tiny Llama on this machine (examples/cpu-2x2.yaml) from the measured CPU profile and from the simulated
(datasheet) one, and show where the two disagree and why: the layer costs side by side, then both plans.

Run: python bench/measured_vs_simulated.py [--profile bench/results/profile-cpu-tiny-llama.json]
(the profile is written by bench/profile_repeatability.py); table + bench/results/measured_vs_simulated.json.
Each plan is also scored under the measured costs: where the plans differ, the measured one should be faster there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import build_context, plan, predict  # noqa: E402
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

    # Two clusters: this machine as it is, and the same with 0.4 GB per process, so the model must be split across
    # stages or recomputed and micro-batch efficiency matters. Each plan is also scored under the measured costs.
    limited = dataclasses.replace(
        cluster,
        groups=tuple(
            dataclasses.replace(g, device=g.device.model_copy(update={"memory_GB": 0.4})) for g in cluster.groups
        ),
    )
    plans = {}
    for label, target in (("cpu-2x2", cluster), ("cpu-2x2, 0.4 GB per process", limited)):
        measured_ctx = build_context(target, model, training, {"cpu": measured})
        print(f"\n{label}")
        for name, profiles in (("measured", {"cpu": measured}), ("simulated", None)):
            result = plan(target, model, training, profiles)
            under_measured = predict(measured_ctx, result.strategy)
            plans[f"{label} / {name}"] = {
                "strategy": describe_strategy(result.strategy),
                "predicted_iteration_time_s": result.evaluation.iteration_time_s,
                "iteration_time_under_measured_costs_s": under_measured.iteration_time_s,
                "fits_under_measured_costs": under_measured.fits,
            }
            print(
                f"  {name:>9} profile plans {describe_strategy(result.strategy)}\n"
                f"            predicted {result.evaluation.iteration_time_s:.3f} s; under the measured costs "
                f"{under_measured.iteration_time_s:.3f} s{'' if under_measured.fits else ' (does not fit)'}"
            )
    out = ROOT / "bench" / "results" / "measured_vs_simulated.json"
    out.write_text(json.dumps({"profile": measured.environment, "layer_costs": costs, "plans": plans}, indent=2) + "\n")
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
