"""Local runs on one host's CPU processes, from the host costs a profile measured (profiler/host.py, the profile's
`host` section): how the processes a strategy keeps busy share the cores, and the framework overheads around the
layers.

A strategy keeps busy one process per device it occupies on groups of a device with measured host costs (idle devices'
ranks only wait at the step's barrier). With P of them on C cores:
  compute       every layer time of those groups (emulated speed included) stretches by HostCosts.stretch(P), the
                measured slowdown of P processes computing at once;
  collectives   links measured between this machine's processes carry what each process per core beyond one adds
                (Link.under_load(P / C): a rank waits for a partner the scheduler has set aside);
  overheads     per micro-batch and stage, running the stage's layers as one module (microbatch_overhead_s plus
                layer_overhead_s per layer, 1/tp of it on a TP shard); per step, making the batch; the optimizer step
                per parameter (sharding.optimizer_time_s), all stretched as compute is.
A context without host costs is evaluated as before; local runs then fall back to the assumed share cores / ranks
(`local_run_context`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from predictor.context import CostContext
from profiler.profile import HostCosts, LayerCostSource, ScaledLayerCosts
from specs.cluster import ClusterSpec, DeviceGroup
from specs.layout import Strategy


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


def on_host(ctx: CostContext, strategy: Strategy) -> CostContext:
    """The context to evaluate `strategy` in: its host groups' layer costs stretched and their links loaded by the
    processes it keeps busy (the same context when no group runs on a profiled host). Made once per number of busy
    processes and kept in `ctx.loaded`."""
    if not ctx.host or ctx.processes_per_core:
        return ctx
    processes = busy_processes(ctx, strategy)
    if processes == 0:
        return ctx
    made = ctx.loaded.get(processes)
    if made is None:
        cores = max(costs.cores for costs in ctx.host.values())
        stretch = max(costs.stretch(processes) for costs in ctx.host.values())
        sources: dict[str, LayerCostSource] = dict(ctx.sources)
        for group in ctx.cluster.groups:
            if host_of(ctx, group) is not None and stretch != 1.0:
                sources[group.name] = ScaledLayerCosts(ctx.source(group.name), stretch)
        made = replace(ctx, sources=sources, processes_per_core=processes / cores, compute_stretch=stretch)
        ctx.loaded[processes] = made
    return made


def stage_overhead_s(ctx: CostContext, group: DeviceGroup, num_layers: int, tp: int) -> float:
    """Per micro-batch, what running a stage's layers as one module adds to their profiled times (0 off a profiled
    host, and never less: the planner's bounds leave it out), stretched and slowed by emulation as the layers are."""
    host = host_of(ctx, group)
    if host is None:
        return 0.0
    overhead = host.microbatch_overhead_s + num_layers * host.layer_overhead_s / tp
    return max(0.0, overhead) * ctx.compute_stretch / group.emulate_speed


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
