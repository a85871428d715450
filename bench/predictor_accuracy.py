"""How well the predictor predicts what it has not seen; tables + bench/results/predictor_accuracy.json.

1. Held-out profile points on this machine's CPU (the committed tiny-Llama profile): fit on the rest, predict the
   largest micro-batch, the largest TP degree, and 5-fold cross-validation; three layer models side by side:
   roofline x learned efficiency (the predictor's), roofline alone, and gradient-boosted trees alone.
2. Small-to-large on this machine: fit on the tiny Llama (h=512), predict a twice-as-wide Llama (h=1024), both
   profiled back to back on one host (bench/results/extrapolation/, written by `hetplan profile`; see the README).
   Profiles from different hosts are refused: VMs of one kind here differed 2-3x in GEMM speed.
3. Small-to-large in simulation: fit on noisy simulated A100 profiles of a 1.7B and a 6.7B GPT at micro-batch
   <= 2 and TP <= 2, predict a 175B GPT at micro-batch 1-8 and TP 1-8 against the simulator itself.
4. Calibration: the bundled published runs, leave-one-out (fit on one, predict the other).

Run: python bench/predictor_accuracy.py
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from predictor.calibration import fit_calibration, prediction_interval  # noqa: E402
from predictor.features import LayerPoint  # noqa: E402
from predictor.layer_model import fit_time_model, predict_total_s, profile_model_spec  # noqa: E402
from predictor.predictor import PUBLISHED_RUNS, Predictor, _calibration_cases  # noqa: E402
from predictor.runs import load_runs  # noqa: E402
from profiler.profile import DeviceProfile, ProfileEntry, load_profile  # noqa: E402
from profiler.simulated import SimulatedDevice  # noqa: E402
from specs.device import get_device  # noqa: E402
from specs.model import load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VARIANTS: dict[str, dict[str, object]] = {
    "roofline x learned efficiency": {},
    "roofline alone": {"residual_trees": 0},
    "trees alone": {"roofline": False},
}


def points_of(profile: DeviceProfile) -> tuple[list[LayerPoint], list[ProfileEntry]]:
    model = profile_model_spec(profile)
    entries = [e for e in profile.entries if e.fits]
    points = [
        LayerPoint(model, profile.seq_length, profile.dtype, e.layer, e.micro_batch_size, e.tp, e.recompute)
        for e in entries
    ]
    return points, entries


def total_s(entries: Sequence[ProfileEntry]) -> np.ndarray:
    return np.array([e.forward_time_s + e.backward_time_s for e in entries])  # type: ignore[operator]


def errors(
    train: tuple[list[LayerPoint], list[ProfileEntry]],
    test: tuple[list[LayerPoint], list[ProfileEntry]],
    params: dict[str, object],
) -> np.ndarray:
    model = fit_time_model(train[0], train[1], **params)
    return predict_total_s(model, test[0]) / total_s(test[1]) - 1


def summary(relative_errors: np.ndarray, points: Sequence[LayerPoint]) -> dict[str, float]:
    absolute = np.abs(relative_errors)
    decoder = np.array([p.layer == "decoder" for p in points])
    return {
        "points": len(absolute),
        "median_abs_error": float(np.median(absolute)),
        "mean_abs_error": float(np.mean(absolute)),
        "max_abs_error": float(np.max(absolute)),
        "decoder_median_abs_error": float(np.median(absolute[decoder])) if decoder.any() else float("nan"),
        "mean_signed_error": float(np.mean(relative_errors)),
    }


def split(
    data: tuple[list[LayerPoint], list[ProfileEntry]], held: Callable[[LayerPoint], bool]
) -> tuple[tuple[list[LayerPoint], list[ProfileEntry]], tuple[list[LayerPoint], list[ProfileEntry]]]:
    points, entries = data
    train = [i for i, p in enumerate(points) if not held(p)]
    test = [i for i, p in enumerate(points) if held(p)]
    return ([points[i] for i in train], [entries[i] for i in train]), (
        [points[i] for i in test],
        [entries[i] for i in test],
    )


def print_rows(title: str, rows: list[dict[str, object]]) -> None:
    print(f"\n{title}")
    header = f"{'case':<34} {'layer model':<30} {'n':>4} {'median':>8} {'mean':>8} {'max':>8} {'decoder med':>12}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:<34} {row['variant']:<30} {row['points']:>4} {row['median_abs_error']:>8.1%} "
            f"{row['mean_abs_error']:>8.1%} {row['max_abs_error']:>8.1%} {row['decoder_median_abs_error']:>12.1%}"
        )


def held_out_cpu(profile: DeviceProfile) -> list[dict[str, object]]:
    data = points_of(profile)
    largest_batch = max(p.micro_batch_size for p in data[0])
    largest_tp = max(p.tp for p in data[0])
    rows: list[dict[str, object]] = []
    for variant, params in VARIANTS.items():
        for case, held in (
            (f"held-out micro-batch {largest_batch}", lambda p: p.micro_batch_size == largest_batch),
            (f"held-out TP {largest_tp}", lambda p: p.tp == largest_tp),
        ):
            train, test = split(data, held)
            rows.append({"case": case, "variant": variant, **summary(errors(train, test, params), test[0])})
        folds = np.arange(len(data[0])) % 5
        np.random.default_rng(0).shuffle(folds)
        all_errors = np.zeros(len(folds))
        for fold in range(5):
            train_idx = np.flatnonzero(folds != fold)
            test_idx = np.flatnonzero(folds == fold)
            train = ([data[0][i] for i in train_idx], [data[1][i] for i in train_idx])
            test = ([data[0][i] for i in test_idx], [data[1][i] for i in test_idx])
            all_errors[test_idx] = errors(train, test, params)
        rows.append({"case": "5-fold cross-validation", "variant": variant, **summary(all_errors, data[0])})
    return rows


def small_to_large_cpu(small: DeviceProfile, large: DeviceProfile) -> list[dict[str, object]]:
    train, test = points_of(small), points_of(large)
    rows = []
    for variant, params in VARIANTS.items():
        model_name = f"h={test[0][0].model.hidden_size} from h={train[0][0].model.hidden_size}"
        rows.append({"case": model_name, "variant": variant, **summary(errors(train, test, params), test[0])})
    return rows


def small_to_large_simulated() -> list[dict[str, object]]:
    device = get_device("a100-80gb")
    large_model = load_model("gpt3-175b")
    train: tuple[list[LayerPoint], list[ProfileEntry]] = ([], [])
    for name in ("gpt3-1.7b", "gpt3-6.7b"):
        noisy = SimulatedDevice(device, load_model(name), 2048, "bf16", noise=0.03, seed=1)
        points, entries = points_of(noisy.to_profile(micro_batch_sizes=(1, 2), tp_degrees=(1, 2)))
        train[0].extend(points)
        train[1].extend(entries)
    truth = SimulatedDevice(device, large_model, 2048, "bf16").to_profile(
        micro_batch_sizes=(1, 2, 4, 8), tp_degrees=(1, 2, 4, 8)
    )
    test = points_of(truth)
    rows = []
    for variant, params in VARIANTS.items():
        rows.append(
            {"case": "gpt3-175b from 1.7b + 6.7b", "variant": variant, **summary(errors(train, test, params), test[0])}
        )
    return rows


def calibration_leave_one_out() -> list[dict[str, object]]:
    runs = load_runs(PUBLISHED_RUNS)
    cases = _calibration_cases(Predictor(), runs)
    rows = []
    for i, case in enumerate(cases):
        others = [c for j, c in enumerate(cases) if j != i]
        calibration = fit_calibration(others)
        name, ctx, strategy, measured = case
        interval = prediction_interval(ctx, strategy, calibration)
        uncalibrated = fit_calibration([])
        before = prediction_interval(ctx, strategy, uncalibrated).iteration_time_s
        rows.append(
            {
                "run": name,
                "measured_s": measured,
                "uncalibrated_s": before,
                "predicted_s": interval.iteration_time_s,
                "low_s": interval.low_s,
                "high_s": interval.high_s,
                "error": interval.iteration_time_s / measured - 1,
                "inside_interval": interval.low_s <= measured <= interval.high_s,
            }
        )
    return rows


def main() -> None:
    cpu_tiny = load_profile(RESULTS / "profile-cpu-tiny-llama.json")
    report: dict[str, object] = {"held_out_cpu": held_out_cpu(cpu_tiny)}
    print_rows(
        "1. held-out points, CPU profile of the tiny Llama (fwd+bwd time, |relative error|)", report["held_out_cpu"]
    )  # type: ignore[arg-type]
    smaller, larger = RESULTS / "extrapolation" / "tiny-llama.json", RESULTS / "extrapolation" / "small-llama.json"
    if larger.exists() and smaller.exists():
        pair = load_profile(smaller), load_profile(larger)
        hosts = {p.environment.get("platform") for p in pair}
        if len(hosts) != 1:
            raise SystemExit(f"{smaller} and {larger} come from different hosts ({hosts}): profile both here")
        report["small_to_large_cpu"] = small_to_large_cpu(*pair)
        print_rows(
            "2. small-to-large on this CPU (fit on one model, predict a wider one)", report["small_to_large_cpu"]
        )  # type: ignore[arg-type]
    else:
        print(f"\n2. skipped: {smaller} or {larger} not found (profile both models first, see the README)")
    report["small_to_large_simulated"] = small_to_large_simulated()
    print_rows("3. small-to-large in simulation (A100, 3% noise in training data)", report["small_to_large_simulated"])  # type: ignore[arg-type]
    report["calibration_leave_one_out"] = rows = calibration_leave_one_out()
    print("\n4. calibration, leave one published run out")
    header = f"{'run':<30} {'measured':>9} {'uncalib.':>9} {'predicted':>10} {'90% interval':>18} {'error':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['run']:<30} {row['measured_s']:>9.3f} {row['uncalibrated_s']:>9.3f} {row['predicted_s']:>10.3f} "
            f"{row['low_s']:>8.3f}-{row['high_s']:<9.3f} {row['error']:>7.1%}"
        )
    report["median_error_held_out_cpu"] = statistics.median(
        r["median_abs_error"]
        for r in report["held_out_cpu"]
        if r["variant"] == "roofline x learned efficiency"  # type: ignore[index, union-attr]
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "predictor_accuracy.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\nwritten to {RESULTS / 'predictor_accuracy.json'}")


if __name__ == "__main__":
    main()
