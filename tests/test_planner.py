"""The planner end to end on the bundled examples: quality, honesty of the yardsticks, determinism, no-fit."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from planner import plan
from planner.candidates import divisors
from predictor.cost_model import decoder_layer_time_s, evaluate
from specs import DoesNotFitError, load_cluster, load_model, load_training
from specs.cluster import ClusterSpec
from specs.errors import SpecError
from tests.conftest import EXAMPLES, ONE_T4_NODE, ROOT


@pytest.fixture(scope="module")
def hethub_plan():
    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    return plan(cluster, load_model("llama-140b"), load_training(EXAMPLES / "training" / "hethub-140b.yaml"))


def test_hethub_plan_fits_uses_everything_and_gives_faster_devices_more_layers(hethub_plan):
    body = hethub_plan.to_dict()
    assert body["schema"] == "hetplan.plan/1"
    assert body["fits"] is True
    assert body["devices_used"] == 768
    ctx = hethub_plan.context
    placed = [(p, s) for p in hethub_plan.strategy.pipelines for s in p.stages]  # every family's stages
    speed = {}  # layers per second per device, from the profiles the plan used
    for pipeline, stage in placed:
        group = ctx.cluster.group(stage.group)
        seconds = decoder_layer_time_s(ctx, group, pipeline.micro_batch_size, stage.tp, hethub_plan.strategy.recompute)
        speed[stage.group] = 1 / (seconds * stage.tp)
    faster = max(speed, key=speed.get)
    slower = min(speed, key=speed.get)
    assert faster != slower

    def layers_per_stage_device(name):  # a replica's share of the model per device of the group
        stages = [s for _, s in placed if s.group == name]
        return sum(s.num_layers for s in stages) / sum(s.tp for s in stages)

    assert layers_per_stage_device(faster) > 1.5 * layers_per_stage_device(slower)
    for stage in (s for p in body["pipelines"] for s in p["stages"]):
        assert stage["memory_bytes"] <= stage["memory_usable_bytes"] < stage["memory_capacity_bytes"]


def test_hethub_yardsticks_are_computed_not_asserted(hethub_plan):
    body = hethub_plan.to_dict()
    groups = body["upper_bound_by_group_tokens_per_s"]
    assert set(groups) == {"amd", "ascend"}
    assert body["upper_bound_tokens_per_s"] == pytest.approx(sum(groups.values()), rel=1e-5)
    assert body["fraction_of_upper_bound"] == pytest.approx(
        body["tokens_per_s"] / body["upper_bound_tokens_per_s"], rel=1e-5
    )
    assert body["fraction_of_compute_bound"] < 1.0  # nothing beats every device busy with no bubble or comm
    assert body["tokens_per_s"] < body["compute_bound_tokens_per_s"]
    assert 0 < body["mfu"] < 1


def test_same_inputs_give_the_same_json_bytes():
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    training = load_training(None, {"dtype": "fp16", "global_batch_size": 256})
    first = plan(cluster, load_model("gpt3-6.7b"), training, top_k=3).to_dict()
    second = plan(cluster, load_model("gpt3-6.7b"), training, top_k=3).to_dict()
    first["search_time_s"] = second["search_time_s"] = 0.0  # wall-clock: the one field that may differ
    assert json.dumps(first) == json.dumps(second)
    assert first["alternatives"] and first["iteration_time_s"] <= first["alternatives"][0]["iteration_time_s"]


def test_plan_equals_exhaustive_search_on_a_small_homogeneous_cluster():
    """Every (tp, pp, dp, micro-batch, recompute, v) with Megatron-style even layers is no better than the plan."""
    from planner import predict
    from specs.layout import PipelineStrategy, StageStrategy, Strategy

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    cluster = cluster.only(cluster.group("a100"))
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64})
    best = plan(cluster, model, training)
    ctx = best.context  # the (calibrated) costs the plan was searched under
    compared = 0
    for tp in (1, 2, 4, 8):
        for pp in (p for p in divisors(model.num_layers) if p * tp <= 16):
            for dp in divisors(16 // (tp * pp)):
                for b in (b for b in training.micro_batch_sizes if 64 % (dp * b) == 0):
                    for recompute in training.recompute:
                        for v in (
                            v for v in training.virtual_stages if v == 1 or (pp > 1 and model.num_layers // pp >= v)
                        ):
                            n = model.num_layers // pp
                            stages = tuple(
                                StageStrategy("a100", i * n, (i + 1) * n, tp, i * tp * dp) for i in range(pp)
                            )
                            strategy = Strategy((PipelineStrategy(dp, b, 64 // (dp * b), stages),), recompute, 1, v)
                            evaluation = predict(ctx, strategy)
                            if evaluation.fits:
                                compared += 1
                                assert best.evaluation.iteration_time_s <= evaluation.iteration_time_s * (1 + 1e-9)
    assert compared > 0


def test_a_group_with_more_stages_than_layers_plans_on_as_many_as_there_are_layers(write):
    """33 nodes of 8 for a 32-layer model at global batch 1 (one replica): every TP degree gives the group more
    stages than layers; it holds 32 and leaves the rest idle (it used to be "no strategy", with every constraint the
    message named met)."""
    group = "groups:\n  - {name: c, device: h100, nodes: 33, devices_per_node: 8, nics_per_node: 8, nic_gbps: 400}\n"
    cluster = load_cluster(write("k33.yaml", "name: k33\n" + group))
    model = load_model("llama3-8b")
    result = plan(cluster, model, load_training(None, {"global_batch_size": 1}))
    (pipeline,) = result.strategy.pipelines
    assert pipeline.replicas == 1 and len(pipeline.stages) == model.num_layers
    assert result.evaluation.fits and result.evaluation.devices_used == 256
    again = evaluate(result.context, result.strategy)
    assert again.iteration_time_s == pytest.approx(result.evaluation.iteration_time_s, rel=1e-12)


def test_memory_infeasible_cluster_reports_smallest_shortfall(write):
    path = write(
        "t4.yaml",
        ONE_T4_NODE,
    )
    with pytest.raises(DoesNotFitError) as caught:
        plan(load_cluster(path), load_model("llama2-70b"), load_training(None, {"dtype": "fp16"}))
    assert caught.value.shortfall_bytes > 0
    message = str(caught.value)
    assert "does not fit" in message and "GiB more per device" in message and "\n" not in message


def test_shortfall_of_a_near_miss_names_the_closest_strategy(write):
    path = write(
        "two-a100.yaml",
        """
