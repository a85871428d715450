"""A plan records where its costs came from (profile files and predictor, with SHA-256), and the commands that read
the plan use the same unless a flag says otherwise, saying so in one line; a changed file is named in one line, a
missing one is a one-line error that asks the user to choose."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, hetplan

CLUSTER = str(EXAMPLES / "cpu-hetero.yaml")
MODEL = str(EXAMPLES / "models" / "tiny-llama.yaml")
TRAINING = str(EXAMPLES / "training" / "cpu-run.yaml")


def _slow_profile(directory: Path, factor: float) -> Path:
    """A simulated CPU profile of tiny-llama whose times are `factor` x the datasheet's (far from what the
    predictor would simulate, so a command that ignores the profile predicts another time)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "cpu.json"
    made = hetplan("simulate-profile", "--device", "cpu", "--model", MODEL, "--out", str(path), "--dtype", "fp32",
                   "--tp", "1,2", "--micro-batches", "1,2")  # fmt: skip
    assert made.returncode == 0, made.stderr
    _scale(path, factor)
    return path


def _scale(path: Path, factor: float) -> None:
    body = json.loads(path.read_text())
    for entry in body["entries"]:
        for key in ("forward_time_s", "backward_time_s"):
            if entry.get(key) is not None:
                entry[key] *= factor
    path.write_text(json.dumps(body))


@pytest.fixture(scope="module")
def profiled_plan(tmp_path_factory):
    """A plan made with --profiles (a profile 3x slower than the datasheet), and that profile."""
    root = tmp_path_factory.mktemp("cost-source")
    profile = _slow_profile(root / "profiles", 3.0)
    plan = root / "plan.json"
    made = hetplan("plan", "-c", CLUSTER, "-m", MODEL, "--training", TRAINING, "--profiles", str(root / "profiles"),
                   "--out", str(plan), "--json", "-q")  # fmt: skip
    assert made.returncode == 0, made.stderr
    return plan, profile, json.loads(made.stdout)


def _predict(plan: Path, *flags: str):
    done = hetplan("predict", "-c", CLUSTER, "--strategy", str(plan), "--json", *flags)
    return done, (json.loads(done.stdout) if done.returncode == 0 else None)


def test_a_plan_records_its_profiles_and_predictor_with_their_hashes(profiled_plan):
    _, profile, body = profiled_plan
    source = body["cost_source"]
    assert source["predictor"]["kind"] == "shipped" and len(source["predictor"]["key"]) == 32
    assert source["profiles"] == [
        {"device": "cpu", "path": str(profile.resolve()), "sha256": hashlib.sha256(profile.read_bytes()).hexdigest()}
    ]


def test_predict_and_explain_use_the_recorded_profiles_and_say_so(profiled_plan, tmp_path):
    plan, profile, body = profiled_plan
    done, predicted = _predict(plan)
    assert done.returncode == 0, done.stderr
    assert predicted["iteration_time_s"] == body["iteration_time_s"]  # the plan's own costs, not the datasheet's
    assert done.stderr.count("\n") == 1 and "as recorded in the plan" in done.stderr
    assert str(profile.resolve()) in done.stderr
    explained = hetplan("explain", str(plan), "-c", CLUSTER, "--json", "-q")
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["iteration_time_s"] == pytest.approx(body["iteration_time_s"], rel=1e-5)
    assert f"profiles cpu={profile.resolve()} (as recorded in the plan)" in explained.stderr
    # an explicit --profiles overrides, and says what it replaced: an empty directory means the datasheet's costs
    (tmp_path / "none").mkdir()
    done, other = _predict(plan, "--profiles", str(tmp_path / "none"))
    assert done.returncode == 0, done.stderr
    assert other["iteration_time_s"] < body["iteration_time_s"] / 2
    assert "--profiles" in done.stderr and "the plan was made with profiles cpu=" in done.stderr


