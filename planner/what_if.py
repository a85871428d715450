"""What a command evaluates when it does not search: a plan file read against the cluster file it was made for (its
name and structure checked, so no command meets a plan that cannot run on that cluster), or Megatron-style flags
with overrides (`hetplan predict`), as model, training, strategy and source. Also the cost context a run's
prediction comes from, and the checks of `replan`'s change list."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.plan import LoadedPlan, load_plan
from specs.cluster import ClusterSpec, load_cluster
from specs.errors import SpecError
from specs.layout import Strategy, check_strategy, megatron_strategy
from specs.model import ModelSpec, load_model
from specs.training import TrainingSpec, load_training, splits_for_context_parallel

if TYPE_CHECKING:
    from predictor.calibration import Interval
    from predictor.cost_model import CostContext, Evaluation
    from predictor.predictor import Predictor
    from profiler.profile import DeviceProfile


@dataclass(frozen=True)
class WhatIf:
    """A strategy to evaluate, the model and training it is for, and where it came from (for messages)."""

    model: ModelSpec
    training: TrainingSpec
    strategy: Strategy
    source: str


def check_plan_against_cluster(plan: LoadedPlan, cluster: ClusterSpec, cluster_file: str | Path) -> None:
    """Refuse a plan made for a cluster of another name (its devices and offsets would mean other hardware), a stage
    on a group the cluster does not have, and a stage whose written `device` is not its group's (the cluster decides
    a group's device: an edited `device` would change nothing)."""
    if plan.cluster_name and cluster.name != plan.cluster_name:
        raise SpecError(
            str(cluster_file),
            "name",
            f"the plan is for cluster {plan.cluster_name!r}, got {cluster.name!r}",
        )
    devices = {group.name: group.device.key for group in cluster.groups}
    for family, pipeline in enumerate(plan.strategy.pipelines):
        for number, stage in enumerate(pipeline.stages):
            if stage.group not in devices:  # the plan's mistake (or the wrong cluster file): named in the plan
                raise SpecError(
                    plan.source,
                    f"pipelines[{family}].stages[{number}].group",
                    f"expected a group of {cluster_file} ({', '.join(devices)}), got {stage.group!r}",
                )
    for family, (pipeline, written) in enumerate(zip(plan.strategy.pipelines, plan.written_devices, strict=False)):
        for number, (stage, device) in enumerate(zip(pipeline.stages, written, strict=False)):
            if device and _device_key(device) != devices[stage.group]:  # every group is the cluster's (above)
                raise SpecError(
                    plan.source,
                    f"pipelines[{family}].stages[{number}].device",
                    f"{device!r} is not group {stage.group!r}'s device in {cluster_file}, {devices[stage.group]!r} "
                    "(the cluster decides a group's device: edit the stage's group or the cluster)",
                )


def _device_key(name: str) -> str:
    """A written device's catalog key (by key or alias, any case), or the name itself when the catalog has none."""
    from specs.device import get_device

    try:
        return get_device(name).key
    except SpecError:
        return name


def recorded_cluster(plan: LoadedPlan, cluster: ClusterSpec, cluster_file: str | Path) -> ClusterSpec:
    """The cluster a plan is for: the cluster file's, on the nodes a re-plan recorded (`hetplan replan --without
    node:ascend/17` leaves ascend nodes 0..16 and 18..79, by the file's numbers: a launch skips the lost one, and
    a node added later keeps its own number); its devices, NICs and network are the file's."""
    numbers = dict(plan.cluster_nodes)
    if not numbers:
        return cluster
    missing = sorted(set(numbers) - {group.name for group in cluster.groups})
    if missing:  # (a group the plan leaves idle too: the file is not the one it was made for)
        raise SpecError(
            str(cluster_file),
            "groups",
            f"{plan.source} was made for a cluster with group {missing[0]!r} (search.cluster_nodes), this file has "
            "none: not the cluster it was made for",
        )
    if plan.cluster_changes is not None:
        check_recorded_changes(plan, cluster, cluster_file)
    groups = tuple(g.with_node_numbers(list(numbers[g.name])) for g in cluster.groups if numbers.get(g.name))
    return replace(cluster, groups=groups)


