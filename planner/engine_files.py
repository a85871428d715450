"""What each engine is given for a plan: its command-line arguments and the files beside them (Megatron-LM and
FlagScale arguments, DeepSpeed's config and pipeline module, torchtitan's TOML, torchrun's plan file); planner/export.py
chooses the plan the engine can run and writes these with a launch script per node."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from planner.plan import evaluation_dict, header_dict
from predictor.cost_model import CostContext, evaluate, interleaved_group_size
from predictor.sharding import shard_ranks
from specs.layout import Strategy, chunk_layer_counts
from specs.model import ModelSpec

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


Writer = Callable[[CostContext, Strategy, Strategy], tuple[dict[str, str], Args]]
WRITERS: dict[str, Writer] = {
    "megatron": _megatron,
    "flagscale": _flagscale,
    "deepspeed": _deepspeed,
    "torchtitan": _torchtitan,
    "torchrun": _launch_only,
}  # one per engine of specs/catalog/engines.yaml, which says what each can express; (exported, plan) -> files, args
