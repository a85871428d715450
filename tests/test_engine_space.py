"""Planning for one engine (`plan --engine`): the training restricted to what it runs, a plan whose export loses
nothing and is at least as fast as the closest export of the free plan; ZeRO stages and FP8 as each engine has them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import tomllib

from planner import plan
from planner.engine_space import engine_lost, engine_training, engine_zero_stage, plan_vendors
from planner.export import export_plan
from planner.plan import load_plan
from specs import get_engine, load_cluster, load_model, load_training
from specs.layout import PipelineStrategy, StageStrategy, Strategy
from tests.conftest import EXAMPLES, hetplan


@pytest.fixture(scope="module")
def h100_mi300x():
    """The H100 + MI300X example and Llama-3-70B: the free plan uses per-stage TP, which Megatron cannot express."""
    return load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b"), load_training()


def test_a_plan_for_megatron_exports_without_loss_and_beats_the_closest_export_of_the_free_plan(h100_mi300x):
    megatron = get_engine("megatron")
    cluster = h100_mi300x[0]
    free = plan(*h100_mi300x)
    for_megatron = plan(*h100_mi300x, engine=megatron)
    assert engine_lost(free.strategy, megatron), "the example must exercise a plan Megatron cannot express"
    assert engine_lost(for_megatron.strategy, megatron, cluster=cluster) == []
    exported = export_plan(for_megatron.context, for_megatron.strategy, "megatron")
    assert exported.lost == [] and exported.strategy == for_megatron.strategy
    assert exported.predicted_iteration_time_s == pytest.approx(for_megatron.evaluation.iteration_time_s)
    closest_of_free = export_plan(free.context, free.strategy, "megatron")
    assert closest_of_free.lost  # ... and says what it lost
    assert for_megatron.evaluation.iteration_time_s <= closest_of_free.predicted_iteration_time_s + 1e-9
    assert free.evaluation.iteration_time_s <= for_megatron.evaluation.iteration_time_s + 1e-9  # the larger space
    assert for_megatron.search_stats["engine"] == "megatron"
    # Megatron's process groups are one library's (NCCL or RCCL): the free plan mixes the vendors, Megatron's trains on
    # one, the other's group idle, and both say so (they planned over both and said to launch over a bridge the files
    # did not set up)
    assert plan_vendors(cluster, free.strategy) == ["amd", "nvidia"]
    assert len(plan_vendors(cluster, for_megatron.strategy)) == 1
    assert closest_of_free.lost[0].startswith("vendors amd, nvidia in one job -> one vendor's devices: megatron builds")
    idle = "megatron trains on one vendor's devices (amd): groups h100 of other vendors stay idle; FlagScale's hetero"
    assert for_megatron.search_stats["engine_note"].startswith(idle)
    assert all(any(note.startswith(idle) for note in export.notes) for export in (exported, closest_of_free))
    for_flagscale = plan(*h100_mi300x, engine="flagscale")  # one job over NCCL and RCCL (its hetero mode)
    assert plan_vendors(cluster, for_flagscale.strategy) == ["amd", "nvidia"]
    assert "engine_note" not in for_flagscale.search_stats
    # the user's own script (torchrun) mixes them too, over hetplan's backend, which the export says
    exported = export_plan(free.context, free.strategy, "torchrun")
    assert exported.lost == [] and plan_vendors(cluster, exported.strategy) == ["amd", "nvidia"]
    bridge = "the plan spans vendors amd, nvidia: build the process groups that cross them with hetplan's backend"
    assert any(note.startswith(bridge) for note in exported.notes)


def test_an_interleaved_plan_of_fewer_micro_batches_than_stages_exports_to_megatron_as_plain_1f1b():
    """Megatron refuses an interleaved run whose micro-batch groups hold fewer than p micro-batches (the export wrote
    --microbatch-group-size-per-virtual-pipeline-stage 2 on 4 stages); the planner's own runtime runs it."""
    from predictor.cost_model import build_context
    from specs.layout import megatron_strategy

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    cluster = cluster.only(cluster.group("a100"))
    training = load_training(overrides={"global_batch_size": 4, "zero_stage": 1})
    ctx = build_context(cluster, load_model("gpt3-1.7b"), training)
    layout = {"group": "a100", "tp": 2, "pp": 4, "dp": 2, "micro_batch_size": 1, "recompute": "none"}
    short = megatron_strategy(cluster, ctx.model, training, **layout, virtual_stages=2)  # 2 micro-batches per replica
    (lost,) = engine_lost(short, get_engine("megatron"))
    assert lost.startswith("interleaved 1F1B over 2 micro-batches on 4 stages -> plain 1F1B")
    exported = export_plan(ctx, short, "megatron", keep_layout=True)
    assert exported.strategy.virtual_stages == 1
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in json.dumps(exported.files)
    enough = megatron_strategy(cluster, ctx.model, training.model_copy(update={"global_batch_size": 8}), **layout,
                               virtual_stages=2)  # fmt: skip
    assert engine_lost(enough, get_engine("megatron")) == []
    assert engine_lost(short, get_engine("torchrun")) == []  # PyTorch's interleaved schedules run it