name: two-a100
groups:
  - {name: a100, device: a100-40gb, nodes: 1, devices_per_node: 2, nics_per_node: 1, nic_gbps: 100}
network: {topology: clos, inter_group_gbps: 100}
""",
    )
    # llama2-13b: 13e9 x (2 + 4 + 12) bytes = 234 GB of state on 2 x 40 GB: far; llama2-7b state 121 GB: far too.
    # gpt3-1.7b at seq 2048 fits; at 256k tokens (positions learned for as many) the fp32 logits of one micro-batch
    # alone exceed a device.
    training = load_training(None, {"recompute": ["full"], "global_batch_size": 2})
    long_gpt = load_model("gpt3-1.7b").model_copy(update={"seq_length": 262144})
    with pytest.raises(DoesNotFitError) as caught:
        plan(load_cluster(path), long_gpt, training)
    assert "the closest strategy (a100(tp" in str(caught.value)
    assert 0 < caught.value.shortfall_bytes < 200 * 2**30


def test_the_closest_misfit_is_found_only_when_asked(write, monkeypatch):
    """A search where nothing fits leaves its closest misfit to be found when a message needs it, once: a search over
    ZeRO stages, CP degrees and family partitions has many such sub-searches, and most plans fit in the end."""
    import planner.search as search_module
    from predictor.cost_model import build_context

    calls = []
    real = search_module.closest_misfit
    monkeypatch.setattr(search_module, "closest_misfit", lambda *args: calls.append(1) or real(*args))
    cluster = load_cluster(write("t4.yaml", ONE_T4_NODE))
    ctx = build_context(cluster, load_model("llama2-70b"), load_training(None, {"dtype": "fp16"}))
    result = search_module.search(ctx)
    assert not result.evaluations and calls == []
    shortfall_bytes, where = result.smallest_shortfall_bytes, result.smallest_shortfall_where
    assert shortfall_bytes > 0 and where and len(calls) == 1
    merged = search_module.merge_results([result, result], 1)
    assert len(calls) == 1  # merging finds nothing either
    assert (merged.smallest_shortfall_bytes, merged.smallest_shortfall_where) == (shortfall_bytes, where)
    assert len(calls) == 1  # each search's misfit is found once


def test_bf16_chosen_beside_devices_without_it_plans_on_the_others_and_names_the_idle_ones():
    """Chosen, bf16 on A100s beside V100s plans on the A100s alone (it was refused), the V100s named as idle with the
    dtype every group trains in; on V100s alone it is a clear error (unchosen, the training there is fp16: below)."""
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    model = load_model("gpt3-1.7b")
    made = plan(cluster, model, load_training(overrides={"dtype": "bf16", "global_batch_size": 64}))
    assert made.context.training.dtype == "bf16" and made.context.cluster.num_devices == 32  # the whole cluster's
    assert {stage.group for p in made.strategy.pipelines for stage in p.stages} == {"a100"}
    assert made.search_stats["idle_note"] == (
        "v100 (16 devices) left idle: v100 has no bf16; in fp16 every group can train (--dtype fp16)"
    )
    alone = plan(
        cluster.only(cluster.group("a100")), model, load_training(overrides={"dtype": "bf16", "global_batch_size": 64})
    )
    assert made.evaluation.iteration_time_s == pytest.approx(alone.evaluation.iteration_time_s)
    with pytest.raises(SpecError, match="v100 has no bf16: train in fp16"):
        plan(cluster.only(cluster.group("v100")), model, load_training(overrides={"dtype": "bf16"}))


def test_fp32_leaves_the_devices_without_a_published_fp32_peak_idle_and_names_them():
    """fp32 on the four-vendor cluster was refused outright ("ascend-910b.peak_fp32_tflops: no fp32 peak is known"):
    Ascend and Gaudi publish no fp32 peak, so nothing times them in fp32; the plan runs on the H100s and MI300Xs and
    names the idle groups with the dtype every group trains in. On those groups alone it is a clear error."""
    cluster, model = load_cluster(EXAMPLES / "four-vendor-256.yaml"), load_model("llama3-8b")
    training = load_training(overrides={"dtype": "fp32", "global_batch_size": 256})
    made = plan(cluster, model, training)
    assert {stage.group for p in made.strategy.pipelines for stage in p.stages} <= {"h100", "mi300x"}
    assert made.search_stats["idle_note"] == (
        "ascend, gaudi2 (128 devices) left idle: ascend-910b has no published fp32 peak; gaudi2 has no published fp32 "
        "peak; in bf16 every group can train (--dtype bf16)"
    )
    with pytest.raises(SpecError, match="ascend-910b has no published fp32 peak: train in bf16 \\(--dtype bf16\\)"):
        plan(cluster.only(cluster.group("ascend")), model, training)


def test_an_engine_without_fp16_trains_in_bf16_where_the_devices_have_it_when_that_is_faster():
    """torchtitan has no fp16: on A100s beside V100s the unchosen dtype was fp16 and became fp32 everywhere (51.8 s
    for GPT-3 6.7B); bf16 on the A100s alone, the V100s idle, is searched too and is eight times faster. Chosen, the
    dtype stays."""
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_model("gpt3-6.7b")
    training = load_training(overrides={"global_batch_size": 256})
    made = plan(cluster, model, training, engine="torchtitan")
    fp32 = plan(
        cluster, model, load_training(overrides={"global_batch_size": 256, "dtype": "fp32"}), engine="torchtitan"
    )
    assert made.context.training.dtype == "bf16" and fp32.context.training.dtype == "fp32"
    assert made.evaluation.iteration_time_s < fp32.evaluation.iteration_time_s / 4
    assert made.search_stats["training_note"] == (
        "training in bf16 on the groups that have it (torchtitan has no fp16 mixed precision; fp32 on every group: "
        f"{fp32.evaluation.iteration_time_s:.3f} s); set dtype or --dtype to choose"
    )
    assert not any("fp16 -> fp32" in change for change in made.search_stats["engine_changes"])
    assert "in fp32 every group can train (--dtype fp32)" in made.search_stats["idle_note"]


def test_plan_equals_exhaustive_search_on_a_small_heterogeneous_cluster():
    """Two device types, 8 devices, 12 layers: every group order, TP per group, replica count, stage count per group
    (not only the largest), micro-batch, recompute, interleaving and every composition of the layers into stages,
    evaluated with the full cost model, is no faster than the plan. Compositions are screened with the pipeline
    objective (a lower bound on the iteration time), so only those that could beat the incumbent are evaluated."""
    import itertools

    import numpy as np

    from planner import predict
    from predictor.cost_model import decoder_layer_time_s, edge_time_s
    from specs.layout import PipelineStrategy, StageStrategy, Strategy

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    small = tuple(dataclasses.replace(g, nodes=1, devices_per_node=4) for g in cluster.groups)
    cluster = dataclasses.replace(cluster, groups=small)
    model = load_model("gpt3-1.7b").model_copy(update={"num_layers": 12})
    training = load_training(
        None,
        {
            "dtype": "fp16",
            "global_batch_size": 16,
            "micro_batch_sizes": [1, 2],
            "recompute": ["none", "full"],
            "virtual_stages": [1, 2],
        },
    )
    result = plan(cluster, model, training)
    best, ctx = result.evaluation.iteration_time_s, result.context
    layers = model.num_layers
    compositions = {
        p: np.array([np.diff((0, *cuts, layers)) for cuts in itertools.combinations(range(1, layers), p - 1)])
        for p in range(1, 9)
    }
    incumbent = np.inf
    evaluated = screened = 0
    groups = cluster.groups
    for order in [(0,), (1,), (0, 1), (1, 0)]:
        chosen = [groups[i] for i in order]
        for tps in itertools.product(*[[1, 2, 4]] * len(chosen)):
            for dp in (1, 2, 4):
                ranges = [range(1, g.num_devices // (t * dp) + 1) for g, t in zip(chosen, tps)]
                for counts in itertools.product(*ranges):
                    stage_groups = [(g, t) for g, t, c in zip(chosen, tps, counts) for _ in range(c)]
                    p = len(stage_groups)
                    for b, recompute, v in itertools.product((1, 2), ("none", "full"), (1, 2)):
                        if 16 % (dp * b) or p > layers or (v > 1 and p == 1):
                            continue
                        m = 16 // (dp * b)
                        a = np.array([decoder_layer_time_s(ctx, g, b, t, recompute) for g, t in stage_groups])
                        e = np.array(
                            [edge_time_s(ctx, g, b, t, i == 0, i == p - 1) for i, (g, t) in enumerate(stage_groups)]
                        )
                        splits = compositions[p][np.all(compositions[p] >= v, axis=1)]
                        times = splits * a + e
                        objective = (m - 1 / v) * times.max(axis=1) + times.sum(axis=1) / v
                        screened += len(splits)
                        for split in splits[objective < incumbent * (1 - 1e-12)]:
                            offsets: dict[str, int] = {}
                            stages, start = [], 0
                            for (g, t), n in zip(stage_groups, split):
                                stages.append(StageStrategy(g.name, start, start + int(n), t, offsets.get(g.name, 0)))
                                offsets[g.name] = offsets.get(g.name, 0) + t * dp
                                start += int(n)
                            strategy = Strategy((PipelineStrategy(dp, b, m, tuple(stages)),), recompute, 1, v)
                            evaluation = predict(ctx, strategy)
                            evaluated += 1
                            if evaluation.fits:
                                incumbent = min(incumbent, evaluation.iteration_time_s)
    assert screened > 50_000 and evaluated > 10
    assert best == pytest.approx(incumbent, rel=1e-9)


def test_root_bound_is_below_every_plan_including_per_stage_recompute():
    """The reported lower bound holds over the whole space the search reports on, per-stage recompute plans
    included: every group order, TP, replicas, stage counts, layer split and recompute mode per stage of a small
    memory-tight instance (per-stage recompute beats one mode everywhere there), evaluated with the cost model."""
    import itertools

    import numpy as np

    from planner import build_context, predict
    from planner.search import SearchOptions, search
    from specs.layout import PipelineStrategy, StageStrategy, Strategy

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    tight = {"memory_GB": 10}  # so that the early stages cannot hold their activations without recompute
    small = tuple(
        dataclasses.replace(g, nodes=1, devices_per_node=2, device=g.device.model_copy(update=tight))
        for g in cluster.groups
    )
    cluster = dataclasses.replace(cluster, groups=small)
    model = load_model("gpt3-6.7b").model_copy(update={"num_layers": 6})
    modes = ("none", "full")
    training = load_training(
        None,
        {
            "dtype": "fp16",
            "global_batch_size": 16,
            "micro_batch_sizes": [4],
            "recompute": list(modes),
            "virtual_stages": [1],
        },
    )
    ctx = build_context(cluster, model, training)
    result = search(ctx, SearchOptions(root_bound=True))
    layers, groups = model.num_layers, cluster.groups
    best_uniform = best_any = np.inf
    for order in [(0,), (1,), (0, 1), (1, 0)]:
        chosen = [groups[i] for i in order]
        for tps in itertools.product(*[[1, 2]] * len(chosen)):
            for dp in (1, 2):
                ranges = [range(1, g.num_devices // (t * dp) + 1) for g, t in zip(chosen, tps)]
                for counts in itertools.product(*ranges):
                    stage_groups = [(g, t) for g, t, c in zip(chosen, tps, counts) for _ in range(c)]
                    p, m = len(stage_groups), 16 // (dp * 4)
                    for per_stage in itertools.product(range(2), repeat=p):
                        for cuts in itertools.combinations(range(1, layers), p - 1):
                            offsets: dict[str, int] = {}
                            stages, start = [], 0
                            for (g, t), end, mode in zip(stage_groups, (*cuts, layers), per_stage):
                                offset = offsets.get(g.name, 0)
                                stages.append(StageStrategy(g.name, start, end, t, offset, modes[mode]))
                                offsets[g.name] = offset + t * dp
                                start = end
                            strategy = Strategy((PipelineStrategy(dp, 4, m, tuple(stages)),), "none", 1, 1)
                            evaluation = predict(ctx, strategy)
                            if evaluation.fits:
                                best_any = min(best_any, evaluation.iteration_time_s)
                                if len(set(per_stage)) == 1:
                                    best_uniform = min(best_uniform, evaluation.iteration_time_s)
    assert best_any < best_uniform  # per-stage recompute pays on this instance
    assert result.evaluations[0].iteration_time_s >= best_any * (1 - 1e-9)
    assert 0.5 * best_any < result.lower_bound_s <= best_any


def test_the_search_finds_per_stage_recompute_shapes_whose_every_uniform_plan_loses(tmp_path):
    """Llama-3 70B on one node of 8 MI300X at ZeRO-3, batch 128 (the shipped predictor, as `hetplan plan` runs it): 2
    replicas of one stage recomputing selectively took 139.852 s; 2 stages on TP 4 did not fit without recompute and
    lost with it everywhere (142.563 s), so the scan never reached the shape, and the per-stage step only re-solved
    the shapes the scan had evaluated. With one stage recomputing they take 139.316 s. The plan must be at least as
    fast as every split and recompute mode per stage of that shape."""
    import itertools

    from planner import predict
    from specs.layout import PipelineStrategy, StageStrategy, Strategy

    path = tmp_path / "mi300x-8.yaml"
    path.write_text(
        "name: mi300x-8\ngroups:\n  - name: mi300x\n    device: mi300x\n    nodes: 1\n    devices_per_node: 8\n"
        "    nics_per_node: 8\n    nic_gbps: 400\n"
    )
    cluster, model = load_cluster(path), load_model("llama3-70b")
    training = load_training(None, {"global_batch_size": 128, "zero_stage": 3})
    found = plan(cluster, model, training)
    layers, modes = model.num_layers, training.recompute
    uniform, mixed = math.inf, math.inf
    for cut in range(1, layers):
        for first, second in itertools.product(modes, repeat=2):
            stages = (StageStrategy("mi300x", 0, cut, 4, 0, first), StageStrategy("mi300x", cut, layers, 4, 4, second))
            strategy = Strategy((PipelineStrategy(1, 1, 128, stages),), "none", 3)
            evaluation = predict(found.context, strategy)
            if evaluation.fits:
                if first == second:
                    uniform = min(uniform, evaluation.iteration_time_s)
                else:
                    mixed = min(mixed, evaluation.iteration_time_s)
    assert mixed < 139.5 < uniform  # the shape wins only with a recompute mode per stage
    assert found.evaluation.iteration_time_s <= mixed * (1 + 1e-9)
    assert found.strategy.recompute_summary.startswith("per-stage")


def test_per_stage_recompute_round_trips_through_the_plan_file(tmp_path):

    from planner import predict
    from planner.plan import load_plan

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    training = load_training(None, {"dtype": "fp16", "global_batch_size": 256})
    result = plan(cluster, load_model("gpt3-6.7b"), training)
    pipeline = result.strategy.pipelines[0]
    stages = (dataclasses.replace(pipeline.stages[0], recompute="full"), *pipeline.stages[1:])
    strategy = dataclasses.replace(
        result.strategy, recompute="none", pipelines=(dataclasses.replace(pipeline, stages=stages),)
    )
    evaluation = predict(result.context, strategy)
    assert evaluation.stages[0].compute_time_s > result.evaluation.stages[0].compute_time_s  # recompute costs time
    assert evaluation.stages[0].memory.activation_bytes < result.evaluation.stages[0].memory.activation_bytes
    path = tmp_path / "mixed.plan.json"
    dataclasses.replace(result, evaluation=evaluation).save(path)
    body = json.loads(path.read_text())
    assert [s["recompute"] for s in body["pipelines"][0]["stages"]][:1] == ["full"]
    assert body["recompute_summary"].startswith("per-stage (full x1, none x")
    assert load_plan(path).strategy == strategy


def test_zero1_dominates_zero0_in_the_cost_model_so_the_search_keeps_the_training_stage(hethub_plan):
    """The search does not branch on the ZeRO stage: under the cost model stage 1 is never slower and never needs
    more memory than stage 0 (optimizer state / dp, 6 instead of 8 bytes of DP traffic per parameter, the optimizer
    step on 1/dp of the parameters): the searched plan's layout and a pinned ZeRO-0 search both say so."""
    ctx = hethub_plan.context
    zero0 = evaluate(ctx, dataclasses.replace(hethub_plan.strategy, zero_stage=0))
    zero1 = evaluate(ctx, dataclasses.replace(hethub_plan.strategy, zero_stage=1))
    assert zero1.iteration_time_s < zero0.iteration_time_s
    assert all(one.memory.total_bytes < zero.memory.total_bytes for one, zero in zip(zero1.stages, zero0.stages))
    pinned = plan(ctx.cluster, ctx.model, ctx.training.model_copy(update={"zero_stage": 0}))
    assert pinned.strategy.zero_stage == 0
    assert pinned.evaluation.iteration_time_s > hethub_plan.evaluation.iteration_time_s


