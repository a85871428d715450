"""The cost model against hand-computed cases."""

from __future__ import annotations

import pytest

from predictor.comm_model import (
    IN_NODE_ALPHA_S,
    Link,
    all_reduce_time_s,
    hierarchical_all_reduce_time_s,
    in_node_link,
)
from predictor.cost_model import CostContext, evaluate
from specs import SpecError, get_device, load_model, load_training
from specs.cluster import ClusterSpec, DeviceGroup
from specs.layout import PipelineStrategy, StageStrategy, Strategy
from tests.conftest import EXAMPLES, FixedCosts


def one_node_cluster(device: str = "a100-80gb", nodes: int = 1) -> ClusterSpec:
    group = DeviceGroup("g", get_device(device), nodes, 8, 8, 25e9)
    return ClusterSpec("test", (group,), "rail-optimized", 12.5e9)


def test_ring_all_reduce_formula():
    link = Link("in_node", 100e9, 1e-5)
    # 2(n-1)/n * S / busbw + 2(n-1) * alpha
    assert all_reduce_time_s(1e9, 4, link) == pytest.approx(1.5 * 1e9 / 100e9 + 6 * 1e-5)
    assert all_reduce_time_s(1e9, 1, link) == 0.0


def test_two_level_all_reduce_beats_flat_ring_over_slow_links():
    fast, slow = Link("in_node", 200e9, 5e-6), Link("rail", 25e9, 1e-5)
    size, per_node, nodes = 4e9, 8, 4
    two_level = hierarchical_all_reduce_time_s(size, per_node, nodes, fast, slow)
    expected = 2 * (7 / 8 * size / 200e9 + 7 * 5e-6) + (2 * 3 / 4 * size / 8 / 25e9 + 6 * 1e-5)
    assert two_level == pytest.approx(expected)
    assert two_level < all_reduce_time_s(size, per_node * nodes, slow)


def fixed_context(costs: FixedCosts, **training) -> CostContext:
    cluster = one_node_cluster()
    model = load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    return CostContext(cluster, model, load_training(None, training), {"g": costs})


def test_1f1b_time_by_hand():
    costs = FixedCosts(decoder_s=1.0, embedding_s=0.5, lm_head_s=2.0, activation_bytes=1000.0)
    ctx = fixed_context(costs, global_batch_size=4, zero_stage=0)
    stages = (StageStrategy("g", 0, 5, 1, 0), StageStrategy("g", 5, 8, 1, 1))
    strategy = Strategy((PipelineStrategy(1, 1, 4, stages),), "none", 0)
    ctx.check_strategy(strategy)
    result = evaluate(ctx, strategy)
    t0, t1 = 5 * 1.0 + 0.5, 3 * 1.0 + 2.0  # per micro-batch, TP 1 has no collectives
    model = ctx.model
    p2p = IN_NODE_ALPHA_S + 1 * 256 * model.hidden_size * 2 / in_node_link(ctx.cluster.groups[0]).bw_bytes_per_s
    pipeline = 4 * max(t0, t1) + (t0 + t1 - max(t0, t1)) + 2 * p2p  # m*max + bubble + fill/drain p2p
    assert result.pipeline_time_s == pytest.approx(pipeline)
    params0 = 5 * model.layer_params() + model.embedding_params()
    params1 = 3 * model.layer_params() + model.lm_head_params()
    optimizer = max(params0, params1) * 30 / (get_device("a100-80gb").hbm_bw_bytes_per_s * 0.7)
    assert result.iteration_time_s == pytest.approx(pipeline + optimizer)
    # memory: bf16 weights 2 + fp32 grads 4 + Adam 12 bytes per parameter; stage 0 holds 2 micro-batches in flight
    assert result.stages[0].memory.weights_bytes + result.stages[0].memory.grads_bytes == pytest.approx(6 * params0)
    assert result.stages[0].memory.optimizer_bytes == pytest.approx(12 * params0)
    assert result.stages[0].memory.activation_bytes == pytest.approx(5 * 1000 * 2)
    assert result.stages[1].memory.activation_bytes == pytest.approx(3 * 1000 * 1)
    assert result.tokens_per_s == pytest.approx(4 * 256 / result.iteration_time_s)