def test_megatron_plans_plain_1f1b_where_the_best_plans_interleave_too_few_micro_batches():
    """Three micro-batches on four stages: the search's best plans interleave, which Megatron refuses; they were
    dropped after the search and nothing was left ('does not fit'), though plain 1F1B fits."""
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_model("llama3-70b")
    training = load_training(overrides={"global_batch_size": 3, "virtual_stages": [1, 2]})
    free = plan(cluster, model, training, engine="torchrun")
    assert free.strategy.virtual_stages == 2  # the planner's own best interleaves
    for_megatron = plan(cluster, model, training, engine="megatron")
    assert (
        for_megatron.strategy.virtual_stages == 1 and engine_lost(for_megatron.strategy, get_engine("megatron")) == []
    )


def test_megatron_interleaves_where_enough_micro_batches_fill_its_groups():
    """H100 + MI300X / Llama-3-70B at global batch 6: the search's best plans interleave fewer micro-batches than
    stages, which Megatron refuses. Its search fell back to plain 1F1B (1.597 s) and never came back to the
    interleaved plans of enough micro-batches those had outranked; the rule is now in the candidates (2 stages, v=4,
    2 micro-batches per replica: 1.482 s)."""
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    training = load_training(overrides={"global_batch_size": 6, "virtual_stages": [1, 2, 4]})
    megatron = plan(cluster, model, training, engine="megatron")
    assert megatron.strategy.virtual_stages > 1 and engine_lost(megatron.strategy, get_engine("megatron")) == []
    plain = plan(cluster, model, training.model_copy(update={"virtual_stages": (1,)}), engine="megatron")
    assert megatron.evaluation.iteration_time_s < 0.95 * plain.evaluation.iteration_time_s


@pytest.mark.parametrize(
    ("engine", "asked", "runs"),
    [("megatron", 3, 1), ("megatron", 2, 1), ("deepspeed", 3, 1), ("torchtitan", 1, 2), ("torchtitan", 3, 3)],
)
def test_an_engine_runs_the_nearest_zero_stage_that_shards_at_least_as_much(engine, asked, runs):
    assert engine_zero_stage(asked, get_engine(engine)) == runs
    training, changed = engine_training(load_training(overrides={"zero_stage": asked}), get_engine(engine))
    assert training.zero_stage == runs
    said = [line for line in changed if "ZeRO" in line]
    assert len(said) == (asked != runs) and all(f"ZeRO-{asked} -> ZeRO-{runs}" in line for line in said)


def test_fp8_stays_where_the_engine_has_it_and_becomes_bf16_where_not():
    fp8 = load_training(overrides={"dtype": "fp8"})
    assert engine_training(fp8, get_engine("megatron"))[0].dtype == "fp8"
    training, changed = engine_training(fp8, get_engine("deepspeed"))
    assert training.dtype == "bf16" and any("FP8 -> bf16" in line for line in changed)


