"""Context parallelism on the planning side: ranks, groups, costs and memory by hand, traffic, the search choosing
it for long sequences, plan files, predict --cp and the exports' flags."""

from __future__ import annotations

import json

import pytest

from comm.plan_groups import plan_groups
from planner import plan
from planner.export import export_plan
from predictor.comm_model import in_node_link
from predictor.context_parallel import attention_share
from predictor.cost_model import CostContext, evaluate
from predictor.predictor import default_predictor
from predictor.traffic import strategy_traffic
from specs import SpecError, get_device, load_cluster, load_model, load_training
from specs.cluster import ClusterSpec, DeviceGroup
from specs.layout import Axis, PipelineStrategy, StageStrategy, Strategy, group_offsets, stage_rank
from tests.conftest import EXAMPLES, FixedCosts, hetplan

TINY = EXAMPLES / "models" / "tiny-llama.yaml"  # hidden 512, 8 heads, 4 kv heads, seq 256, 8 layers


def _one_node(devices_per_node: int = 8) -> ClusterSpec:
    group = DeviceGroup("g", get_device("a100-80gb"), 1, devices_per_node, 8, 25e9)
    return ClusterSpec("test", (group,), "rail-optimized", 12.5e9)


def _cp_strategy(replicas: int, cp: int, tp: int = 1, microbatches: int = 2, zero_stage: int = 1) -> Strategy:
    stage = StageStrategy("g", 0, 8, tp, 0)
    return Strategy((PipelineStrategy(replicas, 1, microbatches, (stage,), 0, cp),), "none", zero_stage)


def test_ranks_and_groups_put_tp_innermost_then_cp_then_replicas():
    cluster = _one_node()
    strategy = _cp_strategy(replicas=2, cp=2, tp=2)
    offsets = group_offsets(cluster)
    stage = strategy.pipelines[0].stages[0]
    assert [stage_rank(offsets, stage, r, k, c, 2) for r in range(2) for c in range(2) for k in range(2)] == list(
        range(8)
    )
    groups = plan_groups(cluster, strategy, global_batch=4)
    by_kind = {kind: [g.ranks for g in groups if g.kind is kind] for kind in (Axis.TP, Axis.CP, Axis.DP)}
    assert by_kind[Axis.TP] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert by_kind[Axis.CP] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert by_kind[Axis.DP] == [(0, 2, 4, 6), (1, 3, 5, 7)]  # the dp-cp group: replicas and their CP ranks
    dp = next(g for g in groups if g.kind is Axis.DP)
    assert dp.weights == (0.5, 0.5, 0.5, 0.5)  # each member carries its replica's share of the batch
    assert strategy.devices == 8


def test_context_parallel_costs_memory_and_ring_by_hand():
    """CP 4 x 2 replicas of the tiny Llama on one node, layers so fast that the ring's transfers stick out: each rank
    computes its quarter of every sequence (micro-batch 1/4), sends its K/V block 3 times forward and K/V plus their
    gradients 3 times backward, reduces gradients and shards Adam over all 8 ranks."""
    decoder_s = 1e-7
    costs = FixedCosts(decoder_s=decoder_s, activation_bytes=1000.0)
    cluster = _one_node()
    model = load_model(str(TINY))
    ctx = CostContext(cluster, model, load_training(None, {"global_batch_size": 4, "zero_stage": 1}), {"g": costs})
    strategy = _cp_strategy(replicas=2, cp=4)
    ctx.check_strategy(strategy)
    result = evaluate(ctx, strategy)
    stage = result.stages[0]
    link = in_node_link(cluster.groups[0])
    block = 2 * 1 * (256 / 4) * (4 * 64) * 2  # K and V: b * s/cp tokens * kv_size, bf16
    step = link.alpha_s + block / link.bw_bytes_per_s
    share = attention_share(model, 256)
    forward = 3 * max(0.0, step - share * (decoder_s / 3) / 4)
    backward = 3 * max(0.0, 2 * step - share * (2 * decoder_s / 3) / 4)
    assert forward > 0 and backward > 0
    assert stage.compute_time_s == pytest.approx(8 * (decoder_s + forward + backward))
    params = 8 * model.layer_params() + model.embedding_params() + model.lm_head_params()
    assert stage.memory.optimizer_bytes == pytest.approx(params * 12 / 8)  # ZeRO-1 over replicas x CP ranks
    assert stage.memory.grads_bytes == pytest.approx(params * 4)
    # one micro-batch in flight of 1/4 of the tokens per layer, plus the computing layer's four ring buffers
    assert stage.memory.activation_bytes == pytest.approx(8 * 1000 / 4 + 4 * block)
    traffic = strategy_traffic(ctx, strategy).by_dimension_and_link()
    per_rank = 2 * 8 * (1 + 2) * 3 * block  # micro-batches x layers x (forward + backward blocks) x steps x block
    assert traffic[Axis.CP]["in_node"] == pytest.approx(8 * per_rank)
    assert sum(traffic[Axis.CP].values()) == traffic[Axis.CP]["in_node"]


