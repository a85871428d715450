"""Several pipeline families: groups split into blocks, each block its own pipelines and share of the batch."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from itertools import pairwise

import pytest
import yaml

from planner import build_context, load_plan, plan, predict
from planner.export import export_plan
from planner.families import _block_context, _block_plans, _BlockPlan, combine, partitions, split_batch_across
from planner.search import SearchOptions, search
from predictor.cost_model import GRAD_BYTES_PER_PARAM, evaluate, stage_params
from predictor.evaluation import Evaluation
from predictor.schedule import bottleneck_words, pipeline_timeline, stage_label
from predictor.traffic import strategy_traffic
from specs import load_cluster, load_model, load_training
from specs.cluster import ClusterFile, ClusterSpec, resolve_cluster
from specs.errors import SpecError
from specs.layout import Axis, PipelineStrategy, StageStrategy, Strategy
from tests.conftest import EXAMPLES, hetplan

BATCH = 64


CLUSTER_YAML = """
name: a100-v100
groups:
  - {{name: a100-80gb, device: a100-80gb, nodes: 3, devices_per_node: 8, nics_per_node: 8, nic_gbps: 200}}
  - {{name: v100, device: v100, nodes: 1, devices_per_node: 8, nics_per_node: 8, nic_gbps: 200}}
