"""What this machine offers local runs and measurements, and how a rank's process knows its launcher and ends (no
torch: the planner's report and the CLI read it too)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn


def host_cores() -> int:
    """The cores this process may run on, which local ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


OTHER_WORK_LIMIT_CORES = 0.1  # other work on the host's cores during a run that its wall time carries noticeably
MIN_OTHER_WORK_S = 2.0  # readings of other work span at least this (the clock ticks of 10 ms are noise below it)


@dataclass(frozen=True)
class HostTimes:
    """Cumulative CPU times of this process's cores (Linux's /proc/stat, its cpuN lines) and of this process with the
    children it has waited for, at a wall-clock moment: two readings tell how much of the cores others used."""

    wall_s: float
    busy_s: float  # user, nice and system time of the cores, every process's
    stolen_s: float  # time the hypervisor ran something else while these virtual cores had work
    own_s: float  # this process's and its children's user and system time (those still running too)


def live_children_cpu_s(proc: Path = Path("/proc")) -> float:
    """User and system time of this process's children still running (each with its own waited-for children), from
    /proc/PID/stat; 0 where there is no /proc. A finished child waited for is in getrusage's RUSAGE_CHILDREN."""
    me = os.getpid()
    ticks = 0
    for stat in proc.glob("[0-9]*/stat"):
        try:  # bytes: a process's name (in parentheses) is any bytes, cut at 15, and may hold ")"
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
            if len(fields) > 14 and int(fields[1]) == me:
                ticks += sum(int(field) for field in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):  # ended meanwhile, or not as documented
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def host_times(stat_path: Path = Path("/proc/stat")) -> HostTimes | None:
    """The host's CPU times now (`HostTimes`), this process's children still running included; None off Linux (no
    /proc/stat) or when it does not read as expected."""
    cores = {f"cpu{core}" for core in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set()
    try:
        lines = stat_path.read_text(encoding="utf-8").splitlines()
        ticks_per_s = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = stolen = 0
    for line in lines:
        name, *fields = line.split() or [""]
        if name not in cores or len(fields) < 8:
            continue
        # irq and softirq left out: with IRQ time accounting no process is charged them (the run's own loopback
        # traffic would read as other work)
        try:
            user, nice, system, steal = (int(fields[index]) for index in (0, 1, 2, 7))
        except ValueError:
            return None
        busy += user + nice + system
        stolen += steal
    if not cores or busy == 0:
        return None
    own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return HostTimes(
        wall_s=time.monotonic(),
        busy_s=busy / ticks_per_s,
        stolen_s=stolen / ticks_per_s,
        own_s=sum(usage.ru_utime + usage.ru_stime for usage in own) + live_children_cpu_s(),
    )


def other_work(before: HostTimes, after: HostTimes, over: str = "the run") -> dict[str, Any]:
    """What else used this process's cores between two readings, in cores on average: other processes (the cores'
    busy time beyond this process's and its children's) and the hypervisor (stolen time). A local run's ranks share
    the cores it finds: a run's wall time carries what others take of them, which the machine-speed checks, timing
    one layer alone or CPU time on every core, do not see (a run 65-208% slower than predicted on a host shared with
    other work read x0.99-1.02 there). `over`: what the readings span, in words."""
    wall_s = max(after.wall_s - before.wall_s, 1e-9)
    others_s = max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s))
    stolen_s = max(0.0, after.stolen_s - before.stolen_s)
    return {
        "checked": True,
        "cores": host_cores(),
        "over": over,
        "over_s": wall_s,
        "other_processes_cores": others_s / wall_s,
        "stolen_cores": stolen_s / wall_s,
    }


def launched_by_torchrun() -> bool:
    """This process is a rank torchrun started (its environment names the job)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def quiet_torchrun_rank() -> bool:
    """This process is a torchrun rank other than 0: rank 0 says what the job says (the costs, its progress), and
    the others say nothing but their failures (a 4-rank job printed every line four times)."""
    return launched_by_torchrun() and os.environ.get("RANK") != "0"


def end_rank_without_teardown(code: int) -> NoReturn:
    """End a rank's process with exit status `code` (its command's, whatever it was) without the interpreter's
    teardown. There, about one run in thirty of tests/test_elastic.py aborted a rank after its work ("terminate
    called without an active exception" with no Python frame left: a C++ thread of torch's destroyed while
    joinable), failing a finished run. What the teardown would wait for is waited for here: threads still running,
    log handlers and buffered output; a Ctrl-C during the wait ends it with 130."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    except KeyboardInterrupt:  # Ctrl-C while waiting: the rank ends now, as interrupted (no traceback)
        print("hetplan: interrupted", file=sys.stderr)
        code = 130
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # None, or closed: nothing to lose
            stream.flush()
    os._exit(code)
