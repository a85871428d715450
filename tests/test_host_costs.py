"""Local runs on this host's CPU processes: the host costs a profile measures (profiler/host.py), the links measured
between local processes (load terms), and how the cost model uses them (predictor/host.py), by hand."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from predictor.calibration import apply, parameters_for
from predictor.comm_model import Link, all_reduce_time_s
from predictor.cost_model import (
    CostContext,
    EndToEndTerms,
    Evaluation,
    cross_family_sync_time_s,
    evaluate,
    simulated_step,
    stage_params,
    tp_collective_time_s,
)
from predictor.host import (
    STRETCH_TOLERANCE,
    busy_processes,
    evaluate_on_host,
    loaded,
    local_run_context,
    on_host,
    simulate_on_host,
    step_overhead_s,
)
from predictor.link_model import LinkPoint, fit_link
from predictor.predictor import Predictor, fit_predictor
from predictor.run_terms import predicted_stage_terms, side_by_side
from predictor.schedule import forward_share
from predictor.sharing import _actors, held_layers, simulate_step
from profiler.collectives import bus_factor, latency_steps
from profiler.profile import HostCosts, load_profile
from profiler.profiles import load_profiles
from profiler.simulated import SimulatedDevice
from specs import SpecError, load_cluster, load_training
from specs.layout import PipelineStrategy, StageStrategy, Strategy
from specs.model import ModelSpec
from tests.conftest import EXAMPLES, FixedCosts

MODEL = ModelSpec(
    key="host-test", num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_kv_heads=2,
    vocab_size=512, seq_length=32, mlp="swiglu",
)  # fmt: skip
HOST = HostCosts(
    cores=2,
    concurrency=[{"processes": 2, "busy_stretch": 1.1}, {"processes": 4, "busy_stretch": 1.25}],
    optimizer_s_per_param=1e-9,
    flatten_s_per_param=2e-9,
    gather_s_per_param=0.5e-9,
    microbatch_overhead_s=1e-3,
    layer_overhead_s=1e-4,
    batch_s=2e-3,
    batch_s_per_sample=1e-4,
)
HOST_LINK = Link("host", 1e9, 1e-3, load_alpha_s=5e-4, load_s_per_byte=1e-9, p2p_alpha_s=2e-3, p2p_load_alpha_s=1e-3)


def test_stretch_is_the_measured_busy_stretch_times_time_slicing_beyond_the_cores():
    assert HOST.stretch(1) == 1.0
    assert HOST.stretch(2) == pytest.approx(1.1)  # two processes on two cores: their busy stretch only
    assert HOST.stretch(3) == pytest.approx((1.1 + 1.25) / 2 * 3 / 2)  # interpolated, and 3 processes on 2 cores
    assert HOST.stretch(4) == pytest.approx(1.25 * 2)
    assert HOST.stretch(8) == pytest.approx(1.25 * 4)  # past the last point: its busy stretch, four per core
    faster = HostCosts.model_validate({**HOST.model_dump(), "concurrency": [{"processes": 2, "busy_stretch": 0.9}]})
    assert faster.stretch(2) == 1.0  # a measurement below 1 is noise: processes do not speed each other up
    assert HOST.data_time_s(8) == pytest.approx(2e-3 + 8e-4)


def test_a_link_under_load_adds_its_load_terms_per_process_per_core_beyond_one():
    assert HOST_LINK.under_load(1.0) is HOST_LINK and HOST_LINK.under_load(0.5) is HOST_LINK
    loaded = HOST_LINK.under_load(2.0)
    assert loaded.alpha_s == pytest.approx(1.5e-3)
    assert 1 / loaded.bw_bytes_per_s == pytest.approx(1e-9 + 1e-9)
    # p2p: its latency 2 + 1 ms; its bytes at the collectives' unloaded rate (it has no rate nor load of its own)
    assert loaded.p2p_time_s(1e6) == pytest.approx(3e-3 + 1e6 * 1e-9)
    assert loaded.under_load(3.0) is loaded  # the load is applied once


def test_link_fit_recovers_latency_bandwidth_and_load_terms_from_mean_times():
    alpha, beta, load_alpha, load_beta = 1e-3, 1e-9, 6e-4, 5e-10
    points = []
    for ranks, per_core in ((2, 1.0), (2, 2.0), (4, 2.0), (2, 1.5)):
        excess = per_core - 1.0
        for size in (4096, 65536, 2**20, 2**24):
            steps, volume = latency_steps("all_reduce", ranks), size * bus_factor("all_reduce", ranks)
            mean = steps * (alpha + excess * load_alpha) + volume * (beta + excess * load_beta)
            # the median is a decoy: a point with its mean time is fitted on the mean
            points.append(LinkPoint(collective="all_reduce", ranks=ranks, size_bytes=size, time_s=mean / 3,
                                    mean_time_s=mean, processes_per_core=per_core))  # fmt: skip
    link, error = fit_link("host", points)
    assert error < 1e-6
    assert link.alpha_s == pytest.approx(alpha, rel=1e-4) and 1 / link.bw_bytes_per_s == pytest.approx(beta, rel=1e-4)
    assert link.load_alpha_s == pytest.approx(load_alpha, rel=1e-4)
    assert link.load_s_per_byte == pytest.approx(load_beta, rel=1e-4)
    assert link.slowdown_per_doubling == pytest.approx(0.0, abs=1e-6)


def test_a_links_cpu_share_is_its_ranks_cpu_time_over_their_time_unloaded():
    def point(size: int, per_core: float, mean_s: float, cpu_s: float) -> LinkPoint:
        return LinkPoint(collective="all_reduce", ranks=2, size_bytes=size, time_s=mean_s, mean_time_s=mean_s,
                         processes_per_core=per_core, mean_cpu_time_s=cpu_s)  # fmt: skip

    points = [point(4096, 1.0, 1e-3, 0.4e-3), point(2**20, 1.0, 3e-3, 2.0e-3), point(2**20, 2.0, 9e-3, 1.0e-3)]
    link, _ = fit_link("host", points)
    assert link.cpu_share == pytest.approx(2.4e-3 / 4e-3)  # the loaded point left out
    assert link.under_load(2.0).cpu_share == link.cpu_share
    untimed = [p.model_copy(update={"mean_cpu_time_s": 0.0}) for p in points]
    assert fit_link("host", untimed)[0].cpu_share == 0.0  # a profile from before: no CPU in collectives


def host_context(**training: object) -> CostContext:
    cluster = load_cluster(EXAMPLES / "cpu-even.yaml")  # two groups of 2 CPU processes, no emulation
    costs = FixedCosts(decoder_s=0.01, embedding_s=0.002, lm_head_s=0.004)
    spec = load_training(None, {"dtype": "fp32", "zero_stage": 1, "seq_length": 32, "global_batch_size": 8, **training})
    sources = {group.name: costs for group in cluster.groups}
    return CostContext(cluster, MODEL, spec, sources, links={"cpu/host": HOST_LINK}, host={"cpu": HOST})


def one_stage(replicas: int = 1, tp: int = 1, group: str = "left") -> Strategy:
    stage = StageStrategy(group, 0, MODEL.num_layers, tp)
    return Strategy((PipelineStrategy(replicas, 1, 8 // replicas, (stage,)),), "none", 1)


def test_one_busy_process_costs_its_layers_the_stage_and_step_overheads_and_the_measured_optimizer():
    ctx = host_context()
    strategy = one_stage()
    assert busy_processes(ctx, strategy) == 1  # the three idle ranks do not share the cores
    result = evaluate(ctx, strategy)
    per_microbatch = 4 * 0.01 + 0.002 + 0.004 + (1e-3 + 4 * 1e-4)  # layers, edges, stage overhead
    params = 4 * MODEL.layer_params() + MODEL.embedding_params() + MODEL.lm_head_params()
    optimizer = params * (1e-9 + 2e-9)  # no DP: the shard is every parameter held
    assert result.stages[0].optimizer_time_s == pytest.approx(optimizer)
    assert result.iteration_time_s == pytest.approx(8 * per_microbatch + optimizer + 2e-3 + 8 * 1e-4)


def test_a_loaded_context_stretches_compute_and_loads_the_links():
    ctx = host_context()
    strategy = one_stage(replicas=2, tp=2)
    assert busy_processes(ctx, strategy) == 4
    shared = loaded(ctx, 2.0, 2.5)  # four processes busy all the time on two cores: HOST.stretch(4) = 2.5
    assert loaded(ctx, 2.0, 2.5) is shared  # made once per load and stretch
    # TP 2 over the host link with two processes per core: latency 1 + 0.5 ms, 1 + 1 ns per byte
    size = 1 * 32 * MODEL.hidden_size * 4
    expected = 2 * 1 / 2 * size * 2e-9 + 2 * 1.5e-3
    group = ctx.cluster.group("left")
    assert tp_collective_time_s(shared, group, 1, 2) == pytest.approx(expected)
    assert tp_collective_time_s(ctx, group, 1, 2) == pytest.approx(all_reduce_time_s(size, 2, HOST_LINK))
    evaluation = evaluate(shared, strategy)
    stage = evaluation.stages[0]
    layers_and_overhead = 2.5 * (4 * 0.01 + 0.002 + 0.004 + 1e-3 + 4 * 1e-4 / 2)
    loss = 3 * (2 * 1 / 2 * 32 * 4 * 2e-9 + 2 * 1.5e-3)  # the loss's 3 all-reduces of one fp32 number per token
    # the TP collectives: 4 per layer, the embedding's and the head's, the loss's (all waits, as the runtime times them)
    assert stage.tp_comm_time_s == pytest.approx(4 * 4 * expected + 2 * expected + loss)
    assert stage.compute_time_s == pytest.approx(layers_and_overhead + stage.tp_comm_time_s)
    shard = (4 * MODEL.layer_params() + MODEL.embedding_params() + MODEL.lm_head_params()) / 2
    # ZeRO-1 over 2 replicas: half the update, everything flattened, the shard padded and the pieces joined
    assert stage.optimizer_time_s == pytest.approx(2.5 * (shard / 2 * 1e-9 + shard * (2e-9 + 0.5e-9)))
    # the run record's terms of that stage: the stage overhead in forward and backward (as the runtime's timers see
    # it), not mistaken for TP collectives; making the batch under `other`
    terms = predicted_stage_terms(ctx, evaluation)[0]["terms"]
    assert terms["forward"] + terms["backward"] == pytest.approx(4 * layers_and_overhead)
    assert terms["forward"] == pytest.approx(terms["backward"] / 2)  # FixedCosts: backward = 2 x forward
    assert terms["other"] == pytest.approx(2.5 * (2e-3 + 8e-4))
    assert terms["tp_comm"] == pytest.approx(4 * stage.tp_comm_time_s)


def test_zero1s_weight_gather_is_in_the_optimizer_term_as_the_runtime_times_it():
    """The runtime all-gathers ZeRO-1's updated shards inside its optimizer step: the predicted terms put the gather
    there too (the reduction stays in dp_sync); without ZeRO there is no gather."""
    from predictor.sharding import dp_sync_time_s

    for zero_stage, gathers in ((1, True), (0, False)):
        ctx = host_context(zero_stage=zero_stage, overlap_grad_reduce=False, overlap_param_gather=False)  # as run
        evaluation = evaluate(ctx, replace(one_stage(replicas=2), zero_stage=zero_stage))
        stage = evaluation.stages[0]
        params = 4 * MODEL.layer_params() + MODEL.embedding_params() + MODEL.lm_head_params()
        sync = dp_sync_time_s(on_host(ctx, evaluation), ctx.cluster.group("left"), params, 1, 2)
        assert stage.gather_exposed_time_s == pytest.approx(sync.params_s if gathers else 0.0)
        assert (stage.gather_exposed_time_s > 0) == gathers and stage.dp_exposed_time_s > stage.gather_exposed_time_s
        terms = predicted_stage_terms(ctx, evaluation)[0]["terms"]
        assert terms["optimizer"] == pytest.approx(stage.optimizer_time_s + stage.gather_exposed_time_s)
        assert terms["dp_sync"] == pytest.approx(stage.dp_exposed_time_s - stage.gather_exposed_time_s)


def test_a_stages_measured_terms_are_a_rank_of_a_replica_with_the_most_microbatches():
    """Two replicas of one stage run 4 and 3 micro-batches (an odd batch): the predicted terms describe the one with
    4, so the record reports its rank, though the other, waiting for it in its sync, ended its step a little later."""
    from runtime.launch import summarize

    def result(rank: int, microbatches: int, step_s: float, sync_s: float) -> dict:
        step = {"time_s": step_s, "compute_s": 0.05, "emulation_s": 0.0, "wait_s": 0.0, "sync_s": sync_s}
        return {"rank": rank, "family": 0, "stage": 0, "replica": rank, "tp_rank": 0, "cp_rank": 0, "group": "left",
                "layers": [0, 4], "emulate_speed": 1.0, "microbatches": microbatches, "steps": [step, step],
                "loss_contributions": [0.0, 0.0], "last_stage": True, "max_rss_bytes": 1}  # fmt: skip

    stage = summarize([result(0, 4, 0.100, 0.005), result(1, 3, 0.101, 0.030)], 2)["stages"][0]
    assert stage["rank"] == 0 and stage["terms"]["dp_sync"] == pytest.approx(0.005)
    even = summarize([result(0, 4, 0.100, 0.005), result(1, 4, 0.101, 0.030)], 2)["stages"][0]
    assert even["rank"] == 1  # replicas alike: the slowest


QUIET = HostCosts(
    cores=2, concurrency=[{"processes": 4, "busy_stretch": 1.0}], optimizer_s_per_param=0.0, flatten_s_per_param=0.0,
    microbatch_overhead_s=0.0, layer_overhead_s=0.0, batch_s=0.0, batch_s_per_sample=0.0,
)  # fmt: skip
INSTANT = Link("host", 1e18, 0.0)  # collectives take no time: the simulation's compute alone


def quiet_context(left_s: float, right_s: float, **training: object) -> CostContext:
    cluster = load_cluster(EXAMPLES / "cpu-even.yaml")
    sources = {"left": FixedCosts(decoder_s=left_s), "right": FixedCosts(decoder_s=right_s)}
    spec = load_training(None, {"dtype": "fp32", "zero_stage": 1, "seq_length": 32, "global_batch_size": 8, **training})
    return CostContext(cluster, MODEL, spec, sources, links={"cpu/host": INSTANT}, host={"cpu": QUIET})


def two_families() -> Strategy:
    """2 x TP 1 on the left group and 1 x TP 2 on the right, one micro-batch each, every layer on each."""
    families = (
        PipelineStrategy(2, 1, 1, (StageStrategy("left", 0, 4, 1),)),
        PipelineStrategy(1, 1, 1, (StageStrategy("right", 0, 4, 2),)),
    )
    return Strategy(families, "none", 1)


def test_the_step_simulation_without_contention_is_the_1f1b_formula():
    ctx = quiet_context(0.01, 0.03)  # a PP 2 of one process per stage on two cores: no sharing
    stages = (StageStrategy("left", 0, 2, 1), StageStrategy("right", 2, 4, 1))
    strategy = Strategy((PipelineStrategy(1, 1, 8, stages),), "none", 1)
    unstretched = evaluate(loaded(ctx, 1.0, 1.0), strategy)
    simulated = simulate_step(ctx, unstretched, QUIET, step_overhead_s(ctx, unstretched.strategy))
    t0, t1 = 2 * 0.01, 2 * 0.03  # per micro-batch; no p2p, no sync, no optimizer
    assert simulated.time_s == pytest.approx(t0 + t1 + 7 * max(t0, t1))
    assert simulated.mean_busy_processes == pytest.approx((8 * t0 + 8 * t1) / simulated.time_s)
    assert evaluate(ctx, strategy).iteration_time_s == pytest.approx(simulated.time_s)


def test_a_traced_step_simulation_lays_out_each_actors_events_as_a_run_record_does():
    """The PP 2 above (8 micro-batches): each stage's 8 forwards and 8 backwards in 1F1B order; the second stage
    waits for the first's forward before each of its warm-up passes, and the first for the second's backward; the
    events of an actor follow each other and the last ends with the step."""
    ctx = quiet_context(0.01, 0.03)
    stages = (StageStrategy("left", 0, 2, 1), StageStrategy("right", 2, 4, 1))
    strategy = Strategy((PipelineStrategy(1, 1, 8, stages),), "none", 1)
    unstretched = evaluate(loaded(ctx, 1.0, 1.0), strategy)
    traced = simulate_step(ctx, unstretched, QUIET, step_overhead_s(ctx, unstretched.strategy), trace=True)
    assert simulate_step(ctx, unstretched, QUIET, step_overhead_s(ctx, unstretched.strategy)).timeline == ()
    first, second = traced.timeline
    assert [(a["family"], a["stage"], a["replica"]) for a in traced.timeline] == [(0, 0, 0), (0, 1, 0)]
    t0_forward = forward_share(ctx, unstretched, 0) * 2 * 0.01
    passes = [kind for kind, _, _ in second["events"] if kind != "wait"]
    assert passes == ["forward", "backward"] * 8  # the last stage: one forward, one backward
    assert second["events"][0] == ["wait", 0.0, pytest.approx(t0_forward)]
    kinds = [kind for kind, _, _ in first["events"]]
    assert kinds.count("forward") == 8 and kinds.count("backward") == 8 and kinds[:2] == ["forward", "forward"]
    assert kinds[2] == "wait"  # for the second stage's first backward
    for actor in traced.timeline:
        ends = [end for _, _, end in actor["events"]]
        starts = [start for _, start, _ in actor["events"]]
        assert starts[1:] == pytest.approx(ends[:-1])
    assert max(a["events"][-1][2] for a in traced.timeline) == pytest.approx(traced.time_s)


def test_a_run_records_the_simulated_step_of_its_prediction_as_json():
    """The record's predicted timeline is the simulation behind evaluate(): the same step, at the strategy's own
    ZeRO stage too, and plain JSON; a context without host costs has none."""
    from runtime.launch import predicted_timeline

    ctx = quiet_context(0.01, 0.03)
    stages = (StageStrategy("left", 0, 2, 1), StageStrategy("right", 2, 4, 1))
    strategy = Strategy((PipelineStrategy(1, 1, 8, stages),), "none", 1)
    direct = simulate_on_host(ctx, strategy, lambda at: evaluate(at, strategy))
    simulated = simulated_step(ctx, strategy)
    assert simulated is not None and simulated.time_s == pytest.approx(direct.time_s) and simulated.timeline
    assert evaluate(ctx, strategy).iteration_time_s == pytest.approx(simulated.time_s)  # no stretch, no fixed cost
    zero3 = replace(strategy, zero_stage=3)  # the plan's own stage, not the training's 1
    assert simulated_step(ctx, zero3) == simulated_step(
        replace(ctx, training=ctx.training.model_copy(update={"zero_stage": 3})), zero3
    )
    record = json.loads(json.dumps(predicted_timeline(ctx, strategy)))
    assert record["step_s"] == pytest.approx(simulated.time_s) and len(record["actors"]) == 2
    assert record["actors"][1]["events"][0][0] == "wait"
    assert predicted_timeline(replace(ctx, host={}), strategy) is None
    # a stage's measured row gets the simulated CPU time of a process of the measured rank's replica
    second = record["actors"][1]["cpu_s"]
    assert second["step"] == pytest.approx(8 * 2 * 0.03)  # 8 micro-batches of its 2 layers, nothing shared
    measured = {"family": 0, "stage": 1, "group": "right", "rank": 1, "replica": 0, "step_s": 0.6,
                "terms": {"forward": 0.2, "backward": 0.3}, "cpu_s": {"step": 0.55}}  # fmt: skip
    predicted = predicted_stage_terms(ctx, evaluate(ctx, strategy))
    (row,) = side_by_side([measured], predicted, record)
    assert row["predicted_cpu_s"] == second and row["cpu_s"] == {"step": 0.55}
    (older,) = side_by_side([{k: v for k, v in measured.items() if k != "replica"}], predicted, record)
    assert older["predicted_cpu_s"] is None  # a record from before the rows said their replica


def test_a_stage_syncs_and_steps_as_soon_as_its_own_replicas_are_done():
    """PP 2 as above, with a 50 ms optimizer step on the last stage: it starts when that stage's last backward ends,
    while the first stage still runs its last backward (its DP group has no one else to wait for), not after every
    stage's passes."""
    ctx = quiet_context(0.01, 0.03)
    stages = (StageStrategy("left", 0, 2, 1), StageStrategy("right", 2, 4, 1))
    strategy = Strategy((PipelineStrategy(1, 1, 8, stages),), "none", 1)
    unstretched = evaluate(loaded(ctx, 1.0, 1.0), strategy)
    steps = tuple(replace(s, optimizer_time_s=0.05 if s.stage.layer_start == 2 else 0.0) for s in unstretched.stages)
    unstretched = replace(unstretched, stages=steps)
    simulated = simulate_step(ctx, unstretched, QUIET, step_overhead_s(ctx, unstretched.strategy))
    t0, t1 = 2 * 0.01, 2 * 0.03
    first_backward_s = (1 - forward_share(ctx, unstretched, 0)) * t0
    assert simulated.time_s == pytest.approx(t0 + t1 + 7 * t1 - first_backward_s + 0.05)


