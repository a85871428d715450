"""Profile the tiny Llama on this machine's CPU twice (separate processes, as a user would) and report how well
the two runs agree, entry by entry; table + bench/results/profile_repeatability.json.

Run: python bench/profile_repeatability.py [--model examples/models/tiny-llama.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from profiler import load_profile  # noqa: E402

TOLERANCE = 0.15


def run_profile(model: str, out: Path, threads: int | None) -> float:
    started = time.perf_counter()
    thread_args = ["--threads", str(threads)] if threads else []
    subprocess.run(
        [sys.executable, "-m", "cli", "profile", "--model", model, "--device", "cpu", "--out", str(out), *thread_args],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "examples" / "models" / "tiny-llama.yaml"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per profile run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile_repeatability.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp) / "first.json", Path(tmp) / "second.json"
        wall = [run_profile(args.model, first, args.threads), run_profile(args.model, second, args.threads)]
        a, b = load_profile(first), load_profile(second)
        kept = Path(args.out).resolve().parent / "profile-cpu-tiny-llama.json"
        kept.write_text(first.read_text())  # the measured profile other benches plan with
    rows = {}
    outliers = []
    for x, y in zip(a.entries, b.entries):
        assert (x.layer, x.micro_batch_size, x.tp, x.recompute) == (y.layer, y.micro_batch_size, y.tp, y.recompute)
        for field in ("forward_time_s", "backward_time_s"):
            u, v = getattr(x, field), getattr(y, field)
            rows.setdefault((x.layer, field), []).append(abs(u - v) / min(u, v))
        total_a = x.forward_time_s + x.backward_time_s
        total_b = y.forward_time_s + y.backward_time_s
        diff = abs(total_a - total_b) / min(total_a, total_b)
        rows.setdefault((x.layer, "fwd+bwd"), []).append(diff)
        if diff > TOLERANCE:
            outliers.append(
                {
                    "layer": x.layer,
                    "micro_batch_size": x.micro_batch_size,
                    "tp": x.tp,
                    "recompute": x.recompute,
                    "fwd_bwd_ms": [total_a * 1e3, total_b * 1e3],
                    "rel_diff": diff,
                }
            )
    ratios = [
        (y.forward_time_s + y.backward_time_s) / (x.forward_time_s + x.backward_time_s)
        for x, y in zip(a.entries, b.entries)
    ]
    speed_ratio = statistics.median(ratios)
    within_normalised = sum(abs(r / speed_ratio - 1) <= TOLERANCE for r in ratios)
    print(f"profile wall time: {wall[0]:.1f} s and {wall[1]:.1f} s; {len(a.entries)} entries each")
    header = f"{'layer':<10} {'quantity':<16} {'entries':>7} {'within 15%':>10} {'median diff':>11} {'max diff':>9}"
    print(header)
    print("-" * len(header))
    table = []
    for (layer, field), diffs in rows.items():
        within = sum(d <= TOLERANCE for d in diffs)
        table.append(
            {
                "layer": layer,
                "quantity": field,
                "entries": len(diffs),
                "within_15pct": within,
                "median_rel_diff": statistics.median(diffs),
                "max_rel_diff": max(diffs),
            }
        )
        print(
            f"{layer:<10} {field:<16} {len(diffs):>7} {within:>10} {statistics.median(diffs):>11.1%} {max(diffs):>9.1%}"
        )
    print(
        f"run-wide speed ratio (second/first, median over entries): {speed_ratio:.3f}; fwd+bwd within 15% after "
        f"dividing it out: {within_normalised}/{len(ratios)} (far from 1: the host drifted)"
    )
    for row in outliers:
        print(
            f"  beyond 15%: {row['layer']} b={row['micro_batch_size']} tp={row['tp']} {row['recompute']}: "
            f"{row['fwd_bwd_ms'][0]:.2f} vs {row['fwd_bwd_ms'][1]:.2f} ms"
        )
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "wall_time_s": wall,
                "environment": a.environment,
                "rows": table,
                "outliers": outliers,
                "run_speed_ratio": speed_ratio,
                "within_15pct_after_speed_ratio": within_normalised,
                "entries": len(ratios),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"written {out}")


if __name__ == "__main__":
    main()
