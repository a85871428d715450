"""Measure collectives for real and fit alpha-beta link models (`hetplan profile-comm`).

Local processes on loopback with Gloo (or one rank of a torchrun job) time all-reduce, all-gather,
reduce-scatter and send/recv over message sizes, reported in the nccl-tests convention
(shared/reference/collectives.md): algbw = S / t with S the whole buffer, busbw = algbw x 2(n-1)/n for all-reduce,
(n-1)/n for all-gather and reduce-scatter, 1 for send/recv. Each (collective, ranks) gets a fitted
t = steps * alpha + S * factor / busbw (steps = 2(n-1), n-1 or 1), least squares on relative error, and the fit's
error against the measured points is recorded with it.

The ranks time the operations as training meets them: each computes for `gap_s` before every operation (as layers
run between TP collectives; no barrier lines them up) and times its own wait inside it. `time_s` is the median over
operations of the slowest rank's time (nccl-tests' convention); `mean_time_s` the mean over operations and the ranks
taking part, what a rank loses per operation on average, which predictions sum (Gloo's time per operation has a long
tail on some hosts, so the two differ). Local runs may also be measured with background processes computing beside
the ranks (`busy_processes`), so that the cores are shared as when a run's ranks outnumber them: each point records
its processes per core. `mean_cpu_time_s` is a rank's CPU time per operation (Gloo's threads' too): a collective
between local processes computes its reductions and copies on the cores the ranks share (2-rank Gloo collectives on
the 2-core benchmark host: 40-70% of their time, 0.6 over the sizes of one link profile).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import multiprocessing
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError as err:  # pragma: no cover - exercised only without torch
    from specs.errors import TorchMissingError

    raise TorchMissingError("`hetplan profile-comm`") from err

from profiler.collectives import bus_factor, latency_steps
from profiler.machine import end_rank_without_teardown, host_cores
from profiler.measure import keep_freed_host_memory
from specs.errors import HetplanError

LINKS_SCHEMA = "hetplan.links/1"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
MIN_POINT_TIME_S = 0.2
MAX_POINT_REPEATS = 100


@dataclass(frozen=True)
class CommPoint:
    collective: str
    ranks: int
    size_bytes: int
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    correct: bool
    mean_time_s: float = 0.0  # 0: not measured (files written before it was)
    processes_per_core: float = 1.0  # the ranks and background processes computing, per core of the host
    mean_cpu_time_s: float = 0.0  # a rank's CPU time per operation, all its threads (0: not measured)


@dataclass(frozen=True)
class LinkFit:
    link_class: str
    collective: str
    ranks: int
    alpha_s: float
    busbw_bytes_per_s: float | None  # None: the times show no size dependence (latency-bound sizes)
    fit_median_rel_error: float
    fit_max_rel_error: float
    processes_per_core: float = 1.0


def _run_one(collective: str, size_bytes: int, rank: int, ranks: int) -> tuple[float, float, bool]:
    """One timed operation on every rank: rank-local wall time, this process's CPU time meanwhile (all its threads,
    Gloo's among them: the reductions and copies a collective computes) and whether the result is right."""
    elements = max(ranks, size_bytes // 4)
    elements -= elements % ranks
    if collective == "all_reduce":
        buffer = torch.full((elements,), float(rank + 1))
        started, cpu_started = time.perf_counter(), time.process_time()
        dist.all_reduce(buffer)
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        return elapsed, cpu_s, bool(buffer[0].item() == ranks * (ranks + 1) / 2)
    if collective == "all_gather":
        shard = torch.full((elements // ranks,), float(rank))
        output = torch.zeros(elements)  # touched now, so page faults stay out of the timing
        started, cpu_started = time.perf_counter(), time.process_time()
        dist.all_gather_single(output, shard)
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        expected = torch.arange(ranks, dtype=torch.float32).repeat_interleave(elements // ranks)
        return elapsed, cpu_s, bool(torch.equal(output, expected))
    if collective == "reduce_scatter":
        full = torch.full((elements,), float(rank + 1))
        output = torch.zeros(elements // ranks)
        started, cpu_started = time.perf_counter(), time.process_time()
        dist.reduce_scatter_single(output, full)
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        return elapsed, cpu_s, bool(output[0].item() == ranks * (ranks + 1) / 2)
    # send/recv between rank 0 and rank 1 (others idle): one direction, size_bytes
    buffer = torch.full((elements,), 7.0) if rank == 0 else torch.zeros(elements)
    started, cpu_started = time.perf_counter(), time.process_time()
    if rank == 0:
        dist.send(buffer, dst=1)
    elif rank == 1:
        dist.recv(buffer, src=0)
    elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    return elapsed, cpu_s, bool(rank != 1 or buffer[0].item() == 7.0)


def compute_for(seconds: float) -> None:
    """Keep this rank's core busy with small matrix products for `seconds` (the gap between operations)."""
    if seconds <= 0:
        return
    matrix = torch.ones(64, 64)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        matrix @ matrix


def measure_points(
    rank: int,
    ranks: int,
    sizes: Sequence[int],
    collectives: Sequence[str],
    repeats: int,
    gap_s: float = 0.0,
    processes_per_core: float = 1.0,
) -> list[CommPoint]:
    """Run inside an initialised process group; every rank returns the same points. Each point runs at least
    `repeats` operations, more for short ones (up to MIN_POINT_TIME_S of operations); the count is agreed by all
    ranks from a probe, so every rank takes the same number of turns."""
    points = []
    for collective in collectives:
        if collective == "send_recv" and ranks < 2:
            continue
        taking_part = 2 if collective == "send_recv" else ranks
        for size in sizes:
            probe = [_run_one(collective, size, rank, ranks)[0] for _ in range(2)]  # the first warms up
            slowest = torch.tensor([probe[-1] + gap_s], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            count = max(repeats, min(MAX_POINT_REPEATS, math.ceil(MIN_POINT_TIME_S / max(slowest.item(), 1e-9))))
            # per operation its wall time, then its CPU time; the last: 1 where a result was wrong
            times = torch.zeros(2 * count + 1, dtype=torch.float64)
            for index in range(count):
                compute_for(gap_s)
                elapsed, cpu_s, ok = _run_one(collective, size, rank, ranks)
                times[index], times[count + index] = elapsed, cpu_s
                times[2 * count] = max(times[2 * count].item(), 0.0 if ok else 1.0)
            everyone = [torch.zeros_like(times) for _ in range(ranks)]
            dist.all_gather(everyone, times)
            stacked = torch.stack(everyone)
            per_operation = stacked[:taking_part, :count]
            time_s = float(per_operation.max(dim=0).values.median())
            algbw = size / time_s
            points.append(
                CommPoint(
                    collective,
                    ranks,
                    size,
                    time_s,
                    algbw,
                    algbw * bus_factor(collective, ranks),
                    bool(stacked[:, 2 * count].max().item() == 0.0),
                    float(per_operation.mean()),
                    processes_per_core,
                    float(stacked[:taking_part, count : 2 * count].mean()),
                )
            )
    return points


def _spin(stop: Event) -> None:
    """A background process computing until `stop` (shares the cores with the measured ranks)."""
    torch.set_num_threads(1)
    keep_freed_host_memory()
    while not stop.is_set():
        compute_for(0.05)


def _worker(
    rank: int,
    ranks: int,
    port: int,
    sizes: list[int],
    collectives: list[str],
    repeats: int,
    timeout_s: float,
    out: str,
    gap_s: float,
    processes_per_core: float,
) -> None:
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as the runtime's ranks run
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks, timeout=timedelta(seconds=timeout_s)
    )
    try:
        points = measure_points(rank, ranks, sizes, collectives, repeats, gap_s, processes_per_core)
        if rank == 0:
            Path(out).write_text(json.dumps([asdict(p) for p in points]), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


GRACE_S = 2.0  # after a failure, how long peers get to exit before SIGTERM, then SIGKILL (torch waits 30 s)


def captured_rank(rank: int, worker: Callable[..., None], log_dir: str, *args: Any) -> None:
    """Run worker(rank, *args) with this process's stderr (Python warnings and torch's C++ log lines alike) in a
    file, so a failure can be told in one line instead of every peer's multi-line warnings."""
    log = os.open(Path(log_dir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(all_threads=True)  # a native crash (SIGABRT, SIGSEGV) leaves where Python was in the log
    worker(rank, *args)
    end_rank_without_teardown(0)  # its work done: results written and closed, process group destroyed


FAULT_HEADER = "Fatal Python error:"
NATIVE_LAST_WORDS = ("terminate called", "what():")  # C++'s message right before an abort


def last_words(log_dir: str, rank: int | None) -> str:
    """The failing rank's last line of stderr (torch's error, not its warnings), cut to 200 characters; for a native
    crash, faulthandler's word for it ("Aborted"; C++'s "terminate called ..." when that line comes right before the
    dump) and the innermost Python frame of the crashing thread, else of another ("no Python frame": the crash came
    as the interpreter shut down)."""
    path = Path(log_dir, f"rank-{rank}.log")
    if rank is None or not path.exists():
        return ""
    lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    fault = next((i for i, line in enumerate(lines) if line.startswith(FAULT_HEADER)), None)
    if fault is None:
        return f" (rank {rank}: {lines[-1][:200]})" if lines else ""
    said = lines[fault].removeprefix(FAULT_HEADER).strip()  # "Aborted", "Segmentation fault"
    before = lines[fault - 1] if fault else ""
    if before.startswith(NATIVE_LAST_WORDS):  # C++'s own words just before it, not an older warning
        said = before
    return f" (rank {rank}: {said[:200]}; {crash_frame(lines[fault + 1 :])})"


def crash_frame(dump: list[str]) -> str:
    """'Python was at runtime/execute.py:515 in spawned_rank' from a faulthandler dump's lines: the crashing thread's
    innermost frame, else (a thread without Python frames crashed) the first other thread's that has one."""
    blocks: list[tuple[bool, list[str]]] = []
    for line in dump:
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append((line.startswith("Current"), []))
        elif line.startswith("File ") and blocks:
            blocks[-1][1].append(line)
    innermost = [(current, frames[0]) for current, frames in sorted(blocks, key=lambda b: not b[0]) if frames]
    if not innermost:
        return "no Python frame"
    current, frame = innermost[0]
    parts = frame.split('"')
    file, rest = (parts[1], parts[2]) if len(parts) >= 3 else ("?", frame)
    line, _, function = rest.removeprefix(", line ").partition(" in ")
    where = f"{'/'.join(Path(file).parts[-2:])}:{line.strip()} in {function.strip()}"
    return f"Python was at {where}" if current else f"in a native thread; Python was at {where}"


def stop_processes(processes: Sequence[mp.Process]) -> None:
    """SIGTERM the live processes, SIGKILL those still alive after GRACE_S (a rank stuck in C++ ignores SIGTERM)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    end = time.monotonic() + GRACE_S
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_processes(
    worker: Callable[..., None],
    args: tuple[Any, ...],
    nprocs: int,
    deadline_s: float,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Spawn `nprocs` local processes running worker(rank, *args); a failure or the deadline is a one-line error,
    peers stopped within seconds, their warnings kept out of the terminal. `meanwhile()` is called about every
    second while they run (e.g. to report their progress)."""
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # its "Terminating process ... via SIGTERM" lines
    with tempfile.TemporaryDirectory(prefix="hetplan-logs-") as log_dir:
        context = mp.start_processes(
            captured_rank, args=(worker, log_dir, *args), nprocs=nprocs, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=1.0, grace_period=GRACE_S):
                if time.monotonic() > deadline:
                    raise HetplanError(f"{what} did not finish in {deadline_s:g} s")
                if meanwhile is not None:
                    meanwhile()
        except mp.ProcessRaisedException as err:
            raise HetplanError(f"{what} failed: {str(err).strip().splitlines()[-1]}") from None
        except mp.ProcessExitedException as err:
            raise HetplanError(f"{what} failed: {err}{last_words(log_dir, err.error_index)}") from None
        finally:
            stop_processes(context.processes)
            spawn_log.setLevel(level)


def run_local(
    ranks: int,
    sizes: Sequence[int],
    collectives: Sequence[str],
    repeats: int,
    scratch: Path,
    timeout_s: float = 120.0,
    gap_s: float = 0.0,
    busy_processes: int = 0,
) -> list[CommPoint]:
    """Spawn `ranks` local processes (Gloo on loopback), bounded by `timeout_s` per operation, with `busy_processes`
    background processes computing beside them."""
    out = scratch / f"points-{ranks}-{busy_processes}.json"
    with computing_beside(busy_processes):
        run_processes(
            _worker,
            (
                ranks,
                free_port(),
                list(sizes),
                list(collectives),
                repeats,
                timeout_s,
                str(out),
                gap_s,
                (ranks + busy_processes) / host_cores(),
            ),
            ranks,
            timeout_s * (len(sizes) * len(collectives) + 2),
            f"profile-comm with {ranks} processes",
        )
    return [CommPoint(**p) for p in json.loads(out.read_text(encoding="utf-8"))]


@contextlib.contextmanager
def computing_beside(busy_processes: int) -> Iterator[None]:
    """`busy_processes` background processes computing (sharing the cores with what runs inside) until the block
    ends."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinners = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy_processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(timeout=GRACE_S)
            if spinner.is_alive():
                spinner.kill()


def run_in_job(
    sizes: Sequence[int],
    collectives: Sequence[str],
    repeats: int,
    timeout_s: float,
    backend: str = "gloo",
    gap_s: float = 0.0,
) -> tuple[int, list[CommPoint]]:
    """This process is one rank of a torchrun job: measure with every rank; returns (rank, points)."""
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    try:
        rank, ranks = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return rank, measure_points(rank, ranks, sizes, collectives, repeats, gap_s, local / host_cores())
    finally:
        dist.destroy_process_group()


def fit_link(points: Sequence[CommPoint], link_class: str) -> LinkFit:
    """Least squares on relative error of t = steps*alpha + S*factor/busbw."""
    first = points[0]
    steps = latency_steps(first.collective, first.ranks)
    factor = bus_factor(first.collective, first.ranks)
    sizes = np.array([p.size_bytes for p in points], dtype=float)
    times = np.array([p.time_s for p in points])
    design = np.stack([np.full_like(sizes, steps), sizes * factor], axis=1) / times[:, None]
    (alpha, inverse_bw), *_ = np.linalg.lstsq(design, np.ones_like(times), rcond=None)
    alpha, inverse_bw = max(float(alpha), 0.0), max(float(inverse_bw), 0.0)
    predicted = steps * alpha + sizes * factor * inverse_bw
    errors = np.abs(predicted - times) / times
    return LinkFit(
        link_class,
        first.collective,
        first.ranks,
        alpha,
        1.0 / inverse_bw if inverse_bw > 0 else None,
        float(np.median(errors)),
        float(np.max(errors)),
        first.processes_per_core,
    )


def link_profile(
    points: Sequence[CommPoint], link_class: str, backend: str, device_key: str = "cpu", gap_s: float = 0.0
) -> dict[str, Any]:
    """The links file: every point, and an alpha-beta fit per collective, group size and processes per core."""
    groups: dict[tuple[str, int, float], list[CommPoint]] = {}
    for point in points:
        groups.setdefault((point.collective, point.ranks, point.processes_per_core), []).append(point)
    fits = [fit_link(group, link_class) for group in groups.values() if len(group) >= 2]
    return {
        "schema": LINKS_SCHEMA,
        "source": "measured",
        "device": device_key,
        "backend": backend,
        "environment": {
            "host": platform.node(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "cores": host_cores(),
            "threads_per_rank": 1,
            "gap_s": gap_s,
        },
        "links": [asdict(f) for f in fits],
        "points": [asdict(p) for p in points],
    }