def test_a_larger_search_budget_never_finds_a_slower_plan():
    """H100 + MI300X / Llama-3-70B (the shipped predictor, as `hetplan plan` runs it): the search stopped at its first
    candidate returned 9 stages with one recomputing (87.04 s), the full search 5 stages at 87.47 s: the per-stage
    recompute step re-solved only the best candidate, whose uniform plan had beaten that one's (recomputing on every
    stage). Here the full search must match every budget's plan."""
    from predictor.predictor import default_predictor

    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    training = load_training(None, {"global_batch_size": 1024, "dtype": "bf16"})
    predictor = default_predictor()
    budgets = (1, 2, 2_000)
    found = [plan(cluster, model, training, predictor=predictor, max_candidates=k).evaluation for k in budgets]
    times = [evaluation.iteration_time_s for evaluation in found]
    assert times[-1] <= min(times) * (1 + 1e-9), dict(zip(budgets, times, strict=True))
    assert found[-1].strategy.recompute_summary.startswith("per-stage")


def test_python_plan_trains_on_the_clusters_devices_as_the_cli_does():
    """plan() without a dtype: fp16 where a group has no bf16, fp32 on CPU devices, each with its note in the search
    statistics (it planned bf16 on CPUs, and refused the bundled A100 + V100 example); a chosen dtype stays."""
    a100_v100 = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    made = plan(a100_v100, load_model("gpt3-1.7b"), load_training(overrides={"global_batch_size": 32}))
    assert made.context.training.dtype == "fp16" and "v100 has no bf16" in made.search_stats["training_note"]
    cpu = plan(
        load_cluster(EXAMPLES / "cpu-2x2.yaml"),
        load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")),
        load_training(overrides={"global_batch_size": 8}),
    )
    assert cpu.context.training.dtype == "fp32" and "on cpu devices" in cpu.search_stats["training_note"]
    chosen = load_training(overrides={"global_batch_size": 8, "dtype": "bf16"})
    kept = plan(
        load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")), chosen
    )
    assert kept.context.training.dtype == "bf16" and "training_note" not in kept.search_stats
    assert "model_notes" not in kept.search_stats  # a model file: nothing taken from a config.json


