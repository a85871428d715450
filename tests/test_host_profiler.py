"""What `hetplan profile` measures of the host besides the layers (profiler/host.py): the arithmetic that turns
timings into host costs (with timings given), and the measurements themselves on a tiny model."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from profiler import host  # noqa: E402
from specs.model import ModelSpec  # noqa: E402

MODEL = ModelSpec(
    key="host-profile-test", num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
    num_kv_heads=2, vocab_size=256, seq_length=16, mlp="swiglu",
)  # fmt: skip


def test_optimizer_costs_time_the_update_the_flattening_and_the_gathered_pieces_each_on_its_own(monkeypatch):
    """Three timings, one per part (the AdamW update, flattening and copying back, padding and joining the pieces),
    each divided by the parameters of the stage: a, b and c by hand, in that order."""
    numel = MODEL.num_layers * MODEL.layer_params()
    a, b, c = 4e-9, 1e-9, 0.5e-9  # seconds per parameter of the shard, held, held when sharded
    times = iter([numel * a, numel * b, numel * c])
    timed = []

    def median_time_s(work, min_time_s, **_):
        timed.append(work.__name__)
        return next(times)

    monkeypatch.setattr(host, "median_time_s", median_time_s)
    assert host.optimizer_costs(MODEL, torch.float32) == pytest.approx((a, b, c))
    assert timed == ["adam", "flatten_and_copy_back", "pad_and_join"]


def test_batch_costs_are_a_fixed_part_and_a_part_per_sample(monkeypatch):
    small, large = host.BATCHES
    times = iter([2e-3 + small * 1e-5, 2e-3 + large * 1e-5])
    monkeypatch.setattr(host, "median_time_s", lambda work, min_time_s, **_: next(times))
    assert host.batch_costs(MODEL, 16) == pytest.approx((2e-3, 1e-5))


def test_stage_overheads_are_a_stage_against_its_parts(monkeypatch):
    """Stages of 1 and STAGE_LAYERS (here the model's 2) layers take 10 and 16 ms; alone the embedding takes 1 ms, a
    layer 5 ms and the head 2 ms: 1 ms more per layer in a stage, and 10 - 1 - 5 - 2 - 1 = 1 ms per micro-batch."""
    stage_times = {1: 10e-3, 2: 16e-3}
    part_times = {"embedding": 1e-3, "decoder": 5e-3, "lm_head": 2e-3}
    calls = iter([1, 2] * host.PASSES)
    monkeypatch.setattr(host, "median_time_s", lambda work, min_time_s, **_: stage_times[next(calls)])
    built = []

    def build_layer(model, layer, *args, **kwargs):
        built.append(layer)
        return layer, []

    def profile_layer(module, inputs, **kwargs):
        return _timed(part_times[module])

    monkeypatch.setattr(host, "build_layer", build_layer)
    monkeypatch.setattr(host, "profile_layer", profile_layer)
    per_microbatch, per_layer = host.stage_overheads(MODEL, 1, 16, torch.float32)
    assert per_layer == pytest.approx(1e-3) and per_microbatch == pytest.approx(1e-3)
    assert built.count("decoder") == host.PASSES


def _timed(total_s: float):
    from profiler.measure import LayerMeasurement

    return LayerMeasurement(total_s / 3, 2 * total_s / 3, 0, 0, 0, 0, 0.0, None, 1)


def test_median_time_counts_busy_time_on_the_process_clock():
    """Sleeping is not busy: on the process clock a sleep of 20 ms costs almost nothing."""
    assert host.median_time_s(lambda: time.sleep(0.02), 0.0, clock=time.process_time) < 0.005
    assert host.median_time_s(lambda: time.sleep(0.02), 0.0, clock=time.perf_counter) >= 0.019


def test_layers_are_timed_on_busy_time_on_the_cpu_with_one_thread(monkeypatch):
    from profiler import measure

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert measure.layer_clock(torch.device("cpu")) is time.process_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # threads of one process: their CPU times add up
    assert measure.layer_clock(torch.device("cpu")) is time.perf_counter


def test_the_host_measurements_of_a_tiny_model_are_plausible():
    """Measured for real (a second or two): per-parameter costs between 0.01 ns and 1 us, a batch in under 1 s. One
    thread, as `hetplan profile --threads 1` times them: busy time, which other tests' processes do not stretch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for per_param_s in host.optimizer_costs(MODEL, torch.float32, min_time_s=0.05):
            assert 1e-12 < per_param_s < 1e-6
        assert 1e-11 < host.family_sync_cost(MODEL, torch.float32, min_time_s=0.05) < 1e-6
    finally:
        torch.set_num_threads(threads)
    batch_s, per_sample = host.batch_costs(MODEL, 16, min_time_s=0.05)
    assert 0 < batch_s + 8 * per_sample < 1.0


@pytest.mark.slow
def test_concurrency_is_measured_with_helper_processes_computing_beside():
    """One helper process (cores given as 1: levels 2 processes); the helpers stop with the measurement."""
    points = host.concurrency(MODEL, 1, 16, torch.float32, cores=1, min_time_s=0.05)
    assert [point.processes for point in points] == [2]
    assert 0.5 < points[0].busy_stretch < 5.0


def test_tp_collective_costs_are_lines_through_the_timed_sizes(monkeypatch):
    """The two TP ranks' timings at three activation sizes, given: compute with collectives 0.1 ms + 1 ns/byte more
    per collective than without, and 0.3 ms + 2 ns/byte inside each all-reduce. Per collective that is an overhead
    of 0.1 ms + 1 ns/byte, and a 2-rank all-reduce of 2 latency steps of 0.15 ms at 0.5 GB/s."""
    import json
    from pathlib import Path

    collectives = host.TP_COLLECTIVES_PER_LAYER * host.TP_LAYERS

    def run_processes(worker, args, nprocs, deadline_s, what):
        assert worker is host._tp_collective_worker and nprocs == 2
        sizes, out = args[2], args[-1]
        assert sizes == [2 * factor for factor in host.TP_SIZE_FACTORS]  # the micro-batch size, 2 and 4 times it
        points = []
        for micro_batch_size in sizes:
            size = micro_batch_size * 16 * MODEL.hidden_size * 4
            points.append(
                {
                    "size_bytes": size,
                    "without_s": 0.01,
                    "with_s": 0.01 + collectives * (1e-4 + 1e-9 * size),
                    "comm_s": collectives * (3e-4 + 2e-9 * size),
                }
            )
        Path(out).write_text(json.dumps({"layers": host.TP_LAYERS, "points": points}))

    monkeypatch.setattr(host, "run_processes", run_processes)
    costs = host.tp_collective_costs(MODEL, 2, 16, torch.float32)
    assert costs is not None
    assert costs.overhead_s == pytest.approx(1e-4) and costs.overhead_s_per_byte == pytest.approx(1e-9)
    assert costs.all_reduce_alpha_s == pytest.approx(1.5e-4)
    assert costs.all_reduce_bw_bytes_per_s == pytest.approx(0.5e9)
    odd = MODEL.model_copy(update={"num_kv_heads": 1, "num_attention_heads": 3})
    assert host.tp_collective_costs(odd, 2, 16, torch.float32) is None  # no TP 2, no collectives to time


@pytest.mark.slow
def test_tp_collectives_are_timed_between_layers_by_two_processes_with_real_gloo_all_reduces():
    """Measured for real on a tiny model: a Gloo all-reduce on loopback takes tens of microseconds to tens of
    milliseconds; the work around one is well under the all-reduce itself."""
    costs = host.tp_collective_costs(MODEL, 1, 16, torch.float32, min_time_s=0.2)
    assert costs is not None
    size = 16 * MODEL.hidden_size * 4
    all_reduce_s = 2 * costs.all_reduce_alpha_s + size / costs.all_reduce_bw_bytes_per_s
    assert 1e-5 < all_reduce_s < 0.05
    assert abs(costs.overhead_s + size * costs.overhead_s_per_byte) < all_reduce_s + 1e-3


def test_a_failed_timing_of_tp_collectives_keeps_the_other_host_costs_and_says_so(monkeypatch):
    """Processes that cannot meet (a firewalled loopback, say) cost the profile its TP timing only: the host section is
    written without it (local runs use the link profile for TP), and the progress line says why."""
    from profiler.profile import ConcurrencyPoint
    from specs.errors import HetplanError

    monkeypatch.setattr(host, "concurrency", lambda *a, **k: [ConcurrencyPoint(processes=2, busy_stretch=1.1)])
    monkeypatch.setattr(host, "stage_overheads", lambda *a, **k: (1e-3, 1e-4))
    monkeypatch.setattr(host, "optimizer_costs", lambda *a, **k: (1e-9, 2e-9, 3e-9))
    monkeypatch.setattr(host, "family_sync_cost", lambda *a, **k: 4e-9)
    monkeypatch.setattr(host, "batch_costs", lambda *a, **k: (1e-3, 1e-5))

    def refused(*args, **kwargs):
        raise HetplanError("timing TP collectives on this host failed: connection refused")

    monkeypatch.setattr(host, "tp_collective_costs", refused)
    said: list[str] = []
    costs = host.measure_host(MODEL, 16, torch.float32, 1, said.append)
    assert costs.tp_all_reduce_alpha_s is None and costs.tp_collective_overhead_s == 0.0
    assert costs.layer_overhead_s == 1e-4 and costs.family_sync_s_per_param == 4e-9
    assert any("connection refused; local runs' TP collectives will use the link profile's" in line for line in said)