def test_an_actor_syncs_with_the_actors_holding_some_of_its_layers():
    ctx = quiet_context(0.01, 0.03, global_batch_size=4)
    halves = (StageStrategy("left", 0, 2, 1), StageStrategy("right", 2, 4, 1))
    replicas = Strategy((PipelineStrategy(2, 1, 1, halves),), "none", 1)
    actors = _actors(ctx, evaluate(ctx, replicas), 0.0)  # family, stage, replica
    assert [a.partners for a in actors] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    # beside a family holding every layer, each half syncs with it, and it with both halves
    beside = Strategy(
        (PipelineStrategy(1, 1, 2, halves), PipelineStrategy(1, 1, 2, (StageStrategy("left", 0, 4, 1),))), "none", 1
    )
    assert [a.partners for a in _actors(ctx, evaluate(ctx, beside), 0.0)] == [(0, 2), (1, 2), (0, 1, 2)]


def test_interleaved_stages_hold_their_chunks_layers_not_their_nominal_range():
    """v = 2 over 8 layers: stages [0, 6) and [6, 8) deal chunks of 3, 1, 3, 1 layers in model order, so the first
    stage holds layers 0-2 and 4-6 (and the embedding), the second 3 and 7."""
    two = PipelineStrategy(1, 1, 2, (StageStrategy("left", 0, 6, 1), StageStrategy("right", 6, 8, 1)))
    assert held_layers(two, 2, tied_embeddings=False) == [frozenset({-1, 0, 1, 2, 4, 5, 6}), frozenset({3, 7})]
    assert held_layers(two, 1, tied_embeddings=True) == [frozenset({-1, *range(6)}), frozenset({-1, 6, 7})]