def test_a_changed_profile_is_named_in_one_line_and_used_as_it_is(profiled_plan, tmp_path):
    plan, profile, body = profiled_plan
    copy = tmp_path / "cpu.json"
    copy.write_bytes(profile.read_bytes())
    moved = tmp_path / "plan.json"
    recorded = json.loads(plan.read_text())
    recorded["cost_source"]["profiles"][0]["path"] = str(copy)
    moved.write_text(json.dumps(recorded))
    _scale(copy, 2.0)
    done, predicted = _predict(moved)
    assert done.returncode == 0, done.stderr
    changed = [line for line in done.stderr.splitlines() if "changed since the plan was made" in line]
    assert len(changed) == 1 and changed[0].startswith(f"{copy}: the plan's cpu profile changed"), done.stderr
    assert predicted["iteration_time_s"] > body["iteration_time_s"] * 1.5


def test_a_missing_profile_is_a_one_line_error_that_asks_to_choose(profiled_plan, tmp_path):
    plan, _, _ = profiled_plan
    moved = tmp_path / "plan.json"
    recorded = json.loads(plan.read_text())
    recorded["cost_source"]["profiles"][0]["path"] = str(tmp_path / "gone.json")
    moved.write_text(json.dumps(recorded))
    for command in (["explain", str(moved), "-c", CLUSTER], ["predict", "-c", CLUSTER, "--strategy", str(moved)]):
        done = hetplan(*command)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"{moved}: cost_source.profiles[0].path: {tmp_path / 'gone.json'}" in done.stderr
        assert "--profiles DIR" in done.stderr and "Traceback" not in done.stderr


def test_old_plans_without_a_cost_source_load_and_say_so(profiled_plan, tmp_path):
    plan, _, body = profiled_plan
    old = tmp_path / "old.json"
    recorded = json.loads(plan.read_text())
    del recorded["cost_source"]
    old.write_text(json.dumps(recorded))
    done, predicted = _predict(old)
    assert done.returncode == 0, done.stderr
    assert "records no cost source" in done.stderr and done.stderr.count("\n") == 1
    assert predicted["iteration_time_s"] < body["iteration_time_s"] / 2  # the shipped predictor's datasheet costs


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["profiles"][0].update(sha256="abc"), "cost_source.profiles[0].sha256"),
        (lambda s: s["predictor"].update(kind="file"), "cost_source.predictor"),
        (lambda s: s.update(extra=1), "cost_source.extra"),
    ],
)
def test_a_bad_cost_source_is_a_one_line_error_naming_the_field(profiled_plan, tmp_path, change, field):
    plan, _, _ = profiled_plan
    bad = tmp_path / "bad.json"
    recorded = json.loads(plan.read_text())
    change(recorded["cost_source"])
    bad.write_text(json.dumps(recorded))
    done = hetplan("explain", str(bad), "-c", CLUSTER)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{bad}: {field}" in done.stderr


@pytest.mark.slow
def test_a_predictor_file_is_recorded_and_used_and_its_loss_is_an_error(tmp_path):
    profile = _slow_profile(tmp_path / "profiles", 3.0)
    fitted = tmp_path / "p.joblib"
    made = hetplan("fit", "--profiles", str(profile.parent), "--out", str(fitted), "-q", "--json")
    assert made.returncode == 0, made.stderr
    plan = tmp_path / "plan.json"
    made = hetplan("plan", "-c", CLUSTER, "-m", MODEL, "--training", TRAINING, "--predictor", str(fitted),
                   "--out", str(plan), "--json", "-q")  # fmt: skip
    assert made.returncode == 0, made.stderr
    body = json.loads(made.stdout)
    digest = hashlib.sha256(fitted.read_bytes()).hexdigest()
    assert body["cost_source"]["predictor"] == {"kind": "file", "path": str(fitted.resolve()), "sha256": digest}
    done, predicted = _predict(plan)
    assert done.returncode == 0, done.stderr
    assert predicted["iteration_time_s"] == body["iteration_time_s"]
    assert f"predictor {fitted.resolve()} (as recorded in the plan)" in done.stderr
    fitted.rename(tmp_path / "moved.joblib")
    done, _ = _predict(plan)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cost_source.predictor.path" in done.stderr and "--predictor FILE" in done.stderr