def test_a_ring_that_spills_over_nodes_uses_the_rails_and_costs_more():
    costs = FixedCosts(decoder_s=1e-7)
    model = load_model(str(TINY))
    training = load_training(None, {"global_batch_size": 2})
    two_nodes = ClusterSpec("test", (DeviceGroup("g", get_device("a100-80gb"), 2, 4, 1, 25e9),), "clos", 25e9)
    ctx = CostContext(two_nodes, model, training, {"g": costs})
    across = evaluate(ctx, _cp_strategy(replicas=1, cp=8, microbatches=2))
    inside = evaluate(ctx, _cp_strategy(replicas=2, cp=4, microbatches=1))
    assert across.stages[0].compute_time_s > 2 * inside.stages[0].compute_time_s
    traffic = strategy_traffic(ctx, _cp_strategy(replicas=1, cp=8, microbatches=2)).by_dimension_and_link()
    assert traffic[Axis.CP]["rail"] + traffic[Axis.CP]["spine"] > 0  # the ring's two hops between the nodes


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (_cp_strategy(replicas=1, cp=3), "tp x context_parallel = 3"),
        # more devices than the group has: said so (it read "stages overlap" where a hand-built one overlapped too)
        (_cp_strategy(replicas=2, cp=8), "group 'g' has 8 devices, the plan's stages on it need 16 \\(TP x CP x "),
    ],
)
def test_a_context_parallel_layout_that_cannot_run_is_named(strategy, message):
    ctx = CostContext(_one_node(), load_model(str(TINY)), load_training(None, {"global_batch_size": 4}), {})
    with pytest.raises(SpecError, match=message):
        ctx.check_strategy(strategy)


def test_sequences_must_split_into_the_load_balanced_chunks():
    ctx = CostContext(
        _one_node(), load_model(str(TINY)), load_training(None, {"global_batch_size": 2, "seq_length": 100}), {}
    )
    with pytest.raises(SpecError, match="do not split into 2 x 4 equal chunks"):
        ctx.check_strategy(_cp_strategy(replicas=2, cp=4, microbatches=1))


def test_the_planner_splits_long_sequences_and_not_short_ones():
    """Llama-3-70B on H100 + MI300X + A100: at 32K tokens the search picks context parallelism (by default it tries
    CP 1-8 there) and says what each degree reached; at 8K it does not search it."""
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x-a100.yaml"), load_model("llama3-70b")
    long = plan(cluster, model, load_training(EXAMPLES / "training" / "long-context-32k.yaml"))
    by_degree = long.search_stats["context_parallel_s"]
    assert set(by_degree) == {"1", "2", "4", "8"}
    assert long.strategy.context_parallel > 1
    assert long.evaluation.iteration_time_s == pytest.approx(min(t for t in by_degree.values() if t is not None))
    assert by_degree["1"] > long.evaluation.iteration_time_s
    short = plan(cluster, model, load_training(None, {"seq_length": 8192, "global_batch_size": 512}))
    assert short.strategy.context_parallel == 1 and "context_parallel_s" not in short.search_stats


def test_context_parallel_plans_a_two_group_cluster_whose_subsets_share_row_tables():
    """Llama-3-8B at 32k tokens on the A100 + V100 cluster, ZeRO-1 and ZeRO-3 searched: the second stage's search
    reuses row tables made with one group subset's context and asks them for the other group's CP costs (once
    refused: 'no group named v100')."""
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    training = load_training(
        None, {"global_batch_size": 32, "seq_length": 32768, "dtype": "fp16", "context_parallel": [2, 4]}
    )
    result = plan(cluster, load_model("llama3-8b"), training, zero_stages=[1, 3])
    assert result.evaluation.fits and result.evaluation.strategy.context_parallel in (2, 4)
    assert {s.group for p in result.evaluation.strategy.pipelines for s in p.stages} == {"a100", "v100"}


