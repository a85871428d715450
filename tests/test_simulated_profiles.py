"""Simulated profiles: physically sensible, deterministic, and the same JSON shape measured profiles use."""

from __future__ import annotations

import pytest

from profiler import SimulatedDevice, load_profile
from specs import get_device, load_model
from tests.conftest import EXAMPLES


@pytest.fixture
def simulated() -> SimulatedDevice:
    return SimulatedDevice(get_device("a100-80gb"), load_model("llama2-7b"), 4096)


def test_time_grows_with_micro_batch_and_falls_with_tp(simulated):
    times = [simulated.layer_cost("decoder", b, 1, "none").time_s for b in (1, 2, 4, 8)]
    assert times == sorted(times)
    per_sample = [t / b for t, b in zip(times, (1, 2, 4, 8))]
    assert per_sample[-1] <= per_sample[0]  # larger GEMMs are at least as efficient
    shards = [simulated.layer_cost("decoder", 1, tp, "none").time_s for tp in (1, 2, 4, 8)]
    assert shards == sorted(shards, reverse=True)
    assert shards[0] / shards[-1] < 8  # thinner GEMMs lose efficiency: TP 8 is less than 8x faster


def test_recompute_trades_time_for_memory(simulated):
    none, selective, full = (simulated.layer_cost("decoder", 2, 1, mode) for mode in ("none", "selective", "full"))
    assert none.forward_time_s == selective.forward_time_s == full.forward_time_s
    assert none.backward_time_s < selective.backward_time_s < full.backward_time_s
    assert full.backward_time_s == pytest.approx(none.backward_time_s + none.forward_time_s)
    assert none.activation_bytes > selective.activation_bytes > full.activation_bytes


def test_layer_reaches_a_realistic_fraction_of_peak(simulated):
    model = simulated.model
    flops = 3 * (model.layer_gemm_flops(4096) + model.layer_attention_flops(1, 4096, causal_kernel=True))
    utilisation = flops / simulated.layer_cost("decoder", 1, 1, "none").time_s / simulated.device.peak_flops_per_s
    assert 0.5 < utilisation < simulated.device.gemm_efficiency


def test_noise_is_seeded(simulated):
    from dataclasses import replace

    a = replace(simulated, noise=0.05, seed=1).layer_cost("decoder", 4, 2, "none")
    b = replace(simulated, noise=0.05, seed=1).layer_cost("decoder", 4, 2, "none")
    c = replace(simulated, noise=0.05, seed=2).layer_cost("decoder", 4, 2, "none")
    assert a == b
    assert a != c


def test_profile_json_round_trip_and_interpolation(simulated, tmp_path):
    profile = simulated.to_profile(micro_batch_sizes=(1, 2, 8), tp_degrees=(1, 4))
    path = tmp_path / "a100.json"
    profile.save(path)
    loaded = load_profile(path)
    assert loaded.to_json() == profile.to_json()
    assert loaded.layer_cost("decoder", 2, 4, "selective") == simulated.layer_cost("decoder", 2, 4, "selective")
    between = loaded.layer_cost("lm_head", 4, 1, "none").time_s
    low, high = (simulated.layer_cost("lm_head", b, 1, "none").time_s for b in (2, 8))
    assert low < between < high
    with pytest.raises(Exception, match=r"no decoder entry for tp=2"):
        loaded.layer_cost("decoder", 1, 2, "none")


@pytest.mark.parametrize(
    ("a100_dtype", "v100_dtype", "fp32_matmul", "peak_ratio"),
    [
        ("bf16", "fp16", "ieee", 125 / 312),  # 16-bit tensor cores
        ("fp32", "fp32", "ieee", 15.7 / 19.5),  # IEEE fp32 on both (PyTorch's default)
        ("fp32", "fp32", "tf32", 15.7 / 156),  # TF32 tensor cores on the A100; the V100 has none
    ],
)
def test_a100_over_v100_layer_time_follows_the_tensor_core_peaks(a100_dtype, v100_dtype, fp32_matmul, peak_ratio):
    """The shipped predictor's A100 / V100 time of a GEMM-bound layer (13B GPT, 8 x 2048 tokens) is the ratio of
    the peaks that apply, within what their efficiencies and calibrations differ by."""
    from predictor.predictor import default_predictor
    from specs import load_cluster, load_training

    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    model = load_model("gpt3-13b")
    times = {}
    for name, dtype in (("a100", a100_dtype), ("v100", v100_dtype)):
        training = load_training(None, {"dtype": dtype, "fp32_matmul": fp32_matmul, "global_batch_size": 8})
        alone = cluster.only(cluster.group(name))
        ctx = default_predictor().context(alone, model, training)
        times[name] = ctx.source(name).layer_cost("decoder", 8, 1, "none").time_s
    assert times["a100"] / times["v100"] == pytest.approx(peak_ratio, rel=0.25)


def test_a_saved_simulated_profile_is_calibrated_as_the_datasheet_simulation_it_saves(tmp_path):
    """The shipped predictor's calibration scales the datasheet simulation per vendor, generation and device; a
    simulated profile file (simulate-profile) holds those same costs, so a plan from it takes the same scales and
    the same time (it took none, and planned H100 + MI300X 19% faster than the datasheet it saved)."""
    from planner import plan
    from profiler.profiles import load_profiles
    from specs import load_cluster, load_training

    cluster = load_cluster(EXAMPLES / "h100-mi300x.yaml")
    model, training = load_model("llama3-8b"), load_training(None, {})
    for device in ("h100", "mi300x"):
        SimulatedDevice(get_device(device), model, model.seq_length, "bf16").to_profile(
            (1, 2, 4, 8), (1, 2, 4, 8)
        ).save(tmp_path / f"{device}.json")
    datasheet = plan(cluster, model, training)
    saved = plan(cluster, model, training, load_profiles(tmp_path, model))
    assert "simulated profile" in saved.context.predictor_identity and " x1." in saved.context.predictor_identity
    assert saved.evaluation.iteration_time_s == pytest.approx(datasheet.evaluation.iteration_time_s, rel=1e-9)
