"""Local runs on one host's CPU processes, from the host costs a profile measured (profiler/host.py, the profile's
`host` section): how the processes of a strategy share the cores, and the framework overheads around the layers.

A strategy runs one process per device it occupies on groups of a device with measured host costs (idle devices'
ranks only wait at the step's barrier). A process computes its layers (and their emulation), its optimizer step and
overheads, and waits asleep for its pipeline neighbours, TP partners and DP sync; sleeping, it leaves its core to the
others. `evaluate_on_host` simulates the step as the processes share the cores (predictor.sharing: fair shares of
the cores, slowed by the measured busy stretch of that many processes computing at once) and stretches the analytic
evaluation's host compute to the simulated step; links measured between this machine's processes are loaded by the
simulation's mean busy processes per core (Link.under_load: a rank waits for a partner the scheduler set aside).
Overheads: per micro-batch and stage, running the stage's layers as one module (microbatch_overhead_s plus
layer_overhead_s per layer, 1/tp of it on a TP shard) and the work around each TP collective
(tp_collective_overhead_s and per byte); per step, making the batch; the optimizer step per parameter
(sharding.optimizer_time_s); the work around a sync across pipeline families per parameter (indexing and
copies: busy in the simulation, as the transfers around it are not). A context without host costs is evaluated as
before; local runs then fall back to the assumed share cores / ranks (`local_run_context`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from predictor.context import CostContext
from predictor.sharing import StepSimulation, simulate_step
from profiler.profile import HostCosts, LayerCostSource, ScaledLayerCosts
from specs.cluster import ClusterSpec, DeviceGroup
from specs.layout import Strategy

if TYPE_CHECKING:
    from predictor.evaluation import Evaluation

MAX_LOADED_CONTEXTS = 512
STRETCH_STEPS = 4  # secants to stretch the analytic evaluation to the simulated step
STRETCH_TOLERANCE = 0.002  # of the simulated step


def host_of(ctx: CostContext, group: DeviceGroup) -> HostCosts | None:
    """The measured host costs of a group's device, when its processes run on a profiled host."""
    return ctx.host.get(group.device.key)


def busy_processes(ctx: CostContext, strategy: Strategy) -> int:
    """Processes the strategy keeps computing on profiled hosts: one per device it occupies there."""
    return sum(
        pipeline.stage_devices(stage)
        for pipeline in strategy.pipelines
        for stage in pipeline.stages
        if host_of(ctx, ctx.cluster.group(stage.group)) is not None
    )


def loaded(ctx: CostContext, processes_per_core: float, stretch: float) -> CostContext:
    """The context with its host groups' layer costs stretched by `stretch` and its links loaded by
    `processes_per_core` busy processes per core. Made once per pair (kept in `ctx.loaded`)."""
    key = (round(max(processes_per_core, 1e-3), 3), round(stretch, 4))
    made = ctx.loaded.get(key)
    if made is None:
        if len(ctx.loaded) > MAX_LOADED_CONTEXTS:  # a long search: keep memory bounded
            ctx.loaded.clear()
        sources: dict[str, LayerCostSource] = dict(ctx.sources)
        for group in ctx.cluster.groups:
            if host_of(ctx, group) is not None and key[1] != 1.0:
                sources[group.name] = ScaledLayerCosts(ctx.sources[group.name], key[1])
        made = replace(ctx, sources=sources, processes_per_core=key[0], compute_stretch=key[1])
        ctx.loaded[key] = made
    return made


