"""The unified communicator with simulated islands: 2-4 local processes, Gloo on loopback, every wait bounded."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from comm.communicator import CommError, Communicator  # noqa: E402
from comm.vendors import VENDORS, detect_local_vendor  # noqa: E402
from profiler.comm_bench import free_port  # noqa: E402

ISLANDS = ["nvidia", "nvidia", "amd", "amd"]


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _collectives_worker(rank: int, port: int, out: str) -> None:
    _init(rank, 4, port, 30.0)
    checks: dict[str, bool] = {}
    try:
        comm = Communicator(ISLANDS, timeout_s=30.0)
        world, partial, inside = comm.create_groups([[0, 1, 2, 3], [0, 1, 2], [0, 1]])
        value = torch.arange(7, dtype=torch.float64) * (rank + 1)
        expected = torch.arange(7, dtype=torch.float64) * 10  # 1 + 2 + 3 + 4
        checks["world all_reduce (equal islands, padded)"] = torch.equal(
            comm.all_reduce(value.clone(), world), expected
        )
        if rank in (0, 1, 2):
            got = comm.all_reduce(value.clone(), partial)
            checks["partial all_reduce (unequal islands)"] = torch.equal(got, torch.arange(7, dtype=torch.float64) * 6)
        if rank in (0, 1):
            got = comm.all_reduce(value.clone(), inside)
            checks["single-island all_reduce (native)"] = torch.equal(got, torch.arange(7, dtype=torch.float64) * 3)
        gathered = comm.all_gather(torch.tensor([float(rank)]), world)
        checks["all_gather"] = [float(t) for t in gathered] == [0.0, 1.0, 2.0, 3.0]
        shard = comm.reduce_scatter(torch.arange(8, dtype=torch.float64) + rank, world)
        full = sum(torch.arange(8, dtype=torch.float64) + r for r in range(4))
        checks["reduce_scatter"] = torch.equal(shard, full.chunk(4)[rank])
        sent = torch.full((3,), 7.0) if rank == 2 else torch.zeros(3)
        checks["broadcast across islands"] = torch.equal(comm.broadcast(sent, 2, world), torch.full((3,), 7.0))
        if rank == 0:
            comm.send(torch.tensor([1.0, 2.0]), 3)
            checks["recv across islands"] = torch.equal(comm.recv(torch.zeros(2), 3), torch.tensor([2.0, 4.0]))
        if rank == 3:
            received = comm.recv(torch.zeros(2), 0)
            comm.send(received * 2, 0)
            checks["send across islands"] = torch.equal(received, torch.tensor([1.0, 2.0]))
        # uneven batches: replica r holds r+1 samples; gradients scaled by share then summed = full-batch gradient
        torch.manual_seed(0)
        weight = torch.randn(5, 1, dtype=torch.float64)
        data = torch.randn(10, 5, dtype=torch.float64)
        sizes = [1, 2, 3, 4]
        start = sum(sizes[:rank])
        local = data[start : start + sizes[rank]]
        w = weight.clone().requires_grad_()
        (local @ w).pow(2).mean().backward()
        grad = w.grad * (sizes[rank] / sum(sizes))
        comm.all_reduce(grad, world)
        w_ref = weight.clone().requires_grad_()
        (data @ w_ref).pow(2).mean().backward()
        checks["uneven-batch weighted gradient sync"] = torch.allclose(grad, w_ref.grad, atol=1e-12)
        comm.barrier(world)
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(checks))
        dist.destroy_process_group()


def _dying_worker(rank: int, port: int, out: str) -> None:
    _init(rank, 3, port, 60.0)  # the ranks' start under load may take seconds apart: not the timeout under test
    dist.barrier()
    comm = Communicator(["nvidia", "amd", "amd"], timeout_s=5.0)
    (world,) = comm.create_groups([[0, 1, 2]])
    comm.all_reduce(torch.ones(4), world)  # everybody alive
    if rank == 2:
        os._exit(1)  # dies without a word
    started = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), world)
        result = {"error": None}
    except CommError as err:
        result = {"error": str(err)}
    result["elapsed_s"] = time.monotonic() - started
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the group cannot be torn down cleanly with a dead member


def _spawn(worker, ranks: int, tmp_path: Path, deadline_s: float) -> dict[int, dict]:
    """Start the ranks and wait for each (bounded); a rank that is meant to die does not stop the others."""
    context = mp.start_processes(
        worker, args=(free_port(), str(tmp_path)), nprocs=ranks, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    try:
        for process in context.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        assert all(not p.is_alive() for p in context.processes), "workers did not finish in time"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    files = {r: Path(tmp_path, f"{r}.json") for r in range(ranks)}
    return {r: json.loads(path.read_text()) for r, path in files.items() if path.exists()}


@pytest.mark.slow
def test_every_collective_is_correct_across_simulated_islands(tmp_path):
    results = _spawn(_collectives_worker, 4, tmp_path, 120)
    assert sorted(results) == [0, 1, 2, 3]
    for rank, checks in results.items():
        assert checks and all(checks.values()), (rank, checks)
    assert results[0]["recv across islands"] and results[3]["send across islands"]
    assert "partial all_reduce (unequal islands)" in results[2]


@pytest.mark.slow
def test_a_dead_peer_makes_the_others_fail_cleanly_within_the_timeout(tmp_path):
    results = _spawn(_dying_worker, 3, tmp_path, 60)
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert result["error"] and "all_reduce over ranks [0, 1, 2] failed within the 5 s timeout" in result["error"]
        assert result["elapsed_s"] < 5 + 3


def test_local_vendor_detection_and_registry():
    assert detect_local_vendor().name in VENDORS
    assert VENDORS["amd"].backend == "nccl" and VENDORS["amd"].library == "RCCL"
    assert VENDORS["ascend"].backend == "hccl" and VENDORS["cpu"].backend == "gloo"


def test_the_communicators_vendors_are_the_registrys():
    from specs.vendors import vendor_catalog

    registry = vendor_catalog()
    assert list(VENDORS) == list(registry)
    for name, vendor in VENDORS.items():
        info = registry[name]
        assert (vendor.device_type, vendor.backend) == (info.device_type, info.backend)
        assert vendor.library == info.library_name
    assert VENDORS["cpu"].available() and VENDORS["intel"].backend == "xccl"


def test_rank_islands_name_the_registry_vendor_of_every_rank_and_refuse_an_unknown_one():
    from comm.plan_groups import rank_islands
    from specs import SpecError, load_cluster

    cluster = load_cluster(Path(__file__).parent.parent / "examples" / "four-vendor-256.yaml")
    islands = rank_islands(cluster)
    assert len(islands) == cluster.num_devices
    assert sorted(set(islands)) == ["amd", "ascend", "habana", "nvidia"]  # the catalog says huawei, intel-habana
    group = cluster.groups[0]
    odd = replace(cluster, groups=(replace(group, device=group.device.model_copy(update={"vendor": "acme"})),))
    with pytest.raises(SpecError, match=r"group .*: unknown vendor 'acme'; expected one of: nvidia, amd, ascend"):
        rank_islands(odd)


def _plan_groups_worker(rank: int, port: int, out: str, islands: list[str], groups: list[list[int]]) -> None:
    _init(rank, len(islands), port, 30.0)
    sums = []
    try:
        comm = Communicator(islands, timeout_s=30.0)
        made = comm.create_groups(groups)  # every rank, every group, one order
        for group in made:
            if rank in group.ranks:
                total = comm.all_reduce(torch.tensor([float(rank + 1)]), group)
                sums.append([list(group.ranks), float(total)])
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(sums))
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_plans_groups_are_created_everywhere_and_work_across_islands(tmp_path):
    from comm.plan_groups import plan_groups, rank_islands
    from specs import load_cluster
    from specs.layout import Axis, PipelineStrategy, StageStrategy, Strategy

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "name: two-vendors\n"
        "groups:\n"
        "  - {name: nv, device: a100-80gb, nodes: 1, devices_per_node: 2, nics_per_node: 1, nic_gbps: 100}\n"
        "  - {name: amd, device: mi250x, nodes: 1, devices_per_node: 2, nics_per_node: 1, nic_gbps: 100}\n"
        "network: {topology: clos, inter_group_gbps: 100}\n"
    )
    cluster = load_cluster(path)
    stages = (StageStrategy("nv", 0, 3, 1, 0), StageStrategy("amd", 3, 6, 1, 0))
    strategy = Strategy((PipelineStrategy(2, 1, 3, stages, total_microbatches=5),), "none", 1)
    planned = plan_groups(cluster, strategy, global_batch=5)
    islands = rank_islands(cluster)
    assert islands == ["nvidia", "nvidia", "amd", "amd"]
    dp = [g for g in planned if g.kind is Axis.DP]
    assert [g.ranks for g in dp] == [(0, 1), (2, 3)] and all(g.weights == (0.6, 0.4) for g in dp)
    assert [g.ranks for g in planned if g.kind is Axis.PP] == [(0, 2), (1, 3)]
    rank_lists = [list(g.ranks) for g in planned]
    out = tmp_path / "out"
    out.mkdir()
    context = mp.start_processes(
        _plan_groups_worker,
        args=(free_port(), str(out), islands, rank_lists),
        nprocs=4,
        join=False,
        start_method="spawn",
    )
    for process in context.processes:
        process.join(timeout=120)
    assert all(not p.is_alive() for p in context.processes)
    for rank in range(4):
        for ranks, total in json.loads(Path(out, f"{rank}.json").read_text()):
            assert total == sum(r + 1 for r in ranks)
    assert any(len(set(islands[r] for r in ranks)) == 2 for ranks, _ in json.loads(Path(out, "0.json").read_text()))


@pytest.mark.slow
def test_comm_bench_checks_every_path_and_writes_a_link_profile_the_predictor_reads(tmp_path):
    from predictor.link_model import fit_link, load_link_points
    from tests.conftest import hetplan

    links = tmp_path / "cross.json"
    result = hetplan(
        "comm-bench",
        "--world",
        "2",
        "--islands",
        "nvidia,amd",
        "--sizes",
        "4KiB,256KiB,16MiB",  # the fit below needs a bandwidth to show above a loaded host's latency jitter
        "--repeats",
        "3",  # each point the median of three: one stalled operation cannot hide the bandwidth from the fit
        "--links-out",
        str(links),
        "--json",
        torch_allowed=True,
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert {row["path"] for row in body["rows"]} == {"direct", "bridged", "hierarchical"}
    assert all(row["correct"] and row["busbw_bytes_per_s"] > 0 for row in body["rows"])
    device, link_class, points = load_link_points(links)
    assert (device, link_class, len(points)) == ("cpu", "cross_group", 3)
    link, _ = fit_link(link_class, points)
    assert link.bw_bytes_per_s > 0
    bad = hetplan("comm-bench", "--world", "3", "--islands", "nvidia,amd", torch_allowed=True)
    assert bad.returncode == 2 and "expected 3 islands" in bad.stderr


def _small_layers() -> list:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(6, 6, dtype=torch.float64), torch.nn.Tanh()) for _ in range(5)]


def _registered_backend_worker(rank: int, port: int, out: str) -> None:
    """DDP over a `hetplan` group spanning two islands, then an uneven 3-stage pipeline (2, 1, 2 layers) through
    torch.distributed.pipelining whose stages sit on different islands; both against single-process references."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from comm.backend import HetplanProcessGroup, register_backend

    _init(rank, 4, port, 30.0)
    result: dict = {}
    try:
        register_backend(ISLANDS)
        world = dist.new_group([0, 1, 2, 3], backend="hetplan")
        pipe = dist.new_group([0, 2, 3], backend="hetplan")  # nvidia, amd, amd
        result["group type"] = type(world).__name__
        torch.manual_seed(rank)  # different weights on every rank: DDP must broadcast rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.Tanh())
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=world, bucket_cap_mb=0.0001)
        torch.manual_seed(7)
        data = torch.randn(8, 6, dtype=torch.float64)
        ddp(data[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
        torch.manual_seed(0)
        reference = torch.nn.Sequential(torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.Tanh())
        reference(data).pow(2).mean().backward()
        result["ddp gradient error"] = max(
            (p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())
        )
        if rank != 1:
            stage_index = [0, 2, 3].index(rank)
            start, end = [(0, 2), (2, 3), (3, 5)][stage_index]
            layers = _small_layers()
            module = torch.nn.Sequential(*layers[start:end])
            stage = PipelineStage(module, stage_index, 3, torch.device("cpu"), group=pipe)

            def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return (y - t).pow(2).mean()

            schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
            x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
            if stage_index == 0:
                schedule.step(x)
            elif stage_index == 2:
                schedule.step(target=target)
            else:
                schedule.step()
            full = torch.nn.Sequential(*_small_layers())
            # the schedule averages micro-batch losses
            (sum(loss_fn(full(a), b) for a, b in zip(x.chunk(4), target.chunk(4), strict=True)) / 4).backward()
            expected = list(full[start:end].parameters())
            result["pipeline gradient error"] = max(
                (p.grad - r.grad).abs().max().item() for p, r in zip(module.parameters(), expected, strict=True)
            )
            result["pipeline group is hetplan"] = isinstance(pipe, HetplanProcessGroup)
        dist.barrier()
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_registered_backend_carries_ddp_and_uneven_pipelining_across_islands(tmp_path):
    results = _spawn(_registered_backend_worker, 4, tmp_path, 120)
    assert sorted(results) == [0, 1, 2, 3]
    for rank, result in results.items():
        assert result["group type"] == "HetplanProcessGroup", (rank, result)
        assert result["ddp gradient error"] < 1e-12, (rank, result)
        if rank != 1:
            assert result["pipeline group is hetplan"] and result["pipeline gradient error"] < 1e-12, (rank, result)


def _hanging_worker(rank: int, fail: bool, stamp: str) -> None:
    """Rank 0 fails after torch has warned on stderr; rank 1 never returns and ignores SIGTERM, as a rank stuck in
    a C++ wait does (a hung peer, not a wait for something)."""
    import signal
    import threading
    import warnings

    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Event().wait()
    warnings.warn("a multi-line\ntorch-style warning", stacklevel=1)
    if fail:
        Path(stamp).write_text(str(time.time()))  # wall clock: when the failure happened
        os._exit(3)


@pytest.mark.slow
@pytest.mark.parametrize("fail", [True, False])
def test_run_processes_reports_a_failed_or_hung_peer_in_one_line_within_seconds(fail, capfd, tmp_path):
    from profiler.comm_bench import GRACE_S, run_processes
    from specs.errors import HetplanError

    deadline_s = 60.0 if fail else 4.0
    started = time.monotonic()
    with pytest.raises(HetplanError) as caught:
        run_processes(_hanging_worker, (fail, str(tmp_path / "failed")), 2, deadline_s, "test job")
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message
    if fail:
        assert "exit code 3" in message and "rank 0: a multi-line" not in message
    else:
        assert "did not finish in 4 s" in message
    if fail:  # from the failure: the grace, SIGTERM, the grace, SIGKILL (torch alone waits 30 s after SIGTERM)
        assert time.time() - float((tmp_path / "failed").read_text()) < 2 * GRACE_S + 15
    else:
        assert elapsed < deadline_s + 2 * GRACE_S + 15  # a loaded host's slack; torch alone would wait 30 s more
    assert "warning" not in capfd.readouterr().err  # the children's stderr stays out of the terminal


def _aborting_worker(rank: int, last_words: bytes) -> None:
    """A native abort as C++ ends a process (`last_words` on stderr, then SIGABRT), in rank 1 only."""
    if rank == 1:
        os.write(2, last_words)
        os.abort()


@pytest.mark.slow
def test_a_rank_that_crashes_natively_is_told_with_its_message_and_where_python_was():
    """A rank that aborts (a C++ thread torn down while joinable said only "terminate called without an active
    exception"): the one line says so, and where the rank's Python was, from faulthandler's dump."""
    from profiler.comm_bench import run_processes
    from specs.errors import HetplanError

    with pytest.raises(HetplanError) as caught:
        run_processes(_aborting_worker, (b"terminate called without an active exception\n",), 2, 60.0, "test job")
    message = str(caught.value)
    assert "\n" not in message and "SIGABRT" in message, message
    assert "(rank 1: terminate called without an active exception; Python was at tests/test_comm.py:" in message
    assert message.endswith(" in _aborting_worker)"), message
    with pytest.raises(HetplanError) as caught:  # an older line before the crash is not its message
        run_processes(_aborting_worker, (b"UserWarning: a harmless warning\n",), 2, 60.0, "test job")
    assert "(rank 1: Aborted; Python was at tests/test_comm.py:" in str(caught.value), str(caught.value)


def test_the_crash_frame_is_the_crashing_threads_else_another_threads():
    from profiler.comm_bench import crash_frame

    dump = ["Thread 0x2 (most recent call first):", 'File "/a/runtime/pipeline.py", line 171 in receive',
            'File "/a/runtime/pipeline.py", line 200 in forward', "Current thread 0x1 (most recent call first):",
            'File "/a/runtime/execute.py", line 515 in spawned_rank']  # fmt: skip
    assert crash_frame(dump) == "Python was at runtime/execute.py:515 in spawned_rank"
    native = [*dump[:3], "Current thread 0x1 (most recent call first):", "<no Python frame>"]
    assert crash_frame(native) == "in a native thread; Python was at runtime/pipeline.py:171 in receive"
    assert crash_frame([]) == "no Python frame"