def test_zero1_divides_optimizer_state_by_dp_and_interleaving_divides_bubble():
    costs = FixedCosts(decoder_s=1.0)
    ctx0 = fixed_context(costs, global_batch_size=8, zero_stage=0)
    ctx1 = fixed_context(costs, global_batch_size=8, zero_stage=1)
    stages = (StageStrategy("g", 0, 4, 1, 0), StageStrategy("g", 4, 8, 1, 2))
    plain = Strategy((PipelineStrategy(2, 1, 4, stages),), "none", 0)
    zero0 = evaluate(ctx0, plain).stages[0].memory.optimizer_bytes
    zero1 = evaluate(ctx1, Strategy((PipelineStrategy(2, 1, 4, stages),), "none", 1)).stages[0].memory.optimizer_bytes
    assert zero1 == pytest.approx(zero0 / 2)
    v1 = evaluate(ctx0, plain)
    v2 = evaluate(ctx0, Strategy(plain.pipelines, "none", 0, virtual_stages=2))
    # plain 1F1B waits for its sends (one boundary: each stage's per micro-batch time carries it once); interleaving
    # overlaps them (Megatron's default) and divides the bubble by 2
    boundary_s = v1.stages[0].p2p_time_s
    assert boundary_s > 0
    assert v1.stages[0].p2p_exposed_time_s == v1.stages[1].p2p_exposed_time_s == pytest.approx(boundary_s)
    assert v1.bubble_time_s == pytest.approx(4.0 + boundary_s)
    assert v2.bubble_time_s == pytest.approx(2.0)
    assert v1.pipeline_time_s == pytest.approx(4 * (4.0 + boundary_s) + 4.0 + boundary_s)


def test_tp_adds_four_collectives_per_layer():
    costs = FixedCosts(decoder_s=1.0)
    ctx = fixed_context(costs, global_batch_size=1)
    one = evaluate(ctx, Strategy((PipelineStrategy(1, 1, 1, (StageStrategy("g", 0, 8, 1, 0),)),), "none", 1))
    two = evaluate(ctx, Strategy((PipelineStrategy(1, 1, 1, (StageStrategy("g", 0, 8, 2, 0),)),), "none", 1))
    size = 256 * ctx.model.hidden_size * 2
    link = in_node_link(ctx.cluster.groups[0])
    collective = all_reduce_time_s(size, 2, link)
    loss = 3 * all_reduce_time_s(256 * 4, 2, link)  # the vocabulary-parallel loss: 3 fp32 statistics per token
    # 8 layers x 4 collectives, + 1 each for embedding and LM head; FixedCosts ignore TP in compute
    difference = two.stages[0].compute_time_s - one.stages[0].compute_time_s
    assert difference == pytest.approx((8 * 4 + 2) * collective + loss)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ((StageStrategy("g", 0, 4, 1, 0), StageStrategy("g", 5, 8, 1, 1)), "expected \\[4, end > 4\\)"),
        ((StageStrategy("g", 0, 8, 3, 0),), "divisor of 8 devices per node"),
        ((StageStrategy("g", 0, 4, 4, 0), StageStrategy("g", 4, 8, 4, 2)), "overlap"),
        ((StageStrategy("g", 0, 8, 8, 0),), "divisor of the model.s 4 kv heads"),
        ((StageStrategy("g", 0, 7, 1, 0),), "layers cover \\[0, 7\\)"),
        # the strategy's field, named as such (it blamed the cluster file: "cluster.yaml: group: no group named")
        ((StageStrategy("nope", 0, 8, 1, 0),), r"^strategy: pipelines\[0\]\.stages\[0\]\.group: expected a group of"),
    ],
)
def test_invalid_strategies_are_named(stages, message):
    ctx = fixed_context(FixedCosts(), global_batch_size=1)
    with pytest.raises(SpecError, match=message):
        ctx.check_strategy(Strategy((PipelineStrategy(1, 1, 1, stages),), "none", 1))


def test_an_emulated_cpu_group_is_predicted_slower_by_its_speed_and_only_cpu_groups_may_emulate():
    from predictor.cost_model import build_context
    from specs.cluster import ClusterFile, resolve_cluster
    from specs.errors import SpecError
    from specs.model import load_model as load
    from specs.training import TrainingSpec

    def cluster(device: str, speed: float | None) -> object:
        group = {"name": "g", "device": device, "nodes": 1, "devices_per_node": 2, "nics_per_node": 1, "nic_gbps": 10}
        if speed is not None:
            group["emulate_speed"] = speed
        file = {"name": "c", "groups": [group], "network": {"topology": "clos", "inter_group_gbps": 10}}
        return resolve_cluster(ClusterFile.model_validate(file), "c.yaml")

    model, training = load("llama2-7b"), TrainingSpec(dtype="fp32")
    plain = build_context(cluster("cpu", None), model, training).source("g").layer_cost("decoder", 1, 1, "none")
    slowed = build_context(cluster("cpu", 0.25), model, training).source("g").layer_cost("decoder", 1, 1, "none")
    assert slowed.forward_time_s == pytest.approx(4 * plain.forward_time_s)
    assert slowed.backward_time_s == pytest.approx(4 * plain.backward_time_s)
    with pytest.raises(SpecError, match="emulate_speed"):
        cluster("a100-80gb", 0.5)
    # ranks sharing the cores compute slower by their share too, and the costs say which slows them (a local run's
    # "prediction from" read "x2.000", the notation of an emulated group alone)
    shared = build_context(cluster("cpu", 0.25).sharing_cores(0.5), model, training).source("g")
    assert shared.layer_cost("decoder", 1, 1, "none").forward_time_s == pytest.approx(8 * plain.forward_time_s)
    assert shared.identity.endswith(" x8.000 (emulated at 0.25 speed, 0.50 of a core per rank)"), shared.identity
    alone = build_context(cluster("cpu", None).sharing_cores(0.5), model, training).source("g").identity
    assert alone.endswith(" x2.000 (0.50 of a core per rank)"), alone