network: {{topology: rail-optimized, inter_group_gbps: {inter_group_gbps}}}
"""


def _a100_and_v100(inter_group_gbps: float = 200) -> ClusterSpec:
    """3 A100 nodes and 1 V100 node: one family must give every replica the same mix, so the V100s either slow
    every replica down or sit idle."""
    text = CLUSTER_YAML.format(inter_group_gbps=inter_group_gbps)
    return resolve_cluster(ClusterFile.model_validate(yaml.safe_load(text)), "test cluster")


def _training(families: str = "search"):
    return load_training(None, {"global_batch_size": BATCH, "dtype": "fp16", "families": families})


@pytest.fixture(scope="module")
def family_plan():
    return plan(_a100_and_v100(), load_model("gpt3-1.7b"), _training())


def test_partitions_are_every_set_partition_once():
    for n, bell in zip(range(1, 6), (1, 2, 5, 15, 52)):
        found = [tuple(sorted(tuple(sorted(block)) for block in p)) for p in partitions(list(range(n)))]
        assert len(found) == bell == len(set(found))
        assert all(sorted(x for block in p for x in block) == list(range(n)) for p in found)


def _brute_force_split(batch: int, blocks: list[list[_BlockPlan]]) -> float:
    best = float("inf")
    for picks in itertools.product(*[range(len(plans)) for plans in blocks]):
        chosen = [blocks[f][i] for f, i in enumerate(picks)]
        depths = {p.virtual_stages for p in chosen if p.virtual_stages}
        if len(depths) > 1:
            continue
        ranges = [range(p.replicas, batch // p.micro_batch_size + 1) for p in chosen]
        for totals in itertools.product(*ranges):
            if sum(p.micro_batch_size * n for p, n in zip(chosen, totals)) != batch:
                continue
            q = [-(-n // p.replicas) for p, n in zip(chosen, totals)]
            if any(qi > p.max_microbatches for qi, p in zip(q, chosen)):
                continue
            best = min(best, max(p.per_microbatch_s * qi + p.fixed_s for p, qi in zip(chosen, q)))
    return best


def test_the_batch_split_across_families_is_exact():
    """Random small instances: the subset-sum bisection equals brute force over every plan choice and total."""
    rng = random.Random(7)
    for _ in range(60):
        batch = rng.randint(4, 30)
        blocks = [
            [
                _BlockPlan(
                    evaluation=None,  # type: ignore[arg-type]  # the split does not look at it
                    replicas=rng.randint(1, 4),
                    micro_batch_size=rng.choice((1, 2, 3)),
                    per_microbatch_s=rng.uniform(0.5, 3.0),
                    fixed_s=rng.uniform(0.0, 5.0),
                    max_microbatches=rng.choice((2, 3, 1 << 30)),
                    virtual_stages=rng.choice((0, 1, 2)),
                )
                for _ in range(rng.randint(1, 3))
            ]
            for _ in range(rng.randint(2, 3))
        ]
        expected = _brute_force_split(batch, blocks)
        split = split_batch_across(batch, blocks)
        if expected == float("inf"):
            assert split is None
            continue
        assert split is not None
        picked, totals = split
        chosen = [blocks[f][i] for f, i in enumerate(picked)]
        assert sum(p.micro_batch_size * n for p, n in zip(chosen, totals)) == batch
        assert all(n >= p.replicas for p, n in zip(chosen, totals))
        slowest = max(p.per_microbatch_s * -(-n // p.replicas) + p.fixed_s for p, n in zip(chosen, totals))
        assert slowest == pytest.approx(expected, rel=1e-9)


def test_families_beat_one_family_and_match_every_batch_share(family_plan):
    """The V100s train their own replicas with a small share of the batch instead of slowing every A100 replica;
    the plan equals the best over every share of the batch between the two blocks (each block's best plans at
    that share, every combination, evaluated by the full cost model)."""
    cluster, model = _a100_and_v100(), load_model("gpt3-1.7b")
    one = plan(cluster, model, _training("off"))
    assert len(family_plan.strategy.pipelines) == 2
    assert family_plan.evaluation.iteration_time_s < 0.97 * one.evaluation.iteration_time_s
    ctx = family_plan.context
    a100, v100 = cluster.groups
    best = float("inf")
    compared = 0
    for share in range(1, BATCH):
        first = _block_plans(search(_block_context(ctx, [a100], share), SearchOptions(top_k=3)).evaluations)
        second = _block_plans(search(_block_context(ctx, [v100], BATCH - share), SearchOptions(top_k=3)).evaluations)
        for x, y in itertools.product(first, second):
            if x.virtual_stages and y.virtual_stages and x.virtual_stages != y.virtual_stages:
                continue
            totals = [share // x.micro_batch_size, (BATCH - share) // y.micro_batch_size]
            if totals[0] * x.micro_batch_size != share or totals[1] * y.micro_batch_size != BATCH - share:
                continue
            if totals[0] < x.replicas or totals[1] < y.replicas:
                continue
            evaluation = evaluate(ctx, combine(ctx, [x, y], totals))
            if evaluation.fits:
                compared += 1
                best = min(best, evaluation.iteration_time_s)
    assert compared > 0
    assert family_plan.evaluation.iteration_time_s == pytest.approx(best, rel=1e-9)


def test_a_family_plan_round_trips_and_records_the_shares(family_plan, tmp_path):
    path = tmp_path / "plan.json"
    family_plan.save(path)
    body = json.loads(path.read_text())
    assert sum(p["family_samples"] for p in body["pipelines"]) == BATCH
    weights = [b["replicas"] * b["gradient_weight"] for p in body["pipelines"] for b in p["replica_batches"]]
    assert sum(weights) == pytest.approx(1.0, abs=1e-5)
    loaded = load_plan(path)
    assert loaded.strategy == family_plan.strategy
    again = predict(family_plan.context, loaded.strategy)
    assert again.iteration_time_s == pytest.approx(family_plan.evaluation.iteration_time_s, rel=1e-12)


def _two_families(ctx, a100_samples: int) -> Strategy:
    first = PipelineStrategy(8, 1, a100_samples // 8, (StageStrategy("a100-80gb", 0, 24, 1, 0),))
    second = PipelineStrategy(8, 1, (BATCH - a100_samples) // 8, (StageStrategy("v100", 0, 24, 1, 0),))
    return Strategy((first, second), "none", 1, 1, True)


def test_the_cost_model_waits_for_the_slowest_family_then_syncs_across_families():
    model = load_model("gpt3-1.7b")
    fast = build_context(_a100_and_v100(), model, _training("off"))
    slow = build_context(_a100_and_v100(inter_group_gbps=10), model, _training("off"))
    strategy = _two_families(fast, 48)
    fast.check_strategy(strategy)
    evaluation = evaluate(fast, strategy)
    families = [
        evaluate(fast, dataclasses.replace(strategy, pipelines=(p,))).pipeline_time_s for p in strategy.pipelines
    ]
    assert evaluation.pipeline_time_s == pytest.approx(max(families), rel=1e-12)
    assert {s.family for s in evaluation.stages} == {0, 1}
    # the gradients cross the groups' link: a slower link makes the sync longer, nothing else
    slower = evaluate(slow, strategy)
    assert slower.pipeline_time_s == pytest.approx(evaluation.pipeline_time_s, rel=1e-12)
    assert all(b.dp_sync_time_s > a.dp_sync_time_s for a, b in zip(evaluation.stages, slower.stages))
    # moving samples to the slow family makes it the slowest
    assert evaluate(fast, _two_families(fast, 32)).pipeline_time_s > evaluation.pipeline_time_s


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda p: (p[0], dataclasses.replace(p[1], num_microbatches=3)), "pipelines", "expected the global batch 64"),
        (
            lambda p: (p[0], dataclasses.replace(p[1], stages=(StageStrategy("a100-80gb", 0, 24, 1, 0),))),
            "pipelines",
            "stages overlap on devices of group 'a100-80gb'",
        ),
        (
            lambda p: (p[0], dataclasses.replace(p[1], stages=(StageStrategy("v100", 0, 20, 1, 0),))),
            "pipelines[1].stages",
            "layers cover [0, 20)",
        ),
    ],
)
def test_family_errors_name_the_family_and_field(change, field, words):
    ctx = build_context(_a100_and_v100(), load_model("gpt3-1.7b"), _training("off"))
    strategy = _two_families(ctx, 48)
    broken = dataclasses.replace(strategy, pipelines=change(strategy.pipelines))
    with pytest.raises(SpecError) as error:
        ctx.check_strategy(broken, "plan.json")
    assert f"plan.json: {field}:" in str(error.value) and words in str(error.value)


def test_the_schedule_draws_every_family_and_waits_for_the_slowest(family_plan):
    ctx = family_plan.context
    # plain 1F1B (the picture draws interleaving as plain 1F1B)
    evaluation = evaluate(ctx, dataclasses.replace(family_plan.strategy, virtual_stages=1))
    blocks = pipeline_timeline(ctx, evaluation)
    flush = max(b.end_s for b in blocks if b.micro_batch >= 0)
    for family, pipeline in enumerate(evaluation.strategy.pipelines):
        indices = [i for i, s in enumerate(evaluation.stages) if s.family == family]
        for i in indices:
            forwards = [b for b in blocks if b.stage == i and b.kind == "forward"]
            assert len(forwards) == pipeline.num_microbatches
        # each family's own makespan is at most the iteration's pipeline time, the slowest one equals it
        own = max(b.end_s for b in blocks if b.stage in indices and b.micro_batch >= 0)
        assert own <= flush + 1e-12
    # uneven stages: the cost model's closed form is the list schedule's makespan to within a fraction of a stage
    assert flush == pytest.approx(evaluation.pipeline_time_s, rel=0.01)
    assert all(b.start_s >= flush - 1e-12 for b in blocks if b.micro_batch < 0)  # DP sync after every family
    words = bottleneck_words(ctx, evaluation)
    assert any("2 pipeline families run side by side" in line for line in words)
    assert "slowest stage of family 0, whose" in words[0]  # the A100 pipeline, 56 of the 64 samples
    assert stage_label(evaluation, len(evaluation.stages) - 1) == "1.0"


def test_traffic_of_families_is_each_familys_own_plus_the_gradient_shards_across_groups(family_plan):
    ctx, strategy = family_plan.context, family_plan.strategy
    traffic = strategy_traffic(ctx, strategy)
    together = traffic.by_dimension_and_link()
    alone = [strategy_traffic(ctx, dataclasses.replace(strategy, pipelines=(p,))) for p in strategy.pipelines]
    for dimension in ("tp", "pp"):
        assert sum(together[dimension].values()) == pytest.approx(sum(t.total_bytes(dimension) for t in alone))
    # the families are different groups: what crosses groups is exactly each device's shard, 2(F-1)/F of it
    families = len(strategy.pipelines)
    expected = 0.0
    for pipeline in strategy.pipelines:
        for index, stage in enumerate(pipeline.stages):
            first, last = index == 0, index == len(pipeline.stages) - 1
            params = stage_params(ctx.model, stage.num_layers, first, last, len(pipeline.stages)) / stage.tp
            devices = stage.tp * pipeline.replicas
            expected += devices * 2 * (families - 1) / families * params * GRAD_BYTES_PER_PARAM / pipeline.replicas
    assert together["dp"]["cross_group"] == pytest.approx(expected, rel=1e-12)
    assert traffic.dp_parts["across families"] == pytest.approx(expected, rel=1e-12)  # the dp row's part, said
    assert together["dp"]["cross_group"] > 0 and all(together[d]["cross_group"] == 0 for d in ("tp", "pp"))


def test_cross_family_groups_tile_the_model_and_hold_every_family(family_plan):
    from comm.plan_groups import plan_groups

    strategy = family_plan.strategy
    planned = plan_groups(family_plan.context.cluster, strategy, BATCH)
    segments = [g for g in planned if g.kind is Axis.CROSS_FAMILY]
    num_layers = family_plan.context.model.num_layers
    assert segments[0].pieces[0] == 0 and segments[-1].pieces[1] == num_layers + 2
    assert all(a.pieces[1] == b.pieces[0] for a, b in pairwise(segments))
    family_ranks = [
        {r for g in planned if g.kind is Axis.TP and g.family == family for r in g.ranks}
        for family in range(len(strategy.pipelines))
    ]
    for segment in segments:  # every family holds every piece: each segment meets all families
        assert all(set(segment.ranks) & ranks for ranks in family_ranks), segment
    # every rank of every family takes part in the sums of the segments it holds
    assert {r for g in segments for r in g.ranks} == set().union(*family_ranks)


def test_export_falls_back_to_one_family(family_plan):
    exported = export_plan(family_plan.context, family_plan.strategy, "megatron")
    assert len(exported.strategy.pipelines) == 1
    assert any("2 pipeline families" in lost for lost in exported.lost)
    assert exported.predicted_iteration_time_s > exported.plan_iteration_time_s


@pytest.mark.slow
def test_cli_plans_families_and_explains_and_counts_their_traffic(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML.format(inter_group_gbps=200))
    out = tmp_path / "plan.json"
    args = ["--cluster", str(cluster), "--model", "gpt3-1.7b", "--dtype", "fp16", "--global-batch", str(BATCH)]
    made = hetplan("plan", *args, "--families", "search", "--out", str(out), "--json")
    assert made.returncode == 0, made.stderr
    body = json.loads(made.stdout)
    assert len(body["pipelines"]) == 2 and body["training"]["families"] == "search"
    assert body["search"]["family_partitions"] == 1
    explained = hetplan("explain", str(out), "--cluster", str(cluster), "--png", str(tmp_path / "x.png"), "--json")
    assert explained.returncode == 0, explained.stderr
    assert (tmp_path / "x.png").stat().st_size > 10_000
    traffic = hetplan("traffic", str(out), "--cluster", str(cluster), "--json")
    assert traffic.returncode == 0, traffic.stderr


def test_interleaved_memory_is_checked_at_every_micro_batch_count():
    """An interleaved plan's stages hold 2(p - i - 1) + (v - 1) N + 1 chunks and Megatron's group size N is not
    monotone in the micro-batches, so a family that fits at its block's count may not fit at the split's (the
    partition was dropped): the mask the split then uses equals the full cost model at every count."""
    from planner.families import _interleaved_fits
    from specs import load_cluster
    from tests.conftest import EXAMPLES

    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    training = load_training(EXAMPLES / "training" / "hethub-140b.yaml", {"uneven_batch": "exhaustive"})
    ctx = build_context(cluster, load_model("llama-140b"), training)
    amd = cluster.group("amd")
    plans = _block_plans(search(_block_context(ctx, [amd], 96), SearchOptions(top_k=3, every_group=True)).evaluations)
    interleaved = [p for p in plans if p.virtual_stages > 1]
    assert interleaved
    checked = set()
    for block_plan in interleaved:
        replicas, size = block_plan.replicas, block_plan.micro_batch_size
        most = 60
        fits = _interleaved_fits(ctx, block_plan.evaluation, most)
        for q in range(1, most + 1):
            alone = _block_context(ctx, [amd], q * replicas * size)
            evaluation = evaluate(alone, combine(alone, [block_plan], [q * replicas]))
            assert fits[q] == evaluation.fits, q
            checked.add(fits[q])
    assert checked == {True, False}


def test_several_runs_of_totals_add_as_the_union_of_their_ranges():
    """The split's table step for a plan whose memory allows several runs of micro-batch totals (an FFT
    convolution) equals adding each run's range."""
    import numpy as np

    from planner.families import _add_range, _add_runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        size, step = int(rng.integers(5, 300)), int(rng.integers(1, 5))
        reachable = rng.random(size) < 0.1
        reachable[0] = True
        runs, start = [], 1
        for _ in range(int(rng.integers(2, 6))):
            low = start + int(rng.integers(0, 5))
            runs.append((low, low + int(rng.integers(0, 5))))
            start = runs[-1][1] + 2
        expected = np.zeros(size, dtype=bool)
        for low, high in runs:
            expected |= _add_range(reachable, step, low, high)
        assert (_add_runs(reachable, step, runs) == expected).all()


