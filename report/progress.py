"""Progress of long commands on stderr: a transient bar on a terminal, else a plain line every few seconds with
done/total, elapsed time and ETA (logs of batch jobs see it too); nothing when quiet. Never on stdout, so `--json`
output stays clean. The first line comes after `interval_s` (HETPLAN_PROGRESS_SECONDS, default 5): commands that
finish sooner print nothing."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from report import said


def default_interval_s() -> float:
    """Seconds between progress lines off a terminal: HETPLAN_PROGRESS_SECONDS when it is a number > 0, else 5."""
    try:
        seconds = float(os.environ.get("HETPLAN_PROGRESS_SECONDS", "5"))
    except ValueError:
        return 5.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 5.0


def duration(seconds: float) -> str:
    """'42 s', '3 min 05 s', '2 h 07 min': short and unambiguous in a log line."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Where a long command is: `update(done, total, what)` (also callable as `progress(done, total)`, the planner's
    and the profiler's callback shape); a heartbeat thread prints a line every `interval_s` even while no update
    arrives (a long solver call, child processes). `total=None`: the amount of work is not known ahead (no ETA)."""

    def __init__(
        self,
        task: str,
        *,
        quiet: bool = False,
        unit: str = "",
        interval_s: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ) -> None:
        self.task, self.unit, self.quiet, self.clock = task, unit, quiet, clock
        self.interval_s = interval_s if interval_s is not None else default_interval_s()
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.done, self.what = 0, ""
        self.total: int | None = None
        self._steps = 0
        self._first_done: tuple[float, int] | None = None  # (when, count) of the first count above 0: the ETA's rate
        self.started = self.last_line = clock()
        self.lines = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None
        self._task_id: Any = None

    def __enter__(self) -> Progress:
        self.started = self.last_line = self.clock()
        self._first_done = None
        if self.quiet:
            return self
        if self.terminal:
            from rich.console import Console
            from rich.progress import Progress as Bar

            self._bar = Bar(transient=True, console=Console(file=self.stream))
            self._bar.start()
            self._task_id = self._bar.add_task(self.task, total=self.total)
        else:
            self._thread = threading.Thread(target=self._beat, name=f"progress-{self.task}", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.stop()
        elif kind is None and self.lines and not self.quiet:
            self._write(f"hetplan {self.task}: done in {duration(self.clock() - self.started)}")

    def __call__(self, done: int, total: int | None = None, what: str = "") -> None:
        self.update(done, total, what)

    def update(self, done: int, total: int | None = None, what: str = "") -> None:
        """Record where the work is (`total` None keeps the last total; `what`, when given, names the current part)."""
        with self._lock:
            moved_back = self._first_done is not None and done < self._first_done[1]
            if moved_back or (total is not None and total != self.total):  # another attempt (a resumed run's)
                self._first_done = None
            self.done = done
            if done > 0 and self._first_done is None:
                self._first_done = (self.clock(), done)
            self.total = total if total is not None else self.total
            self.what = what or self.what
        if self._bar is not None:
            said.flush()
            description = f"{self.task}: {self.what}" if self.what else self.task
            self._bar.update(self._task_id, completed=done, total=self.total, description=description)
        else:
            self.tick()

    def counter(self, what: str) -> Callable[[int, int], None]:
        """A (done, total) callback for work of unknown size, such as the planner's branch and bound (its total is
        only a lower bound): shows the largest count so far, then `what`, and no ETA."""
        return lambda done, total: self.update(max(done, self.done), None, what)

    def say(self, what: str) -> None:
        """Name what is being done now (a line of the library's own progress, e.g. the runtime's)."""
        self.update(self.done, None, what.rstrip(" ."))

    def step(self, what: str, total: int) -> None:
        """Stepwise work: the next of `total` steps starts (`what` it is), so the steps before it are done."""
        self.update(self._steps, total, what)
        self._steps += 1

    def tick(self) -> None:
        """Print a line when one is due (the heartbeat calls this; so does every update)."""
        if self.quiet or self.terminal:
            return
        now = self.clock()
        with self._lock:
            if now - self.last_line < self.interval_s:
                return
            self.last_line = now
            self.lines += 1
            text = self.line(now)
        self._write(text)

    def line(self, now: float) -> str:
        """'hetplan profile: 34/120 (28%) decoder b=2, 1 min 10 s elapsed, about 3 min 00 s left'."""
        elapsed = now - self.started
        done, total = self.done, self.total
        unit = f" {self.unit}" if self.unit else ""
        where = f"{done:,}/{total:,}{unit} ({done / total:.0%})" if total else f"{done:,}{unit}" if unit else ""
        if not (total or done or self.what):  # nothing reported yet (loading inputs, the predictor)
            where = "starting"
        doing = " ".join(part for part in (where, self.what) if part) or "working"
        text = f"hetplan {self.task}: {doing}, {duration(elapsed)} elapsed"
        if total and 0 < done < total:
            text += f", about {duration(self._seconds_per_unit(now) * (total - done))} left"
        return text

    def _seconds_per_unit(self, now: float) -> float:
        """The time a unit of work takes: since the first count above 0 once more have been done (the start, e.g. a
        run's processes starting, is not a unit's), else the time so far over the count."""
        if self._first_done is not None and self.done > self._first_done[1]:
            when, count = self._first_done
            return (now - when) / (self.done - count)
        return (now - self.started) / self.done

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s)):
            self.tick()

    def _write(self, text: str) -> None:
        said.flush()  # the command's notes first: it got past its checks
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or full stderr must not fail the command
            pass