def check_recorded_changes(plan: LoadedPlan, cluster: ClusterSpec, cluster_file: str | Path) -> None:
    """The changes a plan records (search.cluster_changes: a re-plan's, none as planned), made again on the cluster
    file, leave the nodes it records (search.cluster_nodes): else the file is not the one the plan was made or
    re-planned from (a group with fewer or more nodes, other names): its node numbers would name other machines, and
    nodes it does not know of would be launched idle."""
    from planner.replan import CHANGE_FLAGS, changed_cluster, node_ranges

    changes = plan.cluster_changes or ()
    try:
        replayed = changed_cluster(cluster, (), (), earlier=changes, names=CHANGE_FLAGS)  # (as the re-plan said them)
    except SpecError as err:
        change = f"{err.source} {err.field}".strip()
        raise SpecError(
            str(cluster_file),
            "groups",
            f"{plan.source} was re-planned with {change}, which does not apply here: {err.expectation} "
            "(search.cluster_changes)",
        ) from None
    left = {group.name: group.node_numbers for group in replayed.groups}
    recorded = {name: list(numbers) for name, numbers in plan.cluster_nodes if numbers}
    wrong = [group for group in cluster.groups if left.get(group.name, []) != recorded.get(group.name, [])]
    if wrong:
        group = wrong[0]
        runs_on, leaves = recorded.get(group.name, []), left.get(group.name, [])
        also = f" (also {', '.join(g.name for g in wrong[1:])})" if wrong[1:] else ""
        if not changes:  # as planned: the file's groups have grown, shrunk or been added to since
            planned = f"for group {group.name!r} on {_nodes(len(runs_on))} ({node_ranges(runs_on)})"
            raise SpecError(
                str(cluster_file),
                f"groups.{group.name}.nodes",
                f"{plan.source} was planned {planned if runs_on else f'without group {group.name!r}'} "
                f"(search.cluster_nodes), this file gives it {group.nodes}{also}: not the cluster it was planned for "
                "(plan again on this file)",
            )
        # a hetplan before the changes were replayed could give a lost node's number to a node added later
        added = any(add for _, add in changes)
        older = " (or an older hetplan re-planned it, numbering added nodes otherwise: re-plan the plan it began as)"
        raise SpecError(
            str(cluster_file),
            f"groups.{group.name}.nodes",
            f"{plan.source} runs group {group.name!r} on nodes {node_ranges(runs_on) or 'none'} "
            f"(search.cluster_nodes); made again on this file's {_nodes(group.nodes)}, its recorded changes leave "
            f"{node_ranges(leaves) or 'none'}{also}: not the cluster it was re-planned from{older if added else ''}",
        )


def _nodes(count: int) -> str:
    return f"{count} node{'' if count == 1 else 's'}"


def plan_on_cluster(plan_file: str | Path, cluster_file: str | Path) -> tuple[LoadedPlan, ClusterSpec]:
    """A plan file and the cluster file it was made for (with the changes a re-plan recorded: recorded_cluster),
    checked together: the cluster's name, then the layout's structure (layers covered once, TP inside a node, devices
    within the groups, samples adding up to the batch), before anything sizes arrays or walks stages by it."""
    plan = load_plan(plan_file)
    cluster = load_cluster(cluster_file)
    check_plan_against_cluster(plan, cluster, cluster_file)
    cluster = recorded_cluster(plan, cluster, cluster_file)
    check_strategy(plan.strategy, cluster, plan.model, plan.training.global_batch_size, plan.source)
    return plan, cluster


# the layout fields the Megatron-style flags of `hetplan predict` set (megatron_strategy)
FLAG_OF_LAYOUT_FIELD = {
    "tp": "--tp",
    "pp": "--pp",
    "num_layers": "--pp",
    "replicas": "--dp",
    "micro_batch_size": "--micro-batch",
    "recompute": "--recompute",
    "virtual_stages": "--virtual-stages",
    "context_parallel": "--cp",
}