def test_processes_that_finish_early_give_their_cores_to_the_others():
    """Two families on two cores: 2 processes of 6 ms work each and a TP-2 pair of 10 ms work each. All four compute
    at half a core until the first family is done at 12 ms (the pair has done 6 of its 10 ms), then the pair has a core
    each for its last 4 ms: 16 ms, where stretching everything by 4 busy / 2 cores would say 20 ms."""
    ctx = quiet_context(0.006 / 4, 0.01 / 4)  # 4 layers, one micro-batch each; TP 2 halves nothing in FixedCosts
    strategy = two_families()
    ctx = replace(ctx, training=ctx.training.model_copy(update={"global_batch_size": 3}))
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), strategy)
    simulated = simulate_step(ctx, unstretched, QUIET, step_overhead_s(ctx, unstretched.strategy))
    assert simulated.time_s == pytest.approx(0.016)
    # busy: computing or waiting for a core: four for 12 ms, two for 4 ms
    assert simulated.mean_busy_processes == pytest.approx((4 * 0.012 + 2 * 0.004) / 0.016)
    # the evaluation is the analytic one stretched to the simulated step
    assert evaluate(ctx, strategy).iteration_time_s == pytest.approx(0.016, rel=1e-6)


def test_the_step_simulation_counts_each_processs_cpu_time_as_a_run_record_measures_it():
    """The two families above: each process's CPU time is its work (6 ms, 6 ms, 10 ms), however the cores were
    shared; the four ran at half a core while all computed, so the CPU the step used fills the two cores until 12 ms.
    With a pair whose collectives compute half their time, that part of its CPU is its `tp_comm`."""
    ctx = quiet_context(0.006 / 4, 0.01 / 4)
    ctx = replace(ctx, training=ctx.training.model_copy(update={"global_batch_size": 3}))
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), two_families())
    traced = simulate_step(ctx, unstretched, QUIET, 0.0, trace=True)
    assert [a["cpu_s"]["step"] for a in traced.timeline] == pytest.approx([0.006, 0.006, 0.010])
    assert all(a["cpu_s"]["tp_comm"] == a["cpu_s"]["dp_sync"] == 0.0 for a in traced.timeline)
    # the pair waits 4 ms per micro-batch in collectives that compute half of it: 2 ms more of CPU, as tp_comm
    stages = tuple(replace(s, tp_comm_time_s=0.004, compute_time_s=s.compute_time_s + 0.004) if s.family else s
                   for s in unstretched.stages)  # fmt: skip
    pair_links = replace(ctx, links={"cpu/host": replace(INSTANT, cpu_share=0.5)})
    traced = simulate_step(pair_links, replace(unstretched, stages=stages), QUIET, 0.0, trace=True)
    pair = traced.timeline[2]["cpu_s"]
    assert pair["tp_comm"] == pytest.approx(0.002) and pair["step"] == pytest.approx(0.012)