def test_the_planners_in_flight_table_is_the_cost_models_in_flight_count():
    """The search's memory bounds and the cost model must agree on what a stage holds (1F1B and interleaved, m both
    a multiple of p and not, m smaller than p)."""
    import numpy as np

    from predictor.cost_model import in_flight_microbatches, in_flight_table

    stages = np.array([1, 2, 3, 6, 7])
    depths = np.arange(1, 8)
    for microbatches in (1, 3, 6, 16, 31, 64):
        for virtual in (1, 2, 4):
            table = in_flight_table(depths, microbatches, stages, virtual)
            for row, p in enumerate(stages):
                for depth in range(1, p + 1):
                    expected = in_flight_microbatches(p - depth, p, microbatches, virtual)
                    assert table[row, depth - 1] == expected, (p, depth, microbatches, virtual)


def _one_stage_dp(costs: FixedCosts, zero_stage: int, **training) -> tuple[CostContext, Strategy]:
    """The tiny Llama on one stage, 8 replicas of the one node, 2 micro-batches each."""
    ctx = fixed_context(costs, global_batch_size=16, zero_stage=zero_stage, **training)
    strategy = Strategy((PipelineStrategy(8, 1, 2, (StageStrategy("g", 0, 8, 1, 0),)),), "none", zero_stage)
    ctx.check_strategy(strategy)
    return ctx, strategy


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_zero_stages_shard_state_and_move_their_traffic_by_hand(zero_stage):
    """Bytes per device and DP time of each ZeRO stage on 8 replicas in one node (a ring over NVSwitch), with every
    overlap off so nothing hides: ZeRO 0 all-reduces fp32 gradients after the flush; 1 reduce-scatters them and
    all-gathers bf16 weights; 2 reduce-scatters every micro-batch; 3 also all-gathers the weights before each forward
    and backward, and holds two layers' full weights."""
    costs = FixedCosts(decoder_s=1.0)
    ctx, strategy = _one_stage_dp(
        costs, zero_stage, overlap_grad_reduce=False, overlap_param_gather=False, tp_comm_overlap=False
    )
    result = evaluate(ctx, strategy)
    stage = result.stages[0]
    model = ctx.model
    params = 8 * model.layer_params() + model.embedding_params() + model.lm_head_params()
    link = in_node_link(ctx.cluster.groups[0])

    def ring(size_bytes: float, factor: float) -> float:  # factor 2: all-reduce, 1: reduce-scatter / all-gather
        return factor * 7 / 8 * size_bytes / link.bw_bytes_per_s + factor * 7 * link.alpha_s

    weights = {3: 2 / 8}.get(zero_stage, 2)
    grads = 4 / 8 if zero_stage >= 2 else 4
    optimizer = 12 / 8 if zero_stage >= 1 else 12
    gathered = 2 * model.layer_params() * 2 if zero_stage == 3 else 0.0
    assert stage.memory.weights_bytes == pytest.approx(params * weights + gathered)
    assert stage.memory.grads_bytes == pytest.approx(params * grads)
    assert stage.memory.optimizer_bytes == pytest.approx(params * optimizer)
    grads_s, weights_s = ring(params * 4, 2 if zero_stage == 0 else 1), ring(params * 2, 1)
    per_microbatch = {0: 0.0, 1: 0.0, 2: grads_s, 3: grads_s + 2 * weights_s}[zero_stage]
    tail = {0: grads_s, 1: grads_s + weights_s, 2: weights_s, 3: 0.0}[zero_stage]
    assert stage.sharded_exposed_time_s == pytest.approx(per_microbatch)
    assert stage.dp_exposed_time_s == pytest.approx(tail)
    assert result.pipeline_time_s == pytest.approx(2 * (8.0 + per_microbatch))


