"""Traffic: bytes per dimension and link class agree with the collectives the cost model times; rail-only check;
the textbook calculator; `hetplan traffic` with a real heatmap."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from predictor.cost_model import (
    GRAD_BYTES_PER_PARAM,
    build_context,
    dp_sync_time_s,
    stage_params,
    tp_collective_time_s,
)
from predictor.traffic import strategy_traffic, textbook_traffic_per_rank
from report.network import TrafficReport, rail_only
from specs import load_cluster, load_model, load_training
from specs.layout import PipelineStrategy, StageStrategy, Strategy, dp_layout, megatron_strategy
from tests.conftest import EXAMPLES

CLUSTER = EXAMPLES / "a100-v100-32.yaml"


def _a100_context(zero_stage: int):
    cluster = load_cluster(CLUSTER)
    cluster = cluster.only(cluster.group("a100"))
    training = load_training(None, {"global_batch_size": 64, "zero_stage": zero_stage})
    return build_context(cluster, load_model("gpt3-1.7b"), training)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_dp_bytes_per_rank_reproduce_the_cost_models_sync_time(zero_stage):
    """Two-level DP over 2 nodes: in-node and rail bytes of one rank, divided by the link bandwidths, plus the ring
    latencies, give the cost model's DP sync time."""
    ctx = _a100_context(zero_stage)
    strategy = megatron_strategy(
        ctx.cluster, ctx.model, ctx.training, group="a100", tp=1, pp=1, dp=16, micro_batch_size=1, recompute="none"
    )
    traffic = strategy_traffic(ctx, strategy)
    group = ctx.cluster.groups[0]
    inner, outer = ctx.in_node_link(group), ctx.rail_link(group)
    per_node, nodes = dp_layout(group, 1, 16)
    sent = {"in_node": 0.0, "rail": 0.0}
    for (src, dst), size in traffic.pairs["dp"].items():
        if src == 0:
            sent[traffic.link_class(src, dst)] += size
    collectives = 2 if zero_stage else 1  # reduce-scatter + all-gather, or one all-reduce
    steps_inner = (per_node - 1) * (1 if zero_stage else 2)
    steps_outer = (nodes - 1) * (1 if zero_stage else 2)
    time_s = sent["in_node"] / inner.bw_bytes_per_s + sent["rail"] / outer.bw_bytes_per_s
    time_s += collectives * (steps_inner * inner.alpha_s + steps_outer * outer.alpha_s)
    params = stage_params(ctx.model, ctx.model.num_layers, True, True, 1)
    assert time_s == pytest.approx(dp_sync_time_s(ctx, group, params, 1, 16).total_s, rel=1e-9)
    assert traffic.total_bytes("tp") == 0 and traffic.total_bytes("pp") == 0
    grads = params * GRAD_BYTES_PER_PARAM
    if zero_stage == 0:  # every rank's in-node share of the two-level all-reduce: 2(r-1)/r of the gradients
        assert sent["in_node"] == pytest.approx(2 * (per_node - 1) / per_node * grads)


def test_zero_weight_gathers_take_the_layout_their_own_time_picks():
    """Under ZeRO-1 the gradients' reduce-scatter and the weights' all-gather each take the faster of a flat ring and
    the two-level form by their own times: with the in-node all-gather made slow, the weights go flat (rank 0 sends
    them to rank 1 only) while the gradients stay two-level (rank 0's rail partner gets its share of them only)."""
    ctx = _a100_context(1)
    strategy = megatron_strategy(
        ctx.cluster, ctx.model, ctx.training, group="a100", tp=1, pp=1, dp=16, micro_batch_size=1, recompute="none"
    )
    group = ctx.cluster.groups[0]
    per_node, nodes = dp_layout(group, 1, 16)
    partner = per_node  # rank 0's peer on its rail, in the next node
    params = stage_params(ctx.model, ctx.model.num_layers, True, True, 1)
    grads, weights = params * GRAD_BYTES_PER_PARAM, params * ctx.training.dtype_bytes
    rail_share = (nodes - 1) / nodes / per_node
    both = strategy_traffic(ctx, strategy).pairs["dp"][(0, partner)]
    assert both == pytest.approx(rail_share * (grads + weights))
    slow_gather = dataclasses.replace(ctx.in_node_link(group), all_gather_extra_s_per_byte=1e-6)
    ctx = dataclasses.replace(ctx, links={**ctx.links, f"{group.device.key}/in_node": slow_gather})
    pairs = strategy_traffic(ctx, strategy).pairs["dp"]
    assert pairs[(0, partner)] == pytest.approx(rail_share * grads)
    assert pairs[(0, 1)] == pytest.approx((per_node - 1) / per_node * grads + 15 / 16 * weights)


