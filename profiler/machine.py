"""What this machine offers local runs and measurements, and how a rank's process knows its launcher and ends (no
torch: the planner's report and the CLI read it too)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def host_cores() -> int:
    """The cores this process may run on, which local ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def launched_by_torchrun() -> bool:
    """This process is a rank torchrun started (its environment names the job)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


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