def test_zero3_traffic_hides_behind_compute_when_prefetched():
    costs = FixedCosts(decoder_s=1.0)  # a second per layer: far longer than the tiny model's gathers
    ctx, strategy = _one_stage_dp(costs, 3)
    stage = evaluate(ctx, strategy).stages[0]
    assert stage.sharded_exposed_time_s == 0.0 and stage.dp_exposed_time_s == 0.0


def test_plain_1f1b_waits_for_a_slow_boundary_once_per_micro_batch():
    """Two stages on two nodes joined by a slow TCP NIC: each micro-batch's time carries the boundary once on each
    side, and the pipeline is m * max(T + c) + (sum - max) with no separate fill and drain."""
    group = DeviceGroup("g", get_device("a100-80gb"), 2, 8, 1, 25e9 / 8, transport="tcp")
    cluster = ClusterSpec("test", (group,), "rail-optimized", 25e9 / 8)
    model = load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    ctx = CostContext(cluster, model, load_training(None, {"global_batch_size": 4}), {"g": FixedCosts(1.0)})
    stages = (StageStrategy("g", 0, 4, 1, 0), StageStrategy("g", 4, 8, 1, 8))
    result = evaluate(ctx, Strategy((PipelineStrategy(1, 1, 4, stages),), "none", 1))
    c = result.stages[0].p2p_time_s
    rail = ctx.rail_link(group)
    assert rail.bw_bytes_per_s == pytest.approx(25e9 / 8 / 8 * 0.6)  # a device's share of one TCP NIC
    assert c == pytest.approx(rail.alpha_s + 256 * model.hidden_size * 2 / rail.bw_bytes_per_s)
    assert [s.p2p_exposed_time_s for s in result.stages] == pytest.approx([c, c])
    assert result.pipeline_time_s == pytest.approx(4 * (4.0 + c) + (4.0 + c))


def test_fp8_runs_where_the_device_has_it_and_keeps_bf16_state():
    """An H100 stage and an A100 stage trained in fp8: the H100's GEMMs run at its FP8 peak and it keeps an fp8
    copy of its weights; the A100 (no FP8) runs bf16; MFU is against the 16-bit peaks."""
    from predictor.cost_model import build_context

    h100 = DeviceGroup("h", get_device("h100"), 1, 8, 8, 50e9)
    a100 = DeviceGroup("a", get_device("a100-80gb"), 1, 8, 8, 25e9)
    cluster = ClusterSpec("mixed", (h100, a100), "rail-optimized", 12.5e9)
    model = load_model("llama2-7b")
    fp8 = build_context(cluster, model, load_training(None, {"dtype": "fp8", "global_batch_size": 8}))
    bf16 = build_context(cluster, model, load_training(None, {"dtype": "bf16", "global_batch_size": 8}))
    assert fp8.source("h").dtype == "fp8" and fp8.source("a").dtype == "bf16"
    assert fp8.source("a").layer_cost("decoder", 1, 1, "none") == bf16.source("a").layer_cost("decoder", 1, 1, "none")
    gemm = fp8.source("h")._gemm_time_s(8192, 8192, 8192)  # compute-bound: 2 * 8192^3 FLOPs at the FP8 peak
    device = get_device("h100")
    efficiency = device.gemm_efficiency * fp8.source("h")._size_efficiency(2 * 8192**3) * 8192 / (8192 + 64)
    cast = 3 * 8192 * 8192 / (device.hbm_bw_bytes_per_s * 0.8)
    assert gemm == pytest.approx(2 * 8192**3 / (1979e12 * efficiency) + cast)
    stages = (StageStrategy("h", 0, 16, 8, 0), StageStrategy("a", 16, 32, 8, 0))
    strategy = Strategy((PipelineStrategy(1, 1, 8, stages),), "none", 1)
    low, high = evaluate(fp8, strategy), evaluate(bf16, strategy)
    params_h = (16 * model.layer_params() + model.embedding_params()) / 8
    extra = low.stages[0].memory.weights_bytes - high.stages[0].memory.weights_bytes
    assert extra == pytest.approx(params_h)  # one byte per parameter on the FP8 device only
    assert low.stages[1].memory.total_bytes == pytest.approx(high.stages[1].memory.total_bytes)
    assert low.iteration_time_s < high.iteration_time_s
    assert low.mfu == pytest.approx(high.mfu * high.iteration_time_s / low.iteration_time_s)


