"""`hetplan comm-bench`: all-reduce over simulated islands by three paths, checked and timed (nccl-tests units).

Paths: direct (one Gloo group over every rank, as if one library connected all vendors), bridged (a flat all-reduce
staged through host buffers over Gloo, in chunks) and hierarchical (reduce-scatter inside each island, all-reduce of
the shards across islands through the bridge, all-gather inside). Every result is checked against the exact sum.
algbw = S / t; busbw = algbw x 2(n-1)/n (shared/reference/collectives.md).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from comm.communicator import Communicator
from comm.vendors import VENDORS
from profiler.collectives import bus_factor
from profiler.comm_bench import free_port, run_processes
from specs.errors import SpecError

PATHS = ("direct", "bridged", "hierarchical")
Progress = Callable[[int, int], None]  # (points done, points in all)


def check_islands(islands: Sequence[str], world: int) -> list[str]:
    """--islands: one known vendor per rank."""
    if len(islands) != world:
        raise SpecError("--islands", "", f"expected {world} islands (one per rank), got {len(islands)}")
    unknown = sorted(set(islands) - set(VENDORS))
    if unknown:
        raise SpecError("--islands", "", f"unknown vendor(s) {', '.join(unknown)}; known: {', '.join(VENDORS)}")
    return list(islands)


def _worker(
    rank: int, port: int, islands: list[str], sizes: list[int], repeats: int, timeout_s: float, out: str
) -> None:
    torch.set_num_threads(1)
    world = len(islands)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    rows: list[dict[str, Any]] = []
    try:
        comm = Communicator(islands, timeout_s=timeout_s)
        (group,) = comm.create_groups([list(range(world))])
        for size in sizes:
            elements = max(1, size // 4)
            expected = torch.full((elements,), float(sum(range(1, world + 1))))
            for path in PATHS:
                times, correct = [], True
                for _ in range(repeats + 1):  # the first run warms up
                    tensor = torch.full((elements,), float(rank + 1))
                    dist.barrier()
                    started = time.perf_counter()
                    if path == "direct":
                        dist.all_reduce(tensor)
                    elif path == "bridged":
                        comm.bridged_all_reduce(tensor, group)
                    else:
                        comm.all_reduce(tensor, group)
                    times.append(time.perf_counter() - started)
                    correct = correct and torch.equal(tensor, expected)
                local = torch.tensor([statistics.median(times[1:]), float(correct)])
                dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the slowest rank's time
                ok = torch.tensor([float(correct)])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                rows.append(
                    {"path": path, "size_bytes": elements * 4, "time_s": float(local[0]), "correct": bool(ok[0])}
                )
                if rank == 0:
                    Path(out).with_suffix(".done").write_text(str(len(rows)), encoding="utf-8")
        if rank == 0:
            Path(out).write_text(json.dumps(rows), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def run_comm_bench(
    islands: list[str], sizes: list[int], repeats: int, timeout_s: float, progress: Progress | None = None
) -> dict[str, Any]:
    """Time and check the three paths at every size on local processes (one per island entry); `progress` hears
    (points done, points in all) about every half second."""
    points = len(sizes) * len(PATHS)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "comm-bench.json"
        stop = threading.Event()
        follow = threading.Thread(target=_follow, args=(out.with_suffix(".done"), points, progress, stop), daemon=True)
        if progress is not None:
            follow.start()
        try:
            args = (free_port(), islands, sizes, repeats, timeout_s, str(out))
            run_processes(_worker, args, len(islands), timeout_s * (points + 2), "comm-bench")
        finally:
            stop.set()
            if follow.is_alive():
                follow.join()
        rows = json.loads(out.read_text(encoding="utf-8"))
    n = len(islands)
    for row in rows:
        row["algbw_bytes_per_s"] = row["size_bytes"] / row["time_s"]
        row["busbw_bytes_per_s"] = row["algbw_bytes_per_s"] * bus_factor("all_reduce", n)
    return {"schema": "hetplan.commbench/1", "islands": islands, "ranks": n, "rows": rows}


def _follow(done_file: Path, points: int, progress: Progress | None, stop: threading.Event) -> None:
    """Pass rank 0's count of finished points on to `progress` until `stop`."""
    while progress is not None and not stop.wait(0.5):
        try:
            progress(int(done_file.read_text(encoding="utf-8")), points)
        except (OSError, ValueError):  # not written yet, or caught mid-write
            continue


def links_from_bench(result: dict[str, Any], path: str = "bridged") -> dict[str, Any]:
    """The bridged path's points as a `hetplan.links/1` cross-group link profile (what `hetplan fit --links` reads)."""
    points = [
        {
            "collective": "all_reduce",
            "ranks": result["ranks"],
            "size_bytes": row["size_bytes"],
            "time_s": row["time_s"],
            "correct": row["correct"],
        }
        for row in result["rows"]
        if row["path"] == path
    ]
    return {
        "schema": "hetplan.links/1",
        "source": "measured",
        "device": "cpu",
        "backend": "gloo",
        "link_class": "cross_group",
        "points": points,
    }
