"""Exports: a plan as the files the engines people already run read (see shared/reference/engines.md).

Each engine gets ready-to-run argument files or configs (planner/engine_files.py) plus one torchrun command per node.
When the engine cannot express the plan (per-stage TP, uneven replica batches, per-stage recompute, interleaving: its
flags in the engine registry, specs/engines.py), the export says exactly what is lost and describes the closest plan
the engine can run, with that plan's predicted time. Launch commands take each vendor's visible-devices variable from
the vendor registry (specs/vendors.py).

Rank order: Megatron-style engines number ranks tp-cp-ep-dp-pp (pipeline stage outermost). torchrun numbers ranks by
node rank, then local rank; so the nodes are listed stage by stage, and each node's visible devices are ordered as
the stage's (replica, TP rank) order needs. A layout whose stages split a node between non-adjacent ranks cannot be
launched that way and is refused with the stage that breaks it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.engine_files import ARCHITECTURE_NOTE, EXPORTED_PLAN_FILE, TORCHTITAN_UNTIED_NOTE, WRITERS, Args
from planner.engine_space import Closest, closest, engine_dtype, vendors_note
from planner.plan import layout_changes
from predictor.cost_model import CostContext, Evaluation, evaluate
from specs.cluster import ClusterSpec
from specs.engines import Engine, get_engine
from specs.errors import SpecError, expect_argument, wrong_argument
from specs.layout import Strategy
from specs.loading import text_sha256
from specs.training import TrainingSpec
from specs.vendors import get_vendor

MASTER_PORT = 29500


@dataclass(frozen=True)
class NodeLaunch:
    """One node's torchrun: which node of which group, its node rank and the local devices its ranks use."""

    group: str
    node: int  # the cluster file's number of the node in its group (DeviceGroup.node_number)
    node_rank: int
    devices: tuple[int, ...]  # local device indices, in local-rank order
    visible_devices_env: str  # the vendor's variable (CUDA_VISIBLE_DEVICES, ...); "" when it has none

    @property
    def visible(self) -> str:
        return ",".join(str(d) for d in self.devices)


