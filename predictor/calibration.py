"""Calibration: learn the end-to-end terms per-layer profiles cannot see from measured whole-iteration runs.

Parameters (log-scales unless said otherwise), each with a Gaussian prior centred on "the analytic model is right":
  compute:<kind>            layer times from one kind of source (simulated / measured / learned), all devices (sd 0.3)
  compute:<kind>:vendor:<v>, :generation:<g>, :device:<d>
                            the same for one vendor, architecture generation and device type on top of each other
                            (sd 0.2, 0.12, 0.08): a device no run covers (MI300X when only MI250X ran) inherits what the
                            runs taught about its vendor and generation, and its interval widens by the priors of the
                            levels nobody informed. Each is a physical efficiency (achieved / modelled kernel speed).
  engine:<e>                layer times under another framework's kernels than Megatron's fused ones (FSDP models,
                            DeepSpeed), on top of the device's (sd 0.15)
  in_node:<g>               every transfer over generation g's in-node fabric (NVLink cube mesh, NVSwitch, xGMI,
                            HCCS; TP collectives above all) (sd 0.25): fabrics differ within a vendor
  network                   p2p and DP sync over the network (sd 0.3)
  transport:tcp             NIC transfers over TCP sockets rather than RDMA, on top of `network` (sd 0.4)
  optimizer                 the optimizer step (sd 0.5)
  dp_overlap                fraction of the backward / forward that overlapped DP traffic hides behind, in [0, 1]
                            (prior 1, sd 0.3)
  iteration_overhead_s      fixed seconds per iteration, >= 0 (prior 0, sd 0.05 s)
  host:runtime_overhead_s   in place of iteration_overhead_s for local runs whose host the profile measured
                            (predictor/host.py: making the batch, the optimizer step and the overheads around the
                            layers are measured costs, so what is left per step is the runtime's own bookkeeping, well
                            under a millisecond): prior 0, sd 5 ms. A fixed cost shared with engine runs of 5-60 s
                            steps would let 0.1-1 s local steps buy 15-18 ms of it (seen in the runtime-vs-prediction
                            bench's leave-one-out fits) for misses that grow with the work, not with the step count.
Local runs on this machine's CPU processes share no term with accelerator runs: a CPU group's compute scales, and
every end-to-end term of a context whose groups are all CPUs, are named with the prefix `host:` (host:compute:...,
host:network, host:optimizer, ...; same priors). Physically nothing is shared (a CPU's roofline efficiency, loopback
Gloo, an optimizer step in host memory say nothing of an accelerator's kernels, fabric or HBM), and one local run
fitted beside the published runs moved the root `compute:simulated` by +0.13 (and every vendor level to cancel it):
a Gaudi2 prediction, which no run covers, moved 13% on one CPU run's word.
The fit is the maximum a-posteriori estimate (scipy least squares on log-time residuals / run noise and prior
residuals); only parameters some run is sensitive to move. Its Gauss-Newton covariance, with the priors of
parameters no run informed, gives each prediction an interval: var(log t) = g' S g + run noise^2.
Run noise: 3% (an assumption about published and measured iteration times), estimated from the residuals instead
once there are at least 3 more runs than fitted parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from predictor.cost_model import CostContext, EndToEndTerms, evaluate
from predictor.host import models_host
from profiler.profile import DeviceProfile, LayerCostSource, ScaledLayerCosts
from profiler.simulated import SimulatedDevice
from specs.cluster import DeviceGroup
from specs.layout import Strategy
from specs.vendors import find_vendor

DEFAULT_RUN_NOISE = 0.03
HOST_SCOPE = "host:"  # the prefix of local runs' own terms (CPU processes on this machine)
HOST_OVERHEAD = HOST_SCOPE + "runtime_overhead_s"
HOST_OVERHEAD_PRIOR_SD_S = 0.005
MIN_RUN_NOISE = 0.01
Z_90 = 1.6448536269514722  # two-sided 90% interval of a normal
FINITE_STEP = 1e-4
MAX_RESTARTS = 3


@dataclass(frozen=True)
class Parameter:
    name: str
    prior_mean: float
    prior_sd: float
    lower: float = -math.inf
    upper: float = math.inf


def source_kind(source: LayerCostSource) -> str:
    if isinstance(source, ScaledLayerCosts):
        return source_kind(source.inner)
    if isinstance(source, SimulatedDevice):
        return "simulated"
    if isinstance(source, DeviceProfile):  # a saved simulation (simulate-profile) is the datasheet's costs: theirs
        return "simulated" if source.source == "simulated" else "measured"
    return "learned"


COMPUTE_LEVELS = (("vendor", 0.2), ("generation", 0.12), ("device", 0.08))  # prior sd of each level's log-scale


ENGINE_PRIOR_SD = 0.15
IN_NODE_PRIOR_SD = 0.25
REFERENCE_ENGINE = "megatron"  # the engine whose kernels the layer models describe (no term of its own)


def is_host(group: DeviceGroup) -> bool:
    """Whether the group's devices are this machine's CPU processes (a local run's)."""
    return group.device.key == "cpu"


def scope(ctx: CostContext) -> str:
    """The prefix of the context's end-to-end terms: `host:` when all its groups are CPUs (a local run)."""
    return HOST_SCOPE if all(is_host(group) for group in ctx.cluster.groups) else ""


def compute_parameter_names(ctx: CostContext, group_name: str) -> list[str]:
    """The compute scales that apply to a group's layer times, outermost first (the engine's last)."""
    group = ctx.cluster.group(group_name)
    kind = source_kind(ctx.source(group_name))
    prefix = HOST_SCOPE if is_host(group) else ""
    engine = ctx.training.engine
    engines = [] if engine == REFERENCE_ENGINE else [f"{prefix}engine:{engine}"]
    if kind != "simulated":  # measured or learned costs: one scale per device type on top of the kind's
        return [f"{prefix}compute:{kind}", f"{prefix}compute:{kind}:{group.device.key}", *engines]
    labels = {
        "vendor": vendor_key(group),
        "generation": group.device.generation,
        "device": group.device.key,
    }
    levels = [f"{prefix}compute:{kind}:{level}:{labels[level]}" for level, _ in COMPUTE_LEVELS]
    return [f"{prefix}compute:{kind}", *levels, *engines]


def _compute_prior_sd(name: str) -> float:
    name = name.removeprefix(HOST_SCOPE)
    if name.startswith("engine:"):
        return ENGINE_PRIOR_SD
    parts = name.split(":")
    if len(parts) == 2:
        return 0.3
    if len(parts) == 3:  # measured / learned per device
        return 0.15
    return dict(COMPUTE_LEVELS)[parts[2]]


def vendor_key(group: DeviceGroup) -> str:
    vendor = find_vendor(group.device.vendor)
    return vendor.key if vendor is not None else group.device.vendor


def parameters_for(ctx: CostContext) -> list[Parameter]:
    """The calibration parameters a context's predictions depend on."""
    names: dict[str, Parameter] = {}
    for group in ctx.cluster.groups:
        for name in compute_parameter_names(ctx, group.name):
            names.setdefault(name, Parameter(name, 0.0, _compute_prior_sd(name)))
    for group in ctx.cluster.groups:
        name = in_node_name(group)
        names.setdefault(name, Parameter(name, 0.0, IN_NODE_PRIOR_SD))
    prefix = scope(ctx)
    tcp = any(g.transport == "tcp" for g in ctx.cluster.groups)
    transports = [Parameter(f"{prefix}transport:tcp", 0.0, 0.4)] if tcp else []
    return [
        *names.values(),
        Parameter(f"{prefix}network", 0.0, 0.3),
        *transports,
        Parameter(f"{prefix}optimizer", 0.0, 0.5),
        Parameter(f"{prefix}dp_overlap", 1.0, 0.3, 0.0, 1.0),
        Parameter(HOST_OVERHEAD, 0.0, HOST_OVERHEAD_PRIOR_SD_S, 0.0)
        if models_host(ctx)
        else Parameter(f"{prefix}iteration_overhead_s", 0.0, 0.05, 0.0),
    ]


def in_node_name(group: DeviceGroup) -> str:
    return f"{HOST_SCOPE if is_host(group) else ''}in_node:{group.device.generation}"


def apply(ctx: CostContext, values: Mapping[str, float]) -> CostContext:
    """The context with calibrated layer-time factors and end-to-end terms (missing values: prior means)."""

    def value(name: str, default: float = 0.0) -> float:
        return values.get(name, default)

    sources: dict[str, LayerCostSource] = {}
    for group in ctx.cluster.groups:
        source = ctx.source(group)
        log_factor = sum(value(name) for name in compute_parameter_names(ctx, group.name))
        sources[group.name] = ScaledLayerCosts(source, math.exp(log_factor)) if log_factor else source
    in_node = {group.device.generation: value(in_node_name(group)) for group in ctx.cluster.groups}
    prefix = scope(ctx)
    terms = EndToEndTerms(
        in_node_scale=tuple((g, math.exp(log_scale)) for g, log_scale in sorted(in_node.items()) if log_scale),
        network_scale=math.exp(value(f"{prefix}network")),
        tcp_scale=math.exp(value(f"{prefix}transport:tcp")),
        optimizer_scale=math.exp(value(f"{prefix}optimizer")),
        dp_overlap=value(f"{prefix}dp_overlap", 1.0),
        iteration_overhead_s=value(HOST_OVERHEAD if models_host(ctx) else f"{prefix}iteration_overhead_s"),
    )
    return replace(ctx, sources=sources, terms=terms)


@dataclass(frozen=True)
class RunFit:
    name: str
    measured_iteration_time_s: float
    uncalibrated_iteration_time_s: float
    calibrated_iteration_time_s: float


@dataclass(frozen=True)
class Calibration:
    """Fitted parameter values, their covariance, and how the runs are predicted before and after."""

    names: tuple[str, ...] = ()
    values: tuple[float, ...] = ()
    covariance: tuple[tuple[float, ...], ...] = ()
    run_noise: float = DEFAULT_RUN_NOISE
    runs: tuple[RunFit, ...] = ()

    def value_map(self) -> dict[str, float]:
        return dict(zip(self.names, self.values, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "parameters": {
                name: {"value": round(value, 6), "sd": round(math.sqrt(self.covariance[i][i]), 6)}
                for i, (name, value) in enumerate(zip(self.names, self.values, strict=True))
            },
            "run_noise": self.run_noise,
            "runs": [
                {
                    "name": run.name,
                    "measured_iteration_time_s": run.measured_iteration_time_s,
                    "uncalibrated_iteration_time_s": round(run.uncalibrated_iteration_time_s, 6),
                    "calibrated_iteration_time_s": round(run.calibrated_iteration_time_s, 6),
                }
                for run in self.runs
            ],
        }


def _log_time(ctx: CostContext, strategy: Strategy, values: Mapping[str, float]) -> float:
    return math.log(evaluate(apply(ctx, values), strategy).iteration_time_s)


def _gradient(
    ctx: CostContext, strategy: Strategy, values: Mapping[str, float], parameters: Sequence[Parameter]
) -> np.ndarray:
    """d log(iteration time) / d parameter, one-sided differences that stay inside each parameter's bounds."""
    base = _log_time(ctx, strategy, values)
    gradient = np.zeros(len(parameters))
    for i, parameter in enumerate(parameters):
        at = values.get(parameter.name, parameter.prior_mean)
        step = FINITE_STEP if at + FINITE_STEP <= parameter.upper else -FINITE_STEP
        moved = dict(values)
        moved[parameter.name] = at + step
        gradient[i] = (_log_time(ctx, strategy, moved) - base) / step
    return gradient


def fit_calibration(cases: Sequence[tuple[str, CostContext, Strategy, float]]) -> Calibration:
    """MAP fit over (name, uncalibrated context, strategy, measured seconds) cases."""
    if not cases:
        return Calibration()
    from scipy.optimize import least_squares  # imported here: scipy.optimize takes most of a second to load

    catalog: dict[str, Parameter] = {}
    for _, ctx, _, _ in cases:
        for parameter in parameters_for(ctx):
            catalog.setdefault(parameter.name, parameter)
    priors = {name: p.prior_mean for name, p in catalog.items()}
    sensitivity = np.zeros(len(catalog))
    for _, ctx, strategy, _ in cases:
        relevant = parameters_for(ctx)
        gradient = _gradient(ctx, strategy, priors, relevant)
        for parameter, g in zip(relevant, gradient, strict=True):
            sensitivity[list(catalog).index(parameter.name)] += abs(g)
    active = [p for p, s in zip(catalog.values(), sensitivity, strict=True) if s > 1e-6]
    if not active:
        return Calibration()
    measured = np.log([case[3] for case in cases])

    def values_of(x: np.ndarray) -> dict[str, float]:
        values = dict(priors)
        values.update({p.name: float(v) for p, v in zip(active, x, strict=True)})
        return values

    def residuals(x: np.ndarray, run_noise: float) -> np.ndarray:
        values = values_of(x)
        predicted = np.array([_log_time(ctx, strategy, values) for _, ctx, strategy, _ in cases])
        prior = [(v - p.prior_mean) / p.prior_sd for p, v in zip(active, x, strict=True)]
        return np.concatenate([(predicted - measured) / run_noise, prior])

    start = np.array([p.prior_mean for p in active])
    bounds = ([p.lower for p in active], [p.upper for p in active])
    run_noise = DEFAULT_RUN_NOISE

    def solve(x0: np.ndarray, noise: float) -> Any:
        """Least squares from x0, restarted from its answer while that still lowers the cost: the trust region can
        stop after a rejected first step (ftol) far from the optimum. All parameters are log-scales or fractions of
        similar size, so no rescaling."""
        result = least_squares(residuals, x0, bounds=bounds, args=(noise,), ftol=1e-10, xtol=1e-10, gtol=1e-10)
        for _ in range(MAX_RESTARTS):
            again = least_squares(residuals, result.x, bounds=bounds, args=(noise,), ftol=1e-10, xtol=1e-10, gtol=1e-10)
            if again.cost >= result.cost * (1 - 1e-9):
                break
            result = again
        return result

    result = solve(start, run_noise)
    degrees_of_freedom = len(cases) - len(active)
    if degrees_of_freedom >= 3:
        run_errors = result.fun[: len(cases)] * run_noise
        run_noise = max(MIN_RUN_NOISE, float(np.sqrt(np.sum(run_errors**2) / degrees_of_freedom)))
        result = solve(result.x, run_noise)
    jacobian = result.jac
    covariance = np.linalg.pinv(jacobian.T @ jacobian)
    values = values_of(result.x)
    fits = tuple(
        RunFit(
            name,
            measured_s,
            math.exp(_log_time(ctx, strategy, priors)),
            math.exp(_log_time(ctx, strategy, values)),
        )
        for name, ctx, strategy, measured_s in cases
    )
    return Calibration(
        names=tuple(p.name for p in active),
        values=tuple(float(v) for v in result.x),
        covariance=tuple(tuple(float(c) for c in row) for row in covariance),
        run_noise=run_noise,
        runs=fits,
    )


@dataclass(frozen=True)
class Interval:
    """A prediction with its 90% interval; `log_sd` is the standard deviation of log(time)."""

    iteration_time_s: float
    low_s: float
    high_s: float
    log_sd: float
    basis: str


def prediction_interval(
    ctx: CostContext,
    strategy: Strategy,
    calibration: Calibration,
    extra_log_variance: float = 0.0,
    basis: str = "",
) -> Interval:
    """Point and 90% interval of the calibrated iteration time of `strategy` (ctx is uncalibrated). The fitted terms
    count through their covariance and the slope of log time (they are known to a small step); a term no run
    informed counts by what its prior's 90% points, inside its bounds, do to log time (the same for a log-scale term
    the time is linear in): extrapolated from its slope, a fixed 50 ms overhead's prior on a 3 ms step gave a tiny
    CPU model the interval 0.000 - 899841423 s. Each side sums its shifts in quadrature and may differ from the other
    (an overhead >= 0 adds, never takes away); `log_sd` is the root mean square of the two over Z_90."""
    parameters = parameters_for(ctx)
    values = {p.name: p.prior_mean for p in parameters}
    values.update(calibration.value_map())
    base = _log_time(ctx, strategy, values)
    fitted = {name: i for i, name in enumerate(calibration.names)}
    informed = [p for p in parameters if p.name in fitted]
    gradient = _gradient(ctx, strategy, values, informed)
    covariance = np.array(
        [[calibration.covariance[fitted[a.name]][fitted[b.name]] for b in informed] for a in informed]
    )
    common = float(gradient @ covariance @ gradient) if informed else 0.0
    common += calibration.run_noise**2 + extra_log_variance
    up = down = Z_90**2 * common  # squared log shifts of the 90% points
    for parameter in parameters:
        if parameter.name in fitted:
            continue
        shifts = [_log_time(ctx, strategy, {**values, parameter.name: at}) - base for at in _prior_90(parameter)]
        up += max(0.0, *shifts) ** 2
        down += min(0.0, *shifts) ** 2
    point = math.exp(base)
    low, high = point * math.exp(-math.sqrt(down)), point * math.exp(math.sqrt(up))
    return Interval(point, low, high, math.sqrt((up + down) / 2) / Z_90, basis)


def _prior_90(parameter: Parameter) -> tuple[float, float]:
    """The parameter's prior 90% points (Z_90 prior sds above and below its mean), inside its bounds."""
    mean, sd = parameter.prior_mean, parameter.prior_sd
    return min(parameter.upper, mean + Z_90 * sd), max(parameter.lower, mean - Z_90 * sd)