def test_deepspeed_plans_only_the_recompute_modes_it_runs_and_names_the_one_it_lost():
    """DeepSpeed's pipeline engine checkpoints whole layers or none: a plan for it never recomputes selectively (its
    memory would be predicted for a recompute the export cannot switch on), and one that does names the loss."""
    deepspeed, megatron = get_engine("deepspeed"), get_engine("megatron")
    training, changed = engine_training(load_training(), deepspeed)
    assert training.recompute == ("none", "full") and not any("recompute" in line for line in changed)
    assert engine_training(load_training(), megatron)[0].recompute == ("none", "selective", "full")
    training, changed = engine_training(load_training(overrides={"recompute": ["selective"]}), deepspeed)
    assert training.recompute == ("full",)  # saves at least as much memory as asked
    assert changed[0] == "recompute selective -> full (deepspeed runs only none, full)"
    stage = StageStrategy("g", 0, 8, 1, 0)
    selective = Strategy((PipelineStrategy(1, 1, 4, (stage,)),), "selective", 1)
    assert engine_lost(selective, deepspeed) == ["selective recompute -> none or full: deepspeed runs only none, full"]
    assert engine_lost(selective, megatron) == []
    assert engine_lost(replace(selective, recompute="full"), deepspeed) == []


def test_the_engines_kernels_are_predicted_unless_the_training_names_its_own():
    deepspeed = get_engine("deepspeed")
    assert engine_training(load_training(), deepspeed)[0].engine == "deepspeed"
    named = load_training(overrides={"engine": "megatron"})  # e.g. Megatron-DeepSpeed: Megatron's kernels
    assert engine_training(named, deepspeed)[0].engine == "megatron"
    assert engine_training(load_training(), get_engine("torchrun"))[0].engine == "megatron"


def test_a_zero_3_plan_exports_to_torchtitan_as_fsdp_and_to_megatron_as_its_distributed_optimizer(
    h100_mi300x, tmp_path
):
    cluster, model, _ = h100_mi300x
    sharded = plan(cluster, model, load_training(overrides={"zero_stage": 3}))
    assert sharded.strategy.zero_stage == 3
    sharded.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").strategy == sharded.strategy  # the schema takes every ZeRO stage
    titan = export_plan(sharded.context, sharded.strategy, "torchtitan")
    assert not any("ZeRO" in line for line in titan.lost)
    parallel = tomllib.loads(titan.files["torchtitan.toml"])["parallelism"]
    replicas = titan.strategy.pipelines[0].replicas
    assert (parallel["data_parallel_shard_degree"], parallel["data_parallel_replicate_degree"]) == (replicas, 1)
    assert parallel["fsdp_reshard_after_forward"] == "always"
    megatron = export_plan(sharded.context, sharded.strategy, "megatron")
    assert any("ZeRO-3 -> ZeRO-1" in line for line in megatron.lost)
    assert megatron.strategy.zero_stage == 1 and "--use-distributed-optimizer" in megatron.files["launch.sh"]


def test_fp8_plans_export_megatrons_fp8_switch_and_deepspeed_says_it_has_none():
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-8b")
    fp8 = plan(cluster, model, load_training(overrides={"dtype": "fp8", "global_batch_size": 256}))
    megatron = export_plan(fp8.context, fp8.strategy, "megatron").files["launch.sh"]
    assert "--fp8-format hybrid" in megatron and "--bf16" in megatron
    deepspeed = export_plan(fp8.context, fp8.strategy, "deepspeed")
    assert any(line.startswith("FP8 GEMMs -> bf16") for line in deepspeed.lost)
    assert json.loads(deepspeed.files["ds_config.json"])["bf16"]["enabled"] is True
    titan = tomllib.loads(export_plan(fp8.context, fp8.strategy, "torchtitan").files["torchtitan.toml"])
    assert titan["model"]["converters"] == ["quantize.linear.float8"]


