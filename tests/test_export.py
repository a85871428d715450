"""Exports: engine files checked by the engines' own parsers where installable, what is lost said, launch order."""

from __future__ import annotations

import itertools
import json
import subprocess
from dataclasses import replace

import pytest
import tomllib

from planner import plan
from planner.engine_files import ARCHITECTURE_NOTE, WRITERS, megatron_layout
from planner.engine_space import closest, engine_plans, engine_training, near_plans
from planner.export import export_plan
from planner.plan import describe_strategy, layout_changes
from predictor.cost_model import evaluate
from predictor.predictor import default_predictor
from specs import engine_catalog, get_engine, load_cluster, load_model, load_training
from specs.errors import SpecError
from specs.layout import PipelineStrategy, StageStrategy, Strategy
from tests.conftest import EXAMPLES, hetplan


@pytest.fixture(scope="module")
def hethub():
    """The 768-device example's one-family plan (amd + ascend, uneven stages, interleaved) and its context (what an
    export of its two-family plan starts from)."""
    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    model = load_model("llama-140b")
    training = load_training(EXAMPLES / "training" / "hethub-140b.yaml", {"families": "off"})
    ctx = default_predictor().context(cluster, model, training)
    return ctx, plan(cluster, model, training).strategy


@pytest.fixture(scope="module")
def h100_mi300x():
    """A plan of the H100 + MI300X example for Llama-3-70B (default training), and its context: 8 replicas of 8 MI300X
    stages on TP 1 (the first recomputing selectively) and an H100 stage on TP 4, 87.04 s (the search's plan until
    it also searched the shapes that win only with a recompute mode per stage: now 85.99 s, on TP 2 and 4)."""
    cluster, model, training = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b"), load_training()
    ends = (0, 6, 12, 19, 26, 33, 40, 47, 54)
    mi300x = tuple(
        StageStrategy("mi300x", start, end, 1, 8 * i, "selective" if i == 0 else None)
        for i, (start, end) in enumerate(itertools.pairwise(ends))
    )
    strategy = Strategy((PipelineStrategy(8, 1, 128, (*mi300x, StageStrategy("h100", 54, 80, 4, 0))),), "none", 1)
    return default_predictor().context(cluster, model, training), strategy


@pytest.fixture(scope="module")
def mixed():
    """A hand-made plan on a100-v100-32 with per-stage TP and an uneven batch (every exporter must give something)."""
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    model, training = load_model("gpt3-1.7b"), load_training(overrides={"global_batch_size": 30, "dtype": "fp16"})
    ctx = default_predictor().context(cluster, model, training)
    a100, v100 = cluster.groups[0].name, cluster.groups[1].name
    stages = (StageStrategy(a100, 0, 14, 2, 0), StageStrategy(v100, 14, 24, 4, 0))
    strategy = Strategy((PipelineStrategy(4, 1, 8, stages, total_microbatches=30),), "selective", 1)
    return ctx, strategy


@pytest.mark.slow
def test_megatron_layout_is_accepted_by_megatron_core_and_keeps_every_ranks_layer_count(hethub):
    layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    ctx, strategy = hethub
    exported = export_plan(ctx, strategy, "megatron")
    layout_text = megatron_layout(exported.strategy)
    stages = exported.strategy.pipelines[0].stages
    assert f"--pipeline-model-parallel-layout '{layout_text}'" in exported.files["launch.sh"]
    layout = layout_module.PipelineParallelLayerLayout(layout_text, len(stages))
    layout.validate_layer_layout(ctx.model.num_layers, None)
    decoder = layout_module.LayerType.decoder
    per_rank = [sum(chunk.count(decoder) for chunk in rank) for rank in layout.layout]
    assert per_rank == [s.num_layers for s in stages]
    assert layout.virtual_pipeline_model_parallel_size == exported.strategy.virtual_stages


@pytest.mark.parametrize(("key", "tied", "kv_channels"), [("qwen3-4b", True, 128), ("llama3-8b", False, None)])
def test_megatron_gets_the_models_head_width_and_ties_what_the_model_ties(key, tied, kv_channels):
    """Megatron ties the embedding and the output by default: a tied Llama-style model (qwen3-4b) was exported
    untied, 389M parameters more than planned; its heads of 128 at hidden 2560 / 32 need --kv-channels."""
    cluster, model, training = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model(key), load_training()
    ctx = default_predictor().context(cluster, model, training)
    exported = export_plan(ctx, plan(cluster, model, training).strategy, "megatron")
    script = exported.files["launch.sh"]
    assert ("--untie-embeddings-and-output-weights" in script) == (not tied)
    # what the arguments cannot say (Llama 3's rotary base 500000, Qwen3's 1000000 and Q/K norms) is said
    assert ARCHITECTURE_NOTE in exported.notes and "--rotary-base" not in script
    given = [line.split() for line in script.splitlines() if "--kv-channels" in line]
    assert given == ([["--kv-channels", str(kv_channels)]] if kv_channels else [])