def what_if(
    cluster: ClusterSpec,
    cluster_file: str | Path,
    plan_file: Path | None,
    model: str | None,
    training_file: Path | None,
    overrides: Mapping[str, Any],
    megatron: Mapping[str, Any],
) -> WhatIf:
    """`plan_file`'s strategy (its model unless `model` names another, its training under the `overrides`; a plan
    brings its own training, so `training_file` goes with the Megatron-style strategy only), or the Megatron-style
    strategy of `megatron` (group, tp, pp, dp, micro_batch_size, recompute, virtual_stages, sequence_parallel) for
    `model`. None values in `overrides` are not given."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if plan_file is not None:
        if training_file is not None:
            raise SpecError("--training", "", "goes with the Megatron-style flags; a plan sets its own training")
        plan = load_plan(plan_file)
        check_plan_against_cluster(plan, cluster, cluster_file)
        batch = plan.training.global_batch_size
        if given.get("global_batch_size", batch) != batch:  # the stages' micro-batches add up to the plan's batch
            raise SpecError("--global-batch", "", f"the plan's micro-batches add up to {batch} sequences per "
                            f"iteration: re-plan for {given['global_batch_size']} (or leave the flag out)")  # fmt: skip
        other = load_model(model, "--model") if model else plan.model
        if other.num_layers != plan.model.num_layers:
            raise SpecError("--model", model or "", f"has {other.num_layers} layers, the plan's stages hold "
                            f"{plan.model.num_layers}: expected a model of as many layers (or re-plan)")  # fmt: skip
        if model and plan.training.seq_length is None:  # the plan's sequence, not the other model's default
            given.setdefault("seq_length", plan.model.seq_length)
        training = load_training(None, {**plan.training.model_dump(), **given}, "flags")
        return WhatIf(other, training, with_zero(plan.strategy, given), str(plan_file))
    if model is None:
        raise SpecError("--model", "", "required with Megatron-style flags (or pass --strategy plan.json)")
    flags = dict(megatron)
    model_spec = load_model(model, "--model")
    overrides = {**given, "sequence_parallel": flags.pop("sequence_parallel", None)}
    training = load_training(training_file, overrides, "flags")
    pp, chunks = flags["pp"], flags["virtual_stages"]
    if chunks > 1 and pp == 1:  # predicted as plain 1F1B while labelled interleaved
        raise SpecError(
            "--virtual-stages", "", f"interleaves the chunks of two or more stages: {chunks} with --pp 1 has none "
            "to interleave (Megatron refuses it); pass --pp 2 or more, or leave it out"
        )  # fmt: skip
    if chunks > 1 and model_spec.num_layers % pp == 0 and (model_spec.num_layers // pp) % chunks:
        raise SpecError(
            "--virtual-stages", "", f"{model_spec.num_layers // pp} layers per stage do not split evenly into "
            f"{chunks} chunks (Megatron requires it); use a plan with uneven stages"
        )  # fmt: skip
    try:
        strategy = megatron_strategy(cluster, model_spec, training, **flags, source="--tp/--pp/--dp flags")
    except SpecError as err:  # a flag's mistake, named as the flag
        if err.field in FLAG_OF_LAYOUT_FIELD:
            raise SpecError(FLAG_OF_LAYOUT_FIELD[err.field], "", err.expectation) from None
        if err.field != "group":
            raise
        names = ", ".join(group.name for group in cluster.groups)
        where = f"no group named {flags['group']!r}" if flags.get("group") else "the cluster has several groups"
        raise SpecError("--group", "", f"{where}: expected one of {names} (cluster {cluster.name!r})") from None
    return WhatIf(model_spec, training, strategy, "flags")


def with_zero(strategy: Strategy, given: Mapping[str, Any]) -> Strategy:
    """The strategy under a given ZeRO stage (for every family) and sharding scope (`--zero-stage`, `--zero-shard`):
    a plan decides them per family, so changing the training alone would change nothing."""
    if "zero_stage" in given:
        pipelines = tuple(replace(pipeline, zero_stage=None) for pipeline in strategy.pipelines)
        strategy = replace(strategy, pipelines=pipelines, zero_stage=given["zero_stage"])
    if "zero_shard" in given:
        strategy = replace(strategy, zero_shard=given["zero_shard"])
    return strategy


def predicted(
    chosen: WhatIf, cluster: ClusterSpec, predictor: Predictor, profiles: Mapping[str, DeviceProfile]
) -> tuple[CostContext, Evaluation, Interval]:
    """`hetplan predict`: the strategy evaluated with the predictor's calibrated context (structure checked), and
    the 90% interval on its iteration time from the uncalibrated one."""
    from planner.planning import predict

    ctx = predictor.context(cluster, chosen.model, chosen.training, profiles)
    try:
        evaluation = predict(ctx, chosen.strategy, chosen.source)
    except SpecError as err:
        flag = FLAG_OF_LAYOUT_FIELD.get(err.field.rsplit(".", 1)[-1]) if chosen.source == "flags" else None
        if flag is None:
            raise
        raise SpecError(flag, "", err.expectation) from None  # the layout field a Megatron-style flag set
    base = predictor.base_context(cluster, chosen.model, chosen.training, profiles)
    return ctx, evaluation, predictor.interval(base, chosen.strategy)


def check_local_run(cluster: ClusterSpec, cluster_file: str | Path) -> None:
    """`hetplan run` trains on this machine's CPU: a cluster of other devices belongs under torchrun."""
    not_cpu = sorted({g.device.key for g in cluster.groups} - {"cpu"})
    if not_cpu:
        raise SpecError(
            str(cluster_file),
            "groups",
            f"local runs use this machine's CPU; the cluster has {', '.join(not_cpu)} (run one rank per device "
            "under torchrun on the real cluster)",
        )


