"""What the user waits for: the whole `hetplan plan` process of the 768-device example (and `hetplan replan` of its
plan without one Ascend node, and without 8), median of N runs, cold and warm, next to the search time the plan
reports and the part spent building the default predictor (predictor.predictor.default_predictor: the calibration
fitted at every process start until it is cached on disk). Table + bench/results/process_time.json.

Cold: every module compiled from source (an empty bytecode cache: PYTHONPYCACHEPREFIX in a fresh directory), as the
first run after an install; warm: the bytecode cache filled by the runs before. Each run is a fresh interpreter
running cli.main as the `hetplan` script does, with a timer around default_predictor.

Run: python bench/process_time.py [--repeats 5] [--tree CHECKOUT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TREE = [ROOT]  # the checkout whose `hetplan` is timed (--tree: another one, e.g. an export of the last release)
EXAMPLE = ["-c", "examples/hethub-768.yaml"]
PLAN = ["plan", *EXAMPLE, "-m", "llama-140b", "--training", "examples/training/hethub-140b.yaml"]
REPLANS = {
    "replan -node:ascend/17": ["--without", "node:ascend/17"],
    "replan -group:ascend:8": ["--without", "group:ascend:8"],
}

# cli.main with a timer around the default predictor's build; the time goes to the file named by argv[1]
PROBE = """
import sys, time
out = sys.argv.pop(1)
import predictor.predictor as module
build, spent = module.default_predictor, [0.0]
def timed():
    started = time.perf_counter()
    try:
        return build()
    finally:
        spent[0] += time.perf_counter() - started
module.default_predictor = timed
sys.argv[0] = "hetplan"
from cli import main
try:
    main()
finally:
    open(out, "w").write(repr(spent[0]))
"""


def run_once(args: list[str], pycache: str) -> dict[str, float]:
    """One process: wall time, the predictor's build time, and the search time the plan file reports."""
    with tempfile.TemporaryDirectory() as scratch:
        timing, plan_file = Path(scratch) / "predictor_s", Path(scratch) / "out.json"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # warm runs need the cache
        env["PYTHONPYCACHEPREFIX"] = pycache
        command = [sys.executable, "-c", PROBE, str(timing), *args, "--out", str(plan_file), "--json"]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=TREE[0], env=env, capture_output=True, text=True, check=False)
        wall_s = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
        predictor_s = float(timing.read_text())
        row = {
            "process_s": wall_s,
            "predictor_build_s": predictor_s,
            "process_without_predictor_s": wall_s - predictor_s,
        }
        body = json.loads(done.stdout)
        if "search_time_s" in body:
            row["search_time_s"] = body["search_time_s"]
        if "replan_time_s" in body:
            row["replan_time_s"] = body["replan_time_s"]
            row["warm_started"] = body.get("warm_started")
        return row


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every timing over the runs (and the last run's flags)."""
    out: dict[str, Any] = {}
    for key, value in runs[-1].items():
        if isinstance(value, float):
            out[key] = statistics.median(run[key] for run in runs)
        else:
            out[key] = value
    return out


def measure(name: str, args: list[str], repeats: int, warm_cache: str) -> dict[str, Any]:
    """Cold and warm medians of one command (cold and warm runs alternate, so load drifts hit both)."""
    cold, warm = [], []
    run_once(args, warm_cache)  # fill the warm bytecode cache
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as empty:
            cold.append(run_once(args, empty))
        warm.append(run_once(args, warm_cache))
    return {"command": name, "args": args, "cold": medians(cold), "warm": medians(warm), "warm_runs": warm}


def main() -> None:
    """Time plan and the two re-plans, print the table and write the JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=ROOT, help="time the hetplan of this checkout (default: this one)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "process_time.json")
    args = parser.parse_args()
    TREE[0] = args.tree.resolve()
    rows = []
    with tempfile.TemporaryDirectory() as warm_cache, tempfile.TemporaryDirectory() as scratch:
        rows.append(measure("plan", PLAN, args.repeats, warm_cache))
        old_plan = Path(scratch) / "plan.json"
        subprocess.run(
            [sys.executable, "-c", PROBE, os.devnull, *PLAN, "--out", str(old_plan), "--json"],
            cwd=TREE[0],
            capture_output=True,
            check=True,
        )
        for name, change in REPLANS.items():
            rows.append(measure(name, ["replan", str(old_plan), *EXAMPLE, *change], args.repeats, warm_cache))
    header = f"{'command':<24} {'':<5} {'process s':>9} {'predictor s':>11} {'without s':>9} {'search s':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        for kind in ("cold", "warm"):
            m = row[kind]
            inner = m.get("search_time_s", m.get("replan_time_s", float("nan")))
            print(
                f"{row['command']:<24} {kind:<5} {m['process_s']:>9.2f} {m['predictor_build_s']:>11.2f} "
                f"{m['process_without_predictor_s']:>9.2f} {inner:>8.2f}"
            )
    print("search s: the plan's search_time_s (replan: replan_time_s); without s: process less the predictor's build")
    machine = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    body = {"machine": machine, "tree": str(TREE[0]), "repeats": args.repeats, "rows": rows}
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
