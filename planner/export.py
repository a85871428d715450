"""Exports: a plan as the files the engines people already run read (see shared/reference/engines.md).

Each exporter writes ready-to-run argument files or configs plus one torchrun command per node. When the engine
cannot express the plan (per-stage TP, uneven replica batches, per-stage recompute, interleaving: its flags in the
engine registry, specs/engines.py), the export says exactly what is lost and describes the closest plan the engine
can run, with that plan's predicted time. Launch commands take each vendor's visible-devices variable from the
vendor registry (specs/vendors.py).

Rank order: Megatron-style engines number ranks tp-cp-ep-dp-pp (pipeline stage outermost). torchrun numbers ranks by
node rank, then local rank; so the nodes are listed stage by stage, and each node's visible devices are ordered as
the stage's (replica, TP rank) order needs. A layout whose stages split a node between non-adjacent ranks cannot be
launched that way and is refused with the stage that breaks it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.search import search
from predictor.cost_model import CostContext, evaluate, interleaved_group_size
from specs.engines import Engine, get_engine
from specs.errors import SpecError
from specs.layout import PipelineStrategy, Strategy, pack_stages, split_batch
from specs.model import RECOMPUTE_MODES
from specs.vendors import get_vendor

MASTER_PORT = 29500


@dataclass(frozen=True)
class NodeLaunch:
    group: str
    node: int  # index within the group
    node_rank: int
    devices: tuple[int, ...]  # local device indices, in local-rank order
    command: str


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
            "nodes": len(self.nodes),
            "notes": self.notes,
        }


# ---- the closest plan an engine can run -----------------------------------------------------------------------
def _with_tp(pipeline: PipelineStrategy, tp: int) -> PipelineStrategy:
    """Every stage at one TP degree, packed from the start of each group."""
    return replace(pipeline, stages=pack_stages((replace(s, tp=tp) for s in pipeline.stages), pipeline.replicas))


def _one_recompute(strategy: Strategy, mode: str) -> Strategy:
    pipeline = strategy.pipelines[0]
    stages = tuple(replace(s, recompute=None) for s in pipeline.stages)
    return replace(strategy, recompute=mode, pipelines=(replace(pipeline, stages=stages),))


def _even_batch(strategy: Strategy, global_batch: int) -> Strategy | None:
    """The most replicas (at most the plan's) that split the batch into equal whole micro-batches."""
    pipeline = strategy.pipelines[0]
    for replicas in range(pipeline.replicas, 0, -1):
        split = split_batch(global_batch, replicas, pipeline.micro_batch_size)
        if split and split[0] * replicas == split[1]:
            even = replace(pipeline, replicas=replicas, num_microbatches=split[0], total_microbatches=0)
            return replace(strategy, pipelines=(replace(even, stages=pack_stages(pipeline.stages, even.replicas)),))
    return None


def _fastest_fitting(ctx: CostContext, candidates: list[Strategy]) -> Strategy | None:
    best, best_time = None, float("inf")
    for candidate in candidates:
        try:
            ctx.check_strategy(candidate, "export")
        except SpecError:
            continue
        evaluation = evaluate(ctx, candidate)
        if evaluation.fits and evaluation.iteration_time_s < best_time:
            best, best_time = candidate, evaluation.iteration_time_s
    return best


def closest(ctx: CostContext, strategy: Strategy, engine: Engine) -> tuple[Strategy, list[str]]:
    """The fastest fitting plan within the engine's limits, near the given one, and what had to change. A plan of
    several pipeline families is replaced by the best plan of one family first."""
    lost: list[str] = []
    if len(strategy.pipelines) > 1 and not engine.pipeline_families:
        single = ctx.training.model_copy(update={"families": "off"})
        found = search(replace(ctx, training=single))
        if not found.evaluations:
            raise SpecError("export", "plan", "no plan of one pipeline family fits memory")
        lost.append(
            f"{len(strategy.pipelines)} pipeline families with their own batch shares -> one family "
            "(the best plan of one family)"
        )
        strategy = found.evaluations[0].strategy
    pipeline = strategy.pipelines[0]
    candidates = [strategy]
    if not engine.interleaving and strategy.virtual_stages > 1:
        lost.append(f"interleaved 1F1B with {strategy.virtual_stages} virtual stages -> plain 1F1B")
        candidates = [replace(c, virtual_stages=1) for c in candidates]
    modes = {strategy.stage_recompute(s) for s in pipeline.stages}
    if not engine.per_stage_recompute and len(modes) > 1:
        lost.append(f"per-stage recompute ({strategy.recompute_summary}) -> one mode for all stages")
        candidates = [_one_recompute(c, mode) for c in candidates for mode in RECOMPUTE_MODES]
    widths = sorted({s.tp for s in pipeline.stages})
    if not engine.per_stage_tp and len(widths) > 1:
        lost.append(f"per-stage TP ({', '.join(str(s.tp) for s in pipeline.stages)}) -> one TP degree")
        candidates = [replace(c, pipelines=(_with_tp(c.pipelines[0], t),)) for c in candidates for t in widths]
    if not engine.uneven_batch and pipeline.uneven:
        lost.append(
            f"uneven batch shares ({pipeline.microbatch_total} micro-batches over {pipeline.replicas} replicas) "
            "-> the same number of micro-batches on every replica"
        )
        candidates = [even for c in candidates if (even := _even_batch(c, ctx.training.global_batch_size))]
    if not lost or candidates == [strategy]:
        return strategy, lost
    chosen = _fastest_fitting(ctx, candidates)
    if chosen is None:
        raise SpecError("export", "plan", "no plan within the engine's limits fits memory: " + "; ".join(lost))
    return chosen, lost


# ---- launching --------------------------------------------------------------------------------------------------
def node_launches(ctx: CostContext, strategy: Strategy, entry: str) -> list[NodeLaunch]:
    """torchrun commands, nodes in Megatron rank order (stage, then replica, then TP rank)."""
    pipeline = strategy.pipelines[0]
    order: list[tuple[str, int]] = []  # (group, device index in the group), in global rank order
    for stage in pipeline.stages:
        order += [(stage.group, stage.device_offset + i) for i in range(pipeline.stage_devices(stage))]
    nodes: list[tuple[str, int, list[int]]] = []
    for index, (group_name, device) in enumerate(order):
        per_node = ctx.cluster.group(group_name).devices_per_node
        node, local = divmod(device, per_node)
        if nodes and nodes[-1][:2] == (group_name, node):
            nodes[-1][2].append(local)
        elif any(n[:2] == (group_name, node) for n in nodes):
            why = (
                f"rank {index} would reopen node {node} of {group_name}: its devices are not contiguous in the "
                "engine's rank order (tp-dp-pp); reorder the stages or use whole nodes per stage"
            )
            raise SpecError("export", "stages", why)
        else:
            nodes.append((group_name, node, [local]))
    world = len(order)
    launches = []
    for node_rank, (group_name, node, devices) in enumerate(nodes):
        group = ctx.cluster.group(group_name)
        env = get_vendor(group.device.vendor).visible_devices_env
        prefix = f"{env}={','.join(str(d) for d in devices)} " if env else ""
        command = (
            f"{prefix}torchrun --nnodes {len(nodes)} --node-rank {node_rank} --nproc-per-node {len(devices)} "
            f"--master-addr $MASTER_ADDR --master-port {MASTER_PORT} {entry}"
        )
        launches.append(NodeLaunch(group_name, node, node_rank, tuple(devices), command))
    assert sum(len(n.devices) for n in launches) == world
    return launches


def _launch_script(launches: list[NodeLaunch], title: str) -> str:
    lines = [
        "#!/usr/bin/env bash",
        f"# {title}",
        f"# Run on every node with NODE_RANK set (0 .. {len(launches) - 1}); MASTER_ADDR is node rank 0's address.",
        'set -euo pipefail\n: "${MASTER_ADDR:?set MASTER_ADDR}" "${NODE_RANK:?set NODE_RANK}"',
        'case "$NODE_RANK" in',
    ]
    for launch in launches:
        lines.append(f"  {launch.node_rank}) # {launch.group} node {launch.node}")
        lines.append(f"    exec {launch.command} ;;")
    lines += ['  *) echo "NODE_RANK must be 0..' + str(len(launches) - 1) + '" >&2; exit 2 ;;', "esac", ""]
    return "\n".join(lines)


# ---- engines ----------------------------------------------------------------------------------------------------
def chunk_layer_counts(strategy: Strategy) -> list[int]:
    """Decoder layers per model chunk in model order, as interleaving engines deal chunks: chunk c of stage s is
    model part c * stages + s, and each stage's layers are spread over its v chunks as evenly as whole layers allow
    (every rank keeps the plan's layer count; with v > 1 not the plan's layer ids)."""
    stages, v = strategy.pipelines[0].stages, strategy.virtual_stages
    return [s.num_layers // v + (1 if c < s.num_layers % v else 0) for c in range(v) for s in stages]


def megatron_layout(strategy: Strategy) -> str:
    """`--pipeline-model-parallel-layout`: E embedding, t decoder layer, L loss, | between model chunks."""
    parts = [f"t*{n}" if n else "" for n in chunk_layer_counts(strategy)]
    parts[0] = "E" + ("," + parts[0] if parts[0] else "")
    parts[-1] = (parts[-1] + "," if parts[-1] else "") + "L"
    return "|".join(parts)


def _model_args(ctx: CostContext) -> list[str]:
    model = ctx.model
    args = [
        f"--num-layers {model.num_layers}",
        f"--hidden-size {model.hidden_size}",
        f"--ffn-hidden-size {model.ffn_hidden_size}",
        f"--num-attention-heads {model.num_attention_heads}",
        f"--seq-length {ctx.seq_length}",
        f"--max-position-embeddings {max(ctx.seq_length, model.seq_length)}",
        f"--vocab-size {model.vocab_size}",
    ]
    if model.num_kv_heads != model.num_attention_heads:
        args += ["--group-query-attention", f"--num-query-groups {model.num_kv_heads}"]
    if model.mlp == "swiglu":
        args += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope", "--disable-bias-linear"]
        args += ["--untie-embeddings-and-output-weights"]
    dtype = ctx.training.dtype
    if dtype in ("bf16", "fp16"):
        args.append(f"--{dtype}")
    return args


def _recompute_args(mode: str) -> list[str]:
    if mode == "selective":
        return ["--recompute-granularity selective"]
    if mode == "full":
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    return []


def _megatron(ctx: CostContext, strategy: Strategy) -> dict[str, str]:
    pipeline = strategy.pipelines[0]
    args = [
        *_model_args(ctx),
        f"--tensor-model-parallel-size {pipeline.stages[0].tp}",
        f"--pipeline-model-parallel-size {len(pipeline.stages)}",
        f"--micro-batch-size {pipeline.micro_batch_size}",
        f"--global-batch-size {ctx.training.global_batch_size}",
        "--calculate-per-token-loss",
    ]
    counts = {s.num_layers for s in pipeline.stages}
    if len(pipeline.stages) > 1 and (len(counts) > 1 or strategy.virtual_stages > 1):
        args.append(f"--pipeline-model-parallel-layout {shlex.quote(megatron_layout(strategy))}")
    stages, microbatches = len(pipeline.stages), pipeline.num_microbatches
    if strategy.virtual_stages > 1 and interleaved_group_size(microbatches, stages) != stages:
        # Megatron refuses an interleaved run whose micro-batches do not fall into groups of at least p
        size = interleaved_group_size(microbatches, stages)
        args.append(f"--microbatch-group-size-per-virtual-pipeline-stage {size}")
    args += _recompute_args(strategy.recompute)
    if strategy.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    if strategy.sequence_parallel and pipeline.stages[0].tp > 1:
        args.append("--sequence-parallel")
    return {"megatron_args.txt": " \\\n  ".join(args) + "\n"}


def _flagscale(ctx: CostContext, strategy: Strategy) -> dict[str, str]:
    pipeline = strategy.pipelines[0]
    meshes: list[list[int]] = []  # tp cp ep dp pp per run of stages on one group with one TP
    device_types, splits = [], []
    for stage in pipeline.stages:
        device = ctx.cluster.group(stage.group).device.key
        if meshes and device_types[-1] == device and meshes[-1][0] == stage.tp:
            meshes[-1][4] += 1
        else:
            meshes.append([stage.tp, 1, 1, pipeline.replicas, 1])
            device_types.append(device)
        splits.append(stage.num_layers)
    args = [
        *_model_args(ctx),
        "--enable-hetero",
        "--hetero-process-meshes " + " ".join(str(x) for mesh in meshes for x in mesh),
        "--hetero-pipeline-layer-split " + " ".join(str(n) for n in splits),
        "--hetero-device-types " + " ".join(device_types),
        f"--pipeline-model-parallel-size {len(pipeline.stages)}",
        f"--micro-batch-size {pipeline.micro_batch_size}",
        f"--global-batch-size {ctx.training.global_batch_size}",
    ]
    args += _recompute_args(strategy.recompute)
    if strategy.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    return {"flagscale_args.txt": " \\\n  ".join(args) + "\n"}


def _deepspeed(ctx: CostContext, strategy: Strategy) -> dict[str, str]:
    pipeline = strategy.pipelines[0]
    config = {
        "train_batch_size": ctx.training.global_batch_size,
        "train_micro_batch_size_per_gpu": pipeline.micro_batch_size,
        "gradient_accumulation_steps": pipeline.num_microbatches,
        "zero_optimization": {"stage": strategy.zero_stage},
        "bf16": {"enabled": ctx.training.dtype == "bf16"},
        "fp16": {"enabled": ctx.training.dtype == "fp16"},
        "pipeline": {"stages": len(pipeline.stages), "partition_method": "hetplan"},
    }
    if strategy.recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    bounds = [pipeline.stages[0].layer_start] + [s.layer_end for s in pipeline.stages]
    parts = [0] + [b + 1 for b in bounds[1:-1]] + [bounds[-1] + 2]  # + embedding first, + head last
    module = f'''"""PipelineModule with hetplan's stage boundaries (DeepSpeed's partition_method has no explicit list).

Layers: [embedding, decoder 0 .. {ctx.model.num_layers - 1}, head]; stage i owns layers parts[i]:parts[i+1].
"""

from deepspeed.pipe import PipelineModule

PARTS = {parts}


class HetplanPipelineModule(PipelineModule):
    def _partition_layers(self, method: str = "uniform") -> None:
        if method != "hetplan":
            return super()._partition_layers(method)
        self.parts = list(PARTS)
        stage = self.stage_id
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
'''
    return {"ds_config.json": json.dumps(config, indent=2) + "\n", "hetplan_pipeline.py": module}


def _torchtitan(ctx: CostContext, strategy: Strategy) -> dict[str, str]:
    pipeline = strategy.pipelines[0]
    parts, start = [], 0
    for count in chunk_layer_counts(strategy):
        parts.append([f"layers.{i}" for i in range(start, start + count)])
        start += count
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    schedule = "1F1B" if strategy.virtual_stages == 1 else "Interleaved1F1B"
    activation = {"none": "none", "selective": "selective", "full": "full"}[strategy.recompute]
    toml = "\n".join(
        [
            "# hetplan export for torchtitan (merge into your job config)",
            "[parallelism]",
            f"tensor_parallel_degree = {pipeline.stages[0].tp}",
            f"pipeline_parallel_degree = {len(pipeline.stages)}",
            f"data_parallel_replicate_degree = {pipeline.replicas}",
            "data_parallel_shard_degree = 1",
            f'pipeline_parallel_schedule = "{schedule}"',
            f"pipeline_parallel_microbatch_size = {pipeline.micro_batch_size}",
            "module_fqns_per_model_part = " + json.dumps(parts),
            "",
            "[training]",
            f"global_batch_size = {ctx.training.global_batch_size}",
            f"local_batch_size = {pipeline.samples_per_replica}",
            f"seq_len = {ctx.seq_length}",
            f'mixed_precision_param = "{"bfloat16" if ctx.training.dtype == "bf16" else "float32"}"',
            "",
            "[activation_checkpoint]",
            f'mode = "{activation}"',
            "",
        ]
    )
    return {"torchtitan.toml": toml}


def _launch_only(ctx: CostContext, strategy: Strategy) -> dict[str, str]:
    """torchrun starts the user's own script: the launch commands are the whole export."""
    return {}


Writer = Callable[[CostContext, Strategy], dict[str, str]]
WRITERS: dict[str, Writer] = {
    "megatron": _megatron,
    "flagscale": _flagscale,
    "deepspeed": _deepspeed,
    "torchtitan": _torchtitan,
    "torchrun": _launch_only,
}  # one per engine of specs/catalog/engines.yaml, which says what each can express


def export_plan(ctx: CostContext, strategy: Strategy, fmt: str) -> Export:
    """The plan in an engine's terms (or the closest plan the engine can run), with per-node torchrun commands."""
    engine = get_engine(fmt, "--format")
    writer = WRITERS.get(engine.key)
    if writer is None:
        raise SpecError("--format", "", f"{engine.key} is in the engine registry but has no exporter yet")
    ctx.check_strategy(strategy, "plan")
    exported, lost = closest(ctx, strategy, engine)
    files = writer(ctx, exported)
    launches = node_launches(ctx, exported, engine.entry)
    files["launch.sh"] = _launch_script(launches, f"hetplan export --format {engine.key}: one torchrun per node")
    notes = []
    vendors = sorted({ctx.cluster.group(s.group).device.vendor for s in exported.pipelines[0].stages})
    if len(vendors) > 1 and not engine.mixed_vendors:
        notes.append(
            f"the plan spans vendors {', '.join(vendors)}: {engine.key} runs one collective library for the whole "
            "job; launch it over the hetplan backend's bridge (comm/) or use FlagScale's hetero mode"
        )
    if strategy.virtual_stages > 1 and engine.interleaving:
        notes.append(
            "interleaving keeps each rank's layer count, not its layer ids (the engine deals chunks round-robin)"
        )
    return Export(
        engine.key,
        exported,
        evaluate(ctx, exported).iteration_time_s,
        evaluate(ctx, strategy).iteration_time_s,
        lost,
        files,
        launches,
        notes,
    )
