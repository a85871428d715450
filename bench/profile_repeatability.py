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


def run_profile(model: str, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cli", "profile", "--model", model, "--device", "cpu", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "examples" / "models" / "tiny-llama.yaml"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp) / "first.json", Path(tmp) / "second.json"
        wall = [run_profile(args.model, first), run_profile(args.model, second)]
        a, b = load_profile(first), load_profile(second)
    rows = {}
    for x, y in zip(a.entries, b.entries):
        assert (x.layer, x.micro_batch_size, x.tp, x.recompute) == (y.layer, y.micro_batch_size, y.tp, y.recompute)
        for field in ("forward_time_s", "backward_time_s"):
            u, v = getattr(x, field), getattr(y, field)
            rows.setdefault((x.layer, field), []).append(abs(u - v) / min(u, v))
        total_a = x.forward_time_s + x.backward_time_s
        total_b = y.forward_time_s + y.backward_time_s
        rows.setdefault((x.layer, "fwd+bwd"), []).append(abs(total_a - total_b) / min(total_a, total_b))
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
    out = ROOT / "bench" / "results" / "profile_repeatability.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"wall_time_s": wall, "environment": a.environment, "rows": table}, indent=2) + "\n")
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
