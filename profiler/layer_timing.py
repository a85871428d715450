"""Timing a decoder layer's pass on this host: alone (`median_time_s`, `layer_time_s`: how fast the machine runs the
layer now) and with other processes computing the same layer at once (`concurrency`: the busy-time stretch the cost
model applies to ranks sharing the host's cores). Used by the host profile (profiler/host.py) and by a local run's
machine-speed check (runtime/launch.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event

try:
    import torch
    import torch.multiprocessing as mp
except ImportError as err:  # pragma: no cover - exercised only without torch
    from specs.errors import TorchMissingError

    raise TorchMissingError("`hetplan profile`") from err

from profiler.measure import build_layer, keep_freed_host_memory, layer_clock, profile_layer
from profiler.profile import ConcurrencyPoint
from specs.model import ModelSpec

MAX_CONCURRENT_PROCESSES = 32
HELPER_START_S = 120.0  # a spawned helper imports torch and builds its layer within this
HELPER_IDLE_WAKE_S = 1.0  # an idle helper looks whether it should stop this often (told to compute, it starts at once)
CONCURRENCY_ROUNDS = 4  # rounds of the busy-stretch timing (each: every level of processes, then this one alone)


def median_time_s(
    work: Callable[[], object], min_time_s: float, min_repeats: int = 3, clock: Callable[[], float] | None = None
) -> float:
    """Median seconds of `work()` on `clock` (default: the clock the layers are timed on, measure.layer_clock) over
    at least `min_repeats` runs and `min_time_s` of runs (one warm-up run)."""
    clock = clock or layer_clock(torch.device("cpu"))
    work()
    times: list[float] = []
    while len(times) < min_repeats or sum(times) < min_time_s:
        started = clock()
        work()
        times.append(clock() - started)
    return statistics.median(times)


def _layer_pass(model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype) -> Callable[[], None]:
    """One forward and backward of a decoder layer (tp 1, no recompute), as the layer profile runs it."""
    module, inputs = build_layer(model, "decoder", micro_batch_size, seq_length, 1, "none", torch.device("cpu"), dtype)
    x = inputs[0].requires_grad_()
    grad = torch.randn_like(x)

    def run() -> None:
        module.zero_grad(set_to_none=False)
        x.grad = None
        module(x).backward(grad)

    return run


def layer_time_s(model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype, threads: int) -> float:
    """Forward plus backward of a decoder layer (tp 1, no recompute) measured as the profile measures its entries
    (profile_layer on build_layer, with `threads` torch threads: busy time at one, else the wall clock): how fast this
    machine runs the layer now, for a run to set beside the profile's time of the same layer (runtime/launch.py, the
    machine-speed check). Timing the pass any other way reads differently: forward and backward in one span, on a
    layer built by hand, read 7% slower on the same machine at the same moment."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu = torch.device("cpu")
        module, inputs = build_layer(model, "decoder", micro_batch_size, seq_length, 1, "none", cpu, dtype)
        measured = profile_layer(module, inputs, warmup=1, repeats=8, min_time_s=0.3)
        return measured.forward_time_s + measured.backward_time_s
    finally:
        torch.set_num_threads(previous)


def _busy_helper(
    model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: str, go: Event, stop: Event, ready: Event
) -> None:
    """A background process computing the same layer while `go` is set, until `stop`."""
    torch.set_num_threads(1)
    keep_freed_host_memory()
    run = _layer_pass(model, micro_batch_size, seq_length, getattr(torch, dtype))
    run()
    ready.set()
    while not stop.is_set():
        if go.wait(timeout=HELPER_IDLE_WAKE_S) and not stop.is_set():
            run()


class BusyHelpers:
    """`count` background processes that compute the layer (tp 1, no recompute) while asked to: the concurrency
    timing's helpers, started once and kept for all its moments (each helper imports torch as it starts: three of
    them took 3-4 s to start on this 2-core machine, once per moment before)."""

    def __init__(self, model: ModelSpec, micro_batch_size: int, seq_length: int, dtype: torch.dtype, count: int):
        self._args = (model, micro_batch_size, seq_length, str(dtype).removeprefix("torch."))
        self.count = count
        self._helpers: list[tuple[mp.Process, Event, Event]] = []
        self._stop: Event | None = None

    def __enter__(self) -> BusyHelpers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the helpers (once; they start on first use, so a section that times nothing with them starts none)
        and wait until each has built its layer."""
        if self._stop is not None:
            return
        context = mp.get_context("spawn")
        self._stop = context.Event()
        try:
            for _ in range(self.count):
                go, ready = context.Event(), context.Event()
                process = context.Process(target=_busy_helper, args=(*self._args, go, self._stop, ready), daemon=True)
                process.start()
                self._helpers.append((process, go, ready))
            deadline = time.monotonic() + HELPER_START_S
            for process, _, ready in self._helpers:
                while not ready.wait(timeout=0.2):
                    if not process.is_alive() or time.monotonic() > deadline:
                        raise RuntimeError(f"a concurrency helper process did not start (exit code {process.exitcode})")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The helper processes running now (none before the first use and after `close`)."""
        return [process.pid for process, _, _ in self._helpers if process.pid is not None]

    def compute(self, count: int) -> None:
        """The first `count` helpers compute (each finishes its pass in hand when told to stop), the rest idle."""
        for index, (_, go, _) in enumerate(self._helpers):
            go.set() if index < count else go.clear()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        for process, go, _ in self._helpers:
            go.set()  # wakes an idle helper to see the stop
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)  # reaped: no zombie left behind
        self._helpers = []
        self._stop = None


