"""How well a predictor predicts measured runs: per run, per device family, and on sources it was not fitted on.

`check_runs` predicts every run (with its 90% interval) and names the cost-model term that dominates its time;
`leave_one_source_out` refits the calibration without each source in turn (all the runs that cite it) and predicts
that source's runs, which is what a device family's error looks like on work the predictor has not seen;
`family_errors` summarises either by device family (MAPE, signed mean, worst run). With measured profiles the runs
are predicted from them as `hetplan run` predicts its own (the predictor's calibration not applied: its terms were
fitted over other costs); leave-one-source-out then calibrates over the profiles.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from predictor.calibration import Calibration, Interval, apply, fit_calibration, prediction_interval
from predictor.cost_model import CostContext, evaluate
from predictor.predictor import Predictor, _calibration_cases
from predictor.runs import Run
from specs.layout import Strategy

if TYPE_CHECKING:
    from profiler.profile import DeviceProfile

WORST_RUNS = 3


@dataclass(frozen=True)
class RunCheck:
    name: str
    source: str
    family: str  # the device type(s) the run used, e.g. "h100" or "a100-80gb+v100"
    measured_s: float
    predicted_s: float
    low_s: float
    high_s: float
    dominant_term: str  # the cost-model term taking the largest share of the predicted iteration
    dominant_share: float

    @property
    def error(self) -> float:
        """Signed relative error: positive when the prediction is slower than the measurement."""
        return self.predicted_s / self.measured_s - 1

    @property
    def inside_interval(self) -> bool:
        return self.low_s <= self.measured_s <= self.high_s

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "family": self.family,
            "measured_s": self.measured_s,
            "predicted_s": round(self.predicted_s, 6),
            "interval_s": [round(self.low_s, 6), round(self.high_s, 6)],
            "error": round(self.error, 6),
            "dominant_term": self.dominant_term,
            "dominant_share": round(self.dominant_share, 4),
        }


@dataclass(frozen=True)
class FamilyError:
    family: str
    runs: int
    sources: int
    mape: float
    mean_error: float
    worst: RunCheck

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.family,
            "runs": self.runs,
            "sources": self.sources,
            "mape": round(self.mape, 6),
            "mean_error": round(self.mean_error, 6),
            "worst_run": self.worst.name,
            "worst_error": round(self.worst.error, 6),
        }


def run_family(run: Run) -> str:
    """The device types a run used, joined: the family its error is reported under."""
    used = {stage.group for pipeline in run.strategy.pipelines for stage in pipeline.stages}
    return "+".join(sorted({run.cluster.group(name).device.key for name in used}))


def _check(run: Run, base: CostContext, strategy: Strategy, calibration: Calibration, interval: Interval) -> RunCheck:
    terms = evaluate(apply(base, calibration.value_map()), strategy).breakdown()
    dominant = max(terms, key=terms.__getitem__)
    total = sum(terms.values())
    return RunCheck(
        run.name,
        run.source,
        run_family(run),
        run.measured_iteration_time_s,
        interval.iteration_time_s,
        interval.low_s,
        interval.high_s,
        dominant,
        terms[dominant] / total if total > 0 else 0.0,
    )


def check_runs(
    predictor: Predictor, runs: Sequence[Run], profiles: Mapping[str, DeviceProfile] | None = None
) -> list[RunCheck]:
    """Predict every run with the predictor as it is, or from `profiles` without its calibration."""
    if profiles:
        predictor = replace(predictor, calibration=Calibration())
    checks = []
    for run, (_, base, strategy, _) in zip(runs, _calibration_cases(predictor, runs, profiles), strict=True):
        checks.append(_check(run, base, strategy, predictor.calibration, predictor.interval(base, strategy)))
    return checks


def leave_one_source_out(
    predictor: Predictor, runs: Sequence[Run], profiles: Mapping[str, DeviceProfile] | None = None
) -> list[RunCheck]:
    """Each source's runs predicted by the predictor's calibration refitted on every other source's runs."""
    cases = _calibration_cases(predictor, runs, profiles)
    checks: dict[int, RunCheck] = {}
    for source in dict.fromkeys(run.source for run in runs):
        held = [i for i, run in enumerate(runs) if run.source == source]
        calibration = fit_calibration([case for i, case in enumerate(cases) if i not in held])
        for i in held:
            _, base, strategy, _ = cases[i]
            interval = prediction_interval(base, strategy, calibration)
            checks[i] = _check(runs[i], base, strategy, calibration, interval)
    return [checks[i] for i in range(len(runs))]


def family_errors(checks: Sequence[RunCheck]) -> list[FamilyError]:
    """MAPE, signed mean error and the worst run per device family, families in order of first appearance."""
    rows = []
    for family in dict.fromkeys(check.family for check in checks):
        members = [check for check in checks if check.family == family]
        rows.append(
            FamilyError(
                family,
                len(members),
                len({check.source for check in members}),
                statistics.fmean(abs(check.error) for check in members),
                statistics.fmean(check.error for check in members),
                max(members, key=lambda check: abs(check.error)),
            )
        )
    return rows


def validation_report(
    predictor: Predictor,
    runs: Sequence[Run],
    held_out: bool,
    profiles: Mapping[str, DeviceProfile] | None = None,
) -> dict[str, object]:
    """What `hetplan validate` and `hetplan fit` print: every run predicted, the error per device family, the worst
    runs with the term that dominates their time, and (`held_out`, with two or more sources) leave-one-source-out."""
    checks = check_runs(predictor, runs, profiles)
    identity = predictor.identity
    if profiles:
        identity = f"profiles of {', '.join(sorted(profiles))} ({identity}, its calibration not applied)"
    body: dict[str, object] = {
        "predictor": identity,
        "runs": [check.to_dict() for check in checks],
        "families": [row.to_dict() for row in family_errors(checks)],
        "worst": [check.name for check in sorted(checks, key=lambda c: -abs(c.error))[:WORST_RUNS]],
    }
    calibrated_on = set() if profiles else {fit.name for fit in predictor.calibration.runs}
    body["in_sample_runs"] = sum(run.name in calibrated_on for run in runs)  # errors a fit made small, not predicted
    sources = list(dict.fromkeys(run.source for run in runs))
    if held_out and len(sources) > 1:
        loso = leave_one_source_out(predictor, runs, profiles)
        body["leave_one_source_out"] = {
            "runs": [check.to_dict() for check in loso],
            "families": [row.to_dict() for row in family_errors(loso)],
        }
    elif held_out and runs:
        every = f"all {len(runs)} runs have" if len(runs) > 1 else "the run has"
        body["leave_one_source_out"] = {
            "not_computed": f"{every} one source ({sources[0]}): leave-one-source-out refits the calibration on the "
            "runs given (not on the predictor's own), so without it none is left; give runs of two or more sources"
        }
    return body