def test_a_plan_made_with_profiles_in_memory_loads_and_says_they_were_never_saved(tmp_path):
    """The Python API may plan with a profile that is no file: the plan records its device without path or hash,
    loads back, and a command reading it says it uses the predictor's costs for that device."""
    from planner import load_plan, plan
    from planner.cost_source import plan_costs
    from profiler.simulated import SimulatedDevice
    from specs import get_device, load_cluster, load_model, load_training

    model = load_model(MODEL)
    profile = SimulatedDevice(get_device("cpu"), model, model.seq_length, "fp32").to_profile((1, 2), (1, 2))
    training = load_training(TRAINING)
    made = plan(load_cluster(CLUSTER), model, training, {"cpu": profile})
    assert made.to_dict()["cost_source"]["profiles"] == [{"device": "cpu", "path": "", "sha256": ""}]
    path = tmp_path / "plan.json"
    made.save(path)
    costs = plan_costs(load_plan(path))
    assert costs.profiles == {}
    assert "cpu=(never saved) (as recorded in the plan)" in costs.lines[0]
    assert costs.lines[1] == (
        f"{path}: made with a cpu profile that was never saved to a file: using the predictor's costs for cpu "
        "(pass --profiles DIR to choose)"
    )


def test_replan_and_export_use_the_recorded_profiles_too(profiled_plan, tmp_path):
    plan, profile, body = profiled_plan
    new = tmp_path / "new.json"
    done = hetplan("replan", str(plan), "-c", CLUSTER, "--without", "group:slow:1", "--out", str(new), "-q", "--json")
    assert done.returncode == 0, done.stderr
    assert "(as recorded in the plan)" in done.stderr
    assert json.loads(new.read_text())["cost_source"] == body["cost_source"]  # the new plan keeps the source
    exported = hetplan("export", str(plan), "-c", CLUSTER, "-f", "torchrun", "--out", str(tmp_path / "x"), "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["plan_iteration_time_s"] == pytest.approx(body["iteration_time_s"], rel=1e-5)
    assert f"profiles cpu={profile.resolve()} (as recorded in the plan)" in exported.stderr


def test_a_directory_with_a_link_profile_beside_the_layers_is_said_by_its_layer_profile(tmp_path):
    """The plan records a device's layer profile, then its link profiles; the costs line kept the last file per
    device and named the link profile as the cpu profile."""
    from tests.conftest import ROOT

    profile = _slow_profile(tmp_path / "profiles", 3.0)
    (profile.parent / "links.json").write_bytes((ROOT / "bench" / "results" / "links-cpu.json").read_bytes())
    plan = tmp_path / "plan.json"
    made = hetplan("plan", "-c", CLUSTER, "-m", MODEL, "--training", TRAINING, "--profiles", str(profile.parent),
                   "--out", str(plan), "-q")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert len(json.loads(plan.read_text())["cost_source"]["profiles"]) == 2  # both recorded
    done, _ = _predict(plan)
    assert done.returncode == 0, done.stderr
    assert f"profiles cpu={profile.resolve()} (as recorded in the plan)" in done.stderr


def _cpu_record(directory: Path, name: str, cost_source: dict | None, model: str = MODEL) -> Path:
    """A run record of tiny-llama on examples/cpu-2x2.yaml (TP 1, DP 4) whose prediction came from `cost_source`."""
    record = {
        "schema": "hetplan.run/1",
        "name": name,
        "source": f"a test ({name})",
        "cluster": str(EXAMPLES / "cpu-2x2.yaml"),
        "model": model,
        "training": {"global_batch_size": 8, "seq_length": 256, "dtype": "fp32", "zero_stage": 0},
        "strategy": {"group": "cpu", "tp": 1, "pp": 1, "dp": 4, "micro_batch_size": 1, "recompute": "none"},
        "measured_iteration_time_s": 0.5,
        "measurements": {"cost_source": cost_source} if cost_source else {},
    }
    path = directory / f"{name}.json"
    path.write_text(json.dumps(record))
    return path


def test_validate_predicts_run_records_from_the_costs_they_record_and_says_which(profiled_plan, tmp_path):
    """`hetplan run` records the costs its prediction came from: validate uses them when every record names the same
    ones (a recorded profile 3x the datasheet's: 3x the shipped predictor's time), names a missing one in one line,
    and with records that disagree predicts with the shipped predictor and says how many named others."""
    from planner.cost_source import run_costs
    from predictor.runs import load_runs

    _, profile, body = profiled_plan
    recorded = body["cost_source"]
    runs = [run for name in ("a", "b") for run in load_runs(_cpu_record(tmp_path, name, recorded))]
    costs = run_costs(runs)
    assert costs.lines[0] == (
        f"costs: the shipped predictor {recorded['predictor']['key'][:12]}, profiles cpu={profile.resolve()} (as "
        "recorded in the run records), the predictor's calibration not applied (as `hetplan run` predicted)"
    )
    from_profile = hetplan("validate", str(tmp_path / "a.json"), "--json")
    shipped = hetplan("validate", str(tmp_path / "a.json"), "--predictor", "/nonexistent.joblib")
    assert shipped.returncode == 2 and "/nonexistent.joblib" in shipped.stderr  # the flag is read, not the record
    plain = _cpu_record(tmp_path, "plain", None)
    datasheet = hetplan("validate", str(plain), "--json")
    assert from_profile.returncode == datasheet.returncode == 0, from_profile.stderr + datasheet.stderr
    predicted = [json.loads(done.stdout)["runs"][0]["predicted_s"] for done in (from_profile, datasheet)]
    assert predicted[0] / predicted[1] == pytest.approx(3.0, rel=0.15)  # compute dominates this tiny CPU run
    mixed = run_costs(
        [*runs, *load_runs(plain), *load_runs(_cpu_record(tmp_path, "other", {**recorded, "profiles": []}))]
    )
    assert not mixed.profiles and mixed.lines == (
        "costs: the shipped predictor (3 of 4 run records name the costs `hetplan run` predicted them with, 2 "
        "different ones: validate them apart to use those, or pass --predictor / --profiles)",
    )
    gone = {**recorded, "predictor": {"kind": "file", "path": str(tmp_path / "gone.joblib"), "sha256": "0" * 64}}
    lost = hetplan("validate", str(_cpu_record(tmp_path, "lost", gone)))
    assert lost.returncode == 2 and lost.stderr.count("\n") == 1, lost.stderr
    where = f"hetplan: error: {tmp_path / 'lost.json'}: measurements.cost_source.predictor.path: "
    assert lost.stderr.startswith(where)
    assert "the predictor the run was predicted with, is missing: restore it or choose one with --predictor" in (
        lost.stderr
    )


def test_validate_profiles_refuse_a_run_of_another_layer_shape(profiled_plan, tmp_path):
    _, profile, _ = profiled_plan
    tiny = _cpu_record(tmp_path, "tiny", None)
    small = _cpu_record(tmp_path, "small", None, model=str(EXAMPLES / "models" / "small-llama.yaml"))
    done = hetplan("validate", str(tiny), str(small), "--profiles", str(profile.parent))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"hetplan: error: {small}: model: run 'small' trains ")
    assert "whose layers --profiles" in done.stderr and "validate it apart" in done.stderr
    alone = hetplan("validate", str(tiny), "--profiles", str(profile.parent), "--json")
    assert alone.returncode == 0, alone.stderr
    assert f"profiles cpu={profile} from --profiles {profile.parent}" in json.loads(alone.stdout)["costs"][0]