def check_runtime_layout(plan: LoadedPlan) -> None:
    """What hetplan's runtime cannot execute, refused in one line before anything starts: a ZeRO stage per family,
    ZeRO sharded per node, and context parallelism over sequences that do not cut into the 2 * cp equal chunks its
    ranks hold (runtime/context_parallel.py)."""
    stages = {plan.strategy.family_zero_stage(p) for p in plan.strategy.pipelines}
    if len(stages) > 1:
        raise SpecError(
            plan.source,
            "pipelines.zero_stage",
            f"the local runtime runs one ZeRO stage for the whole plan, this one has one per family "
            f"({sorted(stages)}): plan with one --zero-stage to run it",
        )
    if plan.strategy.zero_shard == "node":
        raise SpecError(
            plan.source,
            "zero_shard",
            "the local runtime shards ZeRO over the whole DP group, not per node: plan with --zero-shard dp to run it",
        )
    cp = plan.strategy.context_parallel
    seq_length = plan.training.seq_length or plan.model.seq_length
    if not splits_for_context_parallel(seq_length, cp):
        raise SpecError(
            plan.source,
            "pipelines.context_parallel",
            f"the runtime cuts sequences into 2 x {cp} equal chunks (causal load balance); {seq_length} tokens do "
            "not divide",
        )


# What hetplan's runtime overlaps: nothing of the DP traffic (runtime/execute.py reduces the gradients after the flush
# and, under ZeRO-1, gathers the weights after the update), whatever the training file says an engine would overlap.
RUNTIME_TRAINING = {"overlap_grad_reduce": False, "overlap_param_gather": False}


def run_context(
    plan: LoadedPlan, predictor: Predictor, profiles: Mapping[str, DeviceProfile]
) -> Callable[[ClusterSpec], CostContext]:
    """The cost context a run's prediction comes from, for the cluster as the local ranks see it and the training as
    hetplan's runtime executes it (RUNTIME_TRAINING): this machine's profiles as they are (uncalibrated) when given,
    else the predictor's calibrated context."""
    training = plan.training.model_copy(update=RUNTIME_TRAINING)

    def context(seen: ClusterSpec) -> CostContext:
        if profiles:  # named as such: the predictor's identity alone says what its calibration was fitted on
            base = predictor.base_context(seen, plan.model, training, profiles)
            return replace(base, identity=f"{base.identity}, its calibration not applied")
        return predictor.context(seen, plan.model, training)

    return context


def cpu_share(cluster: ClusterSpec) -> float:
    """The share of a core each local rank gets when the ranks outnumber this machine's cores."""
    from profiler.machine import host_cores

    return min(1.0, host_cores() / cluster.num_devices)


def prediction_context(
    cluster: ClusterSpec, context: Callable[[ClusterSpec], CostContext], share: float | None = None
) -> CostContext:
    """The cost context of a local run's prediction: `context(cluster)` when its costs model this host (measured core
    sharing, predictor/host.py), else `context` of the cluster as the local ranks see it under the assumed share of a
    core each (`share`, default cpu_share)."""
    from predictor.host import local_run_context

    return local_run_context(context, cluster, cpu_share(cluster) if share is None else share)


SAME_TIME = 0.005  # a local run's prediction within this of the plan's is the plan's (nothing to say)
MAX_LOCAL_RANKS = 16  # processes a local run spawns at most, one per device (more: under torchrun)


@dataclass(frozen=True)
class LocalRun:
    """What `hetplan run` predicts for a plan on this machine, where it differs from the plan's time, and why (in
    words, one phrase each)."""

    time_s: float
    reasons: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_iteration_time_s": self.time_s, "why": list(self.reasons)}