@pytest.mark.parametrize("microbatches", [64, 128])
def test_megatron_gets_a_microbatch_group_size_it_accepts_when_interleaving_needs_one(hethub, microbatches):
    """Megatron's interleaved schedule refuses micro-batch groups whose last one is smaller than p (its own check in
    forward_backward_pipelining_with_interleaving); the export sets a group size that passes it."""
    ctx, strategy = hethub
    pipeline = strategy.pipelines[0]
    stages = len(pipeline.stages)
    replicas = ctx.training.global_batch_size // (pipeline.micro_batch_size * microbatches)
    relaid = replace(pipeline, replicas=replicas, num_microbatches=microbatches, total_microbatches=0)
    used: dict[str, int] = {}
    placed = []
    for stage in relaid.stages:
        placed.append(replace(stage, device_offset=used.get(stage.group, 0)))
        used[stage.group] = used.get(stage.group, 0) + stage.tp * replicas
    interleaved = replace(strategy, pipelines=(replace(relaid, stages=tuple(placed)),), virtual_stages=2)
    exported = export_plan(ctx, interleaved, "megatron")
    args = exported.files["launch.sh"]
    # the export may run a faster plan within Megatron's limits: check the group size of the plan it wrote
    written = exported.strategy.pipelines[0]
    stages, microbatches = len(written.stages), written.num_microbatches
    flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    if exported.strategy.virtual_stages == 1 or microbatches % stages == 0:
        assert flag not in args
    else:
        size = int(args.split(flag)[1].split()[0])
        assert stages <= size <= microbatches
        assert microbatches % size == 0 or microbatches % size >= stages


def test_a_gpt_export_has_no_note_of_rotary_positions(mixed):
    ctx, strategy = mixed
    assert ARCHITECTURE_NOTE not in export_plan(ctx, strategy, "megatron").notes


def test_megatron_drops_per_stage_tp_and_uneven_batches_and_says_so_flagscale_keeps_tp(mixed):
    ctx, strategy = mixed
    megatron = export_plan(ctx, strategy, "megatron")
    assert any("per-stage TP" in item for item in megatron.lost)
    assert any("uneven batch" in item for item in megatron.lost)
    exported = megatron.strategy.pipelines[0]
    assert len({s.tp for s in exported.stages}) == 1 and not exported.uneven
    assert ctx.training.global_batch_size == exported.replicas * exported.num_microbatches * exported.micro_batch_size
    assert megatron.predicted_iteration_time_s > 0 and megatron.plan_iteration_time_s > 0
    flagscale = export_plan(ctx, strategy, "flagscale")
    assert not any("TP" in item for item in flagscale.lost)
    # the plan with an even batch keeps its per-stage TP as FlagScale process meshes (the export then takes the
    # planner's best FlagScale plan when that is faster, as here: the hand-made plan is slow)
    near = near_plans(ctx, strategy, get_engine("flagscale"))
    assert [s.tp for s in near[0].pipelines[0].stages] == [2, 4]
    args = [" ".join(line) for line in WRITERS["flagscale"](ctx, near[0], strategy)[1]]
    replicas = near[0].pipelines[0].replicas
    assert f"--hetero-process-meshes 2 1 1 {replicas} 1 4 1 1 {replicas} 1" in args
    assert "--hetero-pipeline-layer-split 14 10" in args
    assert flagscale.predicted_iteration_time_s <= evaluate(ctx, near[0]).iteration_time_s


def test_export_tries_every_tp_the_engine_can_hold_not_only_the_plans(h100_mi300x):
    """A plan of H100 + MI300X / Llama-3-70B that mixes TP 1 and 4 (the search's until 85.99 s on TP 2 and 4, whose
    own widths do fit): no uniform TP of its own widths with its replicas fits memory, but the planner's plans at one
    TP degree do: the export runs the fastest of them."""
    ctx, strategy = h100_mi300x
    assert evaluate(ctx, strategy).iteration_time_s == pytest.approx(87.04, abs=0.005)
    assert len({s.tp for s in strategy.pipelines[0].stages}) > 1
    megatron = get_engine("megatron")
    for near in near_plans(ctx, strategy, megatron):  # each of the plan's own widths: too big or does not fit
        try:
            ctx.check_strategy(near)
        except SpecError:
            continue
        assert not evaluate(ctx, near).fits
    exported = export_plan(ctx, strategy, "megatron")
    assert len({s.tp for s in exported.strategy.pipelines[0].stages}) == 1
    assert evaluate(ctx, exported.strategy).fits
    fastest = min(evaluate(ctx, c).iteration_time_s for c in engine_plans(ctx, megatron))
    assert exported.predicted_iteration_time_s == pytest.approx(fastest)


