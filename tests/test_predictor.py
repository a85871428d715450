"""The predictor: learned layer models, fitted links, calibration from runs, intervals, persistence, `hetplan fit`."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from predictor.calibration import apply, compute_parameter_names, fit_calibration, prediction_interval
from predictor.comm_model import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from predictor.cost_model import build_context, evaluate
from predictor.features import LayerPoint
from predictor.layer_model import fit_layer_cost_model, fit_time_model, predict_total_s, profile_model_spec
from predictor.link_model import LinkPoint, fit_link
from predictor.predictor import (
    PUBLISHED_RUNS,
    Predictor,
    default_predictor,
    fit_predictor,
    load_predictor,
    save_predictor,
)
from predictor.runs import load_runs
from profiler.collectives import bus_factor, latency_steps
from profiler.profile import load_profile
from profiler.simulated import SimulatedDevice
from specs import load_cluster, load_model, load_training
from specs.device import get_device
from specs.errors import SpecError
from specs.layout import megatron_strategy
from tests.conftest import EXAMPLES, ROOT, hetplan

CPU_PROFILE = ROOT / "bench" / "results" / "profile-cpu-tiny-llama.json"


def _held_out_errors(held, **params):
    profile = load_profile(CPU_PROFILE)
    model = profile_model_spec(profile)
    entries = [e for e in profile.entries if e.fits]
    points = [
        LayerPoint(model, profile.seq_length, profile.dtype, e.layer, e.micro_batch_size, e.tp, e.recompute)
        for e in entries
    ]
    train = [i for i, p in enumerate(points) if not held(p)]
    test = [i for i, p in enumerate(points) if held(p)]
    fitted = fit_time_model([points[i] for i in train], [entries[i] for i in train], **params)
    predicted = predict_total_s(fitted, [points[i] for i in test])
    measured = np.array([entries[i].forward_time_s + entries[i].backward_time_s for i in test])
    return np.abs(predicted / measured - 1)


@pytest.mark.parametrize(
    "held", [lambda p: p.micro_batch_size == 8, lambda p: p.tp == 4], ids=["largest-micro-batch", "largest-tp"]
)
def test_held_out_cpu_profile_points_within_ten_percent_median(held):
    assert np.median(_held_out_errors(held)) < 0.10


def test_roofline_term_extrapolates_where_trees_alone_do_not():
    """The reason for the design: past the profiled micro-batches trees keep their edge value."""
    held = lambda p: p.micro_batch_size == 8  # noqa: E731
    assert np.median(_held_out_errors(held)) < np.median(_held_out_errors(held, roofline=False))


def test_learned_layer_model_predicts_a_larger_model_from_a_small_one():
    """Fit on noisy simulated A100 profiles of two small GPTs (micro-batch <= 2, TP <= 2), predict a 175B GPT's
    layers at TP 4 and 8. (Two shapes: with one, GEMM, attention and memory work all scale with tokens/TP and their
    split is not identifiable.)"""
    device = get_device("a100-80gb")
    profiles = [
        SimulatedDevice(device, load_model(name), 2048, "bf16", noise=0.02, seed=3).to_profile(
            micro_batch_sizes=(1, 2), tp_degrees=(1, 2)
        )
        for name in ("gpt3-1.7b", "gpt3-6.7b")
    ]
    layer_model = fit_layer_cost_model(profiles)
    large_model = load_model("gpt3-175b")
    truth = SimulatedDevice(device, large_model, 2048, "bf16")
    for tp in (4, 8):
        point = LayerPoint(large_model, 2048, "bf16", "decoder", 4, tp, "selective")
        predicted, expected = layer_model.cost(point), truth.layer_cost("decoder", 4, tp, "selective")
        assert predicted.time_s == pytest.approx(expected.time_s, rel=0.10)
        assert predicted.activation_bytes == pytest.approx(expected.activation_bytes, rel=0.05)


def test_link_fit_recovers_alpha_beta_and_group_size_growth():
    alpha, busbw, slowdown = 20e-6, 10e9, 0.1
    points = []
    for collective in ("all_reduce", "all_gather", "reduce_scatter"):
        for ranks in (2, 4, 8):
            for size in (2**12, 2**16, 2**20, 2**24, 2**28):
                per_byte = (1 + slowdown * math.log2(ranks / 2)) / busbw
                time_s = latency_steps(collective, ranks) * alpha + size * bus_factor(collective, ranks) * per_byte
                points.append(LinkPoint(collective=collective, ranks=ranks, size_bytes=size, time_s=time_s))
    link, error = fit_link("rail", points)
    assert link.alpha_s == pytest.approx(alpha, rel=0.01)
    assert link.bw_bytes_per_s == pytest.approx(busbw, rel=0.01)
    assert link.slowdown_per_doubling == pytest.approx(slowdown, rel=0.02)
    assert error < 1e-3
    # and the cost model uses it: an 8-rank all-reduce is slower per byte than a 2-rank one
    assert all_reduce_time_s(2**28, 8, link) / (2 * 7 / 8) > all_reduce_time_s(2**28, 2, link)


def test_link_fit_gives_each_collective_its_own_bandwidth():
    """Gloo between local processes moves a reduce-scatter's bus bytes 3x slower than an all-reduce's, an all-gather's
    1.5x: one bandwidth for all read a 4 MiB reduce-scatter 40% short; each its own recovers all three."""
    alpha, per_byte = 300e-6, {"all_reduce": 1.0e-9, "all_gather": 1.5e-9, "reduce_scatter": 3.0e-9}
    points = [
        LinkPoint(
            collective=collective,
            ranks=2,
            size_bytes=size,
            time_s=latency_steps(collective, 2) * alpha + size * bus_factor(collective, 2) * per_byte[collective],
        )
        for collective in per_byte
        for size in (2**12, 2**16, 2**20, 2**22, 2**24)
    ]
    link, error = fit_link("host", points)
    assert error < 1e-3
    size = 2**22
    assert all_reduce_time_s(size, 2, link) == pytest.approx(2 * alpha + size * 1.0e-9, rel=0.01)
    assert all_gather_time_s(size, 2, link) == pytest.approx(alpha + size / 2 * 1.5e-9, rel=0.01)
    assert reduce_scatter_time_s(size, 2, link) == pytest.approx(alpha + size / 2 * 3.0e-9, rel=0.01)
    # a collective measured at one size only takes all-reduce's bandwidth rather than a guess
    one_size = [p for p in points if p.collective != "all_gather" or p.size_bytes == size]
    link, _ = fit_link("host", one_size)
    assert link.all_gather_extra_s_per_byte == 0.0
    assert reduce_scatter_time_s(size, 2, link) == pytest.approx(alpha + size / 2 * 3.0e-9, rel=0.01)


def test_a_links_file_named_twice_is_read_once_and_a_second_one_names_the_first(tmp_path, monkeypatch):
    """`fit --profiles DIR --links DIR/links.json` (the README puts link profiles beside the profiles) refused the
    file it had already read from DIR as "a second links file"."""
    import shutil

    links = tmp_path / "links.json"
    shutil.copy(ROOT / "bench" / "results" / "links-cpu.json", links)
    monkeypatch.chdir(tmp_path)
    fitted = fit_predictor(link_paths=[links, Path("links.json")], published_runs=False)
    assert list(fitted.links) == ["cpu/in_node"]
    shutil.copy(links, tmp_path / "again.json")
    with pytest.raises(SpecError, match=r"again\.json: link_class: a second links file for 'in_node' links of 'cpu' "
                       r"\(the first: links\.json\)"):  # fmt: skip
        fit_predictor(link_paths=[Path("links.json"), tmp_path / "again.json"], published_runs=False)


def _synthetic_runs(true_values):
    """Iteration times of a few A100 strategies under known calibration values: the 'measurements'."""
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    cluster = cluster.only(cluster.group("a100"))
    model = load_model("gpt3-1.7b")
    cases = []
    for tp, pp, dp, recompute in ((1, 1, 16, "none"), (2, 2, 4, "selective"), (4, 1, 4, "full"), (8, 2, 1, "none")):
        training = load_training(None, {"global_batch_size": 64, "zero_stage": 0})
        ctx = build_context(cluster, model, training)
        strategy = megatron_strategy(
            cluster, model, training, group="a100", tp=tp, pp=pp, dp=dp, micro_batch_size=1, recompute=recompute
        )
        measured = evaluate(apply(ctx, true_values), strategy).iteration_time_s
        cases.append((f"tp{tp}-pp{pp}-dp{dp}", ctx, strategy, measured))
    return cases


def test_calibration_recovers_a_known_compute_slowdown_and_predicts_the_runs():
    truth = {"compute:simulated": math.log(1.25)}
    cases = _synthetic_runs(truth)
    calibration = fit_calibration(cases)
    for run in calibration.runs:
        assert run.uncalibrated_iteration_time_s < run.measured_iteration_time_s * 0.9
        assert run.calibrated_iteration_time_s == pytest.approx(run.measured_iteration_time_s, rel=0.02)
    values = calibration.value_map()
    ctx = cases[0][1]
    total = sum(values.get(name, 0.0) for name in compute_parameter_names(ctx, "a100"))
    assert total == pytest.approx(math.log(1.25), abs=0.05)


def test_interval_covers_the_point_and_is_wider_for_a_device_no_run_informed():
    calibration = fit_calibration(_synthetic_runs({"compute:simulated": math.log(1.1)}))
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    widths = {}
    for name in ("a100", "v100"):
        alone = cluster.only(cluster.group(name))
        ctx = build_context(alone, model, training)
        strategy = megatron_strategy(
            alone, model, training, group=name, tp=2, pp=1, dp=8, micro_batch_size=1, recompute="none"
        )
        interval = prediction_interval(ctx, strategy, calibration)
        assert interval.low_s < interval.iteration_time_s < interval.high_s
        widths[name] = interval.log_sd
    assert widths["v100"] > widths["a100"]


def test_a_term_no_run_informed_widens_the_interval_by_what_it_can_add_not_by_its_slope():
    """A 3 ms step of a tiny CPU model under the 50 ms prior of the per-iteration overhead (no run informs it): the
    slope of log time, 1/t, extrapolated to one sd gave 0.000 - 899841423 s. One sd each way: the overhead adds
    up to 50 ms and takes nothing away (it is >= 0)."""
    cluster = load_cluster(EXAMPLES / "cpu-even.yaml")
    model = load_model(EXAMPLES / "models" / "tiny-llama.yaml").model_copy(
        update={"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4,
                "num_kv_heads": 2, "vocab_size": 256, "seq_length": 32}
    )  # fmt: skip
    training = load_training(None, {"global_batch_size": 8, "dtype": "fp32"})
    predictor = default_predictor()
    base = predictor.base_context(cluster, model, training)
    strategy = megatron_strategy(
        cluster, model, training, group="left", tp=1, pp=1, dp=1, micro_batch_size=8, recompute="none"
    )
    interval = predictor.interval(base, strategy)
    point = interval.iteration_time_s
    assert point < 0.02
    assert 0.3 * point < interval.low_s < point < interval.high_s < point + 2 * 0.05
    assert math.log(interval.high_s / point) > 2 * math.log(point / interval.low_s)  # the overhead only adds
    # a large model's interval is its slope's, as before (the terms move it by a small part of itself)
    a100 = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    a100 = a100.only(a100.group("a100"))
    big, big_training = load_model("gpt3-1.7b"), load_training(None, {"global_batch_size": 64})
    big_strategy = megatron_strategy(
        a100, big, big_training, group="a100", tp=2, pp=1, dp=8, micro_batch_size=1, recompute="none"
    )
    wide = predictor.interval(predictor.base_context(a100, big, big_training), big_strategy)
    assert math.log(wide.high_s / wide.iteration_time_s) == pytest.approx(
        math.log(wide.iteration_time_s / wide.low_s), rel=0.05
    )


def _cpu_run(measured_over_predicted: float):
    """A local run on examples/cpu-hetero.yaml's simulated CPUs, measured `measured_over_predicted` times its
    uncalibrated prediction."""
    cluster = load_cluster(EXAMPLES / "cpu-hetero.yaml")
    model = load_model(EXAMPLES / "models" / "tiny-llama.yaml")
    training = load_training(EXAMPLES / "training" / "cpu-run.yaml")
    ctx = build_context(cluster, model, training)
    strategy = megatron_strategy(
        cluster, model, training, group="fast", tp=1, pp=1, dp=2, micro_batch_size=2, recompute="none"
    )
    predicted = evaluate(ctx, strategy).iteration_time_s
    return ("cpu run", ctx, strategy, predicted * measured_over_predicted)


def test_a_local_cpu_run_moves_no_term_an_accelerator_prediction_uses():
    """One CPU run measured at twice its prediction, fitted beside accelerator runs: its terms are its own (`host:`),
    so the A100 runs' terms and a V100 prediction (a device no run covers) are as without it."""
    accelerators = _synthetic_runs({"compute:simulated": math.log(1.1), "network": math.log(1.3)})
    alone = fit_calibration(accelerators)
    with_cpu = fit_calibration([*accelerators, _cpu_run(2.0)])
    host_terms = {name for name in with_cpu.names if name.startswith("host:")}
    assert {"host:compute:simulated", "host:optimizer", "host:iteration_overhead_s"} <= host_terms
    assert with_cpu.value_map()["host:compute:simulated"] > 0.2  # the CPU run did teach its own terms
    shared = {name: value for name, value in with_cpu.value_map().items() if name not in host_terms}
    assert shared == pytest.approx(alone.value_map(), abs=1e-6)
    cluster = load_cluster(EXAMPLES / "a100-v100-32.yaml")
    v100 = cluster.only(cluster.group("v100"))
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    ctx = build_context(v100, model, training)
    strategy = megatron_strategy(
        v100, model, training, group="v100", tp=2, pp=1, dp=8, micro_batch_size=1, recompute="none"
    )
    before, after = (prediction_interval(ctx, strategy, c) for c in (alone, with_cpu))
    assert after.iteration_time_s == pytest.approx(before.iteration_time_s, rel=1e-9)
    assert after.log_sd == pytest.approx(before.log_sd, rel=1e-6)