def test_cli_plan_for_an_engine_says_so_and_refuses_an_unknown_one(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "-c", str(EXAMPLES / "a100-v100-32.yaml"), "-m", "gpt3-1.7b", "--global-batch", "64", "-q"]
    args += ["--dtype", "fp16"]
    done = hetplan(*args, "--engine", "deepspeed", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "deepspeed: only plans it runs as planned" in done.stdout
    search = json.loads(out.read_text())["search"]
    assert search["engine"] == "deepspeed" and any("deepspeed's kernels" in c for c in search["engine_changes"])
    assert {s["tp"] for p in json.loads(out.read_text())["pipelines"] for s in p["stages"]} == {1}
    wrong = hetplan(*args, "--engine", "nemo")
    assert wrong.returncode == 2 and "--engine" in wrong.stderr and "Traceback" not in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1


def test_an_export_is_predicted_with_the_kernels_its_engine_runs_unless_the_training_chose_them(h100_mi300x):
    """The free plan (Megatron's kernels) exported to DeepSpeed was predicted with Megatron's kernels, though
    DeepSpeed runs the user's layers with its own: 115.5 s where `plan --engine deepspeed` predicts the same layout
    at 121.4 s. The export's costs take the engine's kernels, and a note says what they cost the plan itself; a
    training that names its kernels (Megatron's for Megatron-DeepSpeed) keeps them (`keep_kernels`), and so does an
    engine whose kernels the predictor has no scale for (torchtitan's: no note)."""
    from predictor.predictor import default_predictor

    cluster, model, training = h100_mi300x
    free = plan(cluster, model, training)

    def context_for(changed):
        return default_predictor().context(cluster, model, changed)

    kept = export_plan(free.context, free.strategy, "deepspeed", context_for=context_for, keep_kernels=True)
    exported = export_plan(free.context, free.strategy, "deepspeed", context_for=context_for)
    [note] = [note for note in exported.notes if "kernels" in note]
    plan_s = free.evaluation.iteration_time_s
    assert note.startswith("the export's time is predicted with deepspeed's kernels, which deepspeed runs the layers")
    assert f"({plan_s:.3f} s with megatron's, as planned; a training that names its `engine` keeps it)" in note
    assert not any("kernels" in note for note in kept.notes)
    for_engine = plan(cluster, model, training, engine="deepspeed")
    assert for_engine.context.training.engine == "deepspeed"
    assert exported.strategy == kept.strategy == for_engine.strategy
    assert exported.predicted_iteration_time_s == pytest.approx(for_engine.evaluation.iteration_time_s)
    assert exported.predicted_iteration_time_s > 1.02 * kept.predicted_iteration_time_s
    titan = export_plan(free.context, free.strategy, "torchtitan", context_for=context_for)
    assert not any("kernels" in note for note in titan.notes)


def test_a_plan_records_that_its_training_named_the_kernels_and_its_export_keeps_them(tmp_path):
    """`engine: megatron` in the training file (Megatron-DeepSpeed) is recorded in the plan (a loaded training sets
    every field, so the plan must say it): its DeepSpeed export keeps Megatron's kernels; without it the export
    takes DeepSpeed's, and a replan keeps the record."""
    cluster = str(EXAMPLES / "a100-v100-32.yaml")
    named = tmp_path / "named.yaml"
    named.write_text("global_batch_size: 64\ndtype: fp16\nengine: megatron\n")
    unnamed = tmp_path / "unnamed.yaml"
    unnamed.write_text("global_batch_size: 64\ndtype: fp16\n")
    for training, names in ((named, True), (unnamed, False)):
        out = tmp_path / f"{training.stem}.json"
        made = hetplan("plan", "-c", cluster, "-m", "gpt3-1.7b", "--training", str(training), "--out", str(out), "-q")
        assert made.returncode == 0, made.stderr
        assert json.loads(out.read_text())["search"].get("training_names_engine", False) is names
        assert load_plan(out).training_names_engine is names
        result = hetplan("export", str(out), "-c", cluster, "--format", "deepspeed", "--out", str(tmp_path / "ds"))
        assert result.returncode == 0, result.stderr
        assert ("deepspeed's kernels" in result.stdout + result.stderr) is not names
    again = tmp_path / "again.json"
    replanned = hetplan("replan", str(tmp_path / "named.json"), "-c", cluster, "--without", "node:v100/1", "--out",
                        str(again), "-q")  # fmt: skip
    assert replanned.returncode == 0, replanned.stderr
    assert load_plan(again).training_names_engine


def test_an_export_of_a_plan_that_does_not_fit_memory_says_so():
    """A strategy built in code (or a plan edited by hand) that predict finds over memory was exported with no word:
    the engine's launch would run out of memory at its first step."""
    from planner import build_context, predict
    from specs.layout import megatron_strategy

    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    ctx = build_context(cluster, model, training)
    for group, micro_batch, fits in (("v100", 64, False), ("a100", 1, True)):
        strategy = megatron_strategy(cluster, model, training, group=group, tp=1, pp=1, dp=1,
                                     micro_batch_size=micro_batch, recompute="none")  # fmt: skip
        assert predict(ctx, strategy).fits is fits
        notes = [note for note in export_plan(ctx, strategy, "torchrun").notes if "does not fit memory" in note]
        assert (notes == []) is fits, notes
        if not fits:
            assert "v100 stage (layers 0-23) holds" in notes[0] and "29.4 GiB usable" in notes[0], notes


TWO_VENDORS = """name: two
groups:
  - {{name: {slow}, device: {slow}, nodes: 2, devices_per_node: 8, nics_per_node: 8, nic_gbps: 400}}
  - {{name: mi300x, device: mi300x, nodes: 1, devices_per_node: 8, nics_per_node: 8, nic_gbps: 200}}
network: {{topology: rail-optimized, inter_group_gbps: 100}}
"""


def test_an_engine_of_one_library_says_so_where_nothing_fits_and_names_only_the_vendors_idle(tmp_path):
    """(The review's.) Llama-140B fits 2 H100 nodes and 1 MI300X node together, not either vendor alone: Megatron's
    refusal named the H100 shortfall and suggested --zero-stage 3, which Megatron has not, and said nothing of its one
    vendor. With V100s idle by bf16 and MI300Xs the only vendor left, the V100s were said idle by the vendor; and the
    idle-devices hint offered `--uneven-batch exhaustive` to an engine without uneven batches."""
    from report.tables import hint_lines
    from specs.errors import DoesNotFitError

    path = tmp_path / "h100-mi300x.yaml"
    path.write_text(TWO_VENDORS.format(slow="h100"))
    cluster, model = load_cluster(path), load_model("llama-140b")
    training = load_training(overrides={"global_batch_size": 64, "seq_length": 2048})
    assert plan(cluster, model, training).evaluation.fits
    with pytest.raises(DoesNotFitError) as caught:
        plan(cluster, model, training, engine="megatron")
    said = str(caught.value)
    assert said.endswith(
        "megatron trains on one vendor's devices at a time: FlagScale's hetero mode and a torchrun "
        "script over hetplan's backend (comm/) mix vendors (--engine flagscale, --engine torchrun)"
    )
    assert "--zero-stage 3" not in said  # Megatron's ZeRO-3 is its distributed optimizer
    path.write_text(TWO_VENDORS.format(slow="v100"))
    bf16 = load_training(overrides={"global_batch_size": 64, "dtype": "bf16"})
    made = plan(load_cluster(path), load_model("llama3-8b"), bf16, engine="megatron")
    assert "engine_note" not in made.search_stats and "v100 has no bf16" in made.search_stats["idle_note"]
    for_megatron = plan(*_h100_mi300x_inputs(), engine="megatron")
    assert "stay idle" in for_megatron.search_stats["engine_note"]
    assert hint_lines(for_megatron.context, for_megatron.evaluation)  # (without the engine: the H100s idle)
    from planner.engine_space import _no_near_plan

    free = plan(*_h100_mi300x_inputs()).strategy  # over both vendors: no reason for an engine that mixes them
    assert _no_near_plan(free, [], ["amd", "nvidia"], get_engine("flagscale")).startswith("no plan with only those")
    assert _no_near_plan(free, [], ["amd", "nvidia"], get_engine("megatron")).startswith("a plan over amd, nvidia")
    assert hint_lines(for_megatron.context, for_megatron.evaluation, get_engine("megatron")) == []


def _h100_mi300x_inputs() -> tuple[object, object, object]:
    return load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b"), load_training()
