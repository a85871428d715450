"""Learned layer costs per device type: a roofline term with a learned efficiency, scikit-learn estimators.

Tree ensembles alone do not extrapolate: past the largest profiled micro-batch they predict the largest profiled
time. So time = (roofline) x (learned efficiency correction):
  roofline  a positive linear model over physical work, t = g*GEMM FLOPs + a*attention FLOPs + m*bytes + k[kind]
            (g, a, m are 1/achieved FLOP/s and 1/achieved bandwidth; k the launch overhead of a kernel group),
            fitted for relative error. It extrapolates linearly in work, as real kernels do once they are large.
  residual  gradient-boosted trees on scale-free shape descriptors learn log(measured / roofline): how
            efficiency departs from the linear law inside the profiled range. Out of range a tree keeps its
            edge value, i.e. the efficiency correction saturates, which is the physically safe direction.
Activation bytes come from a positive linear fit over the candidate saved-tensor terms of `activation_features`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import KFold

from predictor.features import (
    KERNEL_GROUPS,
    PASSES,
    WORK_COLUMNS,
    LayerPoint,
    Pass,
    activation_features,
    shape_features,
    work_matrix,
)
from profiler.profile import DeviceProfile, LayerCost, LayerKind, ProfileEntry
from specs.errors import SpecError
from specs.model import ModelSpec, Recompute

WORK_WIDTH = len(WORK_COLUMNS) + len(KERNEL_GROUPS)
CV_FOLDS = 5


class RooflineEfficiencyRegressor(RegressorMixin, BaseEstimator):
    """Predicts seconds from [work matrix | shape features] (see module docstring).

    `roofline=False` drops the physical term (trees on log time alone); `residual_trees=0` drops the trees.
    """

    def __init__(
        self,
        roofline: bool = True,
        residual_trees: int = 60,
        max_depth: int = 2,
        learning_rate: float = 0.1,
        random_state: int = 0,
    ) -> None:
        self.roofline = roofline
        self.residual_trees = residual_trees
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.random_state = random_state

    def _roofline_s(self, X: np.ndarray) -> np.ndarray:
        if not self.roofline:
            return np.ones(len(X))
        return np.maximum(X[:, :WORK_WIDTH] @ self.work_coef_, 1e-12)

    def fit(self, X: np.ndarray, y: np.ndarray) -> RooflineEfficiencyRegressor:
        X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
        if self.roofline:
            work = X[:, :WORK_WIDTH]
            scale = np.where(work.max(axis=0) > 0, work.max(axis=0), 1.0)
            # weights 1/y: the squared error of (prediction - y)/y, i.e. relative error, is minimised
            linear = LinearRegression(positive=True, fit_intercept=False)
            linear.fit(work / scale / y[:, None], np.ones_like(y))
            self.work_coef_ = linear.coef_ / scale
        residual = np.log(y / self._roofline_s(X))
        self.residual_model_: GradientBoostingRegressor | None = None
        self.residual_offset_ = 0.0
        if self.residual_trees > 0:
            self.residual_model_ = GradientBoostingRegressor(
                n_estimators=self.residual_trees,
                max_depth=self.max_depth,
                learning_rate=self.learning_rate,
                random_state=self.random_state,
            ).fit(X[:, WORK_WIDTH:], residual)
        else:
            self.residual_offset_ = float(np.mean(residual)) if not self.roofline else 0.0
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        log_correction = np.full(len(X), self.residual_offset_)
        if self.residual_model_ is not None:
            log_correction = self.residual_model_.predict(X[:, WORK_WIDTH:])
        return self._roofline_s(X) * np.exp(log_correction)


def design_matrix(points: Sequence[LayerPoint], passes: Sequence[Pass]) -> np.ndarray:
    return np.hstack([work_matrix(list(points), list(passes)), shape_features(list(points), list(passes))])


def _points_and_times(profile: DeviceProfile, model: ModelSpec) -> tuple[list[LayerPoint], list[ProfileEntry]]:
    entries = [e for e in profile.entries if e.fits]
    points = [
        LayerPoint(model, profile.seq_length, profile.dtype, e.layer, e.micro_batch_size, e.tp, e.recompute)
        for e in entries
    ]
    return points, entries


def profile_model_spec(profile: DeviceProfile) -> ModelSpec:
    """The model shape a profile was measured for (its `model` record)."""
    data = {k: v for k, v in profile.model.items() if k in ModelSpec.model_fields}
    try:
        return ModelSpec.model_validate(data)
    except ValueError:
        raise SpecError(profile.path or "profile", "model", "expected a complete model shape record") from None


def pass_samples(
    points: Sequence[LayerPoint], entries: Sequence[ProfileEntry]
) -> tuple[list[LayerPoint], list[Pass], np.ndarray]:
    """Two samples per entry: its forward and its backward time."""
    sample_points: list[LayerPoint] = []
    sample_passes: list[Pass] = []
    times: list[float] = []
    for point, entry in zip(points, entries, strict=True):
        for pass_, time_s in zip(PASSES, (entry.forward_time_s, entry.backward_time_s), strict=True):
            assert time_s is not None
            sample_points.append(point)
            sample_passes.append(pass_)
            times.append(time_s)
    return sample_points, sample_passes, np.asarray(times)


@dataclass
class LayerCostModel:
    """Layer time and activation bytes of one device type, learned from its profiles."""

    device_key: str
    time_model: RooflineEfficiencyRegressor
    activation_models: dict[tuple[str, str], LinearRegression]
    cv_log_errors: list[float]  # held-out log(predicted / measured) of fwd+bwd time, one per entry
    trained_on: list[str] = field(default_factory=list)  # profile paths

    @property
    def log_error_std(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.cv_log_errors)))) if self.cv_log_errors else 0.0

    def cost(self, point: LayerPoint) -> LayerCost:
        forward_s, backward_s = self.time_model.predict(design_matrix([point, point], list(PASSES)))
        activation = self.activation_models.get((point.layer, point.mode))
        if activation is None:
            raise SpecError(
                f"predictor for {self.device_key}",
                "activation",
                f"no {point.layer} ({point.mode}) entries were profiled on this device",
            )
        activation_bytes = float(activation.predict(activation_features(point)[None, :])[0])
        return LayerCost(float(forward_s), float(backward_s), max(activation_bytes, 0.0))


def fit_time_model(
    points: Sequence[LayerPoint], entries: Sequence[ProfileEntry], **params: object
) -> RooflineEfficiencyRegressor:
    sample_points, sample_passes, times = pass_samples(points, entries)
    regressor = RooflineEfficiencyRegressor(**params)  # type: ignore[arg-type]
    return regressor.fit(design_matrix(sample_points, sample_passes), times)


def predict_total_s(model: RooflineEfficiencyRegressor, points: Sequence[LayerPoint]) -> np.ndarray:
    """Forward + backward seconds per point."""
    doubled = [p for p in points for _ in PASSES]
    passes = [pass_ for _ in points for pass_ in PASSES]
    return model.predict(design_matrix(doubled, passes)).reshape(-1, 2).sum(axis=1)


def fit_layer_cost_model(profiles: Sequence[DeviceProfile], **params: object) -> LayerCostModel:
    """Fit one device type's layer model on its profiles (one or several models' shapes)."""
    keys = {str(p.device.get("key", "")) for p in profiles}
    if len(keys) != 1:
        raise SpecError("--profiles", "device.key", f"expected profiles of one device type, got {sorted(keys)}")
    points: list[LayerPoint] = []
    entries: list[ProfileEntry] = []
    for profile in profiles:
        more_points, more_entries = _points_and_times(profile, profile_model_spec(profile))
        points += more_points
        entries += more_entries
    if len(entries) < 4:
        raise SpecError(profiles[0].path or "profile", "entries", "expected at least 4 measured entries to fit")
    time_model = fit_time_model(points, entries, **params)
    activation_models: dict[tuple[str, str], LinearRegression] = {}
    for group in sorted({(p.layer, p.mode) for p in points}):
        chosen = [i for i, p in enumerate(points) if (p.layer, p.mode) == group]
        X = np.array([activation_features(points[i]) for i in chosen])
        y = np.array([entries[i].activation_bytes for i in chosen], dtype=float)
        activation_models[group] = LinearRegression(positive=True, fit_intercept=False).fit(X, y)
    measured = np.array([e.forward_time_s + e.backward_time_s for e in entries])  # type: ignore[operator]
    cv_errors = np.zeros(len(entries))
    folds = KFold(n_splits=min(CV_FOLDS, len(entries)), shuffle=True, random_state=0)
    for train, test in folds.split(np.arange(len(entries))):
        fold_model = fit_time_model([points[i] for i in train], [entries[i] for i in train], **params)
        predicted = predict_total_s(fold_model, [points[i] for i in test])
        cv_errors[test] = np.log(predicted / measured[test])
    return LayerCostModel(
        device_key=keys.pop(),
        time_model=time_model,
        activation_models=activation_models,
        cv_log_errors=[float(e) for e in cv_errors],
        trained_on=[p.path for p in profiles],
    )


@dataclass
class PredictedLayerCosts:
    """A `LayerCostSource` answering from a learned layer model, for one model shape, sequence and dtype."""

    layer_model: LayerCostModel
    model: ModelSpec
    seq_length: int
    dtype: str
    _costs: dict[tuple[str, int, int, str], LayerCost] = field(default_factory=dict, repr=False)

    @property
    def identity(self) -> str:
        return f"learned layer model for {self.layer_model.device_key}"

    def layer_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        key = (layer, micro_batch_size, tp, recompute)
        cost = self._costs.get(key)
        if cost is None:
            point = LayerPoint(self.model, self.seq_length, self.dtype, layer, micro_batch_size, tp, recompute)
            cost = self._costs[key] = self.layer_model.cost(point)
        return cost