def test_each_family_runs_its_own_zero_stage():
    """A family of its own ZeRO stage holds and moves its state as that stage does (the V100 family at ZeRO-3 holds
    1/8 of its weights, the A100 family at the plan's ZeRO-1 all of them), the plan file keeps both, and the local
    runtime refuses a plan it would run at one stage."""
    model = load_model("gpt3-1.7b")
    ctx = build_context(_a100_and_v100(), model, _training("off"))
    strategy = _two_families(ctx, 48)
    mixed = dataclasses.replace(
        strategy, pipelines=(strategy.pipelines[0], dataclasses.replace(strategy.pipelines[1], zero_stage=3))
    )
    assert mixed.zero_summary == "ZeRO per family (1, 3)"
    uniform, own = evaluate(ctx, strategy), evaluate(ctx, mixed)
    a100, v100 = (s for s in own.stages)
    params = stage_params(model, 24, True, True, 1)
    assert a100.memory.weights_bytes == pytest.approx(params * 2)  # the plan's ZeRO-1: whole fp16 weights
    gathered = 2 * model.layer_params() * 2  # ZeRO-3 holds the layer computing and the one prefetched
    assert v100.memory.weights_bytes == pytest.approx(params * 2 / 8 + gathered)
    assert a100.memory == uniform.stages[0].memory
    assert v100.memory.grads_bytes == pytest.approx(params * 4 / 8)  # ZeRO-3 shards the gradients too
    assert uniform.stages[1].memory.grads_bytes == pytest.approx(params * 4)
    from planner import compute_bounds
    from planner.plan import Plan

    written = Plan(ctx, own, compute_bounds(ctx), 0.0, {}).to_dict()
    assert [p["zero_stage"] for p in written["pipelines"]] == [1, 3]
    from planner.plan import LoadedPlan
    from planner.what_if import check_runtime_layout

    with pytest.raises(SpecError, match="one per family"):
        check_runtime_layout(LoadedPlan(mixed, model, ctx.training, "mixed.json"))
    check_runtime_layout(LoadedPlan(strategy, model, ctx.training, "uniform.json"))


