"""What `hetplan profile` measures of the host besides the layers (profiler/host.py): the arithmetic that turns
timings into host costs (with timings given), and the measurements themselves on a tiny model."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from profiler import host, host_tp, layer_timing  # noqa: E402
from specs.model import ModelSpec  # noqa: E402

MODEL = ModelSpec(
    key="host-profile-test", num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
    num_kv_heads=2, vocab_size=256, seq_length=16, mlp="swiglu",
)  # fmt: skip


def test_optimizer_costs_time_each_part_of_the_update_after_a_pass_over_every_parameter_of_the_stage(monkeypatch):
    """Each step reads the clock five times: before flattening, after it, after AdamW, after copying back, after
    padding and joining. With the parts taking a, b1 + b2 and c seconds per parameter of the whole stage (embedding,
    layers, head) times 1.00, 1.01, ..., 1.06 on the seven timed steps, and the warm-up steps 1000x slower, the three
    medians are 1.03 times a, b1 + b2 and c: the warm-up steps are read and left out (counted in, the median would be
    the 1.04 step's)."""
    stage = host._stage_parts(MODEL, torch.float32, MODEL.num_layers)
    monkeypatch.setattr(host, "_stage_parts", lambda *args: stage)
    numel = sum(p.numel() for p in stage.parameters())
    a, b1, b2, c = 4e-9, 1e-9, 0.5e-9, 0.25e-9
    readings = []

    def clock() -> float:
        step, part = divmod(len(readings), 5)
        if part == 0:  # the update starts right after a forward and backward pass of the whole stage
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in stage.parameters())
        timed = step - host.OPTIMIZER_WARMUP_STEPS
        slow = 1000.0 if timed < 0 else 1.0 + 0.01 * timed
        now = (readings[-1] if readings else 0.0) + slow * numel * (0.0, b1, a, b2, c)[part]
        readings.append(now)
        return now

    assert host.optimizer_costs(MODEL, 1, MODEL.seq_length, torch.float32, min_time_s=0.0, clock=clock) == (
        pytest.approx((1.03 * a, 1.03 * (b1 + b2), 1.03 * c))
    )
    assert len(readings) == 5 * (host.OPTIMIZER_WARMUP_STEPS + host.OPTIMIZER_STEPS)


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
    assert layer_timing.median_time_s(lambda: time.sleep(0.02), 0.0, clock=time.process_time) < 0.005
    assert layer_timing.median_time_s(lambda: time.sleep(0.02), 0.0, clock=time.perf_counter) >= 0.019


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
        for per_param_s in host.optimizer_costs(MODEL, 2, MODEL.seq_length, torch.float32, min_time_s=0.05):
            assert 1e-12 < per_param_s < 1e-6
        assert 1e-11 < host.family_sync_cost(MODEL, torch.float32, min_time_s=0.05) < 1e-6
    finally:
        torch.set_num_threads(threads)
    batch_s, per_sample = host.batch_costs(MODEL, 16, min_time_s=0.05)
    assert 0 < batch_s + 8 * per_sample < 1.0


def test_the_busy_stretch_sets_each_busy_time_against_the_alone_times_around_it():
    """A machine slowing by 10% of the first alone time per measurement, and others computing stretch this process by
    1.1: alone 1.0, 1.2, 1.4, 1.6, 1.8 and busy 1.1 x (1.1, 1.3, 1.5, 1.7) between them read 1.1, where the first
    alone time against the first busy time reads 1.21."""
    alone = [1.0, 1.2, 1.4, 1.6, 1.8]
    busy = [1.1 * (1.1 + 0.2 * index) for index in range(4)]
    assert layer_timing.busy_stretch(alone, busy) == pytest.approx(1.1)
    assert busy[0] / alone[0] == pytest.approx(1.21)


def test_one_disturbed_round_does_not_move_the_busy_stretch_much():
    """Of four rounds at a stretch of 1.05, one read while something else took the core (busy 2x): the median of the
    rounds is the clean rounds' 1.05."""
    alone = [1.0, 1.0, 1.0, 1.0, 1.0]
    busy = [1.05, 1.05, 2.1, 1.05]
    assert layer_timing.busy_stretch(alone, busy) == pytest.approx(1.05)