def test_tp_and_pp_bytes_follow_the_scheduled_collectives():
    ctx = _a100_context(1)
    strategy = megatron_strategy(
        ctx.cluster, ctx.model, ctx.training, group="a100", tp=4, pp=2, dp=2, micro_batch_size=2, recompute="full"
    )
    traffic = strategy_traffic(ctx, strategy)
    pipeline = strategy.pipelines[0]
    m, layers = pipeline.num_microbatches, ctx.model.num_layers
    activation = 2 * ctx.seq_length * ctx.model.hidden_size * ctx.training.dtype_bytes
    # 6 collectives per layer with full recompute, one for the embedding and one for the LM head
    collectives = m * (layers * 6 + 2) * pipeline.replicas
    assert traffic.total_bytes("tp") == pytest.approx(collectives * 4 * 2 * 3 / 4 * activation)
    group = ctx.cluster.groups[0]
    one = tp_collective_time_s(ctx, group, 2, 4)
    assert one == pytest.approx(2 * 3 / 4 * activation / ctx.in_node_link(group).bw_bytes_per_s + 6 * 5e-6, rel=1e-9)
    # one boundary, both directions, every micro-batch, both replicas
    assert traffic.total_bytes("pp") == pytest.approx(2 * m * 2 * activation)


def test_rail_only_check_finds_a_stage_boundary_that_shifts_local_ranks():
    ctx = _a100_context(1)
    n = ctx.model.num_layers // 2
    aligned = (StageStrategy("a100", 0, n, 2, 0), StageStrategy("a100", n, 2 * n, 2, 8))
    shifted = (StageStrategy("a100", 0, n, 2, 0), StageStrategy("a100", n, 2 * n, 2, 6))
    rail = []
    for stages in (aligned, shifted):
        strategy = Strategy((PipelineStrategy(3, 1, 21, stages),), "none", 1)  # 3 replicas of tp 2: 6 devices
        traffic = strategy_traffic(ctx, strategy)
        rail.append(traffic.spine_pairs()["pp"])
    assert rail[0] == 0 and rail[1] > 0


def test_textbook_dp_volume_equals_a_pure_dp_plan_on_one_node():
    ctx = _a100_context(0)
    group = ctx.cluster.groups[0]
    one_node = ctx.cluster.only(dataclasses.replace(group, nodes=1))
    ctx = build_context(one_node, ctx.model, ctx.training)
    strategy = megatron_strategy(
        one_node, ctx.model, ctx.training, group="a100", tp=1, pp=1, dp=8, micro_batch_size=8, recompute="none"
    )
    traffic = strategy_traffic(ctx, strategy)
    tokens = ctx.training.global_batch_size * ctx.seq_length
    textbook = textbook_traffic_per_rank(
        params=ctx.model.total_params(),
        layers=ctx.model.num_layers,
        hidden_size=ctx.model.hidden_size,
        tokens=tokens,
        global_batch_tokens=tokens,
        ranks=8,
        grad_bytes=GRAD_BYTES_PER_PARAM,
    )
    assert traffic.total_bytes("dp") / 8 == pytest.approx(textbook["dp"])


def test_textbook_example_llama3_70b_on_c4():
    """The seed's example: Llama-3-70B, ~156B tokens, batch 2048 sequences, 8 GPUs (standard ring volumes)."""
    model = load_model("llama3-70b")
    tokens, batch_tokens = 156e9, 2048 * model.seq_length
    result = textbook_traffic_per_rank(
        params=model.total_params(),
        layers=model.num_layers,
        hidden_size=model.hidden_size,
        tokens=tokens,
        global_batch_tokens=batch_tokens,
        ranks=8,
    )
    steps = tokens / batch_tokens
    assert result["dp"] == pytest.approx(steps * 2 * 7 / 8 * model.total_params() * 2)
    assert result["fsdp"] / result["dp"] == pytest.approx(1.5)
    assert result["tp"] == pytest.approx(
        steps * 4 * model.num_layers * 2 * 7 / 8 * batch_tokens * model.hidden_size * 2
    )


