"""profile-comm: real Gloo collectives between local processes, nccl-tests bandwidth conventions, alpha-beta fits."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from profiler.collectives import bus_factor
from profiler.comm_bench import CommPoint, fit_link, link_profile, run_local
from tests.conftest import hetplan

pytestmark = pytest.mark.slow  # every test here runs several processes


def test_fit_recovers_a_known_alpha_beta():
    alpha, busbw, ranks = 20e-6, 5e9, 4
    points = []
    for size in (4096, 65536, 2**20, 2**24):
        time_s = 2 * (ranks - 1) * alpha + size * bus_factor("all_reduce", ranks) / busbw
        points.append(CommPoint("all_reduce", ranks, size, time_s, size / time_s, 0.0, True))
    fit = fit_link(points, "in_node")
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.busbw_bytes_per_s == pytest.approx(busbw, rel=1e-6)
    assert fit.fit_max_rel_error < 1e-9


@pytest.mark.parametrize("ranks", [2, 4])
def test_local_collectives_are_correct_and_reported_nccl_tests_style(tmp_path, ranks):
    collectives = ["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
    points = run_local(ranks, [4096, 262144], collectives, repeats=2, scratch=tmp_path, timeout_s=60)
    assert {p.collective for p in points} == set(collectives)
    for point in points:
        assert point.correct, point
        assert point.ranks == ranks and point.time_s > 0
        # a rank computes in a collective (Gloo's reductions and copies), never more than its threads could
        assert 0 < point.mean_cpu_time_s < 4 * point.mean_time_s
        assert point.algbw_bytes_per_s == pytest.approx(point.size_bytes / point.time_s)
        assert point.busbw_bytes_per_s == pytest.approx(point.algbw_bytes_per_s * bus_factor(point.collective, ranks))
    profile = link_profile(points, "in_node", "gloo")
    assert profile["schema"] == "hetplan.links/1"
    assert len(profile["links"]) == 4
    # (None: times that do not grow with the size over these two measure no bandwidth; it was written as 1e15 B/s)
    assert all(link["alpha_s"] >= 0 for link in profile["links"])
    assert all(link["busbw_bytes_per_s"] is None or 0 < link["busbw_bytes_per_s"] < 1e12 for link in profile["links"])


def test_cli_profile_comm_writes_a_link_profile(tmp_path):
    out = tmp_path / "links.json"
    result = hetplan(
        "profile-comm",
        "--world",
        "2",
        "--max-size",
        # profile-comm refuses a profile of latencies alone: 16 MiB (~30 ms) stands well above the latencies' jitter
        # on a loaded host, where 4 MiB (~8 ms) once did not (CI)
        "16MiB",
        "--ops",
        "all_reduce,send_recv",
        "--repeats",
        "2",
        "--no-shared-cores",
        "--out",
        str(out),
        torch_allowed=True,
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(out.read_text())
    assert {link["collective"] for link in body["links"]} == {"all_reduce", "send_recv"}
    assert {link["link_class"] for link in body["links"]} == {"host"}  # local processes: this machine's link
    assert all("fit_median_rel_error" in link for link in body["links"])
    bad = hetplan("profile-comm", "--world", "1", "--out", str(out), torch_allowed=True)
    assert bad.returncode == 2 and "expected process counts from 2 to" in bad.stderr


def test_profile_comm_under_torchrun(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "links.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "cli",
        "profile-comm",
        "--max-size",
        "16MiB",  # as above
        "--ops",
        "all_reduce",
        "--repeats",
        "2",
        "--out",
        str(out),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    body = json.loads(out.read_text())
    assert [link["ranks"] for link in body["links"]] == [2]
    assert all(point["correct"] for point in body["points"])


def test_points_record_mean_waits_and_the_processes_per_core_with_busy_processes_beside(tmp_path):
    """The ranks compute between operations and a background process computes beside them: each point records the
    mean wait (what a step sums) and (ranks + 1) / cores processes per core."""
    from profiler.machine import host_cores

    points = run_local(2, [4096], ["all_reduce", "send_recv"], 2, tmp_path, 60, gap_s=0.001, busy_processes=1)
    assert [p.collective for p in points] == ["all_reduce", "send_recv"]
    for point in points:
        assert point.correct and point.mean_time_s > 0 and point.time_s > 0
        assert point.processes_per_core == pytest.approx(3 / host_cores())
