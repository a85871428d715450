"""The runtime-vs-prediction bench's choice of runs: a run the machine checks read as disturbed is left out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import runtime_vs_prediction as bench


def run(step_s: float, slowdown: float = 1.0, cores_slowdown: float | None = None, others: float = 0.0) -> dict:
    speed = {"checked": True} | ({"cores_slowdown": cores_slowdown} if cores_slowdown is not None else {})
    speed["other_work"] = {"checked": True, "cores": 2, "over_s": 5.0, "other_processes_cores": others,
                           "stolen_cores": 0.0}  # fmt: skip
    return {"measured_iteration_time_s": step_s, "machine_slowdown": slowdown, "measurements": {"machine_speed": speed}}


def test_disturbed_runs_leave_the_median_unless_every_run_was(tmp_path):
    quiet, slow_cores, slow_alone = run(0.11), run(0.17, cores_slowdown=1.4), run(0.2, slowdown=1.3)
    assert [bench.was_disturbed(r) for r in (quiet, slow_cores, slow_alone)] == [False, True, True]
    assert not bench.was_disturbed(run(0.11, cores_slowdown=bench.DISTURBED_LIMIT))  # at the limit: counted
    assert bench.counted([slow_cores, quiet, slow_alone]) == [quiet]
    assert bench.counted([slow_cores, slow_alone]) == [slow_cores, slow_alone]  # all disturbed: all counted
    assert bench.cores_slowdown(run(0.1)) == 1.0  # a record from before the all-cores check
    # other work on the cores during the run (a host shared with other jobs, which the speed checks do not see)
    assert bench.was_disturbed(run(0.11, others=0.5)) and not bench.was_disturbed(run(0.11, others=0.05))
    before_the_check = run(0.11)
    del before_the_check["measurements"]["machine_speed"]["other_work"]
    assert bench.other_work_cores(before_the_check) == 0.0 and not bench.was_disturbed(before_the_check)
    paths = []
    for index, record in enumerate((slow_cores, quiet, run(0.12), slow_alone, run(0.13))):
        paths.append(tmp_path / f"run-{index}.json")
        paths[-1].write_text(json.dumps(record), encoding="utf-8")
    assert bench.median_run(paths) == paths[2]  # 0.12 of the counted 0.11, 0.12, 0.13 (with all five: 0.13)


def test_steadiness_is_the_slowest_timing_over_the_fastest():
    timings = iter([1.0, 1.1, 1.5, 1.2])
    assert bench.steadiness(lambda: next(timings), samples=4, gap_s=0.0) == pytest.approx(0.5)


def stop_before_profiling(monkeypatch, tmp_path: Path, moved: float) -> str:
    """The bench's line when it stops before profiling, its steadiness check reading `moved`."""
    monkeypatch.setattr(bench, "steadiness", lambda *args: moved)
    monkeypatch.setattr(bench, "measure_links", lambda *args: pytest.fail("profiled on a disturbed machine"))
    monkeypatch.setattr(sys, "argv", ["runtime_vs_prediction.py", "--work", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    return str(stopped.value.code)


def test_the_bench_stops_before_profiling_on_a_machine_whose_speed_moves(monkeypatch, tmp_path):
    """One line says why, before ten minutes of profiles and an hour of runs measure the machine instead."""
    said = stop_before_profiling(monkeypatch, tmp_path, 0.69)
    assert "the machine's speed moves by 69% over 20 s (limit 30%)" in said and "or pass --anyway" in said


def test_the_bench_stops_before_profiling_beside_other_work(monkeypatch, tmp_path):
    """A steady layer timing on a host where other work takes a core: a timed layer alone finds the free one, the
    grid's ranks would share it; one line says so (here 0.6 of the cores: 3 s of others' busy time over 5 s)."""
    from profiler.machine import HostTimes

    readings = iter([HostTimes(0.0, 10.0, 0.0, 1.0), HostTimes(5.0, 14.5, 0.0, 2.5)])
    monkeypatch.setattr(bench, "host_times", lambda: next(readings))
    said = stop_before_profiling(monkeypatch, tmp_path, 0.05)
    assert "other work took 0.60 of the host's" in said and "(limit 0.1): the grid would measure the machine" in said
    # readings a moment apart (a steadiness check stood in for) are clock-tick noise, not other work: not read
    readings = iter([HostTimes(0.0, 10.0, 0.0, 1.0), HostTimes(0.01, 10.02, 0.0, 1.0)])
    bench.check_machine(anyway=False)  # (it would stop: 2 cores of others over 0.01 s)


def test_the_bench_stops_after_a_round_the_machine_disturbed(monkeypatch, tmp_path):
    """A host that slows after the steadiness check (grid 28: 12 of its first round's 30 runs disturbed) stops the
    bench after that round, in one line; a round with a quarter or fewer disturbed goes on."""
    paths = []
    for index in range(8):
        paths.append(tmp_path / f"run-{index}.json")
        paths[-1].write_text(json.dumps(run(0.1, slowdown=1.3 if index < 3 else 1.0)), encoding="utf-8")
    stop = bench.disturbed_round(paths, "1")
    assert stop is not None and "3 of round 1's 8 runs ran on a machine more than 15% slower than profiled" in stop
    quiet = tmp_path / "run-quiet.json"
    quiet.write_text(json.dumps(run(0.1)), encoding="utf-8")
    assert bench.disturbed_round([*paths[1:], quiet], "1") is None  # 2 of 8: a quarter
    monkeypatch.setattr(bench, "steadiness", lambda *args: 0.05)
    monkeypatch.setattr(bench, "measure_links", lambda work, reuse: work / "links.json")
    profiles = ({size: tmp_path for size in bench.MODELS}, {})
    monkeypatch.setattr(bench, "measure_profiles", lambda work, reuse, links, anyway: profiles)
    ran: list[str] = []

    def disturbed_run(case, profiles, settings, out):
        ran.append(case.name)
        out.write_text(json.dumps(run(0.1, slowdown=1.3)), encoding="utf-8")

    monkeypatch.setattr(bench, "run_case", disturbed_run)
    monkeypatch.setattr(sys, "argv", ["runtime_vs_prediction.py", "--work", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert len(ran) == len(bench.grid())  # one round, then the stop
    message = str(stopped.value.code)
    assert f"{len(ran)} of round 1's {len(ran)} runs" in message and "--anyway" in message


def test_a_profile_its_layer_disagrees_with_right_after_is_taken_again(monkeypatch, tmp_path):
    """Grid 36's small profile was taken at a slow moment: every small run then timed its layer at 0.71-0.80x the
    profile. A profile whose check reads beyond the limit is taken again; three such attempts stop the bench."""
    profiled: list[str] = []
    monkeypatch.setattr(bench, "hetplan", lambda *arguments: profiled.append(arguments[2]))
    checks = iter([0.75, 1.02, 1.1, 0.97])  # tiny: slow profile, then agreeing; small: agreeing; 10x: agreeing
    monkeypatch.setattr(bench, "profile_check", lambda size, path: next(checks))
    links = tmp_path / "links-cpu.json"
    links.write_text("{}", encoding="utf-8")
    directories, read = bench.measure_profiles(tmp_path, False, links, anyway=False)
    assert read == {"tiny": [0.75, 1.02], "small": [1.1], "10x": [0.97]}
    assert [Path(model).name for model in profiled] == ["model-tiny.json"] * 2 + ["model-small.json", "model-10x.json"]
    assert (directories["small"] / links.name).exists()
    checks = iter([1.3, 0.8, 1.2])
    with pytest.raises(SystemExit) as stopped:
        bench.measure_profiles(tmp_path, False, links, anyway=False)
    assert "the tiny model's profile and its layer timed right after it disagree in 3 attempts" in str(
        stopped.value.code
    )
    assert "1.30, 0.80, 1.20" in str(stopped.value.code)
    checks = iter([1.3, 0.8, 1.2, 1.0, 1.0])
    assert bench.measure_profiles(tmp_path, False, links, anyway=True)[1]["tiny"] == [1.3, 0.8, 1.2]


def test_the_profile_check_times_the_reference_layer_against_the_profile(monkeypatch, tmp_path):
    """The check is the runs' own: the fastest of PROFILE_CHECKS timings over the profiled forward + backward."""
    from profiler.profile import DeviceProfile, ProfileEntry

    def entry(micro_batch_size: int, tp: int, forward_time_s: float) -> ProfileEntry:
        return ProfileEntry(layer="decoder", micro_batch_size=micro_batch_size, tp=tp, forward_time_s=forward_time_s,
                            backward_time_s=2 * forward_time_s, activation_bytes=0)  # fmt: skip

    path = tmp_path / "cpu.json"
    entries = [entry(2, 1, 4e-3), entry(1, 2, 1e-3), entry(1, 1, 2e-3)]
    DeviceProfile(source="measured", device={"key": "cpu"}, model={}, dtype="fp32", seq_length=16,
                  entries=entries).save(path)  # fmt: skip
    profile = bench.load_profile(path)
    reference = bench.reference_entry(profile)
    assert (reference.micro_batch_size, reference.tp) == (1, 1)
    profiled_s = 6e-3
    timings = iter([3.0, 2.0, 2.5])
    monkeypatch.setattr(bench, "reference_time_s", lambda model, profile, entry: next(timings) * profiled_s)
    assert bench.profile_check("tiny", path) == pytest.approx(2.0)