@pytest.mark.slow
def test_traffic_command_writes_a_readable_heatmap(tmp_path):
    import matplotlib.image

    from tests.conftest import hetplan, write_plan

    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, CLUSTER, "gpt3-1.7b", 64)
    png = tmp_path / "traffic.png"
    result = hetplan(
        "traffic", str(plan_path), "--cluster", str(CLUSTER), "--tokens", "1e9", "--png", str(png), "--json"
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["total_bytes_per_iteration"] > 0
    assert body["iterations"] == math.ceil(1e9 / (64 * 2048))  # whole iterations
    image = matplotlib.image.imread(png)
    assert image.shape[0] >= 600 and image.shape[1] >= 600
    assert image[..., :3].std() > 0.1  # not a blank canvas
    wrong = hetplan("traffic", str(plan_path), "--cluster", str(EXAMPLES / "hethub-768.yaml"))
    assert wrong.returncode == 2 and "the plan is for cluster" in wrong.stderr


def test_a_tied_models_first_and_last_stages_exchange_the_matrix_as_the_cost_model_times_it():
    """gpt3-1.7b ties its embedding and output: over PP 2 (a node each) the first stage's devices and their last-stage
    counterparts all-reduce their TP shard of the matrix's fp32 gradient, once each way per replica; the bytes of one
    device over the rail, plus the ring latency, are the cost model's time for it."""
    from predictor.cost_model import tied_embedding_sync_time_s

    ctx = _a100_context(1)
    assert ctx.model.tied_embeddings
    strategy = megatron_strategy(
        ctx.cluster, ctx.model, ctx.training, group="a100", tp=4, pp=2, dp=2, micro_batch_size=2, recompute="full"
    )
    pipeline = strategy.pipelines[0]
    first, last = pipeline.stages
    devices = pipeline.stage_devices(first)
    traffic = strategy_traffic(ctx, strategy)
    across = {pair: size for pair, size in traffic.pairs["dp"].items()
              if (pair[0] < devices) != (pair[1] < devices)}  # fmt: skip
    shard_bytes = ctx.model.vocab_size * ctx.model.hidden_size / 4 * GRAD_BYTES_PER_PARAM
    assert len(across) == 2 * 2 * 4 and list(across.values()) == pytest.approx([shard_bytes] * 16)
    # the dp row says how much of it is the tied sum (a plan of one replica sends it too)
    assert traffic.dp_parts == pytest.approx({"tied embedding": 16 * shard_bytes, "across families": 0.0})
    report = TrafficReport("plan", traffic, traffic.by_dimension_and_link(), None, rail_only(traffic))
    sent = f"{16 * shard_bytes / 1e9:,.2f} GB"
    (line,) = report.dp_parts_lines()
    assert line == f"dp is every gradient sync: {sent} of it the tied embedding's sum per iteration"
    group = ctx.cluster.groups[0]
    link = ctx.rail_link(group)
    assert first.device_offset // group.devices_per_node != last.device_offset // group.devices_per_node
    expected_s = shard_bytes / link.bw_bytes_per_s + 2 * link.alpha_s
    assert tied_embedding_sync_time_s(ctx, pipeline.stages, 0) == pytest.approx(expected_s, rel=1e-9)
    assert tied_embedding_sync_time_s(ctx, pipeline.stages, 1) == pytest.approx(expected_s, rel=1e-9)


def test_a_tied_matrix_over_stages_of_different_tp_widths_goes_to_the_ranks_holding_its_rows():
    """First stage at TP 2 and last at TP 1, two replicas: each first-stage device swaps its half of the vocabulary with
    the last stage's one device of its replica, which swaps each half with the device holding it."""
    ctx = _a100_context(1)
    stages = (StageStrategy("a100", 0, 12, 2, 0), StageStrategy("a100", 12, 24, 1, 8))
    strategy = Strategy((PipelineStrategy(2, 1, 32, stages),), "none", 1)
    across = {pair: size for pair, size in strategy_traffic(ctx, strategy).pairs["dp"].items()
              if (pair[0] < 8) != (pair[1] < 8)}  # fmt: skip
    half = ctx.model.vocab_size * ctx.model.hidden_size * GRAD_BYTES_PER_PARAM / 2
    offsets = {0: 0, 1: 2}  # a replica's first TP rank on the first stage; its device on the last is 8 + replica
    expected = {}
    for replica, first in offsets.items():
        for k in range(2):
            expected[(first + k, 8 + replica)] = expected[(8 + replica, first + k)] = half
    assert across == pytest.approx(expected)