def test_a_context_parallel_plan_round_trips_and_exports_its_degree(tmp_path):
    cluster, model = load_cluster(EXAMPLES / "h100-mi300x-a100.yaml"), load_model("llama3-70b")
    training = load_training(EXAMPLES / "training" / "long-context-32k.yaml", {"context_parallel": [4]})
    made = plan(cluster, model, training)
    assert made.strategy.context_parallel == 4
    path = tmp_path / "plan.json"
    made.save(path)
    written = json.loads(path.read_text())
    assert written["context_parallel"] == 4 and all(p["context_parallel"] == 4 for p in written["pipelines"])
    from planner.plan import load_plan

    assert load_plan(path).strategy == made.strategy
    ctx = default_predictor().context(cluster, model, training)
    megatron = export_plan(ctx, made.strategy, "megatron")
    assert megatron.strategy.context_parallel == 4
    assert "--context-parallel-size 4" in megatron.files["launch.sh"]
    torchtitan = export_plan(ctx, made.strategy, "torchtitan")
    assert "context_parallel_degree = 4" in torchtitan.files["torchtitan.toml"]
    deepspeed = export_plan(ctx, made.strategy, "deepspeed")
    assert deepspeed.strategy.context_parallel == 1
    assert any("context parallelism (CP 4) -> none" in line for line in deepspeed.lost)


def test_predict_takes_cp_and_refuses_it_with_a_plan(tmp_path):
    flags = ["--cluster", str(EXAMPLES / "h100-mi300x-a100.yaml"), "-m", "llama3-70b", "--group", "h100"]
    flags += ["--tp", "4", "--pp", "4", "--seq-len", "32768", "--global-batch", "64", "--recompute", "full"]
    one = json.loads(hetplan("predict", *flags, "--json").stdout)
    two = json.loads(hetplan("predict", *flags, "--cp", "2", "--json").stdout)
    assert (one["devices_used"], two["devices_used"]) == (16, 32)
    assert two["context_parallel"] == 2 and two["iteration_time_s"] < one["iteration_time_s"]
    stage_one, stage_two = one["pipelines"][0]["stages"][0], two["pipelines"][0]["stages"][0]
    activations = [stage["memory_breakdown_bytes"]["activations"] for stage in (stage_one, stage_two)]
    assert activations[1] / activations[0] == pytest.approx(0.5, rel=0.02)  # half the tokens (+ small ring buffers)
    wrong = hetplan("predict", *flags, "--cp", "3")
    assert wrong.returncode != 0 and len(wrong.stderr.strip().splitlines()) == 1 and "tp x cp x pp x dp" in wrong.stderr
    bad = hetplan("plan", "--cluster", str(EXAMPLES / "h100-mi300x.yaml"), "-m", "llama3-70b", "--cp", "two")
    assert bad.returncode != 0 and "--cp" in bad.stderr and "Traceback" not in bad.stderr


def test_replan_searches_the_context_parallel_degrees_again():
    """Losing an A100 node under a 32K plan with CP 4: the re-plan searches CP 1-8 again (warm-started from the old
    plan shrunk to fit) and keeps context parallelism, well ahead of the best plan without it."""
    from planner.replan import changed_cluster, replan

    cluster, model = load_cluster(EXAMPLES / "h100-mi300x-a100.yaml"), load_model("llama3-70b")
    training = load_training(EXAMPLES / "training" / "long-context-32k.yaml")
    old = plan(cluster, model, training)
    smaller = changed_cluster(cluster, ["node:a100/3"], [])
    again = replan(smaller, model, training, old.strategy)
    without_cp = plan(smaller, model, training.model_copy(update={"context_parallel": (1,)}))
    assert again.plan.strategy.context_parallel > 1
    assert again.plan.evaluation.iteration_time_s < without_cp.evaluation.iteration_time_s


def test_a_cp_degree_the_sequence_cannot_split_evenly_is_refused_before_the_search(tmp_path):
    """CP cuts each sequence into 2 x degree equal chunks: `plan --cp 3` at 8192 tokens once wrote a plan every
    other command refused; now the flag is named in one line before any search, and the library refuses it too. The
    degrees searched by default are those the sequence splits for."""
    result = hetplan("plan", "--cluster", str(EXAMPLES / "cpu-2x2.yaml"), "--model", str(TINY), "--cp", "3",
                     "--dtype", "fp32", "--out", str(tmp_path / "plan.json"))  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--cp: context parallel 3 cuts each sequence into 2 x 3 equal chunks" in result.stderr
    assert not (tmp_path / "plan.json").exists()
    training = load_training(None, {"context_parallel": [3], "global_batch_size": 8})
    with pytest.raises(SpecError, match="training: context_parallel: context parallel 3"):
        plan(load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(str(TINY)), training)
    by_default = load_training(None, {})
    assert by_default.context_parallel_degrees(32768) == (1, 2, 4, 8)
    assert by_default.context_parallel_degrees(32770) == (1,)  # 2 x 2 does not divide it, nor any larger degree's