def test_costs_for_another_dtype_keep_only_the_profiles_timed_in_it(tmp_path):
    """An export to an engine that trains in fp32 (torchtitan, an fp16 plan) rebuilds the plan's costs in fp32: a
    V100 profile timed in fp16 cannot say fp32 times, so the V100 takes the predictor's costs, and a line says so."""
    from planner.cost_source import PlanCosts
    from predictor.predictor import default_predictor
    from profiler.profile import load_profile
    from specs import load_cluster, load_model, load_training

    path = tmp_path / "v100.json"
    made = hetplan("simulate-profile", "--device", "v100", "--model", MODEL, "--out", str(path), "--dtype", "fp16",
                   "--tp", "1", "--micro-batches", "1")  # fmt: skip
    assert made.returncode == 0, made.stderr
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_model(MODEL)
    costs = PlanCosts(default_predictor(), {"v100": load_profile(path)}, ())
    v100 = next(group.name for group in cluster.groups if group.device.key == "v100")
    same, note = costs.context_in(cluster, model, load_training(overrides={"dtype": "fp16", "seq_length": 256}))
    assert note == "" and same.source(v100).identity.startswith(load_profile(path).identity)
    fp32, note = costs.context_in(cluster, model, load_training(overrides={"dtype": "fp32", "seq_length": 256}))
    assert note == "note: the profiles of v100 time layers in fp16: in fp32 their costs are the predictor's"
    assert str(path) not in fp32.source(v100).identity and "simulated v100" in fp32.source(v100).identity