def test_plan_with_several_zero_stages_lets_families_pick_and_is_never_slower(tmp_path):
    model, cluster = load_model("gpt3-1.7b"), _a100_and_v100()
    one = plan(cluster, model, _training(), zero_stages=(1,))
    three = plan(cluster, model, _training(), zero_stages=(3,))
    both = plan(cluster, model, _training(), zero_stages=(1, 3))
    assert both.evaluation.iteration_time_s <= min(one.evaluation.iteration_time_s, three.evaluation.iteration_time_s)
    assert set(both.search_stats["zero_stages_s"]) - {"per family"} == {"1", "3"}
    path = tmp_path / "plan.json"
    both.save(path)
    assert load_plan(path).strategy == both.strategy


def test_an_interleaved_block_plan_is_affine_and_offered_from_the_micro_batches_that_fill_its_loop():
    """The batch split took an interleaved plan's time as affine in its micro-batches per replica all the way down;
    below p it waits for the loop through the stages (0.0464 s modelled against 0.0697 s evaluated at one)."""
    from planner.families import _ranges
    from specs.layout import megatron_strategy

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    cluster = cluster.only(cluster.group("a100"))

    def evaluated(batch: int) -> Evaluation:
        training = load_training(overrides={"global_batch_size": batch, "zero_stage": 1})
        ctx = build_context(cluster, load_model("gpt3-1.7b"), training)
        layout = {"group": "a100", "tp": 2, "pp": 4, "dp": 2, "micro_batch_size": 1, "recompute": "none"}
        return evaluate(ctx, megatron_strategy(cluster, ctx.model, training, **layout, virtual_stages=2))

    for batch in (4, 16):  # evaluated below the loop (2 per replica) and above it (8): the same affine form
        (plan,) = _block_plans([evaluated(batch)])
        assert plan.least_microbatches == 4
        for q in (4, 6, 8):
            assert plan.fixed_s + q * plan.per_microbatch_s == pytest.approx(evaluated(2 * q).iteration_time_s)
    assert min(low for low, _ in _ranges(64, plan, 10.0)) == 2 * 3 + 1  # 4 per replica at least: 7 and more
    (below,) = _block_plans([evaluated(4)])  # held to its 2 per replica by memory (below p), and 2 are too few
    assert _ranges(64, below, 10.0) == []
