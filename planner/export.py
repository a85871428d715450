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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from planner.engine_space import Closest, closest, engine_dtype, vendors_note
from planner.plan import evaluation_dict, header_dict, layout_changes
from predictor.cost_model import CostContext, Evaluation, evaluate, interleaved_group_size
from predictor.sharding import shard_ranks
from specs.cluster import ClusterSpec
from specs.engines import Engine, get_engine
from specs.errors import SpecError, expect_argument, wrong_argument
from specs.layout import Strategy, chunk_layer_counts
from specs.loading import text_sha256
from specs.model import ModelSpec
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
Args = list[list[str]]  # an engine's command line: one flag and its values per line, literal words ("$here/x": a file)


def megatron_layout(strategy: Strategy) -> str:
    """`--pipeline-model-parallel-layout`: E embedding, t decoder layer, L loss, | between model chunks."""
    parts = [f"t*{n}" if n else "" for n in chunk_layer_counts(strategy.pipelines[0], strategy.virtual_stages)]
    parts[0] = "E" + ("," + parts[0] if parts[0] else "")
    parts[-1] = (parts[-1] + "," if parts[-1] else "") + "L"
    return "|".join(parts)


def _model_args(ctx: CostContext) -> Args:
    model = ctx.model
    args = [
        ["--num-layers", str(model.num_layers)],
        ["--hidden-size", str(model.hidden_size)],
        ["--ffn-hidden-size", str(model.ffn_hidden_size)],
        ["--num-attention-heads", str(model.num_attention_heads)],
        ["--seq-length", str(ctx.seq_length)],
        ["--max-position-embeddings", str(max(ctx.seq_length, model.seq_length))],
        ["--vocab-size", str(model.vocab_size)],
    ]
    if model.head_dim is not None:  # Megatron's default is hidden size / heads
        args.append(["--kv-channels", str(model.head_dim)])
    if model.num_kv_heads != model.num_attention_heads:
        args += [["--group-query-attention"], ["--num-query-groups", str(model.num_kv_heads)]]
    if model.mlp == "swiglu":
        args += [["--swiglu"], ["--normalization", "RMSNorm"], ["--position-embedding-type", "rope"]]
        args += [["--disable-bias-linear"]]
    if not model.tied_embeddings:  # Megatron ties them by default (a tied Llama-style model, qwen3-4b, was untied)
        args.append(["--untie-embeddings-and-output-weights"])
    if ctx.training.dtype in ("bf16", "fp16", "fp8"):
        args.append(["--fp16" if ctx.training.dtype == "fp16" else "--bf16"])  # FP8: bf16 weights, FP8 GEMMs
    if ctx.training.dtype == "fp8":
        args.append(["--fp8-format", "hybrid"])  # e4m3 forward, e5m2 gradients (Transformer Engine)
    return args


def _overlap_args(ctx: CostContext, strategy: Strategy) -> Args:
    """Megatron's switches for what the cost model overlaps (TrainingSpec.overlap_*; Megatron defaults them off)."""
    training, args = ctx.training, []
    if training.overlap_grad_reduce:
        args.append(["--overlap-grad-reduce"])
    if training.overlap_param_gather and strategy.zero_stage >= 1:  # Megatron: only with the distributed optimizer
        args.append(["--overlap-param-gather"])
    tp_used = any(s.tp > 1 for p in strategy.pipelines for s in p.stages)
    if training.tp_comm_overlap and strategy.sequence_parallel and tp_used:  # needs sequence parallelism
        args.append(["--tp-comm-overlap"])
    return args


def _shard_ranks(ctx: CostContext, strategy: Strategy) -> int:
    """The ranks ZeRO shards the first stage over (all its replicas and CP ranks, or those in a node if hybrid)."""
    pipeline = strategy.pipelines[0]
    stage = pipeline.stages[0]
    update = {"zero_stage": strategy.zero_stage, "zero_shard": strategy.zero_shard}
    staged = replace(ctx, training=ctx.training.model_copy(update=update))
    return shard_ranks(
        staged.at_context_parallel(pipeline.context_parallel),
        ctx.cluster.group(stage.group),
        stage.tp,
        pipeline.replicas,
    )


