"""`plan --zero-stages`: one search per ZeRO stage, the fastest plan kept, each stage's best time reported."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner import plan
from specs import load_cluster, load_model, load_training
from tests.conftest import EXAMPLES, hetplan


def test_the_plan_over_zero_stages_is_at_least_as_fast_as_each_stage_alone_and_says_which_won():
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    alone = {s: plan(cluster, model, load_training(overrides={"zero_stage": s})) for s in (1, 2)}
    searched = plan(cluster, model, load_training(), zero_stages=(1, 2))
    best = min(p.evaluation.iteration_time_s for p in alone.values())
    assert searched.evaluation.iteration_time_s <= best + 1e-9
    by_stage = searched.search_stats["zero_stages_s"]
    assert set(by_stage) - {"per family"} == {"1", "2"}  # and the families' own stages where they made a plan
    for stage, planned in alone.items():
        assert by_stage[str(stage)] <= planned.evaluation.iteration_time_s + 1e-9
    chosen = searched.strategy.zero_stage
    stages = {searched.strategy.family_zero_stage(p) for p in searched.strategy.pipelines}
    key = str(chosen) if len(stages) == 1 else "per family"
    assert by_stage[key] == pytest.approx(searched.evaluation.iteration_time_s)
    assert searched.context.training.zero_stage == chosen  # the plan's training runs the stage it chose


def test_cli_zero_stages_are_checked_and_reported(tmp_path):
    args = ["plan", "-c", str(EXAMPLES / "a100-v100-32.yaml"), "-m", "gpt3-1.7b", "--dtype", "fp16", "-q"]
    out = tmp_path / "plan.json"
    done = hetplan(*args, "--global-batch", "64", "--zero-stages", "0,1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    body = json.loads(out.read_text())
    assert set(body["search"]["zero_stages_s"]) - {"per family"} == {"0", "1"} and body["zero_stage"] in (0, 1)
    wrong = hetplan(*args, "--zero-stages", "1,4")
    assert wrong.returncode == 2 and "--zero-stages" in wrong.stderr and "Traceback" not in wrong.stderr


def test_at_zero_3_the_splits_memory_line_is_exact_from_the_gathered_layers_on_and_never_below():
    """ZeRO 3 holds the full weights of up to GATHERED_LAYERS layers besides each layer's shard, so stage memory is
    not linear in the layers: the split's line (StageTerms.memory_bytes) must be exact from there on and above the
    memory below it. Before, the line through 0 and 1 layers charged every layer a gathered layer too: at ZeRO 3 the
    H100 + MI300X search missed a split 1.3% faster that the ZeRO-2 plan run at ZeRO 3 shows."""
    from planner.candidates import OuterConfig
    from planner.solve import StageTerms
    from predictor.cost_model import evaluate, stage_memory
    from predictor.predictor import default_predictor
    from predictor.sharding import GATHERED_LAYERS

    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    ctx = default_predictor().context(cluster, model, load_training(overrides={"zero_stage": 3}))
    group = cluster.groups[0]
    config = OuterConfig((group,), (2,), (3,), 8, 1, "none", 1, 0.0)
    shape = dict(micro_batch_size=1, tp=2, recompute="none", dp=8, in_flight=2.0, first=False, last=False)
    per_layer, empty, _ = StageTerms(ctx).memory_bytes(group, config, 2, "none", 2.0, False, False, 3)
    for layers in range(12):
        actual = stage_memory(ctx, group, num_layers=layers, pipeline_stages=3, **shape).total_bytes
        line = empty + layers * per_layer
        assert line >= actual * (1 - 1e-12)
        if layers >= GATHERED_LAYERS:
            assert line == pytest.approx(actual, rel=1e-12)
    z2 = plan(cluster, model, load_training(overrides={"zero_stage": 2}))
    z3 = plan(cluster, model, load_training(overrides={"zero_stage": 3}))
    z2_at_3 = evaluate(z3.context, replace(z2.strategy, zero_stage=3))
    assert not z2_at_3.fits or z3.evaluation.iteration_time_s <= z2_at_3.iteration_time_s + 1e-9


def test_the_searches_over_zero_stages_share_their_family_block_scans_and_plan_the_same(monkeypatch):
    """The per-stage searches and the per-family search scan the same blocks at the same stages: shared, each block
    is scanned once, and the plan is the one the searches find apart."""
    import planner.planning as planning
    import planner.search as search_module

    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    runs = []
    real_run = search_module._Search.run
    monkeypatch.setattr(search_module._Search, "run", lambda self: runs.append(1) or real_run(self))
    shared = plan(cluster, model, load_training(), zero_stages=(1, 2))
    shared_runs = len(runs)
    runs.clear()
    real_search = planning.search
    monkeypatch.setattr(planning, "search", lambda *args, block_scans=None, **kwargs: real_search(*args, **kwargs))
    apart = plan(cluster, model, load_training(), zero_stages=(1, 2))
    assert shared.strategy == apart.strategy
    assert shared.evaluation.iteration_time_s == apart.evaluation.iteration_time_s
    assert shared_runs < len(runs)
