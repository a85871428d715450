"""`hetplan explain`: the 1F1B timeline obeys the schedule's dependencies and matches the cost model's pipeline time;
the picture and the HTML report are real."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json

import pytest

from predictor.cost_model import build_context, evaluate
from predictor.schedule import bottleneck_words, pipeline_timeline
from specs import load_cluster, load_model, load_training
from specs.layout import megatron_strategy
from tests.conftest import EXAMPLES

CLUSTER = EXAMPLES / "a100-v100-32.yaml"


def _evaluation(pp: int):
    cluster = load_cluster(CLUSTER)
    cluster = cluster.only(cluster.group("a100"))
    training = load_training(None, {"global_batch_size": 32, "zero_stage": 1})
    ctx = build_context(cluster, load_model("gpt3-1.7b"), training)
    strategy = megatron_strategy(
        cluster, ctx.model, training, group="a100", tp=2, pp=pp, dp=16 // (2 * pp), micro_batch_size=1, recompute="none"
    )
    return ctx, evaluate(ctx, strategy)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_timeline_respects_1f1b_dependencies_and_the_cost_models_pipeline_time(pp):
    ctx, evaluation = _evaluation(pp)
    blocks = pipeline_timeline(ctx, evaluation)
    m = evaluation.strategy.pipelines[0].num_microbatches
    end = {(b.stage, b.kind, b.micro_batch): b.end_s for b in blocks}
    start = {(b.stage, b.kind, b.micro_batch): b.start_s for b in blocks}
    for stage in range(pp):
        runs = sorted((b.start_s, b.end_s) for b in blocks if b.stage == stage and b.micro_batch >= 0)
        assert len(runs) == 2 * m
        assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(runs))  # one thing at a time
        for j in range(m):
            if stage > 0:
                assert start[(stage, "forward", j)] >= end[(stage - 1, "forward", j)]
            if stage < pp - 1:
                assert start[(stage, "backward", j)] >= end[(stage + 1, "backward", j)]
            else:
                assert start[(stage, "backward", j)] >= end[(stage, "forward", j)]
    flush = max(b.end_s for b in blocks if b.micro_batch >= 0)
    # even stages: the list schedule's makespan is the cost model's 1F1B formula
    assert flush == pytest.approx(evaluation.pipeline_time_s, rel=1e-9)
    tail = max(b.end_s for b in blocks) - flush
    assert tail == pytest.approx(evaluation.tail_time_s, rel=1e-9)


def test_bottleneck_names_the_slowest_stage():
    ctx, evaluation = _evaluation(4)
    words = bottleneck_words(ctx, evaluation)
    assert words[0].startswith("Stage ") and "slowest" in words[0]
    assert any("Memory is tightest" in line for line in words)


def test_layout_words_say_the_rings_exposed_time_by_hand():
    """CP 4 x 2 replicas of the tiny Llama on one node with layers so fast the ring sticks out (the hand computation
    of tests/test_context_parallel.py): per micro-batch, 8 layers x (3 forward steps + 3 backward double steps)."""
    from predictor.comm_model import in_node_link
    from predictor.context_parallel import attention_share
    from predictor.cost_model import CostContext
    from predictor.schedule import layout_words
    from tests.conftest import FixedCosts
    from tests.test_context_parallel import TINY, _cp_strategy, _one_node

    decoder_s = 1e-7
    cluster, model = _one_node(), load_model(str(TINY))
    ctx = CostContext(cluster, model, load_training(None, {"global_batch_size": 4}), {"g": FixedCosts(decoder_s)})
    evaluation = evaluate(ctx, _cp_strategy(replicas=2, cp=4))
    link = in_node_link(cluster.groups[0])
    step = link.alpha_s + 2 * (256 / 4) * (4 * 64) * 2 / link.bw_bytes_per_s
    share = attention_share(model, 256)
    ring = 8 * (3 * (step - share * (decoder_s / 3) / 4) + 3 * (2 * step - share * (2 * decoder_s / 3) / 4))
    words = layout_words(ctx, evaluation)
    assert words[0].startswith("Context parallel 4: each replica's 256-token sequences are split over 4 ranks (64")
    assert f"add {ring * 1e3:.1f} ms per micro-batch on stage 0 (g, " in words[0]
    assert words[1] == "ZeRO-1: the optimizer state is sharded over 8 ranks."  # 2 replicas x 4 CP ranks


def test_layout_words_name_each_familys_zero_stage_and_its_traffic():
    """The A100 family at the plan's ZeRO-1, the V100 family at ZeRO-3 (tests/test_families.py), without overlap:
    one sentence each, the ZeRO-3 one with its exposed gathers per micro-batch; overlapped, they hide and it says
    nothing of them."""
    from predictor.schedule import layout_words
    from tests.test_families import _a100_and_v100, _training, _two_families

    for overlap in (False, True):
        training = _training("off").model_copy(update={"overlap_param_gather": overlap, "overlap_grad_reduce": overlap})
        ctx = build_context(_a100_and_v100(), load_model("gpt3-1.7b"), training)
        strategy = _two_families(ctx, 48)
        a100, v100 = strategy.pipelines
        mixed = evaluate(ctx, dataclasses.replace(strategy, pipelines=(a100, dataclasses.replace(v100, zero_stage=3))))
        words = layout_words(ctx, mixed)
        assert words[0] == f"Family 0: ZeRO-1: the optimizer state is sharded over {a100.replicas} ranks."
        sharded = "weights, gradients and optimizer state are sharded (weights gathered layer by layer)"
        assert words[1].startswith(f"Family 1: ZeRO-3: {sharded} over {v100.replicas} ranks")
        exposed = max(s.sharded_exposed_time_s for s in mixed.stages if s.family == 1)
        if overlap:
            assert exposed == 0 and words[1].endswith("ranks.")
        else:
            assert exposed > 0 and f"adds {exposed * 1e3:.1f} ms per micro-batch on stage 1.0 (v100" in words[1]


def test_layout_words_say_one_sentence_when_every_family_shards_alike_and_one_each_otherwise():
    """Both families at ZeRO-1: over their own replicas each (one sentence per family when the counts differ)."""
    from predictor.schedule import layout_words
    from tests.test_families import _a100_and_v100, _training, _two_families

    ctx = build_context(_a100_and_v100(), load_model("gpt3-1.7b"), _training("off"))
    strategy = _two_families(ctx, 48)
    a100, v100 = strategy.pipelines
    words = layout_words(ctx, evaluate(ctx, strategy))
    if a100.replicas == v100.replicas:
        assert words == [f"ZeRO-1: the optimizer state is sharded over {a100.replicas} ranks."]
    else:
        assert words == [
            f"Family 0: ZeRO-1: the optimizer state is sharded over {a100.replicas} ranks.",
            f"Family 1: ZeRO-1: the optimizer state is sharded over {v100.replicas} ranks.",
        ]
    same = dataclasses.replace(strategy, pipelines=(a100, dataclasses.replace(v100, replicas=a100.replicas)))
    assert layout_words(ctx, evaluate(ctx, same)) == [
        f"ZeRO-1: the optimizer state is sharded over {a100.replicas} ranks."
    ]


@pytest.mark.slow
def test_explain_command_writes_a_picture_and_a_self_contained_report(tmp_path):
    import matplotlib.image

    from tests.conftest import hetplan, write_plan

    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, CLUSTER, "gpt3-6.7b", 128)
    png, html = tmp_path / "explain.png", tmp_path / "explain.html"
    result = hetplan(
        "explain", str(plan_path), "--cluster", str(CLUSTER), "--png", str(png), "--html", str(html), "--json"
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["bottleneck"] and body["flush_s"] > 0
    image = matplotlib.image.imread(png)
    assert image.shape[0] >= 500 and image.shape[1] >= 800
    assert image[..., :3].std() > 0.1
    report = html.read_text()
    assert body["bottleneck"][0] in report
    encoded = report.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(encoded)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("pp", "virtual", "batch"),
    [(2, 2, 32), (4, 4, 32), (4, 2, 28), (3, 2, 32), (4, 3, 24), (4, 4, 2), (4, 2, 4), (4, 4, 6)],
)
def test_interleaved_timeline_follows_megatrons_order_and_the_closed_form(pp, virtual, batch):
    """Chunk by chunk in Megatron's order (micro-batch groups of N, including m not a multiple of p): no deadlock,
    one thing at a time per stage, chunk c waits for chunk c - 1 (forward) and c + 1 (backward), and the makespan
    is the cost model's interleaved closed form to within 1%; with fewer micro-batches than stages too (1, 2 and 3
    micro-batches on 4 stages: the form that ignored the loop through the stages said 38-109% less)."""
    cluster = load_cluster(CLUSTER)
    cluster = cluster.only(cluster.group("a100"))
    training = load_training(None, {"global_batch_size": batch, "zero_stage": 1})
    ctx = build_context(cluster, load_model("gpt3-1.7b"), training)
    strategy = megatron_strategy(
        cluster,
        ctx.model,
        training,
        group="a100",
        tp=2,
        pp=pp,
        dp=16 // (2 * pp),
        micro_batch_size=1,
        recompute="none",
        virtual_stages=virtual,
    )
    evaluation = evaluate(ctx, strategy)
    blocks = pipeline_timeline(ctx, evaluation)
    m = strategy.pipelines[0].num_microbatches
    end = {(b.stage, b.kind, b.micro_batch, b.chunk): b.end_s for b in blocks}
    start = {(b.stage, b.kind, b.micro_batch, b.chunk): b.start_s for b in blocks}
    last = pp * virtual - 1
    for stage in range(pp):
        runs = sorted((b.start_s, b.end_s) for b in blocks if b.stage == stage and b.micro_batch >= 0)
        assert len(runs) == 2 * m * virtual
        assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(runs))
        for j in range(m):
            for k in range(virtual):
                chunk = k * pp + stage
                if chunk > 0:
                    before = chunk - 1
                    assert start[(stage, "forward", j, k)] >= end[(before % pp, "forward", j, before // pp)]
                after = chunk + 1
                if chunk < last:
                    assert start[(stage, "backward", j, k)] >= end[(after % pp, "backward", j, after // pp)]
    flush = max(b.end_s for b in blocks if b.micro_batch >= 0)
    assert flush == pytest.approx(evaluation.pipeline_time_s, rel=0.01)


def test_layout_words_of_one_replica_say_there_is_nothing_to_shard():
    """A one-replica plan at ZeRO-1 read "the optimizer state is sharded over 1 ranks" (a newcomer's tiny plan)."""
    from predictor.schedule import layout_words

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    training = load_training(None, {"global_batch_size": 8, "zero_stage": 1})
    ctx = build_context(cluster, load_model("gpt3-1.7b"), training)
    for dp, expected in ((1, "ZeRO-1: one replica, nothing to shard over"), (2, "ZeRO-1: the optimizer state is "
                                                                              "sharded over 2 ranks.")):  # fmt: skip
        strategy = megatron_strategy(
            cluster, ctx.model, training, group="a100", tp=8, pp=1, dp=dp, micro_batch_size=1, recompute="none"
        )
        (words,) = layout_words(ctx, evaluate(ctx, strategy))
        assert words.startswith(expected), words