def concurrency_levels(cores: int, only_cores: bool = False) -> list[int]:
    """The process counts the busy stretch is timed at: 2, the cores and twice the cores (`only_cores`: the cores),
    at most MAX_CONCURRENT_PROCESSES; none on one core with `only_cores`."""
    wanted = (cores,) if only_cores else (2, cores, 2 * cores)
    return sorted({n for n in wanted if 2 <= n <= MAX_CONCURRENT_PROCESSES})


def concurrency(
    model: ModelSpec,
    micro_batch_size: int,
    seq_length: int,
    dtype: torch.dtype,
    cores: int,
    min_time_s: float = 0.5,
    only_cores: bool = False,
    helpers: BusyHelpers | None = None,
) -> list[ConcurrencyPoint]:
    """The layer's busy-time stretch with N processes computing it at once (`concurrency_levels`): this process times
    its busy (CPU) time per pass while N - 1 helpers compute the same layer. Busy time leaves out the waits for a core
    (time slicing, which the cost model adds from the core count) and whatever else the machine runs meanwhile.
    `helpers`: started ones to use (at least the largest level less one; else this starts its own)."""
    levels = concurrency_levels(cores, only_cores)
    if not levels:
        return [ConcurrencyPoint(processes=1, busy_stretch=1.0)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the helpers and the ranks run (more threads would count their spinning as busy)
    try:
        if helpers is not None and helpers.count >= levels[-1] - 1:
            return _concurrency_at(model, micro_batch_size, seq_length, dtype, levels, min_time_s, helpers)
        with BusyHelpers(model, micro_batch_size, seq_length, dtype, levels[-1] - 1) as own:
            return _concurrency_at(model, micro_batch_size, seq_length, dtype, levels, min_time_s, own)
    finally:
        torch.set_num_threads(threads)


def _concurrency_at(
    model: ModelSpec,
    micro_batch_size: int,
    seq_length: int,
    dtype: torch.dtype,
    levels: list[int],
    min_time_s: float,
    helpers: BusyHelpers,
) -> list[ConcurrencyPoint]:
    helpers.start()
    run = _layer_pass(model, micro_batch_size, seq_length, dtype)

    def busy_s(level: int) -> float:
        """This process's busy seconds per pass with `level` processes (itself included) computing."""
        helpers.compute(level - 1)
        return median_time_s(run, min_time_s / CONCURRENCY_ROUNDS, clock=time.process_time)

    try:
        alone = [busy_s(1)]
        together: dict[int, list[float]] = {level: [] for level in levels}
        for _ in range(CONCURRENCY_ROUNDS):  # alone, every level, alone, ...: each level between two alone times
            for level in levels:
                together[level].append(busy_s(level))
            alone.append(busy_s(1))
    finally:
        helpers.compute(0)
    return [ConcurrencyPoint(processes=level, busy_stretch=busy_stretch(alone, together[level])) for level in levels]


def median_points(readings: list[list[ConcurrencyPoint]]) -> list[ConcurrencyPoint]:
    """Each level's busy stretch as the median of its readings at several moments of the profile: a neighbour that
    takes the machine's shared caches or cores for a few seconds moves one reading, not the median (on a shared
    2-core host the runtime benchmark's tiny model read 1.76 for two processes during one such spell, where its runs
    around it read 0.99-1.16)."""
    levels = sorted({point.processes for reading in readings for point in reading})
    return [
        ConcurrencyPoint(
            processes=level,
            busy_stretch=statistics.median(
                p.busy_stretch for reading in readings for p in reading if p.processes == level
            ),
        )
        for level in levels
    ]


def busy_stretch(alone_s: list[float], together_s: list[float]) -> float:
    """The median over rounds of a busy time with others computing against the mean of the alone times taken just
    before and just after it (`alone_s` has one more entry): a machine drifting over the measurement cancels out,
    where one alone time set against later busy times reads any drift as a stretch (the runtime benchmark's small
    model read 0.80 for two processes and 1.41 for four on a disturbed machine, 0.99-1.01 and 1.07-1.09 on a quiet
    one)."""
    return statistics.median(
        busy / ((before + after) / 2) for busy, before, after in zip(together_s, alone_s, alone_s[1:], strict=False)
    )