def evaluate_on_host(
    ctx: CostContext, strategy: Strategy, evaluate_at: Callable[[CostContext], Evaluation]
) -> Evaluation:
    """The evaluation of `strategy` with its processes sharing the host's cores (module docstring): the step is
    simulated (predictor.sharing) from an evaluation with unstretched compute and links loaded by every process;
    then the analytic evaluation, its links loaded by the simulation's mean busy processes, is stretched to the
    simulated step (its time is close to linear in the stretch: secants from no stretch and that of every process
    busy until within STRETCH_TOLERANCE)."""
    host = max(ctx.host.values(), key=lambda costs: costs.cores)
    processes = busy_processes(ctx, strategy)
    simulated = simulate_on_host(ctx, strategy, evaluate_at)
    per_core = simulated.mean_busy_processes / host.cores
    unstretched = evaluate_at(loaded(ctx, per_core, 1.0))
    target_s = simulated.time_s + ctx.terms.iteration_overhead_s
    most = host.stretch(processes)
    if target_s <= unstretched.iteration_time_s or most <= 1.0:
        return unstretched
    previous, last = (1.0, unstretched), (most, evaluate_at(loaded(ctx, per_core, most)))
    for _ in range(STRETCH_STEPS):  # secants through the last two stretches, to the simulated step
        (earlier_stretch, earlier), (last_stretch, found) = previous, last
        slope = (found.iteration_time_s - earlier.iteration_time_s) / (last_stretch - earlier_stretch)
        if abs(found.iteration_time_s - target_s) <= STRETCH_TOLERANCE * target_s or slope <= 0:
            break
        stretch = last_stretch + (target_s - found.iteration_time_s) / slope
        previous, last = last, (stretch, evaluate_at(loaded(ctx, per_core, stretch)))
    return last[1] if last[1].iteration_time_s > unstretched.iteration_time_s else unstretched


def simulate_on_host(
    ctx: CostContext, strategy: Strategy, evaluate_at: Callable[[CostContext], Evaluation], trace: bool = False
) -> StepSimulation:
    """The step simulation `evaluate_on_host` starts from: an evaluation with unstretched compute and links loaded
    by every process, its processes sharing the host's cores (`trace`: with every actor's events)."""
    host = max(ctx.host.values(), key=lambda costs: costs.cores)
    every = evaluate_at(loaded(ctx, busy_processes(ctx, strategy) / host.cores, 1.0))
    unloaded = evaluate_at(loaded(ctx, 1.0, 1.0))
    at = on_host(ctx, every)
    return simulate_step(at, every, host, step_overhead_s(at, strategy), trace, unloaded)


def on_host(ctx: CostContext, evaluation: Evaluation) -> CostContext:
    """The context an evaluation was made in (loaded on a profiled host), for costs computed beside it."""
    return evaluation.context if evaluation.context is not None else ctx


def stage_overhead_s(
    ctx: CostContext, group: DeviceGroup, num_layers: int, tp: int, collectives: tuple[int, float]
) -> float:
    """Per micro-batch, what running a stage's layers as one module, with its TP `collectives` (how many, bytes),
    adds to their profiled times (0 off a profiled host, and never less: the planner's bounds leave it out),
    stretched and slowed by emulation as the layers are."""
    host = host_of(ctx, group)
    if host is None:
        return 0.0
    count, size_bytes = collectives
    overhead = (
        host.microbatch_overhead_s
        + num_layers * host.layer_overhead_s / tp
        + count * host.tp_collective_overhead_s
        + size_bytes * host.tp_collective_overhead_s_per_byte
    )
    return max(0.0, overhead) * ctx.compute_stretch / group.emulate_speed


def family_sync_overhead_s(ctx: CostContext, group: DeviceGroup, params_per_device: float) -> float:
    """The host work around the collectives of a device's gradient sync across pipeline families (0 off a profiled
    host), stretched."""
    host = host_of(ctx, group)
    return 0.0 if host is None else params_per_device * host.family_sync_s_per_param * ctx.compute_stretch


def step_overhead_s(ctx: CostContext, strategy: Strategy) -> float:
    """Per step, making the batch every rank of a profiled host makes (0 without one), stretched."""
    hosts = [host_of(ctx, ctx.cluster.group(s.group)) for p in strategy.pipelines for s in p.stages]
    measured = [host for host in hosts if host is not None]
    if not measured:
        return 0.0
    return max(host.data_time_s(ctx.training.global_batch_size) for host in measured) * ctx.compute_stretch


def models_host(ctx: CostContext) -> bool:
    """Whether the context models the host its CPU groups run on (every CPU group has measured host costs)."""
    cpu = [group for group in ctx.cluster.groups if group.device.key == "cpu"]
    return bool(cpu) and all(host_of(ctx, group) is not None for group in cpu)


def local_run_context(make: Callable[[ClusterSpec], CostContext], cluster: ClusterSpec, share: float) -> CostContext:
    """The context of a local run's prediction: `make(cluster)` when it models the host (measured core sharing),
    else `make` of the cluster as the ranks see it under the assumed share of a core each (`share`, cores / ranks)."""
    ctx = make(cluster)
    return ctx if models_host(ctx) or share >= 1.0 else make(cluster.sharing_cores(share))
