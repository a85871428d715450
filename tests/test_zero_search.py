"""`plan --zero-stages`: one search per ZeRO stage, the fastest plan kept, each stage's best time reported."""

from __future__ import annotations

import json

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
    assert set(by_stage) == {"1", "2"}
    for stage, planned in alone.items():
        assert by_stage[str(stage)] <= planned.evaluation.iteration_time_s + 1e-9
    chosen = searched.strategy.zero_stage
    assert by_stage[str(chosen)] == pytest.approx(searched.evaluation.iteration_time_s)
    assert searched.context.training.zero_stage == chosen  # the plan's training runs the stage it chose


def test_cli_zero_stages_are_checked_and_reported(tmp_path):
    args = ["plan", "-c", str(EXAMPLES / "a100-v100-32.yaml"), "-m", "gpt3-1.7b", "--dtype", "fp16", "-q"]
    out = tmp_path / "plan.json"
    done = hetplan(*args, "--global-batch", "64", "--zero-stages", "0,1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    body = json.loads(out.read_text())
    assert set(body["search"]["zero_stages_s"]) == {"0", "1"} and body["zero_stage"] in (0, 1)
    wrong = hetplan(*args, "--zero-stages", "1,4")
    assert wrong.returncode == 2 and "--zero-stages" in wrong.stderr and "Traceback" not in wrong.stderr