def test_a_bf16_plan_with_idle_v100s_reads_back_with_a_v100_profile_timed_in_fp16(tmp_path):
    """Profiles of both groups (the V100's in fp16, all it has), a bf16 plan on the A100s: the plan records both, and
    `predict` of it refused the V100 profile ("profiled in fp16, training runs bf16 there") though no stage runs
    there. The profiles cover TP 1 and 2 only: calibrated (a saved simulation takes the datasheet's terms), the plan
    asked them for TP 4 ("no decoder entry for tp=4"), the scaled source hiding what they cover."""
    from profiler.profile import ScaledLayerCosts, load_profile

    cluster = str(EXAMPLES / "a100-v100-32.yaml")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for device, dtype in (("a100-80gb", "bf16"), ("v100", "fp16")):
        made = hetplan("simulate-profile", "--device", device, "--model", "gpt3-1.7b", "--out",
                       str(profiles / f"{device}.json"), "--dtype", dtype, "--tp", "1,2",
                       "--micro-batches", "1,2")  # fmt: skip
        assert made.returncode == 0, made.stderr
    assert ScaledLayerCosts(load_profile(profiles / "v100.json"), 1.2).tp_degrees() == (1, 2)
    plan = tmp_path / "plan.json"
    made = hetplan("plan", "-c", cluster, "-m", "gpt3-1.7b", "--global-batch", "64", "--dtype", "bf16", "--profiles",
                   str(profiles), "--out", str(plan), "--json", "-q")  # fmt: skip
    assert made.returncode == 0, made.stderr
    body = json.loads(made.stdout)
    assert body["search"]["idle_note"].startswith("v100 (16 devices) left idle")
    assert {entry["device"] for entry in body["cost_source"]["profiles"]} == {"a100-80gb", "v100"}
    done, predicted = _predict_on(cluster, plan)
    assert done.returncode == 0, done.stderr
    assert predicted["iteration_time_s"] == pytest.approx(body["iteration_time_s"], rel=1e-9)


def _predict_on(cluster: str, plan: Path):
    done = hetplan("predict", "-c", cluster, "--strategy", str(plan), "--json")
    return done, (json.loads(done.stdout) if done.returncode == 0 else None)