def runs_as_planned(plan: LoadedPlan, chosen: WhatIf) -> bool:
    """`predict --strategy`'s what-if is the plan as `hetplan run` would run it: its model and training (flags that
    repeat them change nothing; another dtype, as `run --dtype` gives it)."""

    def runs(training: TrainingSpec, model: ModelSpec) -> dict[str, Any]:
        # the sequence as trained (unset: the model's), the dtype aside
        seq_length = training.seq_length or model.seq_length
        return training.model_copy(update={"dtype": "", "seq_length": seq_length}).model_dump()

    same_model = chosen.model.shape == plan.model.shape  # (`--model gpt3-1.7b` beside its plan: the catalog's source)
    return same_model and runs(chosen.training, chosen.model) == runs(plan.training, plan.model)


def local_run(
    plan: LoadedPlan, cluster: ClusterSpec, predictor: Predictor, profiles: Mapping[str, DeviceProfile]
) -> LocalRun | None:
    """The iteration time `hetplan run` predicts for the plan on this machine (run_context on the cores as its local
    ranks share them) and why it is not the plan's: the ranks share fewer cores (costs without measured host costs,
    which simulate the sharing, are for a core per device: cpu-2x2's tiny plan 1.0 s planned, 2.3 s predicted for
    the run), nothing is overlapped (the runtime reduces gradients after the flush where the training overlaps them,
    as the engines do: a newcomer's plan said 0.251 s, the run's prediction 0.375 s), measured profiles are costed as
    measured (the plan's are calibrated). None where `run` would not run it here (a cluster of other devices than
    CPUs, which it trains under torchrun only; more than MAX_LOCAL_RANKS devices; a layout or dtype the runtime
    refuses), or when the two agree within SAME_TIME."""
    from predictor.cost_model import evaluate
    from profiler.machine import host_cores

    if any(group.device.vendor != "cpu" for group in cluster.groups) or cluster.num_devices > MAX_LOCAL_RANKS:
        return None
    if plan.training.dtype == "fp8":  # the runtime has no FP8 GEMMs (runtime.launch.check_dtype)
        return None
    try:
        check_runtime_layout(plan)
    except SpecError:
        return None
    planned = predictor.context(cluster, plan.model, plan.training, profiles)
    planned_s = evaluate(planned, plan.strategy).iteration_time_s
    run_s = evaluate(
        prediction_context(cluster, run_context(plan, predictor, profiles)), plan.strategy
    ).iteration_time_s
    if abs(run_s / planned_s - 1.0) < SAME_TIME:
        return None
    reasons = []
    if cpu_share(cluster) < 1.0 and not any(group.device.key in planned.host for group in cluster.groups):
        cores = host_cores()
        reasons.append(
            f"its {cluster.num_devices} ranks share {cores} cores here (the plan's times: a core per device)"
        )
    not_overlapped = replace(planned, training=planned.training.model_copy(update=RUNTIME_TRAINING))
    if evaluate(not_overlapped, plan.strategy).iteration_time_s > planned_s * (1.0 + SAME_TIME):
        overlapped = [
            what
            for what, field in (
                ("gradient reduction", "overlap_grad_reduce"),
                ("weight gathering", "overlap_param_gather"),
            )
            if getattr(plan.training, field)
        ]
        reasons.append(f"it does not overlap {' or '.join(overlapped)} with compute (the engines do, as planned)")
    # (the shipped predictor's calibration has no terms of a CPU cluster's: said only where it changes the plan's time)
    as_measured = predictor.base_context(cluster, plan.model, plan.training, profiles) if profiles else planned
    if abs(evaluate(as_measured, plan.strategy).iteration_time_s / planned_s - 1.0) >= SAME_TIME:
        reasons.append("it costs the measured profiles as measured, without the predictor's calibration")
    return LocalRun(run_s, tuple(reasons) or ("as the local runtime runs it",))


def check_changes(without: Sequence[str], add: Sequence[str], cluster: ClusterSpec) -> None:
    """`replan`'s change list: something changed (the example names the cluster's own last node), and no node is
    named lost twice (node:ascend/1 and node:ascend/node01 are one node; removing it twice would remove two)."""
    from planner.replan import CHANGE

    if not without and not add:
        group = cluster.groups[-1]
        raise SpecError(
            "--without/--add", "", f"say what changed, e.g. --without node:{group.name}/{group.node_numbers[-1]}"
        )
    seen: dict[tuple[str, int], str] = {}
    for item in without:
        match = CHANGE.match(item)
        if match is None or match["node"] is None:
            continue
        node = (match["node_group"], int(match["node"]))
        if node in seen:
            raise SpecError("--without", item, f"names the node {seen[node]!r} already named; give each lost node once")
        seen[node] = item