def test_a_wait_on_the_links_takes_the_time_of_the_load_while_it_waits():
    """The families above, the TP pair waiting 4 ms on its links after each pass with every process busy (two per
    core) and 1 ms unloaded. The pair computes its forward first (3.3 ms; it is served first), waits 4 ms while the
    left ones compute, computes its backward (6.7 ms), then waits: 2 ms with the left ones finishing their last
    2 ms, and the other half of the wait, alone on the host, at its unloaded rate (0.5 ms): 16.5 ms. A fixed loaded
    wait would say 18 ms."""
    ctx = quiet_context(0.006 / 4, 0.01 / 4, global_batch_size=3)
    strategy = two_families()

    def with_tp_waits(evaluation: Evaluation, waits_s: float) -> Evaluation:
        stages = tuple(
            replace(s, compute_time_s=s.compute_time_s + waits_s, tp_comm_time_s=waits_s) if s.stage.tp == 2 else s
            for s in evaluation.stages
        )
        return replace(evaluation, stages=stages)

    every = with_tp_waits(evaluate(loaded(ctx, 2.0, 1.0), strategy), 0.008)
    unloaded = with_tp_waits(evaluate(loaded(ctx, 1.0, 1.0), strategy), 0.002)
    at = on_host(ctx, every)
    assert at.processes_per_core == 2.0
    batch_s = step_overhead_s(at, strategy)
    assert simulate_step(at, every, QUIET, batch_s, unloaded=unloaded).time_s == pytest.approx(0.0165)
    assert simulate_step(at, every, QUIET, batch_s).time_s == pytest.approx(0.018)