def test_deepspeed_says_its_pipeline_engine_has_no_tp_and_exports_tp_1(hethub):
    ctx, strategy = hethub
    exported = export_plan(ctx, strategy, "deepspeed")
    widths = ", ".join(str(t) for t in sorted({s.tp for s in strategy.pipelines[0].stages}))
    assert widths != "1" and any(f"tensor parallelism (TP {widths}) -> TP 1" in item for item in exported.lost)
    assert {s.tp for s in exported.strategy.pipelines[0].stages} == {1}
    module = exported.files["hetplan_pipeline.py"]
    assert f"the plan used\nTP {widths}." in module and "TENSOR_PARALLEL = 1" in module


def test_every_engine_in_the_registry_has_an_exporter():
    assert list(WRITERS) == list(engine_catalog())


@pytest.mark.parametrize("key", list(engine_catalog()))
def test_an_engines_capability_flags_decide_what_its_export_loses(mixed, key):
    """The mixed plan has per-stage TP and an uneven batch; with the a100 stage fully recomputed (the v100 one
    selectively) also per-stage recompute: an engine loses exactly what its flags say it cannot express."""
    ctx, strategy = mixed
    engine = get_engine(key)
    pipeline = strategy.pipelines[0]
    stages = (replace(pipeline.stages[0], recompute="full"), pipeline.stages[1])
    varied = replace(strategy, pipelines=(replace(pipeline, stages=stages),))
    found = closest(ctx, varied, engine)
    exported, lost = found.strategy, found.lost
    assert any("per-stage TP" in item for item in lost) is (engine.tensor_parallel and not engine.per_stage_tp)
    assert any("tensor parallelism (TP 2, 4) -> TP 1" in item for item in lost) is not engine.tensor_parallel
    assert any("uneven batch" in item for item in lost) is not engine.uneven_batch
    assert any("per-stage recompute" in item for item in lost) is not engine.per_stage_recompute
    assert (exported == varied) is not lost


def test_a_flag_set_on_an_engine_keeps_that_part_of_the_plan(mixed):
    ctx, strategy = mixed
    megatron = get_engine("megatron")
    assert closest(ctx, strategy, megatron).strategy != strategy
    found = closest(ctx, strategy, megatron.model_copy(update={"per_stage_tp": True, "uneven_batch": True}))
    assert (found.strategy, found.lost, found.near) == (strategy, [], strategy)


def test_a_plan_of_two_families_exported_is_shown_once():
    """The hethub-768 demo's plan (two families) exported to Megatron: the files describe the engine's own best plan,
    which `exported:` shows; the note repeated it whole ("...; it changes pipeline families 2 -> 1; now dp 16 x
    [...]")."""
    cluster, model = load_cluster(EXAMPLES / "hethub-768.yaml"), load_model("llama-140b")
    made = plan(cluster, model, load_training(EXAMPLES / "training" / "hethub-140b.yaml"))
    assert len(made.strategy.pipelines) == 2
    exported = export_plan(made.context, made.strategy, "megatron")
    [note] = [note for note in exported.notes if "engine's best plan" in note]
    assert note.endswith("; it changes pipeline families 2 -> 1")
    assert describe_strategy(exported.strategy) not in " ".join(exported.notes)


def test_an_engines_own_best_plan_in_place_of_the_plan_is_named_with_all_it_changes(mixed):
    """Megatron cannot run the mixed plan's per-stage TP and uneven batch; its own best plan (a100 alone, TP 1) is
    faster than the plan with those two parts replaced, so the files describe that one: the note says so and lists
    every change (the lost list names only the two parts). --keep-layout exports the plan with them replaced."""
    ctx, strategy = mixed
    exported = export_plan(ctx, strategy, "megatron")
    kept = export_plan(ctx, strategy, "megatron", keep_layout=True)
    assert exported.lost == kept.lost and len(exported.lost) == 2
    assert exported.strategy != kept.strategy
    assert exported.predicted_iteration_time_s < kept.predicted_iteration_time_s
    [note] = [note for note in exported.notes if "engine's best plan" in note]
    assert f"({kept.predicted_iteration_time_s:.3f} s; --keep-layout exports that one)" in note
    assert "stages [a100 tp2 L0-13 | v100 tp4 L14-23] -> [" in note and "replicas 4 -> " in note
    assert not any("engine's best plan" in note for note in kept.notes)
    # the kept layout: the plan's stages, groups and layers, one TP degree and an even batch
    kept_stages = kept.strategy.pipelines[0].stages
    assert [(s.group, s.layer_start, s.layer_end) for s in kept_stages] == [
        (s.group, s.layer_start, s.layer_end) for s in strategy.pipelines[0].stages
    ]
    assert len({s.tp for s in kept_stages}) == 1 and not kept.strategy.pipelines[0].uneven