def test_default_predictor_is_calibrated_on_the_published_runs_and_improves_them():
    predictor = default_predictor()
    runs = predictor.calibration.runs
    published = load_runs(PUBLISHED_RUNS)
    assert len(runs) == len(published) == 11
    families = {run.cluster.groups[0].device.key for run in published}
    assert families == {"h100", "a100-80gb", "mi250x", "ascend-910b", "v100"}
    before = sum(abs(r.uncalibrated_iteration_time_s / r.measured_iteration_time_s - 1) for r in runs)
    after = sum(abs(r.calibrated_iteration_time_s / r.measured_iteration_time_s - 1) for r in runs)
    assert after < before / 3
    for run in runs:  # every published run within 10% once calibrated
        assert abs(run.calibrated_iteration_time_s / run.measured_iteration_time_s - 1) < 0.10, run.name


def test_fitted_predictor_round_trips_and_refuses_another_version(tmp_path):
    fitted = fit_predictor([CPU_PROFILE], published_runs=False, name="cpu")
    path = tmp_path / "p.joblib"
    save_predictor(fitted, path)
    loaded = load_predictor(path)
    cluster = load_cluster(EXAMPLES / "cpu-2x2.yaml")
    model = load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    training = load_training(None, {"dtype": "fp32", "global_batch_size": 8, "seq_length": 256})
    strategy = megatron_strategy(
        cluster, model, training, group=None, tp=2, pp=1, dp=2, micro_batch_size=2, recompute="none"
    )
    times = [evaluate(p.context(cluster, model, training), strategy).iteration_time_s for p in (fitted, loaded)]
    assert times[0] == times[1]
    assert "learned layer model for cpu" in loaded.context(cluster, model, training).predictor_identity

    import joblib

    blob = joblib.load(path)
    blob["metadata"]["versions"]["scikit-learn"] = "0.0.1"
    joblib.dump(blob, path)
    with pytest.raises(SpecError, match=r"versions\.scikit-learn: fitted with scikit-learn 0\.0\.1"):
        load_predictor(path)
    (tmp_path / "junk.joblib").write_bytes(pickle.dumps({"not": "a predictor"}))
    with pytest.raises(SpecError, match="schema"):
        load_predictor(tmp_path / "junk.joblib")
    (tmp_path / "text.joblib").write_text("hello")
    with pytest.raises(SpecError, match="not a hetplan predictor file"):
        load_predictor(tmp_path / "text.joblib")