def _recompute_args(mode: str) -> Args:
    if mode == "selective":
        return [["--recompute-granularity", "selective"]]
    if mode == "full":
        return [["--recompute-granularity", "full"], ["--recompute-method", "uniform"], ["--recompute-num-layers", "1"]]
    return []


def _megatron(ctx: CostContext, strategy: Strategy, plan: Strategy) -> tuple[dict[str, str], Args]:
    pipeline = strategy.pipelines[0]
    args = [
        *_model_args(ctx),
        ["--tensor-model-parallel-size", str(pipeline.stages[0].tp)],
        ["--pipeline-model-parallel-size", str(len(pipeline.stages))],
        ["--micro-batch-size", str(pipeline.micro_batch_size)],
        ["--global-batch-size", str(ctx.training.global_batch_size)],
        ["--calculate-per-token-loss"],
    ]
    if pipeline.context_parallel > 1:  # ring attention over the CP group (Transformer Engine, p2p exchange)
        args += [["--context-parallel-size", str(pipeline.context_parallel)], ["--cp-comm-type", "p2p"]]
    counts = {s.num_layers for s in pipeline.stages}
    if len(pipeline.stages) > 1 and (len(counts) > 1 or strategy.virtual_stages > 1):
        args.append(["--pipeline-model-parallel-layout", megatron_layout(strategy)])
    stages, microbatches = len(pipeline.stages), pipeline.num_microbatches
    if strategy.virtual_stages > 1 and interleaved_group_size(microbatches, stages) != stages:
        # Megatron refuses an interleaved run whose micro-batches do not fall into groups of at least p
        size = interleaved_group_size(microbatches, stages)
        args.append(["--microbatch-group-size-per-virtual-pipeline-stage", str(size)])
    args += _recompute_args(strategy.recompute)
    if strategy.zero_stage >= 1:
        args.append(["--use-distributed-optimizer"])
        instances = pipeline.gradient_ranks // _shard_ranks(ctx, strategy)
        if instances > 1:  # hybrid sharding: one optimizer copy per node, the shards replicated across
            args.append(["--num-distributed-optimizer-instances", str(instances)])
    if strategy.sequence_parallel and pipeline.stages[0].tp > 1:
        args.append(["--sequence-parallel"])
    return {}, args + _overlap_args(ctx, strategy)


def _flagscale(ctx: CostContext, strategy: Strategy, plan: Strategy) -> tuple[dict[str, str], Args]:
    pipeline = strategy.pipelines[0]
    meshes: list[list[int]] = []  # tp cp ep dp pp per run of stages on one group with one TP
    device_types, splits = [], []
    for stage in pipeline.stages:
        device = ctx.cluster.group(stage.group).device.key
        if meshes and device_types[-1] == device and meshes[-1][0] == stage.tp:
            meshes[-1][4] += 1
        else:
            meshes.append([stage.tp, pipeline.context_parallel, 1, pipeline.replicas, 1])
            device_types.append(device)
        splits.append(stage.num_layers)
    args = [
        *_model_args(ctx),
        ["--enable-hetero"],
        ["--hetero-process-meshes", *(str(x) for mesh in meshes for x in mesh)],
        ["--hetero-pipeline-layer-split", *(str(n) for n in splits)],
        ["--hetero-device-types", *device_types],
        ["--pipeline-model-parallel-size", str(len(pipeline.stages))],
        ["--micro-batch-size", str(pipeline.micro_batch_size)],
        ["--global-batch-size", str(ctx.training.global_batch_size)],
    ]
    args += _recompute_args(strategy.recompute)
    if strategy.zero_stage >= 1:
        args.append(["--use-distributed-optimizer"])
    return {}, args + _overlap_args(ctx, strategy)