def test_ranks_in_a_collective_take_its_cpu_share_of_the_cores_from_the_others():
    """Two cores: two TP 1 ranks computing and a TP pair waiting on its links, whose collectives compute half their
    time: the pair takes one core, the two others share the other. A wait not on the links takes nothing."""
    from predictor.sharing import Actor, _speeds

    def actor(processes: int, state: str, unloaded_share: float | None = None) -> Actor:
        made = Actor(processes, True, [], state=state, unloaded_share=unloaded_share)
        made.link_cpu_share = 0.5
        return made

    computing = [actor(1, "busy"), actor(1, "busy")]
    speeds, cores_used = _speeds([*computing, actor(2, "sleep", 1.0)], 2, 1.0, 2.0)
    assert speeds[:2] == [0.5, 0.5] and cores_used == [0.5, 0.5, 0.5]  # per process: the pair's two take one core
    speeds, cores_used = _speeds([*computing, actor(2, "sleep")], 2, 1.0, 2.0)  # a wait for a neighbour
    assert speeds[:2] == [1.0, 1.0] and cores_used == [1.0, 1.0, 0.0]
    # the actors take their link's CPU share from the context's host link
    ctx = replace(quiet_context(0.01, 0.01), links={"cpu/host": replace(INSTANT, cpu_share=0.5)})
    actors = _actors(ctx, evaluate(ctx, two_families()), 0.0)
    assert [a.link_cpu_share for a in actors] == [0.5, 0.5, 0.5]


def test_a_sync_across_families_ends_for_each_when_it_ends_for_all():
    """The families above (passes done at 16 ms), the left ones waiting 10 ms on the sync's transfers and the right
    pair 2 ms, then 4 ms of optimizer step on the right. The pair's sync waits for the sums the left ones send it:
    it ends at 26 ms with theirs, its step at 30 ms. Syncing on its own it would step during their wait: 26 ms."""
    ctx = quiet_context(0.006 / 4, 0.01 / 4, global_batch_size=3)
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), two_families())
    stages = tuple(
        replace(s, dp_exposed_time_s=0.002, optimizer_time_s=0.004) if s.family else replace(s, dp_exposed_time_s=0.01)
        for s in unstretched.stages
    )
    simulated = simulate_step(ctx, replace(unstretched, stages=stages), QUIET, 0.0, trace=True)
    assert simulated.time_s == pytest.approx(0.030)
    pair = simulated.timeline[2]["events"]
    assert pair[-2][0] == "dp_sync" and pair[-2][2] == pytest.approx(0.026)


def test_zeros_weight_gather_follows_the_optimizer_step_and_waits_for_the_replicas_only():
    """The families above (passes done at 16 ms). The left replicas (ZeRO-1) wait 6 ms on the gradients' transfers,
    then gather their updated shards for 4 ms after their (instant) optimizer step, as the runtime does; the right pair
    syncs in 2 ms and steps for 20 ms. Both syncs end at 22 ms; the left replicas' gather ends at 26 ms and the step at
    42 ms. With the gather in the sync the pair would step from 26 ms (46 ms); waiting for the pair's optimizer step
    too, the left ones would gather from 42 ms (46 ms)."""
    ctx = quiet_context(0.006 / 4, 0.01 / 4, global_batch_size=3)
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), two_families())
    stages = tuple(
        replace(s, dp_exposed_time_s=0.002, gather_exposed_time_s=0.0, optimizer_time_s=0.02)
        if s.family
        else replace(s, dp_exposed_time_s=0.01, gather_exposed_time_s=0.004, optimizer_time_s=0.0)
        for s in unstretched.stages
    )
    simulated = simulate_step(ctx, replace(unstretched, stages=stages), QUIET, 0.0, trace=True)
    assert simulated.time_s == pytest.approx(0.042)
    for left in simulated.timeline[:2]:
        sync, update = left["events"][-2:]
        assert (sync[0], update[0]) == ("dp_sync", "optimizer")
        assert sync[2] == pytest.approx(0.022) and update[2] == pytest.approx(0.026)


def test_the_analytic_evaluation_is_stretched_to_the_simulated_step_even_when_not_linear_in_the_stretch():
    """The families above simulate to 16 ms; an analytic evaluation growing with the square of the stretch (10 ms
    unstretched) is stretched by secants until it is within the tolerance of it, where one secant stops 10% short."""
    ctx = quiet_context(0.006 / 4, 0.01 / 4, global_batch_size=3)
    strategy = two_families()

    def squared(at: CostContext) -> Evaluation:
        return replace(evaluate(at, strategy), iteration_time_s=0.010 * at.compute_stretch**2)

    found = evaluate_on_host(ctx, strategy, squared)
    assert found.iteration_time_s == pytest.approx(0.016, rel=STRETCH_TOLERANCE)
    assert found.context is not None and found.context.compute_stretch == pytest.approx(1.6**0.5, rel=1e-3)


