"""Uneven batch splits: replica counts that do not divide the global batch, each replica running whole
micro-batches within one of the others, gradients weighted by share."""

from __future__ import annotations

import dataclasses
import json

import pytest

from planner import load_plan, plan, predict
from report.tables import strategy_summary
from specs import load_cluster, load_model, load_training
from specs.errors import SpecError
from specs.layout import PipelineStrategy, StageStrategy, Strategy, split_batch
from tests.conftest import EXAMPLES


def _three_a100_nodes():
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    a100 = cluster.group("a100")
    return cluster.only(dataclasses.replace(a100, nodes=3))


def test_split_batch_is_as_even_as_whole_microbatches_allow():
    assert split_batch(64, 24, 1) == (3, 64)
    assert split_batch(64, 24, 2) == (2, 32)
    assert split_batch(64, 24, 3) is None  # 64 is not whole micro-batches of 3
    assert split_batch(8, 24, 1) is None  # fewer micro-batches than replicas
    pipeline = PipelineStrategy(24, 1, 3, (StageStrategy("a100", 0, 24, 1),), total_microbatches=64)
    counts = pipeline.replica_microbatches()
    assert sum(counts) == 64 and set(counts) == {2, 3} and counts == sorted(counts, reverse=True)


def test_uneven_split_beats_the_best_even_split_on_24_devices():
    """64 sequences over 24 A100s: even splits need 8 replicas x 3 stages (pipeline bubble) or 16 replicas (8 idle
    devices); 24 replicas of 2-3 micro-batches each do better."""
    cluster, model = _three_a100_nodes(), load_model("gpt3-1.7b")
    even = plan(cluster, model, load_training(None, {"global_batch_size": 64}))  # off, the default
    uneven = plan(cluster, model, load_training(None, {"global_batch_size": 64, "uneven_batch": "refine"}))
    exhaustive = plan(cluster, model, load_training(None, {"global_batch_size": 64, "uneven_batch": "exhaustive"}))
    assert uneven.evaluation.iteration_time_s < even.evaluation.iteration_time_s
    assert exhaustive.evaluation.iteration_time_s == pytest.approx(uneven.evaluation.iteration_time_s, rel=1e-12)
    pipeline = uneven.strategy.pipelines[0]
    assert 64 % pipeline.replicas != 0 and pipeline.uneven
    body = uneven.to_dict()["pipelines"][0]
    assert sum(b["replicas"] * b["samples"] for b in body["replica_batches"]) == 64
    assert sum(b["replicas"] * b["gradient_weight"] for b in body["replica_batches"]) == pytest.approx(1.0, abs=1e-5)
    m = pipeline.num_microbatches  # the one-line summary says so (it read "micro-batch b x m": more than the batch)
    assert f"x {m - 1}-{m} (uneven)" in strategy_summary(uneven.evaluation)


def test_uneven_plan_round_trips_and_predicts_the_same(tmp_path):
    cluster, model = _three_a100_nodes(), load_model("gpt3-1.7b")
    result = plan(cluster, model, load_training(None, {"global_batch_size": 64, "uneven_batch": "refine"}))
    path = tmp_path / "plan.json"
    result.save(path)
    loaded = load_plan(path)
    assert loaded.strategy == result.strategy
    again = predict(result.context, loaded.strategy)
    assert again.iteration_time_s == pytest.approx(result.evaluation.iteration_time_s, rel=1e-12)
    assert json.loads(path.read_text())["pipelines"][0]["total_microbatches"] == 64


def test_unbalanced_split_is_refused():
    cluster, model = _three_a100_nodes(), load_model("gpt3-1.7b")
    result = plan(cluster, model, load_training(None, {"global_batch_size": 64, "uneven_batch": "refine"}))
    pipeline = result.strategy.pipelines[0]
    skewed = dataclasses.replace(pipeline, num_microbatches=pipeline.num_microbatches + 1)
    strategy = dataclasses.replace(result.strategy, pipelines=(skewed,))
    with pytest.raises(SpecError, match="micro-batches each"):
        predict(result.context, strategy)


def test_uneven_plan_is_no_worse_than_any_megatron_layout_with_any_replica_count():
    """Every (tp, pp, dp, micro-batch, recompute) with even layers and any dp the devices hold (uneven batch) is no
    better than the plan."""
    cluster, model = _three_a100_nodes(), load_model("gpt3-1.7b")
    training = load_training(
        None,
        {"global_batch_size": 64, "uneven_batch": "exhaustive", "virtual_stages": [1], "micro_batch_sizes": [1, 2, 4]},
    )
    best = plan(cluster, model, training)
    ctx = best.context
    checked = compared = 0
    for tp in (1, 2, 4, 8):
        for pp in (p for p in (1, 2, 3, 4, 6, 8, 12, 24) if p * tp <= 24):
            for dp in range(1, 24 // (tp * pp) + 1):
                for b in training.micro_batch_sizes:
                    split = split_batch(64, dp, b)
                    if split is None:
                        continue
                    m, total = split
                    for recompute in training.recompute:
                        n = model.num_layers // pp
                        stages = tuple(StageStrategy("a100", i * n, (i + 1) * n, tp, i * tp * dp) for i in range(pp))
                        pipeline = PipelineStrategy(dp, b, m, stages, total if total != dp * m else 0)
                        evaluation = predict(ctx, Strategy((pipeline,), recompute, 1))
                        checked += 1
                        if evaluation.fits:
                            compared += 1
                            assert best.evaluation.iteration_time_s <= evaluation.iteration_time_s * (1 + 1e-9)
    assert checked > 500 and compared > 0