def test_run_record_errors_name_the_file_and_field(tmp_path):
    record = {"schema": "hetplan.run/1", **json.loads(PUBLISHED_RUNS.read_text())["runs"][0]}
    del record["measured_iteration_time_s"]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    with pytest.raises(SpecError, match=r"run\.json: measured_iteration_time_s: required field is missing"):
        load_runs(path)
    record["measured_iteration_time_s"] = 1.0
    record["strategy"]["pp"] = 5
    path.write_text(json.dumps(record))
    with pytest.raises(SpecError, match=r"24 layers do not split evenly into 5 stages"):
        load_runs(path)


def test_a_misspelt_key_in_a_run_records_plan_layout_is_named_where_it_is(tmp_path):
    """A run record's strategy is Megatron-style flags or a plan's layout (a union): a misspelt stage key is named in
    the plan layout, not drowned by the flags' branch refusing every key of a plan layout."""
    from predictor.runs import RunRecord
    from specs.loading import validate

    stage = {"group": "cpu", "layers": [0, 2], "tp": 1, "device_ofset": 1}
    pipeline = {"replicas": 1, "micro_batch_size": 1, "num_microbatches": 2, "stages": [stage]}
    record = {"name": "r", "source": "s", "cluster": "c.yaml", "model": "tiny", "measured_iteration_time_s": 1.0,
              "strategy": {"recompute": "none", "zero_stage": 1, "pipelines": [pipeline]}}  # fmt: skip
    with pytest.raises(SpecError) as caught:
        validate(RunRecord, record, "run.json")
    assert str(caught.value) == (
        "run.json: strategy.pipelines[0].stages[0].device_ofset: unknown field (check the spelling; see the README for "
        "the format)"
    )