@dataclass
class Export:
    format: str
    strategy: Strategy  # what the files describe (the plan itself, or the closest plan the engine can run)
    predicted_iteration_time_s: float
    plan_iteration_time_s: float
    lost: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> content
    nodes: list[NodeLaunch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the user must know that does not change the plan

    def summary(self) -> dict[str, object]:
        return {
            "format": self.format,
            "lost": self.lost,
            "plan_iteration_time_s": self.plan_iteration_time_s,
            "exported_iteration_time_s": self.predicted_iteration_time_s,
            "slowdown": self.predicted_iteration_time_s / self.plan_iteration_time_s - 1.0,
            "files": sorted(self.files),
            # what each file held when written: a later export into the directory replaces it only when unchanged
            "files_sha256": {name: text_sha256(self.files[name]) for name in sorted(self.files)},
            "nodes": len(self.nodes),
            "notes": self.notes,
        }


# ---- engines ----------------------------------------------------------------------------------------------------


def _with_cluster_nodes(
    plan_json: str, cluster: ClusterSpec, changes: Sequence[tuple[Sequence[str], Sequence[str]]] | None
) -> str:
    """The exported plan with its cluster's nodes by number and the changes that left them, as a plan records them
    (planner.what_if.recorded_cluster reads them): a cluster that no re-plan changed is the cluster file's as it is
    (no changes: a file with other nodes is refused); renumbered nodes whose changes are unknown (a plan re-planned
    before plans recorded them) are recorded alone."""
    renumbered = any(group.node_ids for group in cluster.groups)
    if changes is None and not renumbered:
        changes = ()
    search: dict[str, Any] = {}
    if changes is not None:
        search["cluster_changes"] = [{"without": list(without), "add": list(add)} for without, add in changes]
    search["cluster_nodes"] = {group.name: group.node_numbers for group in cluster.groups}
    body = json.loads(plan_json)
    body["search"] = {**search, **body.get("search", {})}
    return json.dumps(body, indent=2) + "\n"


# ---- launching --------------------------------------------------------------------------------------------------
def node_launches(cluster: ClusterSpec, ranks: list[tuple[str, int]]) -> list[NodeLaunch]:
    """One torchrun per node for global ranks given as (group, device index in the group) in rank order; a node's
    devices must be contiguous in that order (torchrun numbers ranks node by node)."""
    nodes: list[tuple[str, int, list[int]]] = []
    for index, (group_name, device) in enumerate(ranks):
        node, local = divmod(device, cluster.group(group_name).devices_per_node)
        if nodes and nodes[-1][:2] == (group_name, node):
            nodes[-1][2].append(local)
        elif any(n[:2] == (group_name, node) for n in nodes):
            number = cluster.group(group_name).node_number(node)
            why = (
                f"rank {index} would reopen node {number} of {group_name}: its devices are not contiguous in the "
                "engine's rank order (tp-dp-pp); reorder the stages or use whole nodes per stage"
            )
            raise SpecError("export", "stages", why)
        else:
            nodes.append((group_name, node, [local]))
    launches = []
    for node_rank, (group_name, node, devices) in enumerate(nodes):
        vendor = get_vendor(cluster.group(group_name).device.vendor, cluster.source or "cluster", f"group {group_name}")
        env = vendor.visible_devices_env
        number = cluster.group(group_name).node_number(node)  # a re-planned cluster's nodes keep their numbers
        launches.append(NodeLaunch(group_name, number, node_rank, tuple(devices), env))
    return launches


def megatron_order(strategy: Strategy) -> list[tuple[str, int]]:
    """(group, device) of every global rank in Megatron's order: stage, then replica, then TP rank."""
    pipeline = strategy.pipelines[0]
    return [(s.group, s.device_offset + i) for s in pipeline.stages for i in range(pipeline.stage_devices(s))]


def torchrun_command(launch: NodeLaunch, nodes: int, entry: list[str], master_addr: str, port: int) -> str:
    """The node's command line: its visible devices, then torchrun with a static rendezvous at node rank 0."""
    prefix = f"env {launch.visible_devices_env}={launch.visible} " if launch.visible_devices_env else ""
    words = [
        "torchrun", "--nnodes", str(nodes), "--node-rank", str(launch.node_rank), "--nproc-per-node",
        str(len(launch.devices)), "--master-addr", master_addr, "--master-port", str(port), *entry,
    ]  # fmt: skip
    return prefix + " ".join(_command_word(w) for w in words)


def _command_word(word: str) -> str:
    """A shell word: a variable ($MASTER_ADDR) double-quoted so the shell expands it, anything else quoted."""
    if word.startswith('"$'):
        return word
    return f'"{word}"' if word.startswith("$") and word[1:].replace("_", "").isalnum() else shlex.quote(word)


def _shell_word(word: str) -> str:
    return f'"{word}"' if word.startswith("$here/") else shlex.quote(word)


def launch_script(
    launches: list[NodeLaunch],
    title: str,
    script: str,
    args: Args,
    what: str,
    plan_file: str = "",
    group_args: Mapping[str, list[str]] | None = None,
) -> str:
    """A bash script every node runs: node rank from its argument, $NODE_RANK or $SLURM_NODEID; the node's visible
    devices exported; torchrun started with the engine's arguments as a bash array (real arguments, no re-parsing),
    then `group_args` of the node's group (FlagScale's --hetero-current-device-type); `plan_file` (beside the
    script), when given, named to every rank in $HETPLAN_PLAN."""
    group_args = group_args or {}
    last = len(launches) - 1
    entry = " ".join(shlex.quote(w) for w in shlex.split(script))
    gets = "the plan's arguments, then EXTRA_ARGS" if args else "EXTRA_ARGS"
    usage = [
        f"usage: launch.sh [NODE_RANK] [EXTRA_ARGS...]   starts torchrun for {what} on this node",
        f"  {what}: TRAIN_SCRIPT=path overrides{'' if script else ' (required)'}; it gets {gets} (data, tokenizer, "
        "checkpoints ...)",
        *(
            [
                f"  HETPLAN_PLAN: the plan it runs ({plan_file} beside this script: stages, TP, micro-batches; "
                "planner.plan.load_plan reads it)"
            ]
            if plan_file
            else []
        ),
        f"  NODE_RANK (0..{last}): the argument, else $NODE_RANK, else $SLURM_NODEID; node rank k must be a node "
        "of the group named on its line in this script",
        "  MASTER_ADDR: node rank 0's address (under SLURM: the job's first host); MASTER_PORT: "
        f"{MASTER_PORT} unless set",
    ]
    lines = ["#!/usr/bin/env bash", f"# {title}", "#", *(f"# {u}" for u in usage)]
    lines += ["set -euo pipefail", "usage() {", "  cat >&2 <<'USAGE'", *usage, "USAGE", "}"]
    lines += [
        "if [[ ${1:-} == -h || ${1:-} == --help ]]; then usage; exit 0; fi",
        "if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then NODE_RANK=$1; shift; fi",
        'NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"',
        "if [[ -z $NODE_RANK ]]; then usage; exit 2; fi",
        "if [[ -z ${MASTER_ADDR:-} && -n ${SLURM_JOB_NODELIST:-} ]]; then",
        '  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "fi",
        ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node rank 0}"',
        f'MASTER_PORT="${{MASTER_PORT:-{MASTER_PORT}}}"',
        *(
            ['here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
            if plan_file or any("$here/" in w for a in args for w in a)
            else []
        ),
        *([f'export HETPLAN_PLAN="$here/{plan_file}"'] if plan_file else []),
        f"entry=({entry})",
        'if [[ -n ${TRAIN_SCRIPT:-} ]]; then entry=("$TRAIN_SCRIPT"); fi',
        'if [[ ${#entry[@]} -eq 0 ]]; then echo "launch.sh: set TRAIN_SCRIPT to the training script" >&2; exit 2; fi',
        "args=(",
        *(f"  {' '.join(_shell_word(w) for w in line)}" for line in args),
        ")",
        *(["node_args=()"] if group_args else []),
        'case "$NODE_RANK" in',
    ]
    for launch in launches:
        lines.append(f"  {launch.node_rank})  # {launch.group} node {launch.node}")
        if launch.visible_devices_env:
            lines.append(f"    export {launch.visible_devices_env}={launch.visible}")
        if group_args.get(launch.group):
            lines.append(f"    node_args=({' '.join(_shell_word(w) for w in group_args[launch.group])})")
        lines.append(f"    nproc={len(launch.devices)} ;;")
    lines += [
        f'  *) echo "launch.sh: NODE_RANK must be 0..{last}, got $NODE_RANK" >&2; exit 2 ;;',
        "esac",
        f'exec torchrun --nnodes {len(launches)} --node-rank "$NODE_RANK" --nproc-per-node "$nproc" \\',
        '  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "${entry[@]}" "${args[@]}"'
        + (' "${node_args[@]}"' if group_args else "")
        + ' "$@"',
        "",
    ]
    return "\n".join(lines)


def runtime_launches(cluster: ClusterSpec) -> list[NodeLaunch]:
    """The nodes of the cluster in the runtime's rank order (groups in cluster order, node-major)."""
    return node_launches(
        cluster, [(group.name, device) for group in cluster.groups for device in range(group.num_devices)]
    )


def launch_commands(
    plan_path: str,
    cluster: ClusterSpec,
    cluster_path: str,
    out: str = "run.json",
    master_addr: str = "$MASTER_ADDR",
    port: int = MASTER_PORT,
    extra: Sequence[str] = (),
) -> list[str]:
    """One torchrun command per node of the cluster that runs `hetplan run` on it as one rank per device: nodes in
    the runtime's rank order (groups in cluster order, node-major; static rendezvous, so node ranks are as listed),
    each node's visible devices from its vendor."""
    launches = runtime_launches(cluster)
    entry = ["--no-python", "hetplan", "run", plan_path, "--cluster", cluster_path, "--out", out, *extra]
    return [torchrun_command(launch, len(launches), entry, master_addr, port) for launch in launches]


def _memory_note(evaluation: Evaluation) -> str:
    """Where the exported plan does not fit the devices' memory (a plan edited by hand, a strategy built in code):
    its fullest stage against what its device can use; "" when it fits."""
    if evaluation.fits:
        return ""
    worst = max(evaluation.stages, key=lambda stage: stage.memory.total_bytes / stage.memory_usable_bytes)
    gib = 2**30
    return (
        f"it does not fit memory: family {worst.family}'s {worst.stage.group} stage (layers {worst.stage.layer_start}-"
        f"{worst.stage.layer_end - 1}) holds {worst.memory.total_bytes / gib:.1f} GiB per device, "
        f"{worst.memory_usable_bytes / gib:.1f} GiB usable: the engine would run out of memory (re-plan, or predict "
        "it to see every stage)"
    )


def _engine_plan_note(ctx: CostContext, strategy: Strategy, found: Closest) -> str:
    """Why the files describe the engine's own best plan rather than the plan with only the lost parts replaced, and
    everything that changes with it."""
    exported_s = evaluate(ctx, found.strategy).iteration_time_s
    if found.near is None:
        why = found.no_near
    else:
        why = (
            f"it is faster ({exported_s:.3f} s) than the plan with only those parts replaced "
            f"({evaluate(ctx, found.near).iteration_time_s:.3f} s; --keep-layout exports that one)"
        )
    # the exported plan is shown whole beside the note (`exported:`, export.json): not again here
    changes = [change for change in layout_changes(strategy, found.strategy) if not change.startswith("now ")]
    said = f"the files describe the engine's best plan, not the plan's layout: {why}"
    return said + ("; it changes " + "; ".join(changes) if changes else "")


def _kernels_context(
    ctx: CostContext, strategy: Strategy, engine: Engine, context_for: Callable[[TrainingSpec], CostContext]
) -> tuple[CostContext, str] | None:
    """The plan's costs with the kernels the engine runs the layers with, and a note of what they change; None when
    they change nothing (the plan's own kernels, or a predictor with no scale for the engine's)."""
    if not engine.kernels or engine.kernels == ctx.training.engine:
        return None
    kernels_ctx = context_for(ctx.training.model_copy(update={"engine": engine.kernels}))
    plan_s, with_kernels_s = (evaluate(c, strategy).iteration_time_s for c in (ctx, kernels_ctx))
    if with_kernels_s == plan_s:
        return None
    note = (
        f"the export's time is predicted with {engine.kernels}'s kernels, which {engine.key} runs the layers with: "
        f"the plan itself takes {with_kernels_s:.3f} s with them ({plan_s:.3f} s with {ctx.training.engine}'s, as "
        "planned; a training that names its `engine` keeps it)"
    )
    return kernels_ctx, note


def export_plan(
    ctx: CostContext,
    strategy: Strategy,
    fmt: str,
    keep_layout: bool = False,
    context_for: Callable[[TrainingSpec], CostContext] | None = None,
    keep_kernels: bool = False,
    cluster_changes: Sequence[tuple[Sequence[str], Sequence[str]]] | None = None,
) -> Export:
    """The plan in an engine's terms (or the closest plan the engine can run: engine_space.closest, `keep_layout`
    there), with per-node torchrun commands. `context_for(training)`: the plan's costs for another training; given,
    an engine that trains in another dtype (fp16 -> fp32, FP8 -> bf16) has its plan chosen and predicted in that
    dtype (else in the plan's, and its lost line says so), and with the kernels the engine runs its layers with
    (DeepSpeed's: a note says so) unless `keep_kernels` (the plan's training named its `engine`, e.g. Megatron's for
    Megatron-DeepSpeed, or the plan was made for this engine, which chose its kernels then). `cluster_changes`: a
    plan's changes to the cluster file (LoadedPlan.cluster_changes: a re-plan's, none as planned; None: not
    recorded), which the torchrun export's plan.json records beside the nodes, so a re-plan of it knows them too and a
    cluster file with other nodes is refused."""
    expect_argument(ctx, CostContext, "export_plan()", "ctx", "a CostContext: a Plan's .context, or build_context()")
    expect_argument(strategy, Strategy, "export_plan()", "strategy", "a Strategy (a loaded plan's or a Plan's "
                    ".strategy)")  # fmt: skip
    expect_argument(fmt, str, "export_plan()", "fmt", "an engine name (specs.engine_catalog())")
    for flag, value in (("keep_layout", keep_layout), ("keep_kernels", keep_kernels)):
        expect_argument(value, bool, "export_plan()", flag, "True or False")  # "no" is true
    if context_for is not None and not callable(context_for):
        taken = "a function of a TrainingSpec returning its CostContext (e.g. lambda training: predictor.context("
        raise wrong_argument(context_for, "export_plan()", "context_for", taken + "cluster, model, training)), or None")
    engine = get_engine(fmt, "export_plan()", "fmt")
    writer = WRITERS.get(engine.key)
    if writer is None:
        raise SpecError("--format", "", f"{engine.key} is in the engine registry but has no exporter yet")
    ctx.check_strategy(strategy, "export_plan(): strategy")  # (the CLI checked the plan file before)
    runs_ctx, kernels_note = ctx, ""
    kernels = None if keep_kernels or context_for is None else _kernels_context(ctx, strategy, engine, context_for)
    if kernels is not None:
        runs_ctx, kernels_note = kernels
    dtype = engine_dtype(ctx.training.dtype, engine)
    if dtype != ctx.training.dtype and context_for is not None:
        runs_ctx = context_for(runs_ctx.training.model_copy(update={"dtype": dtype}))
    found = closest(runs_ctx, strategy, engine, keep_layout, planned=ctx.training)
    exported, lost = found.strategy, found.lost
    files, args = writer(ctx, exported, strategy)
    if EXPORTED_PLAN_FILE in files:
        files[EXPORTED_PLAN_FILE] = _with_cluster_nodes(files[EXPORTED_PLAN_FILE], ctx.cluster, cluster_changes)
    launches = node_launches(ctx.cluster, megatron_order(exported))
    what = shlex.split(engine.script)[-1] if engine.script else "your training script"
    title = f"hetplan export --format {engine.key}: one torchrun per node ({len(launches)} nodes)"
    plan_file = EXPORTED_PLAN_FILE if EXPORTED_PLAN_FILE in files else ""
    # FlagScale's hetero mode asks each node its device type (its runner passes it from the hostfile's type=)
    flagscale = engine.key == "flagscale"
    group_args = {g.name: ["--hetero-current-device-type", g.device.key] for g in ctx.cluster.groups if flagscale}
    files["launch.sh"] = launch_script(launches, title, engine.script, args, what, plan_file, group_args)
    notes = [] if exported == found.near else [_engine_plan_note(runs_ctx, strategy, found)]
    notes += [kernels_note] if kernels_note else []
    notes += [note] if (note := vendors_note(ctx.cluster, exported, engine, runs_ctx.training.dtype)) else []
    if exported.virtual_stages > 1 and engine.interleaving and engine.script:  # (not the user's own script)
        notes.append(
            "interleaving keeps each rank's layer count, not its layer ids (the engine deals chunks round-robin)"
        )
    notes += [note] if (note := _memory_note(evaluate(runs_ctx, exported))) else []
    if engine.key in ("megatron", "flagscale") and ctx.model.mlp == "swiglu":
        notes.append(ARCHITECTURE_NOTE)
    if engine.key == "torchtitan" and ctx.model.tied_embeddings:
        notes.append(TORCHTITAN_UNTIED_NOTE)
    if engine.key == "deepspeed" and ctx.model.tied_embeddings:
        notes.append("the model ties its embedding and output: build them as one TiedLayerSpec (hetplan_pipeline.py)")
    return Export(
        engine.key,
        exported,
        evaluate(runs_ctx, exported).iteration_time_s,
        evaluate(ctx, strategy).iteration_time_s,
        lost,
        files,
        launches,
        notes,
    )