@pytest.mark.slow
def test_concurrency_is_measured_with_helper_processes_computing_beside():
    """One helper process (cores given as 1: levels 2 processes); the helpers stop with the measurement."""
    points = layer_timing.concurrency(MODEL, 1, 16, torch.float32, cores=1, min_time_s=0.05)
    assert [point.processes for point in points] == [2]
    assert 0.5 < points[0].busy_stretch < 5.0


@pytest.mark.slow
def test_concurrency_helpers_started_once_serve_every_moment_and_stop_with_the_section():
    """The profile times the busy stretch at three moments with the same helpers (each start imports torch anew);
    helpers nobody used were never started."""
    import os

    with layer_timing.BusyHelpers(MODEL, 1, 16, torch.float32, count=1) as unused:
        assert unused.pids == []
    with layer_timing.BusyHelpers(MODEL, 1, 16, torch.float32, count=1) as helpers:
        first = layer_timing.concurrency(MODEL, 1, 16, torch.float32, cores=1, min_time_s=0.05, helpers=helpers)
        started = helpers.pids
        second = layer_timing.concurrency(MODEL, 1, 16, torch.float32, cores=1, min_time_s=0.05, helpers=helpers)
        assert len(started) == 1 and helpers.pids == started
        assert [p.processes for p in first] == [p.processes for p in second] == [2]
    assert helpers.pids == []
    with pytest.raises(ProcessLookupError):
        os.kill(started[0], 0)  # joined: the process is gone


