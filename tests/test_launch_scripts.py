"""Every generated launch.sh, executed node by node with a stub torchrun first on PATH that records its argv and
environment: node rank, processes, rendezvous, the vendor's visible devices, and arguments the engine's own parser
(or, where the engine is not installable, its documented format) accepts. The 768-device HETHUB example and a mixed
H100 + MI300X cluster, every export format."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

from planner import plan
from planner.export import Export, export_plan
from planner.plan import load_plan
from predictor.predictor import default_predictor
from specs import engine_catalog, load_cluster, load_model, load_training
from specs.vendors import vendor_catalog
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.slow  # plans two large examples, runs ~500 short bash processes
MASTER = "10.1.2.3"
STUB = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$STUB_FILE.argv"
env -0 > "$STUB_FILE.env"
"""
CASES = {
    "hethub-768": (EXAMPLES / "hethub-768.yaml", "llama-140b", EXAMPLES / "training" / "hethub-140b.yaml"),
    "h100-mi300x": (EXAMPLES / "h100-mi300x.yaml", "llama3-70b", None),
    "h100-mi300x-a100-32k": (
        EXAMPLES / "h100-mi300x-a100.yaml",
        "llama3-70b",
        EXAMPLES / "training" / "long-context-32k.yaml",
    ),
    "h100-mi300x-qwen3": (EXAMPLES / "h100-mi300x.yaml", "qwen3-32b", None),  # heads of 128 at hidden 5120 / 64
}


@pytest.fixture(scope="module", params=list(CASES))
def planned(request):
    """The example's default plan (several pipeline families where the planner picks them) and its context."""
    cluster_path, model_name, training_path = CASES[request.param]
    cluster, model, training = load_cluster(cluster_path), load_model(model_name), load_training(training_path)
    ctx = default_predictor().context(cluster, model, training)
    return ctx, plan(cluster, model, training).strategy