def _deepspeed(ctx: CostContext, strategy: Strategy, plan: Strategy) -> tuple[dict[str, str], Args]:
    pipeline = strategy.pipelines[0]
    config = {
        "train_batch_size": ctx.training.global_batch_size,
        "train_micro_batch_size_per_gpu": pipeline.micro_batch_size,
        "gradient_accumulation_steps": pipeline.num_microbatches,
        "zero_optimization": {"stage": strategy.zero_stage, "overlap_comm": ctx.training.overlap_grad_reduce},
        "bf16": {"enabled": ctx.training.dtype in ("bf16", "fp8")},  # FP8: no switch (engine_lost says so)
        "fp16": {"enabled": ctx.training.dtype == "fp16"},
        # DeepSpeed's engine reads "stages" only; the boundaries come with the module (hetplan_pipeline.py)
        "pipeline": {"stages": len(pipeline.stages)},
    }
    if strategy.stage_recompute(pipeline.stages[0]) != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    bounds = [pipeline.stages[0].layer_start] + [s.layer_end for s in pipeline.stages]
    parts = [0] + [b + 1 for b in bounds[1:-1]] + [bounds[-1] + 2]  # + embedding first, + head last
    plan_tp = ", ".join(str(t) for t in sorted({s.tp for p in plan.pipelines for s in p.stages}))
    mode = strategy.stage_recompute(pipeline.stages[0])  # one for every stage (engine_space.closest)
    interval = 1 if mode == "full" else 0  # DeepSpeed checkpoints whole layers, every N-th
    recompute = {  # (selective is not DeepSpeed's: engine_space.closest replaced it)
        "none": "none (activation_checkpoint_interval 0).",
        "full": "full: every layer is checkpointed (activation_checkpoint_interval 1), as predicted.",
    }[mode]
    tied = (
        "\nThe model ties its embedding and output: build both as TiedLayerSpec of one key, the embedding first and "
        "the head last with a forward_fn computing the logits from the shared weight (tied_weight_attr), as planned; "
        "two separate layers would train an output matrix of their own."
        if ctx.model.tied_embeddings
        else ""
    )
    module = f'''"""PipelineModule with hetplan's stage boundaries (DeepSpeed's partition_method has no explicit list).

Build your model with it in place of PipelineModule, e.g. in train.py:

    from hetplan_pipeline import HetplanPipelineModule
    model = HetplanPipelineModule(layers=[embedding, *decoder_layers, head], loss_fn=loss_fn)

It partitions the layers at the plan's boundaries (partition_method="hetplan", its default) over the plan's
{len(pipeline.stages)} stages (num_stages, unless you pass a topology); DeepSpeed's own methods ("parameters",
"uniform", ...) balance by their own rule instead.
Layers: [embedding, decoder 0 .. {ctx.model.num_layers - 1}, head]; stage i owns layers parts[i]:parts[i+1].
Tensor parallelism: none (TP 1 on {len(pipeline.stages)} stages x {pipeline.replicas} replicas); the plan used
TP {plan_tp}. DeepSpeed's pipeline engine has no tensor parallelism of its own, so the export is the fastest TP 1
plan that fits (export.json: "lost"); Megatron-DeepSpeed adds TP through its model-parallel unit.
Recompute: {recompute}{tied}
"""

from typing import Any

from deepspeed.pipe import PipelineModule

PARTS = {parts}
STAGES = {len(pipeline.stages)}
TENSOR_PARALLEL = 1
PLAN_TENSOR_PARALLEL = "{plan_tp}"
ACTIVATION_CHECKPOINT_INTERVAL = {interval}


class HetplanPipelineModule(PipelineModule):
    def __init__(
        self, layers: Any, num_stages: int | None = None, topology: Any = None, *args: Any,
        partition_method: str = "hetplan", **kwargs: Any,
    ) -> None:
        if num_stages is None and topology is None:
            num_stages = STAGES
        if partition_method == "hetplan" and num_stages not in (None, STAGES):
            raise ValueError(f"the plan's boundaries are for {{STAGES}} stages, got num_stages={{num_stages}}")
        kwargs.setdefault("activation_checkpoint_interval", ACTIVATION_CHECKPOINT_INTERVAL)
        super().__init__(layers, num_stages, topology, *args, partition_method=partition_method, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if method != "hetplan":
            return super()._partition_layers(method)
        self.parts = list(PARTS)
        stage = self.stage_id
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
'''
    files = {"ds_config.json": json.dumps(config, indent=2) + "\n", "hetplan_pipeline.py": module}
    return files, [["--deepspeed"], ["--deepspeed_config", "$here/ds_config.json"]]