def test_a_runs_predicted_terms_per_stage_add_up_to_the_iteration_by_hand():
    """The run record's predicted terms (predictor/run_terms.py) for the 1F1B case above: forward and backward are a
    third and two thirds of each stage's layers (FixedCosts), the rest of the pipeline is waiting, each stage's terms
    add up to its step and the slowest stage's step is the iteration."""
    from predictor.run_terms import TERMS, predicted_stage_terms

    costs = FixedCosts(decoder_s=1.0, embedding_s=0.5, lm_head_s=2.0)
    ctx = fixed_context(costs, global_batch_size=4, zero_stage=0)
    stages = (StageStrategy("g", 0, 5, 1, 0), StageStrategy("g", 5, 8, 1, 1))
    strategy = Strategy((PipelineStrategy(1, 1, 4, stages),), "none", 0)
    result = evaluate(ctx, strategy)
    first, second = predicted_stage_terms(ctx, result)
    assert first["terms"]["forward"] == pytest.approx(4 * (5 + 0.5) / 3)
    assert first["terms"]["backward"] == pytest.approx(4 * 2 * (5 + 0.5) / 3)
    assert second["terms"]["forward"] == pytest.approx(4 * (3 + 2) / 3)
    assert first["terms"]["tp_comm"] == pytest.approx(0.0, abs=1e-12) and first["terms"]["dp_sync"] == 0.0  # TP 1, DP 1
    assert first["terms"]["pipeline_wait"] == pytest.approx(result.pipeline_time_s - 4 * 5.5)
    assert second["terms"]["pipeline_wait"] == pytest.approx(result.pipeline_time_s - 4 * 5.0)
    for stage in (first, second):
        assert set(stage["terms"]) == set(TERMS)
        assert stage["step"] == pytest.approx(sum(stage["terms"].values()))
    assert max(first["step"], second["step"]) == pytest.approx(result.iteration_time_s)


def test_a_tied_models_first_and_last_stages_all_reduce_the_matrix_after_the_dp_sync():
    """Megatron's embedding group: the first stage's embedding and the last stage's copy of it as the LM head sum their
    gradients after the DP sync, each device its TP shard in fp32, over the link between the two stages; a middle
    stage and a one-stage pipeline have nothing to sum. The stage cache tells a near partner from a far one."""
    from dataclasses import replace

    from predictor.cost_model import GRAD_BYTES_PER_PARAM

    costs = FixedCosts(decoder_s=1.0, embedding_s=0.5, lm_head_s=2.0, activation_bytes=1000.0)
    untied_ctx = CostContext(one_node_cluster(nodes=2), load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")),
                             load_training(None, {"global_batch_size": 4, "zero_stage": 0}), {"g": costs})  # fmt: skip
    tied_ctx = replace(untied_ctx, model=untied_ctx.model.model_copy(update={"tied_embeddings": True}))
    model = tied_ctx.model

    def three_stages(last_offset: int) -> Strategy:
        stages = (
            StageStrategy("g", 0, 3, 2, 0),
            StageStrategy("g", 3, 6, 2, 2),
            StageStrategy("g", 6, 8, 2, last_offset),
        )
        return Strategy((PipelineStrategy(1, 1, 4, stages),), "none", 0)

    near, far = three_stages(4), three_stages(8)  # the last stage on the first's node, or on the next node
    group = tied_ctx.cluster.groups[0]
    shard_bytes = model.vocab_size * model.hidden_size / 2 * GRAD_BYTES_PER_PARAM
    for strategy, link in ((near, tied_ctx.in_node_link(group)), (far, tied_ctx.rail_link(group))):
        tied, untied = evaluate(tied_ctx, strategy), evaluate(untied_ctx, strategy)
        matrix_s = all_reduce_time_s(shard_bytes, 2, link)
        assert matrix_s > 0
        exposed = [t.dp_exposed_time_s - u.dp_exposed_time_s for t, u in zip(tied.stages, untied.stages, strict=True)]
        assert exposed == pytest.approx([matrix_s, 0.0, matrix_s])
        assert tied.iteration_time_s - untied.iteration_time_s == pytest.approx(matrix_s)
    cache: dict = {}
    evaluate(tied_ctx, near, cache)
    assert (
        evaluate(tied_ctx, far, cache).stages[2].dp_exposed_time_s
        == evaluate(tied_ctx, far).stages[2].dp_exposed_time_s
    )
    one_stage = Strategy((PipelineStrategy(1, 1, 4, (StageStrategy("g", 0, 8, 2, 0),)),), "none", 0)
    assert evaluate(tied_ctx, one_stage).stages[0].dp_sync_time_s == 0.0