def test_keeping_a_layout_the_engine_cannot_fit_is_refused_in_one_line(hethub):
    """The 140B plan's stages (on the Ascend group alone) at DeepSpeed's TP 1 do not fit memory: kept, there is nothing
    to export; nor is there for the plan over AMD and Ascend, whose vendors DeepSpeed's one library does not join."""
    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    training = load_training(EXAMPLES / "training" / "hethub-140b.yaml", {"families": "off"})
    made = plan(cluster.only(cluster.group("ascend")), load_model("llama-140b"), training)
    with pytest.raises(
        SpecError, match=r"no plan with only those parts replaced fits memory .*drop --keep-layout"
    ) as caught:
        export_plan(made.context, made.strategy, "deepspeed", keep_layout=True)
    assert "\n" not in str(caught.value)
    ctx, strategy = hethub
    with pytest.raises(SpecError, match=r"a plan over amd, huawei has no one-vendor counterpart .*drop --keep-layout"):
        export_plan(ctx, strategy, "deepspeed", keep_layout=True)


@pytest.mark.parametrize("key", list(engine_catalog()))
def test_an_fp16_plan_on_an_engine_without_fp16_is_named_as_trained_in_fp32(mixed, key):
    """torchtitan's mixed precision is bf16 or fp32: the mixed plan's fp16 becomes fp32 there, in its TOML, in what
    the export loses and in the training `plan --engine` plans with; engines with fp16 keep it."""
    ctx, strategy = mixed
    engine = get_engine(key)
    exported = export_plan(ctx, strategy, key)
    assert any(item.startswith("fp16 -> fp32") for item in exported.lost) is not engine.fp16
    training, changed = engine_training(ctx.training, engine)
    assert training.dtype == ("fp16" if engine.fp16 else "fp32")
    assert any(line.startswith("fp16 -> fp32") for line in changed) is not engine.fp16
    if key == "torchtitan":
        assert 'mixed_precision_param = "float32"' in exported.files["torchtitan.toml"]


def test_layout_changes_name_each_part_that_differs():
    stages = (StageStrategy("a", 0, 10, 2, 0), StageStrategy("b", 10, 24, 4, 0))
    before = Strategy((PipelineStrategy(4, 1, 8, stages),), "selective", 1)
    swapped = (StageStrategy("b", 0, 12, 4, 0), StageStrategy("a", 12, 24, 2, 0))
    after = replace(before, pipelines=(PipelineStrategy(2, 2, 8, swapped),), zero_stage=0, virtual_stages=2)
    assert layout_changes(before, before) == []
    assert layout_changes(before, after) == [
        "stages [a tp2 L0-9 | b tp4 L10-23] -> [b tp4 L0-11 | a tp2 L12-23]",
        "replicas 4 -> 2",
        "micro-batch 1 -> 2",
        "ZeRO 1 -> 0",
        "interleaving (virtual stages) 1 -> 2",
    ]
    two_families = replace(before, pipelines=(*before.pipelines, *after.pipelines))
    assert layout_changes(two_families, before) == ["pipeline families 2 -> 1", f"now {describe_strategy(before)}"]


@pytest.mark.parametrize("key", list(engine_catalog()))
def test_interleaving_and_the_mixed_vendor_note_follow_the_flags(hethub, key):
    ctx, strategy = hethub
    engine = get_engine(key)
    assert strategy.virtual_stages > 1
    exported = export_plan(ctx, strategy, key)
    assert any("interleaved 1F1B" in item for item in exported.lost) is not engine.interleaving
    assert (exported.strategy.virtual_stages > 1) is engine.interleaving
    vendors = {ctx.cluster.group(s.group).device.vendor for s in exported.strategy.pipelines[0].stages}
    # an engine of one collective library runs one vendor (it lost the other); the user's script is told the backend
    assert (len(vendors) > 1) is engine.mixed_vendors
    assert any(item.startswith("vendors amd, huawei in one job") for item in exported.lost) is not engine.mixed_vendors
    noted = any(note.startswith("the plan spans vendors amd, huawei: build") for note in exported.notes)
    assert noted is (key == "torchrun")


def test_chunks_of_one_stage_are_exported_plain_to_an_engines_own_script():
    """A one-stage plan with 3 virtual stages (hetplan's runtime runs the chunks in turn) was exported to Megatron with
    3 virtual stages, which it refuses without pipeline parallelism, and the interleaving note; the user's own script
    (torchrun) keeps them."""
    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    made = plan(cluster, model, load_training(overrides={"global_batch_size": 8}))
    assert [len(p.stages) for p in made.strategy.pipelines] == [1]
    chunked = replace(made.strategy, virtual_stages=3)
    for key in ("megatron", "torchtitan"):
        exported = export_plan(made.context, chunked, key)
        assert exported.strategy.virtual_stages == 1 and not any("interleaving" in note for note in exported.notes)
        assert f"3 chunks of one pipeline stage -> plain 1F1B: {key} interleaves the chunks of two" in exported.lost[0]
    kept = export_plan(made.context, chunked, "torchrun")
    assert kept.strategy.virtual_stages == 3 and kept.lost == []