# torchtitan's Llama 3 flavors (torchtitan/models/llama3: TransformerModelArgs, the FFN from dim, ffn_dim_multiplier and
# multiple_of), by the model shape that names one
TORCHTITAN_LLAMA3_FLAVORS = {
    "8B": {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32},
    "70B": {"num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64},
    "405B": {"num_layers": 126, "hidden_size": 16384, "ffn_hidden_size": 53248, "num_attention_heads": 128},
}
TORCHTITAN_LLAMA3_SHARED = {"mlp": "swiglu", "num_kv_heads": 8, "vocab_size": 128256, "tied_embeddings": False}


def torchtitan_model_lines(model: ModelSpec, fp8: bool) -> list[str]:
    """The TOML's [model] section: torchtitan's Llama 3 flavor of the model's shape (the TOML named none: torchtitan
    trained its default model), or a comment that none has it; FP8's converter."""
    lines = []
    for flavor, sizes in TORCHTITAN_LLAMA3_FLAVORS.items():
        shape = sizes | TORCHTITAN_LLAMA3_SHARED
        if all(getattr(model, field) == value for field, value in shape.items()) and model.head_dim is None:
            lines += ['name = "llama3"', f'flavor = "{flavor}"']
    if not lines:
        described = (
            f"{model.num_layers} layers, hidden {model.hidden_size}, FFN {model.ffn_hidden_size}, "
            f"{model.num_attention_heads} heads ({model.num_kv_heads} KV) of {model.head_size}, vocabulary "
            f"{model.vocab_size}, {'tied' if model.tied_embeddings else 'untied'}, {model.mlp}"
        )
        lines.append(f"# no torchtitan Llama 3 flavor has this model's shape ({described}): name your model's here")
    if fp8:
        lines.append('converters = ["quantize.linear.float8"]')
    return ["[model]", *lines, ""]


def _torchtitan(ctx: CostContext, strategy: Strategy, plan: Strategy) -> tuple[dict[str, str], Args]:
    pipeline = strategy.pipelines[0]
    parts, start = [], 0
    for count in chunk_layer_counts(strategy.pipelines[0], strategy.virtual_stages):
        parts.append([f"layers.{i}" for i in range(start, start + count)])
        start += count
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    schedule = "1F1B" if strategy.virtual_stages == 1 else "Interleaved1F1B"
    activation = {"none": "none", "selective": "selective", "full": "full"}[strategy.recompute]
    sharded = strategy.zero_stage >= 2  # FSDP2 over the replicas (engine_zero_stage maps ZeRO-1 to 2)
    shard = _shard_ranks(ctx, strategy) // pipeline.context_parallel  # FSDP2 shards over CP ranks too
    replicate = pipeline.replicas // shard if sharded else pipeline.replicas
    low_precision = ctx.training.dtype in ("bf16", "fp8")
    fp8 = ctx.training.dtype == "fp8"  # FP8 GEMMs through torchao's converter, bf16 master weights
    reshard = "always" if strategy.zero_stage == 3 else "never"  # ZeRO-3 frees gathered weights after forward
    toml = "\n".join(
        [
            "# hetplan export for torchtitan (merge into your job config)",
            *torchtitan_model_lines(ctx.model, fp8),
            "[parallelism]",
            f"tensor_parallel_degree = {pipeline.stages[0].tp}",
            f"pipeline_parallel_degree = {len(pipeline.stages)}",
            f"data_parallel_replicate_degree = {replicate}",
            f"data_parallel_shard_degree = {shard if sharded else 1}",
            f"context_parallel_degree = {pipeline.context_parallel}",
            *([f'fsdp_reshard_after_forward = "{reshard}"'] if sharded else []),
            f'pipeline_parallel_schedule = "{schedule}"',
            f"pipeline_parallel_microbatch_size = {pipeline.micro_batch_size}",
            "module_fqns_per_model_part = " + json.dumps(parts),
            "",
            "[training]",
            f"global_batch_size = {ctx.training.global_batch_size}",
            f"local_batch_size = {pipeline.samples_per_replica}",
            f"seq_len = {ctx.seq_length}",
            f'mixed_precision_param = "{"bfloat16" if low_precision else "float32"}"',
            "",
            "[activation_checkpoint]",
            f'mode = "{activation}"',
            *(["", "[quantize.linear.float8]"] if fp8 else []),
            "",
        ]
    )
    return {"torchtitan.toml": toml}, [["--job.config_file", "$here/torchtitan.toml"]]


# what a Llama-style model's Megatron arguments cannot say from hetplan's model (its shape): Llama 3 rotates at a base
# of 500000, Qwen3 at 1000000 with per-head Q/K norms, Qwen2 has Q/K/V biases
ARCHITECTURE_NOTE = (
    "the arguments give the model's shape; its rotary base, norm epsilon, per-head Q/K norms and Q/K/V biases are "
    "Megatron's defaults (10000, 1e-5, none, none): add --rotary-base, --norm-epsilon, --qk-layernorm or "
    "--add-qkv-bias where the model's differ (Llama 3: --rotary-base 500000; Qwen3: 1000000 and --qk-layernorm)"
)
# torchtitan's Llama has an output matrix of its own (no tie across its pipeline stages)
TORCHTITAN_UNTIED_NOTE = (
    "the model ties its embedding and output, torchtitan's Llama trains an output matrix of its own: the run has "
    "vocabulary x hidden more parameters (their state on the last stage) than the plan counts, and no embedding sync"
)
EXPORTED_PLAN_FILE = "plan.json"  # the torchrun export's plan, which launch.sh names to every rank in $HETPLAN_PLAN


def _launch_only(ctx: CostContext, strategy: Strategy, plan: Strategy) -> tuple[dict[str, str], Args]:
    """torchrun starts the user's own script, which takes no plan arguments: the plan goes with it as a plan file
    (hetplan's format, the exported layout: planner.plan.load_plan reads it), named to every rank in $HETPLAN_PLAN."""
    body = {**header_dict(ctx), **evaluation_dict(ctx, evaluate(ctx, strategy))}
    return {EXPORTED_PLAN_FILE: json.dumps(body, indent=2) + "\n"}, []


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


Writer = Callable[[CostContext, Strategy, Strategy], tuple[dict[str, str], Args]]
WRITERS: dict[str, Writer] = {
    "megatron": _megatron,
    "flagscale": _flagscale,
    "deepspeed": _deepspeed,
    "torchtitan": _torchtitan,
    "torchrun": _launch_only,
}  # one per engine of specs/catalog/engines.yaml, which says what each can express; (exported, plan) -> files, args


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
    launches: list[NodeLaunch], title: str, script: str, args: Args, what: str, plan_file: str = ""
) -> str:
    """A bash script every node runs: node rank from its argument, $NODE_RANK or $SLURM_NODEID; the node's visible
    devices exported; torchrun started with the engine's arguments as a bash array (real arguments, no re-parsing);
    `plan_file` (beside the script), when given, named to every rank in $HETPLAN_PLAN."""
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
        'case "$NODE_RANK" in',
    ]
    for launch in launches:
        lines.append(f"  {launch.node_rank})  # {launch.group} node {launch.node}")
        if launch.visible_devices_env:
            lines.append(f"    export {launch.visible_devices_env}={launch.visible}")
        lines.append(f"    nproc={len(launch.devices)} ;;")
    lines += [
        f'  *) echo "launch.sh: NODE_RANK must be 0..{last}, got $NODE_RANK" >&2; exit 2 ;;',
        "esac",
        f'exec torchrun --nnodes {len(launches)} --node-rank "$NODE_RANK" --nproc-per-node "$nproc" \\',
        '  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "${entry[@]}" "${args[@]}" "$@"',
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
    ctx.check_strategy(strategy, "plan")
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
    files["launch.sh"] = launch_script(launches, title, engine.script, args, what, plan_file)
    notes = [] if exported == found.near else [_engine_plan_note(runs_ctx, strategy, found)]
    notes += [kernels_note] if kernels_note else []
    notes += [note] if (note := vendors_note(ctx.cluster, exported, engine)) else []
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