def test_python_plan_says_what_a_config_json_decided_as_the_cli_does(tmp_path):
    """plan() of a Mistral-style config.json trained at its longest context with full attention, the notes `hetplan
    plan` prints on stderr nowhere in the result (a newcomer's launcher)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
        "sliding_window": 256,
    }))  # fmt: skip
    cluster = load_cluster(EXAMPLES / "cpu-2x2.yaml")
    made = plan(cluster, load_model(str(config)), load_training(overrides={"global_batch_size": 8, "dtype": "fp32"}))
    sequence, window = made.search_stats["model_notes"]
    assert sequence.startswith(f"sequences of 1024 tokens, the longest context of {config}")
    assert (
        window == f"{config} sets what hetplan does not model: a sliding attention window of 256 tokens "
        "(attention costed over whole sequences)"
    )


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"zero_stages": [5]}, "plan(): zero_stages: expected ZeRO stages among 0, 1, 2, 3, got 5"),
        ({"zero_stages": [-1]}, "plan(): zero_stages: expected ZeRO stages among 0, 1, 2, 3, got -1"),
        ({"zero_shards": ["rack"]}, "plan(): zero_shards: expected some of dp, node, got 'rack'"),
        # a number was iterated (TypeError), a string letter by letter ('n' is no ZeRO shard), a number called
        ({"zero_stages": 3}, "plan(): zero_stages: expected a list of ZeRO stages among 0, 1, 2, 3 (e.g. [1, 3]), got"),
        ({"zero_shards": "node"}, "plan(): zero_shards: expected a list of ZeRO shards among dp, node, got str 'node'"),
        ({"progress": 42}, "plan(): progress: expected a function of the search's progress, or None, got int 42"),
        ({"top_k": 0}, "plan(): top_k: expected a whole number >= 1, got 0"),
        ({"max_candidates": 0}, "plan(): max_candidates: expected a whole number >= 1, got 0"),
        ({"engine": "megatron-lm"}, "plan(): engine: unknown engine 'megatron-lm'"),
        (
            {"cluster": "examples/cpu-2x2.yaml"},
            "plan(): cluster: expected a ClusterSpec: specs.load_cluster(path), got str",
        ),
        ({"training": None}, "plan(): training: expected a TrainingSpec: specs.load_training(path or None, overrides)"),
        # read as mappings and predictors deep inside ('str' object has no attribute 'get' / 'base_context')
        ({"profiles": ["cpu.json"]}, "plan(): profiles: expected a directory of profile files, or profiler.profiles"),
        ({"profiles": {"cpu": "cpu.json"}}, "plan(): profiles: expected a directory of profile files, or profil"),
        ({"profiles": "no-such-dir"}, "no-such-dir"),
        ({"predictor": 3}, "plan(): predictor: expected a predictor file, or load_predictor(path), got int 3"),
    ],
)
def test_python_plan_names_an_argument_it_cannot_take(arguments, expected):
    """Each in one line, before any work (zero_stages=[5] planned a 'zero-5' that its own loader refused)."""
    given = {
        "cluster": load_cluster(EXAMPLES / "cpu-2x2.yaml"),
        "model": load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")),
        "training": load_training(overrides={"global_batch_size": 8}),
        **arguments,
    }
    with pytest.raises(SpecError) as caught:
        plan(**given)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)


def test_python_plan_reads_a_profiles_directory_and_a_predictor_file_as_the_cli_does(tmp_path):
    """plan(profiles="prof") and plan(predictor="p.joblib") failed deep inside; they are what `hetplan plan --profiles
    DIR --predictor FILE` takes, so they are read the same way (the plan records the files)."""
    from predictor.predictor import default_predictor, save_predictor

    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "cpu.json").write_text(
        (ROOT / "bench" / "results" / "profile-cpu-tiny-llama.json").read_text()
    )
    save_predictor(default_predictor(), tmp_path / "p.joblib")
    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    training = load_training(overrides={"global_batch_size": 8, "seq_length": 256})
    made = plan(cluster, model, training, profiles=tmp_path / "prof", predictor=str(tmp_path / "p.joblib"))
    recorded = made.context.cost_source
    assert [entry["device"] for entry in recorded["profiles"]] == ["cpu"]
    assert recorded["predictor"]["kind"] == "file" and recorded["predictor"]["path"] == str(tmp_path / "p.joblib")


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: load_cluster(5), "load_cluster(): path: expected a path of a cluster YAML/JSON file, or its mapping"),
        (lambda: load_model(3), "load_model(): name_or_path: expected a catalog name, a path of a model YAML/JSON"),
        (lambda: load_training(overrides=[1]), "load_training(): overrides: expected a mapping of training fields"),
        (lambda: load_training(7), "load_training(): path: expected a path of a training YAML/JSON file"),
        (lambda: _api("predict", None, "strategy"), "predict(): ctx: expected a CostContext"),
        (lambda: _api("predict", "ctx", "loaded"), "predict(): strategy: expected a Strategy (a loaded plan's or a"),
        (lambda: _api("build_context", "examples/cpu-2x2.yaml"), "build_context(): cluster: expected a ClusterSpec"),
        (lambda: _api("export_plan", "ctx", "strategy", None), "export_plan(): fmt: expected an engine name"),
        (lambda: _api("export_plan", "ctx", "strategy", "megatorn"), "export_plan(): fmt: unknown engine 'megatorn'"),
        (lambda: _api("fit_predictor", "prof"), "fit_predictor(): profile_paths: expected a list of files"),
        (lambda: _api("load_plan", None), "load_plan(): path: expected a path of a plan JSON file"),
        (lambda: _api("compute_bounds", "cluster"), "compute_bounds(): ctx: expected a CostContext: a plan's .context"),
        (lambda: _api("changed_cluster", "examples/cpu-2x2.yaml", [], []), "changed_cluster(): cluster: expected a "),
        (
            lambda: _api("changed_cluster", "cluster", "group:cpu:1", []),  # read letter by letter: 'g' is no change
            "changed_cluster(): without: expected a list of node:GROUP/NUMBER or group:NAME:COUNT, got str 'group:c",
        ),
        (lambda: _api("interval", "cluster", "strategy"), "Predictor.interval(): base: expected an uncalibrated "),
        (lambda: _api("interval", "base", "loaded"), "Predictor.interval(): strategy: expected a Strategy"),
        (
            lambda: _api("export_plan", "ctx", "strategy", "megatron", "no"),
            "export_plan(): keep_layout: expected True or False, got str 'no'",
        ),
        (
            lambda: _api("export_plan", "ctx", "strategy", "megatron", False, "ctx"),
            "export_plan(): context_for: expected a function of a TrainingSpec returning its CostContext",
        ),
        (lambda: _api("save", 42), "Plan.save(): path: expected a path of the plan JSON file to write, got int 42"),
        (lambda: _api("load_predictor", 42), "load_predictor(): path: expected a path of a predictor file"),
        (lambda: _api("save_predictor", "predictor", 42), "save_predictor(): path: expected a path of the predictor"),
        (lambda: _api("get_device", 42), "get_device(): name: expected a device name, got int 42"),
        (lambda: _api("get_engine", None), "get_engine(): name: expected an engine name, got NoneType None"),
        (lambda: _api("get_engine", "megatorn"), "get_engine(): name: unknown engine 'megatorn'; expected one of: "),
        (lambda: _api("get_vendor", "acme"), "get_vendor(): name: unknown vendor 'acme'; expected one of: "),
        (lambda: _api("fit_predictor", 3), "fit_predictor(): profile_paths: expected a list of files"),  # TypeError
        (lambda: _api("changed_cluster", "cluster", [3], []), "changed_cluster(): without: expected node:GROUP/NUMBE"),
    ],
)
def test_the_python_api_names_an_argument_it_cannot_take(call, expected):
    """Each was a traceback from deep inside: 'LoadedPlan' object has no attribute 'recompute', 'str' object has no
    attribute 'groups', 'NoneType' object has no attribute 'strip', pathlib's TypeError, a path read letter by letter
    ('.: expected a file, got a directory'), and `--format: unknown engine` from Python."""
    with pytest.raises(SpecError) as caught:
        call()
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)


def _api(name: str, *arguments: object) -> object:
    """Call a Python API function with placeholders filled in: "ctx" a context, "strategy" a plan's strategy,
    "loaded" a LoadedPlan (the usual mistake: a loaded plan where its strategy is meant), "cluster" the cluster,
    "base" an uncalibrated context, "predictor" the shipped predictor."""
    from planner import build_context, compute_bounds, load_plan, predict
    from planner.export import export_plan
    from planner.replan import changed_cluster
    from predictor.predictor import default_predictor, fit_predictor, load_predictor, save_predictor
    from specs import get_device, get_engine, get_vendor

    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    made = plan(cluster, model, load_training(overrides={"global_batch_size": 8}))
    loaded = SimpleNamespace(strategy=made.strategy)  # stands for a LoadedPlan: anything but a Strategy
    predictor = default_predictor()
    base = predictor.base_context(cluster, model, made.context.training)
    fill = {"ctx": made.context, "strategy": made.strategy, "loaded": loaded, "cluster": cluster, "base": base,
            "predictor": predictor}  # fmt: skip
    given = [fill.get(a, a) if isinstance(a, str) else a for a in arguments]
    functions = {"predict": predict, "build_context": build_context, "export_plan": export_plan,
                 "fit_predictor": fit_predictor, "load_plan": load_plan, "compute_bounds": compute_bounds,
                 "changed_cluster": changed_cluster, "interval": predictor.interval, "save": made.save,
                 "load_predictor": load_predictor, "save_predictor": save_predictor, "get_device": get_device,
                 "get_engine": get_engine, "get_vendor": get_vendor}  # fmt: skip
    if name == "build_context":
        return build_context(given[0], model, made.context.training)
    return functions[name](*given)


def test_micro_batches_larger_than_the_global_batch_are_named_where_a_search_would_use_them(capsys, tmp_path):
    """Every allowed micro-batch over the global batch left no plan, said as 'the global batch 256 must split into
    replicas x micro-batches' after a search. A given layout (predict's flags) uses its own micro-batch: its training
    may allow any."""
    from planner import build_context, predict
    from specs.layout import megatron_strategy

    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    training = load_training(None, {"global_batch_size": 4, "micro_batch_sizes": [8, 16], "dtype": "fp32"})
    with pytest.raises(SpecError) as caught:
        plan(cluster, model, training)
    assert str(caught.value) == (
        "plan(): training.micro_batch_sizes: the micro-batch sizes [8, 16] are all larger than the global batch (4 "
        "sequences), which no plan can then split: allow a micro-batch of at most the batch, or train a larger batch"
    )
    strategy = megatron_strategy(
        cluster, model, training, group=None, tp=1, pp=1, dp=4, micro_batch_size=1, recompute="none"
    )
    assert predict(build_context(cluster, model, training), strategy).iteration_time_s > 0


def test_python_plan_searches_the_zero_stages_of_any_iterable():
    """The argument check read a generator of ZeRO stages to its end, and the search then had none (the training's
    stage alone was searched, without a word)."""
    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    made = plan(cluster, model, load_training(overrides={"global_batch_size": 8}), zero_stages=(s for s in (0, 3)))
    assert sorted(made.search_stats["zero_stages_s"]) == ["0", "3"]


def test_a_plan_saves_to_and_loads_from_any_path_like(tmp_path):
    """Plan.save took a str or a Path alone after its argument check (pytest's tmpdir, any os.PathLike, worked
    before it)."""
    from planner import load_plan

    class Where:  # an os.PathLike that is not a pathlib.Path
        def __fspath__(self) -> str:
            return str(tmp_path / "plan.json")

    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    made = plan(cluster, model, load_training(overrides={"global_batch_size": 8}))
    made.save(Where())
    assert load_plan(Where()).strategy == made.strategy


def test_python_plan_takes_an_engine_by_name():
    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    made = plan(cluster, model, load_training(overrides={"global_batch_size": 8}), engine="Megatron")
    assert made.search_stats["engine"] == "megatron"


def test_a_model_that_does_not_fit_is_advised_only_what_the_training_does_not_allow():
    """The library's message named 'allow full recompute or ZeRO-1' when both were allowed (the defaults); the CLI
    rewrote it, Python callers got it as it was. Where the state alone exceeds all the memory there is, sharding
    cannot help and only devices are advised (it advised ZeRO-3, which left the shortfall as it was)."""

    def with_memory(memory_gb: float) -> ClusterSpec:
        cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
        devices = [
            dataclasses.replace(g, device=g.device.model_copy(update={"memory_GB": memory_gb})) for g in cluster.groups
        ]
        return dataclasses.replace(cluster, groups=tuple(devices))

    training = load_training(overrides={"global_batch_size": 8, "dtype": "fp16"})
    with pytest.raises(DoesNotFitError) as caught:
        plan(with_memory(5.0), load_model("llama3-8b"), training)  # 135 GiB of state in 32 x 4.5 GiB usable
    message = str(caught.value)
    assert "allow full recompute or ZeRO-1" not in message and "allow full recompute (" not in message
    assert message.endswith(
        "add devices, shard gradients and weights too (--zero-stage 3) or shorten the sequence (--seq-len)"
    )
    with pytest.raises(DoesNotFitError) as caught:
        plan(with_memory(1.0), load_model("llama3-8b"), training)
    assert str(caught.value).endswith("optimizer state alone (135 GiB) need 3.3 GiB more per device than the 29 GiB "
                                      "usable in all; add devices")  # fmt: skip


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"recompute": "bogus"}, "strategy: recompute: expected one of none, selective, full, got 'bogus'"),
        ({"zero_stage": 7}, "strategy: zero_stage: expected one of 0, 1, 2, 3, got 7"),
        ({"virtual_stages": 0}, "strategy: virtual_stages: expected a whole number >= 1, got 0"),
        ({"tp": "8"}, "strategy: pipelines[0].stages[0].tp: expected a whole number >= 1, got '8'"),
        ({"stage_recompute": "most"}, "strategy: pipelines[0].stages[0].recompute: expected one of none, selective"),
        # Strategy(pipeline) without its tuple was iterated field by field: a TypeError
        ({"pipelines": "untupled"}, "strategy: pipelines: expected a tuple of PipelineStrategy, got PipelineStrategy("),
        ({"stages": "untupled"}, "strategy: pipelines[0].stages: expected a tuple of StageStrategy, got StageStrat"),
    ],
)
def test_predict_names_a_hand_built_strategys_value_no_plan_file_could_hold(change, expected):
    """A Strategy built in Python is a plain dataclass: recompute 'bogus' was evaluated as 'none', ZeRO-7 as sharded."""
    from planner import predict
    from predictor.cost_model import build_context
    from specs.layout import PipelineStrategy, StageStrategy, Strategy

    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    ctx = build_context(cluster, model, load_training(overrides={"global_batch_size": 8, "dtype": "fp32"}))
    group = cluster.groups[0].name
    stage = StageStrategy(group, 0, model.num_layers, change.get("tp", 1), 0, change.get("stage_recompute"))
    strategy = Strategy((PipelineStrategy(1, 1, 8, (stage,)),), "none", 1)
    fields = {k: v for k, v in change.items() if k in ("recompute", "zero_stage", "virtual_stages")}
    if "pipelines" in change:
        fields["pipelines"] = strategy.pipelines[0]
    if "stages" in change:
        fields["pipelines"] = (dataclasses.replace(strategy.pipelines[0], stages=stage),)
    with pytest.raises(SpecError) as caught:
        predict(ctx, dataclasses.replace(strategy, **fields))
    assert str(caught.value).startswith(expected)


def test_the_readmes_python_api_runs_as_written(tmp_path, monkeypatch):
    """The README's Python API block, run as a user pastes it (from the repository, writing plan.json beside it):
    the what-if of the plan's own strategy in the plan's context gives the plan's time."""
    from tests.conftest import ROOT

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Python API") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("```\n", start)]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the block's relative paths
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    result, evaluation = namespace["result"], namespace["evaluation"]
    assert evaluation.iteration_time_s == pytest.approx(result.evaluation.iteration_time_s)  # type: ignore[attr-defined]
    assert (tmp_path / "plan.json").exists() and "launch.sh" in namespace["exported"].files  # type: ignore[attr-defined]


def test_a_plan_saved_from_python_creates_its_directory_and_names_a_path_it_cannot_write(tmp_path):
    cluster = load_cluster(EXAMPLES / "cpu-2x2.yaml")
    made = plan(
        cluster,
        load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")),
        load_training(overrides={"global_batch_size": 8}),
    )
    made.save(tmp_path / "new" / "sub" / "plan.json")
    assert (tmp_path / "new" / "sub" / "plan.json").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecError, match=r"^Plan.save: .*file/plan.json: .*file is a file, not a directory$"):
        made.save(tmp_path / "file" / "plan.json")


def test_numpy_integers_are_whole_numbers_and_a_float_is_not_a_zero_stage(tmp_path):
    """A launcher's numbers often come from numpy: np.int64 replicas and top_k ran before the value checks and must
    still; a float ZeRO stage (1.0 == 1) planned a plan its own loader refused."""
    import numpy as np

    from planner import predict
    from planner.plan import load_plan
    from specs.layout import PipelineStrategy, StageStrategy, Strategy

    cluster, model = load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(EXAMPLES / "models" / "tiny-llama.yaml")
    training = load_training(overrides={"global_batch_size": 8, "dtype": "fp32"})
    made = plan(cluster, model, training, top_k=np.int64(2), zero_stages=np.array([0, 1]))
    made.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").strategy == made.strategy
    stage = StageStrategy(cluster.groups[0].name, 0, np.int64(model.num_layers), np.int64(1), 0)
    strategy = Strategy((PipelineStrategy(np.int64(1), 1, 8, (stage,)),), "none", np.int64(1))
    assert predict(made.context, strategy).iteration_time_s > 0
    with pytest.raises(SpecError, match=r"^plan\(\): zero_stages: expected ZeRO stages among 0, 1, 2, 3, got 1\.0$"):
        plan(cluster, model, training, zero_stages=(1.0,))
    with pytest.raises(SpecError, match=r"^strategy: zero_stage: expected one of 0, 1, 2, 3, got 1\.0$"):
        predict(made.context, dataclasses.replace(strategy, zero_stage=1.0))


def test_an_engine_without_fp16_searches_bf16_only_where_a_group_has_it_and_fp32_where_groups_can_be_timed():
    """The bf16 alternative is searched only where some group has bf16 (on V100s alone it refused the plan: 'v100 has
    no bf16'), and a dtype some group cannot be timed in (Gaudi2 publishes no fp32 peak) is planned on the others
    (it was refused for the whole cluster: 'cannot be planned'), its time named beside the faster plan's."""
    from specs.cluster import ClusterFile, resolve_cluster

    def cluster_of(*devices: str):
        groups = [{"name": d, "device": d, "nodes": 1, "devices_per_node": 8, "nics_per_node": 4, "nic_gbps": 100}
                  for d in devices]  # fmt: skip
        network = {"topology": "clos", "inter_group_gbps": 100}
        return resolve_cluster(ClusterFile.model_validate({"name": "c", "groups": groups, "network": network}), "c")

    model, training = load_model("gpt3-1.7b"), load_training(overrides={"global_batch_size": 64})
    v100 = plan(cluster_of("v100"), model, training, engine="torchtitan")
    assert v100.context.training.dtype == "fp32" and "idle_note" not in v100.search_stats
    mixed = plan(cluster_of("gaudi2", "v100"), model, training, engine="torchtitan")
    assert mixed.context.training.dtype == "bf16"
    note = mixed.search_stats["training_note"]
    assert note.startswith("training in bf16 on the groups that have it (torchtitan has no fp16 mixed precision; fp32")
    assert "fp32 on the groups that have it: " in note and "cannot be planned" not in note
