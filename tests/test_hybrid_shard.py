"""Hybrid sharding (ZeRO inside each node, replicated across nodes) by hand, searched, saved and exported."""

from __future__ import annotations

import pytest

from planner import plan
from planner.export import export_plan
from planner.plan import load_plan
from predictor.comm_model import all_reduce_time_s, in_node_link, rail_link, reduce_scatter_time_s
from predictor.cost_model import CostContext, evaluate
from specs import get_device, load_cluster, load_model, load_training
from specs.cluster import ClusterSpec, DeviceGroup
from specs.layout import PipelineStrategy, StageStrategy, Strategy
from tests.conftest import EXAMPLES, FixedCosts, hetplan

TINY = EXAMPLES / "models" / "tiny-llama.yaml"


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_hybrid_sharding_memory_and_sync_by_hand(zero_stage):
    """16 replicas on two nodes of 8, nothing overlapped: sharded over the 8 ranks of a node, the state is 1/8 (not
    1/16); gradients reduce-scatter in the node and each 1/8 shard all-reduces across the two nodes; weights gather
    inside the node only."""
    group = DeviceGroup("g", get_device("a100-80gb"), 2, 8, 8, 25e9)
    cluster = ClusterSpec("test", (group,), "rail-optimized", 25e9)
    model = load_model(str(TINY))
    quiet = {"overlap_grad_reduce": False, "overlap_param_gather": False}
    training = load_training(None, {"global_batch_size": 16, "zero_stage": zero_stage, **quiet})
    ctx = CostContext(cluster, model, training, {"g": FixedCosts(decoder_s=1.0)})
    stage = (StageStrategy("g", 0, 8, 1, 0),)
    whole = evaluate(ctx, Strategy((PipelineStrategy(16, 1, 1, stage),), "none", zero_stage))
    hybrid = evaluate(ctx, Strategy((PipelineStrategy(16, 1, 1, stage),), "none", zero_stage, zero_shard="node"))
    params = 8 * model.layer_params() + model.embedding_params() + model.lm_head_params()
    assert whole.stages[0].memory.optimizer_bytes == pytest.approx(params * 12 / 16)
    assert hybrid.stages[0].memory.optimizer_bytes == pytest.approx(params * 12 / 8)
    inner, outer = in_node_link(group), rail_link(group)
    grads_s = reduce_scatter_time_s(params * 4, 8, inner) + all_reduce_time_s(params * 4 / 8, 2, outer)
    weights_s = reduce_scatter_time_s(params * 2, 8, inner)
    assert hybrid.stages[0].dp_sync_time_s == pytest.approx(grads_s + weights_s)
    assert hybrid.stages[0].dp_sync_time_s != pytest.approx(whole.stages[0].dp_sync_time_s)


def test_plan_searches_where_zero_shards_and_exports_it(tmp_path):
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    training = load_training(None, {"zero_shard": "node"})
    made = plan(cluster, model, training, zero_shards=("dp", "node"))
    times = made.search_stats["zero_shard_s"]
    assert set(times) == {"dp", "node"}
    assert made.evaluation.iteration_time_s == pytest.approx(min(t for t in times.values() if t is not None))
    hybrid = plan(cluster, model, training)  # the training's own choice: node
    assert hybrid.strategy.zero_shard == "node"
    path = tmp_path / "plan.json"
    hybrid.save(path)
    assert load_plan(path).strategy == hybrid.strategy
    ctx = hybrid.context
    megatron = export_plan(ctx, hybrid.strategy, "megatron")
    if megatron.strategy.zero_shard == "node" and megatron.strategy.pipelines[0].replicas > 8:
        assert "--num-distributed-optimizer-instances" in megatron.files["launch.sh"]
    deepspeed = export_plan(ctx, hybrid.strategy, "deepspeed")
    assert any("ZeRO sharding per node (hybrid)" in line for line in deepspeed.lost)


def test_zero_shard_flags_refuse_a_wrong_value_in_one_line():
    bad = hetplan("plan", "--cluster", str(EXAMPLES / "h100-mi300x.yaml"), "-m", "llama3-70b", "--zero-shard", "rack")
    assert bad.returncode != 0 and "--zero-shard" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