def test_passes_start_cold_when_the_hosts_ranks_outnumber_its_cores():
    """The families above with a cold start of 1 ms per forward and per backward: each process does 2 ms more, 8 and
    12 ms of work. Four at half a core until the first family is done at 16 ms (the pair has done 8 of its 12 ms),
    then the pair has a core each for 4 ms: 20 ms. On a host of four cores every rank keeps its core, passes start
    warm and the step is the pair's 10 ms."""
    cold = QUIET.model_copy(update={"cold_forward_s": 0.001, "cold_backward_s": 0.001})
    ctx = quiet_context(0.006 / 4, 0.01 / 4, global_batch_size=3)
    ctx = replace(ctx, host={"cpu": cold})
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), two_families())
    batch_s = step_overhead_s(ctx, unstretched.strategy)
    assert simulate_step(ctx, unstretched, cold, batch_s).time_s == pytest.approx(0.020)
    assert simulate_step(ctx, unstretched, QUIET, batch_s).time_s == pytest.approx(0.016)
    four_cores = cold.model_copy(update={"cores": 4})
    assert simulate_step(ctx, unstretched, four_cores, batch_s).time_s == pytest.approx(0.010)


def test_the_host_work_of_a_sync_across_families_keeps_cores_busy_in_the_step_simulation():
    """The families above, then the sync's indexing and copies (links take no time): 4 ms of work per process on
    the left (every parameter), 2 ms on each TP rank of the right (half of them). Four busy processes share two
    cores: the right pair is done after 4 ms, the left ones then have a core each for their last 2 ms: 16 + 6 ms.
    Asleep, as a wait for transfers, the sync would have added only the longest work, 4 ms."""
    params = stage_params(MODEL, 4, True, True, 1)
    costs = QUIET.model_copy(update={"family_sync_s_per_param": 0.004 / params})
    ctx = quiet_context(0.006 / 4, 0.01 / 4, global_batch_size=3, overlap_grad_reduce=False)  # as the runtime runs
    ctx = replace(ctx, host={"cpu": costs})
    strategy = two_families()
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), strategy)
    left, right = (next(s for s in unstretched.stages if s.family == f) for f in (0, 1))
    assert (left.sync_host_time_s, right.sync_host_time_s) == (pytest.approx(0.004), pytest.approx(0.002))
    assert simulate_step(ctx, unstretched, costs, step_overhead_s(ctx, unstretched.strategy)).time_s == pytest.approx(
        0.022
    )


def test_contexts_without_host_costs_fall_back_to_the_assumed_share_of_a_core():
    ctx = host_context()
    cluster = ctx.cluster
    seen = []

    def make(host: bool):
        def context(given):
            seen.append(given)
            return CostContext(given, MODEL, ctx.training, ctx.sources, host=ctx.host if host else {})

        return context

    assert local_run_context(make(True), cluster, 0.5).cluster is cluster
    assert [group.emulate_speed for group in local_run_context(make(False), cluster, 0.5).cluster.groups] == [0.5] * 2
    assert local_run_context(make(False), cluster, 1.0).cluster is cluster


def simulated_profile(tmp_path, host: bool = True):
    profile = SimulatedDevice(load_cluster(EXAMPLES / "cpu-even.yaml").groups[0].device, MODEL, 32, "fp32")
    written = profile.to_profile((1, 2), (1, 2))
    written.host = HOST if host else None
    written.save(tmp_path / "cpu.json")
    return tmp_path / "cpu.json"


def links_file(path, ranks_and_loads=((2, 1.0), (2, 2.0))) -> None:
    points = []
    for ranks, per_core in ranks_and_loads:
        for collective in ("all_reduce", "send_recv"):
            for size in (4096, 2**20):
                time_s = 1e-3 * per_core + size / 1e9
                points.append({"collective": collective, "ranks": ranks, "size_bytes": size, "time_s": time_s,
                               "mean_time_s": time_s, "processes_per_core": per_core, "correct": True})  # fmt: skip
    body = {"schema": "hetplan.links/1", "device": "cpu", "backend": "gloo", "link_class": "host", "points": points}
    path.write_text(json.dumps(body), encoding="utf-8")


def test_a_profile_round_trips_its_host_section_and_a_link_profile_beside_it_is_attached(tmp_path):
    path = simulated_profile(tmp_path)
    assert load_profile(path).host == HOST
    assert json.loads(path.read_text())["host"]["schema"] == "hetplan.host/1"
    links_file(tmp_path / "links-cpu.json")
    profiles = load_profiles(tmp_path, MODEL)
    assert list(profiles) == ["cpu"]
    assert [record.path for record in profiles["cpu"].link_files] == [str(tmp_path / "links-cpu.json")]
    cluster = load_cluster(EXAMPLES / "cpu-even.yaml")
    training = load_training(None, {"dtype": "fp32", "seq_length": 32, "global_batch_size": 8})
    predictor = Predictor()
    ctx = predictor.base_context(cluster, MODEL, training, profiles)
    assert ctx.host == {"cpu": HOST}
    link = ctx.links["cpu/host"]
    assert link.alpha_s > 0 and link.load_alpha_s > 0  # the links file's 1 ms per extra process per core
    assert ctx.in_node_link(cluster.groups[0]) == link and ctx.rail_link(cluster.groups[0]) == link
    assert ctx.cross_group_link(*cluster.groups) == link  # every link of a local run is this host's
    recorded = [entry["path"] for entry in ctx.cost_source["profiles"]]
    assert recorded == [str((tmp_path / name).resolve()) for name in ("cpu.json", "links-cpu.json")]


def test_a_link_profile_without_its_device_profile_is_refused(tmp_path):
    links_file(tmp_path / "links.json")
    simulated_profile(tmp_path).unlink()
    (tmp_path / "other").mkdir()
    with pytest.raises(SpecError, match="needs that device's profile"):
        load_profiles(tmp_path, MODEL)