def test_deepspeed_config_passes_deepspeeds_own_checks(mixed, tmp_path, monkeypatch):
    ctx, strategy = mixed
    exported = export_plan(ctx, strategy, "deepspeed")
    config = json.loads(exported.files["ds_config.json"])
    pipeline = exported.strategy.pipelines[0]
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * pipeline.replicas
    )
    parts_line = next(line for line in exported.files["hetplan_pipeline.py"].splitlines() if line.startswith("PARTS"))
    ends = [s.layer_end + 1 for s in pipeline.stages[:-1]]  # the embedding is layer 0, the head the last one
    assert parts_line == f"PARTS = {[0, *ends, ctx.model.num_layers + 2]}"
    bounds = exported.strategy.pipelines[0].stages[0]
    near = near_plans(ctx, strategy, get_engine("deepspeed"))[0]  # the plan's own boundaries at TP 1
    assert [s.layer_end for s in near.pipelines[0].stages] == [14, 24] and bounds.tp == 1
    compile(exported.files["hetplan_pipeline.py"], "hetplan_pipeline.py", "exec")
    config_module = pytest.importorskip("deepspeed.runtime.config")

    class DataParallel:
        def get_data_parallel_world_size(self) -> int:
            return pipeline.replicas

    import importlib

    import deepspeed.comm
    import torch.distributed as dist

    from profiler.comm_bench import free_port

    # DeepSpeed reads the data-parallel size from `mpu` only once its communication is up (one local rank here).
    # Its CPU backend would first JIT-compile a shared-memory all-reduce op the config checks never use, behind a
    # file lock that waits without a timeout (an interrupted compile left one behind, and the next suite hung on it)
    backend = importlib.import_module("deepspeed.comm.torch")  # the attribute deepspeed.comm.torch is torch itself
    monkeypatch.setattr(backend, "build_shm_op", lambda: None)
    address = f"tcp://127.0.0.1:{free_port()}"
    deepspeed.comm.init_distributed("gloo", auto_mpi_discovery=False, init_method=address, rank=0, world_size=1)
    wrong = {**config, "train_batch_size": config["train_batch_size"] + 1}
    try:
        checked = config_module.DeepSpeedConfig(config, mpu=DataParallel())
        assert checked.gradient_accumulation_steps == pipeline.num_microbatches
        with pytest.raises(AssertionError):  # the check can fail: a batch that does not add up
            config_module.DeepSpeedConfig(wrong, mpu=DataParallel())
    finally:
        dist.destroy_process_group()


def test_deepspeeds_pipeline_module_takes_the_plans_boundaries_by_default(mixed, monkeypatch):
    """DeepSpeed reads no partition from its config (only the pipeline's stage count there): the exported module
    partitions at the plan's boundaries unless told otherwise, over the plan's stage count."""
    pipe = pytest.importorskip("deepspeed.pipe")
    from deepspeed.runtime.config import get_pipeline_config

    ctx, strategy = mixed
    exported = export_plan(ctx, strategy, "deepspeed", keep_layout=True)
    config = json.loads(exported.files["ds_config.json"])
    assert set(config["pipeline"]) <= set(get_pipeline_config({})) and config["pipeline"]["stages"] == 2
    built: dict[str, object] = {}

    def record(self: object, layers: object, num_stages: object = None, topology: object = None, **kwargs: object):
        built.clear()
        built.update(num_stages=num_stages, topology=topology, **kwargs)

    monkeypatch.setattr(pipe.PipelineModule, "__init__", record)  # DeepSpeed's (layers, num_stages, topology, ...)
    namespace: dict[str, object] = {}
    exec(compile(exported.files["hetplan_pipeline.py"], "hetplan_pipeline.py", "exec"), namespace)
    module_class = namespace["HetplanPipelineModule"]
    module = module_class(layers=[])  # type: ignore[operator]
    assert strategy.recompute == "selective" and exported.strategy.recompute in ("none", "full")
    assert any("selective recompute -> none or full" in line for line in exported.lost)
    interval = int(exported.strategy.recompute == "full")  # DeepSpeed checkpoints whole layers or none
    own = {"partition_method": "hetplan", "num_stages": 2, "topology": None, "activation_checkpoint_interval": interval}
    assert built == own
    module_class([], 2)  # type: ignore[operator]  # the stage count given as DeepSpeed takes it
    assert built == own
    module_class(layers=[], topology="given", partition_method="parameters")  # type: ignore[operator]
    assert built == {**own, "partition_method": "parameters", "num_stages": None, "topology": "given"}
    with pytest.raises(ValueError, match="the plan's boundaries are for 2 stages, got num_stages=3"):
        module_class([], num_stages=3)  # type: ignore[operator]
    bounds: list[tuple[int, int]] = []
    module.stage_id, module._set_bounds = 1, lambda start, stop: bounds.append((start, stop))
    module._partition_layers("hetplan")
    ends = [s.layer_end + 1 for s in exported.strategy.pipelines[0].stages[:-1]]  # the embedding is layer 0
    assert bounds == [(ends[0], ctx.model.num_layers + 2)]
    # a plan predicted with full recompute checkpoints every layer (the module left DeepSpeed's default, none)
    full = export_plan(ctx, replace(strategy, recompute="full"), "deepspeed", keep_layout=True)
    namespace = {}
    exec(compile(full.files["hetplan_pipeline.py"], "hetplan_pipeline.py", "exec"), namespace)
    namespace["HetplanPipelineModule"](layers=[])  # type: ignore[operator]
    assert built == {**own, "activation_checkpoint_interval": 1}
    assert "Recompute: full: every layer is checkpointed" in full.files["hetplan_pipeline.py"]


