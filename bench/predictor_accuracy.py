"""How well the predictor predicts what it has not seen; tables + bench/results/predictor_accuracy.json.

1. Held-out profile points on this machine's CPU (the committed tiny-Llama profile): fit on the rest, predict the
   largest micro-batch, the largest TP degree, and 5-fold cross-validation; three layer models side by side:
   roofline x learned efficiency (the predictor's), roofline alone, and gradient-boosted trees alone.
2. Small-to-large on this machine: fit on the tiny Llama (h=512), predict a twice-as-wide Llama (h=1024), both
   profiled back to back on one host (bench/results/extrapolation/, written by `hetplan profile`; see the README).
   Profiles from different hosts are refused: VMs of one kind here differed 2-3x in GEMM speed.
3. Small-to-large in simulation: fit on noisy simulated A100 profiles of a 1.7B and a 6.7B GPT at micro-batch
   <= 2 and TP <= 2, predict a 175B GPT at micro-batch 1-8 and TP 1-8 against the simulator itself.
4. Calibration on the published small runs (predictor/data/published-runs.json): every run predicted by the shipped
   predictor, then leave-one-source-out (each source's runs predicted by a calibration fitted on the other sources),
   MAPE per device family; and an ablation: the same with each model change undone in turn.

Run: python bench/predictor_accuracy.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from predictor import calibration, cost_model  # noqa: E402
from predictor.features import LayerPoint  # noqa: E402
from predictor.layer_model import fit_time_model, predict_total_s, profile_model_spec  # noqa: E402
from predictor.predictor import PUBLISHED_RUNS, Predictor, _calibration_cases, default_predictor  # noqa: E402
from predictor.runs import Run, load_runs  # noqa: E402
from predictor.validation import check_runs, family_errors, leave_one_source_out  # noqa: E402
from profiler.profile import DeviceProfile, ProfileEntry, load_profile  # noqa: E402
from profiler.simulated import SimulatedDevice  # noqa: E402
from specs.cluster import ClusterFile, DeviceGroup, resolve_cluster  # noqa: E402
from specs.device import device_catalog, get_device  # noqa: E402
from specs.layout import megatron_strategy  # noqa: E402
from specs.model import load_model  # noqa: E402
from specs.training import load_training  # noqa: E402

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


@contextlib.contextmanager
def _patched(module: object, **names: object) -> Iterator[None]:
    """Temporarily replace module attributes (the ablation undoes one model change at a time)."""
    saved = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _with_training(runs: list[Run], **fields: object) -> list[Run]:
    return [dataclasses.replace(run, training=run.training.model_copy(update=fields)) for run in runs]


def _with_devices(runs: list[Run], **fields: object) -> list[Run]:
    def group(g: DeviceGroup) -> DeviceGroup:
        return dataclasses.replace(g, device=g.device.model_copy(update=fields))

    return [
        dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, groups=tuple(map(group, run.cluster.groups))))
        for run in runs
    ]


def _rdma_only(runs: list[Run]) -> list[Run]:
    return [
        dataclasses.replace(
            run,
            cluster=dataclasses.replace(
                run.cluster, groups=tuple(dataclasses.replace(g, transport="rdma") for g in run.cluster.groups)
            ),
        )
        for run in runs
    ]


def _zero3_as_zero1(runs: list[Run]) -> list[Run]:
    out = []
    for run in runs:
        if run.training.zero_stage == 3:
            training = run.training.model_copy(update={"zero_stage": 1})
            run = dataclasses.replace(run, training=training, strategy=dataclasses.replace(run.strategy, zero_stage=1))
        out.append(run)
    return out


ABLATIONS: list[tuple[str, Callable[[list[Run]], list[Run]], Callable[[], contextlib.AbstractContextManager[None]]]] = [
    ("full model", lambda runs: runs, contextlib.nullcontext),
    (
        "- vendor/generation levels",
        lambda runs: runs,
        lambda: _patched(calibration, COMPUTE_LEVELS=(("vendor", 1e-4), ("generation", 1e-4), ("device", 0.15))),
    ),
    ("- engine kernels term", lambda runs: runs, lambda: _patched(calibration, ENGINE_PRIOR_SD=1e-4)),
    ("- in-node fabric per generation", lambda runs: runs, lambda: _patched(calibration, IN_NODE_PRIOR_SD=1e-4)),
    ("- TCP transport", _rdma_only, contextlib.nullcontext),
    ("- ZeRO 3 (FSDP as ZeRO 1)", _zero3_as_zero1, contextlib.nullcontext),
    (
        "- engine overlap flags",
        lambda runs: _with_training(runs, overlap_grad_reduce=True, overlap_param_gather=True, tp_comm_overlap=False),
        contextlib.nullcontext,
    ),
    ("- 1F1B p2p wait", lambda runs: runs, lambda: _patched(cost_model, p2p_exposed=lambda *args: 0.0)),
    (
        "- GEMM shape fall-off per device",
        lambda runs: _with_devices(runs, gemm_ramp_us=4.0, gemm_tile=1e-6),
        contextlib.nullcontext,
    ),
]


def calibration_by_family() -> dict[str, object]:
    """The shipped predictor on every published run; leave-one-source-out; the ablation table."""
    runs = load_runs(PUBLISHED_RUNS)
    shipped = [check.to_dict() for check in check_runs(default_predictor(), runs)]
    uncalibrated = [check.to_dict() for check in check_runs(Predictor(name="uncalibrated"), runs)]
    ablation = []
    loso: list[dict[str, object]] = []
    for name, change_runs, patch in ABLATIONS:
        with patch():
            changed = change_runs(list(runs))
            fitted = Predictor(name=name)
            fitted.calibration = calibration.fit_calibration(_calibration_cases(fitted, changed))
            in_sample = family_errors(check_runs(fitted, changed))
            held_out_checks = leave_one_source_out(Predictor(name=name), changed)
            held_out = family_errors(held_out_checks)
        if name == "full model":
            loso = [check.to_dict() for check in held_out_checks]
        ablation.append(
            {
                "variant": name,
                "in_sample": {row.family: row.mape for row in in_sample},
                "leave_one_source_out": {row.family: row.mape for row in held_out},
                "sources": {row.family: row.sources for row in held_out},
            }
        )
    return {
        "shipped": shipped,
        "uncalibrated": uncalibrated,
        "leave_one_source_out": loso,
        "ablation": ablation,
        "interval_widths": interval_widths(),
    }


def interval_widths() -> list[dict[str, object]]:
    """The shipped predictor's 90% interval on one node of every catalog device (GPT 1.7B, TP 1, 8 replicas,
    micro-batch 1, 64 sequences of 2048): narrow where runs calibrated the device, wider where it borrows from its
    generation or vendor, widest where nothing did."""
    predictor = default_predictor()
    fitted = set(predictor.calibration.names)
    model = load_model("gpt3-1.7b")
    rows = []
    for key, device in device_catalog().items():
        if key == "cpu":
            continue
        dtype = "bf16" if device.supports_bf16 else "fp16"
        group = {"name": key, "device": key, "nodes": 1, "devices_per_node": 8, "nics_per_node": 8, "nic_gbps": 200}
        cluster = resolve_cluster(
            ClusterFile.model_validate(
                {"name": key, "groups": [group], "network": {"topology": "clos", "inter_group_gbps": 200}}
            ),
            key,
        )
        training = load_training(None, {"dtype": dtype, "global_batch_size": 64, "seq_length": 2048})
        strategy = megatron_strategy(
            cluster, model, training, group=key, tp=1, pp=1, dp=8, micro_batch_size=1, recompute="none"
        )
        base = predictor.base_context(cluster, model, training)
        interval = predictor.interval(base, strategy)
        levels = calibration.compute_parameter_names(base, key)[1:]
        rows.append(
            {
                "device": key,
                "calibrated_levels": [name.split(":")[2] for name in levels if name in fitted],
                "iteration_time_s": interval.iteration_time_s,
                "half_width_90": math.exp(1.6448536269514722 * interval.log_sd) - 1,
            }
        )
    return rows


def print_calibration(report: dict[str, object]) -> None:
    print("\n4a. published runs: uncalibrated and shipped predictor (signed error; dominant term of the time)")
    header = (
        f"{'run':<40} {'family':<12} {'measured':>9} {'uncalib.':>9} {'shipped':>9} {'90% interval':>19} {'term':>9}"
    )
    print(header)
    print("-" * len(header))
    for before, after in zip(report["uncalibrated"], report["shipped"], strict=True):  # type: ignore[call-overload]
        low, high = after["interval_s"]
        print(
            f"{after['name']:<40} {after['family']:<12} {after['measured_s']:>9.3f} {before['error']:>+9.1%} "
            f"{after['error']:>+9.1%} {low:>9.3f}-{high:<9.3f} {after['dominant_term']:>9}"
        )
    print("\n4b. leave one source out (each source's runs from a calibration fitted on the others)")
    for check in report["leave_one_source_out"]:  # type: ignore[attr-defined]
        print(
            f"{check['name']:<40} {check['family']:<12} {check['measured_s']:>9.3f} {check['predicted_s']:>9.3f} "
            f"{check['error']:>+8.1%}"
        )
    families = list(report["ablation"][0]["in_sample"])  # type: ignore[index]
    print("\n4c. ablation: MAPE in-sample / leave-one-source-out per family, each model change undone in turn")
    header = f"{'variant':<34} " + " ".join(f"{f:>17}" for f in families)
    print(header)
    print("-" * len(header))
    for row in report["ablation"]:  # type: ignore[attr-defined]
        cells = " ".join(f"{row['in_sample'][f]:>7.1%} / {row['leave_one_source_out'][f]:>6.1%}" for f in families)
        print(f"{row['variant']:<34} {cells}")
    sources = report["ablation"][0]["sources"]  # type: ignore[index]
    print("sources per family: " + ", ".join(f"{f} {sources[f]}" for f in families))
    print("\n4d. 90% interval of one node of each device (GPT 1.7B, 8 replicas): where calibration reached it")
    for row in report["interval_widths"]:  # type: ignore[attr-defined]
        levels = ", ".join(row["calibrated_levels"]) or "nothing (priors only)"
        print(f"{row['device']:<12} +-{row['half_width_90']:>5.1%}   calibrated: {levels}")


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
    report["calibration"] = calibration_by_family()
    print_calibration(report["calibration"])  # type: ignore[arg-type]
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