def _run_node(folder: Path, stub_dir: Path, node_rank: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """Execute launch.sh for one node with the stub torchrun; returns the stub's argv and environment."""
    record = folder / f"node-{node_rank}"
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES") and not k.startswith("SLURM")}
    env.update(PATH=f"{stub_dir}:{env['PATH']}", MASTER_ADDR=MASTER, STUB_FILE=str(record))
    if folder.name == "torchrun":  # the user's own script
        env["TRAIN_SCRIPT"] = "my_train.py"
    done = subprocess.run(
        ["bash", str(folder / "launch.sh"), str(node_rank), *extra], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    argv = record.with_suffix(".argv").read_bytes().decode().split("\0")[:-1]
    pairs = (item.split("=", 1) for item in record.with_suffix(".env").read_bytes().decode().split("\0") if "=" in item)
    return argv, dict(pairs)


def _write(exported: Export, folder: Path) -> None:
    folder.mkdir()
    for name, content in exported.files.items():
        (folder / name).write_text(content, encoding="utf-8")


@pytest.mark.parametrize("fmt", list(engine_catalog()))
def test_every_launch_script_runs_on_every_node_and_the_engine_accepts_its_arguments(planned, fmt, tmp_path):
    ctx, strategy = planned
    exported = export_plan(ctx, strategy, fmt)
    folder = tmp_path / fmt
    _write(exported, folder)
    script = folder / "launch.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        checked = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    (stub_dir / "torchrun").write_text(STUB)
    (stub_dir / "torchrun").chmod(0o755)
    variables = {v.visible_devices_env for v in vendor_catalog().values() if v.visible_devices_env}
    nodes = len(exported.nodes)
    engine_args: list[list[str]] = []
    for launch in exported.nodes:
        extra = ["--data-path", "/data/my corpus"] if launch.node_rank == 0 else []
        argv, env = _run_node(folder, stub_dir, launch.node_rank, extra)
        assert argv[:10] == [
            "--nnodes", str(nodes), "--node-rank", str(launch.node_rank), "--nproc-per-node", str(len(launch.devices)),
            "--master-addr", MASTER, "--master-port", "29500",
        ]  # fmt: skip
        vendor = ctx.cluster.group(launch.group).device.vendor
        expected = {launch.visible_devices_env: launch.visible} if launch.visible_devices_env else {}
        assert {v: env[v] for v in variables if v in env} == expected, (launch, vendor)
        if fmt == "torchrun":  # the user's own script reads the plan it runs from the file HETPLAN_PLAN names
            assert env["HETPLAN_PLAN"] == str(folder.resolve() / "plan.json")
            assert load_plan(env["HETPLAN_PLAN"]).strategy == exported.strategy
        else:
            assert "HETPLAN_PLAN" not in env
        rest = argv[10:]
        if extra:
            assert rest[-2:] == extra  # the user's own arguments arrive whole, after the plan's
            rest = rest[:-2]
        if fmt == "flagscale":  # each node's device type, as FlagScale's runner passes it from the hostfile
            device = ctx.cluster.group(launch.group).device.key
            assert rest[-2:] == ["--hetero-current-device-type", device]
            types = rest[rest.index("--hetero-device-types") + 1 :]
            assert device in types[: next((i for i, w in enumerate(types) if w.startswith("--")), len(types))]
            rest = rest[:-2]
        engine_args.append(rest)
    assert all(args == engine_args[0] for args in engine_args)  # every node starts the same program (its type apart)
    pipeline = exported.strategy.pipelines[0]
    world = sum(len(n.devices) for n in exported.nodes)
    assert world == pipeline.devices
    ACCEPTS[fmt](engine_args[0], world, folder, ctx)
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    script_name = {"torchrun": "your training script", "torchtitan": "torchtitan.train"}.get(fmt)
    assert usage.stderr.startswith("usage: launch.sh") and (script_name or ".py") in usage.stderr.splitlines()[0]


def test_a_launch_script_takes_the_node_rank_from_slurm_and_refuses_a_wrong_one(tmp_path):
    cluster, training = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_training(overrides={"dtype": "fp16"})
    ctx = default_predictor().context(cluster, load_model("gpt3-1.7b"), training)
    exported = export_plan(ctx, plan(ctx.cluster, ctx.model, ctx.training).strategy, "megatron")
    _write(exported, tmp_path / "megatron")
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    (stub_dir / "torchrun").write_text(STUB)
    (stub_dir / "torchrun").chmod(0o755)
    script = str(tmp_path / "megatron" / "launch.sh")
    env = {"PATH": f"{stub_dir}:{os.environ['PATH']}", "MASTER_ADDR": MASTER, "STUB_FILE": str(tmp_path / "s")}
    done = subprocess.run(["bash", script], env={**env, "SLURM_NODEID": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "s.argv").read_bytes().decode().split("\0")
    assert argv[2:4] == ["--node-rank", "1"]
    wrong = subprocess.run(["bash", script, str(len(exported.nodes))], env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and "NODE_RANK must be" in wrong.stderr
    no_master = subprocess.run(["bash", script, "0"], env={"PATH": env["PATH"]}, capture_output=True, text=True)
    assert no_master.returncode != 0 and "MASTER_ADDR" in no_master.stderr


# ---- what each engine's parser accepts -----------------------------------------------------------------------------
MEGATRON_VALUES = {  # Megatron-LM's arguments.py: the flags an export writes, with their types and choices
    "--num-layers": int, "--hidden-size": int, "--ffn-hidden-size": int, "--num-attention-heads": int,
    "--seq-length": int, "--max-position-embeddings": int, "--vocab-size": int, "--num-query-groups": int,
    "--tensor-model-parallel-size": int, "--pipeline-model-parallel-size": int, "--micro-batch-size": int,
    "--global-batch-size": int, "--pipeline-model-parallel-layout": str, "--recompute-num-layers": int,
    "--microbatch-group-size-per-virtual-pipeline-stage": int, "--context-parallel-size": int, "--kv-channels": int,
}  # fmt: skip
MEGATRON_CHOICES = {
    "--normalization": ["LayerNorm", "RMSNorm"],
    "--position-embedding-type": ["learned_absolute", "rope", "mrope", "relative", "none"],
    "--recompute-granularity": ["full", "selective"],
    "--recompute-method": ["uniform", "block"],
    "--fp8-format": ["e4m3", "hybrid"],
    "--cp-comm-type": ["p2p", "a2a", "allgather", "a2a+p2p"],
}
MEGATRON_SWITCHES = [
    "--group-query-attention", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
    "--fp16", "--calculate-per-token-loss", "--use-distributed-optimizer", "--sequence-parallel",
    "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
]  # fmt: skip


def _megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
    for flag, kind in MEGATRON_VALUES.items():
        parser.add_argument(flag, type=kind)
    for flag, choices in MEGATRON_CHOICES.items():
        parser.add_argument(flag, choices=choices)
    for flag in MEGATRON_SWITCHES:
        parser.add_argument(flag, action="store_true")
    return parser


def _megatron_config(args: argparse.Namespace, world: int) -> None:
    """megatron-core's TransformerConfig (its own checks: heads over TP, recompute, the layout) and Megatron-LM's
    batch arithmetic."""
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    ddp_config = pytest.importorskip("megatron.core.distributed").DistributedDataParallelConfig
    import torch

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size or 1
    assert world % (tp * pp * cp) == 0
    dp = world // (tp * pp * cp)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    assert args.global_batch_size % (args.micro_batch_size * dp) == 0
    config_module.TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=args.sequence_parallel,
        gated_linear_unit=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        normalization=args.normalization or "LayerNorm",
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        calculate_per_token_loss=args.calculate_per_token_loss,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_virtual_pipeline_stage,
        fp8=args.fp8_format,
        tp_comm_overlap=args.tp_comm_overlap,
    )
    # Megatron-LM refuses to gather parameters in the background without the distributed optimizer to gather them
    assert args.use_distributed_optimizer or not args.overlap_param_gather
    assert args.sequence_parallel or not args.tp_comm_overlap
    ddp_config(
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def _megatron(argv: list[str], world: int, folder: Path, ctx: object) -> None:
    assert argv[0] == "pretrain_gpt.py"
    args = _megatron_parser().parse_args(argv[1:])
    assert args.kv_channels == ctx.model.head_dim  # (Megatron's default: hidden size / heads)
    assert args.untie_embeddings_and_output_weights == (not ctx.model.tied_embeddings)
    _megatron_config(args, world)


def _flagscale(argv: list[str], world: int, folder: Path, ctx: object) -> None:
    """FlagScale's hetero flags (not installable here): meshes of tp cp ep dp pp that add up to the pipeline and
    the world, a layer split over every stage, one device type per mesh; the rest is Megatron's."""
    assert argv[0] == "pretrain_gpt.py"
    parser = _megatron_parser()
    parser.add_argument("--enable-hetero", action="store_true")
    parser.add_argument("--hetero-process-meshes", nargs="+", type=int)
    parser.add_argument("--hetero-pipeline-layer-split", nargs="+", type=int)
    parser.add_argument("--hetero-device-types", nargs="+")
    args = parser.parse_args(argv[1:])
    assert args.kv_channels == ctx.model.head_dim
    meshes = [args.hetero_process_meshes[i : i + 5] for i in range(0, len(args.hetero_process_meshes), 5)]
    assert args.enable_hetero and len(meshes) == len(args.hetero_device_types)
    assert sum(m[4] for m in meshes) == args.pipeline_model_parallel_size == len(args.hetero_pipeline_layer_split)
    assert sum(m[0] * m[1] * m[2] * m[3] * m[4] for m in meshes) == world
    assert sum(args.hetero_pipeline_layer_split) == args.num_layers


def _deepspeed(argv: list[str], world: int, folder: Path, ctx: object) -> None:
    deepspeed = pytest.importorskip("deepspeed")
    assert argv[0] == "train.py"
    args = deepspeed.add_config_arguments(argparse.ArgumentParser(exit_on_error=False)).parse_args(argv[1:])
    assert args.deepspeed and Path(args.deepspeed_config) == folder.resolve() / "ds_config.json"
    config = json.loads(Path(args.deepspeed_config).read_text())
    stages = config["pipeline"]["stages"]
    assert world % stages == 0
    micro, steps = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    assert config["train_batch_size"] == micro * steps * (world // stages)
    module = (folder / "hetplan_pipeline.py").read_text()
    assert "TENSOR_PARALLEL = 1" in module and "PLAN_TENSOR_PARALLEL" in module


def _torchtitan(argv: list[str], world: int, folder: Path, ctx: object) -> None:
    assert argv[:3] == ["-m", "torchtitan.train", "--job.config_file"] and len(argv) == 4
    parallel = tomllib.loads(Path(argv[3]).read_text())["parallelism"]
    degrees = ("tensor_parallel_degree", "pipeline_parallel_degree", "data_parallel_replicate_degree")
    shard, cp = parallel["data_parallel_shard_degree"], parallel["context_parallel_degree"]
    assert parallel[degrees[0]] * parallel[degrees[1]] * parallel[degrees[2]] * shard * cp == world


def _torchrun(argv: list[str], world: int, folder: Path, ctx: object) -> None:
    assert argv == ["my_train.py"]


ACCEPTS = {"megatron": _megatron, "flagscale": _flagscale, "deepspeed": _deepspeed, "torchtitan": _torchtitan,
           "torchrun": _torchrun}  # fmt: skip