def test_torchtitan_parts_cover_the_model_once_in_order(hethub):
    ctx, strategy = hethub
    exported = export_plan(ctx, strategy, "torchtitan")
    parsed = tomllib.loads(exported.files["torchtitan.toml"])
    parts = parsed["parallelism"]["module_fqns_per_model_part"]
    pipeline = exported.strategy.pipelines[0]
    assert len(parts) == len(pipeline.stages) * exported.strategy.virtual_stages
    flat = [name for part in parts for name in part]
    layers = [f"layers.{i}" for i in range(ctx.model.num_layers)]
    assert flat == ["tok_embeddings", *layers, "norm", "output"]
    assert parsed["parallelism"]["pipeline_parallel_degree"] == len(pipeline.stages)
    assert parsed["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"


def test_launch_script_lists_every_used_device_once_in_stage_order(hethub, tmp_path):
    ctx, strategy = hethub
    exported = export_plan(ctx, strategy, "torchrun")
    pipeline = exported.strategy.pipelines[0]
    assert sum(len(n.devices) for n in exported.nodes) == sum(s.tp for s in pipeline.stages) * pipeline.replicas
    assert [n.node_rank for n in exported.nodes] == list(range(len(exported.nodes)))
    groups_in_order = [n.group for n in exported.nodes]
    assert groups_in_order == sorted(groups_in_order, key=[s.group for s in pipeline.stages].index)
    script = tmp_path / "launch.sh"
    script.write_text(exported.files["launch.sh"])
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "HIP_VISIBLE_DEVICES=" in exported.files["launch.sh"]  # the amd nodes
    assert "ASCEND_RT_VISIBLE_DEVICES=" in exported.files["launch.sh"]  # the catalog's "huawei" ones
    assert any("vendors" in note for note in export_plan(ctx, strategy, "megatron").notes)


def test_a_node_split_between_distant_stages_is_refused(mixed):
    ctx, strategy = mixed
    a100 = ctx.cluster.groups[0].name
    stages = strategy.pipelines[0].stages
    # stage 0 and stage 2 share the A100 group's first node (4 devices each), stage 1 (V100) sits between them
    reordered = (
        StageStrategy(a100, 0, 8, 1, 0),
        replace(stages[1], layer_start=8, layer_end=18),
        StageStrategy(a100, 18, 24, 1, 4),
    )
    odd = Strategy((PipelineStrategy(4, 1, 8, reordered, total_microbatches=30),), "selective", 1)
    with pytest.raises(SpecError, match="reopen node"):
        export_plan(ctx, odd, "torchrun")


@pytest.mark.slow
def test_cli_export_writes_files_and_refuses_an_unknown_format(tmp_path):
    plan_file = tmp_path / "plan.json"
    made = hetplan("plan", "--cluster", str(EXAMPLES / "a100-v100-32.yaml"), "--model", "gpt3-1.7b", "--dtype", "fp16",
                   "--global-batch", "64", "--out", str(plan_file), "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    out = tmp_path / "megatron"
    done = hetplan("export", str(plan_file), "--cluster", str(EXAMPLES / "a100-v100-32.yaml"), "--format", "megatron",
                   "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} == {"launch.sh", "export.json"}
    summary = json.loads((out / "export.json").read_text())
    assert summary["exported_iteration_time_s"] >= summary["plan_iteration_time_s"] * (1 - 1e-9)
    titan = hetplan("export", str(plan_file), "--cluster", str(EXAMPLES / "a100-v100-32.yaml"), "--format",
                    "torchtitan", "--out", str(tmp_path / "titan"))  # fmt: skip
    assert titan.returncode == 0, titan.stderr
    assert "(the export's time is predicted in fp32;" in titan.stdout  # torchtitan has no fp16: as it trains
    summary = json.loads((tmp_path / "titan" / "export.json").read_text())
    assert summary["exported_iteration_time_s"] > 3 * summary["plan_iteration_time_s"]
    bad = hetplan("export", str(plan_file), "--cluster", str(EXAMPLES / "a100-v100-32.yaml"), "--format", "nemo")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "megatron" in bad.stderr


def test_an_export_into_another_engines_export_removes_only_what_that_export_wrote_unchanged(tmp_path, capsys):
    """megatron exported into a directory of a deepspeed export left ds_config.json and hetplan_pipeline.py beside
    its launch.sh: two engines' launch files in one directory. The files the earlier export wrote, as it wrote them
    (export.json records their hashes), are removed and said; a user's own file stays, and one of the earlier
    export's files changed since refuses the export, which then writes nothing."""
    import cli
    from report.failures import exit_status

    def hetplan_here(*args: str) -> tuple[int, str]:
        code = exit_status(cli.app, list(args))
        return code, capsys.readouterr().err

    cluster, model = str(EXAMPLES / "cpu-2x2.yaml"), str(EXAMPLES / "models" / "tiny-llama.yaml")
    plan_file, out = tmp_path / "plan.json", tmp_path / "export"
    made = hetplan_here("plan", "-c", cluster, "-m", model, "--global-batch", "8", "--out", str(plan_file), "--json")
    assert made[0] == 0, made
    export = ("export", str(plan_file), "-c", cluster, "--out", str(out), "--json", "--format")
    assert hetplan_here(*export, "deepspeed")[0] == 0
    (out / "mine.txt").write_text("a user's notes")
    code, said = hetplan_here(*export, "megatron")
    assert (
        code == 0
        and (
            f"note: removed ds_config.json, hetplan_pipeline.py from {out}: the export there before wrote them, "
            "megatron's does not"
        )
        in said.splitlines()
    )
    assert sorted(path.name for path in out.iterdir()) == ["export.json", "launch.sh", "mine.txt"]
    assert hetplan_here(*export, "deepspeed")[0] == 0
    with (out / "ds_config.json").open("a") as config:
        config.write("\n")  # tuned by hand
    refused = (
        f"hetplan: error: --out: {out}: ds_config.json is not as the earlier deepspeed export wrote it (changed "
        "since, or not written by hetplan), and torchtitan's export would overwrite or sit beside it: move it away, "
        "or choose another --out\n"
    )
    assert hetplan_here(*export, "torchtitan") == (2, refused)
    kept = ["ds_config.json", "export.json", "hetplan_pipeline.py", "launch.sh", "mine.txt"]
    assert sorted(path.name for path in out.iterdir()) == kept
    assert json.loads((out / "export.json").read_text())["format"] == "deepspeed"
    # the same engine again: a file it would overwrite, edited by hand, is the user's work too
    assert hetplan_here(*export, "deepspeed")[0] == 2 and (out / "ds_config.json").read_text().endswith("\n\n")
    (out / "ds_config.json").unlink()
    assert hetplan_here(*export, "deepspeed")[0] == 0  # as written (or re-written with the same content): replaced
    # a user's own launch.sh where no export recorded one
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "launch.sh").write_text("#!/bin/sh\necho my own launcher\n")
    code, said = hetplan_here(*export[:4], "--out", str(mine), "--format", "torchrun")
    assert code == 2 and "launch.sh was not written by a hetplan export (no export.json beside it)" in said
    assert (mine / "launch.sh").read_text() == "#!/bin/sh\necho my own launcher\n"


def test_keeping_the_layout_of_a_plan_of_several_families_says_why_there_is_none():
    """The 768-device example's default plan has two families; Megatron runs one, and the only one-family plan is its
    own: kept, the refusal says so (it blamed memory)."""
    cluster, model = load_cluster(EXAMPLES / "hethub-768.yaml"), load_model("llama-140b")
    training = load_training(EXAMPLES / "training" / "hethub-140b.yaml")
    made = plan(cluster, model, training)
    assert len(made.strategy.pipelines) == 2
    with pytest.raises(SpecError, match="a plan of several families has no one-family counterpart") as caught:
        export_plan(made.context, made.strategy, "megatron", keep_layout=True)
    assert "memory" not in str(caught.value)
    exported = export_plan(made.context, made.strategy, "megatron")
    assert any("several families has no one-family counterpart" in note for note in exported.notes)


def test_keeping_a_layout_whose_lost_part_has_no_stand_in_says_so():
    """DeepSpeed splits no sequences over ranks: a long-context plan's CP 8 (on the H100s) has no stand-in that keeps
    its layout."""
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-8b")
    h100 = cluster.only(cluster.group("h100"))
    made = plan(h100, model, load_training(EXAMPLES / "training" / "long-context-32k.yaml"))
    assert made.strategy.context_parallel > 1
    with pytest.raises(SpecError, match=r"can be made \(the engine has no stand-in for one of them\).*CP \d") as caught:
        export_plan(made.context, made.strategy, "deepspeed", keep_layout=True)
    assert "memory" not in str(caught.value)


def test_an_engine_that_trains_in_another_dtype_has_its_plan_chosen_and_predicted_in_it(mixed):
    """torchtitan trains the fp16 plan in fp32: given the plan's costs for another training (`context_for`, what the
    CLI passes), the export's plan is chosen, checked for memory and predicted in fp32 (four times slower here: the
    V100s' and A100s' fp32 against their fp16 tensor cores), and its lost line says so; without, the time stays the
    plan's dtype's and the line says that. Megatron has fp16: nothing changes."""
    ctx, strategy = mixed
    predictor = default_predictor()

    def context_for(training):
        return predictor.context(ctx.cluster, ctx.model, training)

    fp32 = context_for(ctx.training.model_copy(update={"dtype": "fp32"}))
    exported = export_plan(ctx, strategy, "torchtitan", context_for=context_for)
    assert evaluate(fp32, exported.strategy).fits
    assert exported.predicted_iteration_time_s == pytest.approx(evaluate(fp32, exported.strategy).iteration_time_s)
    assert exported.predicted_iteration_time_s > 3 * exported.plan_iteration_time_s
    assert any("(the export's time is predicted in fp32;" in line for line in exported.lost)
    without = export_plan(ctx, strategy, "torchtitan")
    assert any("(the export's time is still predicted in fp16;" in line for line in without.lost)
    assert without.predicted_iteration_time_s < 2 * without.plan_iteration_time_s
    megatron = export_plan(ctx, strategy, "megatron", context_for=context_for)
    assert megatron.predicted_iteration_time_s == export_plan(ctx, strategy, "megatron").predicted_iteration_time_s


def test_a_layout_the_engine_runs_but_not_in_its_dtype_is_replaced_by_one_that_fits():
    """A torchtitan plan in fp16 (micro-batch 16, no recompute) fits there but not in fp32, the dtype torchtitan
    trains it in: the export does not keep it (it ran out of memory before), it writes a plan that fits in fp32."""
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_model("gpt3-1.7b")
    overrides = {"global_batch_size": 256, "dtype": "fp16", "zero_stage": 2, "recompute": ["none"]}
    training = load_training(overrides={**overrides, "micro_batch_sizes": [16]})
    predictor = default_predictor()

    def context_for(changed):
        return predictor.context(cluster, model, changed)

    ctx = context_for(training)
    strategy = engine_plans(ctx, get_engine("torchtitan"))[0]
    fp32 = context_for(training.model_copy(update={"dtype": "fp32"}))
    assert evaluate(ctx, strategy).fits and not evaluate(fp32, strategy).fits
    exported = export_plan(ctx, strategy, "torchtitan", context_for=context_for)
    assert exported.strategy != strategy and evaluate(fp32, exported.strategy).fits
    assert [line.split(":")[0] for line in exported.lost] == ["fp16 -> fp32"]


@pytest.mark.parametrize(
    ("key", "flavor"), [("llama3-8b", "8B"), ("llama3-70b", "70B"), ("llama3-405b", "405B"), ("qwen3-4b", None)]
)
def test_torchtitan_names_the_llama3_flavor_of_the_models_shape(key, flavor):
    """The TOML named no model: torchtitan trained its default flavor whatever the plan's model. A Llama 3 shape
    names its flavor; any other says none has it, with the shape to register (and FP8's converter joins the same
    [model] table)."""
    from planner.engine_files import torchtitan_model_lines

    model = load_model(key)
    parsed = tomllib.loads("\n".join(torchtitan_model_lines(model, fp8=True)))
    assert parsed["model"]["converters"] == ["quantize.linear.float8"]
    if flavor is None:
        assert "name" not in parsed["model"] and "flavor" not in parsed["model"]
        (comment,) = [line for line in torchtitan_model_lines(model, fp8=False) if line.startswith("#")]
        assert comment.startswith("# no torchtitan Llama 3 flavor has this model's shape (36 layers, hidden 2560")
    else:
        assert (parsed["model"]["name"], parsed["model"]["flavor"]) == ("llama3", flavor)
    untied = model.model_copy(update={"vocab_size": 32000})  # another vocabulary is another model
    assert "flavor" not in tomllib.loads("\n".join(torchtitan_model_lines(untied, fp8=False)))["model"]


@pytest.mark.parametrize("key", ["qwen3-4b", "llama3-8b"])
def test_exports_that_cannot_say_the_tie_tell_the_user(key):
    """A tied model's DeepSpeed module said to build [embedding, *layers, head] (two matrices) and torchtitan's
    Llama trains an output of its own, both without a word: DeepSpeed's module and notes now say to tie them with
    TiedLayerSpec, torchtitan's notes what the run trains beyond the plan. An untied model gets neither."""
    from planner.engine_files import TORCHTITAN_UNTIED_NOTE

    cluster, model, training = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model(key), load_training()
    ctx = default_predictor().context(cluster, model, training)
    strategy = plan(cluster, model, training).strategy
    deepspeed, titan = export_plan(ctx, strategy, "deepspeed"), export_plan(ctx, strategy, "torchtitan")
    tied = model.tied_embeddings
    assert ("TiedLayerSpec" in deepspeed.files["hetplan_pipeline.py"]) == tied
    assert any("TiedLayerSpec" in note for note in deepspeed.notes) == tied
    assert (TORCHTITAN_UNTIED_NOTE in titan.notes) == tied