def test_predictor_without_layer_models_leaves_profiles_and_simulation_alone():
    cluster = load_cluster(EXAMPLES / "cpu-2x2.yaml")
    model = load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
    training = load_training(None, {"dtype": "fp32", "global_batch_size": 8, "seq_length": 256})
    profile = load_profile(CPU_PROFILE)
    base = Predictor().base_context(cluster, model, training, {"cpu": profile})
    assert base.source("cpu") is profile


@pytest.mark.slow
def test_fit_then_predict_with_the_fitted_predictor_on_the_command_line(tmp_path):
    from tests.conftest import hetplan

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "cpu.json").write_bytes(CPU_PROFILE.read_bytes())
    out = tmp_path / "cpu.joblib"
    links = ROOT / "bench" / "results" / "links-cpu.json"
    fitted = hetplan("fit", "--profiles", str(profiles), "--links", str(links), "--out", str(out), "--json")
    assert fitted.returncode == 0, fitted.stderr
    body = json.loads(fitted.stdout)
    assert body["layer_models"]["cpu"]["cv_log_error_rms"] < 0.2
    assert body["links"]["cpu/in_node"]["busbw_bytes_per_s"] > 0
    runs = body["calibration"]["runs"]
    assert len(runs) == 11  # the bundled published runs, which the CPU's fitted link must not touch
    for run in runs:
        assert run["calibrated_iteration_time_s"] == pytest.approx(run["measured_iteration_time_s"], rel=0.10)
    held_out = {row["family"]: row for row in body["validation"]["leave_one_source_out"]["families"]}
    assert held_out["h100"]["sources"] == 2 and held_out["h100"]["mape"] < 0.08
    args = ["--cluster", str(EXAMPLES / "cpu-2x2.yaml"), "--model", str(EXAMPLES / "models" / "tiny-llama.yaml")]
    args += ["--tp", "2", "--dp", "2", "--micro-batch", "2", "--global-batch", "8", "--dtype", "fp32"]
    args += ["--seq-len", "256", "--json"]
    learned = json.loads(hetplan("predict", *args, "--predictor", str(out)).stdout)
    default = json.loads(hetplan("predict", *args).stdout)
    assert "learned layer model for cpu" in learned["predictor"]
    assert "learned" not in default["predictor"]
    for body in (learned, default):
        interval = body["iteration_time_interval_s"]
        assert interval["low"] < body["iteration_time_s"] < interval["high"]
    missing = hetplan("predict", *args, "--predictor", str(tmp_path / "nope.joblib"))
    assert missing.returncode == 2 and "predictor file not found" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_the_default_predictor_is_cached_by_the_code_and_data_it_comes_from(tmp_path, monkeypatch):
    import predictor.predictor as module

    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path / "cache"))
    fit, published = module.fit_predictor, module.PUBLISHED_RUNS
    module.default_predictor.cache_clear()
    first = module.default_predictor()
    files = list((tmp_path / "cache").iterdir())
    assert [f.name for f in files] == [f"default-predictor-{module.default_predictor_key()}.pickle"]
    module.default_predictor.cache_clear()
    monkeypatch.setattr(module, "fit_predictor", lambda **_: pytest.fail("refitted although cached"))
    assert module.default_predictor().calibration == first.calibration
    # other published runs: another key, so the cached file is not used for them
    runs = tmp_path / "runs.json"
    runs.write_text(published.read_text().replace('"iteration_time_s"', '"iteration_time_s" '))
    key = module.default_predictor_key()
    monkeypatch.setattr(module, "PUBLISHED_RUNS", runs)
    assert module.default_predictor_key() != key
    # a corrupt cache file is refitted, not trusted
    monkeypatch.setattr(module, "PUBLISHED_RUNS", published)
    monkeypatch.setattr(module, "fit_predictor", fit)
    files[0].write_bytes(b"not a pickle")
    module.default_predictor.cache_clear()
    assert module.default_predictor().calibration == first.calibration
    module.default_predictor.cache_clear()