def test_a_fitted_predictor_keeps_the_profiles_host_costs_for_contexts_without_profiles(tmp_path):
    fitted = fit_predictor([simulated_profile(tmp_path)], published_runs=False)
    assert fitted.host_costs == {"cpu": [(MODEL.hidden_size, HOST)]}
    cluster = load_cluster(EXAMPLES / "cpu-even.yaml")
    training = load_training(None, {"dtype": "fp32", "seq_length": 32, "global_batch_size": 8})
    ctx = fitted.base_context(cluster, MODEL, training)
    assert ctx.host == {"cpu": HOST}
    assert on_host(ctx, evaluate(ctx, one_stage(replicas=2))).compute_stretch > 1.0  # two busy on two cores
    without = fit_predictor([simulated_profile(tmp_path, host=False)], published_runs=False)
    assert without.host_costs == {} and not math.isnan(evaluate(without.context(cluster, MODEL, training),
                                                                one_stage()).iteration_time_s)  # fmt: skip


def test_a_fitted_predictor_takes_the_host_costs_of_the_profile_nearest_in_model_size():
    """Per-parameter costs move with the model's size (cache against memory): profiles of hidden 64 and 512 give a
    model of hidden 96 the first's costs and one of hidden 384 the second's, not an average of both."""
    large = HOST.model_copy(update={"flatten_s_per_param": 9e-9})
    predictor = Predictor(host_costs={"cpu": [(64, HOST), (512, large)]})
    near_small = MODEL.model_copy(update={"hidden_size": 96})
    near_large = MODEL.model_copy(update={"hidden_size": 384})
    assert predictor.host_costs_for(near_small)["cpu"].flatten_s_per_param == 2e-9
    assert predictor.host_costs_for(near_large)["cpu"].flatten_s_per_param == 9e-9


def test_a_sync_across_families_on_a_profiled_host_adds_its_measured_work_per_parameter():
    ctx = host_context()
    costs = HostCosts.model_validate({**HOST.model_dump(), "family_sync_s_per_param": 3e-9})
    with_work = replace(ctx, host={"cpu": costs})
    families = (
        PipelineStrategy(2, 1, 3, (StageStrategy("left", 0, 4, 1),)),
        PipelineStrategy(1, 1, 2, (StageStrategy("right", 0, 4, 2),)),
    )
    strategy = Strategy(families, "none", 1)
    stage = strategy.pipelines[0].stages[0]
    params = 4 * MODEL.layer_params()
    plain = cross_family_sync_time_s(loaded(ctx, 1.0, 1.0), strategy, 0, stage, params)
    assert cross_family_sync_time_s(loaded(with_work, 1.0, 1.0), strategy, 0, stage, params) == pytest.approx(
        plain + params * 3e-9
    )
    assert cross_family_sync_time_s(loaded(with_work, 1.0, 2.0), strategy, 0, stage, params) == pytest.approx(
        plain + 2 * params * 3e-9  # stretched as compute is
    )


def test_a_tp_pair_spinning_for_a_slower_devices_emulation_shares_the_cores_with_the_others():
    """Two cores, two TP 1 ranks computing beside a TP pair: while the pair computes its layers it is served first
    (it is owed the time it slept in its collectives) and the TP 1 ranks wait; while it spins for its group's
    emulated speed it never sleeps, so it is owed nothing and the four processes share the two cores."""
    from predictor.sharing import Actor, _speeds

    ranks = [Actor(1, True, [], state="busy"), Actor(1, True, [], state="busy")]
    pair_computing = _speeds([*ranks, Actor(2, True, [], prompt=True, state="busy")], 2, 1.0, 2.0)
    assert pair_computing == ([0.0, 0.0, 1.0], [0.0, 0.0, 1.0])  # speeds, and the share of a core per process
    # the spin's own speed is the wall clock's (it spins for a wall time); it takes its half of the cores
    pair_spinning = _speeds([*ranks, Actor(2, True, [], prompt=True, state="spin")], 2, 1.0, 2.0)
    assert pair_spinning == ([0.5, 0.5, 1.0], [0.5, 0.5, 0.5])


def test_tp_ranks_waking_from_their_collectives_take_the_cores_first_in_the_step_simulation():
    """Two families on two cores: 2 TP 1 processes of 4 ms work each, and a TP 2 pair of 4 layers whose 16 decoder
    collectives and 5 of the embedding, head and loss per micro-batch take 2 ms each (measured between layers on this
    host: HostCosts.tp_all_reduce_*) and sleep; the pair's own work is its layers and the work around each
    collective. Served
    first, the pair never waits for a core: the step is the pair's unshared time per micro-batch. The TP 1
    processes compute while the pair sleeps and are done long before it. Shared fairly, the four would compute at
    half a core at the start and the pair would finish later."""
    costs = QUIET.model_copy(
        update={"tp_all_reduce_alpha_s": 1e-3, "tp_all_reduce_bw_bytes_per_s": 1e18, "tp_collective_overhead_s": 1e-4}
    )
    ctx = quiet_context(0.001, 0.002, global_batch_size=3, overlap_grad_reduce=False)
    ctx = replace(ctx, host={"cpu": costs})
    strategy = two_families()
    unstretched = evaluate(loaded(ctx, 2.0, 1.0), strategy)
    left, right = (next(s for s in unstretched.stages if s.family == f) for f in (0, 1))
    # 4 layers x 4 all-reduces and the embedding's, head's and loss's 5, of 2 latency steps each
    assert right.tp_comm_time_s == pytest.approx(21 * 2e-3)
    # 4 layers, the 21 collectives and the work around them
    assert right.compute_time_s == pytest.approx(4 * 0.002 + 21 * 2e-3 + 21 * 1e-4)
    assert left.compute_time_s == pytest.approx(4 * 0.001)
    simulated = simulate_step(ctx, unstretched, costs, step_overhead_s(ctx, unstretched.strategy))
    assert simulated.time_s == pytest.approx(right.compute_time_s)


def test_local_runs_calibrate_a_fixed_step_cost_of_their_own_with_a_prior_of_milliseconds():
    host_ctx = quiet_context(0.01, 0.03)
    names = {p.name: p for p in parameters_for(host_ctx)}
    assert not any(name.endswith("iteration_overhead_s") for name in names)
    assert names["host:runtime_overhead_s"].prior_sd == pytest.approx(0.005)
    assert apply(host_ctx, {"host:runtime_overhead_s": 0.003}).terms.iteration_overhead_s == pytest.approx(0.003)
    unprofiled = replace(host_ctx, host={})  # no measured host: the overheads around the layers are not modelled
    names = {p.name: p for p in parameters_for(unprofiled)}
    assert "host:runtime_overhead_s" not in names
    assert names["host:iteration_overhead_s"].prior_sd == pytest.approx(0.05)
    assert "iteration_overhead_s" not in names  # an engine run's fixed cost is its own
    assert apply(unprofiled, {"host:runtime_overhead_s": 0.003}).terms.iteration_overhead_s == 0.0
    assert apply(unprofiled, {"iteration_overhead_s": 0.003}).terms.iteration_overhead_s == 0.0