@pytest.mark.slow
def test_cold_passes_are_timed_with_a_partner_process_on_the_same_core():
    """Measured for real on a tiny model: two non-negative costs well under a pass, and the process's own affinity
    and thread count are restored afterwards."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        assert host.cold_pass_costs(MODEL, 1, 16, torch.float32) == (0.0, 0.0)
        return
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    forward_s, backward_s = host.cold_pass_costs(MODEL, 1, 16, torch.float32, min_time_s=0.05)
    assert 0.0 <= forward_s < 0.05 and 0.0 <= backward_s < 0.05
    assert os.sched_getaffinity(0) == allowed and torch.get_num_threads() == threads


def test_cold_pass_costs_are_turns_after_the_partner_against_back_to_back(monkeypatch):
    """A partner thread stands for the pinned process. With the CPU clock advancing 2 ms per forward and 3 ms per
    backward, plus 0.5 and 1 ms when the partner has just run, the costs are (0.5 ms, 1 ms); the partner ran before
    every cold forward and backward."""
    import threading

    clock = {"now": 0.0, "partner_ran": False, "partner_passes": 0}

    class Loss:
        def backward(self) -> None:
            clock["now"] += 0.003 + (0.001 if clock.pop("partner_ran", False) else 0.0)

    def forward() -> Loss:
        clock["now"] += 0.002 + (0.0005 if clock.pop("partner_ran", False) else 0.0)
        return Loss()

    class Partner(threading.Thread):
        """Runs a turn each time it is asked to (as _core_partner does), in a thread."""

        exitcode = None

        def __init__(self, target, args, daemon):
            super().__init__(daemon=True)
            self.go, self.done, self.stop, ready = args[5:9]
            ready.set()

        def run(self) -> None:
            while not self.stop.is_set():
                if self.go.wait(timeout=0.01):
                    self.go.clear()
                    clock["partner_ran"] = True
                    clock["partner_passes"] += 1
                    self.done.set()

        def kill(self) -> None:
            raise AssertionError("the partner stops when asked to")

    class Context:
        Event = threading.Event
        Process = Partner

    monkeypatch.setattr(host.mp, "get_context", lambda method: Context())
    monkeypatch.setattr(host, "_stage_pass_parts", lambda *a: (forward, lambda loss: loss.backward()))
    monkeypatch.setattr(host.time, "process_time", lambda: clock["now"])
    monkeypatch.setattr(host.os, "sched_setaffinity", lambda pid, cores: None)
    forward_s, backward_s = host.cold_pass_costs(MODEL, 1, 16, torch.float32, min_time_s=0.0)
    assert (forward_s, backward_s) == (pytest.approx(0.0005), pytest.approx(0.001))
    assert clock["partner_passes"] == 2 * host.COLD_ROUNDS


def _tp_timing(overhead_s: float, per_byte_s: float, comm_s: float, comm_per_byte_s: float, **noisy_largest) -> dict:
    """A TP timing at the three sizes (micro-batch 2, seq 16, MODEL's hidden size, fp32): per collective compute
    with collectives `overhead_s` + `per_byte_s` x size more than without, and `comm_s` + `comm_per_byte_s` x size
    inside each all-reduce, every point with a 1 us standard error, or the largest size's fields as `noisy_largest`
    gives them."""
    collectives = host_tp.TP_COLLECTIVES_PER_LAYER * host_tp.TP_LAYERS
    points = []
    for factor in host_tp.TP_SIZE_FACTORS:
        size = 2 * factor * 16 * MODEL.hidden_size * 4
        points.append(
            {
                "size_bytes": size,
                "without_s": 0.01,
                "with_s": 0.01 + collectives * (overhead_s + per_byte_s * size),
                "comm_s": collectives * (comm_s + comm_per_byte_s * size),
                "without_se_s": 1e-6,
                "with_se_s": 1e-6,
                "comm_se_s": 1e-6,
            }
        )
    points[-1].update(noisy_largest)
    return {"layers": host_tp.TP_LAYERS, "points": points, "processes_per_core": 1.0}


def test_tp_collective_costs_are_lines_through_the_timed_sizes():
    """Per collective an overhead of 0.1 ms + 1 ns/byte, and 0.3 ms + 2 ns/byte inside each all-reduce: a 2-rank
    all-reduce of 2 latency steps of 0.15 ms at 0.5 GB/s."""
    costs = host_tp.fit_tp_collective_costs([_tp_timing(1e-4, 1e-9, 3e-4, 2e-9)])
    assert costs.overhead_s == pytest.approx(1e-4) and costs.overhead_s_per_byte == pytest.approx(1e-9)
    assert costs.all_reduce_alpha_s == pytest.approx(1.5e-4)
    assert costs.all_reduce_bw_bytes_per_s == pytest.approx(0.5e9)


def test_tp_collective_costs_weigh_points_by_their_standard_error_and_take_the_median_timing():
    """The largest size is timed in a few passes: its points are the noisiest. One far off the line with a standard
    error 100x the others' barely moves the line (an unweighted fit moves the overhead's intercept by 17%: checked);
    and of three timings, one launch reading everything 1.5x slower leaves the median's line where the other two
    put it."""
    collectives = host_tp.TP_COLLECTIVES_PER_LAYER * host_tp.TP_LAYERS
    exact = _tp_timing(1e-4, 1e-9, 3e-4, 2e-9)
    off = dict(exact["points"][-1])
    off_overhead = {"with_s": off["with_s"] - collectives * 1e-4, "with_se_s": 1e-4, "without_se_s": 1e-4}
    noisy = host_tp.fit_tp_collective_costs([_tp_timing(1e-4, 1e-9, 3e-4, 2e-9, **off_overhead)])
    assert noisy.overhead_s == pytest.approx(1e-4, rel=0.01)
    slow = _tp_timing(1.5e-4, 1.5e-9, 4.5e-4, 3e-9)
    median = host_tp.fit_tp_collective_costs([exact, slow, _tp_timing(1e-4, 1e-9, 3e-4, 2e-9)])
    assert median.overhead_s == pytest.approx(1e-4) and median.all_reduce_alpha_s == pytest.approx(1.5e-4)
    assert median.all_reduce_bw_bytes_per_s == pytest.approx(0.5e9)
    with pytest.raises(ValueError, match="different chain lengths"):
        host_tp.fit_tp_collective_costs([exact, {**slow, "layers": 1}])


def test_tp_collectives_are_timed_by_two_processes_at_the_micro_batch_times_the_size_factors(monkeypatch):
    import contextlib
    import json
    from pathlib import Path

    def run_processes(worker, args, nprocs, deadline_s, what):
        assert worker is host_tp._tp_collective_worker and nprocs == 2
        assert args[2] == [2 * factor for factor in host_tp.TP_SIZE_FACTORS]
        timing = _tp_timing(1e-4, 1e-9, 3e-4, 2e-9)
        del timing["processes_per_core"]  # the worker writes the points; the load is the caller's
        Path(args[-1]).write_text(json.dumps(timing))

    beside = []
    monkeypatch.setattr(host_tp, "run_processes", run_processes)
    monkeypatch.setattr(host_tp, "computing_beside", lambda count: beside.append(count) or contextlib.nullcontext())
    monkeypatch.setattr(host_tp, "host_cores", lambda: 2)
    assert host_tp.time_tp_collectives(MODEL, 2, 16, torch.float32) == _tp_timing(1e-4, 1e-9, 3e-4, 2e-9)
    loaded = host_tp.time_tp_collectives(MODEL, 2, 16, torch.float32, busy_processes=2)
    assert loaded is not None and loaded["processes_per_core"] == 2.0 and beside == [0, 2]
    odd = MODEL.model_copy(update={"num_kv_heads": 1, "num_attention_heads": 3})
    assert host_tp.time_tp_collectives(odd, 2, 16, torch.float32) is None  # no TP 2, no collectives to time


def test_the_standard_error_of_a_median_follows_the_samples_spread():
    assert host_tp.median_standard_error_s([1.0] * 9) == host_tp.MIN_STANDARD_ERROR_S
    wide = host_tp.median_standard_error_s([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    narrow = host_tp.median_standard_error_s([4.6, 4.7, 4.8, 4.9, 5.0, 5.1, 5.2, 5.3, 5.4])
    assert wide == pytest.approx(10 * narrow)
    assert wide == pytest.approx(host_tp.MEDIAN_SE_PER_MAD * 2.0 / 3.0)


@pytest.mark.slow
def test_tp_collectives_are_timed_between_layers_by_two_processes_with_real_gloo_all_reduces():
    """Measured for real on a tiny model: a Gloo all-reduce on loopback takes tens of microseconds to tens of
    milliseconds; the work around one is at most the all-reduce's plus 10 ms (a loaded host's wake-ups)."""
    timing = host_tp.time_tp_collectives(MODEL, 1, 16, torch.float32, min_time_s=0.2)
    assert timing is not None
    costs = host_tp.fit_tp_collective_costs([timing])
    size = 16 * MODEL.hidden_size * 4
    all_reduce_s = 2 * costs.all_reduce_alpha_s + size / costs.all_reduce_bw_bytes_per_s
    assert 1e-5 < all_reduce_s < 0.05
    assert abs(costs.overhead_s + size * costs.overhead_s_per_byte) < all_reduce_s + 10e-3


def test_a_failed_timing_of_tp_collectives_keeps_the_other_host_costs_and_says_so(monkeypatch):
    """Processes that cannot meet (a firewalled loopback, say) cost the profile its TP timing only: the host section is
    written without it (local runs use the link profile for TP), and the progress line says why."""
    from profiler.profile import ConcurrencyPoint
    from specs.errors import HetplanError

    monkeypatch.setattr(host, "concurrency", lambda *a, **k: [ConcurrencyPoint(processes=2, busy_stretch=1.1)])
    monkeypatch.setattr(host, "stage_overheads", lambda *a, **k: (1e-3, 1e-4))
    monkeypatch.setattr(host, "optimizer_costs", lambda *a, **k: (1e-9, 2e-9, 3e-9))
    family_sync_readings = iter([9e-9, 4e-9, 3.9e-9])  # three moments, the first disturbed: the median holds
    monkeypatch.setattr(host, "family_sync_cost", lambda *a, **k: next(family_sync_readings))
    monkeypatch.setattr(host, "batch_costs", lambda *a, **k: (1e-3, 1e-5))
    monkeypatch.setattr(host, "cold_pass_costs", lambda *a, **k: (5e-4, 1e-3))

    attempts = []

    def refused(*args, **kwargs):
        attempts.append(args)
        raise HetplanError("timing TP collectives on this host failed: connection refused")

    monkeypatch.setattr(host, "time_tp_collectives", refused)
    said: list[str] = []
    counts: list[tuple[int, int]] = []
    costs = host.measure_host(
        MODEL, 16, torch.float32, 1, lambda *told: counts.append(told[:2]) or said.append(told[2])
    )
    assert costs.tp_all_reduce_alpha_s is None and costs.tp_collective_overhead_s == 0.0
    assert costs.layer_overhead_s == 1e-4 and costs.family_sync_s_per_param == 4e-9
    assert (costs.cold_forward_s, costs.cold_backward_s) == (5e-4, 1e-3)
    assert any("connection refused; local runs' TP collectives will use the link profile's" in line for line in said)
    assert len(attempts) == 1  # not tried again at the later moments
    # the parts are counted in the progress lines (the layers' count is done by then), the skipped ones too
    total = host.HOST_PARTS + (1 if 0 < 2 * host.host_cores() - 2 <= host.MAX_CONCURRENT_PROCESSES - 2 else 0)
    assert said[0] == "host: TP collectives between layers (1 of 3)" and counts[0] == (0, total)
    assert said[-2:] == ["host: making batches", "host: done"] and total == 14
    assert counts[-2:] == [(total - 1, total), (total, total)]  # the last part starts with the others done, then ends
    assert counts == sorted(counts)  # the count never moves back (a failed part's line keeps it)


def test_host_costs_fit_the_tp_timings_made_at_three_moments(monkeypatch):
    from profiler.profile import ConcurrencyPoint

    monkeypatch.setattr(host, "concurrency", lambda *a, **k: [ConcurrencyPoint(processes=2, busy_stretch=1.1)])
    monkeypatch.setattr(host, "stage_overheads", lambda *a, **k: (1e-3, 1e-4))
    monkeypatch.setattr(host, "optimizer_costs", lambda *a, **k: (1e-9, 2e-9, 3e-9))
    monkeypatch.setattr(host, "family_sync_cost", lambda *a, **k: 4e-9)
    monkeypatch.setattr(host, "batch_costs", lambda *a, **k: (1e-3, 1e-5))
    monkeypatch.setattr(host, "cold_pass_costs", lambda *a, **k: (5e-4, 1e-3))
    loaded = {**_tp_timing(0.0, 0.0, 5e-4, 3e-9), "processes_per_core": 2.0}
    timings = iter(
        [
            _tp_timing(1e-4, 1e-9, 3e-4, 2e-9),
            _tp_timing(3e-4, 3e-9, 9e-4, 6e-9),
            _tp_timing(1e-4, 1e-9, 3e-4, 2e-9),
            loaded,
        ]
    )
    busy = []
    monkeypatch.setattr(host, "host_cores", lambda: 2)

    def timed(*args, busy_processes=0, **kwargs):
        busy.append(busy_processes)
        return next(timings)

    monkeypatch.setattr(host, "time_tp_collectives", timed)
    monkeypatch.setattr(host_tp, "time_tp_collectives", timed)  # the timing under load (host_tp.time_tp_under_load)
    costs = host.measure_host(MODEL, 16, torch.float32, 2, lambda *told: None)
    assert busy == [0, 0, 0, 2]  # three unloaded at three moments, one with a process per core computing beside
    assert costs.tp_collective_overhead_s == pytest.approx(1e-4) and costs.tp_all_reduce_alpha_s == pytest.approx(
        1.5e-4
    )
    # the loaded line (0.5 ms + 3 ns/byte) less the unloaded one (0.3 ms + 2 ns/byte), at one process per core more
    assert costs.tp_all_reduce_load_alpha_s == pytest.approx(1e-4)  # per latency step: 2 of them
    assert costs.tp_all_reduce_load_s_per_byte == pytest.approx(1e-9)
    # 17 cores would take 34 processes for two per core, beyond the concurrency measurement's 32: no loaded timing
    timings = iter([_tp_timing(1e-4, 1e-9, 3e-4, 2e-9)] * 3)
    busy.clear()
    monkeypatch.setattr(host, "host_cores", lambda: 17)
    costs = host.measure_host(MODEL, 16, torch.float32, 2, lambda *told: None)
    assert busy == [0, 0, 0] and costs.tp_all_reduce_load_alpha_s is None
    # one core: the two ranks alone are two per core already, no loaded timing either
    timings = iter([_tp_timing(1e-4, 1e-9, 3e-4, 2e-9)] * 3)
    busy.clear()
    monkeypatch.setattr(host, "host_cores", lambda: 1)
    costs = host.measure_host(MODEL, 16, torch.float32, 2, lambda *told: None)
    assert busy == [0, 0, 0] and costs.tp_all_reduce_load_alpha_s is None


def test_processes_computing_at_once_are_timed_at_three_moments_and_each_level_takes_the_median(monkeypatch):
    """A spell of a neighbour on a shared host during one reading (two processes 1.76x alone) leaves the median of
    three: the profile keeps 1.02 at two processes and 1.1 at four. The stage overheads likewise."""
    from profiler.profile import ConcurrencyPoint

    readings = iter(
        [
            [ConcurrencyPoint(processes=2, busy_stretch=1.76), ConcurrencyPoint(processes=4, busy_stretch=1.62)],
            [ConcurrencyPoint(processes=2, busy_stretch=1.02), ConcurrencyPoint(processes=4, busy_stretch=1.1)],
            [ConcurrencyPoint(processes=2, busy_stretch=0.99), ConcurrencyPoint(processes=4, busy_stretch=1.08)],
        ]
    )
    calls = []
    monkeypatch.setattr(host, "concurrency", lambda *a, **k: calls.append(a) or next(readings))
    # a stage as one module, read at the same three moments: the disturbed first reading leaves the medians
    stage_readings = iter([(0.9e-3, -0.7e-3), (0.5e-3, 0.02e-3), (0.6e-3, 0.03e-3)])
    monkeypatch.setattr(host, "stage_overheads", lambda *a, **k: next(stage_readings))
    monkeypatch.setattr(host, "optimizer_costs", lambda *a, **k: (1e-9, 2e-9, 3e-9))
    monkeypatch.setattr(host, "family_sync_cost", lambda *a, **k: 4e-9)
    monkeypatch.setattr(host, "batch_costs", lambda *a, **k: (1e-3, 1e-5))
    monkeypatch.setattr(host, "cold_pass_costs", lambda *a, **k: (5e-4, 1e-3))
    monkeypatch.setattr(host, "time_tp_collectives", lambda *a, **k: None)
    said: list[str] = []
    costs = host.measure_host(MODEL, 16, torch.float32, 1, lambda done, total, what: said.append(what))
    assert len(calls) == 3 and sum("processes computing at once" in line for line in said) == 3
    assert [(p.processes, p.busy_stretch) for p in costs.concurrency] == [(2, 1.02), (4, 1.1)]
    assert (costs.microbatch_overhead_s, costs.layer_overhead_s) == (0.6e-3, 0.02e-3)
    assert costs.busy_stretch(2) == pytest.approx(1.02)


def test_other_work_is_the_cores_busy_time_beyond_this_process_and_its_children(tmp_path):
    """/proc/stat's lines of this process's cores: busy time (user, nice, system) and stolen time; another core's
    line and the idle, iowait, irq and softirq columns are not counted (with IRQ time accounting no process is
    charged the last two: the run's own loopback traffic would read as other work)."""
    import os

    from profiler.machine import HostTimes, host_times, other_work

    mine = sorted(os.sched_getaffinity(0))
    ticks = os.sysconf("SC_CLK_TCK")
    lines = ["cpu  1 1 1 1 1 1 1 1 0 0"]  # the all-cores line: not read
    lines += [f"cpu{core} 100 10 20 500 7 3 2 5 0 0" for core in mine]
    lines.append(f"cpu{max(mine) + 1} 9999 0 0 0 0 0 0 9999 0 0")  # a core this process may not run on
    stat = tmp_path / "stat"
    stat.write_text("\n".join(lines) + "\nintr 1 2 3\n", encoding="utf-8")
    reading = host_times(stat)
    assert reading is not None
    assert reading.busy_s == pytest.approx(len(mine) * (100 + 10 + 20) / ticks)
    assert reading.stolen_s == pytest.approx(len(mine) * 5 / ticks)
    assert host_times(tmp_path / "missing") is None
    stat.write_text(f"cpu{mine[0]} 1 2 3 4 5 6 7 x 0 0\n", encoding="utf-8")
    assert host_times(stat) is None  # not as documented: unknown, not a guess

    before = HostTimes(wall_s=10.0, busy_s=100.0, stolen_s=1.0, own_s=5.0)
    after = HostTimes(wall_s=14.0, busy_s=103.0, stolen_s=1.4, own_s=6.0)
    others = other_work(before, after)
    assert others["other_processes_cores"] == pytest.approx(0.5) and others["stolen_cores"] == pytest.approx(0.1)
    assert others["over_s"] == pytest.approx(4.0) and others["checked"]


def test_live_children_are_read_from_their_stat_files_whatever_their_names(tmp_path):
    """/proc/PID/stat of this process's children: utime, stime, cutime and cstime (fields 14-17) in clock ticks; a
    name of any bytes (cut at 15 bytes mid-character, with spaces and parentheses) is read past, a process of another
    parent is not counted, and a file that ended meanwhile or reads otherwise is skipped."""
    import os

    from profiler.machine import live_children_cpu_s

    me = os.getpid()
    ticks = os.sysconf("SC_CLK_TCK")

    def stat(pid: int, name: bytes, parent: int, times: str) -> None:
        (tmp_path / str(pid)).mkdir()
        rest = f" S {parent} 1 1 0 -1 4194560 10 0 0 0 {times} 20 0 1 0 100 1000 50".encode()
        (tmp_path / str(pid) / "stat").write_bytes(f"{pid} (".encode() + name + b")" + rest)

    stat(101, "rank é) x".encode()[:9], me, "30 10 5 5")  # a name cut inside "é", with ") " in it
    stat(102, b"hetplan", me, "100 0 0 0")
    stat(103, b"other", me + 1, "900 900 0 0")  # another process's child
    (tmp_path / "104").mkdir()
    (tmp_path / "104" / "stat").write_bytes(f"104 (odd) S {me} 1 1".encode())  # too short: skipped
    (tmp_path / "105").mkdir()  # ended before its stat was read
    assert live_children_cpu_s(tmp_path) == pytest.approx((30 + 10 + 5 + 5 + 100) / ticks)


def test_other_work_sees_a_process_that_is_not_a_child_and_not_the_children_waited_for(tmp_path):
    """A process this one did not start (here: a shell's background loop, left to init) counts as other work; a child
    computing as long, waited for, counts as this process's own. Each computes 0.5 s of CPU time, however busy the
    cores are with the rest of the suite (which only adds to the other work)."""
    import subprocess
    import sys

    from profiler.machine import host_times, other_work

    before = host_times()
    if before is None:
        pytest.skip("this system does not report its cores' busy time")
    done = tmp_path / "done"
    spin = f"import time\nwhile time.process_time() < 0.5: pass\nopen({str(done)!r}, 'w').close()\n"
    script = tmp_path / "spin.py"
    script.write_text(spin, encoding="utf-8")
    subprocess.run([sys.executable, str(script)], check=True, timeout=60)  # a child, waited for
    after = host_times()
    assert after is not None and after.own_s - before.own_s >= 0.45
    done.unlink()
    before = host_times()
    assert before is not None
    # a detached loop: `sh` starts it in the background and exits, so this process never waits for it
    subprocess.run(["sh", "-c", f"{sys.executable} {script} > /dev/null 2>&1 &"], check=True, timeout=30)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.05)  # its exit
    after = host_times()
    assert done.exists() and after is not None
    others = other_work(before, after)
    assert others["other_processes_cores"] * others["over_s"] >= 0.45, others
    assert after.own_s - before.own_s < 0.3  # this process only waited