def test_validate_predicts_every_published_run_within_ten_percent_and_names_the_families(tmp_path):
    result = hetplan("validate", str(PUBLISHED_RUNS), "--json")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert {row["family"] for row in body["families"]} == {"h100", "a100-80gb", "mi250x", "ascend-910b", "v100"}
    assert all(abs(run["error"]) < 0.10 for run in body["runs"])
    assert all(run["dominant_term"] in ("compute", "dp_sync", "tp_comm", "bubble") for run in body["runs"])
    assert body["worst"][0] == max(body["runs"], key=lambda run: abs(run["error"]))["name"]
    assert body["in_sample_runs"] == len(body["runs"])  # the shipped predictor's calibration runs: said so
    said = hetplan("validate", str(PUBLISHED_RUNS)).stdout
    assert "note: the predictor was calibrated on these runs: their errors are in-sample" in said
    bad = tmp_path / "runs.json"
    bad.write_text('{"schema": "hetplan.runs/9"}')
    refused = hetplan("validate", str(bad))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "schema" in refused.stderr


def test_leave_one_source_out_of_one_source_says_why_there_is_no_table():
    """`validate --leave-one-source-out` on runs of one source (a user's own run records) printed nothing about it."""
    from predictor.validation import validation_report
    from report.measurements import validation_renderables

    runs = load_runs(PUBLISHED_RUNS)
    own = [run for run in runs if run.source == runs[0].source]
    body = validation_report(Predictor(), own, held_out=True)
    why = body["leave_one_source_out"]["not_computed"]
    assert why.startswith(f"all {len(own)} runs have one source ({runs[0].source})") and "two or more" in why
    assert "refits the calibration on the runs given (not on the predictor's own)" in why
    assert f"leave one source out: not computed: {why}" in validation_renderables(body)
    assert "leave_one_source_out" not in validation_report(Predictor(), own, held_out=False)


def test_leave_one_source_out_stays_under_eight_percent_for_families_with_two_sources():
    from predictor.validation import family_errors, leave_one_source_out

    rows = family_errors(leave_one_source_out(Predictor(), load_runs(PUBLISHED_RUNS)))
    several = {row.family: row.mape for row in rows if row.sources >= 2}
    assert set(several) == {"h100", "a100-80gb"}
    assert all(mape < 0.08 for mape in several.values()), several


def test_fit_names_a_run_measured_on_a_machine_slower_than_when_profiled(tmp_path):
    from report.measuring import slow_machine_notes

    row = json.loads(PUBLISHED_RUNS.read_text())["runs"][0]
    paths = []
    for name, slowdown in (("quiet", 1.05), ("busy", 1.32)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"schema": "hetplan.run/1", **row, "name": name, "machine_slowdown": slowdown}))
        paths.append(path)
    runs = [run for path in paths for run in load_runs(path)]
    assert [run.machine_slowdown for run in runs] == [1.05, 1.32]
    assert slow_machine_notes(runs) == [
        f"note: run 'busy' ({paths[1]}) ran on a machine 1.32x slower than when profiled (its record's "
        "machine_slowdown): calibration learns its time as measured; rerun it on a quiet machine or leave it out"
    ]