def _profiled_cpu_even_plan(tmp_path, replicas: int):
    """A 2-stage plan of MODEL on cpu-even (`replicas` of it, batch 8) and the saved simulated profile it is costed
    with: (plan, cluster, profiles)."""
    from planner.plan import LoadedPlan

    simulated_profile(tmp_path)
    profiles = load_profiles(tmp_path, MODEL)
    cluster = load_cluster(EXAMPLES / "cpu-even.yaml")
    training = load_training(None, {"dtype": "fp32", "seq_length": 32, "global_batch_size": 8})
    stages = (StageStrategy("left", 0, 2, 1), StageStrategy("right", 2, 4, 1))
    pipeline = PipelineStrategy(replicas, 1, 8 // replicas, stages)
    return LoadedPlan(Strategy((pipeline,), "none", 1), MODEL, training, "plan"), cluster, profiles


def test_a_run_predicted_from_measured_profiles_says_the_predictors_calibration_is_not_applied(tmp_path):
    from planner.what_if import run_context

    plan, cluster, profiles = _profiled_cpu_even_plan(tmp_path, replicas=1)
    from_profiles = run_context(plan, Predictor(), profiles)(cluster)
    assert from_profiles.terms == EndToEndTerms()  # as they are
    assert "its calibration not applied" in from_profiles.predictor_identity
    assert "not applied" not in run_context(plan, Predictor(), {})(cluster).predictor_identity


def test_the_local_runs_reason_of_calibration_left_out_is_said_only_where_the_calibration_changes_the_time(
    tmp_path,
):
    """`plan` calibrates measured profiles, `run` costs them as measured: the "on this machine" row said so for every
    predictor with a calibration, the shipped one too, whose terms are all of accelerator runs (none of a CPU
    cluster's). Said where the predictor calibrates a term of this cluster; not for terms of other clusters."""
    from planner.what_if import local_run
    from predictor.calibration import Calibration

    # two replicas: their gradient reduction, overlapped as planned, is a reason of the run's own
    plan, cluster, profiles = _profiled_cpu_even_plan(tmp_path, replicas=2)
    base = Predictor().base_context(cluster, MODEL, plan.training, profiles)
    host_term = next(p.name for p in parameters_for(base) if p.name.startswith("host:compute"))

    def reasons(names: tuple[str, ...]) -> tuple[str, ...]:
        calibration = Calibration(names, (0.4,) * len(names), tuple((0.01,) * len(names) for _ in names))
        found = local_run(plan, cluster, Predictor(calibration=calibration), profiles)
        return found.reasons if found is not None else ()

    left_out = "it costs the measured profiles as measured, without the predictor's calibration"
    assert left_out in reasons((host_term,))
    assert reasons(())  # (the overlap: a row is shown)
    assert left_out not in reasons(("compute:simulated", "network"))  # an accelerator cluster's terms alone


def test_tp_collectives_under_load_take_the_load_terms_timed_with_them_else_the_host_links():
    """The host link loads every collective by 1 ms per latency step per busy process per core beyond one; a profile
    that timed its TP all-reduces with processes computing beside them (0.2 ms per step) loads its TP link by that."""
    host_link = Link("host", 1e9, 1e-4, load_alpha_s=1e-3)
    measured = QUIET.model_copy(update={"tp_all_reduce_alpha_s": 5e-4, "tp_all_reduce_bw_bytes_per_s": 1e18})
    loaded_terms = measured.model_copy(
        update={"tp_all_reduce_load_alpha_s": 2e-4, "tp_all_reduce_load_s_per_byte": 0.0}
    )
    ctx = replace(quiet_context(0.01, 0.01), links={"cpu/host": host_link})
    group = ctx.cluster.group("left")
    for costs, alpha_s in ((measured, 5e-4 + 1e-3), (loaded_terms, 5e-4 + 2e-4)):
        at = loaded(replace(ctx, host={"cpu": costs}), 2.0, 1.0)
        assert at.tp_link(group).alpha_s == pytest.approx(alpha_s)
        assert loaded(replace(ctx, host={"cpu": costs}), 1.0, 1.0).tp_link(group).alpha_s == pytest.approx(5e-4)


def test_profile_comm_refuses_to_write_a_link_profile_that_fit_and_plan_would_refuse(tmp_path):
    """Messages too small to show the link's bandwidth (all latency): profile-comm says so as it ends, rather than
    writing a file `plan --profiles` refuses later; a profile that fits passes."""
    from report.measuring import check_fits

    links_file(tmp_path / "good.json")
    good = json.loads((tmp_path / "good.json").read_text())
    check_fits(good, "--max-size", "1MiB", "--max-size 16MiB")
    flat = {**good, "points": [{**p, "time_s": 1e-3, "mean_time_s": 1e-3} for p in good["points"]]}
    with pytest.raises(SpecError, match=r"--max-size: 64KiB: the points show no size dependence.*nothing was written"):
        check_fits(flat, "--max-size", "64KiB", "--max-size 16MiB")


def test_link_fits_of_latency_bound_sizes_show_no_bandwidth_and_comm_bench_writes_no_profile_fit_refuses():
    """profile-comm's per-collective fit of times that do not grow with the size clamped 1/bandwidth to 1e-15 and
    wrote a bandwidth of 1,000,000 GB/s; comm-bench --links-out wrote a link profile that `fit --links` refused."""
    pytest.importorskip("torch")
    from comm.bench import links_from_bench
    from profiler.comm_bench import CommPoint
    from profiler.comm_bench import fit_link as fit_group
    from report.measuring import check_fits

    flat = [CommPoint("send_recv", 2, size, 2e-4, 1.0, 1.0, True) for size in (4096, 65536, 1 << 20)]
    assert fit_group(flat, "in_node").busbw_bytes_per_s is None
    growing = [replace(p, time_s=1e-4 + p.size_bytes / 1e9) for p in flat]
    assert fit_group(growing, "in_node").busbw_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    rows = [{"path": "bridged", "size_bytes": size, "time_s": 1e-3, "correct": True} for size in (4096, 1 << 20)]
    links = links_from_bench({"ranks": 2, "rows": rows})
    with pytest.raises(SpecError, match=r"^--sizes: 4KiB,1MiB: the points show no size dependence.*--sizes 4KiB,1MiB"):
        check_fits(links, "--sizes", "4KiB,1MiB", "--sizes 4KiB,1MiB,16MiB")
